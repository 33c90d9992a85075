/* Peers: one table, an entry per peer with its descriptor (resolving a
 * segment name to where it is served: cache, metadata server or the P2P
 * handshake) and the transports' reaches() answers; the choice of a
 * transport per (peer, local memory kind): the registered transports in
 * registry order (transport/registry.c) that have the capability and reach
 * the peer (transport.h, "How the engine chooses one"); forgetting a peer
 * when it is lost. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netdb.h>
#include <poll.h>
#include <time.h>
#include <unistd.h>
#include <sys/socket.h>

#include <cjson/cJSON.h>

#include "engine/engine_internal.h"
#include "gpu/gpu_ipc.h"
#include "util/array.h"
#include "util/hostport.h"
#include "util/log.h"



/* ---- segment resolution ---- */


mc_peer_entry_t *mc_peer_entry_locked(mc_engine_t *e, const char *segment, int create) {
  for (size_t i = 0; i < e->npeers; i++)
    if (!strcmp(e->peers[i].name, segment))
      return &e->peers[i];
  if (!create || strlen(segment) >= sizeof e->peers[0].name)
    return NULL;
  mc_peer_entry_t *nv = mc_array_room(e->peers, e->npeers, &e->cap_peers, sizeof *nv, 8);
  if (!nv)
    return NULL;
  e->peers = nv;
  mc_peer_entry_t *p = &e->peers[e->npeers++];
  memset(p, 0, sizeof *p);
  snprintf(p->name, sizeof p->name, "%s", segment);
  return p;
}

void mc_peers_free(mc_engine_t *e) {
  free(e->peers);
  e->peers = NULL;
  e->npeers = e->cap_peers = 0;
}

int mc_engine_resolve(mc_engine_t *e, const char *segment, mc_segment_desc_t *out,
                      mc_err_t *err) {
  pthread_mutex_lock(&e->peers_mu);
  mc_peer_entry_t *p = mc_peer_entry_locked(e, segment, 0);
  if (p && p->resolved) {
    *out = p->d;
    pthread_mutex_unlock(&e->peers_mu);
    return 0;
  }
  pthread_mutex_unlock(&e->peers_mu);

  mc_segment_desc_t d = {0};
  if (strlen(segment) >= sizeof d.name)
    return mc_err_set(err, MC_EINVAL, "segment name is too long");
  if (!e->p2p) {
    char key[512], *val = NULL;
    size_t vlen = 0;
    mc_meta_key_segment(segment, key, sizeof key);
    int rc = mc_meta_get(e->meta, key, &val, &vlen, err);
    if (rc == MC_ENOTFOUND)
      return mc_meta_not_registered(e->meta, segment, err);
    if (rc < 0)
      return rc;
    rc = mc_segment_desc_decode(val, vlen, segment, &d, err);
    free(val);
    if (rc < 0)
      return rc;
    if (strcmp(d.protocol, e->protocol) != 0)
      return mc_err_set(err, MC_EUNAVAIL, "segment %s speaks protocol \"%s\"; this engine "
                        "speaks \"%s\" (use the same protocol on both sides)", segment,
                        d.protocol, e->protocol);
  } else {
    mc_hostport_t hp;
    if (mc_hostport_parse(segment, &hp, err) < 0 || hp.port < 0)
      return mc_err_set(err, MC_EINVAL,
                        "segment \"%s\" is not \"host:port\"; in P2P mode a segment is named by "
                        "its host and rpc port (get_rpc_port())",
                        segment);
    snprintf(d.name, sizeof d.name, "%s", segment);
    snprintf(d.host, sizeof d.host, "%s", hp.host);
    d.port = hp.port;
    snprintf(d.protocol, sizeof d.protocol, "%s", e->protocol);
    /* P2P handshake: a peer not yet known must accept a connection on its
     * rpc port before a submit to it is accepted (as Mooncake's P2P mode
     * fails the submit, not the later status, for an unknown peer). */
    int rc = mc_hostport_probe(segment, d.host, d.port, err);
    if (rc < 0)
      return rc;
  }
  pthread_mutex_lock(&e->peers_mu);
  if ((p = mc_peer_entry_locked(e, segment, 1))) { /* else: resolved again next time */
    p->d = d;
    p->resolved = 1;
  }
  pthread_mutex_unlock(&e->peers_mu);
  *out = d;
  return 0;
}

/* Whether a peer runs on this host, from its descriptor's host identity
 * ("boot id/hostname", gpu_ipc.h): another boot id is another kernel, so
 * no same-host transport can reach it (-1); the same boot id is this host
 * (1; the same-host transports still check the rest in reaches()); no
 * identity (P2P, or a peer that does not say): 0, not known. */
int mc_peer_same_host(const mc_segment_desc_t *d) {
  if (!d->host_id[0])
    return 0;
  const char *mine = mc_host_identity();
  size_t a = strcspn(d->host_id, "/"), b = strcspn(mine, "/");
  if (!a || !b)
    return 0;
  return a == b && !memcmp(d->host_id, mine, a) ? 1 : -1;
}

/* The peer was lost: its descriptor is resolved afresh and the transports'
 * reaches() asked again at the next contact. */
void mc_engine_forget_segment(mc_engine_t *e, const char *segment) {
  pthread_mutex_lock(&e->peers_mu);
  mc_peer_entry_t *p = mc_peer_entry_locked(e, segment, 0);
  if (p)
    *p = e->peers[--e->npeers];
  pthread_mutex_unlock(&e->peers_mu);
}

/* ---- the choice of a transport per (peer, memory kind) ---- */

/* Remembered reaches() answers, in the peer's entry (peers_mu): 1 yes, -1
 * no, 0 not asked. */
static signed char *route_slot(mc_engine_t *e, const char *segment, int create) {
  mc_peer_entry_t *p = mc_peer_entry_locked(e, segment, create);
  return p ? &p->route[0][0] : NULL;
}

static int ask_reaches(mc_engine_t *e, int id, const mc_peer_t *peer, mc_mem_kind_t kind) {
  const mc_transport_t *t = &e->tr[id];
  if (!t->ops->reaches)
    return 1;
  pthread_mutex_lock(&e->peers_mu);
  signed char *v = route_slot(e, peer->segment, 0);
  int known = v ? v[id * MC_MEM_KINDS + kind] : 0;
  pthread_mutex_unlock(&e->peers_mu);
  if (known)
    return known > 0;
  char why[256] = "";
  int yes = t->ops->reaches(t->impl, peer, kind, why, sizeof why) == 1;
  if (!yes)
    mc_log_info("segment %s: not via %s (%s)", peer->segment, t->ops->name,
                why[0] ? why : "the transport cannot reach it");
  pthread_mutex_lock(&e->peers_mu);
  if ((v = route_slot(e, peer->segment, 1)))
    v[id * MC_MEM_KINDS + kind] = yes ? 1 : -1;
  pthread_mutex_unlock(&e->peers_mu);
  return yes;
}

/* First transport from slot `from` on that can move `kind` memory to the
 * peer (no_plan: skipping transports that take whole calls); the control
 * transport when none does. */
static int choose_from(mc_engine_t *e, const mc_peer_t *peer, mc_mem_kind_t kind, int from,
                       int no_plan) {
  unsigned need = kind == MC_MEM_CUDA ? MC_TCAP_CUDA_MEM : MC_TCAP_HOST_MEM;
  for (int i = from; i < MC_TRANSPORT_MAX; i++) {
    const mc_transport_t *t = &e->tr[i];
    if (!t->ops || !(t->ops->caps & need))
      continue;
    if (t->ops->submit_call ? no_plan : !t->ops->submit)
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

int mc_engine_route_copies_here(mc_engine_t *e, const char *segment) {
  pthread_mutex_lock(&e->peers_mu);
  signed char *v = route_slot(e, segment, 0);
  int here = 0;
  /* choose_from's walk (submit's: no whole-call takers) over the answers
   * remembered: the first transport that reaches the peer decides. */
  for (int i = 0; v && i < MC_TRANSPORT_MAX; i++) {
    const mc_transport_t *t = &e->tr[i];
    if (!t->ops || !(t->ops->caps & MC_TCAP_HOST_MEM) || t->ops->submit_call || !t->ops->submit)
      continue;
    int known = t->ops->reaches ? v[i * MC_MEM_KINDS + MC_MEM_HOST] : 1;
    if (known < 0)
      continue;
    here = known > 0 && (t->ops->caps & MC_TCAP_SAME_HOST); /* 0: not asked yet */
    break;
  }
  pthread_mutex_unlock(&e->peers_mu);
  return here;
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
    chosen = choose_from(e, peer, kind, chosen + 1, 1); /* submit() path: no whole-call takers */
  }
  /* Remembered only when one transport's answer decided it. */
  if (asked == 1 && hi > lo)
    *memo = (mc_takes_memo_t){lo, hi, chosen};
  return chosen;
}
