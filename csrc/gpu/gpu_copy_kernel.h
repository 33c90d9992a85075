/* Many small GPU-to-GPU copies in one kernel launch (copy_kernel.cu): SMs
 * move the pieces, each CTA one piece of <= 64 KiB, so thousands of 64 KiB
 * KV blocks between two GPUs run near link speed where one copy-engine
 * operation per block would not.  The PTX is JIT-loaded per device. */
#ifndef MC_GPU_GPU_COPY_KERNEL_H
#define MC_GPU_GPU_COPY_KERNEL_H

#include <stddef.h>

#include "gpu/cuda_driver.h"
#include "util/errors.h"

#define MC_COPY_PIECE_MAX (64u << 10)
/* Up to this many copies (any size) travel in the kernel's parameters (no
 * table). */
#define MC_COPY_PARAM_REQS 128u
#define MC_COPY_PARAM_REQS_SMALL 8u /* mc_copy_reqs_p8: a few copies, a small block */

/* Bytes of piece table the copies need (24 per piece of <= 64 KiB). */
size_t mc_copy_kernel_table_bytes(const size_t *sizes, size_t count);

/* Pieces of <= MC_COPY_PIECE_MAX bytes the copies make. */
size_t mc_copy_kernel_pieces(const size_t *sizes, size_t count);

/* Launches the copies on `stream` (the context of `device` must be current).
 * Up to MC_COPY_PARAM_REQS copies go in the kernel parameters (`table` may
 * then be NULL); more need `table`: mapped pinned host memory of
 * table_bytes(...) bytes that must stay untouched until the stream passes
 * this launch.  MC_EUNAVAIL if the
 * kernel cannot be loaded here (the caller falls back to driver copies). */
int mc_copy_kernel_launch(int device, const mc_cu_ptr *dsts, const mc_cu_ptr *srcs,
                          const size_t *sizes, size_t count, void *table, mc_cu_stream stream,
                          mc_err_t *err);

#endif
