/* TCP transport: persistent, epoll-driven connections carrying the wire
 * protocol of wire.h.
 *
 * Threads: `io_threads` event loops, each owning its connections.  Other
 * threads hand work over through a per-connection inbox and an eventfd.
 * The listener lives on loop 0; accepted connections are spread round-robin.
 *
 * Ownership: ops passed to mc_tcp_submit belong to the transport from then
 * on.  Each op's done() is called exactly once, on an I/O thread (or on the
 * submitting thread when the connection cannot even be set up), and after
 * done() returns the transport never touches the op's local buffers again.
 */
#ifndef MC_TRANSPORT_TCP_TCP_H
#define MC_TRANSPORT_TCP_TCP_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "mem/regions.h"
#include "transport/transport.h"
#include "util/errors.h"

typedef struct mc_tcp mc_tcp_t;
#include "transport/xfer_op.h"

typedef struct mc_tcp_opts {
  const char *bind_host; /* NULL -> 0.0.0.0 */
  int port;              /* 0 -> any free port */
  int io_threads;        /* >= 1 */
  int conns_per_peer;    /* >= 1: striping */
  int connect_timeout_ms;
  int busy_poll_us; /* keep polling this long after activity (0: off) */
  /* Budgets (0: defaults).  Replies queued for a peer that does not read
   * them: past reply_conn_limit bytes on one connection (or reply_total_limit
   * over all of them) that connection is not read until it drains
   * (backpressure: nothing is dropped).  Connections that have not completed
   * their HELLO: at most max_prehandshake at once, each with hello_timeout_ms
   * to do so and a HELLO of at most MC_TCP_HELLO_MAX bytes. */
  uint64_t reply_conn_limit, reply_total_limit;
  int max_prehandshake, hello_timeout_ms;
} mc_tcp_opts_t;

#define MC_TCP_HELLO_MAX 4096

typedef struct mc_tcp_stats {
  uint64_t reply_bytes;   /* queued replies, all connections */
  uint64_t paused_conns;  /* connections not read because of their replies */
  uint64_t prehandshake;  /* connections before their HELLO */
  uint64_t prehandshake_refused;
  uint64_t prehandshake_evicted; /* the oldest, to admit a newer connection */
  uint64_t redials; /* initiator: handshakes dialed again after a reset */
  uint64_t conn_bytes_each; /* receive buffer of one connection */
  uint64_t peers; /* initiator: peers with an outgoing connection (or one being made) */
} mc_tcp_stats_t;
void mc_tcp_get_stats(mc_tcp_t *t, mc_tcp_stats_t *out);

typedef struct mc_tcp_hooks {
  void *ctx;
  const char *local_name; /* segment name; stable for the transport's life */
  mc_regions_t *regions;  /* the local segment's regions */
  /* Called on an I/O thread for every NOTIFY received; < 0 (err set)
   * refuses it: the sender's NOTIFY fails with that error. */
  int (*on_notify)(void *ctx, const char *from, const void *msg, size_t len, mc_err_t *err);
  /* Optional: an outgoing connection to `segment` could not be set up,
   * reached another segment, or was closed by the peer; called on the
   * thread that noticed (an I/O thread, or a caller on the fast path). */
  void (*on_peer_failed)(void *ctx, const char *segment);
  /* Optional: stages cuda regions through pinned host memory (gpu/). */
  struct mc_gpu_stager *gpu;
  /* Optional: an incoming connection from `segment` (named in its HELLO)
   * closed; called on its I/O thread. */
  void (*on_incoming_closed)(void *ctx, const char *segment);
  /* Optional: answers an RPC (called on an I/O thread; must not block on
   * the network).  Returns 0 with *reply a malloc'ed NUL-terminated text,
   * or < 0 with err set (sent back as the error text). */
  int (*on_rpc)(void *ctx, const char *from, const char *req, size_t len, char **reply,
                mc_err_t *err);
  /* Optional: the shared secret of peer authentication (tcp_auth.c); NULL
   * or "" = off.  Stable for the transport's life. */
  const char *auth_secret;
} mc_tcp_hooks_t;

int mc_tcp_start(const mc_tcp_opts_t *opts, const mc_tcp_hooks_t *hooks,
                 mc_tcp_t **out, mc_err_t *err);
int mc_tcp_port(const mc_tcp_t *t);

/* Queues ops to the target segment reachable at host:port (connecting on
 * first use and reusing connections afterwards).  Never blocks on the
 * network except for name resolution of `host`. */
void mc_tcp_submit(mc_tcp_t *t, const char *host, int port, const char *segment,
                   mc_xfer_op_t **ops, size_t nops);

/* Latency fast path for small synchronous requests.  If the connection to
 * the target is open and idle, the calling thread takes it over from its
 * I/O thread, sends the ops itself and polls for the answers for up to
 * spin_ns (or until finished(arg) is true), then hands the connection back;
 * whatever is still outstanding completes through the I/O thread as usual.
 * Returns 1 if it took the ops (done() as usual), 0 if not (the caller then
 * uses mc_tcp_submit; the ops are untouched). */
int mc_tcp_submit_poll(mc_tcp_t *t, const char *host, int port, const char *segment,
                       mc_xfer_op_t **ops, size_t nops, int (*finished)(void *), void *arg,
                       uint64_t spin_ns);

/* Asks every I/O thread to resolve ops whose cancel flag is set (done() with
 * MC_ECANCELED).  Returns at once; completion shows up through done(). */
void mc_tcp_cancel_sweep(mc_tcp_t *t);

/* The fence of a consumer that gives up on a producer: closes, with RST,
 * every INCOMING connection whose HELLO named `segment` (its bytes still
 * in our receive buffer or on the way are dropped, none is written into
 * our memory), on the I/O threads.  Returns the number of connections cut
 * once no I/O thread (and no GPU staging copy of theirs) can touch memory
 * for them any more, or < 0 (err): MC_ETIMEDOUT when the I/O threads did
 * not answer within timeout_ms.  Connections the peer opens later are not
 * affected.  Blocks: call with the GIL released, never on an I/O thread. */
int mc_tcp_cut_peer(mc_tcp_t *t, const char *segment, int64_t timeout_ms, mc_err_t *err);

/* Stops the loops, fails everything in flight with MC_ECLOSED, frees. */
void mc_tcp_stop(mc_tcp_t *t);

/* The transport interface (tcp_transport.c): start() reads the engine's
 * configuration and the MC_TCP_* knobs.  Ops whose entries include cuda
 * memory (ent.dev >= 0) are staged through hooks.gpu. */
extern const mc_transport_ops_t mc_tcp_transport_ops;
/* tcp_gpu_stage.c: stages one such op, then sends it (done() as usual). */
void mc_tcp_stage_op(mc_tcp_t *t, mc_xfer_op_t *op, const char *host, int port,
                     const char *segment);

#endif
