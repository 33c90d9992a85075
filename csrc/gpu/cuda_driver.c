#include "gpu/cuda_driver.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "util/dynlib.h"

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static mc_cuda_api_t g_api;
static int g_rc;                   /* 0 or the MC_E* code of the failure */
static char g_msg[MC_ERR_MSG_MAX]; /* why loading failed */

const char *mc_cuda_strerror(const mc_cuda_api_t *api, mc_cu_result r, char *buf, size_t n) {
  const char *name = NULL, *text = NULL;
  if (api && api->cuGetErrorName)
    api->cuGetErrorName(r, &name);
  if (api && api->cuGetErrorString)
    api->cuGetErrorString(r, &text);
  snprintf(buf, n, "%s (%d): %s", name ? name : "CUDA error", r, text ? text : "?");
  return buf;
}

static void load(void) {
  mc_err_t err = {0};
  void *h = mc_dynlib_open(&mc_dynlib_cuda, &err);
  if (!h) {
    g_rc = err.code;
    snprintf(g_msg, sizeof g_msg, "%s", err.msg);
    return;
  }
  struct {
    const char *name;
    void **slot;
  } syms[] = {
      {"cuInit", (void **)&g_api.cuInit},
      {"cuDeviceGetCount", (void **)&g_api.cuDeviceGetCount},
      {"cuDeviceGet", (void **)&g_api.cuDeviceGet},
      {"cuPointerGetAttribute", (void **)&g_api.cuPointerGetAttribute},
      {"cuGetErrorName", (void **)&g_api.cuGetErrorName},
      {"cuGetErrorString", (void **)&g_api.cuGetErrorString},
      {"cuDevicePrimaryCtxRetain", (void **)&g_api.cuDevicePrimaryCtxRetain},
      {"cuCtxSetCurrent", (void **)&g_api.cuCtxSetCurrent},
      {"cuMemcpyHtoD_v2", (void **)&g_api.cuMemcpyHtoD},
      {"cuMemcpyDtoH_v2", (void **)&g_api.cuMemcpyDtoH},
  };
  for (size_t i = 0; i < sizeof syms / sizeof *syms; i++) {
    *syms[i].slot = mc_dynlib_sym(h, &mc_dynlib_cuda, syms[i].name, &err);
    if (!*syms[i].slot) {
      g_rc = err.code;
      snprintf(g_msg, sizeof g_msg, "%s", err.msg);
      return;
    }
  }
  mc_cu_result r = g_api.cuInit(0);
  if (r != 0) {
    char b[160];
    g_rc = MC_EUNAVAIL;
    snprintf(g_msg, sizeof g_msg,
             "GPU memory: cuInit failed with %s; check that a GPU is visible "
             "(nvidia-smi, CUDA_VISIBLE_DEVICES) and the driver is loaded",
             mc_cuda_strerror(&g_api, r, b, sizeof b));
    return;
  }
  g_api.cuDeviceGetCount(&g_api.device_count);
}

const mc_cuda_api_t *mc_cuda_api(mc_err_t *err) {
  pthread_once(&g_once, load);
  if (g_rc) {
    mc_err_set(err, g_rc, "%s", g_msg);
    return NULL;
  }
  return &g_api;
}

int mc_cuda_locate(uint64_t addr, uint64_t len, int *device, mc_err_t *err) {
  mc_err_t ignored;
  const mc_cuda_api_t *api = mc_cuda_api(&ignored);
  if (!api)
    return 0; /* no driver: the driver cannot have allocated it */
  unsigned int type = 0;
  if (api->cuPointerGetAttribute(&type, MC_CU_POINTER_ATTRIBUTE_MEMORY_TYPE, addr) != 0 ||
      (type != MC_CU_MEMORYTYPE_DEVICE && type != MC_CU_MEMORYTYPE_UNIFIED))
    return 0; /* plain (or pinned) host memory */
  int ordinal = -1;
  mc_cu_ptr start = 0;
  size_t size = 0;
  if (api->cuPointerGetAttribute(&ordinal, MC_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, addr) != 0 ||
      api->cuPointerGetAttribute(&start, MC_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, addr) != 0 ||
      api->cuPointerGetAttribute(&size, MC_CU_POINTER_ATTRIBUTE_RANGE_SIZE, addr) != 0)
    return mc_err_set(err, MC_EINVAL, "cannot query the CUDA allocation holding 0x%llx",
                      (unsigned long long)addr);
  if (addr + len > start + size)
    return mc_err_set(err, MC_EINVAL,
                      "range [0x%llx, +%llu) starts in a cuda:%d allocation of %zu bytes at "
                      "0x%llx but runs past its end; register each allocation separately",
                      (unsigned long long)addr, (unsigned long long)len, ordinal, size,
                      (unsigned long long)start);
  *device = ordinal;
  return 1;
}
