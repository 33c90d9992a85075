/* Issue 30: the same-host GPU path's fixed cost, our half of
 * benchmarks/gpu_fixed_cost_bench.py (which runs torch's reference in the
 * same run and prints the ratios).  Two processes on cuda:0 (the target
 * forked before CUDA starts), classic cuMemAlloc memory, 1 GiB each; the
 * target also registers 63 more regions of 16 MiB (a vLLM worker registers
 * one per layer).  Prints one JSON object per line:
 *   - 4 KiB WRITE / READ through the engine, submit + wait, p50/p90/p99, and
 *     when mc_batch_submit returned (p50);
 *   - 1 GiB as shuffled blocks (local block i -> remote block perm[i]) of
 *     64 KiB and 2 MiB, in batches of B requests: "seq" submits a batch and
 *     waits for it before the next, "pipe" submits every batch of the pass
 *     and then waits for all; best and median of the passes; the bytes are
 *     checked block by block (the target hashes its memory);
 *   - the permutations, written to <dir>/perm_<block bytes>.u32 for the
 *     torch reference.
 *     build/bench/gpu_fixed_cost <dir> [iterations] [passes]   (needs a GPU) */
#include <dirent.h>
#include <dlfcn.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "engine/engine.h"
#include "engine/engine_internal.h"
#include "gpu/cuda_driver.h"
#include "gpu/gpu_copy_kernel.h"
#include "gpu/gpu_ipc.h"
#include "gpu/gpu_staging.h"
#include "gpu_bench_util.h"

#define GIB (1ull << 30)
#define NEXTRA 63
#define EXTRA (16ull << 20)

static double pct(double *v, int n, double p) {
  qsort(v, (size_t)n, sizeof *v, cmp_d);
  return v[(int)(p * (n - 1) + 0.5)];
}

static int read_full(int fd, void *p, size_t n) {
  for (size_t got = 0; got < n;) {
    ssize_t r = read(fd, (char *)p + got, n - got);
    if (r <= 0)
      return -1;
    got += (size_t)r;
  }
  return 0;
}

static int write_full(int fd, const void *p, size_t n) {
  for (size_t put = 0; put < n;) {
    ssize_t r = write(fd, (const char *)p + put, n - put);
    if (r <= 0)
      return -1;
    put += (size_t)r;
  }
  return 0;
}

/* Hash of each bb-byte block of a device buffer of n bytes. */
static uint64_t *hash_blocks(uint64_t dev, size_t n, size_t bb) {
  uint8_t *h = malloc(n);
  uint64_t *out = malloc(n / bb * sizeof *out);
  if (!h || !out || api->cuMemcpyDtoH(h, dev, n) != 0) {
    free(h);
    free(out);
    return NULL;
  }
  for (size_t i = 0; i < n / bb; i++)
    out[i] = XXH3_64bits(h + i * bb, bb);
  free(h);
  return out;
}

static int zero_dev(uint64_t dev, size_t n) {
  void *z = calloc(1, n);
  int rc = z ? api->cuMemcpyHtoD(dev, z, n) : -1;
  free(z);
  return rc;
}

typedef struct {
  char segment[256];
  uint64_t addr;
  char ipc[MC_GPU_IPC_B64_MAX]; /* the 1 GiB region's export (MC_GPU_DIAG's probe) */
  int ok;
} info_t;

static void child(int wfd, int rfd) {
  info_t in;
  memset(&in, 0, sizeof in);
  mc_engine_opts_t o = {.local_hostname = "127.0.0.1", .metadata_server = "P2PHANDSHAKE"};
  mc_engine_t *B = NULL;
  mc_err_t err = {0};
  if (!gpu_up() || mc_engine_create(&o, &B, &err) < 0 || cu_alloc(&in.addr, GIB) != 0 ||
      mc_engine_register(B, (void *)(uintptr_t)in.addr, GIB, "cuda:0", &err) < 0) {
    (void)!write(wfd, &in, sizeof in);
    _exit(0);
  }
  for (int i = 0; i < NEXTRA; i++) {
    uint64_t a = 0;
    if (cu_alloc(&a, EXTRA) != 0 ||
        mc_engine_register(B, (void *)(uintptr_t)a, EXTRA, "cuda:0", &err) < 0)
      _exit(3);
  }
  snprintf(in.segment, sizeof in.segment, "%s", mc_engine_segment_name(B));
  uint64_t base = 0;
  if (mc_gpu_ipc_export(in.addr, in.ipc, &base, &err) < 0)
    in.ipc[0] = '\0';
  in.ok = 1;
  (void)!write(wfd, &in, sizeof in);
  /* 'h' + block size (u64): the hashes of our region's blocks; 'z': zero it. */
  char c;
  while (read(rfd, &c, 1) == 1) {
    if (c == 'h') {
      uint64_t bb = 0;
      if (read_full(rfd, &bb, sizeof bb) < 0)
        break;
      uint64_t *h = hash_blocks(in.addr, GIB, bb);
      if (!h || write_full(wfd, h, GIB / bb * sizeof *h) < 0)
        _exit(5);
      free(h);
    } else if (c == 'z') {
      zero_dev(in.addr, GIB);
      (void)!write(wfd, &c, 1);
    }
  }
  mc_engine_destroy(B);
  _exit(0);
}

static info_t g_in;
static mc_engine_t *A;
static uint64_t g_local;
static int to_c, from_c;

static int xfer1(int op, uint64_t loc, uint64_t rem, size_t len, double *t_submit) {
  mc_request_t r = {.opcode = op, .local = (void *)(uintptr_t)loc, .remote = rem, .len = len};
  return submit_wait(A, g_in.segment, &r, 1, t_submit);
}

/* GPU copy jobs submitted and launched by the submitting thread so far
 * (MC_GPU_DIRECT): each row reports its own. */
static void gpu_jobs(uint64_t *jobs, uint64_t *direct) {
  mc_engine_stats_t st;
  mc_engine_get_stats(A, &st);
  *jobs = st.gpu_jobs;
  *direct = st.gpu_jobs_direct;
}

/* The same-host path's blocks (ops, jobs, calls) handed out again so far. */
static uint64_t block_reuses(void) {
  mc_engine_stats_t st;
  mc_engine_get_stats(A, &st);
  return st.same_host_gpu_block_reuses;
}

static void small_rows(int iters) {
  double *t = malloc(sizeof(double) * (size_t)iters), *ts = malloc(sizeof(double) * (size_t)iters);
  for (int op = 0; op < 2; op++) {
    int code = op ? MC_OP_READ : MC_OP_WRITE;
    for (int i = 0; i < 200; i++)
      xfer1(code, g_local, g_in.addr + 8192, 4096, NULL);
    uint64_t j0, d0, j1, d1;
    gpu_jobs(&j0, &d0);
    for (int i = 0; i < iters; i++) {
      double t0 = now_us();
      if (xfer1(code, g_local, g_in.addr + 8192, 4096, &ts[i]) < 0)
        exit(1);
      t[i] = now_us() - t0;
    }
    gpu_jobs(&j1, &d1);
    double p50 = pct(t, iters, 0.5), p90 = pct(t, iters, 0.9), p99 = pct(t, iters, 0.99);
    printf("{\"row\": \"4k_%s\", \"p50_us\": %.2f, \"p90_us\": %.2f, \"p99_us\": %.2f, "
           "\"submit_p50_us\": %.2f, \"iters\": %d, \"gpu_jobs\": %llu, "
           "\"gpu_jobs_direct\": %llu}\n",
           op ? "read" : "write", p50, p90, p99, pct(ts, iters, 0.5), iters,
           (unsigned long long)(j1 - j0), (unsigned long long)(d1 - d0));
    fflush(stdout);
  }
  free(t);
  free(ts);
}

/* MC_GPU_DIAG=1: where the threads ran and what the copy worker did per
 * row (issue 30's per-process spread of the pipelined row). */
static int g_diag;
static pid_t g_child;
#define MAXCPU 256
static unsigned long long st_steal[MAXCPU], st_busy[MAXCPU];

static void read_stat(unsigned long long *steal, unsigned long long *busy) {
  FILE *f = fopen("/proc/stat", "r");
  char line[512];
  while (f && fgets(line, sizeof line, f)) {
    int cpu;
    unsigned long long u, n, sy, id, io, irq, sirq, st;
    if (sscanf(line, "cpu%d %llu %llu %llu %llu %llu %llu %llu %llu", &cpu, &u, &n, &sy, &id,
               &io, &irq, &sirq, &st) == 9 && cpu >= 0 && cpu < MAXCPU) {
      steal[cpu] = st;
      busy[cpu] = u + n + sy + irq + sirq;
    }
  }
  if (f)
    fclose(f);
}

/* "comm@cpu(voluntary/involuntary switches)" for each thread of pid. */
static void threads_of(pid_t pid, char *out, size_t cap) {
  char dir[64];
  snprintf(dir, sizeof dir, "/proc/%d/task", (int)pid);
  DIR *d = opendir(dir);
  size_t len = 0;
  out[0] = '\0';
  for (struct dirent *e; d && (e = readdir(d));) {
    if (e->d_name[0] == '.')
      continue;
    char path[128], buf[1024], comm[32] = "?";
    snprintf(path, sizeof path, "%s/%s/stat", dir, e->d_name);
    FILE *f = fopen(path, "r");
    if (!f)
      continue;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    char *l = strchr(buf, '('), *r = strrchr(buf, ')');
    if (!l || !r)
      continue;
    snprintf(comm, sizeof comm, "%.*s", (int)(r - l - 1 < 31 ? r - l - 1 : 31), l + 1);
    int cpu = -1, field = 2;
    for (char *p = r + 1; *p; p++)
      if (*p == ' ' && ++field == 39) {
        cpu = atoi(p + 1);
        break;
      }
    long vol = -1, inv = -1;
    snprintf(path, sizeof path, "%s/%s/status", dir, e->d_name);
    f = fopen(path, "r");
    while (f && fgets(buf, sizeof buf, f)) {
      sscanf(buf, "voluntary_ctxt_switches: %ld", &vol);
      sscanf(buf, "nonvoluntary_ctxt_switches: %ld", &inv);
    }
    if (f)
      fclose(f);
    len += (size_t)snprintf(out + len, len < cap ? cap - len : 0, "%s%s/%s@%d(%ld/%ld)",
                            len ? " " : "", e->d_name, comm, cpu, vol, inv);
    if (len >= cap)
      break;
  }
  if (d)
    closedir(d);
}

static void diag_begin(void) {
  if (!g_diag)
    return;
  mc_gpu_diag_t dg;
  mc_gpu_stager_diag(A->gpu, &dg, 1);
  read_stat(st_steal, st_busy);
}

static int cmp_tl(const void *a, const void *b) {
  double x = ((const mc_gpu_tl_t *)a)->gpu_start_us, y = ((const mc_gpu_tl_t *)b)->gpu_start_us;
  return x < y ? -1 : x > y;
}

/* MC_GPU_DIAG=2: the row's launch timeline, summed up (how busy the GPU
 * was while it had launched work: the union of the kernels' spans against
 * the span from the first launch to the last kernel's end; the time from
 * a launch to its kernel's start) and appended to $GFC_GPU_TRACE. */
static void timeline(const char *row) {
  static mc_gpu_tl_t tl[8192];
  size_t n = mc_gpu_stager_timeline(A->gpu, tl, 8192);
  if (!n)
    return;
  const char *path = getenv("GFC_GPU_TRACE");
  FILE *f = path && *path ? fopen(path, "a") : NULL;
  if (f) {
    fprintf(f, "# pid %d row %s: picked_us launched_us gpu_start_us gpu_end_us copies stream "
            "table done_us\n", (int)getpid(), row);
    for (size_t i = 0; i < n; i++)
      fprintf(f, "%.2f %.2f %.2f %.2f %u %u %u %.2f\n", tl[i].picked_us, tl[i].launched_us,
              tl[i].gpu_start_us, tl[i].gpu_end_us, tl[i].copies, tl[i].stream, tl[i].table,
              tl[i].done_us);
    fclose(f);
  }
  qsort(tl, n, sizeof *tl, cmp_tl);
  double busy = 0, end = tl[0].gpu_start_us, lag = 0, first = tl[0].launched_us, last = 0;
  double gap_max = 0;
  for (size_t i = 0; i < n; i++) {
    double st = tl[i].gpu_start_us > end ? tl[i].gpu_start_us : end;
    if (tl[i].gpu_start_us > end && i && tl[i].gpu_start_us - end > gap_max)
      gap_max = tl[i].gpu_start_us - end;
    if (tl[i].gpu_end_us > st)
      busy += tl[i].gpu_end_us - st;
    end = tl[i].gpu_end_us > end ? tl[i].gpu_end_us : end;
    lag += tl[i].gpu_start_us - tl[i].launched_us;
    first = tl[i].launched_us < first ? tl[i].launched_us : first;
    last = tl[i].gpu_end_us > last ? tl[i].gpu_end_us : last;
  }
  printf("{\"row\": \"timeline\", \"of\": \"%s\", \"launches\": %zu, \"gpu_busy_us\": %.1f, "
         "\"span_us\": %.1f, \"busy_frac\": %.3f, \"launch_to_start_us\": %.2f, "
         "\"max_gap_us\": %.1f}\n",
         row, n, busy, last - first, busy / (last - first > 0 ? last - first : 1),
         lag / (double)n, gap_max);
}

static void diag_end(const char *row) {
  if (!g_diag)
    return;
  timeline(row);
  mc_gpu_diag_t d;
  mc_gpu_stager_diag(A->gpu, &d, 0);
  static unsigned long long steal[MAXCPU], busy[MAXCPU];
  read_stat(steal, busy);
  char cpus[1024] = "";
  size_t len = 0;
  for (int c = 0; c < MAXCPU && len < sizeof cpus; c++) /* CPUs busy in the row (ticks) */
    if (busy[c] - st_busy[c] + steal[c] - st_steal[c] > 2)
      len += (size_t)snprintf(cpus + len, sizeof cpus - len, "%s%d:%llu/%llu", len ? " " : "",
                              c, busy[c] - st_busy[c], steal[c] - st_steal[c]);
  static char me[4096], tgt[4096];
  threads_of(getpid(), me, sizeof me);
  threads_of(g_child, tgt, sizeof tgt);
  double l = d.launches ? (double)d.launches : 1, dj = d.done_jobs ? (double)d.done_jobs : 1;
  printf("{\"row\": \"diag\", \"of\": \"%s\", \"launches\": %llu, \"copies_per_launch\": %.1f, "
         "\"table_launches\": %llu, \"queue_us_per_launch\": %.2f, \"launch_us\": %.2f, "
         "\"done_us\": %.2f, \"loops\": %llu, \"queries\": %llu, \"sleeps\": %llu, "
         "\"gpu_us_per_kernel\": %.2f, \"kernels_timed\": %llu, \"query_us\": %.1f, "
         "\"finish_us_per_launch\": %.2f, \"polls\": %llu, "
         "\"worker_cpu\": %d, \"submit_cpu\": %d, \"worker_cpu_moves\": %llu, "
         "\"worker_on_submit_cpu\": %llu, \"cpu_busy_steal_ticks\": \"%s\", "
         "\"local_2m_offset_kib\": %llu, \"remote_2m_offset_kib\": %llu, "
         "\"threads\": \"%s\", \"target_threads\": \"%s\"}\n",
         row, (unsigned long long)d.launches, (double)d.copies / l,
         (unsigned long long)d.table_launches, (double)d.queue_ns / l / 1e3,
         (double)d.launch_ns / l / 1e3, (double)d.done_ns / dj / 1e3,
         (unsigned long long)d.loops, (unsigned long long)d.queries,
         (unsigned long long)d.sleeps,
         d.gpu_jobs ? (double)d.gpu_ns / (double)d.gpu_jobs / 1e3 : 0.0,
         (unsigned long long)d.gpu_jobs, (double)d.query_ns / 1e3,
         (double)d.finish_ns / dj / 1e3, (unsigned long long)d.polls, d.worker_cpu, d.submit_cpu,
         (unsigned long long)d.cpu_moves, (unsigned long long)d.same_cpu, cpus,
         (unsigned long long)(g_local % (2u << 20)) >> 10,
         (unsigned long long)(g_in.addr % (2u << 20)) >> 10, me, tgt);
  fflush(stdout);
}

/* The GPU's SM clock (MHz) through NVML where it is there, else -1: each
 * row prints it at the start of each pass. */
typedef int (*nvml_init_fn)(void);
typedef int (*nvml_handle_fn)(unsigned, void **);
typedef int (*nvml_clock_fn)(void *, int, unsigned *);
static nvml_clock_fn nvml_clock;
static void *nvml_dev;

static void nvml_up(void) {
  void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
  nvml_init_fn init = h ? (nvml_init_fn)dlsym(h, "nvmlInit_v2") : NULL;
  nvml_handle_fn get = h ? (nvml_handle_fn)dlsym(h, "nvmlDeviceGetHandleByIndex_v2") : NULL;
  nvml_clock = h ? (nvml_clock_fn)dlsym(h, "nvmlDeviceGetClockInfo") : NULL;
  if (!init || !get || !nvml_clock || init() != 0 || get(0, &nvml_dev) != 0)
    nvml_clock = NULL;
}

static int sm_mhz(void) {
  unsigned mhz = 0;
  return nvml_clock && nvml_clock(nvml_dev, 1 /* NVML_CLOCK_SM */, &mhz) == 0 ? (int)mhz : -1;
}

static uint32_t rng_state = 12345;
static uint32_t rng(void) {
  uint32_t x = rng_state;
  x ^= x << 13;
  x ^= x >> 17;
  x ^= x << 5;
  return rng_state = x;
}

/* One pass: 1 GiB of bb-byte blocks, batches of `batch`; seq or pipelined.
 * Returns seconds, < 0 on failure; *submit_s: the time spent inside
 * mc_batch_submit (what the submitting thread costs per batch). */
static double pass(const uint32_t *perm, size_t bb, size_t batch, int pipe, int op,
                   double *submit_s) {
  size_t nblk = GIB / bb, nb = (nblk + batch - 1) / batch;
  mc_request_t *r = malloc(nblk * sizeof *r);
  mc_batch_t **bs = calloc(nb, sizeof *bs);
  for (size_t i = 0; i < nblk; i++)
    r[i] = (mc_request_t){.opcode = op, .local = (void *)(uintptr_t)(g_local + i * bb),
                          .remote = g_in.addr + (uint64_t)perm[i] * bb, .len = bb};
  for (size_t k = 0; k < nb; k++)
    bs[k] = mc_batch_new(A, batch);
  mc_err_t err = {0};
  int rc = 0;
  double t0 = now_us(), in_submit = 0;
  for (size_t k = 0; k < nb && rc == 0; k++) {
    size_t n = nblk - k * batch < batch ? nblk - k * batch : batch;
    double s0 = now_us();
    rc = mc_batch_submit(A, bs[k], g_in.segment, r + k * batch, n, &err);
    in_submit += now_us() - s0;
    if (rc == 0 && !pipe)
      rc = mc_batch_wait(A, bs[k], 30000, &err);
  }
  for (size_t k = 0; k < nb && rc == 0 && pipe; k++)
    rc = mc_batch_wait(A, bs[k], 30000, &err);
  double secs = (now_us() - t0) / 1e6;
  if (submit_s)
    *submit_s = in_submit / 1e6;
  for (size_t k = 0; k < nb; k++)
    mc_batch_free(A, bs[k]);
  free(bs);
  free(r);
  if (rc) {
    fprintf(stderr, "pass failed: %s\n", err.msg);
    return -1;
  }
  return secs;
}

static int verify(const uint32_t *perm, size_t bb, int op) {
  size_t nblk = GIB / bb;
  uint64_t *mine = hash_blocks(g_local, GIB, bb), *theirs = malloc(nblk * sizeof *theirs);
  char c = 'h';
  uint64_t b64 = bb;
  if (!mine || !theirs || write_full(to_c, &c, 1) < 0 || write_full(to_c, &b64, 8) < 0 ||
      read_full(from_c, theirs, nblk * sizeof *theirs) < 0)
    return -1;
  size_t bad = 0;
  for (size_t i = 0; i < nblk; i++)
    bad += mine[i] != theirs[perm[i]];
  free(mine);
  free(theirs);
  (void)op;
  return (int)(bad > 0x7fffffff ? 0x7fffffff : bad);
}

static void fill_local(uint32_t seed) {
  /* Every 4-byte word distinct per block: a misplaced block shows. */
  uint32_t *h = malloc(GIB);
  for (size_t i = 0; i < GIB / 4; i++)
    h[i] = (uint32_t)i * 2654435761u + seed;
  api->cuMemcpyHtoD(g_local, h, GIB);
  free(h);
}

/* MC_GPU_DIAG=1, after the row: the same copy kernel timed with CUDA
 * events (one pass: nb launches of `batch` blocks, back to back on one
 * stream) local -> the peer's import (the row's WRITE), local -> a second
 * local buffer, import -> local, and local -> import with the blocks in
 * order (no shuffle); then the driver's copy (copy engine) of whole 8 MiB
 * runs local -> import and local -> local.  If only the import is slow in
 * a slow process it is the import's memory or mapping; if local -> local
 * is as slow, it is this process's context. */
static uint64_t g_local2;

static double probe_pass(const uint64_t *dst, const uint64_t *src, size_t bb, size_t batch,
                         size_t nblk, int engine, mc_cu_stream st) {
  mc_cu_event e0 = NULL, e1 = NULL;
  mc_err_t err = {0};
  double gbps = -1;
  mc_cu_ptr *d = malloc(batch * sizeof *d), *s = malloc(batch * sizeof *s);
  size_t *len = malloc(batch * sizeof *len);
  if (!d || !s || !len || api->cuEventCreate(&e0, 0) != 0 || api->cuEventCreate(&e1, 0) != 0)
    goto out;
  api->cuEventRecord(e0, st);
  for (size_t k = 0; k < nblk; k += batch) {
    size_t n = nblk - k < batch ? nblk - k : batch;
    if (engine) { /* contiguous runs: one driver copy per batch */
      if (api->cuMemcpyAsync(dst[k], src[k], n * bb, st) != 0)
        goto out;
      continue;
    }
    for (size_t i = 0; i < n; i++) {
      d[i] = dst[k + i];
      s[i] = src[k + i];
      len[i] = bb;
    }
    if (mc_copy_kernel_launch(0, d, s, len, n, NULL, st, &err) < 0) {
      fprintf(stderr, "probe launch: %s\n", err.msg);
      goto out;
    }
  }
  api->cuEventRecord(e1, st);
  float ms = 0;
  if (api->cuEventSynchronize(e1) == 0 && api->cuEventElapsedTime &&
      api->cuEventElapsedTime(&ms, e0, e1) == 0 && ms > 0)
    gbps = (double)(nblk * bb) / (ms * 1e-3) / 1e9;
out:
  if (e0)
    api->cuEventDestroy(e0);
  if (e1)
    api->cuEventDestroy(e1);
  free(d);
  free(s);
  free(len);
  return gbps;
}

static void probe(const uint32_t *perm, size_t bb, size_t batch) {
  if (!g_diag || !g_in.ipc[0] || !getenv("GFC_PROBE") || getenv("GFC_PROBE")[0] != '1')
    return;
  mc_err_t err = {0};
  uint64_t imp = 0;
  mc_cu_stream st = NULL;
  if (!g_local2 && cu_alloc(&g_local2, GIB) != 0)
    g_local2 = 0;
  if (!g_local2 || mc_gpu_ipc_open(g_in.ipc, 0, &imp, &err) < 0 ||
      api->cuStreamCreate(&st, MC_CU_STREAM_NON_BLOCKING) != 0) {
    fprintf(stderr, "probe: cannot set up (%s)\n", err.msg);
    return;
  }
  size_t nblk = GIB / bb;
  uint64_t *lo = malloc(nblk * 8), *lo2 = malloc(nblk * 8), *im = malloc(nblk * 8),
           *imseq = malloc(nblk * 8), *lo2p = malloc(nblk * 8);
  for (size_t i = 0; i < nblk; i++) {
    lo[i] = g_local + i * bb;
    lo2[i] = g_local2 + i * bb;
    lo2p[i] = g_local2 + (uint64_t)perm[i] * bb;
    im[i] = imp + (uint64_t)perm[i] * bb;
    imseq[i] = imp + i * bb;
  }
  static const char *names[] = {"k_local_to_import", "k_local_to_local2", "k_import_to_local2",
                                "k_local_to_import_inorder", "k_local_to_local2_shuffled",
                                "ce_local_to_import", "ce_local_to_local2"};
  const uint64_t *dsts[] = {im, lo2, lo2, imseq, lo2p, imseq, lo2};
  const uint64_t *srcs[] = {lo, lo, imseq, lo, lo, lo, lo};
  char line[2048];
  size_t n = (size_t)snprintf(line, sizeof line,
                              "{\"row\": \"probe\", \"block\": %zu, \"batch\": %zu, "
                              "\"import\": \"0x%llx\", \"import_2m_offset_kib\": %llu, "
                              "\"local2_2m_offset_kib\": %llu",
                              bb, batch, (unsigned long long)imp,
                              (unsigned long long)(imp % (2u << 20)) >> 10,
                              (unsigned long long)(g_local2 % (2u << 20)) >> 10);
  for (int v = 0; v < 7; v++) {
    double g[3];
    for (int r = 0; r < 3; r++) /* 3 passes: best and worst GB/s */
      g[r] = probe_pass(dsts[v], srcs[v], bb, batch, nblk, v >= 5, st);
    double lo_g = g[0], hi_g = g[0];
    for (int r = 1; r < 3; r++) {
      lo_g = g[r] < lo_g ? g[r] : lo_g;
      hi_g = g[r] > hi_g ? g[r] : hi_g;
    }
    n += (size_t)snprintf(line + n, n < sizeof line ? sizeof line - n : 0,
                          ", \"%s_gbps\": [%.1f, %.1f]", names[v], hi_g, lo_g);
  }
  printf("%s}\n", line);
  fflush(stdout);
  api->cuStreamDestroy(st);
  free(lo);
  free(lo2);
  free(im);
  free(imseq);
  free(lo2p);
}

/* GPU_FIXED_COST_ONLY=row:<block>:<batch>:<seq|pipe>: that WRITE row only
 * (for traced runs). */
static size_t only_bb, only_batch;
static int only_pipe = -1;
static double warmup_ms = 200; /* GFC_WARMUP_MS */

static void bulk_rows(const char *dir, size_t bb, int passes) {
  if (only_bb && only_bb != bb)
    return;
  size_t nblk = GIB / bb;
  uint32_t *perm = malloc(nblk * sizeof *perm);
  for (size_t i = 0; i < nblk; i++)
    perm[i] = (uint32_t)i;
  for (size_t i = nblk - 1; i > 0; i--) { /* Fisher-Yates */
    size_t j = rng() % (i + 1);
    uint32_t x = perm[i];
    perm[i] = perm[j];
    perm[j] = x;
  }
  char path[512];
  snprintf(path, sizeof path, "%s/perm_%zu.u32", dir, bb);
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(perm, sizeof *perm, nblk, f) != nblk) {
    fprintf(stderr, "cannot write %s\n", path);
    exit(1);
  }
  fclose(f);
  static const size_t batches[] = {128, 1024};
  for (size_t bi = 0; bi < 2; bi++) {
    size_t batch = batches[bi];
    if (batch > nblk || (only_batch && batch != only_batch))
      continue;
    for (int pipe = 0; pipe < 2; pipe++) {
      if (only_pipe >= 0 && pipe != only_pipe)
        continue;
      for (int op = MC_OP_WRITE; op >= 0;
           op = op == MC_OP_WRITE && only_pipe < 0 ? MC_OP_READ : -1) {
        /* A fresh pattern, the other side zeroed; one warm-up pass. */
        fill_local(0x1234u + (uint32_t)(bb + batch + (size_t)pipe * 7 + (size_t)op));
        char c = 'z';
        if (op == MC_OP_WRITE &&
            (write_full(to_c, &c, 1) < 0 || read_full(from_c, &c, 1) < 0))
          exit(1);
        if (op == MC_OP_READ) { /* the target holds the pattern: write it there first */
          if (pass(perm, bb, 1024 < nblk ? 1024 : nblk, 1, MC_OP_WRITE, NULL) < 0)
            exit(1);
          zero_dev(g_local, GIB);
        }
        double *s = malloc(sizeof(double) * (size_t)(passes + 1));
        double *sub = malloc(sizeof(double) * (size_t)(passes + 1));
        int *mhz = malloc(sizeof(int) * (size_t)(passes + 2));
        uint64_t j0 = 0, d0 = 0, j1, d1, r0 = 0;
        /* Warm-up: passes until warmup_ms went by (at least one): a GPU
         * that sat idle (the row's set-up, the last row's checks) runs at
         * a low clock for a while, and torch's reference is timed busy. */
        int nwarm = 0;
        double w0 = now_us();
        do {
          if (pass(perm, bb, batch, pipe, op, &sub[0]) < 0)
            exit(1);
          nwarm++;
        } while (now_us() - w0 < warmup_ms * 1e3);
        for (int p = 1; p <= passes; p++) {
          if (p == 1) {
            gpu_jobs(&j0, &d0); /* after the warm-up */
            r0 = block_reuses();
            diag_begin();
          }
          mhz[p] = sm_mhz();
          if ((s[p] = pass(perm, bb, batch, pipe, op, &sub[p])) < 0)
            exit(1);
        }
        mhz[passes + 1] = sm_mhz();
        char pl[512] = "";
        size_t pn = 0;
        for (int p = 1; p <= passes + 1 && pn < sizeof pl; p++)
          pn += (size_t)snprintf(pl + pn, sizeof pl - pn, "%s%d", p > 1 ? ", " : "", mhz[p]);
        char tl[512] = "";
        size_t tn = 0;
        for (int p = 1; p <= passes && tn < sizeof tl; p++)
          tn += (size_t)snprintf(tl + tn, sizeof tl - tn, "%s%.3f", p > 1 ? ", " : "", s[p] * 1e3);
        gpu_jobs(&j1, &d1);
        uint64_t r1 = block_reuses();
        char rowname[64];
        snprintf(rowname, sizeof rowname, "%s_%zu_b%zu_%s", op == MC_OP_WRITE ? "write" : "read",
                 bb, batch, pipe ? "pipe" : "seq");
        diag_end(rowname);
        int bad = verify(perm, bb, op);
        if (pipe && op == MC_OP_WRITE)
          probe(perm, bb, batch);
        double best = s[1];
        for (int p = 2; p <= passes; p++)
          best = s[p] < best ? s[p] : best;
        double med = pct(s + 1, passes, 0.5), sub_med = pct(sub + 1, passes, 0.5);
        printf("{\"row\": \"%s_%zu_b%zu_%s\", \"block\": %zu, \"batch\": %zu, \"mode\": "
               "\"%s\", \"op\": \"%s\", \"best_gbps\": %.2f, \"median_gbps\": %.2f, "
               "\"best_s\": %.6f, \"median_s\": %.6f, \"per_batch_us\": %.2f, "
               "\"submit_per_batch_us\": %.2f, \"gpu_jobs\": %llu, \"gpu_jobs_direct\": %llu, "
               "\"block_reuses\": %llu, \"warmup_passes\": %d, \"pass_ms\": [%s], \"sm_mhz\": [%s], \"bad_blocks\": %d}\n",
               op == MC_OP_WRITE ? "write" : "read", bb, batch, pipe ? "pipe" : "seq", bb,
               batch, pipe ? "pipe" : "seq", op == MC_OP_WRITE ? "write" : "read",
               GIB / best / 1e9, GIB / med / 1e9, best, med,
               med * 1e6 / (double)((nblk + batch - 1) / batch),
               sub_med * 1e6 / (double)((nblk + batch - 1) / batch),
               (unsigned long long)(j1 - j0), (unsigned long long)(d1 - d0),
               (unsigned long long)(r1 - r0), nwarm, tl, pl, bad);
        fflush(stdout);
        free(mhz);
        free(s);
        free(sub);
      }
    }
  }
  free(perm);
}

int main(int argc, char **argv) {
  const char *dir = argc > 1 ? argv[1] : ".";
  int iters = argc > 2 ? atoi(argv[2]) : 2000;
  int passes = argc > 3 ? atoi(argv[3]) : 5;
  if (iters < 20)
    iters = 20;
  if (passes < 1)
    passes = 1;
  signal(SIGPIPE, SIG_IGN);
  pid_t pid;
  if (fork_target(child, &pid, &to_c, &from_c) < 0)
    return 1;
  g_child = pid;
  g_diag = getenv("MC_GPU_DIAG") && (getenv("MC_GPU_DIAG")[0] == '1' ||
                                     getenv("MC_GPU_DIAG")[0] == '2');
  if (read_full(from_c, &g_in, sizeof g_in) < 0 || !g_in.ok || !gpu_up()) {
    printf("{\"row\": \"skipped\", \"why\": \"no GPU visible\"}\n");
    return 0;
  }
  mc_engine_opts_t o = {.local_hostname = "127.0.0.1", .metadata_server = "P2PHANDSHAKE"};
  mc_err_t err = {0};
  if (mc_engine_create(&o, &A, &err) < 0 || cu_alloc(&g_local, GIB) != 0 ||
      mc_engine_register(A, (void *)(uintptr_t)g_local, GIB, "cuda:0", &err) < 0) {
    fprintf(stderr, "setup: %s\n", err.msg);
    return 1;
  }
  /* GFC_MAIN_CPU=<n>: this (submitting) thread on CPU n from here on (the
   * engine's threads keep their places; MC_GPU_WORKER_CPU places the copy
   * worker, which otherwise inherits this). */
  const char *wm = getenv("GFC_WARMUP_MS");
  if (wm && *wm)
    warmup_ms = atof(wm);
  nvml_up();
  const char *mc = getenv("GFC_MAIN_CPU");
  if (mc && *mc) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(atoi(mc), &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0)
      fprintf(stderr, "GFC_MAIN_CPU=%s: cannot pin this thread there\n", mc);
  }
  /* "small": the 4 KiB rows only; "row:<block>:<batch>:<seq|pipe>": one
   * WRITE row only; "batch:<n>": the 4 KiB rows and the rows of batches
   * of n (an A/B of issue 30's rows). */
  const char *only = getenv("GPU_FIXED_COST_ONLY");
  char mode[8] = "";
  if (only && sscanf(only, "row:%zu:%zu:%7s", &only_bb, &only_batch, mode) == 3)
    only_pipe = !strcmp(mode, "pipe");
  else if (only && sscanf(only, "batch:%zu", &only_batch) != 1 && strcmp(only, "small"))
    fprintf(stderr, "GPU_FIXED_COST_ONLY=%s not understood (small, batch:<n>, "
            "row:<block>:<batch>:<seq|pipe>): running every row\n", only);
  if (only_pipe < 0)
    small_rows(iters);
  if (!only || strcmp(only, "small")) {
    bulk_rows(dir, 65536, passes);
    bulk_rows(dir, 2u << 20, passes);
  }
  mc_engine_destroy(A);
  close(to_c);
  waitpid(pid, NULL, 0);
  return 0;
}
