/* The same-host GPU transport (same_host_gpu.h): the peer's descriptor (the
 * mc.describe RPC, cached and checked alongside the copies), CUDA IPC
 * mappings of its regions, and one copy job per local GPU and op on the
 * engine's copy worker.  docs/architecture.md "Same-host path". */
#include "transport/same_host_gpu/same_host_gpu.h"
#include "util/bsearch.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpu/cuda_driver.h"
#include "gpu/gpu_ipc.h"
#include "gpu/gpu_staging.h"
#include "meta/segment_desc.h"
#include "util/clock.h"
#include "util/env.h"
#include "util/log.h"

typedef struct peer_entry {
  char name[320];
  int verdict; /* 1 same host, -1 another host, 0 not known */
  int have;    /* desc holds the peer's last descriptor */
  int fresh;   /* desc was fetched by reaches() and not used yet */
  mc_remote_desc_t desc;
  char *raw; /* the reply desc was decoded from (NULL if unknown) */
} peer_entry_t;

typedef struct shg {
  void *ctx;
  int (*rpc)(void *ctx, const char *segment, const char *req, size_t len, int64_t timeout_ms,
             char **reply, mc_err_t *err);
  void (*rpc_async)(void *ctx, const mc_peer_t *peer, mc_xfer_op_t *op);
  char *(*describe)(void *ctx); /* our descriptor, for peers' mc.describe */
  mc_gpu_stager_t *gpu;
  int trace;
  int off; /* MC_GPU_IPC=0: moves nothing, still answers mc.describe */
  pthread_mutex_t mu; /* peers, logged */
  peer_entry_t *peers;
  size_t npeers;
  char (*logged)[320];
  size_t nlogged;
} shg_t;

/* One line per peer: which path its GPU memory takes. */
static void log_path_once(shg_t *t, const char *segment, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void log_path_once(shg_t *t, const char *segment, const char *fmt, ...) {
  char key[320];
  snprintf(key, sizeof key, "%s", segment);
  pthread_mutex_lock(&t->mu);
  for (size_t i = 0; i < t->nlogged; i++)
    if (!strcmp(t->logged[i], key)) {
      pthread_mutex_unlock(&t->mu);
      return;
    }
  char(*v)[320] = realloc(t->logged, (t->nlogged + 1) * sizeof *v);
  if (v) {
    t->logged = v;
    memcpy(v[t->nlogged++], key, sizeof key);
  }
  pthread_mutex_unlock(&t->mu);
  char msg[MC_ERR_MSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  mc_log_info("GPU path to segment %s: %s", segment, msg);
}

/* ---- the peer's descriptor ---- */

/* Asks the peer for its descriptor (an RPC on the control connection). */
static int describe_remote(shg_t *t, const char *segment, mc_remote_desc_t *out, char **raw,
                           mc_err_t *err) {
  char *reply = NULL;
  int rc = t->rpc(t->ctx, segment, MC_RPC_DESCRIBE, strlen(MC_RPC_DESCRIBE), 10000, &reply,
                  err);
  if (rc == 0)
    rc = mc_segment_desc_decode_regions(reply ? reply : "", reply ? strlen(reply) : 0, out, err);
  if (rc == 0 && raw) {
    *raw = reply; /* the caller keeps the text: an identical later reply needs no decode */
    reply = NULL;
  }
  free(reply);
  return rc;
}

static const mc_remote_region_t *find_region(const mc_remote_desc_t *rd, uint64_t addr,
                                             uint64_t len) {
#define RD_ADDR(i) rd->regions[i].addr
  size_t lo = MC_COUNT_LE(rd->n, RD_ADDR, addr); /* first region with addr > a */
#undef RD_ADDR
  if (lo == 0)
    return NULL;
  const mc_remote_region_t *r = &rd->regions[lo - 1];
  return addr + len <= r->addr + r->len ? r : NULL;
}

/* Per-peer cache (under t->mu): same host or not, and the last descriptor
 * seen. */
static ssize_t peer_find(shg_t *t, const char *segment, int create) {
  for (size_t i = 0; i < t->npeers; i++)
    if (!strcmp(t->peers[i].name, segment))
      return (ssize_t)i;
  if (!create)
    return -1;
  void *nv = realloc(t->peers, (t->npeers + 1) * sizeof *t->peers);
  if (!nv)
    return -1;
  t->peers = nv;
  memset(&t->peers[t->npeers], 0, sizeof *t->peers);
  snprintf(t->peers[t->npeers].name, sizeof t->peers[0].name, "%s", segment);
  return (ssize_t)t->npeers++;
}

static int desc_copy(mc_remote_desc_t *dst, const mc_remote_desc_t *src) {
  *dst = *src;
  dst->regions = malloc((src->n ? src->n : 1) * sizeof *src->regions);
  if (!dst->regions) {
    dst->n = 0;
    return MC_ENOMEM;
  }
  memcpy(dst->regions, src->regions, src->n * sizeof *src->regions);
  return 0;
}

/* Stores a fresh descriptor of `segment` (verdict 1 = same host). */
static void peer_store(shg_t *t, const char *segment, int verdict, const mc_remote_desc_t *rd,
                       int fresh, const char *raw) {
  pthread_mutex_lock(&t->mu);
  ssize_t i = peer_find(t, segment, 1);
  if (i >= 0) {
    t->peers[i].verdict = verdict;
    free(t->peers[i].raw);
    t->peers[i].raw = rd && raw ? strdup(raw) : NULL;
    mc_remote_desc_free(&t->peers[i].desc);
    t->peers[i].have = rd && desc_copy(&t->peers[i].desc, rd) == 0;
    t->peers[i].fresh = fresh && t->peers[i].have;
  }
  pthread_mutex_unlock(&t->mu);
}

/* First contact decides: the peer's descriptor names its host.  A peer on
 * another host is remembered; a descriptor that cannot be had now is asked
 * for again by plan() (then logged), as before the interface. */
static int shg_reaches(void *impl, const mc_peer_t *peer, mc_mem_kind_t kind, char *why,
                       size_t why_len) {
  shg_t *t = impl;
  if (t->off) {
    snprintf(why, why_len, "switched off here (MC_GPU_IPC=0)");
    return 0;
  }
  if (kind != MC_MEM_CUDA) {
    snprintf(why, why_len, "it moves GPU memory only");
    return 0;
  }
  pthread_mutex_lock(&t->mu);
  ssize_t pi = peer_find(t, peer->segment, 0);
  int verdict = pi >= 0 ? t->peers[pi].verdict : 0;
  pthread_mutex_unlock(&t->mu);
  if (verdict == 0) {
    mc_remote_desc_t rd = {0};
    mc_err_t err = {0};
    char *raw = NULL;
    if (describe_remote(t, peer->segment, &rd, &raw, &err) < 0)
      return 1; /* plan() asks again and logs why it cannot */
    verdict = rd.host_id[0] && !strcmp(rd.host_id, mc_host_identity()) ? 1 : -1;
    peer_store(t, peer->segment, verdict, verdict > 0 ? &rd : NULL, 1, raw);
    free(raw);
    mc_remote_desc_free(&rd);
  }
  if (verdict < 0) {
    snprintf(why, why_len, "the peer runs on another host: TCP with pinned staging");
    return 0;
  }
  return 1;
}

/* ---- calls, plans, groups ----
 *
 * A call is what one engine submit call shares across its chunks: the peer
 * descriptor the mappings come from, the IPC mappings of its regions
 * (opened once per call), the regions used so far and, when the descriptor
 * came from the cache, the one mc.describe check that runs alongside all
 * of the call's copies.  Each chunk is a plan; each op the engine hands
 * back for it completes as a group: its copy jobs and the call's check.
 * Refcounted under call->mu. */

typedef struct group group_t;

#define RUN_HINTS 4096

typedef struct call {
  shg_t *t;
  pthread_mutex_t mu;
  char segment[320];
  char host[256];
  int port;
  mc_remote_desc_t used; /* the descriptor the mappings came from */
  char *used_raw;        /* the reply `used` was decoded from, or NULL */
  int same_raw;          /* the check's reply was byte-identical to used_raw */
  char *region_used;     /* per used.regions: some request maps into it */
  uint64_t *rmap;        /* per region: mapped base, 1 = cannot be opened */
  int *rdev;             /* per region: local device + 1 it was opened on */
  uint32_t hint[RUN_HINTS]; /* 2 MiB page of a remote address -> region + 1 */
  int same_process;
  int validate; /* cached descriptor: checked by one RPC alongside */
  int rpc_sent; /* submitter only */
  /* Under mu. */
  int checked; /* the check's answer is in */
  int check_code;
  char check_msg[MC_ERR_MSG_MAX];
  mc_remote_desc_t fresh; /* the descriptor the check fetched */
  group_t *waiting;       /* groups waiting for the check */
  int refs;
} call_t;

typedef struct plan {
  call_t *call; /* a reference */
} plan_t;

/* Completion of one op: its copy jobs and, with a cached descriptor, the
 * call's check; the last part completes the op (outside call->mu). */
struct group {
  call_t *call;
  mc_xfer_op_t *op;
  group_t *next_waiting;
  int remaining;
  int code;
  char msg[MC_ERR_MSG_MAX];
};

static void call_free(call_t *r) {
  free(r->used_raw);
  mc_remote_desc_free(&r->used);
  mc_remote_desc_free(&r->fresh);
  free(r->region_used);
  free(r->rmap);
  free(r->rdev);
  pthread_mutex_destroy(&r->mu);
  free(r);
}

static void call_unref(call_t *r) {
  if (!r)
    return;
  pthread_mutex_lock(&r->mu);
  int last = --r->refs == 0;
  pthread_mutex_unlock(&r->mu);
  if (last)
    call_free(r);
}

/* Caller holds r->mu and the check is in: 0 if every region the call used
 * is still registered with the same IPC export, else the failure. */
static int call_verdict(call_t *r, char *why, size_t cap) {
  if (r->check_code < 0) {
    snprintf(why, cap, "%s", r->check_msg);
    return r->check_code;
  }
  if (r->same_raw)
    return 0; /* the same descriptor, byte for byte: every region is unchanged */
  for (size_t i = 0; i < r->used.n; i++) {
    if (!r->region_used[i])
      continue;
    const mc_remote_region_t *u = &r->used.regions[i];
    const mc_remote_region_t *f = find_region(&r->fresh, u->addr, u->len);
    if (!f || f->addr != u->addr || f->len != u->len || strcmp(f->ipc, u->ipc) != 0 ||
        f->ipc_base != u->ipc_base) {
      snprintf(why, cap,
               "segment %s unregistered or re-registered its GPU memory [0x%llx, +%llu) "
               "while this transfer used it; the data may not have landed - retry",
               r->segment, (unsigned long long)u->addr, (unsigned long long)u->len);
      return MC_ERANGE;
    }
  }
  return 0;
}

/* Caller holds g->call->mu.  Returns 1 when g is complete: the caller then
 * runs group_finish after unlocking. */
static int group_part_done(group_t *g, int code, const char *msg) {
  if (code < 0 && g->code == 0) {
    g->code = code;
    snprintf(g->msg, sizeof g->msg, "%s", msg ? msg : mc_strerror(code));
  }
  return --g->remaining == 0;
}

/* No lock held: the op's done() runs, the group drops its call. */
static void group_finish(group_t *g) {
  mc_xfer_op_t *op = g->op;
  op->done(op, g->code, g->code ? g->msg : NULL);
  mc_xfer_op_free(op);
  call_unref(g->call);
  free(g);
}

static void ipc_job_done(mc_gpu_job_t *j, int code, const char *msg) {
  group_t *g = j->arg;
  mc_gpu_job_free(j);
  pthread_mutex_lock(&g->call->mu);
  int fin = group_part_done(g, code, msg);
  pthread_mutex_unlock(&g->call->mu);
  if (fin)
    group_finish(g);
}

/* The peer's current descriptor arrived (I/O thread): every region the
 * call's copies used must still be registered with the same IPC export. */
static void validate_done(mc_xfer_op_t *op, int code, const char *msg) {
  call_t *r = op->arg;
  mc_remote_desc_t fresh = {0};
  char why[MC_ERR_MSG_MAX] = "";
  int same_raw = 0;
  if (code == 0) {
    mc_err_t err = {0};
    const char *json = op->resp ? op->resp : "";
    /* The common case: nothing changed, the reply is the text the call's
     * descriptor came from (the peer caches it): no decode, no compare of
     * regions, the cache stays as it is. */
    same_raw = r->used_raw && !strcmp(json, r->used_raw);
    if (same_raw) {
    } else if (mc_segment_desc_decode_regions(json, strlen(json), &fresh, &err) < 0) {
      code = err.code;
      snprintf(why, sizeof why, "%s", err.msg);
    } else {
      peer_store(r->t, r->segment, 1, &fresh, 0, json);
    }
  } else {
    snprintf(why, sizeof why, "%s", msg ? msg : mc_strerror(code));
  }
  group_t *done = NULL;
  pthread_mutex_lock(&r->mu);
  r->fresh = fresh;
  r->same_raw = same_raw;
  r->check_code = code;
  snprintf(r->check_msg, sizeof r->check_msg, "%s", why);
  r->checked = 1;
  code = call_verdict(r, why, sizeof why);
  while (r->waiting) {
    group_t *g = r->waiting;
    r->waiting = g->next_waiting;
    if (group_part_done(g, code, why)) {
      g->next_waiting = done;
      done = g;
    }
  }
  pthread_mutex_unlock(&r->mu);
  while (done) {
    group_t *g = done;
    done = g->next_waiting;
    group_finish(g);
  }
  call_unref(r); /* the check's reference */
}

/* Maps each entry into the peer's regions per the call's descriptor
 * (mapped[i]: where its remote range appears here).  Returns how many map;
 * *miss: some found no cuda region there. */
static size_t map_entries(call_t *run, const mc_xfer_ent_t *ents, size_t n, char *take,
                          uint64_t *mapped, int *miss) {
  const mc_remote_desc_t *rd = &run->used;
  size_t k = 0;
  mc_err_t err = {0};
  const mc_remote_region_t *r = NULL; /* the region of the previous request */
  *miss = 0;
  for (size_t i = 0; i < n; i++) {
    take[i] = 0;
    if (ents[i].dev < 0)
      continue;
    uint64_t ra = ents[i].remote, rl = ents[i].len;
    /* The region last found in this 2 MiB page first (checking the last
     * region first mispredicts a branch per request over a shuffled block
     * table), then the last region, then a binary search. */
    uint32_t *hp = &run->hint[(ra >> 21) % RUN_HINTS];
    const mc_remote_region_t *c = *hp && *hp <= rd->n ? &rd->regions[*hp - 1] : NULL;
    if (c && ra >= c->addr && ra + rl <= c->addr + c->len) {
      r = c;
    } else if (r && ra >= r->addr && ra + rl <= r->addr + r->len) {
      *hp = (uint32_t)(r - rd->regions) + 1;
    } else {
      r = find_region(rd, ra, rl);
      if (r)
        *hp = (uint32_t)(r - rd->regions) + 1;
    }
    if (!r || r->cuda_dev < 0) {
      *miss = 1; /* host memory there, or not (yet) known: TCP says which */
      r = NULL;
      continue;
    }
    size_t ri = (size_t)(r - rd->regions);
    int ldev = ents[i].dev;
    if (run->same_process) {
      mapped[i] = ra; /* one address space */
    } else {
      if (r->ipc[0] && run->rdev[ri] != ldev + 1) {
        uint64_t base = 0;
        run->rmap[ri] = mc_gpu_ipc_open(r->ipc, ldev, &base, &err) == 0 ? base : 1;
        run->rdev[ri] = ldev + 1;
      }
      if (!r->ipc[0] || run->rmap[ri] <= 1) {
        log_path_once(run->t, run->segment, "TCP with pinned staging (%s)",
                      !r->ipc[0] ? "the peer exported no CUDA IPC handle"
                      : err.msg[0] ? err.msg
                                   : "a peer's CUDA IPC handle cannot be opened here");
        continue;
      }
      mapped[i] = run->rmap[ri] + (ra - r->ipc_base);
    }
    run->region_used[ri] = 1;
    take[i] = 1;
    k++;
  }
  return k;
}

/* A call over descriptor `rd` (taken over); NULL when out of memory. */
static call_t *call_new(shg_t *t, const mc_peer_t *peer, mc_remote_desc_t *rd, int validate) {
  call_t *r = calloc(1, sizeof *r);
  size_t nr = rd->n ? rd->n : 1;
  if (r) {
    pthread_mutex_init(&r->mu, NULL);
    r->region_used = calloc(nr, 1);
    r->rmap = calloc(nr, sizeof *r->rmap);
    r->rdev = calloc(nr, sizeof *r->rdev);
  }
  if (!r || !r->region_used || !r->rmap || !r->rdev) {
    if (r)
      call_free(r);
    mc_remote_desc_free(rd);
    return NULL;
  }
  r->t = t;
  snprintf(r->segment, sizeof r->segment, "%s", peer->segment);
  snprintf(r->host, sizeof r->host, "%s", peer->host ? peer->host : "");
  r->port = peer->port;
  r->used = *rd;
  rd->regions = NULL;
  rd->n = 0;
  r->same_process = r->used.pid == (long)getpid();
  r->validate = validate;
  r->refs = 1; /* the engine's, until call_end */
  return r;
}

/* Starts a call: the cached descriptor (checked alongside) or, with
 * `refetch`, no cache, or one fetched by reaches() just now, the peer's
 * answer now.  NULL: not same host (or no descriptor), logged. */
static call_t *call_start(shg_t *t, const mc_peer_t *peer, int refetch) {
  mc_remote_desc_t rd = {0};
  int have = 0, fresh = 0;
  char *raw = NULL;
  pthread_mutex_lock(&t->mu);
  ssize_t pi = peer_find(t, peer->segment, 0);
  int verdict = pi >= 0 ? t->peers[pi].verdict : 0;
  if (!refetch && pi >= 0 && verdict > 0 && t->peers[pi].have) {
    have = desc_copy(&rd, &t->peers[pi].desc) == 0;
    fresh = have && t->peers[pi].fresh;
    t->peers[pi].fresh = 0;
    if (have && t->peers[pi].raw)
      raw = strdup(t->peers[pi].raw);
  }
  pthread_mutex_unlock(&t->mu);
  if (verdict < 0)
    return NULL;
  if (!have) { /* first contact (or the cache missed): ask the peer now */
    mc_err_t err = {0};
    free(raw);
    raw = NULL;
    if (describe_remote(t, peer->segment, &rd, &raw, &err) < 0) {
      log_path_once(t, peer->segment, "TCP with pinned staging (the peer's descriptor is "
                    "not available: %s)", err.msg);
      return NULL;
    }
    int same = rd.host_id[0] && !strcmp(rd.host_id, mc_host_identity());
    peer_store(t, peer->segment, same ? 1 : -1, same ? &rd : NULL, 0, raw);
    if (!same) {
      free(raw);
      mc_remote_desc_free(&rd);
      log_path_once(t, peer->segment, "TCP with pinned staging (the peer runs on another "
                    "host)");
      return NULL;
    }
  }
  call_t *r = call_new(t, peer, &rd, have && !fresh);
  if (r)
    r->used_raw = raw;
  else
    free(raw);
  return r;
}

static void *shg_plan(void *impl, const mc_peer_t *peer, void **callp, mc_xfer_ent_t *ents,
                      size_t n, char *take) {
  shg_t *t = impl;
  call_t **runp = (call_t **)callp;
  size_t k = 0;
  uint64_t *mapped = malloc((n ? n : 1) * sizeof *mapped);
  if (!mapped) {
    memset(take, 0, n);
    return NULL;
  }
  uint64_t t0 = t->trace ? mc_now_ns() : 0, t1 = 0;
  for (int attempt = 0; attempt < 2; attempt++) {
    if (!*runp && !(*runp = call_start(t, peer, attempt > 0)))
      break;
    if (t->trace)
      t1 = mc_now_ns();
    int miss = 0;
    k = map_entries(*runp, ents, n, take, mapped, &miss);
    if (t->trace)
      mc_log_info("gpu trace: plan of %zu requests: run %.1f us, map %.1f us", n,
                  (t1 - t0) / 1e3, (mc_now_ns() - t1) / 1e3);
    if (!(miss && (*runp)->validate))
      break;
    /* A GPU request fell outside the cached regions: this and later
     * chunks go with a fresh descriptor (the old call lives on until its
     * copies are done). */
    call_unref(*runp);
    *runp = NULL;
    k = 0;
  }
  plan_t *p = k ? malloc(sizeof *p) : NULL;
  if (!p) {
    memset(take, 0, n);
    free(mapped);
    return NULL;
  }
  for (size_t i = 0; i < n; i++) /* the copies' address (transport.h: plan) */
    if (take[i])
      ents[i].remote = mapped[i];
  free(mapped);
  call_t *run = *runp;
  pthread_mutex_lock(&run->mu);
  run->refs++;
  pthread_mutex_unlock(&run->mu);
  p->call = run;
  log_path_once(t, peer->segment, "same host: GPU memory moves directly between the GPUs "
                "(%s; copies by %s)", run->same_process ? "same process" : "CUDA IPC",
                mc_gpu_d2d_copy_name());
  return p;
}

/* Sends the call's check (once, with its first op): it holds a reference
 * to the call until validate_done. */
static void send_check(shg_t *t, call_t *run, atomic_int *cancel) {
  size_t rl = strlen(MC_RPC_DESCRIBE);
  mc_xfer_op_t *op = mc_xfer_op_new(MC_XFER_RPC, 0, rl);
  mc_err_t err = {0};
  if (op)
    memcpy(op->ctrl, MC_RPC_DESCRIBE, rl);
  if (!op || mc_xfer_op_seal(op, &err) < 0) {
    mc_xfer_op_free(op);
    mc_xfer_op_t fake = {0};
    fake.arg = run;
    validate_done(&fake, MC_ENOMEM, "out of memory checking the peer's GPU regions");
    return;
  }
  op->done = validate_done;
  op->arg = run;
  op->cancel = cancel;
  mc_peer_t peer = {.segment = run->segment, .host = run->host, .port = run->port};
  t->rpc_async(t->ctx, &peer, op);
}

/* One op: one copy job per local device; the group completes the op.
 * Returns the group, NULL when it failed at once (the op is done). */
static group_t *op_prepare(call_t *run, mc_xfer_op_t *op, mc_gpu_job_t **jobs, size_t *njobs) {
  group_t *g = calloc(1, sizeof *g);
  char *seen = calloc(op->nent ? op->nent : 1, 1);
  size_t nj = 0;
  if (!g || !seen) {
    free(g);
    free(seen);
    op->done(op, MC_ENOMEM, "out of memory queuing a GPU copy");
    mc_xfer_op_free(op);
    return NULL;
  }
  g->call = run;
  g->op = op;
  for (uint32_t i = 0; i < op->nent; i++) {
    if (seen[i])
      continue;
    int dev = op->ent[i].dev;
    mc_gpu_job_t *j = nj < 16 ? mc_gpu_job_new(dev, MC_GPU_D2D) : NULL;
    for (uint32_t k = i; k < op->nent; k++) {
      if (op->ent[k].dev != dev)
        continue;
      seen[k] = 1;
      mc_cu_ptr loc = (mc_cu_ptr)(uintptr_t)op->ent[k].local;
      mc_cu_ptr mapped = (mc_cu_ptr)op->ent[k].remote;
      if (j && (op->type == MC_XFER_WRITE ? mc_gpu_job_add(j, mapped, loc, op->ent[k].len)
                                          : mc_gpu_job_add(j, loc, mapped, op->ent[k].len)) < 0) {
        mc_gpu_job_free(j);
        j = NULL;
      }
    }
    if (!j) {
      if (g->code == 0) {
        g->code = MC_ENOMEM;
        snprintf(g->msg, sizeof g->msg, "out of memory queuing GPU copies");
      }
      continue;
    }
    j->arg = g;
    j->complete = ipc_job_done;
    jobs[nj++] = j;
  }
  free(seen);
  *njobs = nj;
  return g;
}

static void shg_submit_plan(void *impl, void *plan, mc_xfer_op_t **ops, size_t nops) {
  shg_t *t = impl;
  plan_t *p = plan;
  if (!p)
    return;
  call_t *run = p->call;
  free(p);
  for (size_t o = 0; o < nops; o++) {
    mc_gpu_job_t *jobs[16];
    size_t nj = 0;
    atomic_int *cancel = ops[o]->cancel; /* the op may be done once its jobs are queued */
    group_t *g = op_prepare(run, ops[o], jobs, &nj);
    if (!g)
      continue;
    pthread_mutex_lock(&run->mu);
    run->refs++; /* the group's */
    g->remaining = (int)nj;
    if (run->validate && !run->checked && nj > 0) {
      g->remaining++; /* the call's check completes it too */
      g->next_waiting = run->waiting;
      run->waiting = g;
    } else if (run->validate && run->checked && g->code == 0) {
      g->code = call_verdict(run, g->msg, sizeof g->msg);
    }
    int send = run->validate && !run->rpc_sent && nj > 0;
    if (send) {
      run->rpc_sent = 1;
      run->refs++; /* the check's */
    }
    pthread_mutex_unlock(&run->mu);
    if (nj == 0) { /* nothing could be queued */
      if (g->code == 0)
        g->code = MC_ENOMEM;
      group_finish(g);
      continue;
    }
    for (size_t i = 0; i < nj; i++)
      mc_gpu_stager_submit(t->gpu, jobs[i]);
    if (send)
      send_check(t, run, cancel);
  }
  call_unref(run); /* the plan's */
}

static void shg_call_end(void *impl, void *call) {
  (void)impl;
  call_unref(call);
}

/* Copy jobs run to completion within milliseconds: nothing to cancel (the
 * check is a TCP op, swept there). */
static void shg_cancel_sweep(void *impl) { (void)impl; }

static int shg_start(const mc_transport_env_t *env, void **impl, mc_err_t *err) {
  if (!env->rpc || !env->rpc_async || !env->gpu)
    return mc_err_set(err, MC_EINVAL, "the same-host GPU transport needs the engine's RPC "
                      "calls and its GPU copy worker");
  shg_t *t = calloc(1, sizeof *t);
  if (!t)
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  t->ctx = env->ctx;
  t->rpc = env->rpc;
  t->rpc_async = env->rpc_async;
  t->describe = env->describe;
  t->gpu = env->gpu;
  t->trace = env->gpu_trace;
  t->off = mc_env_long("MC_GPU_IPC", 1, 0, 1) == 0;
  pthread_mutex_init(&t->mu, NULL);
  *impl = t;
  return 0;
}

/* mc.describe: a peer's plan() asks for our regions (and their IPC
 * handles); also mc_engine_describe_peer's answer, so it is served even
 * with MC_GPU_IPC=0. */
static int shg_serve_rpc(void *impl, const char *from, const char *req, size_t len,
                         char **reply, mc_err_t *err) {
  shg_t *t = impl;
  (void)from, (void)req, (void)len; /* the engine matched the whole text */
  *reply = t->describe ? t->describe(t->ctx) : NULL;
  return *reply ? 0 : mc_err_set(err, MC_ENOMEM, "out of memory describing our segment");
}

/* After the engine stopped submitting and its batches were freed: calls
 * and groups hold no pointer into t except validate_done's cache update,
 * which TCP (stopped first) has run by now. */
static void shg_stop(void *impl) {
  shg_t *t = impl;
  if (!t)
    return;
  for (size_t i = 0; i < t->npeers; i++) {
    mc_remote_desc_free(&t->peers[i].desc);
    free(t->peers[i].raw);
  }
  free(t->peers);
  free(t->logged);
  pthread_mutex_destroy(&t->mu);
  free(t);
}

const mc_transport_ops_t mc_same_host_gpu_ops = {
    .name = "gpu-ipc",
    .caps = MC_TCAP_CUDA_MEM | MC_TCAP_SAME_HOST,
    .start = shg_start,
    .stop = shg_stop,
    .reaches = shg_reaches,
    .plan = shg_plan,
    .submit_plan = shg_submit_plan,
    .call_end = shg_call_end,
    .cancel_sweep = shg_cancel_sweep,
    .rpc_prefix = MC_RPC_DESCRIBE, /* no trailing '.': the whole text */
    .serve_rpc = shg_serve_rpc,
};
