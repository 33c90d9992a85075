/* send_kv / recv_kv over engine notifications; see kv_transfer.h.
 *
 * Push: the consumer's request (KVRQ) names token ids and its destination
 * extents; the producer WRITEs the matched blocks there and answers (KVRP).
 * Hidden-state destinations are one per block; blocks stored without hidden
 * states are skipped.  The wire format is kv_msg.[ch] (docs/protocol.md). */
#include "kv/kv_transfer.h"
#include "kv/kv_internal.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/clock.h"
#include "util/env.h"
#include "util/log.h"

/* ---- answers ---- */

static void mark_unreachable(mc_kv_t *kv, const char *from, int code);

/* Answers job j.  The wait for the receipt is bounded by what is left of the
 * asker's timeout (it has given up after that), at most 10 s. */
static void send_answer(mc_kv_t *kv, const kv_job_t *j, uint64_t id, uint32_t tmo,
                        int status, uint32_t matched, const char *text) {
  const char *to = j->from;
  int64_t left = 10000;
  if (tmo) {
    left = (int64_t)tmo - (int64_t)((mc_now_ns() - j->received_ns) / 1000000ull);
    left = left < 100 ? 100 : left > 10000 ? 10000 : left;
  }
  kv_msg_rep_t r = {.id = id, .status = status, .matched = matched, .text = text,
                    .text_len = text ? strlen(text) : 0};
  size_t len = (size_t)kv_msg_rep_size(&r);
  uint8_t *buf = malloc(len);
  if (!buf)
    return;
  mc_err_t err = {0};
  if (kv_msg_rep_encode(&r, buf, len, &err) < 0 ||
      mc_engine_notify(kv->e, to, buf, len, left, &err) < 0) {
    mc_log_warn_rated("recv_kv answer to %s (request %llu) not delivered: %s", to,
                (unsigned long long)id, err.msg);
    mark_unreachable(kv, to, err.code);
  }
  free(buf);
}

static void on_answer(mc_kv_t *kv, const char *from, const uint8_t *m, size_t len) {
  kv_msg_rep_t r;
  mc_err_t err = {0};
  if (kv_msg_rep_decode(m, len, &r, &err) < 0) {
    mc_log_warn_rated("%s from %s: dropped", err.msg, from); /* a peer repeats these at will */
    return;
  }
  pthread_mutex_lock(&kv->mu);
  kv_waiter_t *w = kv_waiter_find_locked(kv, r.id, from);
  if (w) {
    w->done = 1;
    w->status = r.status;
    w->matched = r.matched;
    kv_waiter_set_text(w, r.text, r.text_len);
    pthread_cond_broadcast(&kv->wait_cv);
  }
  pthread_mutex_unlock(&kv->mu);
}

/* A producer's connection went away: its pending recv_kv calls fail now. */
static void on_peer_lost(void *arg, const char *segment) {
  mc_kv_t *kv = arg;
  pthread_mutex_lock(&kv->mu);
  int hit = 0;
  for (kv_waiter_t *w = kv->waiters; w; w = w->next) {
    if (!w->done && !strcmp(w->producer, segment)) {
      w->done = 1;
      w->status = MC_EPEERCLOSED;
      w->matched = 0;
      snprintf(w->msg, sizeof w->msg,
               "the connection to producer %s was lost before it answered (producer gone?)",
               segment);
      hit = 1;
    }
  }
  if (hit)
    pthread_cond_broadcast(&kv->wait_cv);
  /* A consumer that is gone reads nothing more: its leases end now. */
  kv_pull_expire_locked(kv, mc_now_ns(), segment, 0);
  pthread_mutex_unlock(&kv->mu);
}

/* ---- the notification handler (I/O thread: never blocks) ---- */

static int on_message(void *arg, const char *from, const void *msg, size_t len, mc_err_t *err) {
  mc_kv_t *kv = arg;
  const uint8_t *m = msg;
  uint32_t magic = kv_msg_magic(m, len);
  if (magic == KV_REP_MAGIC) {
    on_answer(kv, from, m, len);
    return 0;
  }
  if (magic == KV_PANS_MAGIC) {
    kv_pull_on_answer(kv, from, m, len);
    return 0;
  }
  if (magic == KV_PREL_MAGIC) {
    kv_pull_on_release(kv, from, m, len);
    return 0;
  }
  if (magic != KV_REQ_MAGIC && magic != KV_PULL_MAGIC)
    return mc_engine_queue_notify(kv->e, from, msg, len, err); /* someone else's */
  return kv_queue_job(kv, from, msg, len, err);
}

static uint64_t job_cost(const char *from, size_t len) {
  return (uint64_t)len + strlen(from) + 1 + sizeof(kv_job_t);
}

int kv_queue_job(mc_kv_t *kv, const char *from, const void *msg, size_t len, mc_err_t *err) {
  /* Bounded in bytes (MC_KV_QUEUE_MB): refused before anything is copied;
   * the asker's recv_kv fails at once with this error instead of waiting. */
  uint64_t cost = job_cost(from, len);
  pthread_mutex_lock(&kv->mu);
  if (kv->queued_bytes + cost > kv->queue_limit) {
    uint64_t used = kv->queued_bytes;
    size_t n = kv->njobs;
    kv->stats.queue_refused++;
    pthread_mutex_unlock(&kv->mu);
    return mc_err_set(err, MC_EBUSY,
                      "producer %s has %zu queued KV requests (%llu bytes; budget %llu bytes, "
                      "MC_KV_QUEUE_MB): refused a %zu-byte request; retry later",
                      mc_engine_segment_name(kv->e), n, (unsigned long long)used,
                      (unsigned long long)kv->queue_limit, len);
  }
  kv->queued_bytes += cost; /* reserved */
  pthread_mutex_unlock(&kv->mu);
  kv_job_t *j = calloc(1, sizeof *j);
  if (j) {
    j->from = strdup(from);
    j->msg = malloc(len ? len : 1);
    j->len = len;
    j->received_ns = mc_now_ns();
  }
  if (!j || !j->from || !j->msg) {
    if (j) {
      free(j->from);
      free(j->msg);
      free(j);
    }
    pthread_mutex_lock(&kv->mu);
    kv->queued_bytes -= cost;
    pthread_mutex_unlock(&kv->mu);
    return mc_err_set(err, MC_ENOMEM, "out of memory queueing a KV request");
  }
  memcpy(j->msg, msg, len);
  pthread_mutex_lock(&kv->mu);
  if (kv->stopping) {
    kv->queued_bytes -= cost;
    pthread_mutex_unlock(&kv->mu);
    free(j->from);
    free(j->msg);
    free(j);
    return mc_err_set(err, MC_ECLOSED, "shutting down");
  }
  if (kv->jobs_tail)
    kv->jobs_tail->next = j;
  else
    kv->jobs_head = j;
  kv->jobs_tail = j;
  kv->njobs++;
  pthread_cond_signal(&kv->job_cv);
  pthread_mutex_unlock(&kv->mu);
  return 0;
}

long kv_ask_locked(mc_kv_t *kv, kv_waiter_t *w, const char *producer, const void *msg,
                   size_t len, int timeout_ms, uint64_t deadline, const char *what,
                   mc_err_t *err) {
  long rc = mc_engine_notify(kv->e, producer, msg, len, timeout_ms, err);
  pthread_mutex_lock(&kv->mu);
  while (rc == 0 && !w->done && !kv->stopping) {
    struct timespec ts = mc_deadline_ts(deadline);
    if (pthread_cond_timedwait(&kv->wait_cv, &kv->mu, &ts) != 0 && mc_now_ns() >= deadline)
      break;
  }
  if (rc == 0) {
    if (w->done && w->status < 0)
      rc = mc_err_set(err, w->status, "%s from %s: %s", what, producer, w->msg);
    else if (w->done)
      rc = w->matched;
    else if (kv->stopping)
      rc = mc_err_set(err, MC_ECLOSED, "%s from %s: shutting down", what, producer);
    else
      rc = mc_err_set(err, MC_ETIMEDOUT, "%s from %s: no answer within %d ms (producer "
                      "busy, stuck or gone)", what, producer, timeout_ms);
  }
  kv_waiter_unlink_locked(kv, w);
  pthread_cond_broadcast(&kv->wait_cv); /* destroy may be waiting for us */
  return rc;
}

/* ---- serving one request (worker thread) ---- */

/* Returns matched tokens (>= 0) or a negative code with err set; *tmo =
 * the request's timeout (0 if it could not be read). */
static long serve(mc_kv_t *kv, kv_job_t *j, uint64_t *bytes, uint32_t *tmo, mc_err_t *err) {
  kv_msg_req_t q;
  int drc = kv_msg_req_decode(j->msg, j->len, &q, err);
  if (drc < 0)
    return drc;
  *tmo = q.timeout_ms;
  int width = q.width;
  uint32_t epb = q.epb;
  uint32_t timeout_ms = q.timeout_ms;
  uint64_t ntok = q.ntok, ndest = q.ndest, nhid = q.nhid;
  if (!kv->lb)
    return mc_err_set(err, MC_EINVAL, "segment %s holds no KV (it is not a producer: no lookup "
                      "buffer)", mc_engine_segment_name(kv->e));
  if (epb != mc_lookup_extents_per_block(kv->lb))
    return mc_err_set(err, MC_EINVAL, "the consumer sent %u extents per block; producer %s "
                      "stores %u", epb, mc_engine_segment_name(kv->e),
                      mc_lookup_extents_per_block(kv->lb));
  uint64_t now = mc_now_ns();
  if (timeout_ms && now - j->received_ns > (uint64_t)timeout_ms * 1000000ull)
    return mc_err_set(err, MC_ETIMEDOUT, "request waited %llu ms in the producer's queue, past "
                      "its %u ms timeout; not served", (unsigned long long)((now - j->received_ns) /
                      1000000ull), timeout_ms);
  mc_lookup_match_t *match = NULL;
  long matched = mc_lookup_find(kv->lb, q.tokens, (size_t)ntok, width, &match, err);
  if (matched <= 0)
    return matched;
  size_t nb = mc_lookup_match_blocks(match);
  uint32_t bs = mc_lookup_hasher(kv->lb)->block_size;
  if (nb * epb > ndest) { /* the consumer has room for fewer blocks */
    nb = ndest / epb;
    matched = (long)(nb * bs);
  }
  long rc = matched;
  size_t nreq = nb * epb;
  size_t nh = nhid < nb ? (size_t)nhid : nb; /* blocks whose hidden states are wanted */
  mc_request_t *reqs = calloc(nreq + nh + 1, sizeof *reqs);
  if (!reqs) {
    mc_lookup_release(kv->lb, match);
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  }
  for (size_t b = 0; b < nb && rc >= 0; b++) {
    const mc_lookup_extent_t *src = mc_lookup_match_kv(match, b);
    for (uint32_t k = 0; k < epb; k++) {
      size_t i = b * epb + k;
      kv_ext_t d = kv_msg_extent(q.ext, i);
      uint64_t daddr = d.addr, dlen = d.len;
      if (dlen != src[k].len) {
        rc = mc_err_set(err, MC_EINVAL, "destination extent %zu is %llu bytes but the "
                        "producer's KV block extent is %llu bytes", i,
                        (unsigned long long)dlen, (unsigned long long)src[k].len);
        break;
      }
      reqs[i] = (mc_request_t){.opcode = MC_OP_WRITE, .local = (void *)(uintptr_t)src[k].addr,
                               .remote = daddr, .len = dlen};
      *bytes += dlen;
    }
  }
  for (size_t b = 0; b < nh && rc >= 0; b++) {
    const mc_lookup_extent_t *hx = mc_lookup_match_hidden(match, b);
    if (!hx || hx->len == 0)
      continue; /* stored without hidden states */
    kv_ext_t d = kv_msg_extent(q.ext, ndest + b);
    uint64_t daddr = d.addr, dlen = d.len;
    if (dlen != hx->len) {
      rc = mc_err_set(err, MC_EINVAL, "hidden-state destination %zu is %llu bytes but the "
                      "producer's block holds %llu", b, (unsigned long long)dlen,
                      (unsigned long long)hx->len);
      break;
    }
    reqs[nreq++] = (mc_request_t){.opcode = MC_OP_WRITE, .local = (void *)(uintptr_t)hx->addr,
                                  .remote = daddr, .len = dlen};
    *bytes += dlen;
  }
  if (rc >= 0 && nreq) {
    mc_batch_t *batch = mc_batch_new(kv->e, nreq);
    int64_t left = timeout_ms ? (int64_t)timeout_ms - (int64_t)((mc_now_ns() - j->received_ns) /
                                                              1000000ull)
                              : -1;
    if (!batch) {
      rc = mc_err_set(err, MC_ENOMEM, "out of memory");
    } else {
      /* Sources are lookup-buffer extents: checked against this engine's
       * regions by send_kv, or copies the buffer owns. */
      mc_batch_trust_locals(batch);
      int r = mc_batch_submit(kv->e, batch, j->from, reqs, nreq, err);
      if (r == 0)
        r = mc_batch_wait(kv->e, batch, left > 0 ? left : (timeout_ms ? 1 : -1), err);
      if (r < 0)
        rc = r;
      mc_batch_free(kv->e, batch);
    }
  }
  free(reqs);
  mc_lookup_release(kv->lb, match);
  return rc;
}

/* ---- fairness between consumers (caller holds kv->mu) ----
 * One consumer never holds more than one producer worker: a worker takes
 * the first queued job whose sender no other worker is serving, so a slow
 * or silent consumer delays only its own requests.  A consumer that could
 * not be reached recently (its answer or push failed to connect or timed
 * out) has its queued requests dropped without another network wait. */

static int serving_locked(const mc_kv_t *kv, const char *from) {
  for (int i = 0; i < KV_MAX_SERVING; i++)
    if (kv->serving[i] && !strcmp(kv->serving[i], from))
      return 1;
  return 0;
}

static int unreachable_locked(mc_kv_t *kv, const char *from, uint64_t now) {
  for (int i = 0; i < KV_DEAD_PEERS; i++)
    if (kv->dead[i].until > now && !strcmp(kv->dead[i].name, from))
      return 1;
  return 0;
}


static void mark_unreachable(mc_kv_t *kv, const char *from, int code) {
  if (code != MC_ECONNECT && code != MC_ETIMEDOUT && code != MC_EPEERCLOSED)
    return;
  pthread_mutex_lock(&kv->mu);
  int k = (int)(kv->next_dead++ % KV_DEAD_PEERS);
  snprintf(kv->dead[k].name, sizeof kv->dead[k].name, "%s", from);
  kv->dead[k].until = mc_now_ns() + 5000000000ull; /* 5 s */
  pthread_mutex_unlock(&kv->mu);
}

/* Unlinks the first job a worker may take now (NULL: none). */
static kv_job_t *take_job_locked(mc_kv_t *kv) {
  uint64_t now = mc_now_ns();
  for (kv_job_t **pp = &kv->jobs_head, *prev = NULL; *pp; prev = *pp, pp = &(*pp)->next) {
    kv_job_t *j = *pp;
    uint32_t jm = kv_msg_magic(j->msg, j->len);
    if (jm != KV_PREL_MAGIC && serving_locked(kv, j->from) &&
        !unreachable_locked(kv, j->from, now))
      continue;
    *pp = j->next;
    if (kv->jobs_tail == j)
      kv->jobs_tail = prev;
    j->next = NULL;
    kv->njobs--;
    kv->queued_bytes -= job_cost(j->from, j->len);
    return j;
  }
  return NULL;
}

static void *worker_main(void *arg) {
  mc_kv_t *kv = arg;
  pthread_mutex_lock(&kv->mu);
  int slot = kv->nserving_slots++ % KV_MAX_SERVING;
  for (;;) {
    kv_job_t *j = NULL;
    while (!kv->stopping && !(j = take_job_locked(kv))) {
      /* Leases expire even when no request comes: wake at the next deadline. */
      uint64_t next = kv_pull_expire_locked(kv, mc_now_ns(), NULL, 0);
      if (next) {
        struct timespec ts = mc_deadline_ts(next);
        pthread_cond_timedwait(&kv->job_cv, &kv->mu, &ts);
      } else {
        pthread_cond_wait(&kv->job_cv, &kv->mu);
      }
    }
    if (kv->stopping) {
      if (j) { /* taken just now: freed with the rest by mc_kv_destroy's sweep */
        j->next = kv->jobs_head;
        kv->jobs_head = j;
        if (!kv->jobs_tail)
          kv->jobs_tail = j;
        kv->njobs++;
        kv->queued_bytes += job_cost(j->from, j->len);
      }
      break;
    }
    if (unreachable_locked(kv, j->from, mc_now_ns())) {
      kv->stats.serve_errors++;
      pthread_mutex_unlock(&kv->mu);
      free(j->from);
      free(j->msg);
      free(j);
      pthread_mutex_lock(&kv->mu);
      continue;
    }
    kv->serving[slot] = j->from;
    pthread_mutex_unlock(&kv->mu);

    uint32_t jm = kv_msg_magic(j->msg, j->len);
    if (jm == KV_PULL_MAGIC || jm == KV_PREL_MAGIC) {
      if (jm == KV_PULL_MAGIC)
        kv_pull_serve(kv, j);
      else /* queued by this engine's own pull: deliver the release */
        kv_pull_send_release(kv, j->from, j->msg, j->len);
      pthread_mutex_lock(&kv->mu);
      kv->serving[slot] = NULL;
      free(j->from);
      free(j->msg);
      free(j);
      continue;
    }
    mc_err_t err = {0};
    uint64_t bytes = 0;
    uint32_t tmo = 0;
    long rc = serve(kv, j, &bytes, &tmo, &err);
    uint64_t id = kv_msg_peek_id(j->msg, j->len); /* a malformed request is answered too */
    pthread_mutex_lock(&kv->mu); /* counted before the asker can see the answer */
    if (rc < 0) {
      kv->stats.serve_errors++;
    } else {
      kv->stats.requests_served++;
      kv->stats.tokens_served += (uint64_t)rc;
      kv->stats.bytes_served += bytes;
    }
    pthread_mutex_unlock(&kv->mu);
    if (rc == MC_ECONNECT) /* the push could not reach it: nor would the answer */
      mark_unreachable(kv, j->from, (int)rc);
    else
      send_answer(kv, j, id, tmo, rc < 0 ? (int)rc : 0, rc < 0 ? 0 : (uint32_t)rc, err.msg);

    pthread_mutex_lock(&kv->mu);
    kv->serving[slot] = NULL;
    free(j->from);
    free(j->msg);
    free(j);
  }
  pthread_mutex_unlock(&kv->mu);
  return NULL;
}

/* ---- lifecycle ---- */

int mc_kv_create(mc_engine_t *e, mc_lookup_t *lb, int workers, mc_kv_t **out, mc_err_t *err) {
  if (!e)
    return mc_err_set(err, MC_EINVAL, "send_kv/recv_kv need an initialized engine");
  if (workers <= 0)
    workers = (int)mc_env_long("MC_KV_WORKERS", 2, 1, 64);
  if (workers > 64)
    workers = 64;
  mc_kv_t *kv = calloc(1, sizeof *kv);
  if (!kv || !(kv->threads = calloc((size_t)workers, sizeof *kv->threads))) {
    free(kv);
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  }
  kv->e = e;
  kv->lb = lb;
  kv->queue_limit = (uint64_t)mc_env_long("MC_KV_QUEUE_MB", 64, 1, 1l << 20) << 20;
  pthread_mutex_init(&kv->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&kv->job_cv, &ca);
  pthread_cond_init(&kv->pull_cv, NULL);
  pthread_cond_init(&kv->pull_done_cv, NULL);
  kv->pull_pool = workers > KV_MAX_PULL_THREADS ? KV_MAX_PULL_THREADS : workers;
  pthread_cond_init(&kv->wait_cv, &ca);
  pthread_condattr_destroy(&ca);
  if (!lb)
    workers = 1; /* only to tell askers that this engine holds no KV */
  for (int i = 0; i < workers; i++) {
    if (pthread_create(&kv->threads[i], NULL, worker_main, kv)) {
      mc_kv_destroy(kv);
      return mc_err_set(err, MC_ESYS, "cannot start send_kv worker threads");
    }
    kv->nthreads++;
  }
  mc_engine_set_notify_handler(e, on_message, kv);
  mc_engine_set_peer_lost_handler(e, on_peer_lost, kv);
  if (lb) /* peers are served from these extents: they must be registered */
    mc_lookup_set_extent_check(lb, mc_engine_check_local, e);
  *out = kv;
  return 0;
}

void mc_kv_stop(mc_kv_t *kv) {
  if (!kv || kv->stopped)
    return;
  kv->stopped = 1;
  kv_pull_async_stop(kv); /* before the handler goes: running pulls need answers */
  if (kv->lb)
    mc_lookup_set_extent_check(kv->lb, NULL, NULL);
  mc_engine_set_notify_handler(kv->e, NULL, NULL); /* waits for a call in flight */
  mc_engine_set_peer_lost_handler(kv->e, NULL, NULL);
  pthread_mutex_lock(&kv->mu);
  kv->stopping = 1;
  pthread_cond_broadcast(&kv->job_cv);
  pthread_cond_broadcast(&kv->wait_cv);
  pthread_mutex_unlock(&kv->mu);
  for (int i = 0; i < kv->nthreads; i++)
    pthread_join(kv->threads[i], NULL);
  /* recv_kv callers leave on `stopping`; wait until none is left. */
  pthread_mutex_lock(&kv->mu);
  while (kv->waiters)
    pthread_cond_wait(&kv->wait_cv, &kv->mu);
  pthread_mutex_unlock(&kv->mu);
}

void mc_kv_destroy(mc_kv_t *kv) {
  if (!kv)
    return;
  mc_kv_stop(kv);
  pthread_mutex_lock(&kv->mu);
  kv_pull_expire_locked(kv, 0, NULL, 1); /* before the owner frees the buffer */
  pthread_mutex_unlock(&kv->mu);
  while (kv->jobs_head) {
    kv_job_t *j = kv->jobs_head;
    kv->jobs_head = j->next;
    free(j->from);
    free(j->msg);
    free(j);
  }
  kv_pull_async_free(kv);
  pthread_cond_destroy(&kv->pull_cv);
  pthread_cond_destroy(&kv->pull_done_cv);
  pthread_cond_destroy(&kv->job_cv);
  pthread_cond_destroy(&kv->wait_cv);
  pthread_mutex_destroy(&kv->mu);
  free(kv->threads);
  free(kv);
}

void mc_kv_get_stats(mc_kv_t *kv, mc_kv_stats_t *out) {
  pthread_mutex_lock(&kv->mu);
  *out = kv->stats;
  out->queue_bytes = kv->queued_bytes;
  out->queue_limit = kv->queue_limit;
  out->queue_jobs = kv->njobs;
  out->pulls_open = kv_pull_count_locked(kv);
  pthread_mutex_unlock(&kv->mu);
}

/* ---- recv_kv (consumer) ---- */

long mc_kv_recv(mc_kv_t *kv, const char *producer, const void *tokens, size_t ntok, int width,
                const mc_lookup_extent_t *dest, size_t ndest, uint32_t epb, int timeout_ms,
                mc_err_t *err) {
  return mc_kv_recv_ex(kv, producer, tokens, ntok, width, dest, ndest, epb, NULL, 0, timeout_ms,
                       err);
}

int kv_recv_check_args(const char *producer, int width, uint32_t epb, size_t ntok,
                       size_t ndest, size_t nhidden, mc_err_t *err) {
  if (!producer || !*producer)
    return mc_err_set(err, MC_EINVAL, "recv_kv: the producer segment name is empty");
  if (width != 4 && width != 8)
    return mc_err_set(err, MC_EINVAL, "recv_kv: token ids must be 4 or 8 bytes wide");
  if (epb == 0 || epb > 0xffff)
    return mc_err_set(err, MC_EINVAL, "recv_kv: extents per block must be 1..65535");
  if (ntok > 0xffffffffu || ndest > 0xffffffffu || nhidden > 0xffffffffu)
    return mc_err_set(err, MC_EINVAL, "recv_kv: too many tokens or extents");
  return 0;
}

long mc_kv_recv_ex(mc_kv_t *kv, const char *producer, const void *tokens, size_t ntok,
                   int width, const mc_lookup_extent_t *dest, size_t ndest, uint32_t epb,
                   const mc_lookup_extent_t *hidden, size_t nhidden, int timeout_ms,
                   mc_err_t *err) {
  int bad = kv_recv_check_args(producer, width, epb, ntok, ndest, nhidden, err);
  if (bad < 0)
    return bad;
  if (timeout_ms <= 0)
    timeout_ms = 30000;
  kv_msg_req_t q = {.width = (uint8_t)width, .epb = (uint16_t)epb,
                    .timeout_ms = (uint32_t)timeout_ms, .ntok = (uint32_t)ntok,
                    .ndest = (uint32_t)ndest, .nhid = (uint32_t)nhidden, .tokens = tokens,
                    .dest = dest, .hidden = hidden};
  uint64_t len64 = kv_msg_req_size(&q);
  size_t len = (size_t)len64;
  if (len64 > MC_ENGINE_MAX_MSG)
    return mc_err_set(err, MC_ETOOBIG, "recv_kv request of %zu bytes (%zu tokens, %zu extents) "
                      "exceeds %u bytes; split the prompt", len, ntok, ndest, MC_ENGINE_MAX_MSG);
  uint8_t *buf = malloc(len);
  if (!buf)
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  kv_waiter_t *w;
  int wr = kv_waiter_add(kv, producer, &kv->stats.recvs, "recv_kv", &w, err);
  if (wr < 0) {
    free(buf);
    return wr;
  }
  q.id = w->id;
  long erc = kv_msg_req_encode(&q, buf, len, err); /* checked above: cannot fail */
  if (erc < 0) {
    pthread_mutex_lock(&kv->mu);
    kv_waiter_unlink_locked(kv, w);
    pthread_cond_broadcast(&kv->wait_cv);
    pthread_mutex_unlock(&kv->mu);
    free(buf);
    free(w);
    return erc;
  }

  uint64_t deadline = mc_now_ns() + (uint64_t)timeout_ms * 1000000ull;
  long rc = kv_ask_locked(kv, w, producer, buf, len, timeout_ms, deadline, "recv_kv", err);
  free(buf);
  if (rc < 0)
    kv->stats.recv_errors++;
  else if (rc > 0) {
    kv->stats.recv_hits++;
    kv->stats.recv_tokens += (uint64_t)rc;
  }
  pthread_mutex_unlock(&kv->mu);
  free(w);
  return rc;
}

/* *out = a new waiter for an answer from producer, linked in; counts the
 * call in *counter.  Returns 0, or MC_ENOMEM / MC_ECLOSED (shutting down). */
int kv_waiter_add(mc_kv_t *kv, const char *producer, uint64_t *counter, const char *what,
                  kv_waiter_t **out, mc_err_t *err) {
  kv_waiter_t *w = *out = calloc(1, sizeof *w);
  if (!w)
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  snprintf(w->producer, sizeof w->producer, "%s", producer);
  pthread_mutex_lock(&kv->mu);
  if (kv->stopping) {
    pthread_mutex_unlock(&kv->mu);
    free(w);
    *out = NULL;
    return mc_err_set(err, MC_ECLOSED, "%s: shutting down", what);
  }
  w->id = ++kv->next_id;
  w->next = kv->waiters;
  kv->waiters = w;
  (*counter)++;
  pthread_mutex_unlock(&kv->mu);
  return 0;
}

void kv_waiter_unlink_locked(mc_kv_t *kv, kv_waiter_t *w) {
  for (kv_waiter_t **pp = &kv->waiters; *pp; pp = &(*pp)->next) {
    if (*pp == w) {
      *pp = w->next;
      break;
    }
  }
}

kv_waiter_t *kv_waiter_find_locked(mc_kv_t *kv, uint64_t id, const char *from) {
  for (kv_waiter_t *w = kv->waiters; w; w = w->next)
    if (w->id == id && !w->done && !strcmp(w->producer, from))
      return w;
  return NULL;
}

void kv_waiter_set_text(kv_waiter_t *w, const char *text, size_t len) {
  if (len >= sizeof w->msg)
    len = sizeof w->msg - 1;
  memcpy(w->msg, text, len);
  w->msg[len] = '\0';
}
