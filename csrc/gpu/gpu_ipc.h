/* Same-host GPU memory sharing between processes: CUDA IPC handles.
 *
 * The owner of a cuda region exports the handle of the allocation holding
 * it (cuIpcGetMemHandle, base64 in the segment descriptor); a process on
 * the same host opens it once (cuIpcOpenMemHandle with lazy peer access, so
 * the copy runs over NVLink/PCIe peer-to-peer) and copies with the copy
 * engines directly between the two GPUs.  Opened mappings are shared per
 * (handle, device) and process and reference-counted: the last user's
 * mc_gpu_ipc_release unmaps one (cuIpcCloseMemHandle, or the cuMem
 * import's unmap), so a peer that exited, slept or re-registered does not
 * keep its GPU memory alive through us.
 */
#ifndef MC_GPU_GPU_IPC_H
#define MC_GPU_GPU_IPC_H

#include <stddef.h>
#include <stdint.h>

#include "util/errors.h"

#define MC_GPU_IPC_B64_MAX 96 /* 64 bytes -> 88 chars + NUL */

/* Exports the allocation holding device address `addr`: its IPC handle as
 * base64 and the allocation's start.  MC_EUNAVAIL when the memory cannot be
 * shared this way (e.g. cuMem/VMM or managed memory); callers then use TCP. */
int mc_gpu_ipc_export(uint64_t addr, char out_b64[MC_GPU_IPC_B64_MAX], uint64_t *alloc_base,
                      mc_err_t *err);

/* Exports [addr, addr+len) of cuda:`device` memory for same-host peers:
 * driver-mapped (cuMem) memory as POSIX fds of its physical chunks
 * (gpu_vmm.h: `out` is then "vmm1:...", *alloc_base the first chunk's
 * base), classic allocations as above.  MC_EUNAVAIL with the reason and the
 * fix when neither works. */
int mc_gpu_ipc_export_range(uint64_t addr, uint64_t len, int device,
                            char out[MC_GPU_IPC_B64_MAX], uint64_t *alloc_base, mc_err_t *err);

/* Maps the allocation named by `b64` (or a "vmm1:" export) into this process for use from cuda
 * device `device`; *mapped is where the allocation's start appears here.
 * Mapped once per (b64, device) and process: each success takes a
 * reference, given back with mc_gpu_ipc_release(*mapped, device). */
int mc_gpu_ipc_open(const char *b64, int device, uint64_t *mapped, mc_err_t *err);

/* Another reference to the mapping at `mapped` on `device`: 0, or -1 when
 * no such mapping is open. */
int mc_gpu_ipc_retain(uint64_t mapped, int device);

/* Gives back one reference; the last one unmaps it.  The caller makes sure
 * no copy still uses the range (a copy job holds its reference until it
 * completed).  Takes the process-wide lock of the mappings; may make the
 * device's context current on this thread for the call (put back after). */
void mc_gpu_ipc_release(uint64_t mapped, int device);

/* How many peer mappings are open in this process. */
size_t mc_gpu_ipc_open_count(void);

/* "boot_id/hostname": equal for two processes iff they share a kernel. */
const char *mc_host_identity(void);

#endif
