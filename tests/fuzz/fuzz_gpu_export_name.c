/* Same-host GPU export names from a peer's segment descriptor ("cuda_ipc"):
 * a legacy CUDA IPC handle in base64 or a driver-mapped export
 * "vmm1:<pid>:<tag>:<secret>:<index>", over arbitrary bytes.  Without a GPU
 * both stop after parsing (no driver): a malformed name must fail with a
 * message, never crash or read past the string. */
#include "fuzz_common.h"

#include "gpu/gpu_ipc.h"
#include "gpu/gpu_vmm.h"

FUZZ_INIT_QUIET()

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char *name = malloc(size + 1);
  if (!name)
    return 0;
  memcpy(name, data, size);
  name[size] = '\0';
  uint64_t mapped = 0;
  mc_err_t err = {0};
  if (mc_gpu_vmm_import(name, 0, &mapped, &err) == 0 || !err.msg[0])
    abort(); /* no GPU here: it can never succeed, and must say why */
  err.msg[0] = '\0';
  if (mc_gpu_ipc_open(name, 0, &mapped, &err) == 0 || !err.msg[0])
    abort();
  free(name);
  return 0;
}
