/* The TCP transport behind the common interface (transport/transport.h):
 * host memory directly, cuda memory staged through pinned host memory
 * (tcp_gpu_stage.c), the caller-driven poll path, and the control messages
 * (NOTIFY, RPC) of every transport. */
#include "transport/tcp/tcp_internal.h"

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
static void tcp_t_stop(void *impl) { mc_tcp_stop(impl); }

static const mc_transport_ops_t tcp_ops = {
    .name = "tcp",
    .caps = MC_TCAP_HOST_MEM | MC_TCAP_CUDA_MEM | MC_TCAP_POLL | MC_TCAP_CTRL,
    .stop = tcp_t_stop,
    .submit = tcp_t_submit,
    .submit_poll = tcp_t_submit_poll,
    .cancel_sweep = tcp_t_cancel_sweep,
};

void mc_tcp_transport(mc_tcp_t *t, mc_transport_t *out) {
  out->ops = &tcp_ops;
  out->impl = t;
}
