/* Issue 30, step 1: where the same-host GPU path's fixed cost per small
 * batch goes.  Two processes on cuda:0 (the target forked before CUDA
 * starts), classic cuMemAlloc memory, everything in one run:
 *   - one 4 KiB WRITE / READ through the engine, submit + wait, p50/p90,
 *     with the time until mc_batch_submit returned split out;
 *   - the parts: the mc.describe RPC alone (the check every submit call with
 *     a cached descriptor sends alongside its copies, and waits for), and a
 *     driver copy of 4 KiB on a stream + cuStreamSynchronize;
 *   - 128 x 64 KiB scattered blocks through the engine against the driver
 *     copying the same blocks locally (one cuMemcpyBatchAsync / cuMemcpyAsync
 *     each, + synchronize);
 *   - the same with the target holding 64 regions instead of 1 (the
 *     descriptor the check fetches grows with them, as with vLLM's layers).
 *     build/bench/gpu_small_bench [iterations]       (needs a GPU) */
#include <dlfcn.h>
#include <inttypes.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "engine/engine.h"
#include "engine/engine_internal.h"
#include "gpu/cuda_driver.h"
#include "meta/segment_desc.h"
#include "gpu_bench_util.h"

#define REG (16u << 20)
#define NREG_MAX 64

static double pct(double *v, int n, double p) {
  qsort(v, (size_t)n, sizeof *v, cmp_d);
  return v[(int)(p * (n - 1))];
}

typedef struct {
  char segment[256];
  uint64_t addr[NREG_MAX];
  int ok;
} info_t;

static void child(int wfd, int rfd) {
  info_t in;
  memset(&in, 0, sizeof in);
  mc_engine_opts_t o = {.local_hostname = "127.0.0.1", .metadata_server = "P2PHANDSHAKE"};
  mc_engine_t *B = NULL;
  mc_err_t err = {0};
  if (!gpu_up() || mc_engine_create(&o, &B, &err) < 0) {
    (void)!write(wfd, &in, sizeof in);
    _exit(0);
  }
  for (int i = 0; i < NREG_MAX; i++)
    if (cu_alloc(&in.addr[i], REG) != 0)
      _exit(3);
  if (mc_engine_register(B, (void *)(uintptr_t)in.addr[0], REG, "cuda:0", &err) < 0)
    _exit(4);
  snprintf(in.segment, sizeof in.segment, "%s", mc_engine_segment_name(B));
  in.ok = 1;
  (void)!write(wfd, &in, sizeof in);
  char c;
  while (read(rfd, &c, 1) == 1) {
    if (c == 'm') /* 63 more regions */
      for (int i = 1; i < NREG_MAX; i++)
        mc_engine_register(B, (void *)(uintptr_t)in.addr[i], REG, "cuda:0", &err);
    (void)!write(wfd, &c, 1);
  }
  mc_engine_destroy(B);
  _exit(0);
}

static info_t g_in;
static mc_engine_t *A;
static uint64_t g_local;

static int xfer(int op, uint64_t *loc, uint64_t *rem, size_t n, size_t len, double *t_submit) {
  mc_request_t r[128];
  for (size_t i = 0; i < n; i++)
    r[i] = (mc_request_t){.opcode = op, .local = (void *)(uintptr_t)loc[i], .remote = rem[i],
                          .len = len};
  return submit_wait(A, g_in.segment, r, n, t_submit);
}

static void rows(const char *tag, int iters) {
  double *t = malloc(sizeof(double) * (size_t)iters), *ts = malloc(sizeof(double) * (size_t)iters);
  uint64_t loc = g_local, rem = g_in.addr[0] + 8192;
  for (int op = 0; op < 2; op++) {
    int code = op ? MC_OP_READ : MC_OP_WRITE;
    for (int i = 0; i < 50; i++)
      xfer(code, &loc, &rem, 1, 4096, NULL);
    for (int i = 0; i < iters; i++) {
      double t0 = now_us();
      if (xfer(code, &loc, &rem, 1, 4096, &ts[i]) < 0)
        return;
      t[i] = now_us() - t0;
    }
    double p50 = pct(t, iters, 0.5), p90 = pct(t, iters, 0.9), s50 = pct(ts, iters, 0.5);
    printf("%-8s 4 KiB %-5s round trip             p50 %7.1f us  p90 %7.1f us  (submit "
           "returned after p50 %.1f us)\n", tag, op ? "READ" : "WRITE", p50, p90, s50);
  }
  /* The check alone: mc.describe over the engine's RPC. */
  for (int i = 0; i < iters; i++) {
    char *reply = NULL;
    mc_err_t err = {0};
    double t0 = now_us();
    mc_engine_rpc(A, g_in.segment, MC_RPC_DESCRIBE, strlen(MC_RPC_DESCRIBE), 10000, &reply, &err);
    t[i] = now_us() - t0;
    if (i == 0)
      printf("%-8s mc.describe reply: %zu bytes\n", tag, reply ? strlen(reply) : 0);
    free(reply);
  }
  printf("%-8s mc.describe RPC alone                p50 %7.1f us  p90 %7.1f us\n", tag,
         pct(t, iters, 0.5), pct(t, iters, 0.9));
  /* 128 x 64 KiB scattered. */
  uint64_t l[128], r[128];
  for (int i = 0; i < 128; i++) {
    l[i] = g_local + (uint64_t)i * 65536;
    r[i] = g_in.addr[0] + (uint64_t)((i * 37 + 11) % 256) * 65536;
  }
  int n = iters / 4 > 20 ? iters / 4 : 20;
  for (int i = 0; i < 10; i++)
    xfer(MC_OP_WRITE, l, r, 128, 65536, NULL);
  for (int i = 0; i < n; i++) {
    double t0 = now_us();
    if (xfer(MC_OP_WRITE, l, r, 128, 65536, NULL) < 0)
      return;
    t[i] = now_us() - t0;
  }
  double e50 = pct(t, n, 0.5);
  /* The driver copying the same blocks locally (local -> local + 8 MiB). */
  mc_cu_stream s = NULL;
  api->cuStreamCreate(&s, MC_CU_STREAM_NON_BLOCKING);
  mc_cu_ptr d[128], sr[128];
  size_t sz[128];
  for (int i = 0; i < 128; i++) {
    sr[i] = l[i];
    d[i] = g_local + (16u << 20) + (uint64_t)((i * 37 + 11) % 128) * 65536;
    sz[i] = 65536;
  }
  for (int i = 0; i < n + 10; i++) {
    double t0 = now_us();
    mc_cuda_copy_batch(d, sr, sz, 128, s, NULL);
    api->cuStreamSynchronize(s);
    if (i >= 10)
      ts[i - 10] = now_us() - t0;
  }
  double d50 = pct(ts, n, 0.5);
  printf("%-8s 128 x 64 KiB WRITE: engine p50 %7.1f us (%6.1f GB/s), driver batch copy + sync "
         "p50 %7.1f us (%6.1f GB/s): %.2fx\n", tag, e50, 8.388608e6 / e50 / 1e3, d50,
         8.388608e6 / d50 / 1e3, d50 / e50);
  /* The driver alone, 4 KiB. */
  for (int i = 0; i < iters; i++) {
    double t0 = now_us();
    api->cuMemcpyAsync(g_local + (16u << 20), g_local, 4096, s);
    api->cuStreamSynchronize(s);
    t[i] = now_us() - t0;
  }
  printf("%-8s driver 4 KiB cuMemcpyAsync + sync     p50 %7.1f us  p90 %7.1f us\n", tag,
         pct(t, iters, 0.5), pct(t, iters, 0.9));
  api->cuStreamDestroy(s);
  free(t);
  free(ts);
}

int main(int argc, char **argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 2000;
  if (iters < 20)
    iters = 20;
  signal(SIGPIPE, SIG_IGN);
  int to_c, from_c;
  pid_t pid;
  if (fork_target(child, &pid, &to_c, &from_c) < 0)
    return 1;
  if (read(from_c, &g_in, sizeof g_in) != (ssize_t)sizeof g_in || !g_in.ok || !gpu_up()) {
    printf("gpu_small_bench: no GPU visible; nothing measured\n");
    return 0;
  }
  mc_engine_opts_t o = {.local_hostname = "127.0.0.1", .metadata_server = "P2PHANDSHAKE"};
  mc_err_t err = {0};
  if (mc_engine_create(&o, &A, &err) < 0 || cu_alloc(&g_local, 32u << 20) != 0 ||
      mc_engine_register(A, (void *)(uintptr_t)g_local, 32u << 20, "cuda:0", &err) < 0) {
    fprintf(stderr, "setup: %s\n", err.msg);
    return 1;
  }
  rows("1 region", iters);
  char c = 'm';
  if (write(to_c, &c, 1) != 1 || read(from_c, &c, 1) != 1)
    return 1;
  rows("64 regs", iters);
  mc_engine_destroy(A);
  close(to_c);
  waitpid(pid, NULL, 0);
  return 0;
}
