#include "mem/regions.h"
#include "util/bsearch.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int mc_regions_init(mc_regions_t *r) {
  memset(r, 0, sizeof *r);
  if (pthread_mutex_init(&r->mu, NULL))
    return MC_ENOMEM;
  if (pthread_cond_init(&r->cv, NULL)) {
    pthread_mutex_destroy(&r->mu);
    return MC_ENOMEM;
  }
  return 0;
}

void mc_regions_destroy(mc_regions_t *r) {
  for (size_t i = 0; i < r->n; i++)
    free(r->v[i]);
  free(r->v);
  pthread_cond_destroy(&r->cv);
  pthread_mutex_destroy(&r->mu);
}

/* Caller holds mu: a change (peers holding the old descriptor see it in
 * the published page before the change takes effect). */
static void bump(mc_regions_t *r) {
  r->version++;
  if (r->pub.page)
    __atomic_store_n(&r->pub.page[0], r->version, __ATOMIC_SEQ_CST);
}

void mc_regions_set_pub(mc_regions_t *r, const mc_regions_pub_t *pub) {
  pthread_mutex_lock(&r->mu);
  if (pub && pub->page) {
    r->pub = *pub;
    __atomic_store_n(&r->pub.page[0], r->version, __ATOMIC_SEQ_CST);
  } else {
    memset(&r->pub, 0, sizeof r->pub);
  }
  pthread_mutex_unlock(&r->mu);
}

int mc_regions_pub_info(mc_regions_t *r, int *fd, uint64_t *token) {
  pthread_mutex_lock(&r->mu);
  int ok = r->pub.page != NULL;
  *fd = r->pub.fd;
  *token = r->pub.token;
  pthread_mutex_unlock(&r->mu);
  return ok;
}

/* Index of the last region with addr <= a, or -1. Caller holds mu. */
static long find_le(mc_regions_t *r, uint64_t a) {
#define REG_ADDR(i) r->v[i]->addr
  return (long)MC_COUNT_LE(r->n, REG_ADDR, a) - 1;
#undef REG_ADDR
}

static int valid_location(const char *loc) {
  if (!strcmp(loc, "cpu") || !strncmp(loc, "cpu:", 4))
    return 1;
  if (!strncmp(loc, "cuda:", 5) && loc[5]) {
    for (const char *p = loc + 5; *p; p++)
      if (*p < '0' || *p > '9')
        return 0;
    return 1;
  }
  return 0;
}

int mc_regions_add(mc_regions_t *r, uint64_t addr, uint64_t len,
                   const char *location, mc_err_t *err) {
  return mc_regions_add_ex(r, addr, len, location, NULL, 0, err);
}

int mc_regions_add_ex(mc_regions_t *r, uint64_t addr, uint64_t len, const char *location,
                      const char *ipc, uint64_t ipc_base, mc_err_t *err) {
  if (len == 0)
    return mc_err_set(err, MC_EINVAL, "cannot register 0 bytes at 0x%llx",
                      (unsigned long long)addr);
  if (addr == 0)
    return mc_err_set(err, MC_EINVAL, "cannot register address 0 (NULL)");
  if (addr + len < addr)
    return mc_err_set(err, MC_EINVAL, "region 0x%llx + %llu wraps around the address space",
                      (unsigned long long)addr, (unsigned long long)len);
  if (!location || !*location || !strcmp(location, "*"))
    location = "cpu";
  if (strlen(location) >= MC_LOCATION_MAX || !valid_location(location))
    return mc_err_set(err, MC_EINVAL,
                      "location \"%.40s\" is not accepted; use \"cpu\" or \"cuda:N\"", location);
  mc_region_t *reg = calloc(1, sizeof *reg);
  if (!reg)
    return mc_err_set(err, MC_ENOMEM, "out of memory registering a region");
  reg->addr = addr;
  reg->len = len;
  snprintf(reg->location, sizeof reg->location, "%s", location);
  reg->cuda_dev = !strncmp(location, "cuda:", 5) ? atoi(location + 5) : -1;
  snprintf(reg->ipc, sizeof reg->ipc, "%s", ipc ? ipc : "");
  reg->ipc_base = ipc_base;

  pthread_mutex_lock(&r->mu);
  long i = find_le(r, addr);
  const mc_region_t *prev = i >= 0 ? r->v[i] : NULL;
  const mc_region_t *next = (size_t)(i + 1) < r->n ? r->v[i + 1] : NULL;
  if ((prev && prev->addr + prev->len > addr) || (next && addr + len > next->addr)) {
    const mc_region_t *o = (prev && prev->addr + prev->len > addr) ? prev : next;
    int rc = mc_err_set(err, MC_EOVERLAP,
                        "region [0x%llx, +%llu) overlaps registered region [0x%llx, +%llu); "
                        "unregister it first",
                        (unsigned long long)addr, (unsigned long long)len,
                        (unsigned long long)o->addr, (unsigned long long)o->len);
    pthread_mutex_unlock(&r->mu);
    free(reg);
    return rc;
  }
  if (r->n == r->cap) {
    size_t ncap = r->cap ? r->cap * 2 : 16;
    mc_region_t **nv = realloc(r->v, ncap * sizeof *nv);
    if (!nv) {
      pthread_mutex_unlock(&r->mu);
      free(reg);
      return mc_err_set(err, MC_ENOMEM, "out of memory registering a region");
    }
    r->v = nv;
    r->cap = ncap;
  }
  size_t pos = (size_t)(i + 1);
  memmove(r->v + pos + 1, r->v + pos, (r->n - pos) * sizeof *r->v);
  r->v[pos] = reg;
  r->n++;
  bump(r);
  pthread_mutex_unlock(&r->mu);
  return 0;
}

int mc_regions_remove(mc_regions_t *r, uint64_t addr, int64_t timeout_ms, mc_err_t *err) {
  return mc_regions_remove_cb(r, addr, timeout_ms, -1, NULL, NULL, err);
}

static struct timespec deadline_after(int64_t ms) {
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += ms / 1000;
  dl.tv_nsec += (long)(ms % 1000) * 1000000l;
  if (dl.tv_nsec >= 1000000000l) {
    dl.tv_sec++;
    dl.tv_nsec -= 1000000000l;
  }
  return dl;
}

static const char local_holder[] = "a transfer of this engine (its local buffer)";

mc_region_t *mc_regions_pin_local_locked(mc_regions_t *r, uint64_t addr, uint64_t len) {
  mc_region_t *reg = (mc_region_t *)mc_regions_find_locked(r, addr, len);
  if (!reg)
    return NULL;
  reg->refs++;
  if (reg->holder_key != local_holder) {
    reg->holder_key = local_holder;
    snprintf(reg->holder, sizeof reg->holder, "%s", local_holder);
  }
  return reg;
}

int mc_regions_remove_cb(mc_regions_t *r, uint64_t addr, int64_t timeout_ms, int64_t grace_ms,
                         mc_regions_stall_fn stall, void *arg, mc_err_t *err) {
  pthread_mutex_lock(&r->mu);
  long i = find_le(r, addr);
  if (i >= 0 && r->v[i]->addr == addr && r->v[i]->removing) {
    pthread_mutex_unlock(&r->mu);
    return mc_err_set(err, MC_EBUSY, "region 0x%llx is being unregistered by another thread",
                      (unsigned long long)addr);
  }
  /* A dead region left by a remove that timed out may be removed again. */
  if (i < 0 || r->v[i]->addr != addr) {
    pthread_mutex_unlock(&r->mu);
    return mc_err_set(err, MC_ENOTFOUND,
                      "no registered region starts at 0x%llx; pass the address given to "
                      "register_memory",
                      (unsigned long long)addr);
  }
  mc_region_t *reg = r->v[i];
  reg->dead = 1;
  reg->removing = 1;
  bump(r); /* snapshots no longer list it */
  struct timespec dl = deadline_after(timeout_ms >= 0 ? timeout_ms : 0);
  if (stall && grace_ms >= 0 && (timeout_ms < 0 || grace_ms < timeout_ms)) {
    struct timespec gdl = deadline_after(grace_ms);
    while (reg->refs > 0 && pthread_cond_timedwait(&r->cv, &r->mu, &gdl) != ETIMEDOUT)
      ;
    if (reg->refs > 0) {
      pthread_mutex_unlock(&r->mu);
      stall(arg, reg); /* reg stays: removing keeps other removers off it */
      pthread_mutex_lock(&r->mu);
    }
  }
  while (reg->refs > 0) {
    if (timeout_ms < 0) {
      pthread_cond_wait(&r->cv, &r->mu);
    } else if (pthread_cond_timedwait(&r->cv, &r->mu, &dl) == ETIMEDOUT && reg->refs > 0) {
      int refs = reg->refs;
      char holder[sizeof reg->holder];
      const char *pre = reg->holder[0] && reg->holder_key != local_holder ? "peer " : "";
      snprintf(holder, sizeof holder, "%s", reg->holder[0] ? reg->holder : "a local copy");
      reg->removing = 0;
      pthread_mutex_unlock(&r->mu);
      return mc_err_set(err, MC_EBUSY,
                        "region 0x%llx is still in use after %lld ms: %d access(es) in flight, "
                        "last pinned by %s%s (e.g. a READ it does not read out); it now "
                        "refuses new accesses; retry later (MC_UNREGISTER_WAIT_MS)",
                        (unsigned long long)addr, (long long)timeout_ms, refs,
                        pre, holder);
    }
  }
  /* The index may have moved while we waited. */
  i = find_le(r, addr);
  memmove(r->v + i, r->v + i + 1, (r->n - (size_t)i - 1) * sizeof *r->v);
  r->n--;
  bump(r);
  pthread_mutex_unlock(&r->mu);
  free(reg);
  return 0;
}

int mc_regions_acquire(mc_regions_t *r, uint64_t addr, uint64_t len,
                       const char *who, mc_region_t **out, mc_err_t *err) {
  return mc_regions_acquire_by(r, addr, len, who, NULL, out, err);
}

int mc_regions_acquire_by(mc_regions_t *r, uint64_t addr, uint64_t len, const char *who,
                          const char *peer, mc_region_t **out, mc_err_t *err) {
  pthread_mutex_lock(&r->mu);
  long i = find_le(r, addr);
  mc_region_t *reg = i >= 0 ? r->v[i] : NULL;
  if (!reg || reg->dead || len == 0 || addr + len < addr ||
      addr + len > reg->addr + reg->len) {
    pthread_mutex_unlock(&r->mu);
    return mc_err_set(err, MC_ERANGE,
                      "range [0x%llx, +%llu) is not inside any memory region registered by "
                      "segment %s",
                      (unsigned long long)addr, (unsigned long long)len, who ? who : "?");
  }
  reg->refs++;
  if (peer != reg->holder_key) { /* copied only when the holder changes */
    reg->holder_key = peer;
    snprintf(reg->holder, sizeof reg->holder, "%s", peer ? peer : "");
  }
  pthread_mutex_unlock(&r->mu);
  *out = reg;
  return 0;
}

void mc_regions_release(mc_regions_t *r, mc_region_t *reg) {
  pthread_mutex_lock(&r->mu);
  if (--reg->refs == 0 && reg->dead)
    pthread_cond_broadcast(&r->cv);
  pthread_mutex_unlock(&r->mu);
}

int mc_regions_device_of(mc_regions_t *r, uint64_t addr, uint64_t len, uint64_t *lo,
                         uint64_t *hi) {
  int dev = -2;
  pthread_mutex_lock(&r->mu);
  long i = find_le(r, addr);
  const mc_region_t *reg = i >= 0 ? r->v[i] : NULL;
  if (reg && !reg->dead && len > 0 && addr + len >= addr && addr + len <= reg->addr + reg->len) {
    dev = reg->cuda_dev >= 0 ? reg->cuda_dev : -1;
    *lo = reg->addr;
    *hi = reg->addr + reg->len;
  }
  pthread_mutex_unlock(&r->mu);
  return dev;
}

void mc_regions_lock(mc_regions_t *r) { pthread_mutex_lock(&r->mu); }
void mc_regions_unlock(mc_regions_t *r) { pthread_mutex_unlock(&r->mu); }

const mc_region_t *mc_regions_find_locked(mc_regions_t *r, uint64_t addr, uint64_t len) {
  long i = find_le(r, addr);
  const mc_region_t *reg = i >= 0 ? r->v[i] : NULL;
  if (!reg || reg->dead || len == 0 || addr + len < addr || addr + len > reg->addr + reg->len)
    return NULL;
  return reg;
}

int mc_regions_contains(mc_regions_t *r, uint64_t addr, uint64_t len) {
  pthread_mutex_lock(&r->mu);
  int ok = mc_regions_find_locked(r, addr, len) != NULL;
  pthread_mutex_unlock(&r->mu);
  return ok;
}

size_t mc_regions_snapshot(mc_regions_t *r, mc_region_t *out, size_t max) {
  pthread_mutex_lock(&r->mu);
  size_t k = 0;
  for (size_t i = 0; i < r->n && k < max; i++)
    if (!r->v[i]->dead)
      out[k++] = *r->v[i];
  pthread_mutex_unlock(&r->mu);
  return k;
}

size_t mc_regions_count(mc_regions_t *r) {
  pthread_mutex_lock(&r->mu);
  size_t n = r->n;
  pthread_mutex_unlock(&r->mu);
  return n;
}
