/* RDMA transport: RC queue pairs over libibverbs (loaded at run time).
 *
 * Only data moves over RDMA; the engine's TCP transport stays up as the
 * control channel: the connection handshake is an RPC on it (records in
 * rdma_record.h), and notifications keep using it.
 *
 * Threads: callers post work requests themselves (one doorbell per QP per
 * submit: chained WRs); one completion thread per transport polls the CQs
 * (one per NIC), finishes ops and refills send queues.
 *
 * Ownership: like TCP, ops passed to mc_rdma_submit belong to the transport;
 * each op's done() runs exactly once (on the completion thread, or on the
 * submitting thread when the peer cannot be reached), and after done()
 * returns the NICs never touch the op's buffers again (a canceled op's QP
 * is moved to the error state and its WRs are flushed before done()).
 */
#ifndef MC_TRANSPORT_RDMA_RDMA_H
#define MC_TRANSPORT_RDMA_RDMA_H

#include <stddef.h>
#include <stdint.h>

#include "transport/transport.h"
#include "transport/xfer_op.h"
#include "util/errors.h"

typedef struct mc_rdma mc_rdma_t;
struct ibv_pd;
struct ibv_mr;

typedef struct mc_rdma_opts {
  const char *device_name; /* "mlx5_0,mlx5_1": every NIC to use */
  int qps_per_nic;         /* QPs per peer per local NIC (MC_RDMA_QPS_PER_NIC, 2) */
  uint32_t slice_size;     /* bytes per work request (MC_RDMA_SLICE_SIZE, 64 KiB) */
  int max_wr;              /* send queue depth (MC_RDMA_MAX_WR, 256) */
  uint64_t qp_inflight_bytes; /* bytes posted and unacknowledged per QP (MC_RDMA_QP_INFLIGHT_KB, 1 MiB) */
  int gid_index;           /* MC_GID_INDEX; -1: choose (rdma_gid.h) */
  int timeout;             /* local ACK timeout exponent: 4.096 us * 2^t (MC_RDMA_TIMEOUT, 14) */
  int retry_cnt;           /* transport retries (MC_RDMA_RETRY_CNT, 7) */
  int rnr_retry;           /* RNR retries (7 = infinite per spec; we use 7) */
  int64_t connect_timeout_ms; /* handshake RPC (MC_CONNECT_TIMEOUT_MS) */
  uint64_t poll_spin_ns;   /* completion thread polls this long before sleeping */
} mc_rdma_opts_t;

typedef struct mc_rdma_hooks {
  void *ctx;
  const char *local_name; /* our segment name; stable */
  /* Sends an RPC to a segment over the control channel, waits for the
   * reply (malloc'ed text).  Blocks. */
  int (*rpc)(void *ctx, const char *segment, const char *req, size_t len, int64_t timeout_ms,
             char **reply, mc_err_t *err);
} mc_rdma_hooks_t;

/* Registration of memory the verbs cannot register with ibv_reg_mr alone
 * (GPU memory: DMA-BUF / GPUDirect, provided by csrc/gpu on the GPU
 * branch).  Process-wide; set before engines register such memory.  reg()
 * returns an MR usable like one from ibv_reg_mr (ibv_dereg_mr frees it), or
 * NULL with err set.  preferred_nic() (optional) returns the index in
 * `nics` of the NIC closest to the memory (same PCIe switch), or -1. */
typedef struct mc_rdma_mem_hook {
  void *arg;
  struct ibv_mr *(*reg)(void *arg, struct ibv_pd *pd, void *addr, size_t len, int access,
                        const char *location, mc_err_t *err);
  int (*preferred_nic)(void *arg, const char *location, const char *const *nics, int nnics);
  /* Optional: the physical pieces of [addr, addr+len) that need an MR each
   * (driver-mapped GPU memory: one per cuMemCreate chunk, as DMA-BUF export
   * covers one physical allocation), as malloc'ed (start, len) pairs in
   * address order tiling the range; returns the count (0: one MR for the
   * whole range), or a negative code with err set. */
  long (*pieces)(void *arg, uint64_t addr, uint64_t len, uint64_t **pairs, mc_err_t *err);
} mc_rdma_mem_hook_t;
void mc_rdma_set_mem_hook(const mc_rdma_mem_hook_t *hook); /* NULL removes it */

/* Opens every NIC in device_name (all must exist: the error lists those
 * that do), picks port and GID, starts the completion thread. */
int mc_rdma_start(const mc_rdma_opts_t *opts, const mc_rdma_hooks_t *hooks, mc_rdma_t **out,
                  mc_err_t *err);
/* Fails what is in flight (MC_ECLOSED), tears every QP down, frees. */
void mc_rdma_stop(mc_rdma_t *t);

/* Registers / deregisters a region on every NIC (the MR cache: transfers
 * from and to registered regions use these keys).  location "cpu" or
 * "cuda:N" (through the memory hook). */
int mc_rdma_register(mc_rdma_t *t, void *addr, uint64_t len, const char *location,
                     mc_err_t *err);
void mc_rdma_unregister(mc_rdma_t *t, void *addr);

/* Queues ops to `segment` (connecting on first use: blocks for the
 * handshake).  Never fails as a call: errors go to the ops' done(). */
void mc_rdma_submit(mc_rdma_t *t, const char *segment, mc_xfer_op_t **ops, size_t nops);

/* Ops whose cancel flag is set: unposted ones finish MC_ECANCELED at once;
 * a QP carrying posted ones is moved to the error state (flushed) and
 * reconnected on the next transfer. */
void mc_rdma_cancel_sweep(mc_rdma_t *t);

/* The control connection to `segment` broke (peer gone): fail its QPs now
 * rather than at their retry timeout. */
void mc_rdma_peer_lost(mc_rdma_t *t, const char *segment);

/* `segment`'s control connection to us closed: free the QPs it connected
 * to us (they only serve its one-sided READs/WRITEs). */
void mc_rdma_peer_closed(mc_rdma_t *t, const char *segment);

/* Serves the handshake RPC (target side); reply is malloc'ed. */
int mc_rdma_serve_rpc(mc_rdma_t *t, const char *from, const char *req, size_t len,
                      char **reply, mc_err_t *err);

/* The transport interface (rdma_transport.c): start() reads the engine's
 * protocol and device_name and the MC_RDMA_* knobs. */
extern const mc_transport_ops_t mc_rdma_transport_ops;

/* "rxe0 (port 1, GID 1 RoCE v2 IPv4 GID, MTU 1024), ..." for logs. */
void mc_rdma_describe(mc_rdma_t *t, char *buf, size_t len);

#endif
