#include "gpu/gpu_dmabuf.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "gpu/cuda_driver.h"
#include "util/dynlib.h"

int mc_gpu_dmabuf_fd(uint64_t addr, uint64_t len, int *fd, uint64_t *offset, uint64_t *span,
                     mc_err_t *err) {
  const mc_cuda_api_t *api = mc_cuda_api(err);
  if (!api)
    return err ? err->code : MC_EUNAVAIL;
  int dev = -1;
  int rc = mc_cuda_locate(addr, len, &dev, err);
  if (rc < 0)
    return rc;
  if (rc == 0)
    return mc_err_set(err, MC_EINVAL, "0x%llx is not GPU memory; register host memory with "
                      "ibv_reg_mr directly", (unsigned long long)addr);
  if (!api->cuMemGetHandleForAddressRange)
    return mc_err_set(err, MC_EUNAVAIL, "DMA-BUF export needs CUDA 11.7+; this driver (%d) "
                      "has no cuMemGetHandleForAddressRange", api->driver_version);
  int supported = 0;
  mc_cu_device d;
  if (api->cuDeviceGet(&d, dev) == 0)
    api->cuDeviceGetAttribute(&supported, MC_CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, d);
  if (!supported)
    return mc_err_set(err, MC_EUNAVAIL,
                      "cuda:%d does not support DMA-BUF export (CU_DEVICE_ATTRIBUTE_DMA_BUF_"
                      "SUPPORTED is 0): it needs the open NVIDIA kernel modules "
                      "(nvidia-open), driver 515+ and Linux 5.12+", dev);
  long page = sysconf(_SC_PAGESIZE);
  uint64_t pg = page > 0 ? (uint64_t)page : 4096;
  uint64_t start = addr & ~(pg - 1);
  uint64_t end = (addr + len + pg - 1) & ~(pg - 1);
  if ((rc = mc_cuda_use_device(dev, err)) < 0)
    return rc;
  int h = -1;
  mc_cu_result r = api->cuMemGetHandleForAddressRange(&h, start, end - start,
                                                      MC_CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  if (r != 0) {
    char b[160];
    return mc_err_set(err, MC_EUNAVAIL,
                      "cuMemGetHandleForAddressRange(0x%llx, %llu) on cuda:%d failed: %s; "
                      "DMA-BUF needs the open NVIDIA kernel modules and Linux 5.12+",
                      (unsigned long long)start, (unsigned long long)(end - start), dev,
                      mc_cuda_strerror(api, r, b, sizeof b));
  }
  *fd = h;
  *offset = addr - start;
  if (span)
    *span = end - start;
  return 0;
}

typedef void *(*reg_dmabuf_fn)(void *pd, uint64_t offset, size_t length, uint64_t iova, int fd,
                               int access);
typedef void *(*reg_mr_fn)(void *pd, void *addr, size_t length, int access);

void *mc_gpu_rdma_reg_mr(void *pd, uint64_t addr, uint64_t len, int access, const char **how,
                         mc_err_t *err) {
  void *lib = mc_dynlib_open(&mc_dynlib_ibverbs, err);
  if (!lib)
    return NULL;
  char why1[300] = "", why2[300] = "";
  /* 1. DMA-BUF. */
  mc_err_t e = {0};
  reg_dmabuf_fn reg_dmabuf = (reg_dmabuf_fn)mc_dynlib_sym(lib, &mc_dynlib_ibverbs,
                                                          "ibv_reg_dmabuf_mr", &e);
  int fd = -1;
  uint64_t off = 0;
  if (!reg_dmabuf) {
    snprintf(why1, sizeof why1, "libibverbs has no ibv_reg_dmabuf_mr (rdma-core 34+ needed)");
  } else if (mc_gpu_dmabuf_fd(addr, len, &fd, &off, NULL, &e) < 0) {
    snprintf(why1, sizeof why1, "%s", e.msg);
  } else {
    errno = 0;
    void *mr = reg_dmabuf(pd, off, (size_t)len, addr, fd, access);
    int en = errno;
    close(fd); /* the MR keeps its own reference */
    if (mr) {
      if (how)
        *how = "dmabuf";
      return mr;
    }
    snprintf(why1, sizeof why1, "ibv_reg_dmabuf_mr failed: %s (the NIC driver needs dma-buf "
             "support: in-tree mlx5 on Linux 5.12+ or MLNX_OFED 5.5+)",
             en ? strerror(en) : "unknown error");
  }
  /* 2. nvidia-peermem. */
  reg_mr_fn reg_mr = (reg_mr_fn)mc_dynlib_sym(lib, &mc_dynlib_ibverbs, "ibv_reg_mr", &e);
  if (reg_mr) {
    errno = 0;
    void *mr = reg_mr(pd, (void *)(uintptr_t)addr, (size_t)len, access);
    int en = errno;
    if (mr) {
      if (how)
        *how = "peermem";
      return mr;
    }
    snprintf(why2, sizeof why2, "ibv_reg_mr on the device pointer failed: %s%s",
             en ? strerror(en) : "unknown error",
             en == EFAULT ? " - the nvidia_peermem kernel module is not loaded (check "
                            "`lsmod | grep nvidia_peermem`; `modprobe nvidia-peermem`)"
                          : "");
  } else {
    snprintf(why2, sizeof why2, "libibverbs has no ibv_reg_mr");
  }
  mc_err_set(err, MC_EUNAVAIL,
             "GPUDirect RDMA registration of GPU memory [0x%llx, +%llu) failed on both paths: "
             "DMA-BUF: %s; nvidia-peermem: %s",
             (unsigned long long)addr, (unsigned long long)len, why1, why2);
  return NULL;
}
