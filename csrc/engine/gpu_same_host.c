/* The same-host GPU path: the peer's descriptor (the mc.describe RPC, cached and
 * checked alongside the copies), CUDA IPC mappings of its regions, and one
 * copy job per local GPU for a batch's requests (docs/architecture.md). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/engine_internal.h"
#include "gpu/cuda_driver.h"
#include "gpu/gpu_ipc.h"
#include "util/clock.h"
#include "util/log.h"

/* ---- same-host path ---- */

/* Asks the peer for its descriptor (an RPC on the data connection). */
static int describe_remote(mc_engine_t *e, const char *segment, const mc_segment_desc_t *d,
                           mc_remote_desc_t *out, mc_err_t *err) {
  (void)d;
  char *reply = NULL;
  int rc = mc_engine_rpc(e, segment, MC_RPC_DESCRIBE, strlen(MC_RPC_DESCRIBE), 10000, &reply,
                         err);
  if (rc == 0)
    rc = mc_segment_desc_decode_regions(reply ? reply : "", reply ? strlen(reply) : 0, out, err);
  free(reply);
  return rc;
}

static const mc_remote_region_t *find_region(const mc_remote_desc_t *rd, uint64_t addr,
                                             uint64_t len) {
  size_t lo = 0, hi = rd->n;
  while (lo < hi) { /* first region with addr > a */
    size_t mid = (lo + hi) / 2;
    if (rd->regions[mid].addr <= addr)
      lo = mid + 1;
    else
      hi = mid;
  }
  if (lo == 0)
    return NULL;
  const mc_remote_region_t *r = &rd->regions[lo - 1];
  return addr + len <= r->addr + r->len ? r : NULL;
}

/* Per-peer cache (under gpu_mu): same host or not, and the last
 * descriptor seen. */
static ssize_t peer_find(mc_engine_t *e, const char *segment, int create) {
  for (size_t i = 0; i < e->gpu_npeers; i++)
    if (!strcmp(e->gpu_peers[i].name, segment))
      return (ssize_t)i;
  if (!create)
    return -1;
  void *nv = realloc(e->gpu_peers, (e->gpu_npeers + 1) * sizeof *e->gpu_peers);
  if (!nv)
    return -1;
  e->gpu_peers = nv;
  memset(&e->gpu_peers[e->gpu_npeers], 0, sizeof *e->gpu_peers);
  snprintf(e->gpu_peers[e->gpu_npeers].name, sizeof e->gpu_peers[0].name, "%s", segment);
  return (ssize_t)e->gpu_npeers++;
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
static void peer_store(mc_engine_t *e, const char *segment, int verdict,
                       const mc_remote_desc_t *rd) {
  pthread_mutex_lock(&e->gpu_mu);
  ssize_t i = peer_find(e, segment, 1);
  if (i >= 0) {
    e->gpu_peers[i].verdict = verdict;
    mc_remote_desc_free(&e->gpu_peers[i].desc);
    e->gpu_peers[i].have = rd && desc_copy(&e->gpu_peers[i].desc, rd) == 0;
  }
  pthread_mutex_unlock(&e->gpu_mu);
}

void mc_gpu_forget_peers(mc_engine_t *e) {
  for (size_t i = 0; i < e->gpu_npeers; i++)
    mc_remote_desc_free(&e->gpu_peers[i].desc);
  free(e->gpu_peers);
  e->gpu_peers = NULL;
  e->gpu_npeers = 0;
}

/* ---- runs, plans, groups ----
 *
 * A run is what one submit call shares across its chunks: the peer
 * descriptor the mappings come from, the IPC mappings of its regions
 * (opened once per run), the regions used so far and, when the descriptor
 * came from the cache, the one mc.describe check that runs alongside all
 * of the run's copies.  Each chunk is a plan; its copies complete as a
 * group, which also waits for the run's check.  Refcounted under b->mu. */

typedef struct ipc_group ipc_group_t;

#define RUN_HINTS 4096

struct mc_gpu_run {
  mc_engine_t *e;
  mc_batch_t *b;
  char segment[320];
  char host[256];
  int port;
  mc_remote_desc_t used; /* the descriptor the mappings came from */
  char *region_used;     /* per used.regions: some request maps into it */
  uint64_t *rmap;        /* per region: mapped base, 1 = cannot be opened */
  int *rdev;             /* per region: local device + 1 it was opened on */
  uint32_t hint[RUN_HINTS]; /* 2 MiB page of a remote address -> region + 1 */
  int same_process;
  int validate;          /* cached descriptor: checked by one RPC alongside */
  int rpc_sent;          /* submitter only */
  /* Under b->mu. */
  int checked;           /* the check's answer is in */
  int check_code;
  char check_msg[MC_ERR_MSG_MAX];
  mc_remote_desc_t fresh; /* the descriptor the check fetched */
  ipc_group_t *waiting;   /* groups waiting for the check */
  int refs;
};

struct mc_gpu_plan {
  mc_gpu_run_t *run; /* borrowed: the submitter holds a reference */
  size_t n;
  int *ldev;         /* borrowed until prepare */
  uint64_t *mapped;  /* per request */
  const char *via_ipc;
  mc_gpu_job_t *jobs[16];
  size_t njobs;
};

/* Completion of one chunk: its copy jobs and, with a cached descriptor,
 * the run's check; the last one completes the tasks (b->mu). */
struct ipc_group {
  mc_batch_t *b;
  mc_gpu_run_t *run;
  ipc_group_t *next_waiting;
  int remaining;
  int code;
  char msg[MC_ERR_MSG_MAX];
  size_t nidx;
  size_t idx[];
};

static void run_free(mc_gpu_run_t *r) {
  mc_remote_desc_free(&r->used);
  mc_remote_desc_free(&r->fresh);
  free(r->region_used);
  free(r->rmap);
  free(r->rdev);
  free(r);
}

/* Caller holds b->mu. */
static void run_unref(mc_gpu_run_t *r) {
  if (r && --r->refs == 0)
    run_free(r);
}

void mc_gpu_run_release(mc_gpu_run_t *r) {
  if (!r)
    return;
  mc_batch_t *b = r->b;
  pthread_mutex_lock(&b->mu);
  run_unref(r);
  pthread_mutex_unlock(&b->mu);
}

/* Caller holds b->mu and the check is in: 0 if every region the run used
 * is still registered with the same IPC export, else the failure. */
static int run_verdict(mc_gpu_run_t *r, char *why, size_t cap) {
  if (r->check_code < 0) {
    snprintf(why, cap, "%s", r->check_msg);
    return r->check_code;
  }
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

/* Caller holds b->mu. */
static void group_part_done(ipc_group_t *g, int code, const char *msg) {
  mc_batch_t *b = g->b;
  if (code < 0 && g->code == 0) {
    g->code = code;
    snprintf(g->msg, sizeof g->msg, "%s", msg ? msg : mc_strerror(code));
  }
  b->ops_inflight--;
  if (--g->remaining > 0)
    return;
  for (size_t i = 0; i < g->nidx; i++)
    mc_batch_part_done(b, g->idx[i], g->code, g->code ? g->msg : NULL,
                       b->tasks[g->idx[i]].req.len);
  pthread_cond_broadcast(&b->cv);
  run_unref(g->run);
  free(g);
}

static void ipc_job_done(mc_gpu_job_t *j, int code, const char *msg) {
  ipc_group_t *g = j->arg;
  mc_batch_t *b = g->b;
  mc_gpu_job_free(j);
  pthread_mutex_lock(&b->mu);
  group_part_done(g, code, msg);
  pthread_mutex_unlock(&b->mu);
}

/* The peer's current descriptor arrived (I/O thread): every region the
 * run's copies used must still be registered with the same IPC export. */
static void validate_done(mc_xfer_op_t *op, int code, const char *msg) {
  mc_gpu_run_t *r = op->arg;
  mc_remote_desc_t fresh = {0};
  char why[MC_ERR_MSG_MAX] = "";
  if (code == 0) {
    mc_err_t err = {0};
    const char *json = op->resp ? op->resp : "";
    if (mc_segment_desc_decode_regions(json, strlen(json), &fresh, &err) < 0) {
      code = err.code;
      snprintf(why, sizeof why, "%s", err.msg);
    } else {
      peer_store(r->e, r->segment, 1, &fresh);
    }
  } else {
    snprintf(why, sizeof why, "%s", msg ? msg : mc_strerror(code));
  }
  mc_batch_t *b = r->b;
  pthread_mutex_lock(&b->mu);
  r->fresh = fresh;
  r->check_code = code;
  snprintf(r->check_msg, sizeof r->check_msg, "%s", why);
  r->checked = 1;
  code = run_verdict(r, why, sizeof why);
  while (r->waiting) {
    ipc_group_t *g = r->waiting;
    r->waiting = g->next_waiting;
    group_part_done(g, code, why);
  }
  b->ops_inflight--; /* the check itself */
  pthread_cond_broadcast(&b->cv);
  run_unref(r);
  pthread_mutex_unlock(&b->mu);
}

/* Maps each GPU request into the peer's regions per the run's descriptor.
 * Returns how many map; *miss: some GPU request found no cuda region
 * there. */
static size_t map_requests(mc_gpu_run_t *run, mc_gpu_plan_t *p, const mc_request_t *reqs,
                           const int *ldev, char *via_ipc, int *miss) {
  const mc_remote_desc_t *rd = &run->used;
  size_t k = 0;
  mc_err_t err = {0};
  const mc_remote_region_t *r = NULL; /* the region of the previous request */
  *miss = 0;
  for (size_t i = 0; i < p->n; i++) {
    via_ipc[i] = 0;
    if (ldev[i] < 0)
      continue;
    uint64_t ra = reqs[i].remote, rl = reqs[i].len;
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
    if (run->same_process) {
      p->mapped[i] = ra; /* one address space */
    } else {
      if (r->ipc[0] && run->rdev[ri] != ldev[i] + 1) {
        uint64_t base = 0;
        run->rmap[ri] = mc_gpu_ipc_open(r->ipc, ldev[i], &base, &err) == 0 ? base : 1;
        run->rdev[ri] = ldev[i] + 1;
      }
      if (!r->ipc[0] || run->rmap[ri] <= 1) {
        mc_gpu_log_path_once(run->e, run->segment, "TCP with pinned staging (%s)",
                             !r->ipc[0] ? "the peer exported no CUDA IPC handle"
                             : err.msg[0] ? err.msg
                                          : "a peer's CUDA IPC handle cannot be opened here");
        continue;
      }
      p->mapped[i] = run->rmap[ri] + (ra - r->ipc_base);
    }
    run->region_used[ri] = 1;
    via_ipc[i] = 1;
    k++;
  }
  return k;
}

/* A run over descriptor `rd` (taken over); NULL when out of memory. */
static mc_gpu_run_t *run_new(mc_engine_t *e, mc_batch_t *b, const char *segment,
                             const mc_segment_desc_t *d, mc_remote_desc_t *rd, int validate) {
  mc_gpu_run_t *r = calloc(1, sizeof *r);
  size_t nr = rd->n ? rd->n : 1;
  if (r) {
    r->region_used = calloc(nr, 1);
    r->rmap = calloc(nr, sizeof *r->rmap);
    r->rdev = calloc(nr, sizeof *r->rdev);
  }
  if (!r || !r->region_used || !r->rmap || !r->rdev) {
    if (r)
      run_free(r);
    mc_remote_desc_free(rd);
    return NULL;
  }
  r->e = e;
  r->b = b;
  snprintf(r->segment, sizeof r->segment, "%s", segment);
  snprintf(r->host, sizeof r->host, "%s", d->host);
  r->port = d->port;
  r->used = *rd;
  rd->regions = NULL;
  rd->n = 0;
  r->same_process = r->used.pid == (long)getpid();
  r->validate = validate;
  r->refs = 1; /* the submitter's */
  return r;
}

/* Starts a run: the cached descriptor (checked alongside) or, with
 * `fresh` or no cache, the peer's answer now.  NULL: not same host (or no
 * descriptor), logged. */
static mc_gpu_run_t *run_start(mc_engine_t *e, mc_batch_t *b, const char *segment,
                               const mc_segment_desc_t *d, int fresh) {
  mc_remote_desc_t rd = {0};
  int have = 0;
  pthread_mutex_lock(&e->gpu_mu);
  ssize_t pi = peer_find(e, segment, 0);
  int verdict = pi >= 0 ? e->gpu_peers[pi].verdict : 0;
  if (!fresh && pi >= 0 && verdict > 0 && e->gpu_peers[pi].have)
    have = desc_copy(&rd, &e->gpu_peers[pi].desc) == 0;
  pthread_mutex_unlock(&e->gpu_mu);
  if (verdict < 0)
    return NULL;
  if (!have) { /* first contact (or the cache missed): ask the peer now */
    mc_err_t err = {0};
    if (describe_remote(e, segment, d, &rd, &err) < 0) {
      mc_gpu_log_path_once(e, segment, "TCP with pinned staging (the peer's descriptor is "
                           "not available: %s)", err.msg);
      return NULL;
    }
    int same = rd.host_id[0] && !strcmp(rd.host_id, mc_host_identity());
    peer_store(e, segment, same ? 1 : -1, same ? &rd : NULL);
    if (!same) {
      mc_remote_desc_free(&rd);
      mc_gpu_log_path_once(e, segment, "TCP with pinned staging (the peer runs on another "
                           "host)");
      return NULL;
    }
  }
  return run_new(e, b, segment, d, &rd, have);
}

mc_gpu_plan_t *mc_gpu_ipc_plan(mc_engine_t *e, mc_batch_t *b, const char *segment,
                               const mc_segment_desc_t *d, mc_gpu_run_t **runp,
                               const mc_request_t *reqs, size_t n, int *ldev, char *via_ipc) {
  if (e->gpu_ipc_off)
    return NULL;
  mc_gpu_plan_t *p = calloc(1, sizeof *p);
  if (p) {
    p->n = n;
    p->ldev = ldev;
    p->mapped = calloc(n, sizeof *p->mapped);
  }
  if (!p || !p->mapped) {
    free(p);
    memset(via_ipc, 0, n);
    return NULL;
  }
  size_t k = 0;
  int trace = e->gpu_trace;
  uint64_t t0 = trace ? mc_now_ns() : 0, t1 = 0;
  for (int attempt = 0; attempt < 2; attempt++) {
    if (!*runp && !(*runp = run_start(e, b, segment, d, attempt > 0)))
      break;
    if (trace)
      t1 = mc_now_ns();
    int miss = 0;
    k = map_requests(*runp, p, reqs, ldev, via_ipc, &miss);
    if (trace)
      mc_log_info("gpu trace: plan of %zu requests: run %.1f us, map %.1f us", n,
                  (t1 - t0) / 1e3, (mc_now_ns() - t1) / 1e3);
    if (!(miss && (*runp)->validate))
      break;
    /* A GPU request fell outside the cached regions: this and later
     * chunks go with a fresh descriptor (the old run lives on until its
     * copies are done). */
    mc_gpu_run_release(*runp);
    *runp = NULL;
    k = 0;
  }
  if (k == 0) {
    memset(via_ipc, 0, n);
    free(p->mapped);
    free(p);
    return NULL;
  }
  p->run = *runp;
  mc_gpu_log_path_once(e, segment, "same host: GPU memory moves directly between the GPUs "
                       "(%s; copies by %s)", p->run->same_process ? "same process" : "CUDA IPC",
                       mc_gpu_d2d_copy_name());
  p->via_ipc = via_ipc;
  return p;
}

void mc_gpu_ipc_plan_free(mc_gpu_plan_t *p) {
  if (!p)
    return;
  for (size_t i = 0; i < p->njobs; i++)
    mc_gpu_job_free(p->jobs[i]);
  free(p->mapped);
  free(p);
}

/* Caller holds b->mu.  Queues nothing on failure: the tasks fail. */
void mc_gpu_ipc_prepare(mc_gpu_plan_t *p, mc_batch_t *b, size_t first, const mc_request_t *reqs) {
  mc_gpu_run_t *run = p->run;
  size_t cnt = 0;
  for (size_t i = 0; i < p->n; i++)
    cnt += p->via_ipc[i] != 0;
  ipc_group_t *g = malloc(sizeof *g + cnt * sizeof(size_t));
  if (g) {
    memset(g, 0, sizeof *g);
    g->b = b;
    g->run = run;
    run->refs++;
  }
  /* One copy job per local device. */
  char *seen = calloc(p->n, 1);
  for (size_t i = 0; i < p->n; i++) {
    if (!p->via_ipc[i])
      continue;
    b->tasks[first + i].parts_left = 1;
    if (!g || !seen) {
      mc_batch_part_done(b, first + i, MC_ENOMEM, "out of memory queuing a GPU copy", 0);
      continue;
    }
    g->idx[g->nidx++] = first + i;
    if (seen[i])
      continue;
    int dev = p->ldev[i];
    mc_gpu_job_t *j = p->njobs < 16 ? mc_gpu_job_new(dev, MC_GPU_D2D) : NULL;
    for (size_t k = i; k < p->n; k++) {
      if (!p->via_ipc[k] || p->ldev[k] != dev)
        continue;
      seen[k] = 1;
      mc_cu_ptr loc = (mc_cu_ptr)(uintptr_t)reqs[k].local;
      if (j && (reqs[k].opcode == MC_OP_WRITE
                    ? mc_gpu_job_add(j, p->mapped[k], loc, reqs[k].len)
                    : mc_gpu_job_add(j, loc, p->mapped[k], reqs[k].len)) < 0) {
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
    p->jobs[p->njobs++] = j;
  }
  free(seen);
  if (!g)
    return;
  g->remaining = (int)p->njobs;
  if (run->validate && !run->checked && g->remaining > 0) {
    g->remaining++; /* the run's check completes it too */
    g->next_waiting = run->waiting;
    run->waiting = g;
  } else if (run->validate && run->checked && g->code == 0) {
    g->code = run_verdict(run, g->msg, sizeof g->msg);
  }
  b->gpu = 1;
  b->ops_inflight += (size_t)g->remaining;
  if (run->validate && !run->rpc_sent && g->remaining > 0) {
    run->rpc_sent = 1; /* mc_gpu_ipc_start sends it */
    run->refs++;
    b->ops_inflight++;
  }
  if (p->njobs == 0) { /* nothing could be queued */
    g->remaining = 1;
    b->ops_inflight++;
    group_part_done(g, g->code ? g->code : MC_ENOMEM, g->msg);
  }
}

/* Sends the run's check (once, with its first chunk): the reference and the
 * ops_inflight count prepare took for it pass to validate_done. */
static void send_check(mc_engine_t *e, mc_gpu_run_t *run) {
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
  op->cancel = &run->b->cancel;
  mc_tcp_submit(e->tcp, run->host, run->port, run->segment, &op, 1);
}

void mc_gpu_ipc_start(mc_engine_t *e, mc_gpu_plan_t *p) {
  if (!p)
    return;
  mc_gpu_run_t *run = p->run;
  for (size_t i = 0; i < p->njobs; i++)
    mc_gpu_stager_submit(e->gpu, p->jobs[i]);
  p->njobs = 0;
  if (run->rpc_sent == 1) {
    run->rpc_sent = 2;
    send_check(e, run);
  }
  mc_gpu_ipc_plan_free(p);
}
