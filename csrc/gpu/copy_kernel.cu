// Gather/scatter copy kernels for many small GPU<->GPU pieces (same-host
// path).  Built to PTX once by `make ptx` (nvcc) into copy_kernel_ptx.h and
// JIT-loaded by the driver at run time (cuModuleLoadData), so the extension
// needs no CUDA toolkit at build time.  One CTA copies one piece of at most
// 64 KiB.  mc_copy_pieces reads the pieces (the host splits larger copies)
// from a table in pinned host memory (mapped, reached through unified
// addressing); mc_copy_reqs_p takes up to MC_PARAM_REQS copies of any size
// in its kernel parameters (no read across the bus before the first byte
// moves) and finds its piece of them itself.
#include <stdint.h>

#define MC_PARAM_REQS 128
#define MC_PARAM_REQS_SMALL 8
#define MC_PIECE (64ull << 10)

// Up to N copies in the kernel parameters (N = MC_PARAM_REQS, or
// MC_PARAM_REQS_SMALL for a few copies: a smaller parameter block is
// quicker to launch).
template <int N> struct mc_req_params {
  unsigned long long dst[N], src[N], len[N];
  unsigned int first[N + 1]; // piece index where copy i starts; [n] = total
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

template <int N> static __device__ __forceinline__ void copy_reqs(const mc_req_params<N> &p) {
  unsigned int total = p.first[p.n];
  for (unsigned int b = blockIdx.x; b < total; b += gridDim.x) {
    // The copy holding piece b: first[lo] <= b < first[hi].
    unsigned int lo = 0, hi = p.n;
    while (hi - lo > 1) {
      unsigned int mid = (lo + hi) / 2;
      if (p.first[mid] <= b)
        lo = mid;
      else
        hi = mid;
    }
    unsigned long long off = (unsigned long long)(b - p.first[lo]) * MC_PIECE;
    unsigned long long len = p.len[lo] - off;
    copy_piece((char *)p.dst[lo] + off, (const char *)p.src[lo] + off,
               len < MC_PIECE ? len : MC_PIECE);
  }
}

extern "C" __global__ void __launch_bounds__(512)
mc_copy_reqs_p(const __grid_constant__ mc_req_params<MC_PARAM_REQS> p) {
  copy_reqs<MC_PARAM_REQS>(p);
}

extern "C" __global__ void __launch_bounds__(512)
mc_copy_reqs_p8(const __grid_constant__ mc_req_params<MC_PARAM_REQS_SMALL> p) {
  copy_reqs<MC_PARAM_REQS_SMALL>(p);
}
