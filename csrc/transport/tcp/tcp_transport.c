/* The TCP transport behind the common interface (transport/transport.h):
 * host memory directly, cuda memory staged through pinned host memory
 * (tcp_gpu_stage.c), the caller-driven poll path, and the control messages
 * (NOTIFY, RPC) of every transport. */
#include "transport/tcp/tcp_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/env.h"

static int has_cuda(const mc_xfer_op_t *op) {
  for (uint32_t i = 0; i < op->nent; i++)
    if (op->ent[i].dev >= 0)
      return 1;
  return 0;
}

static void tcp_t_submit(void *impl, const mc_peer_t *peer, mc_xfer_op_t **ops, size_t nops) {
  mc_tcp_t *t = impl;
  size_t k = 0;
  for (size_t i = 0; i < nops; i++) {
    if (has_cuda(ops[i]))
      mc_tcp_stage_op(t, ops[i], peer->host, peer->port, peer->segment);
    else
      ops[k++] = ops[i];
  }
  if (k)
    mc_tcp_submit(t, peer->host, peer->port, peer->segment, ops, k);
}

static int tcp_t_submit_poll(void *impl, const mc_peer_t *peer, mc_xfer_op_t **ops,
                             size_t nops, int (*finished)(void *), void *arg,
                             uint64_t spin_ns) {
  for (size_t i = 0; i < nops; i++)
    if (has_cuda(ops[i]))
      return 0; /* staged: the copy worker sends it */
  return mc_tcp_submit_poll(impl, peer->host, peer->port, peer->segment, ops, nops, finished,
                            arg, spin_ns);
}

static void tcp_t_cancel_sweep(void *impl) { mc_tcp_cancel_sweep(impl); }
static int tcp_t_cut_peer(void *impl, const char *segment, int64_t timeout_ms, mc_err_t *err) {
  return mc_tcp_cut_peer(impl, segment, timeout_ms, err);
}
static void tcp_t_stop(void *impl) { mc_tcp_stop(impl); }
static int tcp_t_port(void *impl) { return mc_tcp_port(impl); }

static int knob(const char *name, int dflt, int lo, int hi) {
  return (int)mc_env_long(name, dflt, lo, hi);
}

/* Its options: the engine's configuration (conf), then its own knobs. */
static int tcp_t_start(const mc_transport_env_t *env, void **impl, mc_err_t *err) {
  static const mc_transport_conf_t none = {0};
  const mc_transport_conf_t *c = env->conf ? env->conf : &none;
  const char *host = c->host ? c->host : "";
  mc_tcp_opts_t o = {
      /* An IPv6 local_hostname listens on "::" (which also takes IPv4). */
      .bind_host = getenv("MC_TCP_BIND_ADDRESS") ? getenv("MC_TCP_BIND_ADDRESS")
                   : strchr(host, ':')            ? "::"
                                                  : NULL,
      .port = c->port > 0 ? c->port : 0,
      .io_threads = c->io_threads ? c->io_threads : knob("MC_TCP_IO_THREADS", 1, 1, 64),
      .conns_per_peer =
          c->conns_per_peer ? c->conns_per_peer : knob("MC_TCP_CONNS_PER_PEER", 1, 1, 64),
      .connect_timeout_ms = knob("MC_CONNECT_TIMEOUT_MS", 5000, 1, 600000),
      .busy_poll_us = knob("MC_TCP_BUSY_POLL_US", 0, 0, 1000000),
      .reply_conn_limit = (uint64_t)knob("MC_TCP_REPLY_QUEUE_MB", 16, 1, 1 << 20) << 20,
      .reply_total_limit = (uint64_t)knob("MC_TCP_REPLY_TOTAL_MB", 256, 1, 1 << 20) << 20,
      .max_prehandshake = knob("MC_TCP_MAX_PREHANDSHAKE", 64, 1, 1 << 20),
      .hello_timeout_ms = knob("MC_TCP_HELLO_TIMEOUT_MS", 5000, 1, 600000),
  };
  mc_tcp_hooks_t hooks = {.ctx = env->ctx, .local_name = env->local_name,
                          .regions = env->regions, .on_notify = env->on_notify,
                          .on_peer_failed = env->on_peer_failed, .on_rpc = env->on_rpc,
                          .on_incoming_closed = env->on_incoming_closed, .gpu = env->gpu,
                          .auth_secret = c->auth_secret};
  mc_tcp_t *t = NULL;
  int rc = mc_tcp_start(&o, &hooks, &t, err);
  const char *bind_env = getenv("MC_TCP_BIND_ADDRESS");
  if (rc < 0 && bind_env && err && strstr(err->msg, "bind"))
    mc_err_prefix(err, "MC_TCP_BIND_ADDRESS=\"%s\" (unset it to listen on every address, or "
                  "give an IP address of this host)", bind_env);
  *impl = t;
  return rc;
}

static void tcp_t_stats(void *impl, mc_transport_stats_t *out) {
  mc_tcp_t *t = impl;
  mc_tcp_stats_t s;
  mc_tcp_get_stats(t, &s);
  out->reply_queue_bytes = s.reply_bytes;
  out->paused_conns = s.paused_conns;
  out->prehandshake_conns = s.prehandshake;
  out->prehandshake_refused = s.prehandshake_refused;
  out->prehandshake_evicted = s.prehandshake_evicted;
  out->handshake_redials = s.redials;
  out->tcp_peers = s.peers;
  out->prehandshake_bytes_each = s.conn_bytes_each;
  out->reply_queue_conn_limit = t->opts.reply_conn_limit;
  out->reply_queue_total_limit = t->opts.reply_total_limit;
  out->prehandshake_limit = (uint64_t)t->opts.max_prehandshake;
}

const mc_transport_ops_t mc_tcp_transport_ops = {
    .name = "tcp",
    .caps = MC_TCAP_HOST_MEM | MC_TCAP_CUDA_MEM | MC_TCAP_POLL | MC_TCAP_CTRL,
    .protocol = "tcp",
    .start = tcp_t_start,
    .stop = tcp_t_stop,
    .stats = tcp_t_stats,
    .port = tcp_t_port,
    .submit = tcp_t_submit,
    .submit_poll = tcp_t_submit_poll,
    .cancel_sweep = tcp_t_cancel_sweep,
    .cut_peer = tcp_t_cut_peer,
};
