#include "gpu/cuda_driver.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpu/gpu_vmm.h"
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

static void *dlsym_quiet(void *h, const char *name) {
  mc_err_t ignored;
  return mc_dynlib_sym(h, &mc_dynlib_cuda, name, &ignored);
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
      {"cuDriverGetVersion", (void **)&g_api.cuDriverGetVersion},
      {"cuDeviceGetAttribute", (void **)&g_api.cuDeviceGetAttribute},
      {"cuCtxGetCurrent", (void **)&g_api.cuCtxGetCurrent},
      {"cuStreamCreate", (void **)&g_api.cuStreamCreate},
      {"cuStreamDestroy_v2", (void **)&g_api.cuStreamDestroy},
      {"cuStreamSynchronize", (void **)&g_api.cuStreamSynchronize},
      {"cuEventCreate", (void **)&g_api.cuEventCreate},
      {"cuEventDestroy_v2", (void **)&g_api.cuEventDestroy},
      {"cuEventRecord", (void **)&g_api.cuEventRecord},
      {"cuEventQuery", (void **)&g_api.cuEventQuery},
      {"cuEventSynchronize", (void **)&g_api.cuEventSynchronize},
      {"cuMemHostAlloc", (void **)&g_api.cuMemHostAlloc},
      {"cuMemFreeHost", (void **)&g_api.cuMemFreeHost},
      {"cuMemcpy", (void **)&g_api.cuMemcpy},
      {"cuMemcpyAsync", (void **)&g_api.cuMemcpyAsync},
      {"cuMemcpyHtoDAsync_v2", (void **)&g_api.cuMemcpyHtoDAsync},
      {"cuMemcpyDtoHAsync_v2", (void **)&g_api.cuMemcpyDtoHAsync},
  };
  for (size_t i = 0; i < sizeof syms / sizeof *syms; i++) {
    *syms[i].slot = mc_dynlib_sym(h, &mc_dynlib_cuda, syms[i].name, &err);
    if (!*syms[i].slot) {
      g_rc = err.code;
      snprintf(g_msg, sizeof g_msg, "%s", err.msg);
      return;
    }
  }
  /* Optional entry points: absent on old drivers, then those paths are off. */
  *(void **)&g_api.cuIpcGetMemHandle = dlsym_quiet(h, "cuIpcGetMemHandle");
  *(void **)&g_api.cuIpcOpenMemHandle = dlsym_quiet(h, "cuIpcOpenMemHandle_v2");
  *(void **)&g_api.cuIpcCloseMemHandle = dlsym_quiet(h, "cuIpcCloseMemHandle");
  *(void **)&g_api.cuMemGetHandleForAddressRange =
      dlsym_quiet(h, "cuMemGetHandleForAddressRange");
  *(void **)&g_api.cuPointerGetAttributes = dlsym_quiet(h, "cuPointerGetAttributes");
  *(void **)&g_api.cuModuleLoadData = dlsym_quiet(h, "cuModuleLoadData");
  *(void **)&g_api.cuModuleGetFunction = dlsym_quiet(h, "cuModuleGetFunction");
  *(void **)&g_api.cuLaunchKernel = dlsym_quiet(h, "cuLaunchKernel");
  *(void **)&g_api.cuMemGetAddressRange = dlsym_quiet(h, "cuMemGetAddressRange_v2");
  *(void **)&g_api.cuMemRetainAllocationHandle = dlsym_quiet(h, "cuMemRetainAllocationHandle");
  *(void **)&g_api.cuMemRelease = dlsym_quiet(h, "cuMemRelease");
  *(void **)&g_api.cuMemExportToShareableHandle =
      dlsym_quiet(h, "cuMemExportToShareableHandle");
  *(void **)&g_api.cuMemImportFromShareableHandle =
      dlsym_quiet(h, "cuMemImportFromShareableHandle");
  *(void **)&g_api.cuMemGetAllocationPropertiesFromHandle =
      dlsym_quiet(h, "cuMemGetAllocationPropertiesFromHandle");
  *(void **)&g_api.cuMemAddressReserve = dlsym_quiet(h, "cuMemAddressReserve");
  *(void **)&g_api.cuMemAddressFree = dlsym_quiet(h, "cuMemAddressFree");
  *(void **)&g_api.cuMemMap = dlsym_quiet(h, "cuMemMap");
  *(void **)&g_api.cuMemUnmap = dlsym_quiet(h, "cuMemUnmap");
  *(void **)&g_api.cuMemSetAccess = dlsym_quiet(h, "cuMemSetAccess");
  *(void **)&g_api.cuMemCreate = dlsym_quiet(h, "cuMemCreate");
  *(void **)&g_api.cuMemGetAllocationGranularity =
      dlsym_quiet(h, "cuMemGetAllocationGranularity");
  *(void **)&g_api.cuStreamQuery = dlsym_quiet(h, "cuStreamQuery");
  *(void **)&g_api.cuEventElapsedTime = dlsym_quiet(h, "cuEventElapsedTime");
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
  g_api.cuDriverGetVersion(&g_api.driver_version);
  /* cuMemcpyBatchAsync changed signature in CUDA 13 (failIdx dropped):
   * ask the driver for the form we declared. */
  typedef mc_cu_result (*get_proc_fn)(const char *, void **, int, uint64_t, int *);
  get_proc_fn gp = (get_proc_fn)dlsym_quiet(h, "cuGetProcAddress_v2");
  if (gp) {
    void *fn = NULL;
    int status = 0;
    if (g_api.driver_version >= 13000 &&
        gp("cuMemcpyBatchAsync", &fn, 13000, 0, &status) == 0 && fn)
      *(void **)&g_api.cuMemcpyBatchAsync13 = fn;
    else if (g_api.driver_version >= 12080 &&
             gp("cuMemcpyBatchAsync", &fn, 12080, 0, &status) == 0 && fn)
      *(void **)&g_api.cuMemcpyBatchAsync12 = fn;
  }
  if (getenv("MC_GPU_NO_BATCH_COPY")) { /* for comparisons */
    g_api.cuMemcpyBatchAsync13 = NULL;
    g_api.cuMemcpyBatchAsync12 = NULL;
  }
}

#define MC_CUDA_MAX_DEVICES 64
static pthread_mutex_t g_ctx_mu = PTHREAD_MUTEX_INITIALIZER;
static mc_cu_context g_ctx[MC_CUDA_MAX_DEVICES];
static atomic_int g_last_dev; /* the device last made current by us */

int mc_cuda_use_device(int device, mc_err_t *err) {
  const mc_cuda_api_t *api = mc_cuda_api(err);
  if (!api)
    return err ? err->code : MC_EUNAVAIL;
  if (device < 0 || device >= api->device_count || device >= MC_CUDA_MAX_DEVICES)
    return mc_err_set(err, MC_EINVAL, "cuda:%d does not exist (this process sees %d GPU(s); "
                      "check CUDA_VISIBLE_DEVICES)", device, api->device_count);
  pthread_mutex_lock(&g_ctx_mu);
  mc_cu_context ctx = g_ctx[device];
  mc_cu_result r = 0;
  if (!ctx) {
    mc_cu_device d;
    r = api->cuDeviceGet(&d, device);
    if (r == 0)
      r = api->cuDevicePrimaryCtxRetain(&ctx, d);
    if (r == 0)
      g_ctx[device] = ctx;
  }
  pthread_mutex_unlock(&g_ctx_mu);
  if (r == 0)
    r = api->cuCtxSetCurrent(ctx);
  if (r == 0)
    atomic_store_explicit(&g_last_dev, device, memory_order_relaxed);
  if (r != 0) {
    char b[160];
    return mc_err_set(err, MC_EUNAVAIL, "cannot use cuda:%d: %s", device,
                      mc_cuda_strerror(api, r, b, sizeof b));
  }
  return 0;
}

int mc_cuda_enter_device(int device, mc_cu_context *saved, mc_err_t *err) {
  const mc_cuda_api_t *api = mc_cuda_api(err);
  *saved = NULL;
  if (!api)
    return err ? err->code : MC_EUNAVAIL;
  if (api->cuCtxGetCurrent(saved) != 0)
    *saved = NULL;
  mc_cu_context want = NULL;
  if (device >= 0 && device < MC_CUDA_MAX_DEVICES) {
    pthread_mutex_lock(&g_ctx_mu);
    want = g_ctx[device];
    pthread_mutex_unlock(&g_ctx_mu);
  }
  if (want && want == *saved)
    return 0;
  int rc = mc_cuda_use_device(device, err);
  return rc < 0 ? rc : 1;
}

void mc_cuda_leave_device(mc_cu_context saved, int changed) {
  const mc_cuda_api_t *api = mc_cuda_api(NULL);
  if (changed > 0 && api)
    api->cuCtxSetCurrent(saved);
}

int mc_cuda_copy_batch(mc_cu_ptr *dsts, mc_cu_ptr *srcs, size_t *sizes, size_t count,
                       mc_cu_stream stream, mc_err_t *err) {
  const mc_cuda_api_t *api = mc_cuda_api(err);
  if (!api)
    return err ? err->code : MC_EUNAVAIL;
  if (count == 0)
    return 0;
  mc_cu_result r = 0;
  /* The batch API refuses the legacy NULL stream; fall back there. */
  if (count > 1 && stream && (api->cuMemcpyBatchAsync13 || api->cuMemcpyBatchAsync12)) {
    mc_cu_memcpy_attrs_t attr = {.src_access_order = MC_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM};
    size_t idx = 0, fail = 0;
    /* Batches are cut so a driver-side limit on one call is never hit. */
    for (size_t off = 0; off < count && r == 0;) {
      size_t k = count - off < 4096 ? count - off : 4096;
      r = api->cuMemcpyBatchAsync13
              ? api->cuMemcpyBatchAsync13(dsts + off, srcs + off, sizes + off, k, &attr, &idx,
                                          1, stream)
              : api->cuMemcpyBatchAsync12(dsts + off, srcs + off, sizes + off, k, &attr, &idx,
                                          1, &fail, stream);
      off += k;
    }
  } else {
    for (size_t i = 0; i < count && r == 0; i++)
      r = api->cuMemcpyAsync(dsts[i], srcs[i], sizes[i], stream);
  }
  if (r != 0) {
    char b[160];
    return mc_err_set(err, MC_ESYS, "GPU copy of %zu piece(s) failed: %s", count,
                      mc_cuda_strerror(api, r, b, sizeof b));
  }
  return 0;
}

const mc_cuda_api_t *mc_cuda_api(mc_err_t *err) {
  pthread_once(&g_once, load);
  if (g_rc) {
    mc_err_set(err, g_rc, "%s", g_msg);
    return NULL;
  }
  return &g_api;
}

const mc_cuda_api_t *mc_cuda_api_if_loaded(void) {
  static atomic_int known; /* 1: loaded and usable */
  static _Atomic uint64_t next_check_ns;
  if (atomic_load_explicit(&known, memory_order_acquire))
    return &g_api;
  /* Not loaded: look again at most every 100 ms (dlopen takes a lock). */
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  uint64_t now = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
  if (now < atomic_load_explicit(&next_check_ns, memory_order_relaxed))
    return NULL;
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (!h) {
    atomic_store_explicit(&next_check_ns, now + 100000000ull, memory_order_relaxed);
    return NULL;
  }
  dlclose(h);
  const mc_cuda_api_t *api = mc_cuda_api(NULL);
  if (api)
    atomic_store_explicit(&known, 1, memory_order_release);
  return api;
}

int mc_cuda_locate(uint64_t addr, uint64_t len, int *device, mc_err_t *err) {
  uint64_t start, size;
  return mc_cuda_locate_range(addr, len, device, &start, &size, err);
}

int mc_cuda_locate_range(uint64_t addr, uint64_t len, int *device, uint64_t *start_out,
                         uint64_t *size_out, mc_err_t *err) {
  mc_err_t ignored;
  const mc_cuda_api_t *api = mc_cuda_api(&ignored);
  if (!api)
    return 0; /* no driver: the driver cannot have allocated it */
  /* Pointer queries want a current context: threads of ours (I/O, kv
   * workers) may have none yet. */
  mc_cu_context cur = NULL;
  if (api->cuCtxGetCurrent(&cur) != 0 || !cur)
    mc_cuda_use_device(atomic_load_explicit(&g_last_dev, memory_order_relaxed), NULL);
  unsigned int type = 0;
  int ordinal = -1;
  mc_cu_ptr start = 0;
  size_t size = 0;
  int ok = 0;
  if (api->cuPointerGetAttributes) { /* one driver call instead of four */
    int attrs[4] = {MC_CU_POINTER_ATTRIBUTE_MEMORY_TYPE, MC_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                    MC_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                    MC_CU_POINTER_ATTRIBUTE_RANGE_SIZE};
    void *data[4] = {&type, &ordinal, &start, &size};
    if (api->cuPointerGetAttributes(4, attrs, data, addr) != 0)
      return 0;
    if (type != MC_CU_MEMORYTYPE_DEVICE && type != MC_CU_MEMORYTYPE_UNIFIED)
      return 0; /* plain (or pinned) host memory */
    ok = ordinal >= 0 && size > 0;
  }
  if (!ok) {
    if (api->cuPointerGetAttribute(&type, MC_CU_POINTER_ATTRIBUTE_MEMORY_TYPE, addr) != 0 ||
        (type != MC_CU_MEMORYTYPE_DEVICE && type != MC_CU_MEMORYTYPE_UNIFIED))
      return 0; /* plain (or pinned) host memory */
    if (api->cuPointerGetAttribute(&ordinal, MC_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, addr) != 0 ||
        api->cuPointerGetAttribute(&start, MC_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, addr) != 0 ||
        api->cuPointerGetAttribute(&size, MC_CU_POINTER_ATTRIBUTE_RANGE_SIZE, addr) != 0)
      return mc_err_set(err, MC_EINVAL, "cannot query the CUDA allocation holding 0x%llx",
                        (unsigned long long)addr);
  }
  if (addr + len > start + size) {
    /* Driver-mapped memory: one range may be several physical chunks mapped
     * back to back (vLLM's extensible KV cache); the query answers per chunk. */
    mc_gpu_chunk_t *ch = NULL;
    size_t n = 0;
    mc_err_t ignored2;
    if (mc_gpu_vmm_is_mapped(addr) && mc_gpu_vmm_chunks(addr, len, &ch, &n, &ignored2) == 0) {
      start = ch[0].base;
      size = (size_t)(ch[n - 1].base + ch[n - 1].size - ch[0].base);
      free(ch);
    }
  }
  if (addr + len > start + size)
    return mc_err_set(err, MC_EINVAL,
                      "range [0x%llx, +%llu) starts in a cuda:%d allocation of %zu bytes at "
                      "0x%llx but runs past its end; register each allocation separately",
                      (unsigned long long)addr, (unsigned long long)len, ordinal, size,
                      (unsigned long long)start);
  *device = ordinal;
  *start_out = start;
  *size_out = size;
  return 1;
}

int mc_cuda_memcpy_any(void *dst, const void *src, size_t n, mc_err_t *err) {
  const mc_cuda_api_t *api = n ? mc_cuda_api_if_loaded() : NULL;
  int ddev = -1, sdev = -1;
  int dgpu = api && mc_cuda_locate((uint64_t)(uintptr_t)dst, n, &ddev, NULL) == 1;
  int sgpu = api && mc_cuda_locate((uint64_t)(uintptr_t)src, n, &sdev, NULL) == 1;
  if (!dgpu && !sgpu) {
    memcpy(dst, src, n);
    return 0;
  }
  int rc = mc_cuda_use_device(sgpu ? sdev : ddev, err);
  if (rc < 0)
    return rc;
  mc_cu_result r = api->cuMemcpyAsync((mc_cu_ptr)(uintptr_t)dst, (mc_cu_ptr)(uintptr_t)src, n,
                                      NULL);
  if (r == 0)
    r = api->cuStreamSynchronize(NULL);
  if (r != 0) {
    char b[160];
    return mc_err_set(err, MC_ESYS, "GPU copy of %zu bytes failed: %s", n,
                      mc_cuda_strerror(api, r, b, sizeof b));
  }
  return 0;
}
