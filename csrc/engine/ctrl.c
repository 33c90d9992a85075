/* Control messages: notifications (sent, waited for or detached; received
 * into the handler or the bounded queue) and RPCs, over the control
 * channel (the transport with MC_TCAP_CTRL). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/engine_internal.h"
#include "util/clock.h"
#include "util/log.h"


void mc_engine_set_peer_lost_handler(mc_engine_t *e, mc_peer_lost_cb cb, void *arg) {
  pthread_rwlock_wrlock(&e->handler_lock);
  e->peer_lost_cb = cb;
  e->peer_lost_arg = arg;
  pthread_rwlock_unlock(&e->handler_lock);
}

void mc_engine_note_peer_lost(mc_engine_t *e, const char *segment) {
  if (!segment || !segment[0])
    return;
  pthread_mutex_lock(&e->notify_mu);
  size_t i = 0;
  while (i < e->nlost && strcmp(e->lost_peers[i], segment))
    i++;
  if (i == e->nlost) { /* not noted yet */
    char *name = strdup(segment);
    if (name) {
      if (e->nlost == MC_LOST_PEERS_MAX) { /* bounded: the oldest goes */
        free(e->lost_peers[0]);
        memmove(e->lost_peers, e->lost_peers + 1, (MC_LOST_PEERS_MAX - 1) * sizeof(char *));
        e->nlost--;
      }
      e->lost_peers[e->nlost++] = name;
    }
  }
  e->lost_gen++;
  pthread_cond_broadcast(&e->notify_cv);
  pthread_mutex_unlock(&e->notify_mu);
}

size_t mc_engine_take_lost_peers(mc_engine_t *e, char **out, size_t max) {
  pthread_mutex_lock(&e->notify_mu);
  size_t k = e->nlost < max ? e->nlost : max;
  memcpy(out, e->lost_peers, k * sizeof(char *));
  memmove(e->lost_peers, e->lost_peers + k, (e->nlost - k) * sizeof(char *));
  e->nlost -= k;
  pthread_mutex_unlock(&e->notify_mu);
  return k;
}

void mc_engine_set_notify_handler(mc_engine_t *e, mc_notify_handler_fn cb, void *arg) {
  /* The write lock waits for a handler call in flight to return, so the
   * old handler's state may be freed once this returns. */
  pthread_rwlock_wrlock(&e->handler_lock);
  e->notify_cb = cb;
  e->notify_arg = arg;
  pthread_rwlock_unlock(&e->handler_lock);
}

int mc_engine_on_notify(void *ctx, const char *from, const void *msg, size_t len,
                        mc_err_t *err) {
  mc_engine_t *e = ctx;
  pthread_rwlock_rdlock(&e->handler_lock);
  if (e->notify_cb) {
    int rc = e->notify_cb(e->notify_arg, from ? from : "", msg, len, err);
    pthread_rwlock_unlock(&e->handler_lock);
    return rc;
  }
  pthread_rwlock_unlock(&e->handler_lock);
  return mc_engine_queue_notify(e, from, msg, len, err);
}

#define NOTIFY_MAX_MSGS 65536

/* What one queued message costs (its copy, the sender's name, the node). */
static uint64_t notify_cost(const char *from, size_t len) {
  return (uint64_t)len + 1 + strlen(from) + 1 + sizeof(mc_notify_msg_t);
}

int mc_engine_queue_notify(mc_engine_t *e, const char *from, const void *msg, size_t len,
                           mc_err_t *err) {
  from = from ? from : "";
  uint64_t cost = notify_cost(from, len);
  /* Refuse before copying: the budget bounds what unread messages hold. */
  pthread_mutex_lock(&e->notify_mu);
  if (e->notify_count >= NOTIFY_MAX_MSGS || e->notify_bytes + cost > e->notify_limit) {
    uint64_t used = e->notify_bytes;
    size_t cnt = e->notify_count;
    e->notify_refused++;
    pthread_mutex_unlock(&e->notify_mu);
    return mc_err_set(err, MC_EBUSY,
                      "segment %s has %zu unread notifications (%llu bytes; budget %llu "
                      "bytes, MC_NOTIFY_QUEUE_MB, and %d messages): refused a %zu-byte "
                      "notification; the receiver must call get_notifies()",
                      e->name, cnt, (unsigned long long)used,
                      (unsigned long long)e->notify_limit, NOTIFY_MAX_MSGS, len);
  }
  e->notify_bytes += cost; /* reserved; given back below on failure */
  e->notify_count++;
  pthread_mutex_unlock(&e->notify_mu);
  mc_notify_msg_t *n = calloc(1, sizeof *n);
  if (n) {
    n->from = strdup(from);
    n->msg = malloc(len + 1);
  }
  if (!n || !n->from || !n->msg) {
    if (n) {
      free(n->from);
      free(n->msg);
      free(n);
    }
    pthread_mutex_lock(&e->notify_mu);
    e->notify_bytes -= cost;
    e->notify_count--;
    pthread_mutex_unlock(&e->notify_mu);
    return mc_err_set(err, MC_ENOMEM, "out of memory queueing a notification");
  }
  memcpy(n->msg, msg, len);
  n->msg[len] = '\0';
  n->len = len;
  pthread_mutex_lock(&e->notify_mu);
  if (e->notify_tail)
    e->notify_tail->next = n;
  else
    e->notify_head = n;
  e->notify_tail = n;
  pthread_cond_broadcast(&e->notify_cv);
  pthread_mutex_unlock(&e->notify_mu);
  return 0;
}

int mc_engine_wait_notifies(mc_engine_t *e, int64_t timeout_us) {
  struct timespec dl;
  clock_gettime(CLOCK_MONOTONIC, &dl);
  if (timeout_us < 0)
    timeout_us = 0;
  dl.tv_sec += (time_t)(timeout_us / 1000000);
  dl.tv_nsec += (long)(timeout_us % 1000000) * 1000L;
  if (dl.tv_nsec >= 1000000000L) {
    dl.tv_sec++;
    dl.tv_nsec -= 1000000000L;
  }
  /* MC_WAKE_SPIN_US: look (under the lock, briefly) before sleeping, so a
   * notification that comes soon is taken without a wake-up. */
  uint64_t spin = e->wake_spin_ns < (uint64_t)timeout_us * 1000u ? e->wake_spin_ns
                                                                  : (uint64_t)timeout_us * 1000u;
  if (spin) {
    uint64_t until = mc_now_ns() + spin;
    for (;;) {
      pthread_mutex_lock(&e->notify_mu);
      int ready = e->notify_head || e->lost_gen != e->lost_woken || e->notify_waiters_woken;
      pthread_mutex_unlock(&e->notify_mu);
      if (ready || mc_now_ns() >= until)
        break;
      mc_cpu_relax();
    }
  }
  pthread_mutex_lock(&e->notify_mu);
  /* A loss wakes a waiter once (lost_woken), not until the names are taken:
   * a caller that never takes them must not spin. */
  while (!e->notify_head && e->lost_gen == e->lost_woken && !e->notify_waiters_woken) {
    if (pthread_cond_timedwait(&e->notify_cv, &e->notify_mu, &dl) == ETIMEDOUT)
      break;
  }
  int have = e->notify_head != NULL || e->lost_gen != e->lost_woken;
  e->lost_woken = e->lost_gen;
  pthread_mutex_unlock(&e->notify_mu);
  return have;
}

int mc_engine_notifies_pending(mc_engine_t *e) {
  pthread_mutex_lock(&e->notify_mu);
  int have = e->notify_head != NULL || e->nlost > 0;
  pthread_mutex_unlock(&e->notify_mu);
  return have;
}

void mc_engine_wake_notify_waiters(mc_engine_t *e) {
  pthread_mutex_lock(&e->notify_mu);
  e->notify_waiters_woken = 1;
  pthread_cond_broadcast(&e->notify_cv);
  pthread_mutex_unlock(&e->notify_mu);
}

size_t mc_engine_drain_notifies(mc_engine_t *e, size_t max, mc_notify_cb cb, void *arg) {
  size_t k = 0;
  while (k < max) {
    pthread_mutex_lock(&e->notify_mu);
    mc_notify_msg_t *n = e->notify_head;
    if (n) {
      e->notify_head = n->next;
      if (!e->notify_head)
        e->notify_tail = NULL;
      e->notify_count--;
      e->notify_bytes -= notify_cost(n->from, n->len);
    }
    pthread_mutex_unlock(&e->notify_mu);
    if (!n)
      break;
    cb(arg, n->from, n->msg, n->len);
    free(n->from);
    free(n->msg);
    free(n);
    k++;
  }
  return k;
}

/* ---- control messages: one op each, no batch ---- */

/* One NOTIFY or RPC in flight: what its done() reports. */
struct mc_ctrl {
  pthread_mutex_t mu;
  pthread_cond_t cv;      /* CLOCK_MONOTONIC */
  atomic_int finished;    /* the op's done() ran */
  atomic_int cancel;      /* the op's cancel flag */
  int code;               /* 0 or the failure */
  char *msg;              /* the failure's text (malloc'ed) */
  char *reply;            /* an RPC's reply (malloc'ed) */
  size_t len;             /* the message's bytes */
  char segment[320];      /* where it goes */
  /* mc_engine_notify_detached: owned by the engine's list (det_*). */
  mc_ctrl_t *det_next;
  uint64_t det_deadline_ns;
  const char *det_what;
};

static void ctrl_free(mc_ctrl_t *c) {
  if (!c)
    return;
  free(c->msg);
  free(c->reply);
  pthread_cond_destroy(&c->cv);
  pthread_mutex_destroy(&c->mu);
  free(c);
}

static void ctrl_done(mc_xfer_op_t *op, int code, const char *msg) {
  mc_ctrl_t *c = op->arg;
  pthread_mutex_lock(&c->mu);
  if (op->type == MC_XFER_RPC) { /* the reply text is moved out before the op is freed */
    free(c->reply);
    c->reply = op->resp;
    op->resp = NULL;
  }
  if (code && !c->code) {
    c->code = code;
    c->msg = strdup(msg && *msg ? msg : mc_strerror(code));
  }
  atomic_store_explicit(&c->finished, 1, memory_order_release);
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
}

/* Builds one control message (NOTIFY or RPC) to a segment: *cp and *opp to
 * hand to ctrl_submit.  The op's done is `done`. */
static int ctrl_prepare(mc_engine_t *e, const char *segment, int type, const void *msg,
                        size_t len, mc_xfer_done_fn done, mc_segment_desc_t *d,
                        mc_ctrl_t **cp, mc_xfer_op_t **opp, mc_err_t *err) {
  if (len > MC_XFER_MAX_CTRL)
    return mc_err_set(err, MC_ETOOBIG, "%s of %zu bytes exceeds %u",
                      type == MC_XFER_RPC ? "RPC" : "notification", len, MC_XFER_MAX_CTRL);
  if (!segment || !*segment)
    return mc_err_set(err, MC_EINVAL, "target segment name is empty");
  int rc = mc_engine_resolve(e, segment, d, err);
  if (rc < 0)
    return rc;
  mc_ctrl_t *c = calloc(1, sizeof *c);
  mc_xfer_op_t *op = mc_xfer_op_new(type, 0, len);
  if (!c || !op) {
    free(c);
    mc_xfer_op_free(op);
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  }
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&c->cv, &ca);
  pthread_condattr_destroy(&ca);
  pthread_mutex_init(&c->mu, NULL);
  c->len = len;
  snprintf(c->segment, sizeof c->segment, "%s", segment);
  if (len)
    memcpy(op->ctrl, msg, len);
  op->done = done;
  op->arg = c;
  op->cancel = &c->cancel;
  if ((rc = mc_xfer_op_seal(op, err)) < 0) {
    mc_xfer_op_free(op);
    ctrl_free(c);
    return rc;
  }
  *cp = c;
  *opp = op;
  return 0;
}

void mc_ctrl_submit_op(mc_engine_t *e, const mc_peer_t *peer, mc_xfer_op_t *op) {
  e->tr[e->ctrl].ops->submit(e->tr[e->ctrl].impl, peer, &op, 1);
}

/* Control messages go over the control channel. */
static void ctrl_submit(mc_engine_t *e, const char *segment, const mc_segment_desc_t *d,
                        mc_xfer_op_t *op) {
  mc_peer_t peer = {.segment = segment, .host = d->host, .port = d->port};
  mc_ctrl_submit_op(e, &peer, op);
}

static int ctrl_busy(const void *arg) { return !((const mc_ctrl_t *)arg)->finished; }

/* Cancels the op and waits until the transport is done with it. */
static void ctrl_cancel_and_drain(mc_engine_t *e, mc_ctrl_t *c) {
  atomic_store(&c->cancel, 1);
  mc_transports_drain(e, &c->mu, &c->cv, ctrl_busy, c);
}

/* Waits for the op's receipt (busy-waiting MC_WAIT_SPIN_US first), up to
 * timeout_ms (<0: MC_TRANSFER_TIMEOUT); past it the op is canceled and
 * fails MC_ETIMEDOUT.  The error reads as a one-request batch's did. */
static int ctrl_wait(mc_engine_t *e, mc_ctrl_t *c, int64_t timeout_ms, mc_err_t *err) {
  if (e->spin_ns) {
    uint64_t until = mc_now_ns() + e->spin_ns;
    while (!atomic_load_explicit(&c->finished, memory_order_acquire) && mc_now_ns() < until)
      __builtin_ia32_pause();
  }
  uint64_t tmo_ns = timeout_ms >= 0 ? (uint64_t)timeout_ms * 1000000ull
                                    : e->timeout_ms * 1000000ull;
  uint64_t deadline = mc_now_ns() + tmo_ns;
  int timed_out = 0;
  pthread_mutex_lock(&c->mu);
  while (!c->finished) {
    struct timespec ts = mc_deadline_ts(deadline);
    if (pthread_cond_timedwait(&c->cv, &c->mu, &ts) != 0 && mc_now_ns() >= deadline) {
      timed_out = !c->finished;
      break;
    }
  }
  pthread_mutex_unlock(&c->mu);
  if (timed_out) {
    ctrl_cancel_and_drain(e, c);
    pthread_mutex_lock(&c->mu);
    if (c->code == MC_ECANCELED) {
      char m[MC_ERR_MSG_MAX];
      snprintf(m, sizeof m, "WRITE of %llu bytes to segment %s timed out after %llu ms (0 bytes "
               "confirmed)", (unsigned long long)c->len, c->segment,
               (unsigned long long)(tmo_ns / 1000000ull));
      free(c->msg);
      c->msg = strdup(m);
      c->code = MC_ETIMEDOUT;
    }
    pthread_mutex_unlock(&c->mu);
  }
  if (!c->code)
    return 0;
  return mc_err_set(err, c->code, "request 0 of 1: %s", c->msg ? c->msg : mc_strerror(c->code));
}

/* One control message (NOTIFY or RPC) to a segment, waited for. */
static int ctrl_call(mc_engine_t *e, const char *segment, int type, const void *msg,
                     size_t len, int64_t timeout_ms, char **reply, mc_err_t *err) {
  mc_segment_desc_t d;
  mc_ctrl_t *c;
  mc_xfer_op_t *op;
  int rc = ctrl_prepare(e, segment, type, msg, len, ctrl_done, &d, &c, &op, err);
  if (rc < 0)
    return rc;
  ctrl_submit(e, segment, &d, op);
  rc = ctrl_wait(e, c, timeout_ms, err);
  if (rc == 0 && reply) {
    pthread_mutex_lock(&c->mu);
    *reply = c->reply;
    c->reply = NULL;
    pthread_mutex_unlock(&c->mu);
    if (!*reply)
      *reply = strdup("");
    if (!*reply)
      rc = mc_err_set(err, MC_ENOMEM, "out of memory");
  }
  ctrl_free(c);
  return rc;
}

int mc_engine_notify(mc_engine_t *e, const char *segment, const void *msg, size_t len,
                     int64_t timeout_ms, mc_err_t *err) {
  return ctrl_call(e, segment, MC_XFER_NOTIFY, msg, len, timeout_ms, NULL, err);
}

/* ---- detached notifications ----
 * Each is on e->det_head, owned by the engine.  The next detached call
 * (and mc_engine_reap_detached at close, after the transports stopped)
 * frees the finished ones and cancels those past their deadline: nothing
 * waits on a receipt, and what is in flight is bounded. */

static void detached_done(mc_xfer_op_t *op, int code, const char *msg) {
  mc_ctrl_t *c = op->arg;
  if (code)
    mc_log_warn("%s to segment %s not delivered: %s", c->det_what, c->segment,
                msg && *msg ? msg : mc_strerror(code));
  ctrl_done(op, code, msg);
}

void mc_engine_reap_detached(mc_engine_t *e, int all) {
  uint64_t now = mc_now_ns();
  int sweep = 0;
  mc_ctrl_t *dead = NULL;
  pthread_mutex_lock(&e->det_mu);
  for (mc_ctrl_t **pp = &e->det_head; *pp;) {
    mc_ctrl_t *c = *pp;
    if (atomic_load_explicit(&c->finished, memory_order_acquire) || all) {
      /* all: the transports stopped, every op is done */
      *pp = c->det_next;
      e->ndet--;
      e->det_bytes -= c->len;
      c->det_next = dead;
      dead = c;
      continue;
    }
    if (now >= c->det_deadline_ns && !atomic_load(&c->cancel)) {
      atomic_store(&c->cancel, 1);
      sweep = 1;
    }
    pp = &c->det_next;
  }
  pthread_mutex_unlock(&e->det_mu);
  if (sweep && !all)
    mc_transports_cancel_sweep(e);
  while (dead) {
    mc_ctrl_t *c = dead;
    dead = c->det_next;
    /* done() may still hold c->mu right after setting finished */
    pthread_mutex_lock(&c->mu);
    pthread_mutex_unlock(&c->mu);
    ctrl_free(c);
  }
}

int mc_engine_notify_detached(mc_engine_t *e, const char *segment, const void *msg, size_t len,
                              int64_t timeout_ms, const char *what, mc_err_t *err) {
  mc_engine_reap_detached(e, 0);
  pthread_mutex_lock(&e->det_mu);
  int full = e->ndet >= MC_ENGINE_DETACHED_MAX ||
             e->det_bytes + len > MC_ENGINE_DETACHED_BYTES;
  pthread_mutex_unlock(&e->det_mu);
  if (full) /* back-pressure: this one waits for its receipt */
    return mc_engine_notify(e, segment, msg, len, timeout_ms, err);
  mc_segment_desc_t d;
  mc_ctrl_t *c;
  mc_xfer_op_t *op;
  int rc = ctrl_prepare(e, segment, MC_XFER_NOTIFY, msg, len, detached_done, &d, &c, &op, err);
  if (rc < 0)
    return rc;
  uint64_t tmo_ns = (uint64_t)(timeout_ms > 0 ? timeout_ms : (int64_t)e->timeout_ms) * 1000000ull;
  c->det_deadline_ns = mc_now_ns() + tmo_ns;
  c->det_what = what && *what ? what : "notification";
  pthread_mutex_lock(&e->det_mu);
  c->det_next = e->det_head;
  e->det_head = c;
  e->ndet++;
  e->det_bytes += len;
  pthread_mutex_unlock(&e->det_mu);
  ctrl_submit(e, segment, &d, op); /* may be done before it returns: the list owns c */
  return 0;
}

int mc_engine_rpc(mc_engine_t *e, const char *segment, const char *req, size_t len,
                  int64_t timeout_ms, char **reply, mc_err_t *err) {
  *reply = NULL;
  return ctrl_call(e, segment, MC_XFER_RPC, req, len, timeout_ms, reply, err);
}
