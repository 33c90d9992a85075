// Copy variants for 1 GiB as shuffled 64 KiB pieces between two GPUs: the
// engine's LD/ST kernel, Hopper bulk copies (TMA, cp.async.bulk) through
// shared memory, copy-engine batches (cudaMemcpyBatchAsync), and SM +
// copy-engine hybrids, against cudaMemcpyPeerAsync of 1 GiB contiguous
// (benchmarks/README.md, "Bulk copies and copy engines").  Needs two GPUs
// with peer access:
//   nvcc -O3 -arch=sm_90 -std=c++17 -o bcv benchmarks/gpu/gpu_bulk_copy_variants.cu && ./bcv
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <random>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); exit(1);} } while (0)
typedef unsigned long long u64;

// k0: the engine's own copy kernel (csrc/gpu/copy_kernel.cu), built in.
#include "../../csrc/gpu/copy_kernel.cu"
#define k0 mc_copy_pieces

__device__ __forceinline__ unsigned sa(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(u64 *b) { asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(sa(b)) : "memory"); }
__device__ __forceinline__ void mbar_wait(u64 *b, unsigned parity) {
  asm volatile("{\n .reg .pred p;\n W%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W%=;\n}" :: "r"(sa(b)), "r"(parity) : "memory");
}
__device__ __forceinline__ void tma_load(void *sm, const void *g, unsigned bytes, u64 *b) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(sa(b)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(sa(sm)), "l"(g), "r"(bytes), "r"(sa(b)) : "memory");
}
__device__ __forceinline__ void tma_store(void *g, const void *sm, unsigned bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(g), "r"(sa(sm)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// One thread per CTA drives S shared-memory stages of C bytes: bulk loads run
// up to S-1 chunks ahead of the bulk stores.
template <int C, int S>
__global__ void __launch_bounds__(32) ktma(const u64 *__restrict__ table, unsigned n) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) u64 bar[S];
  __shared__ u64 dst[S];
  __shared__ unsigned sz[S];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < S; s++) mbar_init(&bar[s]);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  unsigned pi = blockIdx.x; u64 off = 0;
  auto load_next = [&](int s) -> bool {
    if (pi >= n) return false;
    u64 d = table[3 * pi], src = table[3 * pi + 1], len = table[3 * pi + 2];
    unsigned k = (unsigned)(len - off < (u64)C ? len - off : (u64)C);
    dst[s] = d + off; sz[s] = k;
    tma_load(smem + (size_t)s * C, (const void *)(src + off), k, &bar[s]);
    off += k;
    if (off >= len) { pi += gridDim.x; off = 0; }
    return true;
  };
  unsigned issued = 0, stored = 0;
  for (int s = 0; s < S; s++) if (load_next(s)) issued++;
  while (stored < issued) {
    int s = stored % S;
    mbar_wait(&bar[s], (stored / S) & 1);
    tma_store((void *)dst[s], smem + (size_t)s * C, sz[s]);
    stored++;
    if (stored >= 2) {  // chunk stored-2's store has read its stage: loads may run S-1 ahead
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      while (issued <= stored - 2 + S && load_next(issued % S)) issued++;
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

static u64 *maptab(u64 *h) { u64 *t; CK(cudaHostGetDevicePointer((void **)&t, h, 0)); return t; }

int main() {
  const size_t G = 1ull << 30, P = 64 << 10, N = G / P;
  int can; CK(cudaDeviceCanAccessPeer(&can, 0, 1)); if (!can) { printf("no peer\n"); return 1; }
  int rtv; cudaRuntimeGetVersion(&rtv); printf("runtime %d\n", rtv);
  char *a, *b;
  CK(cudaSetDevice(1)); CK(cudaDeviceEnablePeerAccess(0, 0)); CK(cudaMalloc(&b, G)); CK(cudaMemset(b, 0, G));
  CK(cudaSetDevice(0)); CK(cudaDeviceEnablePeerAccess(1, 0)); CK(cudaMalloc(&a, G));
  {
    std::vector<unsigned> hv(G / 4); std::mt19937 r0(5); for (auto &x : hv) x = r0();
    CK(cudaMemcpy(a, hv.data(), G, cudaMemcpyHostToDevice));
  }
  std::vector<size_t> ps(N), pd(N), order(N);
  for (size_t i = 0; i < N; i++) ps[i] = pd[i] = order[i] = i;
  std::mt19937 rng(1); std::shuffle(ps.begin(), ps.end(), rng); std::shuffle(pd.begin(), pd.end(), rng);
  std::shuffle(order.begin(), order.end(), rng);
  for (int dir = 0; dir < 2; dir++) {  // 0: write (runs on 0: local a -> peer b); 1: read (runs on 1: peer a -> local b)
    int dev = dir == 0 ? 0 : 1;
    CK(cudaSetDevice(dev));
    cudaStream_t st, st2; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking)); CK(cudaStreamCreateWithFlags(&st2, cudaStreamNonBlocking));
    cudaEvent_t e0, e1, ef, ej; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1)); CK(cudaEventCreate(&ef)); CK(cudaEventCreate(&ej));
    u64 *ht; CK(cudaHostAlloc(&ht, N * 24, cudaHostAllocMapped));
    std::vector<void *> vd(N), vs(N); std::vector<size_t> vz(N, P);
    for (size_t j = 0; j < N; j++) { size_t i = order[j]; ht[3*j] = (u64)(b + pd[i] * P); ht[3*j+1] = (u64)(a + ps[i] * P); ht[3*j+2] = P; vd[j] = (void *)ht[3*j]; vs[j] = (void *)ht[3*j+1]; }
    u64 *t = maptab(ht);
    double ref = 0;
    auto check = [&](const char *name) {
      // spot-check 64 pieces
      std::vector<unsigned> x(P / 4), y(P / 4);
      for (int q = 0; q < 64; q++) { size_t j = (size_t)q * (N / 64) + 7; CK(cudaMemcpy(x.data(), vs[j], P, cudaMemcpyDefault)); CK(cudaMemcpy(y.data(), vd[j], P, cudaMemcpyDefault));
        if (x != y) { printf("  MISMATCH in %s piece %zu\n", name, j); return; } }
    };
    auto timeit = [&](const char *name, auto launch, bool shuffled = true) {
      CK(cudaMemsetAsync(b, 0, G, st)); CK(cudaStreamSynchronize(st));
      float best = 1e9;
      for (int r = 0; r < 8; r++) { CK(cudaEventRecord(e0, st)); launch(); CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); if (r && ms < best) best = ms; }
      CK(cudaGetLastError());
      double gbs = G / (best * 1e-3) / 1e9; if (!ref) ref = gbs;
      printf("%s %-34s %7.1f GB/s %6.3fx\n", dir ? "read " : "write", name, gbs, gbs / ref); fflush(stdout);
      if (shuffled)
        check(name);
    };
    timeit("memcpyPeer 1GiB contiguous", [&] { CK(cudaMemcpyPeerAsync(b, 1, a, 0, G, st)); }, false);
    unsigned g = N < 65535 ? N : 65535;
    timeit("k0 (engine kernel, host table)", [&] { k0<<<g, 512, 0, st>>>(t, N); });
    int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
#define TMA(C, S, PER) do { auto f = ktma<C, S>; CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, C * S)); \
      char nm[64]; snprintf(nm, sizeof nm, "tma C=%dK S=%d grid=%dx%d", C >> 10, S, sms, PER); \
      timeit(nm, [&] { f<<<sms * PER, 32, C * S, st>>>(t, N); }); } while (0)
    TMA(16384, 4, 1); TMA(16384, 4, 2); TMA(16384, 4, 3); TMA(32768, 4, 1); TMA(32768, 3, 2);
    TMA(16384, 8, 1); TMA(8192, 8, 2); TMA(65536, 3, 1);
    // copy engines: one batch call per 4096 pieces
    auto ce = [&](size_t j0, size_t j1, cudaStream_t s) {
      cudaMemcpyAttributes at = {}; at.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      size_t idx = 0;
      for (size_t o = j0; o < j1; o += 4096) {
        size_t k = std::min((size_t)4096, j1 - o);
#if CUDART_VERSION >= 13000
        CK(cudaMemcpyBatchAsync((const void **)&vd[o], (const void **)&vs[o], &vz[o], k, &at, &idx, 1, s));
#else
        size_t fi; CK(cudaMemcpyBatchAsync(&vd[o], &vs[o], &vz[o], k, &at, &idx, 1, &fi, s));
#endif
      }
    };
    timeit("CE batch, all pieces", [&] { ce(0, N, st); });
    for (int f8 : {1, 2, 4}) {  // CE takes f8/8 of the pieces, the kernel the rest, concurrently
      size_t m = N * f8 / 8;
      char nm[64]; snprintf(nm, sizeof nm, "k0 %d/8 + CE batch %d/8", 8 - f8, f8);
      timeit(nm, [&] { CK(cudaEventRecord(ef, st)); CK(cudaStreamWaitEvent(st2, ef, 0)); ce(N - m, N, st2);
                       k0<<<g, 512, 0, st>>>(t, N - m); CK(cudaEventRecord(ej, st2)); CK(cudaStreamWaitEvent(st, ej, 0)); });
    }
    {
      auto f = ktma<16384, 4>; size_t m = N / 4;
      timeit("tma16Kx4 g2 3/4 + CE batch 1/4", [&] { CK(cudaEventRecord(ef, st)); CK(cudaStreamWaitEvent(st2, ef, 0)); ce(N - m, N, st2);
                       f<<<sms * 2, 32, 16384 * 4, st>>>(t, N - m); CK(cudaEventRecord(ej, st2)); CK(cudaStreamWaitEvent(st, ej, 0)); });
    }
    CK(cudaFreeHost(ht));
  }
  return 0;
}
