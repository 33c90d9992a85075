/* A submit's requests before anything moves: each checked, its local
 * buffer's region found, pinned for the batch and its device noted, in one
 * pass over the request array under one lock of the batch and one of the
 * regions table. */
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"

/* The checks of one request, with their messages (the slow path: the pass
 * below tests the same conditions branch-free first). */
static int check_request(const mc_request_t *r, size_t i, mc_err_t *err) {
  if (r->opcode != MC_OP_READ && r->opcode != MC_OP_WRITE)
    return mc_err_set(err, MC_EINVAL, "request %zu: opcode %d is not READ (0) or WRITE (1)", i,
                      r->opcode);
  if (!r->local)
    return mc_err_set(err, MC_EINVAL, "request %zu: local address is NULL", i);
  if (r->len == 0)
    return mc_err_set(err, MC_EINVAL, "request %zu: length is 0", i);
  if ((uint64_t)(uintptr_t)r->local + r->len < (uint64_t)(uintptr_t)r->local ||
      r->remote + r->len < r->remote)
    return mc_err_set(err, MC_EINVAL, "request %zu: address + length wraps around", i);
  return 0;
}

/* 1 if request r fails a check of check_request (no message). */
static inline int request_bad(const mc_request_t *r) {
  uint64_t a = (uint64_t)(uintptr_t)r->local, len = r->len;
  /* a + len <= a: length 0 or the local range wraps around */
  return ((unsigned)r->opcode > MC_OP_WRITE) | (a == 0) | (a + len <= a) |
         (r->remote + len < r->remote);
}

/* A request of the pass failed at index i (after those before it passed):
 * a check failing further on is what the caller hears (every request is
 * checked before any is looked up, as before the one pass). */
static int fail_at(const mc_request_t *reqs, size_t i, size_t n, int rc, mc_err_t *err) {
  for (size_t j = i + 1; j < n; j++)
    if (request_bad(&reqs[j]))
      return check_request(&reqs[j], j, err);
  return rc;
}

/* Pins reg for batch b unless it already holds it (b->mu and the regions
 * lock held).  0, or MC_ENOMEM. */
static int pin_region(mc_engine_t *e, mc_batch_t *b, const mc_region_t *reg, uint64_t a,
                      uint64_t len) {
  for (size_t k = b->npins; k-- > 0;)
    if (b->pins[k] == reg)
      return 0;
  if (b->npins == b->cap_pins) { /* the batch's own few slots first (batch.c) */
    size_t nc = b->cap_pins * 2;
    mc_region_t **nv = b->pins == b->pins_s ? malloc(nc * sizeof *nv)
                                             : realloc(b->pins, nc * sizeof *nv);
    if (!nv)
      return MC_ENOMEM;
    if (b->pins == b->pins_s)
      memcpy(nv, b->pins_s, sizeof b->pins_s);
    b->pins = nv;
    b->cap_pins = nc;
  }
  b->pins[b->npins++] = mc_regions_pin_local_locked(&e->regions, a, len);
  return 0;
}

/* The pass (b->mu and the regions lock held): stops at the first request
 * that fails (rc < 0, err set; b->pins may have grown).  Inlined twice, with and
 * without ldev, so the loop does not test for it. */
static inline __attribute__((always_inline)) int pass(mc_engine_t *e, mc_batch_t *b,
                                                      const mc_request_t *reqs, size_t n,
                                                      int *ldev, const int with_ldev,
                                                      mc_prepared_t *out, mc_err_t *err) {
  const int must = e->local_check && !b->trusted_locals;
  int gpu = 0, dev = -1;
  size_t unknown = 0;
  /* The region of the last request found in one: [lo, hi), lo > 0 (no
   * region starts at 0), dev its device. */
  uint64_t lo = UINT64_MAX, hi = 0;
  for (size_t i = 0; i < n; i++) {
    const mc_request_t *r = &reqs[i];
    uint64_t a = (uint64_t)(uintptr_t)r->local, len = r->len, end = a + len;
    /* In the last request's region, which makes its local range
     * non-NULL, non-empty and not wrapping (end > a >= lo > 0); the
     * opcode and the remote range checked here too. */
    if (__builtin_expect(a >= lo && end > a && end <= hi &&
                             (unsigned)r->opcode <= MC_OP_WRITE && r->remote + len >= r->remote,
                         1)) {
      if (with_ldev)
        ldev[i] = dev;
      continue;
    }
    if (request_bad(r))
      return check_request(r, i, err);
    const mc_region_t *f = mc_regions_find_locked(&e->regions, a, len);
    if (!f) {
      if (must)
        return fail_at(reqs, i, n,
                       mc_err_set(err, MC_EINVAL,
                                  "request %zu: local range [0x%llx, +%llu) is not inside any "
                                  "memory region registered with this engine (segment %s); "
                                  "register the buffer first (register_memory / "
                                  "allocate_managed_buffer)",
                                  i, (unsigned long long)a, (unsigned long long)len, e->name),
                       err);
      /* Not registered (MC_LOCAL_CHECK=0 or a trusted batch): nothing to
       * pin; the caller asks the driver where it lives. */
      unknown++;
      if (with_ldev)
        ldev[i] = MC_LDEV_UNKNOWN;
      continue;
    }
    if (pin_region(e, b, f, a, len) < 0)
      return fail_at(reqs, i, n, mc_err_set(err, MC_ENOMEM, "out of memory"), err);
    lo = f->addr;
    hi = f->addr + f->len;
    dev = f->cuda_dev >= 0 ? f->cuda_dev : -1; /* checked at registration */
    gpu |= dev >= 0;
    if (with_ldev)
      ldev[i] = dev;
  }
  out->gpu = gpu;
  out->unknown = unknown;
  return 0;
}

int mc_batch_prepare(mc_engine_t *e, mc_batch_t *b, const mc_request_t *reqs, size_t n,
                     int *ldev, mc_prepared_t *out, mc_err_t *err) {
  pthread_mutex_lock(&b->mu);
  b->submitting++;
  const size_t np0 = b->npins;
  mc_regions_lock(&e->regions);
  int rc = ldev ? pass(e, b, reqs, n, ldev, 1, out, err) : pass(e, b, reqs, n, NULL, 0, out, err);
  mc_regions_unlock(&e->regions);
  size_t np1 = b->npins;
  if (rc < 0) { /* a failed submit holds no pin: those it took go back */
    for (size_t k = np0; k < np1; k++)
      mc_regions_release(&e->regions, b->pins[k]); /* lock order: b->mu, regions */
    b->npins = np0;
  }
  int listed = b->on_pin_list;
  pthread_mutex_unlock(&b->mu);
  if (rc == 0 && np1 > np0 && !listed)
    mc_batch_pin_list_add(e, b);
  return rc;
}
