/* Gated write batches: a batch whose requests are handed to their
 * transport only once a CUDA event completed (the sources are written by
 * kernels still queued on a stream when the batch is submitted), and an
 * optional notification the engine sends to the target once every request
 * of the batch completed.  Two engine threads, started at the first gated
 * submit: the gate thread waits for the events in submission order, asleep
 * in the driver (cuEventSynchronize; blocking-sync events sleep, others
 * spin in the driver), and submits each batch (a batch queued without an
 * event, on_gate_thread, is submitted as soon as its turn comes: host
 * memory whose copy the same-host CPU path makes inside the submit, taken
 * off the caller's thread); the notifier thread sends
 * the notifications of batches that completed (mc_engine_notify_detached,
 * so no I/O or copy thread ever sends or waits).  A batch waiting for its
 * event holds one pseudo-request (pending) and one pseudo-op (in flight):
 * status polls see it running and a cancel (a wait's timeout, a free)
 * drains it like any op (mc_gate_sweep from the transports' cancel sweep).
 * A gated note (mc_engine_notify_gated) is an entry with a message and no
 * batch: in its FIFO turn, once its event (if any) completed, the message
 * goes to the notifier thread; its event failing, the engine stopping or
 * its send_by passing drop it (counted gate_notes_dropped, logged). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/engine_internal.h"
#include "gpu/cuda_driver.h"
#include "util/clock.h"
#include "util/log.h"

typedef struct gate_ent {
  struct gate_ent *next;
  mc_batch_t *b; /* NULL once a cancel let the batch go (gate mu) */
  mc_engine_t *e;
  char segment[320];
  mc_request_t *reqs;
  size_t n;
  uint64_t event;
  int dev;
  int64_t submit_by_ns; /* mc_gate_opts_t.submit_by_ns; a note's send_by_ns */
  mc_gate_msg_t *note;  /* a gated note (b NULL): posted in its turn */
} gate_ent_t;

struct mc_gate_msg {
  struct mc_gate_msg *next;
  const char *what; /* for the log: what the message tells */
  char segment[320];
  int64_t timeout_ms;
  size_t len;
  char msg[];
};

struct mc_gate {
  mc_engine_t *e;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  gate_ent_t *head, *tail;
  size_t n;                 /* queued + the one waited for */
  gate_ent_t *cur;          /* its event is being waited for (mu) */
  gate_ent_t *dispatching;  /* being submitted: a sweep leaves it to the submit */
  int stop;
  /* completed batches' notifications (nmu: taken under a batch's mu) */
  pthread_mutex_t nmu;
  pthread_cond_t ncv;
  mc_gate_msg_t *mhead, *mtail;
  uint64_t sent, failed_events, host, dropped; /* stats (nmu / mu / mu / mu) */
  pthread_t thr, nthr;
  int started;
};

static void post(mc_gate_t *gt, mc_gate_msg_t *m);

static void ent_free(gate_ent_t *g) {
  if (g) {
    free(g->reqs);
    free(g->note);
    free(g);
  }
}

/* Waits (asleep in the driver for a blocking-sync event) until the event
 * completed; 0 or <0 with err naming the driver's error. */
static int wait_event(const gate_ent_t *g, int *dev_set, mc_err_t *err) {
  const mc_cuda_api_t *api = mc_cuda_api(err);
  if (!api)
    return err->code;
  if (*dev_set != g->dev) { /* the event's context current on this thread */
    int rc = mc_cuda_use_device(g->dev, err);
    if (rc < 0)
      return rc;
    *dev_set = g->dev;
  }
  mc_cu_event ev = (mc_cu_event)(uintptr_t)g->event;
  mc_cu_result r = 1;
  if (g->e->wake_spin_ns) { /* MC_WAKE_SPIN_US: look before sleeping in the driver */
    uint64_t until = mc_now_ns() + g->e->wake_spin_ns;
    while ((r = api->cuEventQuery(ev)) == MC_CU_ERROR_NOT_READY && mc_now_ns() < until)
      mc_cpu_relax();
  }
  if (r != 0) /* not complete yet, or an error the synchronize names */
    r = api->cuEventSynchronize(ev);
  if (r != 0) {
    char buf[160];
    return mc_err_set(err, MC_ESYS, "its CUDA event failed: %s",
                      mc_cuda_strerror(api, r, buf, sizeof buf));
  }
  return 0;
}

/* The event completed (rc 0) or failed: submit the batch, or fail its
 * requests; then the gate's hold on it goes. */
static void dispatch(mc_gate_t *gt, gate_ent_t *g, int rc, const mc_err_t *ev_err) {
  mc_batch_t *b = g->b;
  mc_err_t err = {0};
  if (rc < 0) {
    err = *ev_err;
  } else if (atomic_load(&b->cancel)) {
    rc = mc_err_set(&err, MC_ECANCELED, "canceled before its CUDA event completed");
  } else if (g->submit_by_ns && mc_wall_ns() > g->submit_by_ns) {
    rc = mc_err_set(&err, MC_ETIMEDOUT, "its time to be written ended (%.3f s ago) before the "
                    "gate thread could submit it: nothing written",
                    (double)(mc_wall_ns() - g->submit_by_ns) * 1e-9);
  } else {
    rc = mc_batch_submit(gt->e, b, g->segment, g->reqs, g->n, &err);
  }
  /* Canceled while it was being submitted: its ops may have missed the
   * canceler's sweep.  Read before the release: the batch may be freed
   * as soon as the gate lets go of it. */
  int sweep = rc == 0 && atomic_load(&b->cancel);
  mc_batch_gate_release(b, g->reqs, g->n, rc, rc < 0 ? err.msg : NULL);
  if (sweep)
    mc_transports_cancel_sweep(gt->e);
}

/* A gated note's turn (gate mu not held): posted to the notifier, or
 * dropped when its event failed (rc < 0), the engine stops or its
 * send_by passed. */
static void note_turn(mc_gate_t *gt, gate_ent_t *g, int rc, const mc_err_t *ev_err) {
  mc_gate_msg_t *m = g->note;
  const char *why = rc < 0 ? ev_err->msg : NULL;
  if (!why && g->submit_by_ns && mc_wall_ns() > g->submit_by_ns)
    why = "its time to be sent ended before its turn";
  pthread_mutex_lock(&gt->mu);
  if (!why && gt->stop)
    why = "the engine stops";
  if (why)
    gt->dropped++;
  pthread_mutex_unlock(&gt->mu);
  if (why) {
    mc_log_warn("gated notification to %s dropped: %s", m->segment, why);
    return; /* ent_free frees it */
  }
  g->note = NULL;
  post(gt, m); /* not mc_gate_post: a destroy clears e->gate first */
}

static int gate_ready(const mc_gate_t *gt) { return gt->head || gt->stop; }
static int notifier_ready(const mc_gate_t *gt) { return gt->mhead || gt->stop; }

/* MC_WAKE_SPIN_US: called with mu held and nothing to do; lets mu go and
 * looks again (taking it briefly) until ready(gt) or the engine's
 * wake_spin_ns passed, then returns with mu held: work that comes within
 * that time is taken without a wake-up (tens of microseconds on a VM). */
static void spin_unlocked(const mc_gate_t *gt, pthread_mutex_t *mu,
                          int (*ready)(const mc_gate_t *)) {
  uint64_t until = mc_now_ns() + gt->e->wake_spin_ns;
  for (;;) {
    pthread_mutex_unlock(mu);
    mc_cpu_relax();
    pthread_mutex_lock(mu);
    if (ready(gt) || mc_now_ns() >= until)
      return;
  }
}

static void *gate_main(void *arg) {
  mc_gate_t *gt = arg;
  int dev_set = -1;
  pthread_mutex_lock(&gt->mu);
  for (;;) {
    if (!gt->stop && !gt->head && gt->e->wake_spin_ns) /* MC_WAKE_SPIN_US */
      spin_unlocked(gt, &gt->mu, gate_ready);
    while (!gt->stop && !gt->head)
      pthread_cond_wait(&gt->cv, &gt->mu);
    if (gt->stop)
      break;
    gate_ent_t *g = gt->head;
    gt->head = g->next;
    if (!gt->head)
      gt->tail = NULL;
    gt->cur = g;
    pthread_mutex_unlock(&gt->mu);
    mc_err_t err = {0};
    int rc = g->event ? wait_event(g, &dev_set, &err) : 0;
    pthread_mutex_lock(&gt->mu);
    gt->cur = NULL;
    if (rc < 0)
      gt->failed_events++;
    if (g->note) {
      pthread_mutex_unlock(&gt->mu);
      note_turn(gt, g, rc, &err);
      pthread_mutex_lock(&gt->mu);
    } else if (g->b && !gt->stop) {
      if (!g->event)
        gt->host++;
      gt->dispatching = g;
      pthread_mutex_unlock(&gt->mu);
      dispatch(gt, g, rc, &err);
      pthread_mutex_lock(&gt->mu);
      gt->dispatching = NULL;
    }
    gt->n--;
    pthread_cond_broadcast(&gt->cv); /* a sweep waiting for the submit */
    ent_free(g);
  }
  pthread_mutex_unlock(&gt->mu);
  return NULL;
}

static void *notifier_main(void *arg) {
  mc_gate_t *gt = arg;
  pthread_mutex_lock(&gt->nmu);
  for (;;) {
    if (!gt->stop && !gt->mhead && gt->e->wake_spin_ns) /* MC_WAKE_SPIN_US */
      spin_unlocked(gt, &gt->nmu, notifier_ready);
    while (!gt->stop && !gt->mhead)
      pthread_cond_wait(&gt->ncv, &gt->nmu);
    if (gt->stop)
      break;
    mc_gate_msg_t *m = gt->mhead;
    gt->mhead = m->next;
    if (!gt->mhead)
      gt->mtail = NULL;
    pthread_mutex_unlock(&gt->nmu);
    mc_err_t err = {0};
    /* Detached: the receipt is the transport's business (a failure is
     * logged); back-pressure past the engine's bound waits here only. */
    int rc = mc_engine_notify_detached(gt->e, m->segment, m->msg, m->len, m->timeout_ms,
                                       m->what, &err);
    if (rc < 0)
      mc_log_warn("%s to %s not sent: %s", m->what, m->segment, err.msg);
    free(m);
    pthread_mutex_lock(&gt->nmu);
    if (rc == 0)
      gt->sent++;
  }
  pthread_mutex_unlock(&gt->nmu);
  return NULL;
}

static mc_gate_t *gate_get(mc_engine_t *e, mc_err_t *err) {
  pthread_mutex_lock(&e->gate_mu);
  mc_gate_t *gt = e->gate;
  if (!gt) {
    gt = calloc(1, sizeof *gt);
    if (!gt) {
      pthread_mutex_unlock(&e->gate_mu);
      mc_err_set(err, MC_ENOMEM, "out of memory");
      return NULL;
    }
    gt->e = e;
    pthread_mutex_init(&gt->mu, NULL);
    pthread_cond_init(&gt->cv, NULL);
    pthread_mutex_init(&gt->nmu, NULL);
    pthread_cond_init(&gt->ncv, NULL);
    if (pthread_create(&gt->thr, NULL, gate_main, gt) != 0) {
      free(gt);
      pthread_mutex_unlock(&e->gate_mu);
      mc_err_set(err, MC_ENOMEM, "cannot start the engine's gate thread");
      return NULL;
    }
    if (pthread_create(&gt->nthr, NULL, notifier_main, gt) != 0) {
      pthread_mutex_lock(&gt->mu);
      gt->stop = 1;
      pthread_cond_broadcast(&gt->cv);
      pthread_mutex_unlock(&gt->mu);
      pthread_join(gt->thr, NULL);
      free(gt);
      pthread_mutex_unlock(&e->gate_mu);
      mc_err_set(err, MC_ENOMEM, "cannot start the engine's notifier thread");
      return NULL;
    }
    pthread_setname_np(gt->thr, "mc-gate");
    pthread_setname_np(gt->nthr, "mc-gate-notify");
    gt->started = 1;
    e->gate = gt;
  }
  pthread_mutex_unlock(&e->gate_mu);
  return gt;
}

/* An entry's CUDA event (0: none) can be waited for. */
static int check_cuda(uint64_t cuda_event, int cuda_device, mc_err_t *err) {
  if (!cuda_event)
    return 0;
  if (!mc_cuda_api_if_loaded())
    return mc_err_set(err, MC_EUNAVAIL, "a CUDA event was given but the CUDA driver is not "
                      "loaded in this process; pass no event (0) for host memory");
  if (cuda_device < 0)
    return mc_err_set(err, MC_EINVAL, "cuda_device %d: give the event's device ordinal (>= 0)",
                      cuda_device);
  return 0;
}

static int check_args(mc_engine_t *e, mc_batch_t *b, const char *segment,
                      const mc_request_t *reqs, size_t n, const mc_gate_opts_t *o,
                      mc_err_t *err) {
  if (!segment || !*segment)
    return mc_err_set(err, MC_EINVAL, "target segment name is empty");
  if (n == 0)
    return mc_err_set(err, MC_EINVAL, "a gated batch needs at least one request");
  for (size_t i = 0; i < n; i++)
    if (reqs[i].opcode != MC_OP_WRITE)
      return mc_err_set(err, MC_EINVAL, "request %zu: a gated batch carries WRITEs only", i);
  pthread_mutex_lock(&b->mu);
  int used = b->n != 0 || b->gate_hold || b->notify;
  size_t cap = b->cap;
  pthread_mutex_unlock(&b->mu);
  if (used)
    return mc_err_set(err, MC_EINVAL, "the batch already has requests: a gated submit needs a "
                      "new batch");
  if (n > cap)
    return mc_err_set(err, MC_EINVAL, "batch has room for %zu requests, %zu submitted; "
                      "allocate a larger batch", cap, n);
  if (o->notify_len > MC_ENGINE_MAX_MSG)
    return mc_err_set(err, MC_ETOOBIG, "notification of %zu bytes exceeds %u", o->notify_len,
                      MC_ENGINE_MAX_MSG);
  (void)e;
  return check_cuda(o->cuda_event, o->cuda_device, err);
}

/* A message for the notifier thread (NULL: out of memory). */
static mc_gate_msg_t *msg_new(const char *segment, const void *msg, size_t len,
                              int64_t timeout_ms, const char *what) {
  mc_gate_msg_t *m = malloc(sizeof *m + (len ? len : 1));
  if (!m)
    return NULL;
  m->next = NULL;
  m->what = what;
  snprintf(m->segment, sizeof m->segment, "%s", segment);
  m->timeout_ms = timeout_ms > 0 ? timeout_ms : -1;
  m->len = len;
  if (len)
    memcpy(m->msg, msg, len);
  return m;
}

/* A new gate entry for segment with its CUDA event (0: none) and its
 * deadline (0: none); NULL when out of memory. */
static gate_ent_t *ent_new(mc_engine_t *e, const char *segment, uint64_t event, int dev,
                           int64_t by_ns) {
  gate_ent_t *g = calloc(1, sizeof *g);
  if (!g)
    return NULL;
  g->e = e;
  g->event = event;
  g->dev = dev;
  g->submit_by_ns = by_ns;
  snprintf(g->segment, sizeof g->segment, "%s", segment);
  return g;
}

/* Appends g to the gate's FIFO; a batch entry's batch is held for it
 * (with m, its notification) under gt->mu: lock order gate, batch.
 * Returns 0, or the count of entries waiting when MC_GATE_MAX already
 * wait: g is not queued then (the caller's to free). */
static size_t gate_push(mc_gate_t *gt, gate_ent_t *g, mc_gate_msg_t *m) {
  pthread_mutex_lock(&gt->mu);
  size_t q = gt->n;
  if (q < MC_GATE_MAX) {
    if (g->b)
      mc_batch_gate_hold(g->b, m);
    if (gt->tail)
      gt->tail->next = g;
    else
      gt->head = g;
    gt->tail = g;
    gt->n++;
    pthread_cond_broadcast(&gt->cv);
    q = 0;
  }
  pthread_mutex_unlock(&gt->mu);
  return q;
}

int mc_batch_submit_gated(mc_engine_t *e, mc_batch_t *b, const char *segment,
                          const mc_request_t *reqs, size_t n, const mc_gate_opts_t *o,
                          mc_err_t *err) {
  int rc = check_args(e, b, segment, reqs, n, o, err);
  if (rc < 0)
    return rc;
  mc_gate_msg_t *m = NULL;
  if (o->notify) {
    m = msg_new(segment, o->notify, o->notify_len, o->notify_timeout_ms,
                "notification of a completed write batch");
    if (!m)
      return mc_err_set(err, MC_ENOMEM, "out of memory");
  }
  if (!o->cuda_event && !o->on_gate_thread) { /* submitted here, told at completion */
    if (m && !gate_get(e, err)) {
      free(m);
      return err->code;
    }
    /* Held while submitting: a request completing before the last one is
     * queued (a transport taking the call in chunks) must not look like
     * the whole batch. */
    mc_batch_gate_hold(b, m);
    rc = mc_batch_submit(e, b, segment, reqs, n, err);
    mc_batch_gate_release(b, reqs, n, rc, rc < 0 ? err->msg : NULL);
    return rc;
  }
  mc_gate_t *gt = gate_get(e, err);
  gate_ent_t *g = gt ? ent_new(e, segment, o->cuda_event, o->cuda_device, o->submit_by_ns)
                     : NULL;
  if (g)
    g->reqs = malloc(n * sizeof *g->reqs);
  if (!g || !g->reqs) {
    ent_free(g);
    free(m);
    return gt ? mc_err_set(err, MC_ENOMEM, "out of memory") : err->code;
  }
  memcpy(g->reqs, reqs, n * sizeof *reqs);
  g->n = n;
  g->b = b;
  size_t q = gate_push(gt, g, m);
  if (q) {
    ent_free(g);
    free(m);
    return mc_err_set(err, MC_EBUSY, "%zu gated batches already wait for the engine's gate "
                      "thread (their CUDA events, or their submit; at most %d): wait for some, "
                      "or submit without an event", q, MC_GATE_MAX);
  }
  return 0;
}

static int check_note(const char *segment, const void *msg, size_t len, uint64_t cuda_event,
                      int cuda_device, mc_err_t *err) {
  if (!segment || !*segment)
    return mc_err_set(err, MC_EINVAL, "target segment name is empty");
  if (strlen(segment) >= sizeof(((mc_gate_msg_t *)0)->segment))
    return mc_err_set(err, MC_EINVAL, "target segment name is too long");
  if (!msg && len)
    return mc_err_set(err, MC_EINVAL, "no message");
  if (len > MC_ENGINE_MAX_MSG)
    return mc_err_set(err, MC_ETOOBIG, "notification of %zu bytes exceeds %u", len,
                      MC_ENGINE_MAX_MSG);
  return check_cuda(cuda_event, cuda_device, err);
}

int mc_engine_notify_gated(mc_engine_t *e, const char *segment, const void *msg, size_t len,
                           const mc_note_opts_t *o, mc_err_t *err) {
  int rc = check_note(segment, msg, len, o->cuda_event, o->cuda_device, err);
  if (rc < 0)
    return rc;
  mc_gate_t *gt = gate_get(e, err);
  if (!gt)
    return err->code;
  gate_ent_t *g = ent_new(e, segment, o->cuda_event, o->cuda_device, o->send_by_ns);
  if (g)
    g->note = msg_new(segment, msg, len, o->timeout_ms, "gated notification");
  if (!g || !g->note) {
    ent_free(g);
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  }
  size_t q = gate_push(gt, g, NULL);
  if (q) {
    ent_free(g);
    return mc_err_set(err, MC_EBUSY, "%zu entries already wait for the engine's gate thread "
                      "(at most %d): send the note another way", q, MC_GATE_MAX);
  }
  return 0;
}

/* Batches canceled while they wait for their event let go now (their
 * requests end MC_ECANCELED); one being submitted is left to the submit. */
void mc_gate_sweep(mc_engine_t *e) {
  pthread_mutex_lock(&e->gate_mu);
  mc_gate_t *gt = e->gate;
  pthread_mutex_unlock(&e->gate_mu);
  if (!gt)
    return;
  pthread_mutex_lock(&gt->mu);
  gate_ent_t **pp = &gt->head;
  while (*pp) {
    gate_ent_t *g = *pp;
    if (g->b && atomic_load(&g->b->cancel)) {
      *pp = g->next;
      if (gt->tail == g) {
        gt->tail = NULL;
        for (gate_ent_t *t = gt->head; t; t = t->next)
          gt->tail = t;
      }
      gt->n--;
      mc_batch_gate_release(g->b, g->reqs, g->n, MC_ECANCELED,
                            "canceled before its CUDA event completed");
      ent_free(g);
      continue;
    }
    pp = &g->next;
  }
  gate_ent_t *c = gt->cur;
  if (c && c->b && atomic_load(&c->b->cancel)) { /* the gate thread frees the entry */
    mc_batch_gate_release(c->b, c->reqs, c->n, MC_ECANCELED,
                          "canceled before its CUDA event completed");
    c->b = NULL;
  }
  pthread_mutex_unlock(&gt->mu);
}

/* Called under b->mu once a batch with a notification went idle. */
void mc_gate_post(mc_engine_t *e, mc_gate_msg_t *m) {
  post(e->gate, m); /* set before any batch carried a message */
}

static void post(mc_gate_t *gt, mc_gate_msg_t *m) {
  pthread_mutex_lock(&gt->nmu);
  m->next = NULL;
  if (gt->mtail)
    gt->mtail->next = m;
  else
    gt->mhead = m;
  gt->mtail = m;
  pthread_cond_signal(&gt->ncv);
  pthread_mutex_unlock(&gt->nmu);
}

void mc_gate_counts(mc_engine_t *e, uint64_t *notified, uint64_t *event_failures,
                    uint64_t *host_batches, uint64_t *notes_dropped) {
  *notified = *event_failures = *host_batches = *notes_dropped = 0;
  pthread_mutex_lock(&e->gate_mu);
  mc_gate_t *gt = e->gate;
  pthread_mutex_unlock(&e->gate_mu);
  if (!gt)
    return;
  pthread_mutex_lock(&gt->nmu);
  *notified = gt->sent;
  pthread_mutex_unlock(&gt->nmu);
  pthread_mutex_lock(&gt->mu);
  *event_failures = gt->failed_events;
  *host_batches = gt->host;
  *notes_dropped = gt->dropped;
  pthread_mutex_unlock(&gt->mu);
}

/* Engine destroy (every batch freed): the threads stop; notifications not
 * sent yet are dropped.  A gate thread still asleep on an event that never
 * completes (a hung GPU) is left running after 10 s, its state leaked. */
void mc_gate_destroy(mc_engine_t *e) {
  pthread_mutex_lock(&e->gate_mu);
  mc_gate_t *gt = e->gate;
  e->gate = NULL;
  pthread_mutex_unlock(&e->gate_mu);
  if (!gt)
    return;
  pthread_mutex_lock(&gt->mu);
  gt->stop = 1;
  pthread_cond_broadcast(&gt->cv);
  pthread_mutex_unlock(&gt->mu);
  pthread_mutex_lock(&gt->nmu);
  pthread_cond_broadcast(&gt->ncv);
  pthread_mutex_unlock(&gt->nmu);
  pthread_join(gt->nthr, NULL);
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += 10;
  if (pthread_timedjoin_np(gt->thr, NULL, &dl) != 0) {
    mc_log_warn("engine gate thread still waits for a CUDA event after 10 s; left running");
    pthread_detach(gt->thr);
    return;
  }
  while (gt->head) {
    gate_ent_t *g = gt->head;
    gt->head = g->next;
    ent_free(g);
  }
  while (gt->mhead) {
    mc_gate_msg_t *m = gt->mhead;
    gt->mhead = m->next;
    free(m);
  }
  pthread_mutex_destroy(&gt->mu);
  pthread_cond_destroy(&gt->cv);
  pthread_mutex_destroy(&gt->nmu);
  pthread_cond_destroy(&gt->ncv);
  free(gt);
}
