/* Private state of the engine, shared by engine.c and batch.c. */
#ifndef MC_ENGINE_INTERNAL_H
#define MC_ENGINE_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "engine/engine.h"
#include "mem/regions.h"
#include "meta/segment_desc.h"
#include "gpu/gpu_staging.h"
#include "meta/meta.h"
#include "transport/transport.h"
#include "util/env.h"

typedef struct mc_ctrl mc_ctrl_t; /* a control message in flight (ctrl.c) */
typedef struct mc_gate mc_gate_t;         /* gated batches' threads (gate.c) */
typedef struct mc_gate_msg mc_gate_msg_t; /* a notification sent at a batch's completion */

/* What the engine knows of one peer (peers.c; e->peers_mu). */
typedef struct mc_peer_entry {
  char name[320];
  int resolved;         /* d holds its descriptor (else only routes were asked) */
  mc_segment_desc_t d;
  signed char route[MC_TRANSPORT_MAX][MC_MEM_KINDS]; /* reaches(): 1 yes, -1 no, 0 not asked */
} mc_peer_entry_t;

typedef struct mc_notify_msg {
  struct mc_notify_msg *next;
  char *from;
  char *msg;
  size_t len;
} mc_notify_msg_t;

struct mc_engine {
  char name[320]; /* "host:port" */
  char auth_secret[MC_AUTH_SECRET_MAX + 1]; /* "" = peer authentication off */
  char host[256];
  int port;
  int p2p;
  mc_meta_t *meta;
  mc_regions_t regions;
  /* Transports by registry slot (transport/registry.c; transports.c
   * starts them, peers.c chooses); an empty slot has ops NULL. */
  mc_transport_t tr[MC_TRANSPORT_MAX];
  int ctrl;                  /* the control channel's slot (NOTIFY, RPC) */
  mc_transport_conf_t tconf; /* what the transports read at start */
  char protocol[8];
  uint64_t slice_size;    /* bytes per wire op */
  uint32_t op_entries;    /* entries per wire op */
  uint64_t timeout_ms;    /* MC_TRANSFER_TIMEOUT */
  uint64_t spin_ns;       /* MC_WAIT_SPIN_US: busy-wait before sleeping */
  uint64_t wake_spin_ns;  /* MC_WAKE_SPIN_US: the gate, its notifier and notification
                           * waiters spin this long before sleeping (0: they sleep) */
  mc_gpu_stager_t *gpu;   /* pinned staging + GPU copy thread (gpu_xfer.c) */
  int gpu_reserved;       /* staging pre-allocated (first cuda region) */
  int gpu_first_chunk;    /* MC_GPU_FIRST_CHUNK: requests located before the GPU path is chosen */
  int gpu_trace;          /* MC_GPU_TRACE=1: log planning times (docs/device.md) */
  int local_check;        /* local buffers must lie in our regions (MC_LOCAL_CHECK) */
  int unregister_wait_ms; /* MC_UNREGISTER_WAIT_MS: bound on waiting for pins */
  pthread_mutex_t gpu_mu; /* gpu_reserved */
  int unregister_grace_ms; /* MC_UNREGISTER_GRACE_MS: then transfers holding it are cut */
  int unregister_revoke;   /* MC_UNREGISTER_REVOKE: peers holding it past grace are cut */

  /* Batches that have pinned local regions (batch.c), so an unregister can
   * cancel the transfers using the region.  Lock order: pin_mu, b->mu,
   * regions. */
  pthread_mutex_t pin_mu;
  mc_batch_t *pin_head;

  /* One table of peers (peers.c): each one's descriptor and the
   * transports' reaches() answers, the choice). */
  pthread_mutex_t peers_mu;
  mc_peer_entry_t *peers;
  size_t npeers, cap_peers;

  /* Detached notifications in flight (batch.c, mc_engine_notify_detached). */
  pthread_mutex_t det_mu;
  struct mc_ctrl *det_head;
  size_t ndet;
  uint64_t det_bytes;

  pthread_mutex_t notify_mu;
  pthread_cond_t notify_cv; /* CLOCK_MONOTONIC; signalled when a notification is queued */
  mc_notify_msg_t *notify_head, *notify_tail;
  size_t notify_count;
  uint64_t notify_bytes, notify_limit, notify_refused; /* MC_NOTIFY_QUEUE_MB */
  pthread_rwlock_t handler_lock; /* guards notify_cb/arg against a call in flight */
  mc_notify_handler_fn notify_cb; /* if set, notifications go here instead of the queue */
  void *notify_arg;
  mc_peer_lost_cb peer_lost_cb; /* under handler_lock */
  void *peer_lost_arg;
  /* Peers lost since the last mc_engine_take_lost_peers (notify_mu): names,
   * each once, at most MC_LOST_PEERS_MAX (the oldest dropped). */
  char *lost_peers[MC_LOST_PEERS_MAX];
  size_t nlost;
  uint64_t lost_gen, lost_woken; /* losses noted / seen by a wait_notifies return */
  int notify_waiters_woken;      /* mc_engine_wake_notify_waiters ran (notify_mu) */

  /* Metadata liveness (engine.c): our entries carry a TTL that a keep-alive
   * thread refreshes every TTL/3 s, re-writing them when the server lost
   * them (restart); see docs/protocol.md "Liveness". */
  int meta_ttl_s;           /* MC_METADATA_TTL; 0 = entries without TTL */
  pthread_mutex_t pub_mu;   /* serialises writes of our entries */
  char *pub_desc, *pub_rpc; /* last published values (pub_mu) */
  int pub_dirty;            /* the last PUT of them failed: the keep-alive re-PUTs (pub_mu) */
  int published;            /* our entries were PUT (create): destroy removes them */
  int rpc_written;          /* rpc entry PUT once; Mooncake's server refuses a second (pub_mu) */
  /* Regions unregistered here whose new descriptor did not reach the
   * metadata server (pub_mu): unregistering one again retries the publish. */
  uint64_t *unpub;
  size_t nunpub, cap_unpub;
  pthread_mutex_t desc_mu;  /* desc_cache */
  char *desc_cache;         /* mc.describe's reply for regions.version desc_cache_ver */
  uint64_t desc_cache_ver;
  /* Gated batches (gate.c): made at the first gated submit (gate_mu). */
  pthread_mutex_t gate_mu;
  mc_gate_t *gate;
  /* The gate's CUDA events (gate_events.c; gate_mu): a ring of
   * MC_GATE_EVENTS, made at first use, on one device. */
  uint64_t *gev;
  size_t gev_next, gev_made;
  int gev_dev;
  pthread_t ka_thread;
  int ka_running;
  pthread_mutex_t ka_mu;
  pthread_cond_t ka_cv; /* CLOCK_MONOTONIC */
  int ka_stop;
};

typedef struct mc_task {
  mc_request_t req;
  mc_task_state_t state;
  int code;
  uint64_t done_bytes;
  uint32_t parts_left; /* ops (or local copies) still outstanding */
  char *msg;           /* first failure, malloc'ed */
} mc_task_t;

struct mc_batch {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  mc_task_t *tasks;
  size_t n, cap;
  _Atomic size_t pending; /* tasks not finished (read without the lock while spinning) */
  size_t ops_inflight; /* ops handed to a transport and not done */
  uint64_t bytes;      /* total requested */
  atomic_int cancel;
  int gpu;             /* a planning transport (same-host GPU copies) took some: wait polls closely */
  int any_msg;         /* some task has a message (failed): else none to scan or free */
  int trusted_locals;  /* mc_batch_trust_locals: skip the local-address check */
  char last_segment[320];
  /* Local regions pinned while ops of this batch are in flight (a region
   * appears once); released when the batch goes idle. */
  mc_engine_t *eng;
  mc_region_t **pins;   /* pins_s until more are needed (prepare.c) */
  size_t npins, cap_pins;
  mc_region_t *pins_s[4];
  int submitting;       /* submits between pinning and handing out their ops */
  int on_pin_list;      /* linked on eng->pin_head (until mc_batch_free) */
  int gate_hold;        /* waiting for its CUDA event (gate.c): one pseudo-task pending,
                           one pseudo-op in flight */
  mc_gate_msg_t *notify; /* sent (gate.c) once no task is pending and every one completed */
  mc_batch_t *pin_next, *pin_prev;
};

/* batch.c: cancels the transfers of this engine whose local buffers lie in
 * reg (an unregister that waited past its grace period); returns how many
 * batches were canceled. */
size_t mc_engine_cancel_local_users(mc_engine_t *e, const mc_region_t *reg);

/* The engine's integer knobs (MC_*: range-checked, the default otherwise). */
static inline int mc_knob(const char *name, int dflt, int lo, int hi) {
  return (int)mc_env_long(name, dflt, lo, hi);
}

/* e->gpu_trace (MC_GPU_TRACE=1) times the GPU planning steps and the wait,
 * in absolute us comparable with the copy worker's job lines. */
static inline double mc_trace_us(uint64_t ns) { return (double)(ns / 1000 % 100000000); }

/* batch.c: an op of the batch op->arg finished (its done()); one entry of
 * it failed (its entry_failed()). */
void mc_batch_op_done(mc_xfer_op_t *op, int code, const char *msg);
void mc_batch_op_entry_failed(mc_xfer_op_t *op, uint32_t idx, int code, const char *msg);
/* prepare.c: one pass over a submit's requests: each checked (opcode,
 * NULL, length 0, wrap-around: the first failing request's message, before
 * any lookup failure), the region holding its local buffer pinned for the
 * batch (once per region; MC_LOCAL_CHECK and an untrusted batch: every
 * buffer must lie in one) and, with ldev, its device noted: ldev[i] = the
 * region's cuda device, -1 host memory, MC_LDEV_UNKNOWN in no region (the
 * driver says: mc_gpu_locate_locals).  Marks a submit in progress
 * (mc_batch_pin_end after the ops are handed out, also after a failure);
 * a failure pins nothing. */
#define MC_LDEV_UNKNOWN (-2)
typedef struct mc_prepared {
  int gpu;        /* some request's local buffer lies in a cuda region */
  size_t unknown; /* requests whose local buffer lies in no region */
} mc_prepared_t;
int mc_batch_prepare(mc_engine_t *e, mc_batch_t *b, const mc_request_t *reqs, size_t n,
                     int *ldev, mc_prepared_t *out, mc_err_t *err);
/* batch.c: the end of a submit (prepare); the batch joins the engine's
 * list of batches holding pins (unregister looks there). */
void mc_batch_pin_end(mc_batch_t *b);
void mc_batch_pin_list_add(mc_engine_t *e, mc_batch_t *b);
int mc_batch_finished(void *arg); /* no task pending (a poll's stop test) */

/* batch.c, for gate.c: the batch waits for its event (caller holds the
 * gate's mutex; m: its notification or NULL); the wait is over: rc 0 (its
 * requests were submitted) or <0, then requests [b->n, n) of reqs are
 * recorded as failed with msg. */
void mc_batch_gate_hold(mc_batch_t *b, mc_gate_msg_t *m);
void mc_batch_gate_release(mc_batch_t *b, const mc_request_t *reqs, size_t n, int rc,
                           const char *msg);
/* gate.c: canceled batches waiting for events let go (the transports'
 * cancel sweep calls it); a completed batch's notification queued for the
 * notifier thread (caller holds the batch's mu); counts; stop + free. */
void mc_gate_sweep(mc_engine_t *e);
void mc_gate_post(mc_engine_t *e, mc_gate_msg_t *m);
void mc_gate_counts(mc_engine_t *e, uint64_t *notified, uint64_t *event_failures,
                    uint64_t *host_batches, uint64_t *notes_dropped);
void mc_gate_destroy(mc_engine_t *e);

/* publish.c: our entries on the metadata server. */
int mc_engine_publish(mc_engine_t *e, mc_err_t *err);
void mc_engine_unpublish(mc_engine_t *e);
int mc_keepalive_start(mc_engine_t *e, mc_err_t *err);
void mc_keepalive_stop(mc_engine_t *e);
/* Regions unregistered here whose removal is not yet published (pub_mu
 * taken inside, except find: caller holds it). */
int mc_unpub_find(mc_engine_t *e, uint64_t addr);
void mc_unpub_drop(mc_engine_t *e, uint64_t addr);
void mc_unpub_add(mc_engine_t *e, uint64_t addr);

/* batch.c: records one finished part of task i (caller holds b->mu). */
void mc_batch_part_done(mc_batch_t *b, size_t i, int code, const char *msg, uint64_t bytes);

/* gpu_xfer.c: GPU memory in transfers. */
/* Where local buffers live: inside a region this engine registered (its
 * location was checked then), else as the CUDA driver says.  A locator
 * remembers the regions and allocations it found (and maps a 2 MiB page to
 * the one last found there), so a batch located in pieces looks each up
 * once. */
#define MC_LOCATE_CACHE 64
#define MC_LOCATE_HINTS 4096
typedef struct mc_gpu_locator {
  struct {
    uint64_t lo, hi;
    int dev;
  } seen[MC_LOCATE_CACHE];
  size_t nseen, last;
  unsigned char hint[MC_LOCATE_HINTS]; /* page -> seen index + 1 */
  mc_regions_t *regions;               /* the engine's own, or NULL */
} mc_gpu_locator_t;
void mc_gpu_locator_init(mc_gpu_locator_t *lc, mc_regions_t *regions);
/* Locates the local buffers of reqs[from, to): ldev[i] = cuda device or
 * -1.  Returns how many are GPU memory, or <0 (a buffer runs past its
 * allocation). */
int mc_gpu_locate_locals(mc_gpu_locator_t *lc, const mc_request_t *reqs, size_t from,
                         size_t to, int *ldev, mc_err_t *err);
/* Synchronous copy for same-segment requests touching GPU memory. */
int mc_gpu_copy_sync(void *dst, const void *src, uint64_t len, int dev, mc_err_t *err);

/* transports.c: the registered transports.  start: the control channel
 * first (its port completes the name: mc_engine_set_port), then the rest
 * in registry order; a protocol nobody started falls back to the control
 * transport's (the transport asked for logged why). */
int mc_transport_count(void);
int mc_protocol_check(const char *proto, mc_err_t *err); /* one a transport offers? */
const char *mc_protocol_default(void);
int mc_transports_start(mc_engine_t *e, mc_err_t *err);
void mc_transports_stop(mc_engine_t *e);
void mc_transports_stats(mc_engine_t *e, mc_transport_stats_t *out);
/* After canceling (the ops' cancel flag set): sweeps the transports and
 * waits on cv under mu until busy(arg) is 0, sweeping again every second. */
void mc_transports_drain(mc_engine_t *e, pthread_mutex_t *mu, pthread_cond_t *cv,
                         int (*busy)(const void *), const void *arg);
/* ctrl.c: the control channel (the transport with MC_TCAP_CTRL) takes a
 * NOTIFY/RPC op. */
void mc_ctrl_submit_op(mc_engine_t *e, const mc_peer_t *peer, mc_xfer_op_t *op);

/* engine.c: our name gets the control transport's port (port 0 asked). */
void mc_engine_set_port(mc_engine_t *e, int port);
/* engine.c: a NOTIFY arrived (the handler or the queue). */
int mc_engine_on_notify(void *ctx, const char *from, const void *msg, size_t len,
                        mc_err_t *err);

/* peers.c: choose returns the slot that moves `kind` memory to `peer` (the
 * control transport when nothing better reaches it); no_plan: the best
 * after planning transports (for the requests a plan() did not take). */
/* peers.c: the peer's entry (peers_mu held), created if asked (NULL: none,
 * or out of memory); all entries freed (engine destroy). */
mc_peer_entry_t *mc_peer_entry_locked(mc_engine_t *e, const char *segment, int create);
void mc_peers_free(mc_engine_t *e);
/* batch.c: frees finished detached notifications and cancels those past
 * their deadline; all: frees every one (after mc_transports_stop). */
void mc_engine_reap_detached(mc_engine_t *e, int all);
int mc_transport_choose(mc_engine_t *e, const mc_peer_t *peer, mc_mem_kind_t kind,
                        int no_plan);
/* The transport that moves one request: `chosen` (from choose) unless its
 * takes() declines [remote, remote+len), then the next one that can.
 * `memo` (zeroed per submit and kind) remembers the last answer's range. */
typedef struct mc_takes_memo {
  uint64_t lo, hi;
  int id;
} mc_takes_memo_t;
int mc_transport_for_request(mc_engine_t *e, const mc_peer_t *peer, mc_mem_kind_t kind,
                             int chosen, uint64_t remote, uint64_t len, mc_takes_memo_t *memo);
void mc_transports_cancel_sweep(mc_engine_t *e);
void mc_transports_peer_lost(mc_engine_t *e, const char *segment);
/* Records a lost peer for mc_engine_take_lost_peers and wakes waiters (ctrl.c). */
void mc_engine_note_peer_lost(mc_engine_t *e, const char *segment);
/* gate_events.c: the ring's events destroyed (after mc_gate_destroy). */
void mc_gate_events_destroy(mc_engine_t *e);
void mc_transports_peer_closed(mc_engine_t *e, const char *segment);
int mc_transports_serve_rpc(mc_engine_t *e, const char *from, const char *req, size_t len,
                            char **reply, mc_err_t *err);
int mc_transports_register(mc_engine_t *e, void *addr, uint64_t len, const char *location,
                           mc_err_t *err);
/* Before the region leaves e->regions: <0 (e.g. MC_EBUSY, copies in
 * flight past timeout_ms) fails the engine's unregister. */
int mc_transports_unregister(mc_engine_t *e, void *addr, int64_t timeout_ms, mc_err_t *err);

/* Resolves a segment name to where it is served (cache, metadata or P2P). */
int mc_engine_resolve(mc_engine_t *e, const char *segment, mc_segment_desc_t *out,
                      mc_err_t *err);
void mc_engine_forget_segment(mc_engine_t *e, const char *segment);
/* peers.c: 1 the peer runs on this host, -1 on another, 0 not known. */
int mc_peer_same_host(const mc_segment_desc_t *d);

/* Sends an RPC (a transport's control request, e.g. a connection
 * handshake) to a segment over the control channel and waits for the reply text
 * (*reply, malloc'ed).  Blocks up to timeout_ms (<0: engine default). */
int mc_engine_rpc(mc_engine_t *e, const char *segment, const char *req, size_t len,
                  int64_t timeout_ms, char **reply, mc_err_t *err);

#endif
