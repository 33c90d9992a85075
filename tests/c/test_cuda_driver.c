/* CUDA driver loading and pointer location.  Without a GPU (CI) it checks
 * the clear "not available" path; on a GPU host it allocates device memory
 * through the driver and checks the detection. */
#include <dlfcn.h>
#include <stdint.h>

#include "gpu/cuda_driver.h"
#include "testlib.h"

static void test_host_memory_is_host(void) {
  char *p = malloc(4096);
  int dev = -7;
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_cuda_locate((uint64_t)(uintptr_t)p, 4096, &dev, &err), 0);
  CHECK_EQ_INT(dev, -7);
  free(p);
}

static void test_api_or_clear_error(void) {
  mc_err_t err = {0};
  const mc_cuda_api_t *api = mc_cuda_api(&err);
  if (api) {
    fprintf(stderr, "  (CUDA driver loaded, %d device(s))\n", api->device_count);
    CHECK(api->device_count >= 0);
  } else {
    CHECK_EQ_INT(err.code, MC_EUNAVAIL);
    CHECK(strstr(err.msg, "libcuda.so.1") || strstr(err.msg, "cuInit"));
    fprintf(stderr, "  (no CUDA here: %s)\n", err.msg);
  }
}

typedef int (*mem_alloc_fn)(uint64_t *, size_t);
typedef int (*mem_free_fn)(uint64_t);

static void test_device_memory_detected(void) {
  mc_err_t err = {0};
  const mc_cuda_api_t *api = mc_cuda_api(&err);
  if (!api || api->device_count < 1) {
    fprintf(stderr, "  (skipped: no GPU)\n");
    return;
  }
  void *h = dlopen("libcuda.so.1", RTLD_NOW);
  mem_alloc_fn alloc = (mem_alloc_fn)dlsym(h, "cuMemAlloc_v2");
  mem_free_fn release = (mem_free_fn)dlsym(h, "cuMemFree_v2");
  CHECK(alloc && release);
  mc_cu_device d;
  mc_cu_context ctx;
  CHECK_EQ_INT(api->cuDeviceGet(&d, 0), 0);
  CHECK_EQ_INT(api->cuDevicePrimaryCtxRetain(&ctx, d), 0);
  CHECK_EQ_INT(api->cuCtxSetCurrent(ctx), 0);
  uint64_t p = 0;
  CHECK_EQ_INT(alloc(&p, 1 << 20), 0);
  int dev = -1;
  CHECK_EQ_INT(mc_cuda_locate(p + 100, 4096, &dev, &err), 1);
  CHECK_EQ_INT(dev, 0);
  CHECK_EQ_INT(mc_cuda_locate(p, (1 << 20) + 1, &dev, &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "runs past its end");
  CHECK_EQ_INT(release(p), 0);
  dlclose(h);
}

int main(void) {
  RUN(test_host_memory_is_host);
  RUN(test_api_or_clear_error);
  RUN(test_device_memory_detected);
  TEST_MAIN_END();
}
