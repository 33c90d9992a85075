/* GPUDirect RDMA registration of GPU memory, for the RDMA transport.
 *
 * Two ways exist for a NIC to DMA into GPU memory:
 *  1. DMA-BUF: the CUDA driver exports the range as a dma-buf file
 *     descriptor (cuMemGetHandleForAddressRange) and the verbs library
 *     registers that (ibv_reg_dmabuf_mr).  Needs CUDA >= 11.7 with the open
 *     GPU kernel modules, Linux >= 5.12 and a NIC driver with dma-buf
 *     support (mlx5 in-tree or MLNX_OFED >= 5.5).
 *  2. nvidia-peermem: plain ibv_reg_mr on the device pointer, which works
 *     only while the nvidia_peermem kernel module is loaded; without it the
 *     kernel answers EFAULT ("Bad address").
 * mc_gpu_rdma_reg_mr tries 1, then 2, and on failure says which path failed
 * and what to check.  The verbs side is dlopen'ed (util/dynlib.h) and kept
 * to these two calls; the RDMA transport owns the protection domain.
 */
#ifndef MC_GPU_GPU_DMABUF_H
#define MC_GPU_GPU_DMABUF_H

#include <stdint.h>

#include "util/errors.h"

/* Exports [addr, addr+len) of GPU memory as a dma-buf: *fd (the caller
 * closes it) covers the page-aligned range around it, *offset is where addr
 * lies inside it.  MC_EUNAVAIL with the driver's reason when the GPU, driver
 * or kernel cannot. */
int mc_gpu_dmabuf_fd(uint64_t addr, uint64_t len, int *fd, uint64_t *offset, uint64_t *span,
                     mc_err_t *err);

/* Registers GPU memory [addr, addr+len) with the verbs protection domain
 * `pd` (struct ibv_pd *) and access flags (IBV_ACCESS_*): DMA-BUF first,
 * nvidia-peermem second.  Returns the struct ibv_mr * (release it with
 * ibv_dereg_mr), or NULL with err naming both paths' failures.  *how (may be
 * NULL) is set to "dmabuf" or "peermem". */
void *mc_gpu_rdma_reg_mr(void *pd, uint64_t addr, uint64_t len, int access, const char **how,
                         mc_err_t *err);

#endif
