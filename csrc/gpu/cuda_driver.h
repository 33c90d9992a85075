/* The CUDA driver API, loaded from libcuda.so.1 at run time.
 *
 * Nothing here needs CUDA headers or libraries at build time: the few types,
 * constants and signatures used are declared below (they are part of the
 * driver's stable ABI), and the library is dlopen'ed on first use, so one
 * build imports and runs on hosts with or without a GPU.
 */
#ifndef MC_GPU_CUDA_DRIVER_H
#define MC_GPU_CUDA_DRIVER_H

#include <stddef.h>
#include <stdint.h>

#include "util/errors.h"

typedef int mc_cu_result;    /* CUresult; 0 = CUDA_SUCCESS */
typedef uint64_t mc_cu_ptr;  /* CUdeviceptr */
typedef void *mc_cu_stream;  /* CUstream */
typedef void *mc_cu_context; /* CUcontext */
typedef int mc_cu_device;    /* CUdevice */

enum {
  MC_CU_POINTER_ATTRIBUTE_CONTEXT = 1,
  MC_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
  MC_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
  MC_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11,
  MC_CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12,
  MC_CU_MEMORYTYPE_HOST = 1,
  MC_CU_MEMORYTYPE_DEVICE = 2,
  MC_CU_MEMORYTYPE_UNIFIED = 4,
};

typedef struct mc_cuda_api {
  mc_cu_result (*cuInit)(unsigned flags);
  mc_cu_result (*cuDeviceGetCount)(int *count);
  mc_cu_result (*cuDeviceGet)(mc_cu_device *dev, int ordinal);
  mc_cu_result (*cuPointerGetAttribute)(void *data, int attribute, mc_cu_ptr ptr);
  mc_cu_result (*cuGetErrorName)(mc_cu_result err, const char **str);
  mc_cu_result (*cuGetErrorString)(mc_cu_result err, const char **str);
  mc_cu_result (*cuDevicePrimaryCtxRetain)(mc_cu_context *ctx, mc_cu_device dev);
  mc_cu_result (*cuCtxSetCurrent)(mc_cu_context ctx);
  mc_cu_result (*cuMemcpyHtoD)(mc_cu_ptr dst, const void *src, size_t n);
  mc_cu_result (*cuMemcpyDtoH)(void *dst, mc_cu_ptr src, size_t n);
  int driver_version;
  int device_count;
} mc_cuda_api_t;

/* Loads libcuda.so.1 and calls cuInit(0), once per process.  Returns the
 * function table, or NULL with MC_EUNAVAIL naming the library and package
 * (not installed) or the driver's error (no usable GPU).  Thread-safe. */
const mc_cuda_api_t *mc_cuda_api(mc_err_t *err);

/* Where does [addr, addr+len) live?  Returns 1 and sets *device if it is
 * one CUDA device allocation (managed memory counts as device memory of its
 * ordinal), 0 if it is host memory the driver does not know (or no CUDA
 * driver is installed), or a negative code: MC_EINVAL when the range starts
 * in a device allocation but runs past its end. */
int mc_cuda_locate(uint64_t addr, uint64_t len, int *device, mc_err_t *err);

/* Formats a CUresult as "CUDA_ERROR_X: text". */
const char *mc_cuda_strerror(const mc_cuda_api_t *api, mc_cu_result r, char *buf, size_t n);

#endif
