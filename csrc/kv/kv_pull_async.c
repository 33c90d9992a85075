/* Asynchronous pulls: mc_kv_pull_start queues a pull, a small pool of pull
 * threads runs mc_kv_pull_ex, mc_kv_pull_poll reports and frees it.  A
 * caller (the vLLM connector) starts a load and checks it once per step
 * without any thread of its own, so no Python thread has to win the GIL for
 * a load to start or finish.  The pool is separate from the serving workers,
 * so an engine that pulls and serves (kv_both) never starves its peers. */
#include <stdlib.h>
#include <string.h>

#include "kv/kv_internal.h"
#include "util/clock.h"
#include "util/log.h"

struct kv_pull_op {
  struct kv_pull_op *next; /* queue, then the done list */
  uint64_t id;
  char producer[320];
  void *tokens;
  size_t ntok;
  int width;
  uint32_t skip, epb;
  mc_lookup_extent_t *dest;
  size_t ndest;
  int timeout_ms;
  int started, done;
  long result;
  mc_err_t err;
  uint64_t t0_ns, t1_ns;
};

static void op_free(kv_pull_op_t *op) {
  if (!op)
    return;
  free(op->tokens);
  free(op->dest);
  free(op);
}

static long queued_too_long(mc_kv_t *kv, const kv_pull_op_t *op, mc_err_t *err) {
  return mc_err_set(err, MC_ETIMEDOUT,
                    "recv_kv (pull) from %s timed out after %d ms before it started: all %d "
                    "pull threads were busy with other pulls (raise the number of load "
                    "workers or the load timeout)",
                    op->producer, op->timeout_ms, kv->pull_pool);
}

/* Queued pulls past their deadline are done (timed out) without a thread;
 * returns the earliest deadline of those still queued (0: none). */
static uint64_t expire_queued_locked(mc_kv_t *kv, uint64_t now) {
  uint64_t next = 0;
  for (kv_pull_op_t *o = kv->pulls; o; o = o->next) {
    if (o->started)
      continue;
    uint64_t dl = o->t0_ns + (uint64_t)o->timeout_ms * 1000000ull;
    if (now >= dl) {
      o->started = o->done = 1;
      o->result = queued_too_long(kv, o, &o->err);
      o->t1_ns = now;
      kv->stats.pull_errors++;
    } else if (!next || dl < next) {
      next = dl;
    }
  }
  return next;
}

/* Pulls run oldest first (the list is newest first), and a pull's timeout
 * counts from mc_kv_pull_start: time spent queued behind busy pull threads
 * is part of it, so a pull never reports later than its caller's deadline
 * (plus one READ's cancellation). */
static void *pull_main(void *arg) {
  mc_kv_t *kv = arg;
  pthread_mutex_lock(&kv->mu);
  for (;;) {
    kv_pull_op_t *op = NULL;
    for (kv_pull_op_t *o = kv->pulls; o; o = o->next)
      if (!o->started)
        op = o;
    if (!op) {
      if (kv->pull_stopping)
        break;
      pthread_cond_wait(&kv->pull_cv, &kv->mu);
      continue;
    }
    op->started = 1;
    pthread_mutex_unlock(&kv->mu);
    mc_err_t err = {0};
    long r;
    uint64_t waited_ms = (mc_now_ns() - op->t0_ns) / 1000000ull;
    if (waited_ms + 1 >= (uint64_t)op->timeout_ms) {
      r = queued_too_long(kv, op, &err);
      pthread_mutex_lock(&kv->mu);
      kv->stats.pull_errors++;
      pthread_mutex_unlock(&kv->mu);
    } else
      r = mc_kv_pull_ex(kv, op->producer, op->tokens, op->ntok, op->width, op->skip,
                        op->dest, op->ndest, op->epb, op->timeout_ms - (int)waited_ms, &err);
    pthread_mutex_lock(&kv->mu);
    op->result = r;
    op->err = err;
    op->t1_ns = mc_now_ns();
    op->done = 1;
    pthread_cond_broadcast(&kv->pull_done_cv);
  }
  pthread_mutex_unlock(&kv->mu);
  return NULL;
}

int mc_kv_pull_start(mc_kv_t *kv, const char *producer, const void *tokens, size_t ntok,
                     int width, uint32_t skip, const mc_lookup_extent_t *dest, size_t ndest,
                     uint32_t epb, int timeout_ms, uint64_t *id, mc_err_t *err) {
  if (width != 4 && width != 8)
    return mc_err_set(err, MC_EINVAL, "recv_kv: token ids must be 4 or 8 bytes wide");
  if (!producer || strlen(producer) >= sizeof(((kv_pull_op_t *)0)->producer))
    return mc_err_set(err, MC_EINVAL, "recv_kv: bad producer segment name");
  kv_pull_op_t *op = calloc(1, sizeof *op);
  if (op) {
    op->tokens = malloc(ntok ? ntok * (size_t)width : 1);
    op->dest = malloc((ndest ? ndest : 1) * sizeof *dest);
  }
  if (!op || !op->tokens || !op->dest) {
    op_free(op);
    return mc_err_set(err, MC_ENOMEM, "out of memory queueing a pull");
  }
  memcpy(op->tokens, tokens, ntok * (size_t)width);
  memcpy(op->dest, dest, ndest * sizeof *dest);
  strcpy(op->producer, producer);
  op->ntok = ntok;
  op->width = width;
  op->skip = skip;
  op->ndest = ndest;
  op->epb = epb;
  op->timeout_ms = timeout_ms > 0 ? timeout_ms : 30000; /* mc_kv_pull_ex's default */
  op->t0_ns = mc_now_ns();
  pthread_mutex_lock(&kv->mu);
  if (kv->stopping || kv->pull_stopping) {
    pthread_mutex_unlock(&kv->mu);
    op_free(op);
    return mc_err_set(err, MC_ECLOSED, "recv_kv: shutting down");
  }
  /* Pull threads start on demand, up to the pool size. */
  if (kv->npull_threads < kv->pull_pool) {
    if (pthread_create(&kv->pull_threads[kv->npull_threads], NULL, pull_main, kv) == 0) {
      kv->npull_threads++;
    } else if (kv->npull_threads == 0) {
      pthread_mutex_unlock(&kv->mu);
      op_free(op);
      return mc_err_set(err, MC_ESYS, "cannot start a pull thread");
    }
  }
  op->id = *id = ++kv->next_pull;
  op->next = kv->pulls;
  kv->pulls = op;
  pthread_cond_signal(&kv->pull_cv);
  pthread_mutex_unlock(&kv->mu);
  return 0;
}

int mc_kv_pull_poll(mc_kv_t *kv, uint64_t id, long *result, double *seconds, mc_err_t *err) {
  pthread_mutex_lock(&kv->mu);
  expire_queued_locked(kv, mc_now_ns());
  kv_pull_op_t **pp = &kv->pulls;
  while (*pp && (*pp)->id != id)
    pp = &(*pp)->next;
  kv_pull_op_t *op = *pp;
  if (!op) {
    pthread_mutex_unlock(&kv->mu);
    return mc_err_set(err, MC_EINVAL, "no pull %llu (already reported?)",
                      (unsigned long long)id);
  }
  if (!op->done) {
    pthread_mutex_unlock(&kv->mu);
    return 0;
  }
  *pp = op->next;
  pthread_mutex_unlock(&kv->mu);
  *result = op->result;
  if (seconds)
    *seconds = (double)(op->t1_ns - op->t0_ns) / 1e9;
  if (op->result < 0 && err)
    *err = op->err;
  op_free(op);
  return 1;
}

int mc_kv_pull_wait(mc_kv_t *kv, const uint64_t *ids, size_t n, int timeout_ms, mc_err_t *err) {
  uint64_t deadline = mc_now_ns() + (uint64_t)(timeout_ms > 0 ? timeout_ms : 0) * 1000000ull;
  pthread_mutex_lock(&kv->mu);
  for (;;) {
    uint64_t now = mc_now_ns();
    uint64_t next = expire_queued_locked(kv, now);
    size_t left = 0;
    for (size_t i = 0; i < n; i++) {
      kv_pull_op_t *op = kv->pulls;
      while (op && op->id != ids[i])
        op = op->next;
      if (!op) {
        pthread_mutex_unlock(&kv->mu);
        return mc_err_set(err, MC_EINVAL, "no pull %llu (already reported?)",
                          (unsigned long long)ids[i]);
      }
      left += !op->done;
    }
    if (!left) {
      pthread_mutex_unlock(&kv->mu);
      return 1;
    }
    if (now >= deadline)
      break;
    struct timespec ts = mc_deadline_ts(next && next < deadline ? next : deadline);
    pthread_cond_timedwait(&kv->pull_done_cv, &kv->mu, &ts);
  }
  pthread_mutex_unlock(&kv->mu);
  return 0;
}

void kv_pull_async_stop(mc_kv_t *kv) {
  pthread_mutex_lock(&kv->mu);
  kv->pull_stopping = 1;
  kv->stopping = 1; /* pulls waiting for an answer give up now */
  pthread_cond_broadcast(&kv->wait_cv);
  /* Pulls not started yet never run. */
  for (kv_pull_op_t *o = kv->pulls; o; o = o->next)
    if (!o->started) {
      o->started = o->done = 1;
      o->result = mc_err_set(&o->err, MC_ECLOSED, "recv_kv: shutting down");
    }
  pthread_cond_broadcast(&kv->pull_cv);
  pthread_cond_broadcast(&kv->pull_done_cv);
  pthread_mutex_unlock(&kv->mu);
  for (int i = 0; i < kv->npull_threads; i++)
    pthread_join(kv->pull_threads[i], NULL); /* running pulls end by their timeout */
  kv->npull_threads = 0;
}

size_t kv_pull_count_locked(const mc_kv_t *kv) {
  size_t n = 0;
  for (const kv_pull_op_t *o = kv->pulls; o; o = o->next)
    n++;
  return n;
}

void kv_pull_async_free(mc_kv_t *kv) {
  while (kv->pulls) {
    kv_pull_op_t *o = kv->pulls;
    kv->pulls = o->next;
    op_free(o);
  }
}
