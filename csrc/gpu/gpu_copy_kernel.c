#include "gpu/gpu_copy_kernel.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/copy_kernel_ptx.h"

#define MAX_DEV 64
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static void *g_fn[MAX_DEV], *g_fn_p[MAX_DEV], *g_fn_p8[MAX_DEV];
static int g_failed[MAX_DEV];

size_t mc_copy_kernel_table_bytes(const size_t *sizes, size_t count) {
  size_t pieces = 0;
  for (size_t i = 0; i < count; i++)
    pieces += (sizes[i] + MC_COPY_PIECE_MAX - 1) / MC_COPY_PIECE_MAX;
  return pieces * 3 * sizeof(uint64_t);
}

static void *kernel_for(int device, const mc_cuda_api_t *api, void **fn_p, void **fn_p8,
                        mc_err_t *err) {
  pthread_mutex_lock(&g_mu);
  void *fn = g_fn[device];
  if (!fn && !g_failed[device]) {
    void *mod = NULL;
    mc_cu_result r = api->cuModuleLoadData(&mod, mc_copy_kernel_ptx);
    if (r == 0)
      r = api->cuModuleGetFunction(&fn, mod, "mc_copy_pieces");
    /* The parameter-table variant is optional (older PTX JIT): without it
     * every launch reads its table from pinned host memory. */
    if (r == 0 && api->cuModuleGetFunction(&g_fn_p[device], mod, "mc_copy_reqs_p") != 0)
      g_fn_p[device] = NULL;
    /* A few copies: the small parameter block launches quicker
     * (MC_GPU_SMALL_PARAMS=0: always the large one). */
    const char *sp = getenv("MC_GPU_SMALL_PARAMS");
    if (r == 0 && ((sp && !strcmp(sp, "0")) ||
                   api->cuModuleGetFunction(&g_fn_p8[device], mod, "mc_copy_reqs_p8") != 0))
      g_fn_p8[device] = NULL;
    if (r != 0) {
      char b[160];
      mc_err_set(err, MC_EUNAVAIL, "cannot load the GPU copy kernel on cuda:%d: %s", device,
                 mc_cuda_strerror(api, r, b, sizeof b));
      g_failed[device] = 1;
      fn = NULL;
    } else {
      g_fn[device] = fn;
    }
  } else if (!fn) {
    mc_err_set(err, MC_EUNAVAIL, "the GPU copy kernel failed to load on cuda:%d", device);
  }
  *fn_p = fn ? g_fn_p[device] : NULL;
  *fn_p8 = fn ? g_fn_p8[device] : NULL;
  pthread_mutex_unlock(&g_mu);
  return fn;
}

size_t mc_copy_kernel_pieces(const size_t *sizes, size_t count) {
  size_t pieces = 0;
  for (size_t i = 0; i < count; i++)
    pieces += (sizes[i] + MC_COPY_PIECE_MAX - 1) / MC_COPY_PIECE_MAX;
  return pieces;
}

/* The kernel parameters of mc_copy_reqs_p (copy_kernel.cu). */
#define PARAM_REQS_STRUCT(N)                                                                   \
  struct {                                                                                     \
    uint64_t dst[N], src[N], len[N];                                                           \
    uint32_t first[N + 1];                                                                     \
    uint32_t n;                                                                                \
  }
typedef PARAM_REQS_STRUCT(MC_COPY_PARAM_REQS) param_reqs_t;
typedef PARAM_REQS_STRUCT(MC_COPY_PARAM_REQS_SMALL) param_reqs8_t; /* mc_copy_reqs_p8 */

_Static_assert(sizeof(param_reqs_t) <= 4096, "kernel parameters fit the portable 4 KiB");
_Static_assert(sizeof(param_reqs8_t) == 232, "copy_kernel.cu's small parameter block");

/* Fills a parameter block of `cap` copies (its arrays at dst, src, len,
 * first; n after first[cap]).  Returns the number of pieces. */
static uint32_t fill_params(uint64_t *dst, uint64_t *src, uint64_t *len, uint32_t *first,
                            uint32_t *n, const mc_cu_ptr *dsts, const mc_cu_ptr *srcs,
                            const size_t *sizes, size_t count) {
  uint32_t f = 0;
  for (size_t i = 0; i < count; i++) {
    dst[i] = dsts[i];
    src[i] = srcs[i];
    len[i] = sizes[i];
    first[i] = f;
    f += (uint32_t)((sizes[i] + MC_COPY_PIECE_MAX - 1) / MC_COPY_PIECE_MAX);
  }
  first[count] = f;
  *n = (uint32_t)count;
  return f;
}

int mc_copy_kernel_launch(int device, const mc_cu_ptr *dsts, const mc_cu_ptr *srcs,
                          const size_t *sizes, size_t count, void *table, mc_cu_stream stream,
                          mc_err_t *err) {
  const mc_cuda_api_t *api = mc_cuda_api(err);
  if (!api)
    return err ? err->code : MC_EUNAVAIL;
  if (!api->cuModuleLoadData || !api->cuModuleGetFunction || !api->cuLaunchKernel ||
      device < 0 || device >= MAX_DEV)
    return mc_err_set(err, MC_EUNAVAIL, "this CUDA driver cannot launch the copy kernel");
  void *fn_p = NULL, *fn_p8 = NULL;
  void *fn = kernel_for(device, api, &fn_p, &fn_p8, err);
  if (!fn)
    return MC_EUNAVAIL;
  size_t pieces = mc_copy_kernel_pieces(sizes, count);
  int in_params = fn_p && count <= MC_COPY_PARAM_REQS && pieces < UINT32_MAX;
  if (!in_params && !table)
    return mc_err_set(err, MC_EINVAL, "GPU copy kernel: more than %u copies need a table",
                      MC_COPY_PARAM_REQS);
  if (in_params) {
    param_reqs_t pr;
    param_reqs8_t pr8;
    int small = fn_p8 && count <= MC_COPY_PARAM_REQS_SMALL;
    uint32_t first = small ? fill_params(pr8.dst, pr8.src, pr8.len, pr8.first, &pr8.n, dsts,
                                         srcs, sizes, count)
                           : fill_params(pr.dst, pr.src, pr.len, pr.first, &pr.n, dsts, srcs,
                                         sizes, count);
    if (first == 0)
      return 0;
    void *params_p[] = {small ? (void *)&pr8 : (void *)&pr};
    unsigned grid = first < 65535u ? first : 65535u;
    mc_cu_result r = api->cuLaunchKernel(small ? fn_p8 : fn_p, grid, 1, 1, 512, 1, 1, 0, stream,
                                         params_p, NULL);
    if (r != 0) {
      char b[160];
      return mc_err_set(err, MC_ESYS, "GPU copy kernel launch (%zu copies) failed: %s", count,
                        mc_cuda_strerror(api, r, b, sizeof b));
    }
    return 0;
  }
  uint64_t *t = table;
  unsigned n = 0;
  for (size_t i = 0; i < count; i++)
    for (size_t off = 0; off < sizes[i]; off += MC_COPY_PIECE_MAX) {
      size_t k = sizes[i] - off < MC_COPY_PIECE_MAX ? sizes[i] - off : MC_COPY_PIECE_MAX;
      t[3 * n] = dsts[i] + off;
      t[3 * n + 1] = srcs[i] + off;
      t[3 * n + 2] = k;
      n++;
    }
  if (n == 0)
    return 0;
  unsigned grid = n < 65535u ? n : 65535u;
  uint64_t tp = (uint64_t)(uintptr_t)table;
  void *params[] = {&tp, &n};
  mc_cu_result r = api->cuLaunchKernel(fn, grid, 1, 1, 512, 1, 1, 0, stream, params, NULL);
  if (r != 0) {
    char b[160];
    return mc_err_set(err, MC_ESYS, "GPU copy kernel launch (%u pieces) failed: %s", n,
                      mc_cuda_strerror(api, r, b, sizeof b));
  }
  return 0;
}
