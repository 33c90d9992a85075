// Gather/scatter copy kernel for many small GPU<->GPU pieces (same-host
// path).  Built to PTX once by `make ptx` (nvcc) into copy_kernel_ptx.h and
// JIT-loaded by the driver at run time (cuModuleLoadData), so the extension
// needs no CUDA toolkit at build time.  One CTA copies one piece of at most
// 64 KiB (the host splits larger copies); pieces are read from a table in
// pinned host memory (mapped, reached through unified addressing).
#include <stdint.h>

extern "C" __global__ void __launch_bounds__(512)
mc_copy_pieces(const unsigned long long *__restrict__ table, unsigned int n) {
  for (unsigned int i = blockIdx.x; i < n; i += gridDim.x) {
    char *d = (char *)table[3 * i];
    const char *s = (const char *)table[3 * i + 1];
    unsigned long long len = table[3 * i + 2];
    if (((((uintptr_t)d) | ((uintptr_t)s)) & 15) == 0) {
      unsigned long long nv = len >> 4;
      uint4 *dv = (uint4 *)d;
      const uint4 *sv = (const uint4 *)s;
      unsigned long long k = threadIdx.x;
      // Four loads in flight per thread before the stores.
      for (; k + 3 * blockDim.x < nv; k += 4 * blockDim.x) {
        uint4 a = sv[k], b = sv[k + blockDim.x], c = sv[k + 2 * blockDim.x],
              e = sv[k + 3 * blockDim.x];
        dv[k] = a;
        dv[k + blockDim.x] = b;
        dv[k + 2 * blockDim.x] = c;
        dv[k + 3 * blockDim.x] = e;
      }
      for (; k < nv; k += blockDim.x)
        dv[k] = sv[k];
      for (unsigned long long t = (nv << 4) + threadIdx.x; t < len; t += blockDim.x)
        d[t] = s[t];
    } else {
      for (unsigned long long t = threadIdx.x; t < len; t += blockDim.x)
        d[t] = s[t];
    }
  }
}
