/* Batches: splitting requests into wire ops, completion accounting,
 * waiting with timeouts, cancellation. */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"
#include "util/clock.h"

_Static_assert(MC_ENGINE_MAX_MSG == MC_XFER_MAX_CTRL, "message cap");
#include "util/log.h"

mc_batch_t *mc_batch_new(mc_engine_t *e, size_t capacity) {
  if (capacity == 0)
    capacity = 1;
  mc_batch_t *b = calloc(1, sizeof *b);
  if (!b)
    return NULL;
  /* Not zeroed: tasks are initialised as requests are submitted (a large
   * batch's pages are then first touched chunk by chunk, while earlier
   * chunks are already moving). */
  b->tasks = malloc(capacity * sizeof *b->tasks);
  if (!b->tasks) {
    free(b);
    return NULL;
  }
  b->cap = capacity;
  b->eng = e;
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&b->cv, &ca);
  pthread_condattr_destroy(&ca);
  pthread_mutex_init(&b->mu, NULL);
  return b;
}

size_t mc_batch_size(mc_batch_t *b) {
  pthread_mutex_lock(&b->mu);
  size_t n = b->n;
  pthread_mutex_unlock(&b->mu);
  return n;
}

size_t mc_batch_pending(mc_batch_t *b) {
  pthread_mutex_lock(&b->mu);
  size_t n = b->pending;
  pthread_mutex_unlock(&b->mu);
  return n;
}

static mc_task_state_t state_for(int code) {
  if (code == 0)
    return MC_TASK_COMPLETED;
  if (code == MC_ECANCELED)
    return MC_TASK_CANCELED;
  if (code == MC_ETIMEDOUT)
    return MC_TASK_TIMEOUT;
  return MC_TASK_FAILED;
}

/* Records one finished part of task i. Caller holds b->mu. */
#define part_done mc_batch_part_done
void mc_batch_part_done(mc_batch_t *b, size_t i, int code, const char *msg, uint64_t bytes) {
  mc_task_t *t = &b->tasks[i];
  if (code == 0) {
    t->done_bytes += bytes;
  } else if (t->code == 0) {
    t->code = code;
    free(t->msg);
    t->msg = strdup(msg && *msg ? msg : mc_strerror(code));
    b->any_msg = 1;
  }
  if (t->parts_left > 0 && --t->parts_left == 0) {
    t->state = state_for(t->code);
    b->pending--;
  }
}

/* ---- local pins ----
 * A region holding a local buffer of a batch is pinned (its refs) from the
 * submit until no op of the batch is in flight: unregister waits for it (or
 * cancels the batch, mc_engine_cancel_local_users), so no transport writes
 * into (or sends from) memory that was unregistered and freed. */
/* Releases the batch's pins if it is idle (caller holds b->mu; lock order
 * b->mu, then the regions lock).  The array stays for the next submit. */
static void pins_release_if_idle(mc_batch_t *b) {
  if (b->npins && b->ops_inflight == 0 && b->submitting == 0) {
    for (size_t i = 0; i < b->npins; i++)
      mc_regions_release(&b->eng->regions, b->pins[i]);
    b->npins = 0;
  }
}

static void pin_list_add(mc_engine_t *e, mc_batch_t *b) {
  pthread_mutex_lock(&e->pin_mu);
  if (!b->on_pin_list) {
    b->on_pin_list = 1;
    b->pin_prev = NULL;
    b->pin_next = e->pin_head;
    if (e->pin_head)
      e->pin_head->pin_prev = b;
    e->pin_head = b;
  }
  pthread_mutex_unlock(&e->pin_mu);
}

static void pin_list_remove(mc_engine_t *e, mc_batch_t *b) {
  pthread_mutex_lock(&e->pin_mu);
  if (b->on_pin_list) {
    if (b->pin_prev)
      b->pin_prev->pin_next = b->pin_next;
    else
      e->pin_head = b->pin_next;
    if (b->pin_next)
      b->pin_next->pin_prev = b->pin_prev;
    b->on_pin_list = 0;
  }
  pthread_mutex_unlock(&e->pin_mu);
}

/* Pins the regions holding the local buffers of reqs (those that lie in
 * one) and marks a submit in progress.  Call submit_end after the ops are
 * handed out. */
static int submit_begin(mc_engine_t *e, mc_batch_t *b, const mc_request_t *reqs, size_t n,
                        mc_err_t *err) {
  pthread_mutex_lock(&b->mu);
  b->submitting++;
  int rc = 0, added = 0;
  uint64_t lo = 1, hi = 0; /* the last region seen: [lo, hi) */
  mc_regions_lock(&e->regions);
  for (size_t i = 0; i < n; i++) {
    uint64_t a = (uint64_t)(uintptr_t)reqs[i].local, end = a + reqs[i].len;
    if (a >= lo && end <= hi && end > a)
      continue;
    const mc_region_t *f = mc_regions_find_locked(&e->regions, a, reqs[i].len);
    if (!f && e->local_check && !b->trusted_locals) {
      rc = mc_err_set(err, MC_EINVAL,
                      "request %zu: local range [0x%llx, +%llu) is not inside any memory "
                      "region registered with this engine (segment %s); register the buffer "
                      "first (register_memory / allocate_managed_buffer)",
                      i, (unsigned long long)a, (unsigned long long)reqs[i].len, e->name);
      break;
    }
    if (!f)
      continue; /* not registered (MC_LOCAL_CHECK=0 or trusted): nothing to pin */
    lo = f->addr;
    hi = f->addr + f->len;
    size_t k = 0;
    while (k < b->npins && b->pins[k] != f)
      k++;
    if (k < b->npins)
      continue;
    if (b->npins == b->cap_pins) {
      size_t nc = b->cap_pins ? b->cap_pins * 2 : 4;
      mc_region_t **nv = realloc(b->pins, nc * sizeof *nv);
      if (!nv) {
        rc = mc_err_set(err, MC_ENOMEM, "out of memory");
        break;
      }
      b->pins = nv;
      b->cap_pins = nc;
    }
    b->pins[b->npins++] = mc_regions_pin_local_locked(&e->regions, a, reqs[i].len);
    added = 1;
  }
  mc_regions_unlock(&e->regions);
  int listed = b->on_pin_list;
  pthread_mutex_unlock(&b->mu);
  if (added && !listed)
    pin_list_add(e, b);
  return rc;
}

static void submit_end(mc_batch_t *b) {
  pthread_mutex_lock(&b->mu);
  b->submitting--;
  pins_release_if_idle(b);
  pthread_mutex_unlock(&b->mu);
}

size_t mc_engine_cancel_local_users(mc_engine_t *e, const mc_region_t *reg) {
  size_t n = 0;
  pthread_mutex_lock(&e->pin_mu);
  for (mc_batch_t *b = e->pin_head; b; b = b->pin_next) {
    pthread_mutex_lock(&b->mu);
    for (size_t k = 0; k < b->npins; k++) {
      if (b->pins[k] == reg) {
        atomic_store(&b->cancel, 1);
        n++;
        break;
      }
    }
    pthread_mutex_unlock(&b->mu);
  }
  pthread_mutex_unlock(&e->pin_mu);
  if (n)
    mc_transports_cancel_sweep(e);
  return n;
}

static void op_done(mc_xfer_op_t *op, int code, const char *msg) {
  mc_batch_t *b = op->arg;
  pthread_mutex_lock(&b->mu);
  for (uint32_t k = 0; k < op->nent; k++)
    part_done(b, op->ent[k].cookie, code, msg, op->ent[k].len);
  if (op->nent == 0) /* NOTIFY: one task, index 0 */
    part_done(b, 0, code, msg, op->ctrl_len);
  b->ops_inflight--;
  pins_release_if_idle(b);
  pthread_cond_broadcast(&b->cv);
  pthread_mutex_unlock(&b->mu);
}

static void op_entry_failed(mc_xfer_op_t *op, uint32_t idx, int code, const char *msg) {
  mc_batch_t *b = op->arg;
  pthread_mutex_lock(&b->mu);
  part_done(b, op->ent[idx].cookie, code, msg, 0);
  pthread_cond_broadcast(&b->cv);
  pthread_mutex_unlock(&b->mu);
}

static int validate(const mc_request_t *r, size_t i, mc_err_t *err) {
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

/* Every request valid?  (Well-predicted branches: ~1 ns a request.) */
static int validate_all(const mc_request_t *reqs, size_t n, mc_err_t *err) {
  for (size_t i = 0; i < n; i++) {
    int rc = validate(&reqs[i], i, err);
    if (rc < 0)
      return rc;
  }
  return 0;
}

void mc_batch_trust_locals(mc_batch_t *b) { b->trusted_locals = 1; }

int mc_engine_check_local(void *engine, uint64_t addr, uint64_t len, mc_err_t *err) {
  mc_engine_t *e = engine;
  if (mc_regions_contains(&e->regions, addr, len))
    return 0;
  return mc_err_set(err, MC_EINVAL,
                    "range [0x%llx, +%llu) is not inside any memory region registered with "
                    "this engine (segment %s); register the buffer first (register_memory)",
                    (unsigned long long)addr, (unsigned long long)len, e->name);
}

/* Same-segment requests: a checked memcpy. */
static void run_local(mc_engine_t *e, mc_batch_t *b, size_t first, size_t n,
                      const int *ldev) {
  for (size_t i = first; i < first + n; i++) {
    mc_task_t *t = &b->tasks[i];
    mc_region_t *reg;
    mc_err_t err;
    int rc = mc_regions_acquire(&e->regions, t->req.remote, t->req.len, e->name, &reg, &err);
    if (rc == 0) {
      void *remote = (void *)(uintptr_t)t->req.remote;
      int dev = reg->cuda_dev >= 0 ? reg->cuda_dev : ldev ? ldev[i - first] : -1;
      if (dev >= 0) /* GPU memory on either side: a driver copy */
        rc = t->req.opcode == MC_OP_WRITE
                 ? mc_gpu_copy_sync(remote, t->req.local, t->req.len, dev, &err)
                 : mc_gpu_copy_sync(t->req.local, remote, t->req.len, dev, &err);
      else if (t->req.opcode == MC_OP_WRITE)
        memmove(remote, t->req.local, t->req.len);
      else
        memmove(t->req.local, remote, t->req.len);
      mc_regions_release(&e->regions, reg);
    }
    pthread_mutex_lock(&b->mu);
    part_done(b, i, rc, rc ? err.msg : NULL, t->req.len);
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
  }
}

typedef struct op_builder {
  mc_xfer_op_t **ops;
  size_t n, cap;
  mc_xfer_op_t *cur;
  uint32_t cur_cap;
  uint64_t cur_bytes;
} op_builder_t;

static int builder_flush(op_builder_t *ob, mc_err_t *err) {
  if (!ob->cur)
    return 0;
  int rc = mc_xfer_op_seal(ob->cur, err);
  if (rc < 0)
    return rc;
  if (ob->n == ob->cap) {
    size_t nc = ob->cap ? ob->cap * 2 : 16;
    mc_xfer_op_t **nv = realloc(ob->ops, nc * sizeof *nv);
    if (!nv)
      return mc_err_set(err, MC_ENOMEM, "out of memory");
    ob->ops = nv;
    ob->cap = nc;
  }
  ob->ops[ob->n++] = ob->cur;
  ob->cur = NULL;
  ob->cur_bytes = 0;
  return 0;
}

static void builder_free(op_builder_t *ob) {
  for (size_t i = 0; i < ob->n; i++)
    mc_xfer_op_free(ob->ops[i]);
  mc_xfer_op_free(ob->cur);
  free(ob->ops);
}

static int batch_finished(void *arg) {
  mc_batch_t *b = arg;
  return atomic_load_explicit(&b->pending, memory_order_acquire) == 0;
}

#define MC_POLL_MAX_BYTES (1u << 20)
#define MC_POLL_MAX_OPS 16

static int submit(mc_engine_t *e, mc_batch_t *b, const char *segment,
                  const mc_request_t *reqs, size_t n, int poll, mc_err_t *err);
static int submit_pinned(mc_engine_t *e, mc_batch_t *b, const char *segment,
                         const mc_request_t *reqs, size_t n, int poll, uint64_t t_in,
                         mc_err_t *err);
/* What a planning transport (transport.h: plan) took of one chunk. */
typedef struct planned {
  int slot;            /* its slot, -1: none */
  void *plan;          /* its plan, NULL: it took nothing */
  const char *take;    /* per request of the chunk */
  const mc_xfer_ent_t *ents; /* per request of the chunk (remote rewritten) */
} planned_t;

static int submit_planned(mc_engine_t *e, mc_batch_t *b, const char *segment,
                          const mc_segment_desc_t *dp, int local, const mc_request_t *reqs,
                          size_t n, int poll, const int *ldev, const planned_t *pl,
                          mc_err_t *err);

int mc_batch_submit(mc_engine_t *e, mc_batch_t *b, const char *segment,
                    const mc_request_t *reqs, size_t n, mc_err_t *err) {
  return submit(e, b, segment, reqs, n, 0, err);
}

int mc_batch_submit_sync(mc_engine_t *e, mc_batch_t *b, const char *segment,
                         const mc_request_t *reqs, size_t n, mc_err_t *err) {
  return submit(e, b, segment, reqs, n, 1, err);
}

/* e->gpu_trace (MC_GPU_TRACE=1) times the GPU planning steps and the wait,
 * in absolute us comparable with the copy worker's job lines. */
static double trace_us(uint64_t ns) {
  return (double)(ns / 1000 % 100000000);
}

static int submit(mc_engine_t *e, mc_batch_t *b, const char *segment,
                  const mc_request_t *reqs, size_t n, int poll, mc_err_t *err) {
  uint64_t t_in = e->gpu_trace ? mc_now_ns() : 0;
  if (!segment || !*segment)
    return mc_err_set(err, MC_EINVAL, "target segment name is empty");
  if (n == 0)
    return 0;
  /* A process that has moved GPU memory before: wake the copy thread now,
   * so it polls by the time this batch's first copy is queued. */
  if (mc_cuda_api_if_loaded())
    mc_gpu_stager_poke(e->gpu);
  int rc = validate_all(reqs, n, err);
  if (rc < 0)
    return rc;
  /* Checks the local buffers (MC_LOCAL_CHECK) and pins their regions. */
  if ((rc = submit_begin(e, b, reqs, n, err)) == 0)
    rc = submit_pinned(e, b, segment, reqs, n, poll, t_in, err);
  submit_end(b);
  return rc;
}

static int submit_pinned(mc_engine_t *e, mc_batch_t *b, const char *segment,
                         const mc_request_t *reqs, size_t n, int poll, uint64_t t_in,
                         mc_err_t *err) {
  int rc = 0;
  int local = !strcmp(segment, e->name);
  mc_segment_desc_t d;
  d.host[0] = '\0';
  d.port = 0;
  if (!local) {
    rc = mc_engine_resolve(e, segment, &d, err);
    if (rc < 0)
      return rc;
  }
  /* GPU memory: where the local buffers live (no CUDA call at all unless
   * this process has loaded CUDA). */
  size_t chunk = (size_t)e->gpu_chunk;
  size_t first_step = chunk < (size_t)e->gpu_first_chunk ? chunk : (size_t)e->gpu_first_chunk;
  int *ldev = NULL;
  mc_gpu_locator_t loc;
  size_t located = n;
  int trace = e->gpu_trace;
  uint64_t t0 = trace ? mc_now_ns() : 0, t1 = 0, t2 = 0;
  if (mc_cuda_api_if_loaded()) {
    ldev = malloc(n * sizeof *ldev);
    if (!ldev)
      return mc_err_set(err, MC_ENOMEM, "out of memory");
    mc_gpu_locator_init(&loc, &e->regions);
    /* A GPU batch to a peer is located chunk by chunk below, so its first
     * copies start before the last request is looked at; anything else
     * (or a first chunk without GPU memory) is located at once. */
    located = !local && n > first_step ? first_step : n;
    int ngpu = mc_gpu_locate_locals(&loc, reqs, 0, located, ldev, err);
    if (ngpu == 0 && located < n) {
      ngpu = mc_gpu_locate_locals(&loc, reqs, located, n, ldev, err);
      located = n;
    }
    if (ngpu <= 0) {
      free(ldev);
      ldev = NULL;
      located = n;
      if (ngpu < 0)
        return ngpu;
    }
  }
  if (trace)
    t1 = mc_now_ns();
  int same_host = 0;
  /* The transport chosen for GPU memory to this peer may plan per request
   * (the same-host GPU transport, transport.h "plan"): it is offered each
   * chunk's GPU requests first; *call is its state across the chunks. */
  mc_peer_t peer = {.segment = segment, .host = d.host, .port = d.port};
  int pslot = ldev && !local ? mc_transport_choose(e, &peer, MC_MEM_CUDA, 0) : -1;
  int pt = mc_tr_plans(e, pslot) ? pslot : -1;
  void *call = NULL;
  if (ldev && !local) {
    /* Large GPU batches go in chunks: locating, planning and queuing chunk
     * k+1 on this thread overlaps the copies of chunk k on the GPU (host
     * work per request would otherwise add up before the first copy
     * starts).  A buffer found running past its allocation in a later
     * chunk fails the submit with earlier chunks already started; the
     * caller's mc_batch_free waits for them. */
    /* The first chunk is small so the GPU starts early; chunks then double
     * up to MC_GPU_CHUNK, and shrink again towards the end (at most half
     * of what is left) so little completion work remains after the last
     * copy. */
    size_t step = first_step;
    if (b->n + n > b->cap)
      step = chunk = n; /* let submit_planned report the size error */
    size_t most = chunk < n ? chunk : n;
    char *take = pt >= 0 ? malloc(most) : NULL;
    mc_xfer_ent_t *ents = pt >= 0 ? malloc(most * sizeof *ents) : NULL;
    if (pt >= 0 && (!take || !ents))
      pt = -1; /* out of memory: the next choice moves them */
    for (size_t off = 0, k; off < n && rc == 0; off += k) {
      size_t left = n - off, half = left / 2 > 256 ? left / 2 : 256;
      k = step < half ? step : half;
      if (k > left)
        k = left;
      step = step * 2 < chunk ? step * 2 : chunk;
      if (off + k > located) {
        rc = mc_gpu_locate_locals(&loc, reqs, located, off + k, ldev, err);
        if (rc < 0)
          break;
        rc = 0;
        located = off + k;
      }
      planned_t pl = {.slot = -1};
      if (pt >= 0) {
        for (size_t i = 0; i < k; i++) {
          const mc_request_t *r = &reqs[off + i];
          ents[i] = (mc_xfer_ent_t){.local = r->local, .remote = r->remote, .len = r->len,
                                    .cookie = (uint32_t)i, .dev = ldev[off + i]};
        }
        pl = (planned_t){.slot = pslot, .take = take, .ents = ents};
        pl.plan = mc_tr_plan(e, pt, &peer, &call, ents, k, take);
      }
      same_host |= pl.plan != NULL;
      if (trace && off == 0)
        t2 = mc_now_ns();
      rc = submit_planned(e, b, segment, &d, 0, reqs + off, k, poll, ldev + off,
                          pl.plan ? &pl : NULL, err);
    }
    if (pt >= 0)
      mc_tr_call_end(e, pt, call);
    free(take);
    free(ents);
  } else {
    t2 = trace ? mc_now_ns() : 0;
    rc = submit_planned(e, b, segment, &d, local, reqs, n, poll, ldev, NULL, err);
  }
  if (trace && ldev)
    mc_log_info("gpu trace: %zu requests at %.1f us: validate %.1f us, locate (first chunk) "
                "%.1f us, first plan (describe, ipc) %.1f us, submit all %.1f us, same-host "
                "path %s", n,
                trace_us(t_in), (t0 - t_in) / 1e3, (t1 - t0) / 1e3, (t2 - t1) / 1e3,
                (mc_now_ns() - t2) / 1e3, same_host ? "yes" : "no");
  free(ldev);
  return rc;
}

/* The requests a planning transport took (caller holds b->mu): whole, one
 * entry each, an op per opcode of up to MC_XFER_MAX_ENTRIES (WRITE ops
 * first), entries as plan() left them. */
static int build_planned(mc_batch_t *b, size_t first, const mc_request_t *reqs, size_t n,
                         const planned_t *pl, op_builder_t *pb, mc_err_t *err) {
  int rc = 0;
  for (int pass = 0; pass < 2 && rc == 0; pass++) {
    int type = pass == 0 ? MC_XFER_WRITE : MC_XFER_READ;
    size_t left = 0;
    for (size_t i = 0; i < n; i++)
      left += pl->take[i] && (reqs[i].opcode == MC_OP_WRITE) == (pass == 0);
    for (size_t i = 0; i < n && rc == 0; i++) {
      if (!pl->take[i] || (reqs[i].opcode == MC_OP_WRITE) != (pass == 0))
        continue;
      if (pb->cur && pb->cur->nent == pb->cur_cap && (rc = builder_flush(pb, err)) < 0)
        break;
      if (!pb->cur) {
        uint32_t cap = left < MC_XFER_MAX_ENTRIES ? (uint32_t)left : MC_XFER_MAX_ENTRIES;
        if (!(pb->cur = mc_xfer_op_new(type, cap, 0))) {
          rc = mc_err_set(err, MC_ENOMEM, "out of memory");
          break;
        }
        pb->cur_cap = cap;
        pb->cur->nent = 0;
        pb->cur->done = op_done;
        pb->cur->entry_failed = op_entry_failed;
        pb->cur->arg = b;
        pb->cur->cancel = &b->cancel;
      }
      mc_xfer_ent_t *ent = &pb->cur->ent[pb->cur->nent++];
      *ent = pl->ents[i];
      ent->cookie = (uint32_t)(first + i);
      b->tasks[first + i].parts_left++;
      left--;
    }
    if (rc == 0)
      rc = builder_flush(pb, err);
  }
  return rc;
}

static int submit_planned(mc_engine_t *e, mc_batch_t *b, const char *segment,
                          const mc_segment_desc_t *dp, int local, const mc_request_t *reqs,
                          size_t n, int poll, const int *ldev, const planned_t *pl,
                          mc_err_t *err) {
  const mc_segment_desc_t *d = dp;
  int pt = pl ? pl->slot : -1;
  const char *via_plan = pl ? pl->take : NULL;
  pthread_mutex_lock(&b->mu);
  if (b->n + n > b->cap) {
    size_t room = b->cap - b->n;
    pthread_mutex_unlock(&b->mu);
    if (pt >= 0)
      mc_tr_submit_plan(e, pt, pl->plan, NULL, 0);
    return mc_err_set(err, MC_EINVAL,
                      "batch has room for %zu more requests, %zu submitted; allocate a larger "
                      "batch",
                      room, n);
  }
  size_t first = b->n;
  for (size_t i = 0; i < n; i++) {
    mc_task_t *t = &b->tasks[first + i];
    memset(t, 0, sizeof *t);
    t->req = reqs[i];
    t->state = MC_TASK_PENDING;
    b->bytes += reqs[i].len;
  }
  b->n += n;
  b->pending += n;
  snprintf(b->last_segment, sizeof b->last_segment, "%s", segment);
  if (local) {
    for (size_t i = 0; i < n; i++)
      b->tasks[first + i].parts_left = 1;
    pthread_mutex_unlock(&b->mu);
    run_local(e, b, first, n, ldev);
    return 0;
  }
  /* Slice and pack: an op holds up to op_entries slices of one opcode and
   * about slice_size bytes; a large request spans several ops.  Each
   * request goes to the transport chosen for the peer and the memory kind
   * of its local buffer (route.c), one set of ops per transport. */
  mc_peer_t peer = {.segment = segment, .host = d->host, .port = d->port};
  int via[MC_MEM_KINDS] = {-1, -1};
  mc_takes_memo_t memo[MC_MEM_KINDS];
  memset(memo, 0, sizeof memo);
  op_builder_t ob[MC_TRANSPORT_MAX];
  memset(ob, 0, sizeof ob);
  int rc = 0;
  op_builder_t pb = {0};
  if (pl)
    rc = build_planned(b, first, reqs, n, pl, &pb, err);
  /* Slices still to place: sizes each op's entry array to what it needs. */
  uint64_t slices_left = 0;
  for (size_t i = 0; i < n; i++)
    if (!(via_plan && via_plan[i]))
      slices_left += (reqs[i].len + e->slice_size - 1) / e->slice_size;
  for (size_t i = 0; i < n && rc == 0; i++) {
    const mc_request_t *r = &reqs[i];
    if (via_plan && via_plan[i])
      continue; /* the planning transport's */
    int dev = ldev ? ldev[i] : -1;
    mc_mem_kind_t kind = dev >= 0 ? MC_MEM_CUDA : MC_MEM_HOST;
    if (via[kind] < 0) /* a planning transport takes only what it planned */
      via[kind] = mc_transport_choose(e, &peer, kind, 1);
    /* The chosen transport may decline this remote range (a peer's GPU
     * region on the same-host CPU path): the next one takes it. */
    op_builder_t *bd = &ob[mc_transport_for_request(e, &peer, kind, via[kind], r->remote,
                                                    r->len, &memo[kind])];
    int type = r->opcode == MC_OP_WRITE ? MC_XFER_WRITE : MC_XFER_READ;
    uint64_t off = 0;
    while (off < r->len) {
      if (bd->cur && (bd->cur->type != type || bd->cur_bytes >= e->slice_size ||
                      bd->cur->nent == bd->cur_cap)) {
        if ((rc = builder_flush(bd, err)) < 0)
          break;
      }
      if (!bd->cur) {
        uint32_t cap = slices_left < e->op_entries ? (uint32_t)slices_left : e->op_entries;
        bd->cur = mc_xfer_op_new(type, cap ? cap : 1, 0);
        if (!bd->cur) {
          rc = mc_err_set(err, MC_ENOMEM, "out of memory");
          break;
        }
        bd->cur_cap = bd->cur->nent;
        bd->cur->nent = 0;
        bd->cur->done = op_done;
        bd->cur->entry_failed = op_entry_failed;
        bd->cur->arg = b;
        bd->cur->cancel = &b->cancel;
      }
      uint64_t room = e->slice_size - bd->cur_bytes;
      uint64_t len = r->len - off < room ? r->len - off : room;
      mc_xfer_ent_t *ent = &bd->cur->ent[bd->cur->nent++];
      ent->local = (char *)r->local + off;
      ent->remote = r->remote + off;
      ent->len = len;
      ent->cookie = (uint32_t)(first + i);
      ent->dev = dev;
      b->tasks[first + i].parts_left++;
      bd->cur_bytes += len;
      off += len;
      if (slices_left)
        slices_left--;
    }
  }
  size_t nops = 0;
  for (int k = 0; k < MC_TRANSPORT_MAX && rc == 0; k++) {
    rc = builder_flush(&ob[k], err);
    nops += ob[k].n;
  }
  if (rc < 0) {
    /* Nothing was handed out: roll the tasks back. */
    b->n = first;
    b->pending -= n;
    pthread_mutex_unlock(&b->mu);
    for (int k = 0; k < MC_TRANSPORT_MAX; k++)
      builder_free(&ob[k]);
    builder_free(&pb);
    if (pt >= 0)
      mc_tr_submit_plan(e, pt, pl->plan, NULL, 0);
    return rc;
  }
  b->ops_inflight += nops + pb.n;
  if (pb.n)
    b->gpu = 1;
  uint64_t bytes = 0;
  for (size_t i = 0; i < n; i++)
    bytes += reqs[i].len;
  pthread_mutex_unlock(&b->mu);
  if (pt >= 0) { /* first: its copies start while the others are sent */
    mc_tr_submit_plan(e, pt, pl->plan, pb.ops, pb.n);
    free(pb.ops);
  }
  for (int k = 0; k < MC_TRANSPORT_MAX; k++) {
    if (!ob[k].n)
      continue;
    /* Small synchronous batches: the caller drives the transport itself. */
    if (!(poll && e->spin_ns && bytes <= MC_POLL_MAX_BYTES && ob[k].n <= MC_POLL_MAX_OPS &&
          mc_tr_submit_poll(e, k, &peer, ob[k].ops, ob[k].n, batch_finished, b, e->spin_ns)))
      mc_tr_submit(e, k, &peer, ob[k].ops, ob[k].n);
    free(ob[k].ops);
  }
  return 0;
}

/* Cancels what is left and waits until no transport holds the batch. */
static void cancel_and_drain(mc_engine_t *e, mc_batch_t *b) {
  atomic_store(&b->cancel, 1);
  mc_transports_cancel_sweep(e);
  pthread_mutex_lock(&b->mu);
  uint64_t next_sweep = mc_now_ns() + 1000000000ull;
  while (b->ops_inflight > 0) {
    struct timespec ts = mc_deadline_ts(mc_now_ns() + 100000000ull);
    pthread_cond_timedwait(&b->cv, &b->mu, &ts);
    if (b->ops_inflight > 0 && mc_now_ns() > next_sweep) {
      pthread_mutex_unlock(&b->mu);
      mc_transports_cancel_sweep(e);
      pthread_mutex_lock(&b->mu);
      next_sweep = mc_now_ns() + 1000000000ull;
    }
  }
  pthread_mutex_unlock(&b->mu);
}

int mc_batch_wait(mc_engine_t *e, mc_batch_t *b, int64_t timeout_ms, mc_err_t *err) {
  /* Small transfers finish within microseconds: spinning briefly saves the
   * wake-up of a sleeping thread, which dominates round trips on VMs. */
  if (e->spin_ns) {
    uint64_t until = mc_now_ns() + e->spin_ns;
    while (atomic_load_explicit(&b->pending, memory_order_acquire) > 0 && mc_now_ns() < until)
      __builtin_ia32_pause();
  }
  if (b->gpu) {
    /* Same-host GPU copies finish within milliseconds: yield-poll for a
     * while rather than pay a sleeping thread's wake-up. */
    uint64_t until = mc_now_ns() + 20000000ull;
    while (atomic_load_explicit(&b->pending, memory_order_acquire) > 0 && mc_now_ns() < until)
      sched_yield();
    if (e->gpu_trace)
      mc_log_info("gpu trace: wait: %zu pending at %.1f us", mc_batch_pending(b),
                  trace_us(mc_now_ns()));
  }
  pthread_mutex_lock(&b->mu);
  uint64_t tmo_ns = timeout_ms >= 0 ? (uint64_t)timeout_ms * 1000000ull
                                    : e->timeout_ms * 1000000ull + b->bytes;
  uint64_t deadline = mc_now_ns() + tmo_ns;
  int timed_out = 0;
  while (b->pending > 0) {
    struct timespec ts = mc_deadline_ts(deadline);
    if (pthread_cond_timedwait(&b->cv, &b->mu, &ts) != 0 && mc_now_ns() >= deadline) {
      timed_out = b->pending > 0;
      break;
    }
  }
  pthread_mutex_unlock(&b->mu);
  if (timed_out) {
    cancel_and_drain(e, b);
    pthread_mutex_lock(&b->mu);
    for (size_t i = 0; i < b->n; i++) {
      mc_task_t *t = &b->tasks[i];
      if (t->state == MC_TASK_CANCELED || t->state == MC_TASK_PENDING) {
        if (t->state == MC_TASK_PENDING) /* local parts cannot stay pending */
          b->pending--;
        t->state = MC_TASK_TIMEOUT;
        t->code = MC_ETIMEDOUT;
        free(t->msg);
        char m[MC_ERR_MSG_MAX];
        snprintf(m, sizeof m,
                 "%s of %llu bytes to segment %s timed out after %llu ms (%llu bytes confirmed)",
                 t->req.opcode == MC_OP_WRITE ? "WRITE" : "READ",
                 (unsigned long long)t->req.len, b->last_segment,
                 (unsigned long long)(tmo_ns / 1000000ull), (unsigned long long)t->done_bytes);
        t->msg = strdup(m);
        b->any_msg = 1;
      }
    }
    pthread_mutex_unlock(&b->mu);
  }
  pthread_mutex_lock(&b->mu);
  int rc = 0;
  /* Every task finished (pending 0): one that did not complete has a
   * message.  Without any, nothing to scan. */
  for (size_t i = 0; (b->any_msg || b->pending) && i < b->n; i++) {
    mc_task_t *t = &b->tasks[i];
    if (t->state != MC_TASK_COMPLETED) {
      rc = mc_err_set(err, t->code ? t->code : MC_EPROTO, "request %zu of %zu: %s", i, b->n,
                      t->msg ? t->msg : mc_strerror(t->code));
      break;
    }
  }
  pthread_mutex_unlock(&b->mu);
  return rc;
}

int mc_batch_status(mc_batch_t *b, size_t i, mc_task_status_t *out) {
  pthread_mutex_lock(&b->mu);
  if (i >= b->n) {
    pthread_mutex_unlock(&b->mu);
    return MC_EINVAL;
  }
  mc_task_t *t = &b->tasks[i];
  out->state = t->state;
  out->code = t->code;
  out->transferred = t->done_bytes;
  snprintf(out->msg, sizeof out->msg, "%s", t->msg ? t->msg : "");
  pthread_mutex_unlock(&b->mu);
  return 0;
}

void mc_batch_free(mc_engine_t *e, mc_batch_t *b) {
  if (!b)
    return;
  pthread_mutex_lock(&b->mu);
  int busy = b->ops_inflight > 0;
  pthread_mutex_unlock(&b->mu);
  if (busy)
    cancel_and_drain(e, b);
  pin_list_remove(e, b);
  pthread_mutex_lock(&b->mu);
  pins_release_if_idle(b); /* idle now: nothing is in flight */
  pthread_mutex_unlock(&b->mu);
  free(b->pins);
  for (size_t i = 0; b->any_msg && i < b->n; i++)
    free(b->tasks[i].msg);
  free(b->rpc_reply);
  free(b->tasks);
  pthread_cond_destroy(&b->cv);
  pthread_mutex_destroy(&b->mu);
  free(b);
}

/* RPC: the reply text is moved into the batch before the op is freed. */
static void rpc_done(mc_xfer_op_t *op, int code, const char *msg) {
  mc_batch_t *b = op->arg;
  pthread_mutex_lock(&b->mu);
  free(b->rpc_reply);
  b->rpc_reply = op->resp;
  op->resp = NULL;
  pthread_mutex_unlock(&b->mu);
  op_done(op, code, msg);
}

/* Builds one control message (NOTIFY or RPC) to a segment as a batch of
 * one task: *bp and *opp to hand to ctrl_submit.  The op's done is `done`. */
static int ctrl_prepare(mc_engine_t *e, const char *segment, int type, const void *msg,
                        size_t len, mc_xfer_done_fn done, mc_segment_desc_t *d,
                        mc_batch_t **bp, mc_xfer_op_t **opp, mc_err_t *err) {
  if (len > MC_XFER_MAX_CTRL)
    return mc_err_set(err, MC_ETOOBIG, "%s of %zu bytes exceeds %u",
                      type == MC_XFER_RPC ? "RPC" : "notification", len, MC_XFER_MAX_CTRL);
  if (!segment || !*segment)
    return mc_err_set(err, MC_EINVAL, "target segment name is empty");
  int rc = mc_engine_resolve(e, segment, d, err);
  if (rc < 0)
    return rc;
  mc_batch_t *b = mc_batch_new(e, 1);
  mc_xfer_op_t *op = mc_xfer_op_new(type, 0, len);
  if (!b || !op) {
    mc_batch_free(e, b);
    mc_xfer_op_free(op);
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  }
  if (len)
    memcpy(op->ctrl, msg, len);
  op->done = done;
  op->arg = b;
  op->cancel = &b->cancel;
  if ((rc = mc_xfer_op_seal(op, err)) < 0) {
    mc_xfer_op_free(op);
    mc_batch_free(e, b);
    return rc;
  }
  memset(&b->tasks[0], 0, sizeof b->tasks[0]);
  b->n = 1;
  b->pending = 1;
  b->ops_inflight = 1;
  b->tasks[0].state = MC_TASK_PENDING;
  b->tasks[0].parts_left = 1;
  b->tasks[0].req.opcode = MC_OP_WRITE;
  b->tasks[0].req.len = len;
  snprintf(b->last_segment, sizeof b->last_segment, "%s", segment);
  *bp = b;
  *opp = op;
  return 0;
}

/* Control messages go over the control channel. */
static void ctrl_submit(mc_engine_t *e, const char *segment, const mc_segment_desc_t *d,
                        mc_xfer_op_t *op) {
  mc_peer_t peer = {.segment = segment, .host = d->host, .port = d->port};
  mc_tr_ctrl_submit(e, &peer, op);
}

/* One control message (NOTIFY or RPC) to a segment, waited for. */
static int ctrl_call(mc_engine_t *e, const char *segment, int type, const void *msg,
                     size_t len, int64_t timeout_ms, char **reply, mc_err_t *err) {
  mc_segment_desc_t d;
  mc_batch_t *b;
  mc_xfer_op_t *op;
  int rc = ctrl_prepare(e, segment, type, msg, len, type == MC_XFER_RPC ? rpc_done : op_done,
                        &d, &b, &op, err);
  if (rc < 0)
    return rc;
  ctrl_submit(e, segment, &d, op);
  rc = mc_batch_wait(e, b, timeout_ms, err);
  if (rc == 0 && reply) {
    pthread_mutex_lock(&b->mu);
    *reply = b->rpc_reply;
    b->rpc_reply = NULL;
    pthread_mutex_unlock(&b->mu);
    if (!*reply)
      *reply = strdup("");
    if (!*reply)
      rc = mc_err_set(err, MC_ENOMEM, "out of memory");
  }
  mc_batch_free(e, b);
  return rc;
}

int mc_engine_notify(mc_engine_t *e, const char *segment, const void *msg, size_t len,
                     int64_t timeout_ms, mc_err_t *err) {
  return ctrl_call(e, segment, MC_XFER_NOTIFY, msg, len, timeout_ms, NULL, err);
}

/* ---- detached notifications ----
 * Each is a batch of one on e->det_head, owned by the engine.  The next
 * detached call (and mc_engine_reap_detached at close, after the transports
 * stopped) frees the finished ones and cancels those past their deadline:
 * nothing waits on a receipt, and what is in flight is bounded. */

static void detached_done(mc_xfer_op_t *op, int code, const char *msg) {
  mc_batch_t *b = op->arg;
  if (code)
    mc_log_warn("%s to segment %s not delivered: %s", b->det_what, b->last_segment,
                msg && *msg ? msg : mc_strerror(code));
  op_done(op, code, msg);
}

void mc_engine_reap_detached(mc_engine_t *e, int all) {
  uint64_t now = mc_now_ns();
  int sweep = 0;
  mc_batch_t *dead = NULL;
  pthread_mutex_lock(&e->det_mu);
  for (mc_batch_t **pp = &e->det_head; *pp;) {
    mc_batch_t *b = *pp;
    pthread_mutex_lock(&b->mu);
    int busy = b->ops_inflight > 0;
    pthread_mutex_unlock(&b->mu);
    if (!busy || all) { /* all: the transports stopped, every op is done */
      *pp = b->det_next;
      e->ndet--;
      e->det_bytes -= b->tasks[0].req.len;
      b->det_next = dead;
      dead = b;
      continue;
    }
    if (now >= b->det_deadline_ns && !atomic_load(&b->cancel)) {
      atomic_store(&b->cancel, 1);
      sweep = 1;
    }
    pp = &b->det_next;
  }
  pthread_mutex_unlock(&e->det_mu);
  if (sweep && !all)
    mc_transports_cancel_sweep(e);
  while (dead) {
    mc_batch_t *b = dead;
    dead = b->det_next;
    mc_batch_free(e, b);
  }
}

int mc_engine_notify_detached(mc_engine_t *e, const char *segment, const void *msg, size_t len,
                              int64_t timeout_ms, const char *what, mc_err_t *err) {
  mc_engine_reap_detached(e, 0);
  pthread_mutex_lock(&e->det_mu);
  int full = e->ndet >= MC_ENGINE_DETACHED_MAX ||
             e->det_bytes + len > MC_ENGINE_DETACHED_BYTES;
  pthread_mutex_unlock(&e->det_mu);
  if (full) /* back-pressure: this one waits for its receipt */
    return mc_engine_notify(e, segment, msg, len, timeout_ms, err);
  mc_segment_desc_t d;
  mc_batch_t *b;
  mc_xfer_op_t *op;
  int rc = ctrl_prepare(e, segment, MC_XFER_NOTIFY, msg, len, detached_done, &d, &b, &op, err);
  if (rc < 0)
    return rc;
  uint64_t tmo_ns = (uint64_t)(timeout_ms > 0 ? timeout_ms : (int64_t)e->timeout_ms) * 1000000ull;
  b->det_deadline_ns = mc_now_ns() + tmo_ns;
  b->det_what = what && *what ? what : "notification";
  pthread_mutex_lock(&e->det_mu);
  b->det_next = e->det_head;
  e->det_head = b;
  e->ndet++;
  e->det_bytes += len;
  pthread_mutex_unlock(&e->det_mu);
  ctrl_submit(e, segment, &d, op); /* may be done before it returns: the list owns b */
  return 0;
}

int mc_engine_rpc(mc_engine_t *e, const char *segment, const char *req, size_t len,
                  int64_t timeout_ms, char **reply, mc_err_t *err) {
  *reply = NULL;
  return ctrl_call(e, segment, MC_XFER_RPC, req, len, timeout_ms, reply, err);
}
