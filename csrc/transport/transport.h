/* One interface for every transport (TCP, RDMA, same-host GPU, same-host
 * CPU): an ops table the engine calls and nothing else.
 *
 * How a transport plugs in
 *   A transport lives in its own folder and fills one static
 *   mc_transport_ops_t; transport/registry.c lists the tables, in order of
 *   preference (one line per transport).  The engine starts each through
 *   ops->start with an mc_transport_env_t (its part of the configuration,
 *   mc_transport_conf_t, and the engine's calls); the transport reads its
 *   own knobs.  The engine keeps what started as mc_transport_t {ops, impl}
 *   and never looks inside impl; it names no transport.
 *
 * How the engine chooses one, per (peer, memory kind)
 *   For the memory kind of the LOCAL buffer (host, cuda), the registered
 *   transports in registry order (today: same-host CPU, same-host GPU,
 *   RDMA, TCP), skipping those whose caps lack that memory kind:
 *       host: SAME_HOST_CPU, RDMA, TCP
 *       cuda: SAME_HOST_GPU, RDMA, TCP (TCP stages through pinned memory)
 *   The first started transport whose caps include that memory kind, that
 *   is not MC_TCAP_SAME_HOST with a peer known to be elsewhere
 *   (peer->same_host == -1), and whose reaches() (if set) says yes, takes
 *   the requests.  The engine sets peer->same_host from the peer's
 *   descriptor (engine/peers.c); a same-host transport decides the rest in
 *   reaches().  The control
 *   transport (the first started with MC_TCAP_CTRL: TCP) is always there
 *   and the last resort, so a choice always exists.  The engine remembers the
 *   answer per peer (reaches() is asked once per peer and kind, again after
 *   the peer was lost); reaches() that says no writes one sentence into
 *   `why`, which the engine logs once per peer.
 *
 * Ops and threading
 *   - submit() is called on the submitting (Python) thread with the GIL
 *     released; it may block (connect, handshake) but never fails as a
 *     call: every error goes to the ops' done().  Ownership of each op
 *     passes to the transport at submit(); the transport frees it (with
 *     mc_xfer_op_free) right after its done() returned.  done() runs exactly
 *     once per op, on any thread (an I/O or completion thread, or the
 *     submitting thread itself), never with a transport lock held that
 *     submit() could need; after done() the transport touches none of the
 *     op's local buffers.  entry_failed() (optional on the op) may run before
 *     done() for single refused entries.
 *   - Ops handed to one submit() carry one opcode per op (WRITE or READ)
 *     and entries of ONE memory kind (the kind the transport was chosen
 *     for); NOTIFY / RPC ops only go to a transport with MC_TCAP_CTRL.
 *   - cancel_sweep(): finish (done() with MC_ECANCELED) every op whose
 *     *op->cancel is non-zero, soon; called from any thread, repeatedly.
 *   - peer_lost(): the control connection to `segment` broke; fail its ops
 *     now.  peer_closed(): `segment`'s connection to us closed; free what
 *     served it.  Both optional, any thread.
 *   - mem_register()/mem_unregister(): called for every region the engine
 *     registers (location "cpu" or "cuda:N"), optional; an unregister that
 *     times out on accesses in flight fails the engine's unregister.
 *   - takes(): optional per-request veto after the choice (the remote
 *     range's kind may rule a transport out: the next one takes it).  The region table
 *     (mem/regions.h) stays the authority on what a peer may touch.
 *   - stop(): fail everything in flight with MC_ECLOSED, join threads, free
 *     impl.  Called once, after the engine stopped submitting.
 *
 * Transports that take whole submit calls (submit_call)
 *   A transport that moves some requests to a peer and not others (the
 *   same-host GPU transport: only requests whose remote range lies in a
 *   CUDA region of the peer whose IPC handle opens here) implements
 *   submit_call() instead of submit().  The engine hands it a submit call's
 *   whole request list (validated, local buffers pinned, the batch's room
 *   checked) as an mc_xfer_call_t and the transport plans, chunks and
 *   starts the copies itself, on the submitting thread:
 *     - call->locate(call, to) tells where local buffers [located, to)
 *       live (ldev[i]: the cuda device, -1 host memory, which it must not
 *       take); the engine located the first `located` before the call
 *       (all n when every local buffer lies in a registered region: its
 *       device noted by the engine's check-and-pin pass);
 *     - the transport makes its ops itself (mc_xfer_op_init over memory
 *       it may reuse) with the call's op_done, op_entry_failed, op_arg and
 *       op_cancel, so their done() / entry_failed() report to the engine;
 *       one entry per whole request, cookie = the request's index in reqs,
 *       dev = ldev; total set (as mc_xfer_op_seal would);
 *     - call->accept(call, off, k, take, ops, nops) settles requests
 *       [off, off+k): take[i-off] marks those its ops move; the engine
 *       registers them all, routes the untaken ones to its next choice for
 *       their memory kind (and hands those out) and returns 0, after which
 *       the transport owns the ops (the rules of submit(): done() once
 *       each) and starts them; < 0 (err set): nothing of the range was
 *       registered, the transport frees the ops and returns that error.
 *   Every request must be settled by accept() exactly once, in order,
 *   unless an error ends the call (earlier ranges are then in flight; the
 *   caller's wait or free covers them).  Large calls go in chunks so the
 *   first copies start before the last request was looked at.
 */
#ifndef MC_TRANSPORT_TRANSPORT_H
#define MC_TRANSPORT_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>

#include "transport/xfer_op.h"
#include "util/errors.h"

struct mc_regions;

/* Where a local buffer lives. */
typedef enum mc_mem_kind { MC_MEM_HOST = 0, MC_MEM_CUDA = 1, MC_MEM_KINDS } mc_mem_kind_t;

/* At most this many transports are registered (transport/registry.c). */
#define MC_TRANSPORT_MAX 8

/* Capabilities. */
#define MC_TCAP_HOST_MEM (1u << 0)  /* moves host memory */
#define MC_TCAP_CUDA_MEM (1u << 1)  /* moves cuda memory (itself or staged) */
#define MC_TCAP_SAME_HOST (1u << 2) /* reaches peers on this host only */
#define MC_TCAP_POLL (1u << 3)      /* submit_poll implemented */
#define MC_TCAP_CTRL (1u << 4)      /* carries NOTIFY and RPC ops */

/* A peer as the engine knows it (from its descriptor).  Strings live for
 * the duration of the call only: copy what you keep. */
struct mc_gpu_stager;

typedef struct mc_peer {
  const char *segment; /* "host:port", the peer's name */
  const char *host;    /* where its TCP listener is */
  int port;
  int same_host; /* 1: same host (the boot id of the host identity in its
                    descriptor matches ours), -1: another host (no
                    MC_TCAP_SAME_HOST transport is asked), 0: not known
                    (P2P mode, or no identity in the descriptor) */
  int pid;       /* the peer's process id (0 if not known) */
} mc_peer_t;

/* The part of the engine's configuration the transports read: each takes
 * what concerns it (its own knobs it reads itself, MC_* environment). */
typedef struct mc_transport_conf {
  const char *protocol;    /* the data protocol asked for ("tcp", "rdma"): ops->protocol */
  const char *host;        /* local_hostname's host (the control listener binds there) */
  int port;                /* local_hostname's port, 0: any */
  const char *device_name; /* NICs for rdma */
  int io_threads;          /* 0: the transport's own knob */
  int conns_per_peer;      /* 0: the transport's own knob */
  const char *auth_secret; /* "" = peer authentication off; stable */
  int same_host_cpu_off;   /* mooncake.json "same_host_cpu": false */
} mc_transport_conf_t;

/* What a transport gets from the engine at ops->start. */
typedef struct mc_transport_env {
  const char *local_name;     /* our segment name; stable for the engine's life (with
                                 port 0 filled in once the control transport started) */
  struct mc_regions *regions; /* our registered regions (authoritative) */
  const mc_transport_conf_t *conf; /* NULL: defaults (tests) */
  int off; /* tests: switched off by configuration (start anyway, to tell peers why) */
  void *ctx;                  /* for the calls below */
  /* Sends an RPC to `segment` over the control channel and waits for
   * the reply (*reply malloc'ed).  For handshakes; any thread but an I/O
   * thread; may block up to timeout_ms (<0: engine default). */
  int (*rpc)(void *ctx, const char *segment, const char *req, size_t len, int64_t timeout_ms,
             char **reply, mc_err_t *err);
  /* Hands a sealed RPC op (MC_XFER_RPC) for `peer` to the control channel
   * without waiting: its done() reports the reply (op->resp).  For checks
   * that run alongside a transport's own copies. */
  void (*rpc_async)(void *ctx, const mc_peer_t *peer, mc_xfer_op_t *op);
  /* Our segment descriptor JSON (malloc'ed; NULL: out of memory), as
   * published: for a transport that serves it to peers. */
  char *(*describe)(void *ctx);
  /* For the control transport (MC_TCAP_CTRL): what arrives on it.
   * on_notify: a NOTIFY (< 0 with err set refuses it: the sender's NOTIFY
   * fails); on_rpc: an RPC (the engine hands it to the transport whose
   * rpc_prefix matches); on_peer_failed: an outgoing connection to
   * `segment` failed or closed; on_incoming_closed: `segment`'s connection
   * to us closed.  Called on its I/O threads: they must not block. */
  int (*on_notify)(void *ctx, const char *from, const void *msg, size_t len, mc_err_t *err);
  int (*on_rpc)(void *ctx, const char *from, const char *req, size_t len, char **reply,
                mc_err_t *err);
  void (*on_peer_failed)(void *ctx, const char *segment);
  void (*on_incoming_closed)(void *ctx, const char *segment);
  /* The engine's GPU copy worker (gpu/gpu_staging.h), shared with TCP's
   * staging; NULL if none. */
  struct mc_gpu_stager *gpu;
  int gpu_trace; /* MC_GPU_TRACE=1: log planning times */
} mc_transport_env_t;

/* A submit call handed whole to a transport (submit_call, above). */
typedef struct mc_xfer_call mc_xfer_call_t;
struct mc_xfer_call {
  const mc_xfer_req_t *reqs;
  size_t n;
  int *ldev;      /* per request: local cuda device, -1 host memory; set for [0, located) */
  size_t located; /* advanced by locate() */
  /* The engine's side of the call. */
  int (*locate)(mc_xfer_call_t *call, size_t to, mc_err_t *err);
  /* What every op the transport makes for the call carries (its memory
   * the transport's, malloc'ed: mc_xfer_op_init): done() / entry_failed()
   * report to the engine. */
  mc_xfer_done_fn op_done;
  void (*op_entry_failed)(mc_xfer_op_t *op, uint32_t idx, int code, const char *msg);
  void *op_arg;
  atomic_int *op_cancel;
  int (*accept)(mc_xfer_call_t *call, size_t off, size_t k, const char *take,
                mc_xfer_op_t **ops, size_t nops, mc_err_t *err);
};

/* What transports report to the engine's statistics (mc_engine_stats_t
 * carries the same fields): each stats() fills those it owns. */
#define MC_TRANSPORT_STATS_FIELDS                                                              \
  /* the control transport (TCP): replies queued for peers that do not read */               \
  uint64_t reply_queue_bytes, reply_queue_conn_limit, reply_queue_total_limit, paused_conns;   \
  /* connections before their HELLO and what one may hold */                                 \
  uint64_t prehandshake_conns, prehandshake_limit, prehandshake_refused;                     \
  uint64_t prehandshake_bytes_each;                                                          \
  uint64_t prehandshake_evicted; /* oldest pre-handshake connections dropped for newer */    \
  uint64_t handshake_redials; /* our connections dialed again after a reset before HELLO_ACK */ \
  /* the same-host CPU path: bytes copied into (WRITE) and out of (READ)                  */ \
  /* peers' memory, ops, peers reached, peers refused (hello not bound to the connection) */ \
  uint64_t same_host_cpu_bytes_written, same_host_cpu_bytes_read, same_host_cpu_ops;         \
  uint64_t same_host_cpu_peers;                                                              \
  uint64_t same_host_cpu_refused_unbound;                                                    \
  /* the same-host GPU path: peers it keeps an entry for (dropped when lost or dead); its  */ \
  /* blocks (ops, copy jobs, calls) kept for reuse now (at most 16) and handed out again    */ \
  uint64_t same_host_gpu_peers, same_host_gpu_cached_blocks, same_host_gpu_block_reuses;     \
  /* TCP: peers with an outgoing connection (or one being made); the entry goes with the  */ \
  /* last of them */                                                                          \
  uint64_t tcp_peers;                                                                        \
  /* the same-host CPU path: peers with an entry now (dropped when lost) */                  \
  uint64_t same_host_cpu_peer_entries;

typedef struct mc_transport_stats {
  MC_TRANSPORT_STATS_FIELDS
} mc_transport_stats_t;

typedef struct mc_transport_ops {
  const char *name; /* "tcp", "rdma", "gpu-ipc", "shm-cpu": for logs */
  unsigned caps;    /* MC_TCAP_* */
  /* The value of the engine's `protocol` option that asks for this
   * transport as the data transport (and that the descriptor publishes);
   * NULL: none.  The control transport's is the default. */
  const char *protocol;
  /* Starts the transport from env (its knobs it reads itself): 0 with
   * *impl its state, or 0 with *impl NULL (not wanted here, e.g. another
   * protocol was asked for, or switched off: logged), or < 0. */
  int (*start)(const mc_transport_env_t *env, void **impl, mc_err_t *err);
  void (*stop)(void *impl);
  /* Optional: adds its numbers to *out (any thread). */
  void (*stats)(void *impl, mc_transport_stats_t *out);
  /* Control transport: the port it listens on (our rpc port). */
  int (*port)(void *impl);
  /* Optional: can this transport move `kind` memory to/from `peer`?  1 yes;
   * 0 no, with one sentence in why (logged once per peer). */
  int (*reaches)(void *impl, const mc_peer_t *peer, mc_mem_kind_t kind, char *why,
                 size_t why_len);
  void (*submit)(void *impl, const mc_peer_t *peer, mc_xfer_op_t **ops, size_t nops);
  /* Optional (MC_TCAP_POLL): latency fast path for small synchronous
   * batches: drive the ops on the calling thread until finished(arg) or
   * spin_ns pass.  Returns 1 if it took the ops, 0 if not (nothing sent:
   * the caller then uses submit). */
  int (*submit_poll)(void *impl, const mc_peer_t *peer, mc_xfer_op_t **ops, size_t nops,
                     int (*finished)(void *), void *arg, uint64_t spin_ns);
  void (*cancel_sweep)(void *impl);
  void (*peer_lost)(void *impl, const char *segment);   /* optional */
  void (*peer_closed)(void *impl, const char *segment); /* optional */
  /* Optional: an RPC whose text starts with rpc_prefix (e.g. "mc.shm.";
   * a prefix not ending in '.' must match the whole text, e.g.
   * "mc.describe") arrived from `from` on the control channel; answer it (*reply
   * malloc'ed, NUL-terminated).  rpc_prefix NULL: this transport gets the
   * RPCs no prefix matched (RDMA's handshake; one such transport at most).
   * Called on a TCP I/O thread: must not block on the network. */
  const char *rpc_prefix;
  int (*serve_rpc)(void *impl, const char *from, const char *req, size_t len, char **reply,
                   mc_err_t *err);
  /* Optional: whole submit calls (see "Transports that take whole submit
   * calls" above).  A transport with submit_call() gets its requests only
   * through it, never through submit().  0, or < 0 with err set (the
   * submit fails with it). */
  int (*submit_call)(void *impl, const mc_peer_t *peer, struct mc_xfer_call *call,
                     mc_err_t *err);
  /* Optional: a region was registered / is being unregistered.
   * mem_unregister runs BEFORE the engine drops the region: it waits up to
   * timeout_ms (<0: no limit) for accesses in flight through this
   * transport and fails (MC_EBUSY, naming who holds it) past it; the
   * engine's unregister then fails too and the region stays registered
   * (a later unregister may finish).  An address it does not know is 0. */
  int (*mem_register)(void *impl, void *addr, uint64_t len, const char *location,
                      mc_err_t *err);
  int (*mem_unregister)(void *impl, void *addr, int64_t timeout_ms, mc_err_t *err);
  /* Optional: does this transport take the request [remote, remote+len) to
   * `peer` (after reaches() said yes for its memory kind)?  1 yes; 0 no:
   * the engine gives that request to the next transport in preference
   * order (e.g. the same-host CPU path declines a peer's GPU region, which
   * TCP stages).  Submitting thread, GIL released.  It sets [*lo, *hi) to
   * a remote range holding [remote, remote+len) that gets the same answer
   * (e.g. the whole region): the engine does not ask again for requests
   * inside it during this submit (so it is asked about once per region). */
  int (*takes)(void *impl, const mc_peer_t *peer, uint64_t remote, uint64_t len, uint64_t *lo,
               uint64_t *hi);
  /* Optional: the consumer's fence (mc_engine_cut_peer).  Ends every way
   * `segment` has of writing into our memory through this transport (TCP:
   * resets its incoming connections) and returns, within timeout_ms, only
   * once nothing of it can land any more: the number of connections cut,
   * or < 0 (err).  A transport without it has nothing the peer drives on
   * our side (RDMA: one-sided writes are the peer's; same-host CPU / GPU:
   * the peer process copies itself) and is skipped: docs/connector.md,
   * "The lease", says what that leaves open.  Any thread but its own I/O
   * threads; blocks. */
  int (*cut_peer)(void *impl, const char *segment, int64_t timeout_ms, mc_err_t *err);
} mc_transport_ops_t;

typedef struct mc_transport {
  const mc_transport_ops_t *ops; /* NULL: slot empty */
  void *impl;
} mc_transport_t;

#endif
