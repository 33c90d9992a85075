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
#include "transport/tcp/wire.h"
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

struct mc_gpu_plan {
  mc_engine_t *e;
  char segment[320];
  char host[256];
  int port;
  mc_remote_desc_t used; /* the descriptor the mappings came from */
  char *region_used;     /* per used.regions: some request maps into it */
  int validate;          /* used came from the cache: check it alongside */
  size_t n;
  int *ldev;         /* borrowed until prepare */
  uint64_t *mapped;  /* per request */
  const char *via_ipc;
  mc_gpu_job_t *jobs[16];
  size_t njobs;
  struct ipc_group *group;
};

/* Completion of one same-host batch: the copy jobs and, with a cached
 * descriptor, the mc.describe RPC that checks it; the last one completes the
 * tasks (b->mu). */
typedef struct ipc_group {
  mc_batch_t *b;
  mc_engine_t *e;
  char segment[320];
  mc_remote_desc_t used;
  char *region_used;
  int remaining;
  int code;
  char msg[MC_ERR_MSG_MAX];
  size_t nidx;
  size_t idx[];
} ipc_group_t;

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
  mc_remote_desc_free(&g->used);
  free(g->region_used);
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
 * copies used must still be registered with the same IPC export. */
static void validate_done(mc_xfer_op_t *op, int code, const char *msg) {
  ipc_group_t *g = op->arg;
  char why[MC_ERR_MSG_MAX] = "";
  if (code == 0) {
    mc_remote_desc_t fresh;
    mc_err_t err = {0};
    const char *json = op->resp ? op->resp : "";
    if (mc_segment_desc_decode_regions(json, strlen(json), &fresh, &err) < 0) {
      code = err.code;
      snprintf(why, sizeof why, "%s", err.msg);
    } else {
      for (size_t i = 0; i < g->used.n && code == 0; i++) {
        if (!g->region_used[i])
          continue;
        const mc_remote_region_t *u = &g->used.regions[i];
        const mc_remote_region_t *f = find_region(&fresh, u->addr, u->len);
        if (!f || f->addr != u->addr || f->len != u->len || strcmp(f->ipc, u->ipc) != 0 ||
            f->ipc_base != u->ipc_base) {
          code = MC_ERANGE;
          snprintf(why, sizeof why,
                   "segment %s unregistered or re-registered its GPU memory [0x%llx, +%llu) "
                   "while this transfer used it; the data may not have landed - retry",
                   g->segment, (unsigned long long)u->addr, (unsigned long long)u->len);
        }
      }
      peer_store(g->e, g->segment, 1, &fresh);
      mc_remote_desc_free(&fresh);
    }
  } else {
    snprintf(why, sizeof why, "%s", msg ? msg : mc_strerror(code));
  }
  mc_batch_t *b = g->b;
  pthread_mutex_lock(&b->mu);
  group_part_done(g, code, why);
  pthread_mutex_unlock(&b->mu);
}

/* Maps each GPU request into the peer's regions per `rd`.  Returns how
 * many map; *miss: some GPU request found no cuda region there. */
static size_t map_requests(mc_gpu_plan_t *p, const mc_remote_desc_t *rd,
                           const mc_request_t *reqs, const int *ldev, char *via_ipc,
                           int *miss) {
  int same_process = rd->pid == (long)getpid();
  size_t k = 0;
  mc_err_t err = {0};
  /* Each region's mapping opened once per call (gpu_ipc caches across
   * calls); 1 = cannot be opened. */
  uint64_t *rmap = calloc(rd->n ? rd->n : 1, sizeof *rmap);
  int *rdev = calloc(rd->n ? rd->n : 1, sizeof *rdev);
  *miss = 0;
  if (!rmap || !rdev) {
    free(rmap);
    free(rdev);
    return 0;
  }
  for (size_t i = 0; i < p->n; i++) {
    via_ipc[i] = 0;
    if (ldev[i] < 0)
      continue;
    const mc_remote_region_t *r = find_region(rd, reqs[i].remote, reqs[i].len);
    if (!r || r->cuda_dev < 0) {
      *miss = 1; /* host memory there, or not (yet) known: TCP says which */
      continue;
    }
    size_t ri = (size_t)(r - rd->regions);
    if (!same_process && r->ipc[0] && (!rmap[ri] || rdev[ri] != ldev[i] + 1)) {
      uint64_t base = 0;
      rmap[ri] = mc_gpu_ipc_open(r->ipc, ldev[i], &base, &err) == 0 ? base : 1;
      rdev[ri] = ldev[i] + 1;
    }
    if (same_process) {
      p->mapped[i] = reqs[i].remote; /* one address space */
    } else if (r->ipc[0] && rmap[ri] > 1) {
      p->mapped[i] = rmap[ri] + (reqs[i].remote - r->ipc_base);
    } else {
      mc_gpu_log_path_once(p->e, p->segment, "TCP with pinned staging (%s)",
                           r->ipc[0] ? err.msg : "the peer exported no CUDA IPC handle");
      continue;
    }
    p->region_used[ri] = 1;
    via_ipc[i] = 1;
    k++;
  }
  free(rmap);
  free(rdev);
  return k;
}

mc_gpu_plan_t *mc_gpu_ipc_plan(mc_engine_t *e, const char *segment, const mc_segment_desc_t *d,
                               const mc_request_t *reqs, size_t n, int *ldev, char *via_ipc) {
  if (e->gpu_ipc_off)
    return NULL;
  mc_remote_desc_t rd = {0};
  int have = 0;
  pthread_mutex_lock(&e->gpu_mu);
  ssize_t pi = peer_find(e, segment, 0);
  int verdict = pi >= 0 ? e->gpu_peers[pi].verdict : 0;
  if (pi >= 0 && verdict > 0 && e->gpu_peers[pi].have)
    have = desc_copy(&rd, &e->gpu_peers[pi].desc) == 0;
  pthread_mutex_unlock(&e->gpu_mu);
  if (verdict < 0)
    return NULL;
  mc_gpu_plan_t *p = calloc(1, sizeof *p);
  if (!p) {
    mc_remote_desc_free(&rd);
    return NULL;
  }
  p->e = e;
  p->n = n;
  p->ldev = ldev;
  snprintf(p->segment, sizeof p->segment, "%s", segment);
  snprintf(p->host, sizeof p->host, "%s", d->host);
  p->port = d->port;
  p->mapped = calloc(n, sizeof *p->mapped);
  size_t k = 0;
  for (int attempt = 0; attempt < 2 && p->mapped; attempt++) {
    if (!have) { /* first contact (or the cache missed): ask the peer now */
      mc_err_t err = {0};
      if (describe_remote(e, segment, d, &rd, &err) < 0) {
        mc_gpu_log_path_once(e, segment, "TCP with pinned staging (the peer's descriptor is "
                             "not available: %s)", err.msg);
        break;
      }
      int same = rd.host_id[0] && !strcmp(rd.host_id, mc_host_identity());
      peer_store(e, segment, same ? 1 : -1, same ? &rd : NULL);
      if (!same) {
        mc_gpu_log_path_once(e, segment, "TCP with pinned staging (the peer runs on another "
                             "host)");
        break;
      }
      have = 1;
      p->validate = 0;
    } else {
      p->validate = 1; /* cached: checked concurrently with the copies */
    }
    free(p->region_used);
    p->region_used = calloc(rd.n ? rd.n : 1, 1);
    if (!p->region_used)
      break;
    int miss = 0;
    k = map_requests(p, &rd, reqs, ldev, via_ipc, &miss);
    if (!(miss && p->validate))
      break;
    /* A GPU request fell outside the cached regions: refresh once. */
    mc_remote_desc_free(&rd);
    have = 0;
    k = 0;
  }
  if (k == 0) {
    memset(via_ipc, 0, n);
    mc_remote_desc_free(&rd);
    free(p->region_used);
    free(p->mapped);
    free(p);
    return NULL;
  }
  p->used = rd;
  mc_gpu_log_path_once(e, segment, "same host: GPU memory moves directly between the GPUs "
                       "(%s; copies by %s)", rd.pid == (long)getpid() ? "same process" : "CUDA IPC",
                       mc_gpu_d2d_copy_name());
  p->via_ipc = via_ipc;
  return p;
}

void mc_gpu_ipc_plan_free(mc_gpu_plan_t *p) {
  if (!p)
    return;
  for (size_t i = 0; i < p->njobs; i++)
    mc_gpu_job_free(p->jobs[i]);
  mc_remote_desc_free(&p->used);
  free(p->region_used);
  free(p->mapped);
  free(p);
}

void mc_gpu_ipc_prepare(mc_gpu_plan_t *p, mc_batch_t *b, size_t first, const mc_request_t *reqs) {
  size_t cnt = 0;
  for (size_t i = 0; i < p->n; i++)
    cnt += p->via_ipc[i] != 0;
  ipc_group_t *g = malloc(sizeof *g + cnt * sizeof(size_t));
  if (g) {
    memset(g, 0, sizeof *g);
    g->b = b;
    g->e = p->e;
    snprintf(g->segment, sizeof g->segment, "%s", p->segment);
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
  g->remaining = (int)p->njobs + (p->validate ? 1 : 0);
  b->gpu = 1;
  b->ops_inflight += (size_t)g->remaining;
  if (p->validate) {
    g->used = p->used;
    g->region_used = p->region_used;
    p->used.regions = NULL;
    p->used.n = 0;
    p->region_used = NULL;
  }
  if (g->remaining == 0) { /* nothing could be queued */
    g->remaining = 1;
    b->ops_inflight++;
    group_part_done(g, g->code ? g->code : MC_ENOMEM, g->msg);
    g = NULL;
  }
  p->group = g;
}

void mc_gpu_ipc_start(mc_engine_t *e, mc_gpu_plan_t *p) {
  if (!p)
    return;
  ipc_group_t *g = p->group;
  int validate = g && p->validate;
  for (size_t i = 0; i < p->njobs; i++)
    mc_gpu_stager_submit(e->gpu, p->jobs[i]);
  p->njobs = 0;
  if (validate) {
    size_t rl = strlen(MC_RPC_DESCRIBE);
    mc_xfer_op_t *op = mc_xfer_op_new(MC_WIRE_RPC, 0, rl);
    mc_err_t err = {0};
    if (op)
      memcpy(op->ctrl, MC_RPC_DESCRIBE, rl);
    if (!op || mc_xfer_op_seal(op, &err) < 0) {
      mc_xfer_op_free(op);
      pthread_mutex_lock(&g->b->mu);
      group_part_done(g, MC_ENOMEM, "out of memory checking the peer's GPU regions");
      pthread_mutex_unlock(&g->b->mu);
    } else {
      op->done = validate_done;
      op->arg = g;
      op->cancel = &g->b->cancel;
      mc_tcp_submit(e->tcp, p->host, p->port, p->segment, &op, 1);
    }
  }
  mc_gpu_ipc_plan_free(p);
}

