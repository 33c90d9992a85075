/* Test fixture: a host-memory stand-in for libcuda.so.1, built as
 * build/fakecuda/libcuda.so.1 and loaded by tests that run without a GPU
 * (LD_LIBRARY_PATH; tests/c/test_gate.c, tests/test_gated_write.py).
 * "Device" memory is malloc'ed and tracked, launches of the copy kernel copy
 * on the CPU at launch, and a stream reports NOT_READY until LAT_NS after its
 * last launch, so completion polling paths are exercised.  For the tests:
 * fakecuda_stream_hold(stream, ns) makes the stream busy for ns more
 * nanoseconds (an event recorded on it then completes that much later), and
 * cuEventSynchronize sleeps in 50 us steps (a blocking-sync event) instead
 * of spinning.
 * CUDA IPC across processes: every cuMemAlloc is a memfd mapped shared, its
 * cuIpcGetMemHandle names the exporter's pid and fd, and cuIpcOpenMemHandle
 * maps /proc/<pid>/fd/<fd> here (the same-host GPU path's job build, queue,
 * copy thread and completion run as on a GPU; the copies are host memcpy).
 * fakecuda_ipc_opens() counts the handles opened in this process,
 * fakecuda_ipc_open_now() those open now (opened, not yet closed).
 * fakecuda_set_latency_ns(ns) makes every later copy complete ns after its
 * launch and, from then on, tracks which imported allocations copies use:
 * a cuIpcCloseMemHandle before the last copy using one completed (what a
 * GPU would fault on) is counted by fakecuda_ipc_closes_in_use().
 * Driver-mapped memory (cuMem*: vLLM 0.34's KV cache): cuMemCreate makes a
 * memfd, exported as a dup of it (POSIX fd handles only), imported from
 * one; cuMemAddressReserve reserves address space, cuMemMap maps a handle's
 * memfd there (one tracked mapping: cuMemGetAddressRange answers per
 * mapping, as the driver does), cuMemUnmap puts the reservation back (a
 * copy still using it counts as above).  fakecuda_vmm_imports_mapped()
 * counts the mappings of imported handles open now. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <sys/stat.h>
#include <pthread.h>
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define LAT_NS 20000ull
typedef int CUresult;
static __thread void *cur_ctx;
static int the_ctx;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
/* imported: 0 cuMemAlloc, 1 an opened IPC handle, 2 a cuMemMap mapping (h). */
typedef struct memh memh_t;
typedef struct { uint64_t lo, hi; int fd; int imported; uint64_t busy_until; memh_t *h; } alloc_t;
static alloc_t allocs[1024];
static int nallocs;
static uint64_t now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1000000000ull + t.tv_nsec; }
typedef struct { uint64_t ready; } stream_t;
typedef struct { uint64_t ready; int fail; } event_t; /* fail: fakecuda_event_fail */
static stream_t null_stream;
#define ST(s) ((s) ? (stream_t *)(s) : &null_stream)
static uint64_t lat_ns = LAT_NS;
static int track_busy; /* fakecuda_set_latency_ns was called */
static int closes_in_use;
static void bump(void *s) { __atomic_store_n(&ST(s)->ready, now() + __atomic_load_n(&lat_ns, __ATOMIC_SEQ_CST), __ATOMIC_SEQ_CST); }
void fakecuda_set_latency_ns(uint64_t ns) { __atomic_store_n(&lat_ns, ns, __ATOMIC_SEQ_CST); __atomic_store_n(&track_busy, 1, __ATOMIC_SEQ_CST); }
int fakecuda_ipc_closes_in_use(void) { return __atomic_load_n(&closes_in_use, __ATOMIC_SEQ_CST); }
/* A copy launched now uses [a, a+n): an imported allocation there is busy
 * until the copy completes. */
static void touch(uint64_t a, uint64_t n) {
  if (!__atomic_load_n(&track_busy, __ATOMIC_SEQ_CST) || !n)
    return;
  uint64_t until = now() + __atomic_load_n(&lat_ns, __ATOMIC_SEQ_CST);
  pthread_mutex_lock(&mu);
  for (int i = 0; i < nallocs; i++)
    if (allocs[i].imported && a < allocs[i].hi && a + n > allocs[i].lo && allocs[i].busy_until < until)
      allocs[i].busy_until = until;
  pthread_mutex_unlock(&mu);
}
static void copy_launched(uint64_t d, uint64_t s, uint64_t n) {
  memmove((void *)(uintptr_t)d, (void *)(uintptr_t)s, n);
  touch(d, n);
  touch(s, n);
}

CUresult cuInit(unsigned f) { (void)f; return 0; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return 0; }
CUresult cuDeviceGet(int *d, int o) { *d = o; return o == 0 ? 0 : 101; }
CUresult cuDriverGetVersion(int *v) { *v = 12000; return 0; }
CUresult cuDeviceGetAttribute(int *v, int a, int d) { (void)a; (void)d; *v = 0; return 0; }
CUresult cuGetErrorName(CUresult r, const char **s) { (void)r; *s = "FAKE_ERROR"; return 0; }
CUresult cuGetErrorString(CUresult r, const char **s) { (void)r; *s = "fake error"; return 0; }
CUresult cuDevicePrimaryCtxRetain(void **c, int d) { (void)d; *c = &the_ctx; return 0; }
CUresult cuCtxSetCurrent(void *c) { cur_ctx = c; return 0; }
CUresult cuCtxGetCurrent(void **c) { *c = cur_ctx; return 0; }
static int find(uint64_t a, alloc_t *out) {
  pthread_mutex_lock(&mu);
  int k = -1;
  for (int i = 0; i < nallocs; i++) if (a >= allocs[i].lo && a < allocs[i].hi) { k = i; *out = allocs[i]; }
  pthread_mutex_unlock(&mu);
  return k;
}
static int track(void *m, size_t n, int fd, int imported) {
  pthread_mutex_lock(&mu);
  int ok = nallocs < (int)(sizeof allocs / sizeof allocs[0]);
  if (ok)
    allocs[nallocs++] = (alloc_t){(uint64_t)(uintptr_t)m, (uint64_t)(uintptr_t)m + n, fd, imported, 0, NULL};
  pthread_mutex_unlock(&mu);
  return ok;
}
CUresult cuMemAlloc_v2(uint64_t *p, size_t n) {
  int fd = memfd_create("fakecuda", MFD_CLOEXEC);
  void *m = MAP_FAILED;
  if (fd >= 0 && ftruncate(fd, (off_t)n) == 0)
    m = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED || !track(m, n, fd, 0)) {
    if (m != MAP_FAILED)
      munmap(m, n);
    if (fd >= 0)
      close(fd);
    return 2;
  }
  *p = (uint64_t)(uintptr_t)m;
  return 0;
}
/* Forgets the allocation at p (imported: 1 for an opened IPC handle). */
static int untrack(uint64_t p, int imported) {
  alloc_t a = {0, 0, -1, 0, 0, NULL};
  pthread_mutex_lock(&mu);
  for (int i = 0; i < nallocs; i++)
    if (allocs[i].lo == p && allocs[i].imported == imported) {
      a = allocs[i];
      if (imported && now() < a.busy_until)
        closes_in_use++;
      allocs[i] = allocs[--nallocs];
      break;
    }
  pthread_mutex_unlock(&mu);
  if (!a.lo)
    return 1;
  munmap((void *)(uintptr_t)a.lo, a.hi - a.lo);
  if (a.fd >= 0)
    close(a.fd);
  return 0;
}
CUresult cuMemFree_v2(uint64_t p) { return untrack(p, 0); }
typedef struct { char data[64]; } ipc_handle_t;
typedef struct { uint32_t magic; int32_t fd; int64_t pid; uint64_t len; } ipc_wire_t;
#define IPC_MAGIC 0xfacecda1u
static int ipc_opens;
int fakecuda_ipc_opens(void) { return __atomic_load_n(&ipc_opens, __ATOMIC_SEQ_CST); }
int fakecuda_ipc_open_now(void) {
  pthread_mutex_lock(&mu);
  int k = 0;
  for (int i = 0; i < nallocs; i++)
    k += allocs[i].imported == 1;
  pthread_mutex_unlock(&mu);
  return k;
}
CUresult cuIpcGetMemHandle(ipc_handle_t *h, uint64_t p) {
  pthread_mutex_lock(&mu);
  int k = -1;
  for (int i = 0; i < nallocs; i++)
    if (allocs[i].lo == p && !allocs[i].imported) k = i;
  ipc_wire_t w = {IPC_MAGIC, k >= 0 ? allocs[k].fd : -1, (int64_t)getpid(),
                  k >= 0 ? allocs[k].hi - allocs[k].lo : 0};
  pthread_mutex_unlock(&mu);
  if (k < 0)
    return 1; /* CUDA_ERROR_INVALID_VALUE: not the start of an allocation */
  memset(h, 0, sizeof *h);
  memcpy(h->data, &w, sizeof w);
  return 0;
}
CUresult cuIpcOpenMemHandle_v2(uint64_t *p, ipc_handle_t h, unsigned flags) {
  (void)flags;
  ipc_wire_t w;
  memcpy(&w, h.data, sizeof w);
  if (w.magic != IPC_MAGIC)
    return 1;
  if (w.pid == (int64_t)getpid())
    return 1; /* the driver refuses opening one's own handle */
  char path[64];
  snprintf(path, sizeof path, "/proc/%lld/fd/%d", (long long)w.pid, (int)w.fd);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0)
    return 1;
  void *m = mmap(NULL, w.len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED)
    return 2;
  if (!track(m, w.len, -1, 1)) {
    munmap(m, w.len);
    return 2;
  }
  __atomic_add_fetch(&ipc_opens, 1, __ATOMIC_SEQ_CST);
  *p = (uint64_t)(uintptr_t)m;
  return 0;
}
CUresult cuIpcCloseMemHandle(uint64_t p) { return untrack(p, 1); }
CUresult cuPointerGetAttribute(void *data, int attr, uint64_t p) {
  alloc_t a;
  if (find(p, &a) < 0) return 1; /* CUDA_ERROR_INVALID_VALUE: not ours */
  switch (attr) {
  case 2: *(unsigned *)data = 2; return 0;
  case 9: *(int *)data = 0; return 0;
  case 11: *(uint64_t *)data = a.lo; return 0;
  case 12: *(size_t *)data = a.hi - a.lo; return 0;
  case 1: *(void **)data = &the_ctx; return 0;
  default: return 1;
  }
}
CUresult cuMemGetAddressRange_v2(uint64_t *b, size_t *n, uint64_t p) {
  alloc_t a;
  if (find(p, &a) < 0) return 1;
  if (b) *b = a.lo;
  if (n) *n = a.hi - a.lo;
  return 0;
}
CUresult cuMemcpyHtoD_v2(uint64_t d, const void *s, size_t n) { memcpy((void *)(uintptr_t)d, s, n); return 0; }
CUresult cuMemcpyDtoH_v2(void *d, uint64_t s, size_t n) { memcpy(d, (void *)(uintptr_t)s, n); return 0; }
CUresult cuMemcpy(uint64_t d, uint64_t s, size_t n) { memmove((void *)(uintptr_t)d, (void *)(uintptr_t)s, n); return 0; }
CUresult cuMemcpyAsync(uint64_t d, uint64_t s, size_t n, void *st) { copy_launched(d, s, n); bump(st); return 0; }
CUresult cuMemcpyHtoDAsync_v2(uint64_t d, const void *s, size_t n, void *st) { memcpy((void *)(uintptr_t)d, s, n); bump(st); return 0; }
CUresult cuMemcpyDtoHAsync_v2(void *d, uint64_t s, size_t n, void *st) { memcpy(d, (void *)(uintptr_t)s, n); bump(st); return 0; }
CUresult cuStreamCreate(void **s, unsigned f) { (void)f; *s = calloc(1, sizeof(stream_t)); return 0; }
CUresult cuStreamDestroy_v2(void *s) { free(s); return 0; }
CUresult cuStreamSynchronize(void *s) { while (now() < __atomic_load_n(&ST(s)->ready, __ATOMIC_SEQ_CST)) ; return 0; }
CUresult cuStreamQuery(void *s) { return now() < __atomic_load_n(&ST(s)->ready, __ATOMIC_SEQ_CST) ? 600 : 0; }
CUresult cuEventCreate(void **e, unsigned f) { (void)f; *e = calloc(1, sizeof(event_t)); return 0; }
CUresult cuEventDestroy_v2(void *e) { free(e); return 0; }
CUresult cuEventRecord(void *e, void *s) { __atomic_store_n(&((event_t *)e)->ready, __atomic_load_n(&ST(s)->ready, __ATOMIC_SEQ_CST), __ATOMIC_SEQ_CST); return 0; }
CUresult cuEventQuery(void *e) { return now() < ((event_t *)e)->ready ? 600 : ((event_t *)e)->fail ? 999 : 0; }
CUresult cuEventSynchronize(void *e) {
  struct timespec ts = {0, 50000};
  while (now() < __atomic_load_n(&((event_t *)e)->ready, __ATOMIC_SEQ_CST))
    nanosleep(&ts, NULL);
  return __atomic_load_n(&((event_t *)e)->fail, __ATOMIC_SEQ_CST) ? 999 : 0;
}
/* The event's wait fails (999, CUDA_ERROR_UNKNOWN) once it completes. */
void fakecuda_event_fail(void *e) { __atomic_store_n(&((event_t *)e)->fail, 1, __ATOMIC_SEQ_CST); }
CUresult cuEventElapsedTime(float *ms, void *a, void *b) {
  *ms = (float)((double)(int64_t)(((event_t *)b)->ready - ((event_t *)a)->ready) / 1e6);
  return 0;
}
void fakecuda_stream_hold(void *s, uint64_t ns) {
  __atomic_store_n(&ST(s)->ready, now() + ns, __ATOMIC_SEQ_CST);
}
CUresult cuMemHostAlloc(void **p, size_t n, unsigned f) { (void)f; *p = malloc(n); return *p ? 0 : 2; }
CUresult cuMemFreeHost(void *p) { free(p); return 0; }
/* The copy kernel: module/function handles name the entry point. */
static char mod_tag;
static char fn_pieces, fn_p, fn_p8;
CUresult cuModuleLoadData(void **m, const void *img) { (void)img; *m = &mod_tag; return 0; }
CUresult cuModuleGetFunction(void **f, void *m, const char *name) {
  (void)m;
  *f = !strcmp(name, "mc_copy_pieces") ? (void *)&fn_pieces : !strcmp(name, "mc_copy_reqs_p") ? (void *)&fn_p
     : !strcmp(name, "mc_copy_reqs_p8") ? (void *)&fn_p8 : NULL;
  return *f ? 0 : 500;
}
#define PRS(N) struct { uint64_t dst[N], src[N], len[N]; uint32_t first[N + 1]; uint32_t n; }
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned sh, void *st, void **params, void **extra) {
  (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)sh; (void)extra;
  if (f == &fn_p) {
    PRS(128) *p = params[0];
    for (uint32_t i = 0; i < p->n; i++) copy_launched(p->dst[i], p->src[i], p->len[i]);
  } else if (f == &fn_p8) {
    PRS(8) *p = params[0];
    for (uint32_t i = 0; i < p->n; i++) copy_launched(p->dst[i], p->src[i], p->len[i]);
  } else if (f == &fn_pieces) {
    uint64_t *t = (uint64_t *)(uintptr_t)*(uint64_t *)params[0];
    unsigned n = *(unsigned *)params[1];
    for (unsigned i = 0; i < n; i++) copy_launched(t[3 * i], t[3 * i + 1], t[3 * i + 2]);
  } else {
    return 400;
  }
  bump(st);
  return 0;
}

/* ---- driver-mapped memory (cuMem*) ---- */
struct memh { int fd; uint64_t size; int types, dev, imported, refs; };
static void memh_put(memh_t *h) {
  pthread_mutex_lock(&mu);
  int last = --h->refs == 0;
  pthread_mutex_unlock(&mu);
  if (last) {
    close(h->fd);
    free(h);
  }
}
typedef struct { int type, types, loc_type, loc_id; } prop_head_t; /* CUmemAllocationProp's start */
CUresult cuMemCreate(unsigned long long *out, size_t size, const prop_head_t *prop, unsigned long long f) {
  (void)f;
  memh_t *h = calloc(1, sizeof *h);
  int fd = memfd_create("fakecuda-cumem", MFD_CLOEXEC);
  if (!h || fd < 0 || ftruncate(fd, (off_t)size) != 0) {
    free(h);
    if (fd >= 0) close(fd);
    return 2;
  }
  *h = (memh_t){fd, size, prop->types, prop->loc_id, 0, 1};
  *out = (unsigned long long)(uintptr_t)h;
  return 0;
}
CUresult cuMemRelease(unsigned long long h) { memh_put((memh_t *)(uintptr_t)h); return 0; }
CUresult cuMemRetainAllocationHandle(unsigned long long *out, void *addr) {
  uint64_t a = (uint64_t)(uintptr_t)addr;
  memh_t *h = NULL;
  pthread_mutex_lock(&mu);
  for (int i = 0; i < nallocs && !h; i++)
    if (allocs[i].imported == 2 && a >= allocs[i].lo && a < allocs[i].hi) {
      h = allocs[i].h;
      h->refs++;
    }
  pthread_mutex_unlock(&mu);
  if (!h) return 1; /* not driver-mapped memory */
  *out = (unsigned long long)(uintptr_t)h;
  return 0;
}
CUresult cuMemGetAllocationPropertiesFromHandle(prop_head_t *prop, unsigned long long hh) {
  memh_t *h = (memh_t *)(uintptr_t)hh;
  memset(prop, 0, sizeof *prop);
  prop->type = 1;
  prop->types = h->types;
  prop->loc_type = 1;
  prop->loc_id = h->dev;
  return 0;
}
CUresult cuMemGetAllocationGranularity(size_t *g, const void *prop, int opt) { (void)prop; (void)opt; *g = 4096; return 0; }
CUresult cuMemExportToShareableHandle(void *out, unsigned long long hh, int type, unsigned long long f) {
  (void)f;
  memh_t *h = (memh_t *)(uintptr_t)hh;
  if (type != 1 || !(h->types & 1)) return 1;
  int fd = fcntl(h->fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return 2;
  *(int *)out = fd;
  return 0;
}
CUresult cuMemImportFromShareableHandle(unsigned long long *out, void *shareable, int type) {
  int fd = (int)(intptr_t)shareable;
  struct stat st;
  memh_t *h = type == 1 && fstat(fd, &st) == 0 ? calloc(1, sizeof *h) : NULL;
  int mine = h ? fcntl(fd, F_DUPFD_CLOEXEC, 0) : -1;
  if (mine < 0) {
    free(h);
    return 1;
  }
  *h = (memh_t){mine, (uint64_t)st.st_size, 1, 0, 1, 1};
  *out = (unsigned long long)(uintptr_t)h;
  return 0;
}
CUresult cuMemAddressReserve(uint64_t *p, size_t size, size_t align, uint64_t addr, unsigned long long f) {
  (void)align; (void)addr; (void)f;
  void *m = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return 2;
  *p = (uint64_t)(uintptr_t)m;
  return 0;
}
CUresult cuMemAddressFree(uint64_t p, size_t size) { return munmap((void *)(uintptr_t)p, size) ? 1 : 0; }
CUresult cuMemMap(uint64_t p, size_t size, size_t off, unsigned long long hh, unsigned long long f) {
  (void)f;
  memh_t *h = (memh_t *)(uintptr_t)hh;
  if (off + size > h->size) return 1;
  void *m = mmap((void *)(uintptr_t)p, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, h->fd, (off_t)off);
  if (m == MAP_FAILED) return 2;
  pthread_mutex_lock(&mu);
  int ok = nallocs < (int)(sizeof allocs / sizeof allocs[0]);
  if (ok) {
    allocs[nallocs++] = (alloc_t){p, p + size, -1, 2, 0, h};
    h->refs++;
  }
  pthread_mutex_unlock(&mu);
  return ok ? 0 : 2;
}
CUresult cuMemUnmap(uint64_t p, size_t size) {
  memh_t *gone[64];
  int n = 0;
  pthread_mutex_lock(&mu);
  for (int i = 0; i < nallocs;)
    if (allocs[i].imported == 2 && allocs[i].lo >= p && allocs[i].hi <= p + size && n < 64) {
      if (now() < allocs[i].busy_until)
        closes_in_use++;
      gone[n++] = allocs[i].h;
      allocs[i] = allocs[--nallocs];
    } else {
      i++;
    }
  pthread_mutex_unlock(&mu);
  if (!n) return 1;
  mmap((void *)(uintptr_t)p, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  for (int i = 0; i < n; i++)
    memh_put(gone[i]);
  return 0;
}
CUresult cuMemSetAccess(uint64_t p, size_t size, const void *desc, size_t count) { (void)p; (void)size; (void)desc; (void)count; return 0; }
int fakecuda_vmm_imports_mapped(void) {
  pthread_mutex_lock(&mu);
  int k = 0;
  for (int i = 0; i < nallocs; i++)
    k += allocs[i].imported == 2 && allocs[i].h->imported;
  pthread_mutex_unlock(&mu);
  return k;
}
