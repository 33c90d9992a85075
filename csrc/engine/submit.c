/* The data path: a submit's requests checked, pinned and located (host or
 * GPU: prepare.c), offered to a planning transport, sliced into ops per
 * chosen transport and handed over; same-segment requests copied here. */
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

static inline int mc_tr_takes_calls(mc_engine_t *e, int id) { /* slot id takes whole calls */
  return id >= 0 && e->tr[id].ops && e->tr[id].ops->submit_call;
}

static inline int mc_tr_submit_call(mc_engine_t *e, int id, const mc_peer_t *peer,
                                    mc_xfer_call_t *call, mc_err_t *err) {
  return e->tr[id].ops->submit_call(e->tr[id].impl, peer, call, err);
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
                         int *ldev, const mc_prepared_t *prep, mc_err_t *err);
/* What a transport taking whole calls (transport.h: submit_call) took of
 * one range of the call: its ops, which it starts itself once accepted. */
typedef struct planned {
  size_t off;               /* the range's first request in the call */
  const char *take;         /* per request of the range */
  mc_xfer_op_t **ops;       /* entries' cookies: request index in the call */
  size_t nops;
} planned_t;

static int submit_planned(mc_engine_t *e, mc_batch_t *b, const mc_segment_desc_t *d,
                          int local, const mc_request_t *reqs, size_t n, int poll, const int *ldev, const planned_t *pl,
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
  int cuda = mc_cuda_api_if_loaded() != NULL;
  if (cuda)
    mc_gpu_stager_poke(e->gpu);
  /* GPU memory: where the local buffers live (no CUDA call at all unless
   * this process has loaded CUDA). */
  int *ldev = NULL, ldev_s[256]; /* a batch of up to 256: no allocation */
  if (cuda && !(ldev = n <= 256 ? ldev_s : malloc(n * sizeof *ldev)))
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  /* Checks every request, pins the regions of the local buffers (and
   * checks they lie in one: MC_LOCAL_CHECK) and notes their devices. */
  mc_prepared_t prep;
  int rc = mc_batch_prepare(e, b, reqs, n, ldev, &prep, err);
  if (rc == 0)
    rc = submit_pinned(e, b, segment, reqs, n, poll, t_in, ldev, &prep, err);
  mc_batch_pin_end(b);
  if (ldev != ldev_s)
    free(ldev);
  return rc;
}

/* A submit call handed whole to a transport (transport.h submit_call): the
 * engine's side of it. */
typedef struct gpu_call {
  mc_xfer_call_t c; /* first: the transport's callbacks get this */
  mc_engine_t *e;
  mc_batch_t *b;
  const mc_segment_desc_t *d;
  mc_gpu_locator_t *loc;
  int poll;
} gpu_call_t;

static int call_locate(mc_xfer_call_t *c, size_t to, mc_err_t *err) {
  gpu_call_t *g = (gpu_call_t *)c;
  if (to > c->n)
    to = c->n;
  if (to <= c->located)
    return 0;
  int rc = mc_gpu_locate_locals(g->loc, c->reqs, c->located, to, c->ldev, err);
  if (rc < 0)
    return rc;
  c->located = to;
  return 0;
}

static int call_accept(mc_xfer_call_t *c, size_t off, size_t k, const char *take,
                       mc_xfer_op_t **ops, size_t nops, mc_err_t *err) {
  gpu_call_t *g = (gpu_call_t *)c;
  if (off + k > c->located && call_locate(c, off + k, err) < 0)
    return err->code;
  planned_t pl = {.off = off, .take = take, .ops = ops, .nops = nops};
  return submit_planned(g->e, g->b, g->d, 0, c->reqs + off, k, g->poll,
                        c->ldev + off, &pl, err);
}

/* GPU memory to a peer whose transport for it takes whole calls: the
 * transport plans, chunks and starts them (transport.h); else one submit. */
static int submit_gpu(mc_engine_t *e, mc_batch_t *b, const mc_peer_t *peer,
                      const mc_segment_desc_t *d, const mc_request_t *reqs, size_t n, int poll,
                      gpu_call_t *g, int *same_host, mc_err_t *err) {
  int slot = mc_transport_choose(e, peer, MC_MEM_CUDA, 0);
  pthread_mutex_lock(&b->mu);
  size_t room = b->cap - b->n;
  pthread_mutex_unlock(&b->mu);
  if (mc_tr_takes_calls(e, slot) && n <= room) {
    *same_host = 1;
    return mc_tr_submit_call(e, slot, peer, &g->c, err);
  }
  int rc = call_locate(&g->c, n, err); /* n > room: submit_planned reports it */
  return rc < 0 ? rc : submit_planned(e, b, d, 0, reqs, n, poll, g->c.ldev,
                                       NULL, err);
}

/* Local buffers outside every registered region (MC_LOCAL_CHECK=0, a
 * trusted batch): the driver says where, through a locator.  A GPU batch to
 * a peer is then located chunk by chunk (by the transport that takes it,
 * through call_locate), so its first copies start before the last request
 * is looked at; anything else (or a first chunk without GPU memory) at
 * once.  Returns how many are GPU memory (0: the batch is host memory), or
 * <0. */
static int locate_unknown(mc_engine_t *e, mc_gpu_locator_t *loc, const mc_request_t *reqs,
                          size_t n, int local, int *ldev, size_t *located, mc_err_t *err) {
  size_t first_step = (size_t)e->gpu_first_chunk;
  mc_gpu_locator_init(loc, &e->regions);
  *located = !local && n > first_step ? first_step : n;
  int ngpu = mc_gpu_locate_locals(loc, reqs, 0, *located, ldev, err);
  if (ngpu == 0 && *located < n) {
    ngpu = mc_gpu_locate_locals(loc, reqs, *located, n, ldev, err);
    *located = n;
  }
  return ngpu;
}

static int submit_pinned(mc_engine_t *e, mc_batch_t *b, const char *segment,
                         const mc_request_t *reqs, size_t n, int poll, uint64_t t_in,
                         int *ldev, const mc_prepared_t *prep, mc_err_t *err) {
  int rc = 0;
  int local = !strcmp(segment, e->name);
  /* The peer is resolved once here; everything below works on its
   * descriptor (d.name: the segment). */
  mc_segment_desc_t d;
  d.host[0] = '\0';
  d.host_id[0] = '\0';
  d.port = 0;
  if (local)
    snprintf(d.name, sizeof d.name, "%s", e->name);
  else if ((rc = mc_engine_resolve(e, segment, &d, err)) < 0)
    return rc;
  /* The devices of buffers in registered regions were noted by the
   * prepare pass; only the others need the driver. */
  mc_gpu_locator_t loc;
  size_t located = n;
  int trace = e->gpu_trace;
  uint64_t t0 = trace ? mc_now_ns() : 0, t1 = 0;
  if (ldev) {
    int ngpu = prep->gpu;
    if (prep->unknown &&
        (ngpu = locate_unknown(e, &loc, reqs, n, local, ldev, &located, err)) < 0)
      return ngpu;
    if (ngpu == 0) { /* host memory only */
      ldev = NULL;
      located = n;
    }
  }
  if (trace)
    t1 = mc_now_ns();
  int same_host = 0;
  if (ldev && !local) {
    mc_peer_t peer = {.segment = d.name, .host = d.host, .port = d.port,
                      .same_host = mc_peer_same_host(&d)};
    gpu_call_t g = {.c = {.reqs = reqs, .n = n, .ldev = ldev, .located = located,
                          .locate = call_locate, .op_done = mc_batch_op_done,
                          .op_entry_failed = mc_batch_op_entry_failed, .op_arg = b,
                          .op_cancel = &b->cancel, .accept = call_accept},
                    .e = e, .b = b, .d = &d, .loc = &loc, .poll = poll};
    rc = submit_gpu(e, b, &peer, &d, reqs, n, poll, &g, &same_host, err);
  } else {
    rc = submit_planned(e, b, &d, local, reqs, n, poll, ldev, NULL, err);
  }
  if (trace && ldev)
    mc_log_info("gpu trace: %zu requests at %.1f us: validate %.1f us, locate (first chunk) "
                "%.1f us, submit all %.1f us, whole call to its transport %s", n,
                mc_trace_us(t_in), (t0 - t_in) / 1e3, (t1 - t0) / 1e3,
                (mc_now_ns() - t1) / 1e3, same_host ? "yes" : "no");
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

/* The ops a transport taking whole calls built for tasks [first, first+n)
 * (caller holds b->mu): each entry is one whole request; its cookie, the
 * request's index in the call, becomes the task's; count: each adds its
 * task's part (else the task was made with it). */
static void adopt_planned(mc_batch_t *b, size_t first, const planned_t *pl, int count,
                          op_builder_t *pb) {
  uint32_t shift = (uint32_t)(first - pl->off);
  for (size_t o = 0; o < pl->nops; o++) {
    mc_xfer_op_t *op = pl->ops[o];
    mc_xfer_ent_t *ent = op->ent;
    for (uint32_t k = 0, m = op->nent; k < m; k++) {
      uint32_t task = ent[k].cookie + shift;
      ent[k].cookie = task;
      if (count) /* else set when the task was made */
        b->tasks[task].parts_left++;
    }
  }
  pb->ops = pl->ops;
  pb->n = pl->nops;
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

/* Hands the built ops out (caller holds b->mu; released here): one set
 * per transport (a whole-call transport's, pb, it starts itself once this
 * returned); small synchronous batches are driven on this thread
 * (submit_poll). */
static int hand_out(mc_engine_t *e, mc_batch_t *b, const mc_peer_t *peer, op_builder_t *ob,
                    const op_builder_t *pb, uint64_t bytes, int poll, mc_err_t *err) {
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
  pthread_mutex_unlock(&b->mu);
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

static int submit_planned(mc_engine_t *e, mc_batch_t *b, const mc_segment_desc_t *d,
                          int local, const mc_request_t *reqs, size_t n, int poll, const int *ldev, const planned_t *pl,
                          mc_err_t *err) {
  const char *via_plan = pl ? pl->take : NULL;
  pthread_mutex_lock(&b->mu);
  if (b->n + n > b->cap) {
    size_t room = b->cap - b->n;
    pthread_mutex_unlock(&b->mu);
    return mc_err_set(err, MC_EINVAL,
                      "batch has room for %zu more requests, %zu submitted; allocate a larger "
                      "batch",
                      room, n);
  }
  size_t first = b->n, left = n; /* left: requests the planning transport did not take */
  if (pl) /* each planned entry is one whole request it took (adopt_planned) */
    for (size_t o = 0; o < pl->nops; o++)
      left -= pl->ops[o]->nent;
  /* Every request taken by the plan: each task has its one part now (and
   * adopt_planned only renumbers the entries); else counted as made. */
  const uint32_t parts = pl && left == 0;
  uint64_t bytes = 0;
  for (size_t i = 0; i < n; i++) {
    b->tasks[first + i] =
        (mc_task_t){.req = reqs[i], .state = MC_TASK_PENDING, .parts_left = parts};
    bytes += reqs[i].len;
  }
  b->bytes += bytes;
  b->n += n;
  b->pending += n;
  if (strcmp(b->last_segment, d->name) != 0) {
    size_t k = strnlen(d->name, sizeof b->last_segment - 1);
    memcpy(b->last_segment, d->name, k);
    b->last_segment[k] = '\0';
  }
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
  mc_peer_t peer = {.segment = d->name, .host = d->host, .port = d->port,
                    .same_host = mc_peer_same_host(d)};
  int via[MC_MEM_KINDS] = {-1, -1};
  mc_takes_memo_t memo[MC_MEM_KINDS];
  memset(memo, 0, sizeof memo);
  op_builder_t ob[MC_TRANSPORT_MAX];
  memset(ob, 0, sizeof ob);
  int rc = 0;
  op_builder_t pb = {0};
  if (pl)
    adopt_planned(b, first, pl, !parts, &pb);
  /* Slices still to place: sizes each op's entry array to what it needs. */
  uint64_t slices_left = 0;
  for (size_t i = 0; i < n && left; i++)
    if (!(via_plan && via_plan[i]))
      slices_left += (reqs[i].len + e->slice_size - 1) / e->slice_size;
  for (size_t i = 0; i < n && rc == 0 && left; i++) {
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
  if (rc == 0 && (rc = hand_out(e, b, &peer, ob, &pb, bytes, poll, err)) == 0)
    return 0;
  /* Nothing was handed out: roll the tasks back. */
  b->n = first;
  b->pending -= n;
  pthread_mutex_unlock(&b->mu);
  for (int k = 0; k < MC_TRANSPORT_MAX; k++)
    builder_free(&ob[k]);
  return rc; /* a whole-call transport frees its ops (pb) itself */
}
