/* Driver-mapped GPU memory (CUDA virtual memory management, cuMem*):
 * several physical allocations (cuMemCreate) mapped back to back into one
 * reserved virtual range, as vLLM 0.34's extensible KV cache does.
 *
 * Legacy CUDA IPC (cuIpcGetMemHandle) cannot export such memory.  Here:
 *  - the chunk walk: which physical allocations back [addr, addr+len), each
 *    as the virtual range it is mapped at (shared by the same-host export and
 *    the per-chunk DMA-BUF registration for RDMA);
 *  - same-host sharing: the owner exports each chunk as a POSIX file
 *    descriptor (cuMemExportToShareableHandle) on demand and passes the fds
 *    over a Unix domain socket (abstract namespace, SCM_RIGHTS) to a peer
 *    that presents the export's secret and runs under the same uid.  The
 *    name "vmm1:<pid>:<tag>:<secret>:<index>" travels in the segment
 *    descriptor (the tag names the socket; the secret is not in it); the peer
 *    imports them (cuMemImportFromShareableHandle) and maps them back to back
 *    into a range it reserved (cuMemAddressReserve, cuMemMap,
 *    cuMemSetAccess), so offsets inside the export are the same on both
 *    sides.  Works only when the chunks were created with the POSIX fd handle
 *    type (vLLM: the connector declares KVCacheAccess.EXPORTS_FD).
 */
#ifndef MC_GPU_GPU_VMM_H
#define MC_GPU_GPU_VMM_H

#include <stddef.h>
#include <stdint.h>

#include "util/errors.h"

#define MC_GPU_VMM_MAX_CHUNKS 65536
#define MC_GPU_VMM_PREFIX "vmm1:"

typedef struct mc_gpu_chunk {
  uint64_t base; /* where the physical allocation is mapped */
  uint64_t size; /* bytes of that mapping */
} mc_gpu_chunk_t;

/* 1 if `addr` lies in driver-mapped (cuMem) memory, 0 if not (classic
 * cuMemAlloc memory, host memory, no driver). */
int mc_gpu_vmm_is_mapped(uint64_t addr);

/* The chunks backing [addr, addr+len), in address order, back to back:
 * (*out)[0].base <= addr, the last one ends at or after addr+len.  *out is
 * malloc'ed (the caller frees it).  MC_EUNAVAIL if addr is not driver-mapped
 * memory; MC_EINVAL naming the address if the range has a hole (an unmapped
 * or non-cuMem stretch) or is not on one device. */
int mc_gpu_vmm_chunks(uint64_t addr, uint64_t len, mc_gpu_chunk_t **out, size_t *n,
                      mc_err_t *err);

/* Pure part of the walk, for tests: given a lookup `range_at(ctx, a, &base,
 * &size)` (0 if a is mapped, giving its chunk), the chunks covering
 * [addr, addr+len).  Same results as mc_gpu_vmm_chunks. */
typedef int (*mc_gpu_range_fn)(void *ctx, uint64_t a, uint64_t *base, uint64_t *size);
int mc_gpu_vmm_walk(mc_gpu_range_fn range_at, void *ctx, uint64_t addr, uint64_t len,
                    mc_gpu_chunk_t **out, size_t *n, mc_err_t *err);

/* The pieces of [addr, addr+len) that lie in one physical chunk each, as
 * (start, len) pairs (malloc'ed into *pairs): what RDMA registers one MR per
 * (DMA-BUF export covers one physical allocation).  Returns the count, 0
 * when the range is not driver-mapped memory or lies in one chunk (one MR as
 * before), or a negative code (a hole, another device) with err set. */
long mc_gpu_vmm_pieces(uint64_t addr, uint64_t len, uint64_t **pairs, mc_err_t *err);
/* Pure part of it: clips chunks (from a walk of [addr, addr+len)) to the
 * range.  Returns n, or MC_ENOMEM. */
long mc_gpu_chunks_clip(const mc_gpu_chunk_t *ch, size_t n, uint64_t addr, uint64_t len,
                        uint64_t **pairs);

/* Exports [addr, addr+len) of driver-mapped memory on cuda:`device` for
 * same-host peers: checks every chunk can be exported as a POSIX fd, starts
 * the fd server (once per process) and writes the export's name (at most
 * `cap` bytes, "vmm1:..." ) and where the exported range starts (*base, the
 * first chunk's base).  MC_EUNAVAIL with the reason (and the fix) when the
 * chunks were created without the POSIX fd handle type. */
int mc_gpu_vmm_export(uint64_t addr, uint64_t len, int device, char *name, size_t cap,
                      uint64_t *base, mc_err_t *err);

/* Imports the export `name` (from a peer's segment descriptor) into this
 * process for use from cuda:`device`; *mapped is where the export's base
 * appears here.  The caller caches the result (one import per export). */
int mc_gpu_vmm_import(const char *name, int device, uint64_t *mapped, mc_err_t *err);

/* Undoes the import mapped at `mapped` (cuMemUnmap of each chunk,
 * cuMemAddressFree of the range; the handles were released at import, so
 * the physical memory goes once the exporter let go of it too).  The caller
 * makes sure nothing uses the range any more and that the device's context
 * is current.  MC_EINVAL if `mapped` is no import of this process. */
int mc_gpu_vmm_unimport(uint64_t mapped, mc_err_t *err);

#endif
