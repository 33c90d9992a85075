/* Shared by the C GPU tests: whether a GPU is visible (loads CUDA through
 * the engine's loader, device 0 current), device memory from the driver
 * (cuMemAlloc/cuMemFree looked up in libcuda.so.1), SKIP_NO_GPU() for
 * tests that must still pass, saying they skipped, where there is none,
 * and the engine pair set-up of the tests that transfer between two
 * engines of this process (engine_new, engine_pair, xfer, describe). */
#ifndef MC_TESTS_GPU_TESTLIB_H
#define MC_TESTS_GPU_TESTLIB_H

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>

#include "engine/engine.h"
#include "engine/engine_internal.h"
#include "gpu/cuda_driver.h"
#include "meta/segment_desc.h"
#include "testlib.h"

typedef int (*mem_alloc_fn)(uint64_t *, size_t);
typedef int (*mem_free_fn)(uint64_t);
static mem_alloc_fn cu_alloc;
static mem_free_fn cu_free;
static const mc_cuda_api_t *api;

static int have_gpu(void) {
  if (api)
    return 1;
  mc_err_t err = {0};
  const mc_cuda_api_t *a = mc_cuda_api(&err);
  if (!a || a->device_count < 1)
    return 0;
  void *h = dlopen("libcuda.so.1", RTLD_NOW);
  cu_alloc = h ? (mem_alloc_fn)dlsym(h, "cuMemAlloc_v2") : NULL;
  cu_free = h ? (mem_free_fn)dlsym(h, "cuMemFree_v2") : NULL;
  if (!cu_alloc || !cu_free || mc_cuda_use_device(0, &err) < 0)
    return 0;
  api = a;
  return 1;
}

#define SKIP_NO_GPU()                                                          \
  do {                                                                         \
    if (!have_gpu()) {                                                         \
      fprintf(stderr, "  (skipped: no GPU visible)\n");                        \
      return;                                                                  \
    }                                                                          \
  } while (0)

/* n bytes of device memory on cuda:0, or 0. */
static uint64_t dalloc(size_t n) {
  uint64_t p = 0;
  mc_cuda_use_device(0, NULL);
  return cu_alloc(&p, n) == 0 ? p : 0;
}

/* An engine in this process (127.0.0.1, P2P handshake, the transports
 * the engine picks by itself): 0, or the error code with err saying why. */
static inline int engine_new(mc_engine_t **e, mc_err_t *err) {
  mc_engine_opts_t o = {.local_hostname = "127.0.0.1", .metadata_server = "P2PHANDSHAKE"};
  *e = NULL;
  return mc_engine_create(&o, e, err);
}

/* Two of them, A and B: 0, or the error code (neither engine left). */
static inline int engine_pair(mc_engine_t **A, mc_engine_t **B, mc_err_t *err) {
  *B = NULL;
  int rc = engine_new(A, err);
  if (rc == 0 && (rc = engine_new(B, err)) != 0) {
    mc_engine_destroy(*A);
    *A = NULL;
  }
  return rc;
}

/* One batch of n requests from A to B, waited for (60 s): 0, or the
 * error code with err saying why. */
static inline int xfer(mc_engine_t *A, mc_engine_t *B, const mc_request_t *r, size_t n,
                       mc_err_t *err) {
  mc_batch_t *b = mc_batch_new(A, n);
  int rc = mc_batch_submit(A, b, mc_engine_segment_name(B), r, n, err);
  if (rc == 0)
    rc = mc_batch_wait(A, b, 60000, err);
  mc_batch_free(A, b);
  return rc;
}

/* B's descriptor as A's RPC (mc.describe, the same-host path's) gets it. */
static inline void describe(mc_engine_t *A, mc_engine_t *B, mc_remote_desc_t *rd) {
  char *reply = NULL;
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_engine_rpc(A, mc_engine_segment_name(B), MC_RPC_DESCRIBE,
                             strlen(MC_RPC_DESCRIBE), 5000, &reply, &err), 0);
  CHECK(reply);
  CHECK_EQ_INT(mc_segment_desc_decode_regions(reply ? reply : "", reply ? strlen(reply) : 0, rd,
                                              &err), 0);
  free(reply);
}

#endif
