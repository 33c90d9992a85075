/* The data path: a submit's requests checked, located (host or GPU),
 * offered to a planning transport, sliced into ops per chosen transport
 * and handed over; same-segment requests copied here. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"
#include "gpu/cuda_driver.h"
#include "util/clock.h"
#include "util/log.h"

_Static_assert(MC_ENGINE_MAX_MSG == MC_XFER_MAX_CTRL, "message cap");

/* Thin wrappers over the ops table of slot id (transport.h says what each
 * does): the data path calls a transport only through these. */
static inline void mc_tr_submit(mc_engine_t *e, int id, const mc_peer_t *peer,
                                mc_xfer_op_t **ops, size_t n) {
  e->tr[id].ops->submit(e->tr[id].impl, peer, ops, n);
}

static inline int mc_tr_submit_poll(mc_engine_t *e, int id, const mc_peer_t *peer,
                                    mc_xfer_op_t **ops, size_t n, int (*finished)(void *),
                                    void *arg, uint64_t spin_ns) {
  const mc_transport_t *t = &e->tr[id];
  return t->ops->submit_poll &&
         t->ops->submit_poll(t->impl, peer, ops, n, finished, arg, spin_ns);
}

static inline int mc_tr_plans(mc_engine_t *e, int id) { /* slot id plans per request */
  return id >= 0 && e->tr[id].ops && e->tr[id].ops->plan;
}

static inline void *mc_tr_plan(mc_engine_t *e, int id, const mc_peer_t *peer, void **call,
                               mc_xfer_ent_t *ents, size_t n, char *take) {
  return e->tr[id].ops->plan(e->tr[id].impl, peer, call, ents, n, take);
}

static inline void mc_tr_submit_plan(mc_engine_t *e, int id, void *plan, mc_xfer_op_t **ops,
                                     size_t n) {
  e->tr[id].ops->submit_plan(e->tr[id].impl, plan, ops, n);
}

static inline void mc_tr_call_end(mc_engine_t *e, int id, void *call) {
  if (e->tr[id].ops->call_end)
    e->tr[id].ops->call_end(e->tr[id].impl, call);
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
    mc_batch_part_done(b, i, rc, rc ? err.msg : NULL, t->req.len);
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
  if ((rc = mc_batch_pin_begin(e, b, reqs, n, err)) == 0)
    rc = submit_pinned(e, b, segment, reqs, n, poll, t_in, err);
  mc_batch_pin_end(b);
  return rc;
}

/* The locating and tracing state of a GPU batch sent chunk by chunk. */
typedef struct gpu_chunks {
  mc_gpu_locator_t *loc;    /* ldev is located so far for [0, located) */
  size_t located, first_step, chunk;
  uint64_t t2;              /* trace: when the first chunk was planned */
  int same_host;            /* a planning transport took some */
} gpu_chunks_t;

static int submit_gpu_chunks(mc_engine_t *e, mc_batch_t *b, const mc_peer_t *peer,
                             const mc_segment_desc_t *d, const mc_request_t *reqs, size_t n,
                             int poll, int *ldev, gpu_chunks_t *g, mc_err_t *err) {
  size_t chunk = g->chunk, located = g->located;
  int rc = 0;
  /* The transport chosen for GPU memory to this peer may plan per request
   * (the same-host GPU transport, transport.h "plan"): it is offered each
   * chunk's GPU requests first; *call is its state across the chunks. */
  int pslot = mc_transport_choose(e, peer, MC_MEM_CUDA, 0);
  int pt = mc_tr_plans(e, pslot) ? pslot : -1;
  void *call = NULL;
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
  size_t step = g->first_step;
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
      rc = mc_gpu_locate_locals(g->loc, reqs, located, off + k, ldev, err);
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
      pl.plan = mc_tr_plan(e, pt, peer, &call, ents, k, take);
    }
    g->same_host |= pl.plan != NULL;
    if (e->gpu_trace && off == 0)
      g->t2 = mc_now_ns();
    rc = submit_planned(e, b, peer->segment, d, 0, reqs + off, k, poll, ldev + off,
                        pl.plan ? &pl : NULL, err);
  }
  if (pt >= 0)
    mc_tr_call_end(e, pt, call);
  free(take);
  free(ents);
  return rc;
}

static int submit_pinned(mc_engine_t *e, mc_batch_t *b, const char *segment,
                         const mc_request_t *reqs, size_t n, int poll, uint64_t t_in,
                         mc_err_t *err) {
  int rc = 0;
  int local = !strcmp(segment, e->name);
  mc_segment_desc_t d;
  d.host[0] = '\0';
  d.host_id[0] = '\0';
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
  if (ldev && !local) {
    /* The transport chosen for GPU memory to this peer may plan per
     * request: it is offered each chunk's requests first. */
    mc_peer_t peer = {.segment = segment, .host = d.host, .port = d.port,
                      .same_host = mc_peer_same_host(&d)};
    gpu_chunks_t g = {.loc = &loc, .located = located, .first_step = first_step,
                      .chunk = chunk, .t2 = t2};
    rc = submit_gpu_chunks(e, b, &peer, &d, reqs, n, poll, ldev, &g, err);
    t2 = g.t2;
    same_host = g.same_host;
  } else {
    t2 = trace ? mc_now_ns() : 0;
    rc = submit_planned(e, b, segment, &d, local, reqs, n, poll, ldev, NULL, err);
  }
  if (trace && ldev)
    mc_log_info("gpu trace: %zu requests at %.1f us: validate %.1f us, locate (first chunk) "
                "%.1f us, first plan (describe, ipc) %.1f us, submit all %.1f us, same-host "
                "path %s", n,
                mc_trace_us(t_in), (t0 - t_in) / 1e3, (t1 - t0) / 1e3, (t2 - t1) / 1e3,
                (mc_now_ns() - t2) / 1e3, same_host ? "yes" : "no");
  free(ldev);
  return rc;
}

/* Opens the builder's next op: `cap` entries of `type` for batch b. */
static int builder_open(op_builder_t *bd, mc_batch_t *b, int type, uint32_t cap,
                        mc_err_t *err) {
  bd->cur = mc_xfer_op_new(type, cap, 0);
  if (!bd->cur)
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  bd->cur_cap = bd->cur->nent;
  bd->cur->nent = 0;
  bd->cur->done = mc_batch_op_done;
  bd->cur->entry_failed = mc_batch_op_entry_failed;
  bd->cur->arg = b;
  bd->cur->cancel = &b->cancel;
  return 0;
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
      if (!pb->cur &&
          (rc = builder_open(pb, b, type,
                             left < MC_XFER_MAX_ENTRIES ? (uint32_t)left : MC_XFER_MAX_ENTRIES,
                             err)) < 0)
        break;
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

/* Slices request r (task `task`) into the builder's ops: an op holds up to
 * op_entries slices of one opcode and about slice_size bytes.  Caller
 * holds b->mu. */
static inline int slice_request(mc_engine_t *e, mc_batch_t *b, op_builder_t *bd,
                                const mc_request_t *r, size_t task, int dev,
                                uint64_t *slices_left, mc_err_t *err) {
  int type = r->opcode == MC_OP_WRITE ? MC_XFER_WRITE : MC_XFER_READ;
  int rc = 0;
  for (uint64_t off = 0; off < r->len;) {
    if (bd->cur && (bd->cur->type != type || bd->cur_bytes >= e->slice_size ||
                    bd->cur->nent == bd->cur_cap) && (rc = builder_flush(bd, err)) < 0)
      return rc;
    if (!bd->cur) {
      uint32_t cap = *slices_left < e->op_entries ? (uint32_t)*slices_left : e->op_entries;
      if ((rc = builder_open(bd, b, type, cap ? cap : 1, err)) < 0)
        return rc;
    }
    uint64_t room = e->slice_size - bd->cur_bytes;
    uint64_t len = r->len - off < room ? r->len - off : room;
    mc_xfer_ent_t *ent = &bd->cur->ent[bd->cur->nent++];
    ent->local = (char *)r->local + off;
    ent->remote = r->remote + off;
    ent->len = len;
    ent->cookie = (uint32_t)task;
    ent->dev = dev;
    b->tasks[task].parts_left++;
    bd->cur_bytes += len;
    off += len;
    if (*slices_left)
      (*slices_left)--;
  }
  return 0;
}

/* Hands the built ops out (caller holds b->mu; released here): the
 * planning transport's first (its copies start while the others are
 * sent), then one set per transport; small synchronous batches are driven
 * on this thread (submit_poll). */
static int hand_out(mc_engine_t *e, mc_batch_t *b, const mc_peer_t *peer, op_builder_t *ob,
                    op_builder_t *pb, const planned_t *pl, size_t n, const mc_request_t *reqs,
                    int poll, mc_err_t *err) {
  int rc = 0;
  size_t nops = 0;
  for (int k = 0; k < MC_TRANSPORT_MAX && rc == 0; k++) {
    rc = builder_flush(&ob[k], err);
    nops += ob[k].n;
  }
  if (rc < 0)
    return rc; /* the caller rolls back, b->mu still held */
  b->ops_inflight += nops + pb->n;
  if (pb->n)
    b->gpu = 1;
  uint64_t bytes = 0;
  for (size_t i = 0; i < n; i++)
    bytes += reqs[i].len;
  pthread_mutex_unlock(&b->mu);
  if (pl) {
    mc_tr_submit_plan(e, pl->slot, pl->plan, pb->ops, pb->n);
    free(pb->ops);
  }
  for (int k = 0; k < MC_TRANSPORT_MAX; k++) {
    if (!ob[k].n)
      continue;
    if (!(poll && e->spin_ns && bytes <= MC_POLL_MAX_BYTES && ob[k].n <= MC_POLL_MAX_OPS &&
          mc_tr_submit_poll(e, k, peer, ob[k].ops, ob[k].n, mc_batch_finished, b,
                            e->spin_ns)))
      mc_tr_submit(e, k, peer, ob[k].ops, ob[k].n);
    free(ob[k].ops);
  }
  return 0;
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
   * of its local buffer (peers.c), one set of ops per transport. */
  mc_peer_t peer = {.segment = segment, .host = d->host, .port = d->port,
                    .same_host = mc_peer_same_host(d)};
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
     * region on a same-host path): the next one takes it. */
    op_builder_t *bd = &ob[mc_transport_for_request(e, &peer, kind, via[kind], r->remote,
                                                    r->len, &memo[kind])];
    rc = slice_request(e, b, bd, r, first + i, dev, &slices_left, err);
  }
  if (rc == 0 && (rc = hand_out(e, b, &peer, ob, &pb, pl, n, reqs, poll, err)) == 0)
    return 0;
  /* Nothing was handed out: roll the tasks back. */
  b->n = first;
  b->pending -= n;
  pthread_mutex_unlock(&b->mu);
  for (int k = 0; k < MC_TRANSPORT_MAX; k++)
    builder_free(&ob[k]);
  builder_free(&pb);
  if (pl)
    mc_tr_submit_plan(e, pl->slot, pl->plan, NULL, 0);
  return rc;
}
