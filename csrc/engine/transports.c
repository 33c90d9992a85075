/* The engine's transports (transport/transport.h): starting the registered
 * ones (transport/registry.c) from the engine's configuration, the control
 * channel (whichever declares MC_TCAP_CTRL), the calls every transport gets
 * (cancel, peer lost/closed, RPCs, memory registration, statistics, stop),
 * and thin wrappers over the ops table for the data path.  Nothing here
 * knows a transport. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"
#include "transport/registry.h"
#include "util/clock.h"
#include "util/log.h"

static int env_rpc(void *ctx, const char *segment, const char *req, size_t len,
                   int64_t timeout_ms, char **reply, mc_err_t *err) {
  return mc_engine_rpc(ctx, segment, req, len, timeout_ms, reply, err);
}

/* An RPC op to the control channel, not waited for. */
static void env_rpc_async(void *ctx, const mc_peer_t *peer, mc_xfer_op_t *op) {
  mc_ctrl_submit_op(ctx, peer, op);
}

static char *env_describe(void *ctx) { return mc_engine_describe(ctx); }

/* A connection to a segment failed to come up or named another segment:
 * forget the peer (its cached address, so that the next call resolves it
 * afresh and, with a metadata server, learns whether the peer is gone or
 * moved; and its transports' answers, asked again at the next contact). */
static void on_peer_failed(void *ctx, const char *segment) {
  mc_engine_t *e = ctx;
  mc_engine_forget_segment(e, segment);
  mc_transports_peer_lost(e, segment);
  pthread_rwlock_rdlock(&e->handler_lock);
  if (e->peer_lost_cb)
    e->peer_lost_cb(e->peer_lost_arg, segment);
  pthread_rwlock_unlock(&e->handler_lock);
  mc_engine_note_peer_lost(e, segment);
}

/* A peer's control connection to us closed: e.g. drop the QPs it connected. */
static void on_incoming_closed(void *ctx, const char *segment) {
  mc_transports_peer_closed(ctx, segment);
  mc_engine_note_peer_lost(ctx, segment);
}

static int on_rpc(void *ctx, const char *from, const char *req, size_t len, char **reply,
                  mc_err_t *err) {
  return mc_transports_serve_rpc(ctx, from, req, len, reply, err);
}

int mc_protocol_check(const char *proto, mc_err_t *err) {
  char known[128] = "";
  size_t n = 0;
  /* Listed from the default (the control transport, registered last) up. */
  for (int i = MC_TRANSPORT_MAX - 1; i >= 0; i--) {
    const mc_transport_ops_t *ops = i < mc_transport_count() ? mc_transport_registry[i] : NULL;
    if (!ops || !ops->protocol)
      continue;
    if (!strcmp(ops->protocol, proto))
      return 0;
    n += (size_t)snprintf(known + n, n < sizeof known ? sizeof known - n : 0, "%s\"%s\"",
                          n ? " or " : "", ops->protocol);
  }
  return mc_err_set(err, MC_EINVAL, "protocol \"%s\" is not accepted; use %s", proto, known);
}

/* The control transport's protocol (the first registered with MC_TCAP_CTRL). */
const char *mc_protocol_default(void) {
  for (int i = 0; i < mc_transport_count(); i++)
    if ((mc_transport_registry[i]->caps & MC_TCAP_CTRL) && mc_transport_registry[i]->protocol)
      return mc_transport_registry[i]->protocol;
  return "";
}

int mc_transport_count(void) {
  int n = 0;
  while (n < MC_TRANSPORT_MAX && mc_transport_registry[n])
    n++;
  return n;
}

static int start_one(mc_engine_t *e, int i, const mc_transport_env_t *env, mc_err_t *err) {
  const mc_transport_ops_t *ops = mc_transport_registry[i];
  void *impl = NULL;
  int rc = ops->start(env, &impl, err);
  if (rc < 0) /* a protocol's transport names itself in its errors */
    return ops->protocol ? rc : mc_err_prefix(err, "transport %s", ops->name);
  if (impl) {
    e->tr[i].ops = ops;
    e->tr[i].impl = impl;
  }
  return 0;
}

int mc_transports_start(mc_engine_t *e, mc_err_t *err) {
  mc_transport_env_t env = {.local_name = e->name, .regions = &e->regions, .conf = &e->tconf,
                            .ctx = e, .rpc = env_rpc, .rpc_async = env_rpc_async,
                            .describe = env_describe, .on_notify = mc_engine_on_notify,
                            .on_rpc = on_rpc, .on_peer_failed = on_peer_failed,
                            .on_incoming_closed = on_incoming_closed, .gpu = e->gpu,
                            .gpu_trace = e->gpu_trace};
  int n = mc_transport_count();
  /* The control channel first: its port completes our name, which the
   * others (and its own HELLO) read from then on. */
  e->ctrl = -1;
  for (int i = 0; i < n && e->ctrl < 0; i++) {
    if (!(mc_transport_registry[i]->caps & MC_TCAP_CTRL))
      continue;
    int rc = start_one(e, i, &env, err);
    if (rc < 0)
      return rc;
    if (e->tr[i].ops)
      e->ctrl = i;
  }
  if (e->ctrl < 0)
    return mc_err_set(err, MC_EUNAVAIL, "no transport carries control messages");
  mc_engine_set_port(e, e->tr[e->ctrl].ops->port(e->tr[e->ctrl].impl));
  int proto_up = !strcmp(e->tr[e->ctrl].ops->protocol, e->protocol);
  for (int i = 0; i < n; i++) {
    if (i == e->ctrl)
      continue;
    int rc = start_one(e, i, &env, err);
    if (rc < 0)
      return rc;
    const mc_transport_ops_t *ops = e->tr[i].ops;
    proto_up |= ops && ops->protocol && !strcmp(ops->protocol, e->protocol);
  }
  /* The transport asked for declined to start (a fallback it logged): the
   * control transport's protocol is what peers see. */
  if (!proto_up)
    snprintf(e->protocol, sizeof e->protocol, "%s", e->tr[e->ctrl].ops->protocol);
  return 0;
}

void mc_transports_stop(mc_engine_t *e) {
  /* The control channel first: no RPC (e.g. a handshake) reaches another
   * transport after. */
  for (int pass = 0; pass < 2; pass++)
    for (int i = 0; i < MC_TRANSPORT_MAX; i++) {
      mc_transport_t *t = &e->tr[i];
      if (!t->ops || (pass == 0 && i != e->ctrl))
        continue;
      if (t->ops->stop)
        t->ops->stop(t->impl);
      t->ops = NULL;
    }
}

void mc_transports_drain(mc_engine_t *e, pthread_mutex_t *mu, pthread_cond_t *cv,
                         int (*busy)(const void *), const void *arg) {
  mc_transports_cancel_sweep(e);
  pthread_mutex_lock(mu);
  uint64_t next_sweep = mc_now_ns() + 1000000000ull;
  while (busy(arg)) {
    struct timespec ts = mc_deadline_ts(mc_now_ns() + 100000000ull);
    pthread_cond_timedwait(cv, mu, &ts);
    if (busy(arg) && mc_now_ns() > next_sweep) {
      pthread_mutex_unlock(mu);
      mc_transports_cancel_sweep(e);
      pthread_mutex_lock(mu);
      next_sweep = mc_now_ns() + 1000000000ull;
    }
  }
  pthread_mutex_unlock(mu);
}

void mc_transports_stats(mc_engine_t *e, mc_transport_stats_t *out) {
  for (int i = 0; i < MC_TRANSPORT_MAX; i++)
    if (e->tr[i].ops && e->tr[i].ops->stats)
      e->tr[i].ops->stats(e->tr[i].impl, out);
}

/* ---- calls every transport gets ---- */


void mc_transports_cancel_sweep(mc_engine_t *e) {
  mc_gate_sweep(e); /* batches still waiting for their CUDA event: not in a transport yet */
  for (int i = 0; i < MC_TRANSPORT_MAX; i++)
    if (e->tr[i].ops && e->tr[i].ops->cancel_sweep)
      e->tr[i].ops->cancel_sweep(e->tr[i].impl);
}

void mc_transports_peer_lost(mc_engine_t *e, const char *segment) {
  for (int i = 0; i < MC_TRANSPORT_MAX; i++)
    if (e->tr[i].ops && e->tr[i].ops->peer_lost)
      e->tr[i].ops->peer_lost(e->tr[i].impl, segment);
}

int mc_engine_cut_peer(mc_engine_t *e, const char *segment, int64_t timeout_ms, mc_err_t *err) {
  if (!segment || !segment[0])
    return mc_err_set(err, MC_EINVAL, "cut_peer: the peer's segment name is empty (give its "
                      "\"host:port\", as take_lost_peers or a notification's sender names it)");
  if (!strcmp(segment, e->name))
    return mc_err_set(err, MC_EINVAL, "cut_peer: \"%s\" is this engine's own segment name; "
                      "name the peer to fence", segment);
  int total = 0;
  for (int i = 0; i < MC_TRANSPORT_MAX; i++) {
    if (!e->tr[i].ops || !e->tr[i].ops->cut_peer)
      continue;
    int rc = e->tr[i].ops->cut_peer(e->tr[i].impl, segment, timeout_ms, err);
    if (rc < 0)
      return rc;
    total += rc;
  }
  return total;
}

void mc_transports_peer_closed(mc_engine_t *e, const char *segment) {
  for (int i = 0; i < MC_TRANSPORT_MAX; i++)
    if (e->tr[i].ops && e->tr[i].ops->peer_closed)
      e->tr[i].ops->peer_closed(e->tr[i].impl, segment);
}

int mc_transports_serve_rpc(mc_engine_t *e, const char *from, const char *req, size_t len,
                            char **reply, mc_err_t *err) {
  int any = -1;
  for (int i = 0; i < MC_TRANSPORT_MAX; i++) {
    const mc_transport_t *t = &e->tr[i];
    if (!t->ops || !t->ops->serve_rpc)
      continue;
    const char *pf = t->ops->rpc_prefix;
    if (!pf) {
      any = i;
      continue;
    }
    size_t pl = strlen(pf);
    int whole = pl && pf[pl - 1] != '.'; /* "mc.describe": the whole text */
    if (whole ? len == pl && !memcmp(req, pf, pl) : len >= pl && !memcmp(req, pf, pl))
      return t->ops->serve_rpc(t->impl, from, req, len, reply, err);
  }
  if (any < 0) {
    /* The registered transport that would serve it is not started here. */
    const char *want = "?";
    for (int i = 0; i < mc_transport_count(); i++)
      if (mc_transport_registry[i]->serve_rpc && !mc_transport_registry[i]->rpc_prefix)
        want = mc_transport_registry[i]->protocol ? mc_transport_registry[i]->protocol
                                                  : mc_transport_registry[i]->name;
    return mc_err_set(err, MC_EUNAVAIL, "segment %s speaks protocol \"%s\", not \"%s\": "
                      "use the same protocol on both sides", e->name, e->protocol, want);
  }
  return e->tr[any].ops->serve_rpc(e->tr[any].impl, from, req, len, reply, err);
}

int mc_transports_register(mc_engine_t *e, void *addr, uint64_t len, const char *location,
                           mc_err_t *err) {
  for (int i = 0; i < MC_TRANSPORT_MAX; i++) {
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
  /* Registry order: a transport that may refuse (copies in flight) comes
   * before one whose unregister cannot be undone (it revokes access). */
  for (int i = 0; i < MC_TRANSPORT_MAX; i++) {
    const mc_transport_t *t = &e->tr[i];
    int rc = t->ops && t->ops->mem_unregister
                 ? t->ops->mem_unregister(t->impl, addr, timeout_ms, err)
                 : 0;
    if (rc < 0)
      return rc;
  }
  return 0;
}
