/* GPU memory in transfers (engine side): where local buffers live, and
 * synchronous copies for same-segment requests.  Moving GPU memory to
 * peers is the transports' (directly between GPUs, or staged through
 * pinned memory); all use the engine's copy worker (gpu/gpu_staging.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"
#include "gpu/cuda_driver.h"
#include "util/log.h"

void mc_gpu_locator_init(mc_gpu_locator_t *lc, mc_regions_t *regions) {
  lc->regions = regions;
  lc->nseen = 0;
  lc->last = 0;
  memset(lc->hint, 0, sizeof lc->hint);
}

int mc_gpu_locate_locals(mc_gpu_locator_t *lc, const mc_request_t *reqs, size_t from,
                         size_t to, int *ldev, mc_err_t *err) {
  int k = 0;
  /* Answer from the allocations already seen while the buffers stay inside
   * one: a driver query per allocation, not per request (a shuffled block
   * order over 32 layers would otherwise ask the driver for every block).
   * The locator keeps them across calls, so one batch located chunk by
   * chunk asks the driver no more often than located at once. */
  size_t nseen = lc->nseen, last = lc->last;
  for (size_t i = from; i < to; i++) {
    uint64_t a = (uint64_t)(uintptr_t)reqs[i].local, end = a + reqs[i].len;
    size_t h = (size_t)(a >> 21) % MC_LOCATE_HINTS;
    int hit = -1, c = lc->hint[h] - 1;
    /* The page hint first: checking the last allocation first costs a
     * mispredicted branch per request when blocks alternate between
     * allocations at random (4-7x slower over a shuffled block table). */
    if (c >= 0 && a >= lc->seen[c].lo && end <= lc->seen[c].hi) {
      hit = c;
    } else if (nseen && a >= lc->seen[last].lo && end <= lc->seen[last].hi) {
      hit = (int)last;
      lc->hint[h] = (unsigned char)(last + 1);
    } else {
      for (size_t j = 0; j < nseen; j++)
        if (a >= lc->seen[j].lo && end <= lc->seen[j].hi) {
          hit = (int)j;
          last = j;
          lc->hint[h] = (unsigned char)(j + 1);
          break;
        }
    }
    if (hit >= 0) {
      ldev[i] = lc->seen[hit].dev;
      k += ldev[i] >= 0;
      continue;
    }
    /* A registered region (no driver call; host regions are remembered
     * too), else the driver (GPU allocations only). */
    uint64_t start = 0, size = 0, hi = 0;
    int dev = lc->regions ? mc_regions_device_of(lc->regions, a, reqs[i].len, &start, &hi) : -2;
    int rc = 1;
    if (dev >= -1)
      size = hi - start;
    else if ((rc = mc_cuda_locate_range(a, reqs[i].len, &dev, &start, &size, err)) < 0) {
      lc->nseen = nseen;
      lc->last = last;
      return mc_err_prefix(err, "request %zu (local buffer)", i);
    }
    ldev[i] = rc == 1 ? dev : -1;
    k += rc == 1 && dev >= 0;
    if (rc == 1) {
      last = nseen < MC_LOCATE_CACHE ? nseen++ : (last + 1) % MC_LOCATE_CACHE;
      lc->seen[last].lo = start;
      lc->seen[last].hi = start + size;
      lc->seen[last].dev = dev;
      lc->hint[h] = (unsigned char)(last + 1);
    }
  }
  lc->nseen = nseen;
  lc->last = last;
  return k;
}

int mc_gpu_copy_sync(void *dst, const void *src, uint64_t len, int dev, mc_err_t *err) {
  const mc_cuda_api_t *api = mc_cuda_api(err);
  if (!api)
    return err ? err->code : MC_EUNAVAIL;
  int rc = mc_cuda_use_device(dev, err);
  if (rc < 0)
    return rc;
  mc_cu_result r = api->cuMemcpyAsync((mc_cu_ptr)(uintptr_t)dst, (mc_cu_ptr)(uintptr_t)src,
                                      len, NULL);
  if (r == 0)
    r = api->cuStreamSynchronize(NULL);
  if (r != 0) {
    char m[160];
    return mc_err_set(err, MC_ESYS, "GPU copy of %llu bytes failed: %s",
                      (unsigned long long)len, mc_cuda_strerror(api, r, m, sizeof m));
  }
  return 0;
}
