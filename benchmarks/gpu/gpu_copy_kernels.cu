// Copy-kernel ceiling on two GPUs, outside the engine: 1 GiB as 16,384
// shuffled 64 KiB pieces (random permutation on both sides, random order)
// copied by kernel variants (the engine's copy kernel = k0; more loads in
// flight, streaming cache hints, a warp per piece, table in host-mapped vs
// device memory, grid sizes) against cudaMemcpyPeerAsync of 1 GiB
// contiguous.  One process with peer access; "write" runs the kernel on the
// source GPU, "read" on the destination GPU.
//
//   nvcc -O3 -arch=sm_90 -std=c++17 -o gpu_copy_kernels benchmarks/gpu/gpu_copy_kernels.cu
//   ./gpu_copy_kernels        (needs two GPUs with peer access)
//
// Results (with torch's peer copy measured in the same run as the reference):
// benchmarks/README.md, "Copy-kernel ceiling".
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <random>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1);} } while (0)
typedef unsigned long long u64;

// k0: the engine's own copy kernel (csrc/gpu/copy_kernel.cu), built in.
#include "../../csrc/gpu/copy_kernel.cu"
#define k0 mc_copy_pieces
// V2: U loads in flight per thread
template <int U>
__global__ void __launch_bounds__(512) ku(const u64 *__restrict__ table, unsigned n) {
  for (unsigned i = blockIdx.x; i < n; i += gridDim.x) {
    char *d = (char *)table[3 * i]; const char *s = (const char *)table[3 * i + 1]; u64 len = table[3 * i + 2];
    u64 nv = len >> 4; uint4 *dv = (uint4 *)d; const uint4 *sv = (const uint4 *)s; u64 k = threadIdx.x;
    for (; k + (U - 1) * blockDim.x < nv; k += U * blockDim.x) {
      uint4 r[U];
#pragma unroll
      for (int j = 0; j < U; j++) r[j] = __ldcs(&sv[k + j * blockDim.x]);
#pragma unroll
      for (int j = 0; j < U; j++) __stcs(&dv[k + j * blockDim.x], r[j]);
    }
    for (; k < nv; k += blockDim.x) dv[k] = sv[k];
  }
}
// V3: a warp per piece, U in flight per lane
template <int U>
__global__ void __launch_bounds__(256) kw(const u64 *__restrict__ table, unsigned n) {
  unsigned warps = gridDim.x * (blockDim.x / 32);
  unsigned lane = threadIdx.x & 31;
  for (unsigned i = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; i < n; i += warps) {
    char *d = (char *)table[3 * i]; const char *s = (const char *)table[3 * i + 1]; u64 len = table[3 * i + 2];
    u64 nv = len >> 4; uint4 *dv = (uint4 *)d; const uint4 *sv = (const uint4 *)s; u64 k = lane;
    for (; k + (U - 1) * 32 < nv; k += U * 32) {
      uint4 r[U];
#pragma unroll
      for (int j = 0; j < U; j++) r[j] = sv[k + j * 32];
#pragma unroll
      for (int j = 0; j < U; j++) dv[k + j * 32] = r[j];
    }
    for (; k < nv; k += 32) dv[k] = sv[k];
  }
}

int main() {
  const size_t G = 1ull << 30, P = 64 << 10, N = G / P;
  int can; CK(cudaDeviceCanAccessPeer(&can, 0, 1)); if (!can) { printf("no peer\n"); return 1; }
  char *a, *b;
  CK(cudaSetDevice(1)); CK(cudaDeviceEnablePeerAccess(0, 0)); CK(cudaMalloc(&b, G)); CK(cudaMemset(b, 0, G));
  CK(cudaSetDevice(0)); CK(cudaDeviceEnablePeerAccess(1, 0)); CK(cudaMalloc(&a, G)); CK(cudaMemset(a, 7, G));
  std::vector<size_t> ps(N), pd(N), order(N);
  for (size_t i = 0; i < N; i++) ps[i] = pd[i] = order[i] = i;
  std::mt19937 rng(1); std::shuffle(ps.begin(), ps.end(), rng); std::shuffle(pd.begin(), pd.end(), rng);
  std::shuffle(order.begin(), order.end(), rng);
  for (int dir = 0; dir < 2; dir++) {  // 0: write (kernel on 0: local a -> peer b); 1: read (kernel on 1: peer a -> local b)
    int dev = dir == 0 ? 0 : 1;
    CK(cudaSetDevice(dev));
    cudaStream_t st; CK(cudaStreamCreate(&st));
    cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    u64 *ht, *dt; CK(cudaHostAlloc(&ht, N * 24, cudaHostAllocMapped)); CK(cudaMalloc(&dt, N * 24));
    for (size_t j = 0; j < N; j++) { size_t i = order[j]; ht[3*j] = (u64)(b + pd[i] * P); ht[3*j+1] = (u64)(a + ps[i] * P); ht[3*j+2] = P; }
    CK(cudaMemcpy(dt, ht, N * 24, cudaMemcpyHostToDevice));
    auto timeit = [&](const char *name, auto launch) {
      float best = 1e9;
      for (int r = 0; r < 8; r++) { CK(cudaEventRecord(e0, st)); launch(); CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); if (r && ms < best) best = ms; }
      CK(cudaGetLastError());
      printf("%s %-26s %7.1f GB/s\n", dir ? "read " : "write", name, G / (best * 1e-3) / 1e9); fflush(stdout);
      return best;
    };
    timeit("memcpyPeer 1GiB", [&] { CK(cudaMemcpyPeerAsync(b, 1, a, 0, G, st)); });
    timeit("memcpy (UVA) 1GiB", [&] { CK(cudaMemcpyAsync(b, a, G, cudaMemcpyDefault, st)); });
    unsigned g = N < 65535 ? N : 65535;
    timeit("k0 host table", [&] { u64 *t; cudaHostGetDevicePointer((void**)&t, ht, 0); k0<<<g, 512, 0, st>>>(t, N); });
    timeit("k0 device table", [&] { k0<<<g, 512, 0, st>>>(dt, N); });
    timeit("k0 dev grid 132*4", [&] { k0<<<132*4, 512, 0, st>>>(dt, N); });
    timeit("ku8 cs dev", [&] { ku<8><<<g, 512, 0, st>>>(dt, N); });
    timeit("ku8 cs grid 132*4", [&] { ku<8><<<132*4, 512, 0, st>>>(dt, N); });
    timeit("ku4 cs dev", [&] { ku<4><<<g, 512, 0, st>>>(dt, N); });
    timeit("kw8 256t dev", [&] { kw<8><<<(N + 7) / 8, 256, 0, st>>>(dt, N); });
    timeit("kw8 grid 132*8", [&] { kw<8><<<132*8, 256, 0, st>>>(dt, N); });
    timeit("kw16 grid 132*8", [&] { kw<16><<<132*8, 256, 0, st>>>(dt, N); });
    timeit("kw4 grid 132*8", [&] { kw<4><<<132*8, 256, 0, st>>>(dt, N); });
    // contiguous pieces in order, for reference
    for (size_t j = 0; j < N; j++) { ht[3*j] = (u64)(b + j * P); ht[3*j+1] = (u64)(a + j * P); ht[3*j+2] = P; }
    CK(cudaMemcpy(dt, ht, N * 24, cudaMemcpyHostToDevice));
    timeit("k0 dev in-order", [&] { k0<<<g, 512, 0, st>>>(dt, N); });
    timeit("kw8 grid in-order", [&] { kw<8><<<132*8, 256, 0, st>>>(dt, N); });
    // restore the shuffled table for the next direction
    CK(cudaFreeHost(ht)); CK(cudaFree(dt));
  }
  return 0;
}
