/* Private state of the engine, shared by engine.c and batch.c. */
#ifndef MC_ENGINE_INTERNAL_H
#define MC_ENGINE_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "engine/engine.h"
#include "engine/regions.h"
#include "engine/segment_desc.h"
#include "meta/meta.h"
#include "transport/rdma/rdma.h"
#include "transport/tcp/tcp.h"

typedef struct mc_notify_msg {
  struct mc_notify_msg *next;
  char *from;
  char *msg;
  size_t len;
} mc_notify_msg_t;

struct mc_engine {
  char name[320]; /* "host:port" */
  char host[256];
  int port;
  int p2p;
  mc_meta_t *meta;
  mc_regions_t regions;
  mc_tcp_t *tcp;   /* data (protocol tcp) and always the control channel */
  mc_rdma_t *rdma; /* data for protocol rdma, else NULL */
  char protocol[8];
  uint64_t slice_size;    /* bytes per wire op */
  uint32_t op_entries;    /* entries per wire op */
  uint64_t timeout_ms;    /* MC_TRANSFER_TIMEOUT */
  uint64_t spin_ns;       /* MC_WAIT_SPIN_US: busy-wait before sleeping */

  pthread_mutex_t seg_mu; /* segment cache */
  mc_segment_desc_t *segs;
  size_t nsegs, cap_segs;

  pthread_mutex_t notify_mu;
  mc_notify_msg_t *notify_head, *notify_tail;
  size_t notify_count;
  pthread_rwlock_t handler_lock; /* guards notify_cb/arg against a call in flight */
  mc_notify_cb notify_cb; /* if set, notifications go here instead of the queue */
  void *notify_arg;
  mc_peer_lost_cb peer_lost_cb; /* under handler_lock */
  void *peer_lost_arg;

  /* Metadata liveness (engine.c): our entries carry a TTL that a keep-alive
   * thread refreshes every TTL/3 s, re-writing them when the server lost
   * them (restart); see docs/protocol.md "Liveness". */
  int meta_ttl_s;           /* MC_METADATA_TTL; 0 = entries without TTL */
  pthread_mutex_t pub_mu;   /* serialises writes of our entries */
  char *pub_desc, *pub_rpc; /* last published values (pub_mu) */
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
  char last_segment[320];
  char *rpc_reply; /* mc_engine_rpc: the reply text (malloc'ed) */
};

/* Resolves a segment name to where it is served (cache, metadata or P2P). */
int mc_engine_resolve(mc_engine_t *e, const char *segment, mc_segment_desc_t *out,
                      mc_err_t *err);
void mc_engine_forget_segment(mc_engine_t *e, const char *segment);

/* Sends an RPC (a transport's control request, e.g. the RDMA handshake) to
 * a segment over its TCP control connection and waits for the reply text
 * (*reply, malloc'ed).  Blocks up to timeout_ms (<0: engine default). */
int mc_engine_rpc(mc_engine_t *e, const char *segment, const char *req, size_t len,
                  int64_t timeout_ms, char **reply, mc_err_t *err);

#endif
