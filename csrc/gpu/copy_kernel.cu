// Gather/scatter copy kernels for many small GPU<->GPU pieces (same-host
// path).  Built to PTX once by `make ptx` (nvcc) into copy_kernel_ptx.h and
// JIT-loaded by the driver at run time (cuModuleLoadData), so the extension
// needs no CUDA toolkit at build time.  One CTA copies one piece of at most
// 64 KiB (the host splits larger copies).  mc_copy_pieces reads the pieces
// from a table in pinned host memory (mapped, reached through unified
// addressing); mc_copy_pieces_p takes up to MC_PARAM_PIECES of them in its
// kernel parameters (no read across the bus before the first byte moves).
#include <stdint.h>

#define MC_PARAM_PIECES 160

struct mc_piece_params {
  unsigned long long t[3 * MC_PARAM_PIECES];
  unsigned int n;
};

static __device__ __forceinline__ void copy_piece(char *d, const char *s,
                                                  unsigned long long len) {
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

extern "C" __global__ void __launch_bounds__(512)
mc_copy_pieces(const unsigned long long *__restrict__ table, unsigned int n) {
  for (unsigned int i = blockIdx.x; i < n; i += gridDim.x)
    copy_piece((char *)table[3 * i], (const char *)table[3 * i + 1], table[3 * i + 2]);
}

extern "C" __global__ void __launch_bounds__(512)
mc_copy_pieces_p(const __grid_constant__ mc_piece_params p) {
  for (unsigned int i = blockIdx.x; i < p.n; i += gridDim.x)
    copy_piece((char *)p.t[3 * i], (const char *)p.t[3 * i + 1], p.t[3 * i + 2]);
}
