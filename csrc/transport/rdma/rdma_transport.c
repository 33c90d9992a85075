/* The RDMA transport behind the common interface (transport/transport.h):
 * host and cuda memory (GPUDirect through the memory hook), one-sided. */
#include "transport/rdma/rdma.h"

#include <stdlib.h>
#include <string.h>

#include "gpu/gpu_dmabuf.h"
#include "gpu/gpu_vmm.h"
#include "util/env.h"
#include "util/log.h"

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

static struct ibv_mr *gpu_reg_mr(void *arg, struct ibv_pd *pd, void *addr, size_t len,
                                 int access, const char *location, mc_err_t *err) {
  (void)arg;
  const char *how = NULL;
  struct ibv_mr *mr = mc_gpu_rdma_reg_mr(pd, (uint64_t)(uintptr_t)addr, len, access, &how, err);
  if (mr)
    mc_log_info("%s memory 0x%llx+%zu registered for RDMA through %s", location,
                (unsigned long long)(uintptr_t)addr, len, how);
  return mr;
}

/* Driver-mapped GPU memory: an MR per physical chunk (gpu_vmm.h). */
static long gpu_pieces(void *arg, uint64_t addr, uint64_t len, uint64_t **pairs,
                       mc_err_t *err) {
  (void)arg;
  long n = mc_gpu_vmm_pieces(addr, len, pairs, err);
  if (n > 1)
    mc_log_info("GPU memory 0x%llx+%llu is %ld driver-mapped chunks: one RDMA registration "
                "each", (unsigned long long)addr, (unsigned long long)len, n);
  return n;
}

static int knob(const char *name, int dflt, int lo, int hi) {
  return (int)mc_env_long(name, dflt, lo, hi);
}

/* Started when the engine's protocol is "rdma" (its options: device_name
 * and the MC_RDMA_* knobs).  Failing to start fails the engine, unless
 * MC_RDMA_FALLBACK_TCP=1 asks for TCP instead (never silent: logged). */
static int rdma_t_start(const mc_transport_env_t *env, void **impl, mc_err_t *err) {
  *impl = NULL;
  if (!env->conf || !env->conf->protocol || strcmp(env->conf->protocol, "rdma") != 0)
    return 0;
  mc_rdma_opts_t ro = {
      .device_name = env->conf->device_name,
      .qps_per_nic = knob("MC_RDMA_QPS_PER_NIC", 2, 1, 16),
      .slice_size = (uint32_t)knob("MC_RDMA_SLICE_SIZE", 65536, 4096, 1 << 30),
      .max_wr = knob("MC_RDMA_MAX_WR", 256, 8, 16384),
      .qp_inflight_bytes = (uint64_t)knob("MC_RDMA_QP_INFLIGHT_KB", 1024, 64, 1 << 20) * 1024,
      .gid_index = knob("MC_GID_INDEX", -1, -1, 255),
      .timeout = knob("MC_RDMA_TIMEOUT", 14, 1, 31),
      .retry_cnt = knob("MC_RDMA_RETRY_CNT", 7, 0, 7),
      .rnr_retry = knob("MC_RDMA_RNR_RETRY", 7, 0, 7),
      .connect_timeout_ms = knob("MC_CONNECT_TIMEOUT_MS", 5000, 1, 600000),
      .poll_spin_ns = (uint64_t)knob("MC_RDMA_POLL_SPIN_US", 50, 0, 1000000) * 1000ull,
  };
  mc_rdma_hooks_t rh = {.ctx = env->ctx, .local_name = env->local_name, .rpc = env->rpc};
  /* GPU regions: GPUDirect registration (DMA-BUF, then nvidia-peermem). */
  static const mc_rdma_mem_hook_t gpu_hook = {.reg = gpu_reg_mr, .pieces = gpu_pieces};
  mc_rdma_set_mem_hook(&gpu_hook);
  mc_rdma_t *rdma = NULL;
  int rc = mc_rdma_start(&ro, &rh, &rdma, err);
  if (rc < 0) {
    /* Never a silent fallback: only when asked for, and logged. */
    if (!mc_env_bool("MC_RDMA_FALLBACK_TCP", 0)) /* 1 / true / on / yes; else warned */
      return rc;
    mc_log_warn("protocol \"rdma\" is unavailable (%s); falling back to TCP because "
                "MC_RDMA_FALLBACK_TCP=%s", err ? err->msg : "", getenv("MC_RDMA_FALLBACK_TCP"));
    mc_err_clear(err);
    return 0;
  }
  *impl = rdma;
  return 0;
}

const mc_transport_ops_t mc_rdma_transport_ops = {
    .name = "rdma",
    .caps = MC_TCAP_HOST_MEM | MC_TCAP_CUDA_MEM,
    .protocol = "rdma",
    .start = rdma_t_start,
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
