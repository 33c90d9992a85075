#include "gpu/gpu_vmm.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "gpu/cuda_driver.h"
#include "util/array.h"
#include "util/log.h"

/* ---- the chunk walk ---------------------------------------------------- */

int mc_gpu_vmm_walk(mc_gpu_range_fn range_at, void *ctx, uint64_t addr, uint64_t len,
                    mc_gpu_chunk_t **out, size_t *n, mc_err_t *err) {
  *out = NULL;
  *n = 0;
  if (addr + len < addr)
    return mc_err_set(err, MC_EINVAL, "GPU range [0x%" PRIx64 ", +%" PRIu64 ") wraps around",
                      addr, len);
  uint64_t end = addr + (len ? len : 1);
  mc_gpu_chunk_t *v = NULL;
  size_t cnt = 0, cap = 0;
  uint64_t a = addr;
  for (;;) {
    uint64_t b = 0, s = 0;
    if (range_at(ctx, a, &b, &s) != 0 || s == 0 || b > a || a - b >= s || b + s < b) {
      free(v);
      if (cnt == 0)
        return mc_err_set(err, MC_EUNAVAIL, "0x%" PRIx64 " is not driver-mapped (cuMem) GPU "
                          "memory", addr);
      return mc_err_set(err, MC_EINVAL,
                        "GPU range [0x%" PRIx64 ", +%" PRIu64 ") is not driver-mapped memory "
                        "of one GPU throughout: nothing usable is mapped at 0x%" PRIx64
                        " (after %zu chunk(s)); register each mapped range separately",
                        addr, len, a, cnt);
    }
    mc_gpu_chunk_t *nv = mc_array_room(v, cnt, &cap, sizeof *nv, 8);
    if (!nv) {
      free(v);
      return mc_err_set(err, MC_ENOMEM, "out of memory walking GPU chunks");
    }
    v = nv;
    v[cnt].base = b;
    v[cnt].size = s;
    cnt++;
    if (b + s >= end)
      break;
    if (cnt >= MC_GPU_VMM_MAX_CHUNKS) {
      free(v);
      return mc_err_set(err, MC_EINVAL, "GPU range [0x%" PRIx64 ", +%" PRIu64 ") spans more "
                        "than %d physical chunks; register it in smaller pieces", addr, len,
                        MC_GPU_VMM_MAX_CHUNKS);
    }
    a = b + s;
  }
  *out = v;
  *n = cnt;
  return 0;
}

typedef struct {
  const mc_cuda_api_t *api;
  int device; /* of the first chunk; -1 before it */
} walk_ctx_t;

/* The physical allocation mapped at `a`: where its mapping starts and its
 * size (cuMemGetAddressRange answers per mapping for cuMem memory). */
static int real_range_at(void *vctx, uint64_t a, uint64_t *base, uint64_t *size) {
  walk_ctx_t *c = vctx;
  mc_cu_mem_handle h = 0;
  if (c->api->cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)a) != 0)
    return -1;
  mc_cu_mem_alloc_prop_t prop;
  memset(&prop, 0, sizeof prop);
  int rc = c->api->cuMemGetAllocationPropertiesFromHandle(&prop, h);
  c->api->cuMemRelease(h);
  if (rc != 0 || prop.location.type != MC_CU_MEM_LOCATION_TYPE_DEVICE)
    return -1;
  if (c->device < 0)
    c->device = prop.location.id;
  else if (c->device != prop.location.id)
    return -1;
  mc_cu_ptr b = 0;
  size_t s = 0;
  if (c->api->cuMemGetAddressRange(&b, &s, a) != 0)
    return -1;
  *base = b;
  *size = s;
  return 0;
}

static const mc_cuda_api_t *vmm_api(mc_err_t *err) {
  const mc_cuda_api_t *api = mc_cuda_api(err);
  if (!api)
    return NULL;
  if (!api->cuMemRetainAllocationHandle || !api->cuMemRelease || !api->cuMemGetAddressRange ||
      !api->cuMemGetAllocationPropertiesFromHandle) {
    mc_err_set(err, MC_EUNAVAIL, "this CUDA driver (%d) lacks the cuMem virtual memory API",
               api->driver_version);
    return NULL;
  }
  return api;
}

int mc_gpu_vmm_is_mapped(uint64_t addr) {
  const mc_cuda_api_t *api = mc_cuda_api_if_loaded();
  if (!api || !api->cuMemRetainAllocationHandle || !api->cuMemRelease)
    return 0;
  mc_cu_mem_handle h = 0;
  if (api->cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)addr) != 0)
    return 0;
  api->cuMemRelease(h);
  return 1;
}

int mc_gpu_vmm_chunks(uint64_t addr, uint64_t len, mc_gpu_chunk_t **out, size_t *n,
                      mc_err_t *err) {
  const mc_cuda_api_t *api = vmm_api(err);
  *out = NULL;
  *n = 0;
  if (!api)
    return err ? err->code : MC_EUNAVAIL;
  walk_ctx_t c = {.api = api, .device = -1};
  return mc_gpu_vmm_walk(real_range_at, &c, addr, len, out, n, err);
}

long mc_gpu_chunks_clip(const mc_gpu_chunk_t *ch, size_t n, uint64_t addr, uint64_t len,
                        uint64_t **pairs) {
  uint64_t *p = malloc((n ? n : 1) * 2 * sizeof *p);
  if (!p)
    return MC_ENOMEM;
  uint64_t end = addr + len;
  for (size_t i = 0; i < n; i++) {
    uint64_t lo = ch[i].base > addr ? ch[i].base : addr;
    uint64_t hi = ch[i].base + ch[i].size < end ? ch[i].base + ch[i].size : end;
    p[2 * i] = lo;
    p[2 * i + 1] = hi > lo ? hi - lo : 0;
  }
  *pairs = p;
  return (long)n;
}

long mc_gpu_vmm_pieces(uint64_t addr, uint64_t len, uint64_t **pairs, mc_err_t *err) {
  *pairs = NULL;
  if (!mc_gpu_vmm_is_mapped(addr))
    return 0;
  mc_gpu_chunk_t *ch = NULL;
  size_t n = 0;
  int rc = mc_gpu_vmm_chunks(addr, len, &ch, &n, err);
  if (rc < 0)
    return rc;
  long k = n > 1 ? mc_gpu_chunks_clip(ch, n, addr, len, pairs) : 0;
  free(ch);
  if (k < 0)
    return mc_err_set(err, MC_ENOMEM, "out of memory splitting GPU memory into chunks");
  return k;
}

/* ---- export: the fd server -------------------------------------------- */

typedef struct export_ent {
  uint64_t addr, len; /* as registered */
  uint64_t base, span; /* the chunks' range */
  int device;
} export_ent_t;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static export_ent_t *g_ex;
static size_t g_nex, g_capex;
static pid_t g_srv_pid; /* the process whose server runs (fork: a child starts its own) */
static char g_nonce[33]; /* the secret importers present */
static char g_tag[17];   /* names the socket: abstract names are world-readable */

#define VMM_MAGIC "MCVMM1"

typedef struct {
  char magic[8];
  int32_t status; /* 0 or an MC_E* code */
  uint32_t n;
  uint64_t span;
  char msg[240];
} vmm_hdr_t;

static void sock_name(struct sockaddr_un *sa, socklen_t *len, long pid, const char *tag) {
  memset(sa, 0, sizeof *sa);
  sa->sun_family = AF_UNIX;
  int k = snprintf(sa->sun_path + 1, sizeof sa->sun_path - 1, "mc-gpu-vmm-%ld-%s", pid, tag);
  *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)k);
}

/* Sends (sending) or receives exactly n bytes on a blocking socket: 0, or
 * -1 on an error or a peer that closed first. */
static int io_full(int fd, void *p, size_t n, int sending) {
  char *c = p;
  while (n) {
    ssize_t k = sending ? send(fd, c, n, MSG_NOSIGNAL) : recv(fd, c, n, 0);
    if (k < 0 && errno == EINTR)
      continue;
    if (k <= 0)
      return -1;
    c += k;
    n -= (size_t)k;
  }
  return 0;
}

static int send_all(int fd, const void *p, size_t n) { return io_full(fd, (void *)p, n, 1); }

static void serve_fail(int c, int code, const char *fmt, const char *arg) {
  vmm_hdr_t h;
  memset(&h, 0, sizeof h);
  memcpy(h.magic, VMM_MAGIC, sizeof VMM_MAGIC);
  h.status = code;
  snprintf(h.msg, sizeof h.msg, fmt, arg);
  send_all(c, &h, sizeof h);
}

static void serve_one(int c) {
  struct ucred cr;
  socklen_t crl = sizeof cr;
  if (getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cr, &crl) != 0 || cr.uid != getuid()) {
    serve_fail(c, MC_EAUTH, "%s", "GPU memory export refused: the importer runs as another "
               "user");
    return;
  }
  char req[128];
  size_t got = 0;
  while (got < sizeof req - 1) {
    ssize_t k = recv(c, req + got, sizeof req - 1 - got, 0);
    if (k < 0 && errno == EINTR)
      continue;
    if (k <= 0)
      return;
    got += (size_t)k;
    if (memchr(req, '\n', got))
      break;
  }
  req[got] = '\0';
  char nonce[40] = "";
  unsigned long idx = 0;
  if (sscanf(req, VMM_MAGIC " %39s %lu", nonce, &idx) != 2 || strcmp(nonce, g_nonce) != 0) {
    serve_fail(c, MC_EAUTH, "%s", "GPU memory export refused: wrong export secret");
    return;
  }
  pthread_mutex_lock(&g_mu);
  export_ent_t e = {0};
  int found = idx < g_nex;
  if (found)
    e = g_ex[idx];
  pthread_mutex_unlock(&g_mu);
  if (!found) {
    serve_fail(c, MC_ENOTFOUND, "%s", "no such GPU memory export");
    return;
  }
  mc_err_t err = {0};
  const mc_cuda_api_t *api = vmm_api(&err);
  mc_gpu_chunk_t *ch = NULL;
  size_t n = 0;
  if (!api || mc_cuda_use_device(e.device, &err) < 0 ||
      mc_gpu_vmm_chunks(e.addr, e.len, &ch, &n, &err) < 0) {
    serve_fail(c, err.code ? err.code : MC_EUNAVAIL, "%s", err.msg);
    return;
  }
  if (ch[0].base != e.base || ch[n - 1].base + ch[n - 1].size - ch[0].base != e.span) {
    free(ch);
    serve_fail(c, MC_ERANGE, "%s", "the exporter's GPU memory was remapped since it was "
               "registered");
    return;
  }
  vmm_hdr_t h;
  memset(&h, 0, sizeof h);
  memcpy(h.magic, VMM_MAGIC, sizeof VMM_MAGIC);
  h.n = (uint32_t)n;
  h.span = e.span;
  if (send_all(c, &h, sizeof h) < 0) {
    free(ch);
    return;
  }
  for (size_t i = 0; i < n; i++) {
    mc_cu_mem_handle mh = 0;
    int fd = -1;
    if (api->cuMemRetainAllocationHandle(&mh, (void *)(uintptr_t)ch[i].base) != 0)
      break;
    int r = api->cuMemExportToShareableHandle(&fd, mh, MC_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                              0);
    api->cuMemRelease(mh);
    if (r != 0)
      break; /* the importer sees the connection end early */
    uint64_t size = ch[i].size;
    struct iovec iov = {.iov_base = &size, .iov_len = sizeof size};
    union {
      char buf[CMSG_SPACE(sizeof(int))];
      struct cmsghdr align;
    } u;
    memset(&u, 0, sizeof u);
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
                       .msg_controllen = sizeof u.buf};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &fd, sizeof fd);
    ssize_t k;
    do
      k = sendmsg(c, &m, MSG_NOSIGNAL);
    while (k < 0 && errno == EINTR);
    close(fd); /* the importer holds its own copy */
    if (k != (ssize_t)sizeof size)
      break;
  }
  free(ch);
}

static void *serve(void *arg) {
  int ls = (int)(intptr_t)arg;
  for (;;) {
    int c = accept4(ls, NULL, NULL, SOCK_CLOEXEC);
    if (c < 0) {
      if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE) {
        if (errno == EMFILE || errno == ENFILE)
          usleep(10000);
        continue;
      }
      mc_log_warn("GPU memory export server stopped: accept: %s", strerror(errno));
      return NULL;
    }
    struct timeval tv = {.tv_sec = 5};
    setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(c, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    serve_one(c);
    close(c);
  }
}

/* Caller holds g_mu. */
static int start_server(mc_err_t *err) {
  if (g_srv_pid == getpid())
    return 0;
  unsigned char rnd[24];
  if (getrandom(rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd)
    return mc_err_set(err, MC_ESYS, "getrandom: %s", strerror(errno));
  for (int i = 0; i < 16; i++)
    snprintf(g_nonce + 2 * i, 3, "%02x", rnd[i]);
  for (int i = 0; i < 8; i++)
    snprintf(g_tag + 2 * i, 3, "%02x", rnd[16 + i]);
  int ls = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (ls < 0)
    return mc_err_set(err, MC_ESYS, "GPU memory export: socket: %s", strerror(errno));
  struct sockaddr_un sa;
  socklen_t sl;
  sock_name(&sa, &sl, (long)getpid(), g_tag);
  if (bind(ls, (struct sockaddr *)&sa, sl) != 0 || listen(ls, 64) != 0) {
    int en = errno;
    close(ls);
    return mc_err_set(err, MC_ESYS, "GPU memory export: cannot listen on a Unix socket: %s",
                      strerror(en));
  }
  pthread_t t;
  pthread_attr_t at;
  pthread_attr_init(&at);
  pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
  int rc = pthread_create(&t, &at, serve, (void *)(intptr_t)ls);
  pthread_attr_destroy(&at);
  if (rc != 0) {
    close(ls);
    return mc_err_set(err, MC_ESYS, "GPU memory export: cannot start its thread: %s",
                      strerror(rc));
  }
  g_nex = 0; /* a forked child does not serve its parent's exports */
  g_srv_pid = getpid();
  return 0;
}

int mc_gpu_vmm_export(uint64_t addr, uint64_t len, int device, char *name, size_t cap,
                      uint64_t *base, mc_err_t *err) {
  const mc_cuda_api_t *api = vmm_api(err);
  if (!api)
    return err ? err->code : MC_EUNAVAIL;
  if (!api->cuMemExportToShareableHandle)
    return mc_err_set(err, MC_EUNAVAIL, "this CUDA driver has no cuMemExportToShareableHandle");
  mc_gpu_chunk_t *ch = NULL;
  size_t n = 0;
  int rc = mc_gpu_vmm_chunks(addr, len, &ch, &n, err);
  if (rc < 0)
    return rc;
  /* Every chunk must export as a POSIX fd: check now, so a registration that
   * cannot be shared says so once instead of at every peer's first copy. */
  for (size_t i = 0; i < n; i++) {
    mc_cu_mem_handle mh = 0;
    mc_cu_mem_alloc_prop_t prop;
    memset(&prop, 0, sizeof prop);
    int r = api->cuMemRetainAllocationHandle(&mh, (void *)(uintptr_t)ch[i].base);
    if (r == 0)
      r = api->cuMemGetAllocationPropertiesFromHandle(&prop, mh);
    int fd = -1;
    if (r == 0 && (prop.requested_handle_types & MC_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
      r = api->cuMemExportToShareableHandle(&fd, mh, MC_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                            0);
    if (mh)
      api->cuMemRelease(mh);
    if (fd >= 0)
      close(fd);
    if (r != 0 || !(prop.requested_handle_types & MC_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
      char m[160] = "";
      if (r != 0)
        mc_cuda_strerror(api, r, m, sizeof m);
      rc = mc_err_set(
          err, MC_EUNAVAIL,
          "GPU memory at 0x%" PRIx64 " is driver-mapped (cuMem) memory of %zu physical "
          "chunk(s) whose chunk %zu %s%s: same-host peers reach it over TCP with pinned staging "
          "instead of the same-host GPU path. Allocate it with "
          "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (vLLM 0.34: the connector declares "
          "KVCacheAccess.EXPORTS_FD) or as classic cudaMalloc memory",
          addr, n, i,
          r != 0 ? "cannot be exported as a POSIX file descriptor: " : "was created without a "
                                                                       "POSIX file descriptor "
                                                                       "handle type",
          r != 0 ? m : (prop.requested_handle_types & MC_CU_MEM_HANDLE_TYPE_FABRIC
                            ? " (it has a FABRIC handle, which this connector does not import)"
                            : ""));
      free(ch);
      return rc;
    }
  }
  export_ent_t e = {.addr = addr, .len = len, .base = ch[0].base,
                    .span = ch[n - 1].base + ch[n - 1].size - ch[0].base, .device = device};
  free(ch);
  pthread_mutex_lock(&g_mu);
  rc = start_server(err);
  size_t idx = 0;
  if (rc == 0) {
    /* Every export gets a new name, never a reused one: after vLLM's sleep
     * or weight update re-commits the cache, the same addresses hold new
     * physical chunks, and a peer that mapped the old name (cached per
     * name) must see a changed descriptor and import afresh. */
    idx = g_nex;
    export_ent_t *v = mc_array_room(g_ex, g_nex, &g_capex, sizeof *v, 16);
    if (!v)
      rc = mc_err_set(err, MC_ENOMEM, "out of memory exporting GPU memory");
    else {
      g_ex = v;
      g_ex[g_nex++] = e;
    }
  }
  if (rc == 0 && (size_t)snprintf(name, cap, MC_GPU_VMM_PREFIX "%ld:%s:%s:%zu", (long)getpid(),
                                  g_tag, g_nonce, idx) >= cap)
    rc = mc_err_set(err, MC_EINVAL, "GPU memory export name too long");
  pthread_mutex_unlock(&g_mu);
  if (rc == 0)
    *base = e.base;
  return rc;
}

/* ---- import ------------------------------------------------------------ */

static int recv_full(int s, void *p, size_t n) { return io_full(s, p, n, 0); }

/* One chunk message: its size and fd.  -1 on a short or malformed one. */
static int recv_chunk(int s, uint64_t *size, int *fd) {
  union {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } u;
  struct iovec iov = {.iov_base = size, .iov_len = sizeof *size};
  struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
                     .msg_controllen = sizeof u.buf};
  ssize_t k;
  do
    k = recvmsg(s, &m, MSG_CMSG_CLOEXEC | MSG_WAITALL);
  while (k < 0 && errno == EINTR);
  *fd = -1;
  struct cmsghdr *cm = k > 0 ? CMSG_FIRSTHDR(&m) : NULL;
  if (cm && cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS &&
      cm->cmsg_len == CMSG_LEN(sizeof(int)))
    memcpy(fd, CMSG_DATA(cm), sizeof *fd);
  if (k != (ssize_t)sizeof *size || (m.msg_flags & MSG_CTRUNC) || *fd < 0) {
    if (*fd >= 0)
      close(*fd);
    *fd = -1;
    return -1;
  }
  return 0;
}

/* Unmaps the first n chunks (sizes[i] bytes each, back to back from va) and
 * frees the reserved range of `span` bytes (va 0: none reserved): a failed
 * import's rollback and mc_gpu_vmm_unimport.  The imported handles were
 * released once mapped, so the last unmap frees the physical memory (once
 * the exporter let go of it too).  0, or the first failing call's result. */
static int unmap_chunks(const mc_cuda_api_t *api, mc_cu_ptr va, const uint64_t *sizes,
                        uint32_t n, uint64_t span) {
  int first = 0;
  uint64_t off = 0;
  for (uint32_t i = 0; i < n; i++) {
    int r = api->cuMemUnmap(va + off, sizes[i]);
    if (r != 0 && first == 0)
      first = r;
    off += sizes[i];
  }
  if (va) {
    int r = api->cuMemAddressFree(va, span);
    if (r != 0 && first == 0)
      first = r;
  }
  return first;
}

/* What mc_gpu_vmm_unimport needs of each import: its chunks' sizes. */
typedef struct {
  uint64_t va, span;
  uint32_t n;
  uint64_t *sizes; /* malloc'ed */
} import_ent_t;
static import_ent_t *g_im;
static size_t g_nim, g_capim;

/* Under g_mu: remembers import va (takes over sizes); -1 out of memory. */
static int import_remember(uint64_t va, uint64_t span, uint32_t n, uint64_t *sizes) {
  import_ent_t *v = mc_array_room(g_im, g_nim, &g_capim, sizeof *v, 8);
  if (!v)
    return -1;
  g_im = v;
  g_im[g_nim++] = (import_ent_t){.va = va, .span = span, .n = n, .sizes = sizes};
  return 0;
}

int mc_gpu_vmm_unimport(uint64_t mapped, mc_err_t *err) {
  pthread_mutex_lock(&g_mu);
  import_ent_t e = {0};
  for (size_t i = 0; i < g_nim; i++)
    if (g_im[i].va == mapped) {
      e = g_im[i];
      g_im[i] = g_im[--g_nim];
      break;
    }
  pthread_mutex_unlock(&g_mu);
  if (!e.va)
    return mc_err_set(err, MC_EINVAL, "0x%" PRIx64 " is no GPU memory import of this process",
                      mapped);
  const mc_cuda_api_t *api = vmm_api(err);
  int r = api ? unmap_chunks(api, e.va, e.sizes, e.n, e.span) : 0;
  free(e.sizes);
  if (!api)
    return err ? err->code : MC_EUNAVAIL;
  if (r != 0) {
    char m[160];
    return mc_err_set(err, MC_EUNAVAIL, "cannot unmap the imported GPU memory at 0x%" PRIx64
                      ": %s", mapped, mc_cuda_strerror(api, r, m, sizeof m));
  }
  return 0;
}

int mc_gpu_vmm_import(const char *name, int device, uint64_t *mapped, mc_err_t *err) {
  long pid = 0;
  char nonce[40] = "", tag[24] = "";
  unsigned long idx = 0;
  int used = 0;
  if (strncmp(name, MC_GPU_VMM_PREFIX, strlen(MC_GPU_VMM_PREFIX)) != 0 ||
      sscanf(name + strlen(MC_GPU_VMM_PREFIX), "%ld:%16[0-9a-f]:%32[0-9a-f]:%lu%n", &pid, tag,
             nonce, &idx, &used) != 4 ||
      name[strlen(MC_GPU_VMM_PREFIX) + (size_t)used] != '\0' || pid <= 0 ||
      strlen(nonce) != 32 || strlen(tag) != 16)
    return mc_err_set(err, MC_EINVAL, "malformed GPU memory export \"%.40s\" in a peer's "
                      "segment descriptor", name);
  const mc_cuda_api_t *api = vmm_api(err);
  if (!api)
    return err ? err->code : MC_EUNAVAIL;
  if (!api->cuMemImportFromShareableHandle || !api->cuMemAddressReserve || !api->cuMemMap ||
      !api->cuMemSetAccess || !api->cuMemUnmap || !api->cuMemAddressFree)
    return mc_err_set(err, MC_EUNAVAIL, "this CUDA driver lacks cuMem import/map calls");
  int rc = mc_cuda_use_device(device, err);
  if (rc < 0)
    return rc;
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0)
    return mc_err_set(err, MC_ESYS, "socket: %s", strerror(errno));
  struct timeval tv = {.tv_sec = 10};
  setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  struct sockaddr_un sa;
  socklen_t sl;
  sock_name(&sa, &sl, pid, tag);
  char req[96];
  int rl = snprintf(req, sizeof req, VMM_MAGIC " %s %lu\n", nonce, idx);
  vmm_hdr_t h;
  if (connect(s, (struct sockaddr *)&sa, sl) != 0) {
    int en = errno;
    close(s);
    return mc_err_set(err, MC_EUNAVAIL, "cannot reach the GPU memory export of process %ld: "
                      "%s (it must run on this host, in this network namespace)",
                      pid, strerror(en));
  }
  if (send_all(s, req, (size_t)rl) < 0 || recv_full(s, &h, sizeof h) < 0 ||
      memcmp(h.magic, VMM_MAGIC, sizeof VMM_MAGIC) != 0) {
    close(s);
    return mc_err_set(err, MC_EPROTO, "GPU memory export of process %ld: no valid answer", pid);
  }
  h.msg[sizeof h.msg - 1] = '\0';
  if (h.status != 0) {
    close(s);
    return mc_err_set(err, MC_EUNAVAIL, "GPU memory export of process %ld: %s", pid, h.msg);
  }
  if (h.n == 0 || h.n > MC_GPU_VMM_MAX_CHUNKS || h.span == 0) {
    close(s);
    return mc_err_set(err, MC_EPROTO, "GPU memory export of process %ld: %u chunk(s) of %" PRIu64
                      " bytes", pid, h.n, h.span);
  }
  mc_cu_mem_handle *hs = calloc(h.n, sizeof *hs);
  uint64_t *sizes = calloc(h.n, sizeof *sizes);
  if (!hs || !sizes) {
    free(hs);
    free(sizes);
    close(s);
    return mc_err_set(err, MC_ENOMEM, "out of memory importing GPU memory");
  }
  uint32_t got = 0;
  uint64_t total = 0;
  char m[160];
  rc = 0;
  for (; got < h.n; got++) {
    int fd = -1;
    if (recv_chunk(s, &sizes[got], &fd) < 0 || sizes[got] == 0 ||
        sizes[got] > h.span - total) {
      rc = mc_err_set(err, MC_EPROTO, "GPU memory export of process %ld: chunk %u of %u "
                      "missing or malformed (the exporter could not export it)", pid, got, h.n);
      break;
    }
    int r = api->cuMemImportFromShareableHandle(&hs[got], (void *)(intptr_t)fd,
                                                MC_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    close(fd);
    if (r != 0) {
      rc = mc_err_set(err, MC_EUNAVAIL, "cannot import chunk %u of process %ld's GPU memory: %s",
                      got, pid, mc_cuda_strerror(api, r, m, sizeof m));
      break;
    }
    total += sizes[got];
  }
  close(s);
  if (rc == 0 && total != h.span)
    rc = mc_err_set(err, MC_EPROTO, "GPU memory export of process %ld: chunks of %" PRIu64
                    " bytes for a span of %" PRIu64, pid, total, h.span);
  mc_cu_ptr va = 0;
  uint32_t nmapped = 0;
  if (rc == 0) {
    size_t align = 0;
    mc_cu_mem_alloc_prop_t prop;
    memset(&prop, 0, sizeof prop);
    if (api->cuMemGetAllocationGranularity &&
        api->cuMemGetAllocationPropertiesFromHandle(&prop, hs[0]) == 0)
      api->cuMemGetAllocationGranularity(&align, &prop, MC_CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    int r = api->cuMemAddressReserve(&va, h.span, align, 0, 0);
    if (r != 0)
      rc = mc_err_set(err, MC_EUNAVAIL, "cannot reserve %" PRIu64 " bytes of GPU address "
                      "space: %s", h.span, mc_cuda_strerror(api, r, m, sizeof m));
  }
  uint64_t off = 0;
  for (; rc == 0 && nmapped < h.n; nmapped++) {
    int r = api->cuMemMap(va + off, sizes[nmapped], 0, hs[nmapped], 0);
    if (r != 0) {
      rc = mc_err_set(err, MC_EUNAVAIL, "cannot map chunk %u of process %ld's GPU memory: %s",
                      nmapped, pid, mc_cuda_strerror(api, r, m, sizeof m));
      break;
    }
    off += sizes[nmapped];
  }
  if (rc == 0) {
    mc_cu_mem_access_desc_t d = {.location = {MC_CU_MEM_LOCATION_TYPE_DEVICE, device},
                                 .flags = MC_CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    int r = api->cuMemSetAccess(va, h.span, &d, 1);
    if (r != 0)
      rc = mc_err_set(err, MC_EUNAVAIL, "cannot give cuda:%d access to process %ld's GPU "
                      "memory: %s", device, pid, mc_cuda_strerror(api, r, m, sizeof m));
  }
  if (rc == 0) { /* for mc_gpu_vmm_unimport */
    pthread_mutex_lock(&g_mu);
    if (import_remember(va, h.span, h.n, sizes) == 0)
      sizes = NULL;
    else
      rc = mc_err_set(err, MC_ENOMEM, "out of memory importing GPU memory");
    pthread_mutex_unlock(&g_mu);
  }
  if (rc < 0)
    unmap_chunks(api, va, sizes, nmapped, h.span);
  /* The mappings hold the memory; our handles are no longer needed. */
  for (uint32_t i = 0; i < got && i < h.n; i++)
    if (hs[i])
      api->cuMemRelease(hs[i]);
  free(hs);
  free(sizes);
  if (rc == 0)
    *mapped = va;
  return rc;
}
