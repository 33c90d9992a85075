/* Shared by the C GPU tests: whether a GPU is visible (loads CUDA through
 * the engine's loader, device 0 current), device memory from the driver
 * (cuMemAlloc/cuMemFree looked up in libcuda.so.1), and SKIP_NO_GPU() for
 * tests that must still pass, saying they skipped, where there is none. */
#ifndef MC_TESTS_GPU_TESTLIB_H
#define MC_TESTS_GPU_TESTLIB_H

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>

#include "gpu/cuda_driver.h"

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

#endif
