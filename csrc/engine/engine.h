/* The transfer engine: one local segment (registered memory regions,
 * addressed by peers through the segment's name "host:port"), batches of
 * READ/WRITE requests against remote segments, and small notifications.
 *
 * Threading: every function may be called from any thread.  Functions that
 * block say so; the Python bindings release the GIL around them.
 */
#ifndef MC_ENGINE_ENGINE_H
#define MC_ENGINE_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "transport/transport.h"
#include "util/errors.h"

typedef struct mc_engine mc_engine_t;
typedef struct mc_batch mc_batch_t;

typedef struct mc_engine_opts {
  const char *local_hostname;  /* "host" or "host:port" (port 0/absent: any) */
  const char *metadata_server; /* "P2PHANDSHAKE" or a metadata URL */
  const char *protocol;        /* a registered transport's protocol (transport/registry.c);
                                  NULL/"": the control transport's */
  const char *device_name;     /* for the transports that use NICs */
  int io_threads;              /* 0: the transports' own knob (docs/) or 1 */
  int conns_per_peer;          /* 0: the transports' own knob (docs/) or 1 */
  /* Peer authentication (docs/security.md): the shared secret every peer
   * must prove it knows in the control channel's handshake, at most MC_AUTH_SECRET_MAX
   * bytes.  NULL: env MC_AUTH_SECRET; NULL/"" there too: off. */
  const char *auth_secret;
  /* 1: the same-host CPU transport stays off (mooncake.json "same_host_cpu":
   * false); MC_SAME_HOST_CPU=0 switches it off too. */
  int same_host_cpu_off;
} mc_engine_opts_t;

#define MC_AUTH_SECRET_MAX 1024

enum { MC_OP_READ = MC_XFER_REQ_READ, MC_OP_WRITE = MC_XFER_REQ_WRITE };

/* Same numbering as Mooncake's TransferStatusEnum. */
typedef enum {
  MC_TASK_WAITING = 0,
  MC_TASK_PENDING = 1,
  MC_TASK_INVALID = 2,
  MC_TASK_CANCELED = 3,
  MC_TASK_COMPLETED = 4,
  MC_TASK_TIMEOUT = 5,
  MC_TASK_FAILED = 6,
} mc_task_state_t;

/* One request (transport/xfer_op.h mc_xfer_req_t): opcode MC_OP_READ
 * (remote -> local) or MC_OP_WRITE (local -> remote); local: a host or GPU
 * buffer inside a region registered with this engine (else the submit
 * fails naming it); remote: an address inside a region the target
 * registered; len bytes. */
typedef mc_xfer_req_t mc_request_t;

typedef struct mc_task_status {
  mc_task_state_t state;
  int code;             /* 0 or the MC_E* code of the failure */
  uint64_t transferred; /* bytes confirmed */
  char msg[MC_ERR_MSG_MAX];
} mc_task_status_t;

/* Creates an engine: starts its transports (the control channel listens on
 * the rpc port), publishes the segment to the
 * metadata server (unless P2P).  Blocks (network). */
int mc_engine_create(const mc_engine_opts_t *opts, mc_engine_t **out, mc_err_t *err);
/* Cancels what is in flight, unpublishes, stops threads, frees.  Blocks. */
void mc_engine_destroy(mc_engine_t *e);

const char *mc_engine_segment_name(const mc_engine_t *e); /* "host:port" */
int mc_engine_rpc_port(const mc_engine_t *e);

/* Registers [addr, addr+len) as remotely accessible.  location: "cpu",
 * "cuda:N", or NULL/"*" (detect); a claim that does not match where the
 * memory is fails with MC_EINVAL naming the right one.  Every started
 * transport is told (GPU regions: staged through pinned memory, or moved
 * directly between the GPUs of one host; docs/architecture.md).  Republishes the
 * segment descriptor when a metadata server is used (blocks). */
int mc_engine_register(mc_engine_t *e, void *addr, uint64_t len, const char *location,
                       mc_err_t *err);
int mc_engine_register_batch(mc_engine_t *e, void *const *addrs, const uint64_t *lens,
                             size_t n, const char *location, mc_err_t *err);
/* 0 if [addr, addr+len) lies inside one region registered with this
 * engine, else MC_EINVAL naming the range (matches mc_lookup_check_fn). */
int mc_engine_check_local(void *engine, uint64_t addr, uint64_t len, mc_err_t *err);
/* Waits for accesses in flight to the region to finish, then removes it. */
int mc_engine_unregister(mc_engine_t *e, void *addr, mc_err_t *err);
/* 1 if a region (even one being removed) starts at addr: a failed register
 * or unregister that left it there means the memory must not be freed. */
int mc_engine_is_registered(mc_engine_t *e, void *addr);

/* Batches. A batch holds up to `capacity` requests to one or more targets. */
mc_batch_t *mc_batch_new(mc_engine_t *e, size_t capacity);
/* Submits requests to `segment`.  Asynchronous: returns once queued (may
 * block briefly on a metadata lookup or DNS for a new peer).  Argument
 * errors return MC_EINVAL and submit nothing; peer errors show up in the
 * task statuses. */
int mc_batch_submit(mc_engine_t *e, mc_batch_t *b, const char *segment,
                    const mc_request_t *reqs, size_t n, mc_err_t *err);
/* Same, for a caller that will wait right away: small batches (<= 1 MiB)
 * may be sent and polled on the calling thread (see MC_WAIT_SPIN_US),
 * saving two thread hand-offs per round trip. */
int mc_batch_submit_sync(mc_engine_t *e, mc_batch_t *b, const char *segment,
                         const mc_request_t *reqs, size_t n, mc_err_t *err);
/* For layers that checked their local buffers themselves or own them (the
 * KV producer pushes from extents send_kv checked against this engine's
 * regions, or from copies its lookup buffer holds): submits to this batch
 * skip the check that local buffers lie in registered memory. */
void mc_batch_trust_locals(mc_batch_t *b);
/* Tasks not yet finished. Non-blocking. */
size_t mc_batch_pending(mc_batch_t *b);
/* Blocks until every task finished or timeout_ms passed (<0: engine default,
 * MC_TRANSFER_TIMEOUT seconds + 1 ns per byte).  On timeout, cancels what
 * is left (those tasks become MC_TASK_TIMEOUT) and returns only once no I/O
 * thread can touch the batch's buffers any more.  Returns 0 if every task
 * completed, else the code of the first failed task with its message. */
int mc_batch_wait(mc_engine_t *e, mc_batch_t *b, int64_t timeout_ms, mc_err_t *err);
/* Blocks until no task of the batch is pending or timeout_ns passed, on
 * the batch's condition variable (no polling; GPU batches, which a status
 * poll reaps, are looked at every millisecond).  Cancels nothing, frees
 * nothing.  Returns 1 when nothing is pending, 0 on timeout. */
int mc_batch_wait_idle(mc_batch_t *b, uint64_t timeout_ns);
size_t mc_batch_size(mc_batch_t *b);
int mc_batch_status(mc_batch_t *b, size_t i, mc_task_status_t *out);
/* Cancels unfinished tasks (waits until buffers are released) and frees. */
void mc_batch_free(mc_engine_t *e, mc_batch_t *b);

/* Gated write batches (gate.c; docs/architecture.md "Threads"): the
 * requests (WRITEs) are handed to their transport only once `cuda_event`
 * (a CUevent, recorded by the caller on the stream that writes the
 * sources; 0: none, submitted at once) completed on device `cuda_device`,
 * waited for by the engine's gate thread asleep in the driver; and when
 * `notify` is set, the engine sends that message to `segment` (detached,
 * from its notifier thread) once every request of the batch completed; a
 * batch with a failed, canceled or timed-out request sends nothing.  `b`
 * must be new (no request yet).  Until the event completed the batch
 * counts as pending (status polls, waits); a cancel (a wait's timeout, a
 * free) lets it go at once, its requests ending MC_ECANCELED (the gate
 * thread never touches it again).  The caller keeps the event alive until
 * the batch is over.  At most MC_GATE_MAX batches wait for events at once
 * (MC_EBUSY past it).  Returns 0 once queued, or <0 for bad arguments. */
#define MC_GATE_MAX 4096
typedef struct mc_gate_opts {
  uint64_t cuda_event;        /* CUevent or 0 */
  int cuda_device;            /* the event's device ordinal */
  const void *notify;         /* NULL: no notification */
  size_t notify_len;          /* at most MC_ENGINE_MAX_MSG */
  int64_t notify_timeout_ms;  /* the notification's receipt; <= 0: MC_TRANSFER_TIMEOUT */
  /* No event: 0 submits on the calling thread (as mc_batch_submit would);
   * 1 queues the batch for the gate thread like an evented one (nothing to
   * wait for: it submits at once), so the caller only queues.  For a route
   * whose transport copies inside its submit (the same-host CPU path:
   * process_vm_writev on the submitting thread; mc_engine_route_copies_here)
   * the copy then runs on the gate thread (and its copy helpers). */
  int on_gate_thread;
  /* 0: none.  Else a wall-clock time (CLOCK_REALTIME ns, mc_wall_ns) past
   * which the gate thread does not submit the batch: when its turn comes
   * later (a long copy or CUDA event ahead of it, the process stopped
   * meanwhile) its requests end MC_ETIMEDOUT, nothing is written and no
   * notification sent.  A push target's lease minus the producer's margin:
   * the consumer may free the blocks after it, and the same-host CPU
   * path's copies (the producer's own process_vm_writev) cannot be fenced
   * from the consumer's side. */
  int64_t submit_by_ns;
} mc_gate_opts_t;
int mc_batch_submit_gated(mc_engine_t *e, mc_batch_t *b, const char *segment,
                          const mc_request_t *reqs, size_t n, const mc_gate_opts_t *o,
                          mc_err_t *err);

/* A gated note (gate.c): `msg` (at most MC_ENGINE_MAX_MSG bytes, copied)
 * queued in the gate thread's FIFO like a gated batch, carrying no
 * request: in its turn, once `cuda_event` (0: none) completed, the
 * engine's notifier thread sends it to `segment` (detached, as a gated
 * batch's notification).  One FIFO for batches and notes: notes to a peer
 * go out in the order they were queued, evented or not.  Its event
 * failing, the engine stopping, or `send_by_ns` (wall clock, 0: none)
 * passing before its turn drop it (counted gate_notes_dropped, logged).
 * The caller only queues (no I/O, no wait); MC_EBUSY past MC_GATE_MAX
 * entries.  The caller keeps the event alive until the note is sent. */
typedef struct mc_note_opts {
  uint64_t cuda_event; /* CUevent or 0 */
  int cuda_device;     /* the event's device ordinal */
  int64_t timeout_ms;  /* the note's receipt; <= 0: MC_TRANSFER_TIMEOUT */
  int64_t send_by_ns;  /* 0: none; else CLOCK_REALTIME ns (mc_wall_ns) */
} mc_note_opts_t;
int mc_engine_notify_gated(mc_engine_t *e, const char *segment, const void *msg, size_t len,
                           const mc_note_opts_t *o, mc_err_t *err);

/* Records the next of the engine's own gate events (a ring of
 * MC_GATE_EVENTS blocking-sync CUevents, made at first use in the device's
 * primary context) on `stream` (a CUstream of that context; 0: the legacy
 * default stream) from the calling thread, and gives its handle for
 * mc_batch_submit_gated; one device per engine.  Does not block (the
 * driver queues the record).  0, or <0 (MC_EUNAVAIL: no CUDA driver;
 * MC_ESYS: the driver refused, named; MC_EINVAL: another device). */
#define MC_GATE_EVENTS (2 * MC_GATE_MAX)

/* 1 when host memory to `segment` is known to go by a transport that copies
 * inside its submit (a same-host path: the same-host CPU path's
 * process_vm_writev runs on the submitting thread), from the routes the
 * engine remembers (no lookup, no I/O); 0 otherwise, also when the route is
 * not known yet (the first submit to the peer asks). */
int mc_engine_route_copies_here(mc_engine_t *e, const char *segment);
int mc_engine_gate_record(mc_engine_t *e, int dev, uint64_t stream, uint64_t *event,
                          mc_err_t *err);

/* Sends a small message (at most MC_ENGINE_MAX_MSG bytes) to a segment and
 * waits for its receipt. Blocks. */
#define MC_ENGINE_MAX_MSG (16u << 20) /* = MC_XFER_MAX_CTRL (batch.c checks) */
int mc_engine_notify(mc_engine_t *e, const char *segment, const void *msg, size_t len,
                     int64_t timeout_ms, mc_err_t *err);
/* Sends the same without waiting: the message is copied and the engine owns
 * its delivery, which ends by the receipt, an error (logged as a warning
 * naming `what` and the segment) or timeout_ms, whichever comes first.
 * Returns 0 once handed to the transport, or <0 when it cannot be sent at
 * all (no such segment, too big).  At most MC_ENGINE_DETACHED_MAX messages
 * (MC_ENGINE_DETACHED_BYTES bytes) are in flight at once; past that the
 * call waits for this one's receipt, like mc_engine_notify. */
#define MC_ENGINE_DETACHED_MAX 1024
#define MC_ENGINE_DETACHED_BYTES (64ull << 20)
int mc_engine_notify_detached(mc_engine_t *e, const char *segment, const void *msg, size_t len,
                              int64_t timeout_ms, const char *what, mc_err_t *err);
/* Pops up to `max` received notifications: callback gets (from, msg, len). */
typedef void (*mc_notify_cb)(void *arg, const char *from, const void *msg, size_t len);
size_t mc_engine_drain_notifies(mc_engine_t *e, size_t max, mc_notify_cb cb, void *arg);
/* Waits up to timeout_us for a queued notification (none taken) or a peer
 * lost since the last return (mc_engine_take_lost_peers; each loss wakes a
 * waiter once); 1 if either, 0 on timeout. */
int mc_engine_wait_notifies(mc_engine_t *e, int64_t timeout_us);
/* 1 when a notification is queued or a lost peer is not taken yet (a look,
 * nothing taken, no wait): whether a drain has anything to do. */
int mc_engine_notifies_pending(mc_engine_t *e);
/* Before a destroy: wakes every mc_engine_wait_notifies caller and makes
 * later ones return at once (the caller that closes need not wait for them). */
void mc_engine_wake_notify_waiters(mc_engine_t *e);

/* Routes incoming notifications to cb (called on an I/O thread: it must not
 * block; copy what it needs) instead of the queue drained above.  NULL
 * restores the queue.  Used by layers built on the engine (lookup buffer).
 * A handler returning < 0 (err set) refuses the message: the sender's
 * notify fails with that error (budgets: nothing is dropped silently). */
typedef int (*mc_notify_handler_fn)(void *arg, const char *from, const void *msg, size_t len,
                                    mc_err_t *err);
void mc_engine_set_notify_handler(mc_engine_t *e, mc_notify_handler_fn cb, void *arg);
/* Called (on an I/O thread; must not block) when a connection to `segment`
 * fails or is closed by the peer, so layers waiting on that peer can fail
 * at once instead of at their timeout.  NULL removes it. */
typedef void (*mc_peer_lost_cb)(void *arg, const char *segment);
void mc_engine_set_peer_lost_handler(mc_engine_t *e, mc_peer_lost_cb cb, void *arg);
/* Peers whose connection failed or closed (outgoing or incoming) since the
 * last call, each named once (at most MC_LOST_PEERS_MAX kept; the oldest are
 * dropped): up to `max` malloc'd names into out (the caller frees each);
 * returns how many.  A loss also wakes mc_engine_wait_notifies, so a layer
 * polling both learns of it at once.  For layers above the handler's owner
 * (the push flow: a producer gone while we wait for its writes). */
#define MC_LOST_PEERS_MAX 64
size_t mc_engine_take_lost_peers(mc_engine_t *e, char **out, size_t max);

/* The consumer's fence: before memory a peer was lent for writing is reused
 * without the peer's answer, every transport that has a way in for it on
 * our side ends it (TCP: its incoming connections are reset; transports
 * without cut_peer are skipped, transport.h).  Returns, within timeout_ms
 * (< 0: 5 s) per transport, once no byte from `segment` can be written
 * into our memory by this engine any more: the number of connections cut
 * (0: none was open), or < 0 (err: MC_EINVAL for an empty or our own name,
 * MC_ETIMEDOUT).  Other transfers from that peer in flight fail with it;
 * the peer's next request opens a fresh connection.  Blocks. */
int mc_engine_cut_peer(mc_engine_t *e, const char *segment, int64_t timeout_ms, mc_err_t *err);

/* Puts a notification on the queue drained by mc_engine_drain_notifies (for
 * handlers that pass on messages they do not own).  The queue is bounded:
 * MC_NOTIFY_QUEUE_MB bytes (default 64) and 65536 messages; beyond that it
 * refuses (MC_EBUSY, err names the budget) and the sender sees the error. */
int mc_engine_queue_notify(mc_engine_t *e, const char *from, const void *msg, size_t len,
                           mc_err_t *err);

/* Current use of the engine's budgets (docs/connector.md "Budgets"). */
typedef struct mc_engine_stats {
  uint64_t notify_queue_bytes, notify_queue_limit, notify_queue_msgs, notify_refused;
  /* What the transports report (transport.h, MC_TRANSPORT_STATS_FIELDS:
   * each transport fills the fields it owns). */
  union {
    struct {
      MC_TRANSPORT_STATS_FIELDS
    };
    mc_transport_stats_t transport;
  };
  /* Detached notifications not yet freed (mc_engine_notify_detached). */
  uint64_t detached_msgs, detached_bytes;
  /* GPU copy jobs submitted so far, and how many of them the submitting
   * thread launched itself (MC_GPU_DIRECT; docs/architecture.md). */
  uint64_t gpu_jobs, gpu_jobs_direct;
  /* Gated batches (mc_batch_submit_gated): notifications the engine sent
   * for completed batches, and CUDA event waits that failed. */
  uint64_t gate_notified, gate_event_failures;
  /* Gated batches without an event the gate thread submitted
   * (mc_gate_opts_t.on_gate_thread: the caller only queued them). */
  uint64_t gate_host_batches;
  /* Gated notes (mc_engine_notify_gated) dropped: their event failed, the
   * engine stopped or their send_by passed before their turn. */
  uint64_t gate_notes_dropped;
} mc_engine_stats_t;
void mc_engine_get_stats(mc_engine_t *e, mc_engine_stats_t *out);

/* The segment descriptor JSON this engine publishes (malloc'ed). */
char *mc_engine_describe(mc_engine_t *e);
/* The descriptor JSON of segment (malloc'ed into *out, caller frees): the
 * own one directly, a peer's asked from the peer over the control channel
 * (MC_RPC_DESCRIBE; also in P2P mode).  0 or an MC_E* code. */
int mc_engine_describe_peer(mc_engine_t *e, const char *segment, int64_t timeout_ms,
                            char **out, mc_err_t *err);

#endif
