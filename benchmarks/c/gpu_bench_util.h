/* What the two-process GPU benchmarks share (gpu_fixed_cost.c,
 * gpu_small_bench.c): the target process forked before CUDA starts, the
 * CUDA driver on cuda:0 (api; cu_alloc: classic cuMemAlloc memory), a
 * microsecond clock, and one batch submitted and waited for. */
#ifndef MC_BENCH_GPU_BENCH_UTIL_H
#define MC_BENCH_GPU_BENCH_UTIL_H
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include "engine/engine.h"
#include "gpu/cuda_driver.h"

typedef int (*alloc_fn)(uint64_t *, size_t);
static alloc_fn cu_alloc;
static const mc_cuda_api_t *api;

/* The target: target(wfd, rfd) in a child forked now (stdout flushed
 * first), talking over two pipes; *to_c (write) and *from_c (read) are this
 * side's ends, *pid the child's.  -1 when a pipe cannot be made. */
static inline int fork_target(void (*target)(int wfd, int rfd), pid_t *pid, int *to_c,
                              int *from_c) {
  int a[2], b[2];
  if (pipe(a) || pipe(b))
    return -1;
  fflush(stdout);
  *pid = fork();
  if (*pid == 0) {
    close(a[1]);
    close(b[0]);
    target(b[1], a[0]);
  }
  close(a[0]);
  close(b[1]);
  *to_c = a[1];
  *from_c = b[0];
  return 0;
}

/* 1 when the driver, device 0 and cuMemAlloc_v2 are there. */
static inline int gpu_up(void) {
  mc_err_t err = {0};
  api = mc_cuda_api(&err);
  if (!api || api->device_count < 1 || mc_cuda_use_device(0, &err) < 0)
    return 0;
  void *h = dlopen("libcuda.so.1", RTLD_NOW);
  cu_alloc = h ? (alloc_fn)dlsym(h, "cuMemAlloc_v2") : NULL;
  return cu_alloc != NULL;
}

static inline double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

static inline int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* The n requests r to segment as one batch of e's: submitted (the
 * microseconds until mc_batch_submit returned in *t_submit, when given),
 * then waited for (10 s at most); a failure named on stderr. */
static inline int submit_wait(mc_engine_t *e, const char *segment, const mc_request_t *r,
                              size_t n, double *t_submit) {
  mc_err_t err = {0};
  double t0 = now_us();
  mc_batch_t *b = mc_batch_new(e, n);
  int rc = mc_batch_submit(e, b, segment, r, n, &err);
  if (t_submit)
    *t_submit = now_us() - t0;
  if (rc == 0)
    rc = mc_batch_wait(e, b, 10000, &err);
  mc_batch_free(e, b);
  if (rc)
    fprintf(stderr, "transfer failed: %s\n", err.msg);
  return rc;
}

#endif
