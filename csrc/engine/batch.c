/* Batches: tasks, completion accounting, the local regions a batch pins,
 * waiting with timeouts, cancellation. */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"
#include "util/clock.h"
#include "util/log.h"


mc_batch_t *mc_batch_new(mc_engine_t *e, size_t capacity) {
  if (capacity == 0)
    capacity = 1;
  mc_batch_t *b = calloc(1, sizeof *b);
  if (!b)
    return NULL;
  /* Not zeroed: tasks are initialised as requests are submitted (a large
   * batch's pages are then first touched chunk by chunk, while earlier
   * chunks are already moving). */
  b->tasks = malloc(capacity * sizeof *b->tasks);
  if (!b->tasks) {
    free(b);
    return NULL;
  }
  b->cap = capacity;
  b->eng = e;
  b->pins = b->pins_s;
  b->cap_pins = sizeof b->pins_s / sizeof b->pins_s[0];
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&b->cv, &ca);
  pthread_condattr_destroy(&ca);
  pthread_mutex_init(&b->mu, NULL);
  return b;
}

size_t mc_batch_size(mc_batch_t *b) {
  pthread_mutex_lock(&b->mu);
  size_t n = b->n;
  pthread_mutex_unlock(&b->mu);
  return n;
}

size_t mc_batch_pending(mc_batch_t *b) {
  if (b->gpu) /* a status poll sees a directly launched copy finish (gpu_staging.h) */
    mc_gpu_stager_reap(b->eng->gpu);
  pthread_mutex_lock(&b->mu);
  size_t n = b->pending;
  pthread_mutex_unlock(&b->mu);
  return n;
}

int mc_batch_wait_idle(mc_batch_t *b, uint64_t timeout_ns) {
  uint64_t deadline = mc_now_ns() + timeout_ns;
  for (;;) {
    if (b->gpu) /* a directly launched copy is seen finished by a poll */
      mc_gpu_stager_reap(b->eng->gpu);
    pthread_mutex_lock(&b->mu);
    uint64_t now = mc_now_ns(), until = deadline;
    if (b->gpu && deadline > now + 1000000ull)
      until = now + 1000000ull;
    while (b->pending > 0 && mc_now_ns() < until) {
      struct timespec ts = mc_deadline_ts(until);
      pthread_cond_timedwait(&b->cv, &b->mu, &ts);
    }
    int idle = b->pending == 0;
    pthread_mutex_unlock(&b->mu);
    if (idle || mc_now_ns() >= deadline)
      return idle;
  }
}

static mc_task_state_t state_for(int code) {
  if (code == 0)
    return MC_TASK_COMPLETED;
  if (code == MC_ECANCELED)
    return MC_TASK_CANCELED;
  if (code == MC_ETIMEDOUT)
    return MC_TASK_TIMEOUT;
  return MC_TASK_FAILED;
}

/* A batch carrying a notification went idle (caller holds b->mu): every
 * task completed (none has a failure message) -> the gate's notifier
 * sends it; else it is dropped. */
static void notify_if_completed(mc_batch_t *b) {
  mc_gate_msg_t *m = b->notify;
  b->notify = NULL;
  int ok = !b->any_msg && b->n > 0;
  for (size_t i = 0; ok && i < b->n; i++)
    ok = b->tasks[i].state == MC_TASK_COMPLETED;
  if (ok)
    mc_gate_post(b->eng, m);
  else
    free(m);
}

/* Records one finished part of task i; 1 if that finished the task (the
 * caller then takes it off `pending`).  Caller holds b->mu. */
static int task_part_done(mc_batch_t *b, size_t i, int code, const char *msg, uint64_t bytes) {
  mc_task_t *t = &b->tasks[i];
  if (code == 0) {
    t->done_bytes += bytes;
  } else if (t->code == 0) {
    t->code = code;
    free(t->msg);
    t->msg = strdup(msg && *msg ? msg : mc_strerror(code));
    b->any_msg = 1;
  }
  if (t->parts_left > 0 && --t->parts_left == 0) {
    t->state = state_for(t->code);
    return 1;
  }
  return 0;
}

/* n tasks finished: off `pending` in one step (a waiter spins on it: one
 * write to its cache line per op, not one per task).  Caller holds b->mu. */
static void tasks_finished(mc_batch_t *b, size_t n) {
  if (n && atomic_fetch_sub(&b->pending, n) == n && b->notify)
    notify_if_completed(b);
}

/* Records one finished part of task i. Caller holds b->mu. */
#define part_done mc_batch_part_done
void mc_batch_part_done(mc_batch_t *b, size_t i, int code, const char *msg, uint64_t bytes) {
  tasks_finished(b, (size_t)task_part_done(b, i, code, msg, bytes));
}

/* ---- local pins ----
 * A region holding a local buffer of a batch is pinned (its refs) from the
 * submit until no op of the batch is in flight: unregister waits for it (or
 * cancels the batch, mc_engine_cancel_local_users), so no transport writes
 * into (or sends from) memory that was unregistered and freed. */
/* Releases the batch's pins if it is idle (caller holds b->mu; lock order
 * b->mu, then the regions lock).  The array stays for the next submit. */
static void pins_release_if_idle(mc_batch_t *b) {
  if (b->npins && b->ops_inflight == 0 && b->submitting == 0) {
    for (size_t i = 0; i < b->npins; i++)
      mc_regions_release(&b->eng->regions, b->pins[i]);
    b->npins = 0;
  }
}

void mc_batch_pin_list_add(mc_engine_t *e, mc_batch_t *b) {
  pthread_mutex_lock(&e->pin_mu);
  if (!b->on_pin_list) {
    b->on_pin_list = 1;
    b->pin_prev = NULL;
    b->pin_next = e->pin_head;
    if (e->pin_head)
      e->pin_head->pin_prev = b;
    e->pin_head = b;
  }
  pthread_mutex_unlock(&e->pin_mu);
}

static void pin_list_remove(mc_engine_t *e, mc_batch_t *b) {
  pthread_mutex_lock(&e->pin_mu);
  if (b->on_pin_list) {
    if (b->pin_prev)
      b->pin_prev->pin_next = b->pin_next;
    else
      e->pin_head = b->pin_next;
    if (b->pin_next)
      b->pin_next->pin_prev = b->pin_prev;
    b->on_pin_list = 0;
  }
  pthread_mutex_unlock(&e->pin_mu);
}

void mc_batch_pin_end(mc_batch_t *b) {
  pthread_mutex_lock(&b->mu);
  b->submitting--;
  pins_release_if_idle(b);
  pthread_mutex_unlock(&b->mu);
}

size_t mc_engine_cancel_local_users(mc_engine_t *e, const mc_region_t *reg) {
  size_t n = 0;
  pthread_mutex_lock(&e->pin_mu);
  for (mc_batch_t *b = e->pin_head; b; b = b->pin_next) {
    pthread_mutex_lock(&b->mu);
    for (size_t k = 0; k < b->npins; k++) {
      if (b->pins[k] == reg) {
        atomic_store(&b->cancel, 1);
        n++;
        break;
      }
    }
    pthread_mutex_unlock(&b->mu);
  }
  pthread_mutex_unlock(&e->pin_mu);
  if (n)
    mc_transports_cancel_sweep(e);
  return n;
}

void mc_batch_op_done(mc_xfer_op_t *op, int code, const char *msg) {
  mc_batch_t *b = op->arg;
  pthread_mutex_lock(&b->mu);
  size_t fin = 0;
  for (uint32_t k = 0; k < op->nent; k++)
    fin += (size_t)task_part_done(b, op->ent[k].cookie, code, msg, op->ent[k].len);
  tasks_finished(b, fin);
  b->ops_inflight--;
  pins_release_if_idle(b);
  pthread_cond_broadcast(&b->cv);
  pthread_mutex_unlock(&b->mu);
}

void mc_batch_op_entry_failed(mc_xfer_op_t *op, uint32_t idx, int code, const char *msg) {
  mc_batch_t *b = op->arg;
  pthread_mutex_lock(&b->mu);
  part_done(b, op->ent[idx].cookie, code, msg, 0);
  pthread_cond_broadcast(&b->cv);
  pthread_mutex_unlock(&b->mu);
}

void mc_batch_gate_hold(mc_batch_t *b, mc_gate_msg_t *m) {
  pthread_mutex_lock(&b->mu);
  b->gate_hold = 1;
  b->notify = m;
  b->pending++;
  b->ops_inflight++;
  pthread_mutex_unlock(&b->mu);
}

void mc_batch_gate_release(mc_batch_t *b, const mc_request_t *reqs, size_t n, int rc,
                           const char *msg) {
  pthread_mutex_lock(&b->mu);
  if (rc < 0) { /* the requests not submitted end failed, with the reason */
    for (size_t i = b->n; i < n && i < b->cap; i++) {
      b->tasks[i] = (mc_task_t){.req = reqs[i], .state = state_for(rc), .code = rc,
                                .msg = strdup(msg && *msg ? msg : mc_strerror(rc))};
      b->bytes += reqs[i].len;
    }
    if (b->n < n) {
      b->n = n < b->cap ? n : b->cap;
      b->any_msg = 1;
    }
  }
  b->gate_hold = 0;
  b->ops_inflight--;
  b->pending--;
  if (b->pending == 0 && b->notify)
    notify_if_completed(b);
  pins_release_if_idle(b);
  pthread_cond_broadcast(&b->cv);
  pthread_mutex_unlock(&b->mu);
}

int mc_batch_finished(void *arg) {
  mc_batch_t *b = arg;
  return atomic_load_explicit(&b->pending, memory_order_acquire) == 0;
}


static int batch_busy(const void *arg) { return ((const mc_batch_t *)arg)->ops_inflight > 0; }

/* Cancels what is left and waits until no transport holds the batch. */
static void cancel_and_drain(mc_engine_t *e, mc_batch_t *b) {
  atomic_store(&b->cancel, 1);
  mc_transports_drain(e, &b->mu, &b->cv, batch_busy, b);
}

int mc_batch_wait(mc_engine_t *e, mc_batch_t *b, int64_t timeout_ms, mc_err_t *err) {
  /* Small transfers finish within microseconds: spinning briefly saves the
   * wake-up of a sleeping thread, which dominates round trips on VMs. */
  if (e->spin_ns) {
    uint64_t until = mc_now_ns() + e->spin_ns;
    while (atomic_load_explicit(&b->pending, memory_order_acquire) > 0 && mc_now_ns() < until)
      if (!b->gpu || !mc_gpu_stager_reap(e->gpu))
        __builtin_ia32_pause();
  }
  if (b->gpu) {
    /* Same-host GPU copies finish within milliseconds: yield-poll for a
     * while rather than pay a sleeping thread's wake-up; a copy the
     * submitting thread launched itself is seen finished here, not by
     * the copy worker (no hop between threads). */
    uint64_t until = mc_now_ns() + 20000000ull;
    while (atomic_load_explicit(&b->pending, memory_order_acquire) > 0 && mc_now_ns() < until)
      if (!mc_gpu_stager_reap(e->gpu))
        sched_yield();
    if (e->gpu_trace)
      mc_log_info("gpu trace: wait: %zu pending at %.1f us", mc_batch_pending(b),
                  mc_trace_us(mc_now_ns()));
  }
  pthread_mutex_lock(&b->mu);
  uint64_t tmo_ns = timeout_ms >= 0 ? (uint64_t)timeout_ms * 1000000ull
                                    : e->timeout_ms * 1000000ull + b->bytes;
  uint64_t deadline = mc_now_ns() + tmo_ns;
  int timed_out = 0;
  while (b->pending > 0) {
    struct timespec ts = mc_deadline_ts(deadline);
    if (pthread_cond_timedwait(&b->cv, &b->mu, &ts) != 0 && mc_now_ns() >= deadline) {
      timed_out = b->pending > 0;
      break;
    }
  }
  pthread_mutex_unlock(&b->mu);
  if (timed_out) {
    cancel_and_drain(e, b);
    pthread_mutex_lock(&b->mu);
    for (size_t i = 0; i < b->n; i++) {
      mc_task_t *t = &b->tasks[i];
      if (t->state == MC_TASK_CANCELED || t->state == MC_TASK_PENDING) {
        if (t->state == MC_TASK_PENDING) /* local parts cannot stay pending */
          b->pending--;
        t->state = MC_TASK_TIMEOUT;
        t->code = MC_ETIMEDOUT;
        free(t->msg);
        char m[MC_ERR_MSG_MAX];
        snprintf(m, sizeof m,
                 "%s of %llu bytes to segment %s timed out after %llu ms (%llu bytes confirmed)",
                 t->req.opcode == MC_OP_WRITE ? "WRITE" : "READ",
                 (unsigned long long)t->req.len, b->last_segment,
                 (unsigned long long)(tmo_ns / 1000000ull), (unsigned long long)t->done_bytes);
        t->msg = strdup(m);
        b->any_msg = 1;
      }
    }
    pthread_mutex_unlock(&b->mu);
  }
  pthread_mutex_lock(&b->mu);
  int rc = 0;
  /* Every task finished (pending 0): one that did not complete has a
   * message.  Without any, nothing to scan. */
  for (size_t i = 0; (b->any_msg || b->pending) && i < b->n; i++) {
    mc_task_t *t = &b->tasks[i];
    if (t->state != MC_TASK_COMPLETED) {
      rc = mc_err_set(err, t->code ? t->code : MC_EPROTO, "request %zu of %zu: %s", i, b->n,
                      t->msg ? t->msg : mc_strerror(t->code));
      break;
    }
  }
  pthread_mutex_unlock(&b->mu);
  return rc;
}

int mc_batch_status(mc_batch_t *b, size_t i, mc_task_status_t *out) {
  pthread_mutex_lock(&b->mu);
  if (i >= b->n) {
    pthread_mutex_unlock(&b->mu);
    return MC_EINVAL;
  }
  mc_task_t *t = &b->tasks[i];
  out->state = t->state;
  out->code = t->code;
  out->transferred = t->done_bytes;
  snprintf(out->msg, sizeof out->msg, "%s", t->msg ? t->msg : "");
  pthread_mutex_unlock(&b->mu);
  return 0;
}

void mc_batch_free(mc_engine_t *e, mc_batch_t *b) {
  if (!b)
    return;
  pthread_mutex_lock(&b->mu);
  int busy = b->ops_inflight > 0;
  pthread_mutex_unlock(&b->mu);
  if (busy)
    cancel_and_drain(e, b);
  pin_list_remove(e, b);
  pthread_mutex_lock(&b->mu);
  pins_release_if_idle(b); /* idle now: nothing is in flight */
  pthread_mutex_unlock(&b->mu);
  if (b->pins != b->pins_s)
    free(b->pins);
  free(b->notify); /* never completed */
  for (size_t i = 0; b->any_msg && i < b->n; i++)
    free(b->tasks[i].msg);
  free(b->tasks);
  pthread_cond_destroy(&b->cv);
  pthread_mutex_destroy(&b->mu);
  free(b);
}
