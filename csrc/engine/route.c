/* Which transport moves a request: per peer and local memory kind, the
 * registered transports in registry order (transport/registry.c) that
 * have the capability and reach the peer (transport.h, "How the engine
 * chooses one").  Nothing here knows a transport. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"
#include "util/log.h"

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

/* First transport from slot `from` on that can move `kind` memory to the
 * peer (no_plan: skipping transports that plan per request); the control
 * transport when none does. */
static int choose_from(mc_engine_t *e, const mc_peer_t *peer, mc_mem_kind_t kind, int from,
                       int no_plan) {
  unsigned need = kind == MC_MEM_CUDA ? MC_TCAP_CUDA_MEM : MC_TCAP_HOST_MEM;
  for (int i = from; i < MC_TRANSPORT_MAX; i++) {
    const mc_transport_t *t = &e->tr[i];
    if (!t->ops || !(t->ops->caps & need))
      continue;
    if (t->ops->plan ? no_plan || !t->ops->submit_plan : !t->ops->submit)
      continue;
    if ((t->ops->caps & MC_TCAP_SAME_HOST) && peer->same_host < 0)
      continue;
    if (ask_reaches(e, i, peer, kind))
      return i;
  }
  return e->ctrl;
}

int mc_transport_choose(mc_engine_t *e, const mc_peer_t *peer, mc_mem_kind_t kind,
                        int no_plan) {
  return choose_from(e, peer, kind, 0, no_plan);
}

int mc_transport_for_request(mc_engine_t *e, const mc_peer_t *peer, mc_mem_kind_t kind,
                             int chosen, uint64_t remote, uint64_t len, mc_takes_memo_t *memo) {
  if (memo->hi > memo->lo && remote >= memo->lo && remote < memo->hi &&
      len <= memo->hi - remote)
    return memo->id; /* same answer as an earlier request in this range */
  int asked = 0;
  uint64_t lo = 0, hi = 0;
  while (chosen != e->ctrl) {
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
    chosen = choose_from(e, peer, kind, chosen + 1, 1); /* submit() path: no planners */
  }
  /* Remembered only when one transport's answer decided it. */
  if (asked == 1 && hi > lo)
    *memo = (mc_takes_memo_t){lo, hi, chosen};
  return chosen;
}

/* The peer was lost: ask reaches() again at the next contact. */
void mc_routes_forget(mc_engine_t *e, const char *segment) {
  pthread_mutex_lock(&e->route_mu);
  signed char *v = route_slot(e, segment, 0);
  if (v)
    memset(v, 0, sizeof e->routes[0].v);
  pthread_mutex_unlock(&e->route_mu);
}

void mc_routes_free(mc_engine_t *e) {
  free(e->routes);
  e->routes = NULL;
  e->nroutes = 0;
}
