/* GPU memory in transfers (engine side), common helpers: where local
 * buffers live, synchronous copies for same-segment requests, the once-per-
 * peer log of the chosen path.  The same-host path is gpu_same_host.c, the
 * staging of local GPU buffers for TCP gpu_stage.c; the target side of TCP
 * stages cuda regions itself (transport/tcp/tcp_recv.c).  All use the
 * engine's copy worker (gpu/gpu_staging.c). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"
#include "gpu/cuda_driver.h"
#include "util/log.h"

/* Allocations already seen in one locate pass (KV blocks come from a few
 * allocations, e.g. one per layer, in any order). */
#define LOCATE_CACHE 64
#define LOCATE_HINTS 4096

int mc_gpu_locate_locals(const mc_request_t *reqs, size_t n, int *ldev, mc_err_t *err) {
  int k = 0;
  /* Answer from the allocations already seen while the buffers stay inside
   * one: a driver query per allocation, not per request (a shuffled block
   * order over 32 layers would otherwise ask the driver for every block). */
  struct {
    uint64_t lo, hi;
    int dev;
  } seen[LOCATE_CACHE];
  size_t nseen = 0, last = 0;
  /* 2 MiB page of an address -> the allocation last found there (+1): a
   * shuffled order finds its allocation in one probe, not a scan. */
  unsigned char hint[LOCATE_HINTS];
  memset(hint, 0, sizeof hint);
  for (size_t i = 0; i < n; i++) {
    uint64_t a = (uint64_t)(uintptr_t)reqs[i].local, end = a + reqs[i].len;
    size_t h = (size_t)(a >> 21) % LOCATE_HINTS;
    int hit = -1, c = hint[h] - 1;
    /* The page hint first: checking the last allocation first costs a
     * mispredicted branch per request when blocks alternate between
     * allocations at random (4-7x slower over a shuffled block table). */
    if (c >= 0 && a >= seen[c].lo && end <= seen[c].hi) {
      hit = c;
    } else if (nseen && a >= seen[last].lo && end <= seen[last].hi) {
      hit = (int)last;
      hint[h] = (unsigned char)(last + 1);
    } else {
      for (size_t j = 0; j < nseen; j++)
        if (a >= seen[j].lo && end <= seen[j].hi) {
          hit = (int)j;
          last = j;
          hint[h] = (unsigned char)(j + 1);
          break;
        }
    }
    if (hit >= 0) {
      ldev[i] = seen[hit].dev;
      k++;
      continue;
    }
    int dev = -1;
    uint64_t start = 0, size = 0;
    int rc = mc_cuda_locate_range(a, reqs[i].len, &dev, &start, &size, err);
    if (rc < 0)
      return mc_err_prefix(err, "request %zu (local buffer)", i);
    ldev[i] = rc == 1 ? dev : -1;
    k += rc == 1;
    if (rc == 1) {
      last = nseen < LOCATE_CACHE ? nseen++ : (last + 1) % LOCATE_CACHE;
      seen[last].lo = start;
      seen[last].hi = start + size;
      seen[last].dev = dev;
      hint[h] = (unsigned char)(last + 1);
    }
  }
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

void mc_gpu_log_path_once(mc_engine_t *e, const char *segment, const char *fmt, ...) {
  char key[320];
  snprintf(key, sizeof key, "%s", segment);
  pthread_mutex_lock(&e->gpu_mu);
  for (size_t i = 0; i < e->gpu_nlogged; i++)
    if (!strcmp(e->gpu_logged[i], key)) {
      pthread_mutex_unlock(&e->gpu_mu);
      return;
    }
  char(*v)[320] = realloc(e->gpu_logged, (e->gpu_nlogged + 1) * sizeof *v);
  if (v) {
    e->gpu_logged = v;
    memcpy(v[e->gpu_nlogged++], key, sizeof key);
  }
  pthread_mutex_unlock(&e->gpu_mu);
  char msg[MC_ERR_MSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  mc_log_info("GPU path to segment %s: %s", segment, msg);
}

