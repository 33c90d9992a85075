/* The RDMA transport behind the common interface (transport/transport.h):
 * host and cuda memory (GPUDirect through the memory hook), one-sided. */
#include "transport/rdma/rdma.h"

static void rdma_t_submit(void *impl, const mc_peer_t *peer, mc_xfer_op_t **ops, size_t nops) {
  mc_rdma_submit(impl, peer->segment, ops, nops);
}
static void rdma_t_cancel_sweep(void *impl) { mc_rdma_cancel_sweep(impl); }
static void rdma_t_peer_lost(void *impl, const char *segment) {
  mc_rdma_peer_lost(impl, segment);
}
static void rdma_t_peer_closed(void *impl, const char *segment) {
  mc_rdma_peer_closed(impl, segment);
}
static int rdma_t_register(void *impl, void *addr, uint64_t len, const char *location,
                           mc_err_t *err) {
  return mc_rdma_register(impl, addr, len, location, err);
}
static int rdma_t_unregister(void *impl, void *addr, int64_t timeout_ms, mc_err_t *err) {
  (void)timeout_ms, (void)err; /* one-sided accesses: deregistering revokes them */
  mc_rdma_unregister(impl, addr);
  return 0;
}
static int rdma_t_serve_rpc(void *impl, const char *from, const char *req, size_t len,
                            char **reply, mc_err_t *err) {
  return mc_rdma_serve_rpc(impl, from, req, len, reply, err);
}
static void rdma_t_stop(void *impl) { mc_rdma_stop(impl); }

static const mc_transport_ops_t rdma_ops = {
    .name = "rdma",
    .caps = MC_TCAP_HOST_MEM | MC_TCAP_CUDA_MEM,
    .stop = rdma_t_stop,
    .submit = rdma_t_submit,
    .cancel_sweep = rdma_t_cancel_sweep,
    .peer_lost = rdma_t_peer_lost,
    .peer_closed = rdma_t_peer_closed,
    .rpc_prefix = NULL, /* the handshake: every RPC no other transport claims */
    .serve_rpc = rdma_t_serve_rpc,
    .mem_register = rdma_t_register,
    .mem_unregister = rdma_t_unregister,
};

void mc_rdma_transport(mc_rdma_t *t, mc_transport_t *out) {
  out->ops = &rdma_ops;
  out->impl = t;
}
