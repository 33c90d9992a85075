/* Shared state of send_kv/recv_kv (kv_transfer.c) and the pull protocol
 * (kv_pull.c).  Not part of the public API. */
#ifndef MC_KV_KV_INTERNAL_H
#define MC_KV_KV_INTERNAL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "kv/kv_msg.h" /* the wire format: all byte work is there */
#include "kv/kv_transfer.h"


typedef struct kv_job {
  struct kv_job *next;
  char *from;
  uint8_t *msg;
  size_t len;
  uint64_t received_ns;
} kv_job_t;

typedef struct kv_waiter {
  struct kv_waiter *next;
  uint64_t id;
  char producer[320];
  int done;
  int status;
  uint32_t matched;
  char msg[MC_ERR_MSG_MAX];
  /* pull answers only: */
  uint64_t lease_id;
  uint32_t nblocks, epb;
  uint8_t *extents; /* nblocks * epb * {u64 addr, u64 len}, malloc'ed */
} kv_waiter_t;

/* A producer-side lease: blocks pinned for one consumer until it releases
 * them or the deadline passes. */
typedef struct kv_lease {
  struct kv_lease *next;
  uint64_t id;
  char from[320];
  uint64_t deadline_ns;
  mc_lookup_match_t *match;
} kv_lease_t;

typedef struct kv_pull_op kv_pull_op_t; /* kv_pull_async.c */
#define KV_MAX_PULL_THREADS 16
#define KV_MAX_SERVING 64 /* = the most workers mc_kv_create starts */
#define KV_DEAD_PEERS 64

struct mc_kv {
  mc_engine_t *e;
  mc_lookup_t *lb;
  pthread_mutex_t mu;
  pthread_cond_t job_cv;  /* workers wait for jobs */
  pthread_cond_t wait_cv; /* recv_kv callers wait for answers */
  kv_job_t *jobs_head, *jobs_tail;
  size_t njobs;
  uint64_t queued_bytes, queue_limit; /* MC_KV_QUEUE_MB: what queued jobs hold */
  /* Fairness (kv_transfer.c): the sender each worker serves, and consumers
   * found unreachable recently. */
  const char *serving[KV_MAX_SERVING];
  int nserving_slots;
  struct {
    char name[320];
    uint64_t until;
  } dead[KV_DEAD_PEERS];
  uint64_t next_dead;
  kv_waiter_t *waiters;
  uint64_t next_id;
  int stopping;
  int stopped; /* mc_kv_stop ran (only its caller and mc_kv_destroy read it) */
  pthread_t *threads;
  int nthreads;
  mc_kv_stats_t stats;
  kv_lease_t *leases; /* guarded by mu */
  uint64_t next_lease;
  /* asynchronous pulls (kv_pull_async.c), guarded by mu */
  kv_pull_op_t *pulls;
  uint64_t next_pull;
  pthread_cond_t pull_cv;
  pthread_cond_t pull_done_cv; /* mc_kv_pull_wait callers */
  pthread_t pull_threads[KV_MAX_PULL_THREADS];
  int npull_threads, pull_pool, pull_stopping;
};

/* kv_pull.c */
/* Worker thread: serves a KVPQ job (answers it). */
void kv_pull_serve(mc_kv_t *kv, kv_job_t *j);
/* I/O thread: a KVPP answer or a KVPR release arrived. */
void kv_pull_on_answer(mc_kv_t *kv, const char *from, const uint8_t *m, size_t len);
void kv_pull_on_release(mc_kv_t *kv, const char *from, const uint8_t *m, size_t len);
/* Worker thread: delivers a release this engine queued (kv_pull.c). */
void kv_pull_send_release(mc_kv_t *kv, const char *producer, const uint8_t *msg, size_t len);
/* Releases expired leases (or all of them, or those of one peer); caller
 * holds kv->mu. Returns the next deadline (0 = none). */
uint64_t kv_pull_expire_locked(mc_kv_t *kv, uint64_t now_ns, const char *only_from, int all);
/* kv_pull_async.c: stop and join the pull threads; free what is left. */
void kv_pull_async_stop(mc_kv_t *kv);
void kv_pull_async_free(mc_kv_t *kv);
/* Pulls started and not yet taken by mc_kv_pull_poll (kv->mu held). */
size_t kv_pull_count_locked(const mc_kv_t *kv);
/* kv_transfer.c: queues a job for the worker threads (a copy of msg);
 * MC_ENOMEM or MC_ECLOSED (shutting down) if it cannot. */
int kv_queue_job(mc_kv_t *kv, const char *from, const void *msg, size_t len, mc_err_t *err);
/* Sends msg to producer, waits for w's answer until deadline; returns the
 * answer's matched tokens or a negative code (err says "<what> from ...").
 * Returns with kv->mu held and w unlinked (the caller counts, unlocks). */
long kv_ask_locked(mc_kv_t *kv, kv_waiter_t *w, const char *producer, const void *msg,
                   size_t len, int timeout_ms, uint64_t deadline, const char *what,
                   mc_err_t *err);
/* Unlinks and frees a waiter; caller holds kv->mu. */
/* *out = a new waiter for an answer from producer, linked in; counts the call in
 * *counter (under kv->mu).  Returns 0, or MC_ENOMEM / MC_ECLOSED ("WHAT: shutting down"). */
int kv_waiter_add(mc_kv_t *kv, const char *producer, uint64_t *counter, const char *what,
                  kv_waiter_t **out, mc_err_t *err);
void kv_waiter_unlink_locked(mc_kv_t *kv, kv_waiter_t *w);
/* The waiter still waiting for answer id from producer `from`, or NULL;
 * caller holds kv->mu. */
kv_waiter_t *kv_waiter_find_locked(mc_kv_t *kv, uint64_t id, const char *from);
/* w->msg = a peer's text of len bytes (not NUL-terminated), cut to fit. */
void kv_waiter_set_text(kv_waiter_t *w, const char *text, size_t len);
/* kv_transfer.c: recv_kv's argument checks (mc_kv_recv_ex, mc_kv_pull_ex:
 * producer named, 4- or 8-byte token ids, 1..65535 extents per block, counts
 * that fit 32 bits): 0, or MC_EINVAL naming the first that fails. */
int kv_recv_check_args(const char *producer, int width, uint32_t epb, size_t ntok,
                       size_t ndest, size_t nhidden, mc_err_t *err);

#endif
