/* The engine's transports (transport/transport.h): which one moves a
 * request (per peer and local memory kind, from the preference table
 * below), and the calls every transport gets (cancel, peer lost/closed,
 * RPCs, memory registration, stop).  Nothing here knows a transport's
 * insides. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"
#include "transport/cma/cma.h"
#include "transport/same_host_gpu/same_host_gpu.h"
#include "util/log.h"

/* Transports the engine starts through ops->start (no options of their
 * own), by slot.  TCP and RDMA are started in engine.c with their options.
 * The same-host CPU transport (cma) and the same-host GPU transport start
 * here; each is left unstarted by its off switch (MC_SAME_HOST_CPU=0,
 * MC_GPU_IPC=0). */
static const mc_transport_ops_t *const started_here[MC_TRANSPORT_COUNT] = {
    [MC_TRANSPORT_SAME_HOST_CPU] = &mc_cma_transport_ops,
    [MC_TRANSPORT_SAME_HOST_GPU] = &mc_same_host_gpu_ops,
};

/* Preference per local memory kind, best first (-1 ends a row). */
static const int prefs[MC_MEM_KINDS][MC_TRANSPORT_COUNT + 1] = {
    [MC_MEM_HOST] = {MC_TRANSPORT_SAME_HOST_CPU, MC_TRANSPORT_RDMA, MC_TRANSPORT_TCP, -1},
    [MC_MEM_CUDA] = {MC_TRANSPORT_SAME_HOST_GPU, MC_TRANSPORT_RDMA, MC_TRANSPORT_TCP, -1},
};

static int env_rpc(void *ctx, const char *segment, const char *req, size_t len,
                   int64_t timeout_ms, char **reply, mc_err_t *err) {
  return mc_engine_rpc(ctx, segment, req, len, timeout_ms, reply, err);
}

/* An RPC op to the control channel (TCP), not waited for. */
static void env_rpc_async(void *ctx, const mc_peer_t *peer, mc_xfer_op_t *op) {
  mc_engine_t *e = ctx;
  e->tr[MC_TRANSPORT_TCP].ops->submit(e->tr[MC_TRANSPORT_TCP].impl, peer, &op, 1);
}

int mc_transports_start(mc_engine_t *e, mc_err_t *err) {
  mc_transport_env_t env = {.local_name = e->name, .regions = &e->regions, .ctx = e,
                            .rpc = env_rpc, .rpc_async = env_rpc_async, .gpu = e->gpu,
                            .gpu_trace = e->gpu_trace};
  for (int i = 0; i < MC_TRANSPORT_COUNT; i++) {
    const mc_transport_ops_t *ops = started_here[i];
    if (!ops || !ops->start || e->tr[i].ops)
      continue;
    if (i == MC_TRANSPORT_SAME_HOST_GPU && e->gpu_ipc_off)
      continue; /* MC_GPU_IPC=0 */
    void *impl = NULL;
    env.off = i == MC_TRANSPORT_SAME_HOST_CPU && e->same_host_cpu_off;
    int rc = ops->start(&env, &impl, err);
    if (rc < 0) {
      mc_err_prefix(err, "transport %s", ops->name);
      return rc;
    }
    e->tr[i].ops = ops;
    e->tr[i].impl = impl;
  }
  return 0;
}

void mc_transports_stop(mc_engine_t *e) {
  /* TCP first: no RPC (e.g. a handshake) reaches another transport after. */
  if (e->tr[MC_TRANSPORT_TCP].ops)
    e->tr[MC_TRANSPORT_TCP].ops->stop(e->tr[MC_TRANSPORT_TCP].impl);
  e->tr[MC_TRANSPORT_TCP].ops = NULL;
  e->tcp = NULL;
  for (int i = 0; i < MC_TRANSPORT_COUNT; i++) {
    if (e->tr[i].ops && e->tr[i].ops->stop)
      e->tr[i].ops->stop(e->tr[i].impl);
    e->tr[i].ops = NULL;
  }
  free(e->routes);
  e->routes = NULL;
  e->nroutes = 0;
}

/* ---- choice per (peer, memory kind) ---- */

/* Remembered reaches() answers (route_mu): 1 yes, -1 no, 0 not asked. */
static signed char *route_slot(mc_engine_t *e, const char *segment, int create) {
  for (size_t i = 0; i < e->nroutes; i++)
    if (!strcmp(e->routes[i].name, segment))
      return &e->routes[i].v[0][0];
  if (!create)
    return NULL;
  void *nv = realloc(e->routes, (e->nroutes + 1) * sizeof *e->routes);
  if (!nv)
    return NULL;
  e->routes = nv;
  memset(&e->routes[e->nroutes], 0, sizeof *e->routes);
  snprintf(e->routes[e->nroutes].name, sizeof e->routes[0].name, "%s", segment);
  return &e->routes[e->nroutes++].v[0][0];
}

static int ask_reaches(mc_engine_t *e, int id, const mc_peer_t *peer, mc_mem_kind_t kind) {
  const mc_transport_t *t = &e->tr[id];
  if (!t->ops->reaches)
    return 1;
  pthread_mutex_lock(&e->route_mu);
  signed char *v = route_slot(e, peer->segment, 0);
  int known = v ? v[id * MC_MEM_KINDS + kind] : 0;
  pthread_mutex_unlock(&e->route_mu);
  if (known)
    return known > 0;
  char why[256] = "";
  int yes = t->ops->reaches(t->impl, peer, kind, why, sizeof why) == 1;
  if (!yes)
    mc_log_info("segment %s: not via %s (%s)", peer->segment, t->ops->name,
                why[0] ? why : "the transport cannot reach it");
  pthread_mutex_lock(&e->route_mu);
  if ((v = route_slot(e, peer->segment, 1)))
    v[id * MC_MEM_KINDS + kind] = yes ? 1 : -1;
  pthread_mutex_unlock(&e->route_mu);
  return yes;
}

/* First transport of kind's row from position `from` on that can move it
 * (no_plan: skipping transports that plan per request). */
static int choose_from(mc_engine_t *e, const mc_peer_t *peer, mc_mem_kind_t kind,
                       const int *from, int no_plan) {
  unsigned need = kind == MC_MEM_CUDA ? MC_TCAP_CUDA_MEM : MC_TCAP_HOST_MEM;
  for (const int *p = from; *p >= 0; p++) {
    const mc_transport_t *t = &e->tr[*p];
    if (!t->ops || !(t->ops->caps & need))
      continue;
    if (t->ops->plan ? no_plan || !t->ops->submit_plan : !t->ops->submit)
      continue;
    if ((t->ops->caps & MC_TCAP_SAME_HOST) && peer->same_host < 0)
      continue;
    if (ask_reaches(e, *p, peer, kind))
      return *p;
  }
  return MC_TRANSPORT_TCP;
}

int mc_transport_choose(mc_engine_t *e, const mc_peer_t *peer, mc_mem_kind_t kind,
                        int no_plan) {
  return choose_from(e, peer, kind, prefs[kind], no_plan);
}

int mc_transport_for_request(mc_engine_t *e, const mc_peer_t *peer, mc_mem_kind_t kind,
                             int chosen, uint64_t remote, uint64_t len, mc_takes_memo_t *memo) {
  if (memo->hi > memo->lo && remote >= memo->lo && remote < memo->hi &&
      len <= memo->hi - remote)
    return memo->id; /* same answer as an earlier request in this range */
  int asked = 0;
  uint64_t lo = 0, hi = 0;
  while (chosen != MC_TRANSPORT_TCP) {
    const mc_transport_t *t = &e->tr[chosen];
    if (!t->ops || !t->ops->takes)
      break;
    uint64_t l = remote, h = remote;
    int yes = t->ops->takes(t->impl, peer, remote, len, &l, &h);
    if (asked++ == 0 && l <= remote && h > remote && len <= h - remote) {
      lo = l;
      hi = h;
    }
    if (yes)
      break;
    const int *p = prefs[kind];
    while (*p >= 0 && *p != chosen)
      p++;
    if (*p < 0) {
      chosen = MC_TRANSPORT_TCP;
      break;
    }
    chosen = choose_from(e, peer, kind, p + 1, 1); /* submit() path: no planners */
  }
  /* Remembered only when one transport's answer decided it. */
  if (asked == 1 && hi > lo)
    *memo = (mc_takes_memo_t){lo, hi, chosen};
  return chosen;
}

/* ---- calls every transport gets ---- */

void mc_transports_cancel_sweep(mc_engine_t *e) {
  for (int i = 0; i < MC_TRANSPORT_COUNT; i++)
    if (e->tr[i].ops && e->tr[i].ops->cancel_sweep)
      e->tr[i].ops->cancel_sweep(e->tr[i].impl);
}

void mc_transports_peer_lost(mc_engine_t *e, const char *segment) {
  pthread_mutex_lock(&e->route_mu);
  signed char *v = route_slot(e, segment, 0);
  if (v) /* ask again at the next contact */
    memset(v, 0, sizeof e->routes[0].v);
  pthread_mutex_unlock(&e->route_mu);
  for (int i = 0; i < MC_TRANSPORT_COUNT; i++)
    if (e->tr[i].ops && e->tr[i].ops->peer_lost)
      e->tr[i].ops->peer_lost(e->tr[i].impl, segment);
}

void mc_transports_peer_closed(mc_engine_t *e, const char *segment) {
  for (int i = 0; i < MC_TRANSPORT_COUNT; i++)
    if (e->tr[i].ops && e->tr[i].ops->peer_closed)
      e->tr[i].ops->peer_closed(e->tr[i].impl, segment);
}

int mc_transports_serve_rpc(mc_engine_t *e, const char *from, const char *req, size_t len,
                            char **reply, mc_err_t *err) {
  int any = -1;
  for (int i = 0; i < MC_TRANSPORT_COUNT; i++) {
    const mc_transport_t *t = &e->tr[i];
    if (!t->ops || !t->ops->serve_rpc)
      continue;
    const char *pf = t->ops->rpc_prefix;
    if (!pf) {
      any = i;
      continue;
    }
    size_t pl = strlen(pf);
    if (len >= pl && !memcmp(req, pf, pl))
      return t->ops->serve_rpc(t->impl, from, req, len, reply, err);
  }
  if (any < 0)
    return mc_err_set(err, MC_EUNAVAIL, "segment %s speaks protocol \"tcp\", not \"rdma\": "
                      "use the same protocol on both sides", e->name);
  return e->tr[any].ops->serve_rpc(e->tr[any].impl, from, req, len, reply, err);
}

int mc_transports_register(mc_engine_t *e, void *addr, uint64_t len, const char *location,
                           mc_err_t *err) {
  for (int i = 0; i < MC_TRANSPORT_COUNT; i++) {
    const mc_transport_t *t = &e->tr[i];
    if (!t->ops || !t->ops->mem_register)
      continue;
    int rc = t->ops->mem_register(t->impl, addr, len, location, err);
    if (rc < 0) {
      mc_err_t ignored; /* all or none: nobody knew of it yet */
      for (int k = 0; k < i; k++)
        if (e->tr[k].ops && e->tr[k].ops->mem_register && e->tr[k].ops->mem_unregister)
          e->tr[k].ops->mem_unregister(e->tr[k].impl, addr, e->unregister_wait_ms, &ignored);
      return rc;
    }
  }
  return 0;
}

int mc_transports_unregister(mc_engine_t *e, void *addr, int64_t timeout_ms, mc_err_t *err) {
  /* Slot order: the same-host CPU path (which may refuse: copies in
   * flight) before RDMA (which cannot). */
  for (int i = 0; i < MC_TRANSPORT_COUNT; i++) {
    const mc_transport_t *t = &e->tr[i];
    int rc = t->ops && t->ops->mem_unregister
                 ? t->ops->mem_unregister(t->impl, addr, timeout_ms, err)
                 : 0;
    if (rc < 0)
      return rc;
  }
  return 0;
}
