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
typedef void *mc_cu_event;   /* CUevent */

#define MC_CU_IPC_HANDLE_SIZE 64
typedef struct mc_cu_ipc_handle {
  unsigned char data[MC_CU_IPC_HANDLE_SIZE];
} mc_cu_ipc_handle_t; /* CUipcMemHandle */

/* CUmemcpyAttributes (CUDA 12.8+), for cuMemcpyBatchAsync. */
typedef struct mc_cu_memcpy_attrs {
  int src_access_order; /* CUmemcpySrcAccessOrder */
  int src_loc_type, src_loc_id; /* CUmemLocation srcLocHint */
  int dst_loc_type, dst_loc_id; /* CUmemLocation dstLocHint */
  unsigned flags;
} mc_cu_memcpy_attrs_t;

/* CUmemGenericAllocationHandle and the cuMem* structures (stable ABI). */
typedef unsigned long long mc_cu_mem_handle;
typedef struct mc_cu_mem_location {
  int type; /* CUmemLocationType: 1 = device */
  int id;
} mc_cu_mem_location_t;
typedef struct mc_cu_mem_alloc_prop {
  int type;                  /* CUmemAllocationType: 1 = pinned */
  int requested_handle_types; /* CUmemAllocationHandleType bits */
  mc_cu_mem_location_t location;
  void *win32_handle_meta_data;
  struct {
    unsigned char compression_type;
    unsigned char gpu_direct_rdma_capable;
    unsigned short usage;
    unsigned char reserved[4];
  } alloc_flags;
} mc_cu_mem_alloc_prop_t; /* CUmemAllocationProp */
typedef struct mc_cu_mem_access_desc {
  mc_cu_mem_location_t location;
  int flags; /* CUmemAccess_flags: 3 = read/write */
} mc_cu_mem_access_desc_t;

enum {
  MC_CU_MEM_ALLOCATION_TYPE_PINNED = 1,
  MC_CU_MEM_LOCATION_TYPE_DEVICE = 1,
  MC_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1,
  MC_CU_MEM_HANDLE_TYPE_FABRIC = 8,
  MC_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,
  MC_CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0,
  MC_CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10,
  MC_CU_POINTER_ATTRIBUTE_MAPPED = 13,
};

enum {
  MC_CU_POINTER_ATTRIBUTE_CONTEXT = 1,
  MC_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
  MC_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
  MC_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11,
  MC_CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12,
  MC_CU_MEMORYTYPE_HOST = 1,
  MC_CU_MEMORYTYPE_DEVICE = 2,
  MC_CU_MEMORYTYPE_UNIFIED = 4,
  MC_CU_STREAM_NON_BLOCKING = 1,
  MC_CU_EVENT_DISABLE_TIMING = 2,
  MC_CU_MEMHOSTALLOC_PORTABLE = 1,
  MC_CU_MEMHOSTALLOC_DEVICEMAP = 2,
  MC_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1,
  MC_CU_ERROR_NOT_READY = 600,
  MC_CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1,
  MC_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1,
  MC_CU_MEMCPY_SRC_ACCESS_ORDER_ANY = 3,
  MC_CU_DEVICE_ATTRIBUTE_PCI_BUS_ID = 33,
  MC_CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID = 34,
  MC_CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID = 50,
  MC_CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124,
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
  mc_cu_result (*cuDriverGetVersion)(int *version);
  mc_cu_result (*cuDeviceGetAttribute)(int *v, int attrib, mc_cu_device dev);
  mc_cu_result (*cuCtxGetCurrent)(mc_cu_context *ctx);
  mc_cu_result (*cuStreamCreate)(mc_cu_stream *s, unsigned flags);
  mc_cu_result (*cuStreamDestroy)(mc_cu_stream s);
  mc_cu_result (*cuStreamSynchronize)(mc_cu_stream s);
  mc_cu_result (*cuEventCreate)(mc_cu_event *e, unsigned flags);
  mc_cu_result (*cuEventDestroy)(mc_cu_event e);
  mc_cu_result (*cuEventRecord)(mc_cu_event e, mc_cu_stream s);
  mc_cu_result (*cuEventQuery)(mc_cu_event e);
  mc_cu_result (*cuEventSynchronize)(mc_cu_event e);
  mc_cu_result (*cuMemHostAlloc)(void **p, size_t n, unsigned flags);
  mc_cu_result (*cuMemFreeHost)(void *p);
  mc_cu_result (*cuMemcpy)(mc_cu_ptr dst, mc_cu_ptr src, size_t n);
  mc_cu_result (*cuMemcpyAsync)(mc_cu_ptr dst, mc_cu_ptr src, size_t n, mc_cu_stream s);
  mc_cu_result (*cuMemcpyHtoDAsync)(mc_cu_ptr dst, const void *src, size_t n, mc_cu_stream s);
  mc_cu_result (*cuMemcpyDtoHAsync)(void *dst, mc_cu_ptr src, size_t n, mc_cu_stream s);
  /* Optional (NULL when the driver lacks them). */
  mc_cu_result (*cuIpcGetMemHandle)(mc_cu_ipc_handle_t *h, mc_cu_ptr p);
  mc_cu_result (*cuIpcOpenMemHandle)(mc_cu_ptr *p, mc_cu_ipc_handle_t h, unsigned flags);
  mc_cu_result (*cuIpcCloseMemHandle)(mc_cu_ptr p);
  mc_cu_result (*cuMemGetHandleForAddressRange)(void *handle, mc_cu_ptr p, size_t n, int type,
                                                unsigned long long flags);
  mc_cu_result (*cuPointerGetAttributes)(unsigned n, int *attrs, void **data, mc_cu_ptr p);
  mc_cu_result (*cuModuleLoadData)(void **module, const void *image);
  mc_cu_result (*cuModuleGetFunction)(void **fn, void *module, const char *name);
  mc_cu_result (*cuLaunchKernel)(void *fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                 unsigned by, unsigned bz, unsigned smem, mc_cu_stream s,
                                 void **params, void **extra);
  /* cuMemcpyBatchAsync: the CUDA 13 form (no failIdx) or the 12.8 one. */
  mc_cu_result (*cuMemcpyBatchAsync13)(mc_cu_ptr *dsts, mc_cu_ptr *srcs, size_t *sizes,
                                       size_t count, mc_cu_memcpy_attrs_t *attrs,
                                       size_t *attr_idx, size_t nattrs, mc_cu_stream s);
  mc_cu_result (*cuMemcpyBatchAsync12)(mc_cu_ptr *dsts, mc_cu_ptr *srcs, size_t *sizes,
                                       size_t count, mc_cu_memcpy_attrs_t *attrs,
                                       size_t *attr_idx, size_t nattrs, size_t *fail_idx,
                                       mc_cu_stream s);
  /* Virtual memory management (cuMem*): driver-mapped memory such as
   * vLLM's extensible KV cache; optional (NULL on drivers without them). */
  mc_cu_result (*cuMemGetAddressRange)(mc_cu_ptr *base, size_t *size, mc_cu_ptr p);
  mc_cu_result (*cuMemRetainAllocationHandle)(mc_cu_mem_handle *h, void *addr);
  mc_cu_result (*cuMemRelease)(mc_cu_mem_handle h);
  mc_cu_result (*cuMemExportToShareableHandle)(void *shareable, mc_cu_mem_handle h, int type,
                                               unsigned long long flags);
  mc_cu_result (*cuMemImportFromShareableHandle)(mc_cu_mem_handle *h, void *shareable, int type);
  mc_cu_result (*cuMemGetAllocationPropertiesFromHandle)(mc_cu_mem_alloc_prop_t *prop,
                                                         mc_cu_mem_handle h);
  mc_cu_result (*cuMemAddressReserve)(mc_cu_ptr *p, size_t size, size_t align, mc_cu_ptr addr,
                                      unsigned long long flags);
  mc_cu_result (*cuMemAddressFree)(mc_cu_ptr p, size_t size);
  mc_cu_result (*cuMemMap)(mc_cu_ptr p, size_t size, size_t offset, mc_cu_mem_handle h,
                           unsigned long long flags);
  mc_cu_result (*cuMemUnmap)(mc_cu_ptr p, size_t size);
  mc_cu_result (*cuMemSetAccess)(mc_cu_ptr p, size_t size, const mc_cu_mem_access_desc_t *desc,
                                 size_t count);
  mc_cu_result (*cuMemCreate)(mc_cu_mem_handle *h, size_t size,
                              const mc_cu_mem_alloc_prop_t *prop, unsigned long long flags);
  mc_cu_result (*cuMemGetAllocationGranularity)(size_t *g, const mc_cu_mem_alloc_prop_t *prop,
                                                int option);
  mc_cu_result (*cuStreamQuery)(mc_cu_stream s); /* optional */
  mc_cu_result (*cuEventElapsedTime)(float *ms, mc_cu_event start, mc_cu_event end); /* optional */
  int driver_version;
  int device_count;
} mc_cuda_api_t;

/* Loads libcuda.so.1 and calls cuInit(0), once per process.  Returns the
 * function table, or NULL with MC_EUNAVAIL naming the library and package
 * (not installed) or the driver's error (no usable GPU).  Thread-safe. */
const mc_cuda_api_t *mc_cuda_api(mc_err_t *err);

/* The table only if libcuda is already loaded in this process (by us or by
 * a framework such as torch); NULL otherwise, without loading it.  Cheap:
 * lets CPU-only callers skip pointer checks. */
const mc_cuda_api_t *mc_cuda_api_if_loaded(void);

/* Where does [addr, addr+len) live?  Returns 1 and sets *device if it is
 * one CUDA device allocation (managed memory counts as device memory of its
 * ordinal), 0 if it is host memory the driver does not know (or no CUDA
 * driver is installed), or a negative code: MC_EINVAL when the range starts
 * in a device allocation but runs past its end. */
int mc_cuda_locate(uint64_t addr, uint64_t len, int *device, mc_err_t *err);

/* Makes the primary context of `device` current on the calling thread
 * (retained once per device for the life of the process). */
int mc_cuda_use_device(int device, mc_err_t *err);

/* The same for a while on a thread that is not ours (a submitting
 * thread): *saved gets the context that was current; returns 1 when it
 * changed it (then mc_cuda_leave_device(saved, 1) puts it back), 0 when
 * `device`'s was current already, or a negative code. */
int mc_cuda_enter_device(int device, mc_cu_context *saved, mc_err_t *err);
void mc_cuda_leave_device(mc_cu_context saved, int changed);

/* Copies `count` (dst, src, size) triples, any mix of host/device memory
 * (unified addressing), on `stream`: one cuMemcpyBatchAsync when the driver
 * has it (CUDA 12.8+), else one cuMemcpyAsync each.  Asynchronous. */
int mc_cuda_copy_batch(mc_cu_ptr *dsts, mc_cu_ptr *srcs, size_t *sizes, size_t count,
                       mc_cu_stream stream, mc_err_t *err);

/* memcpy that also works when either side is GPU memory (a synchronous
 * driver copy then; plain memcpy otherwise, without touching CUDA unless
 * the process loaded it).  Blocks: never call it on an I/O thread. */
int mc_cuda_memcpy_any(void *dst, const void *src, size_t n, mc_err_t *err);

/* Like mc_cuda_locate, also giving the allocation [*start, *start+*size)
 * so callers can answer later queries inside it without the driver. */
int mc_cuda_locate_range(uint64_t addr, uint64_t len, int *device, uint64_t *start,
                         uint64_t *size, mc_err_t *err);

/* Formats a CUresult as "CUDA_ERROR_X: text". */
const char *mc_cuda_strerror(const mc_cuda_api_t *api, mc_cu_result r, char *buf, size_t n);

#endif
