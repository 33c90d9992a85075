/* Gated notes (mc_engine_notify_gated, csrc/engine/gate.c): a message in
 * the gate thread's FIFO, sent by the engine's notifier once its CUDA event
 * (if any) completed; notes to a peer keep their order, evented or not; a
 * failed event drops its note (counted); MC_GATE_MAX bounds the queue; an
 * engine destroyed with notes queued frees them (ASan: `make SAN=1
 * test-c`).  Runs against the host-memory libcuda stand-in
 * (tests/c/fakecuda.c) like test_gate. */
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "engine/engine.h"
#include "gpu/cuda_driver.h"
#include "testlib.h"
#include "two_engines.h"
#include "util/clock.h"

static const mc_cuda_api_t *api;
static void (*stream_hold)(void *stream, uint64_t ns);
static void (*event_fail)(void *event);

typedef struct {
  int n;
  char seen[16][32];
} seq_t;

static void collect(void *arg, const char *from, const void *msg, size_t len) {
  (void)from;
  seq_t *q = arg;
  if (q->n < 16)
    snprintf(q->seen[q->n], sizeof q->seen[0], "%.*s", (int)len, (const char *)msg);
  q->n++;
}

/* B's notifications for ms milliseconds, or until it has want of them. */
static void drain_b(seq_t *q, int want, int ms) {
  uint64_t until = mc_now_ns() + (uint64_t)ms * 1000000ull;
  while (mc_now_ns() < until && q->n < want) {
    mc_engine_wait_notifies(B, 10000);
    mc_engine_drain_notifies(B, 64, collect, q);
  }
}

/* An event on a new stream held hold_ns; the caller destroys both. */
static mc_cu_result held_event(mc_cu_stream *s, mc_cu_event *ev, uint64_t hold_ns) {
  mc_cu_result rc = api->cuStreamCreate(s, 0);
  if (rc == 0)
    rc = api->cuEventCreate(ev, 0);
  if (rc != 0)
    return rc;
  stream_hold(*s, hold_ns);
  return api->cuEventRecord(*ev, *s);
}

static int note(mc_engine_t *e, const char *msg, mc_cu_event ev, mc_err_t *err) {
  mc_note_opts_t o = {.cuda_event = (uint64_t)(uintptr_t)ev};
  return mc_engine_notify_gated(e, mc_engine_segment_name(B), msg, strlen(msg), &o, err);
}

/* "src" (no event), "layer 0" (an event 200 ms away), "layer 1" (no
 * event): the first comes at once, the other two only after the event and
 * in that order (the no-event note waits its turn behind the evented one). */
static void test_order_kept(void) {
  mc_err_t err = {0};
  mc_cu_stream s = NULL;
  mc_cu_event ev = NULL;
  CHECK(held_event(&s, &ev, 200000000ull) == 0);
  uint64_t t0 = mc_now_ns();
  CHECK_EQ_INT(note(A, "src", NULL, &err), 0);
  CHECK_EQ_INT(note(A, "layer 0", ev, &err), 0);
  CHECK_EQ_INT(note(A, "layer 1", NULL, &err), 0);
  seq_t q = {0};
  drain_b(&q, 3, 120);
  CHECK_EQ_INT(q.n, 1);
  CHECK(strcmp(q.seen[0], "src") == 0);
  drain_b(&q, 3, 3000);
  CHECK(mc_now_ns() - t0 >= 190000000ull);
  CHECK_EQ_INT(q.n, 3);
  CHECK(strcmp(q.seen[1], "layer 0") == 0);
  CHECK(strcmp(q.seen[2], "layer 1") == 0);
  api->cuEventDestroy(ev);
  api->cuStreamDestroy(s);
}

/* A failed event drops its note (counted), the next note still goes. */
static void test_failed_event_drops_the_note(void) {
  mc_err_t err = {0};
  mc_cu_stream s = NULL;
  mc_cu_event ev = NULL;
  CHECK(held_event(&s, &ev, 50000000ull) == 0);
  event_fail(ev);
  mc_engine_stats_t st0, st;
  mc_engine_get_stats(A, &st0);
  CHECK_EQ_INT(note(A, "never", ev, &err), 0);
  CHECK_EQ_INT(note(A, "after", NULL, &err), 0);
  seq_t q = {0};
  drain_b(&q, 2, 1000);
  CHECK_EQ_INT(q.n, 1);
  CHECK(strcmp(q.seen[0], "after") == 0);
  mc_engine_get_stats(A, &st);
  CHECK_EQ_INT(st.gate_notes_dropped - st0.gate_notes_dropped, 1);
  CHECK_EQ_INT(st.gate_event_failures - st0.gate_event_failures, 1);
  /* past its send_by: dropped too */
  mc_note_opts_t o = {.send_by_ns = mc_wall_ns() - 1};
  CHECK_EQ_INT(mc_engine_notify_gated(A, mc_engine_segment_name(B), "late", 4, &o, &err), 0);
  CHECK_EQ_INT(note(A, "in time", NULL, &err), 0);
  q = (seq_t){0};
  drain_b(&q, 2, 1000);
  CHECK_EQ_INT(q.n, 1);
  CHECK(strcmp(q.seen[0], "in time") == 0);
  mc_engine_get_stats(A, &st);
  CHECK_EQ_INT(st.gate_notes_dropped - st0.gate_notes_dropped, 2);
  api->cuEventDestroy(ev);
  api->cuStreamDestroy(s);
}

/* A third engine fills its gate (one note behind an event 300 ms away,
 * then MC_GATE_MAX - 1 more): the next is refused MC_EBUSY; destroyed with
 * them queued, it frees them (nothing leaks under ASan) and sends none of
 * those still queued. */
static void test_bound_and_destroy_with_notes_queued(void) {
  mc_err_t err = {0};
  mc_engine_t *c = mk();
  CHECK(c != NULL);
  mc_cu_stream s = NULL;
  mc_cu_event ev = NULL;
  CHECK(held_event(&s, &ev, 300000000ull) == 0);
  CHECK_EQ_INT(note(c, "held", ev, &err), 0);
  for (int i = 1; i < MC_GATE_MAX; i++)
    CHECK_EQ_INT(note(c, "queued", NULL, &err), 0);
  CHECK_EQ_INT(note(c, "one too many", NULL, &err), MC_EBUSY);
  CHECK_CONTAINS(err.msg, "at most");
  mc_engine_destroy(c); /* the gate thread's wait ends with the event */
  api->cuEventDestroy(ev);
  api->cuStreamDestroy(s);
  seq_t q = {0};
  drain_b(&q, 1, 200);
  CHECK_EQ_INT(q.n, 0);
}

static void test_bad_arguments(void) {
  mc_err_t err = {0};
  mc_note_opts_t o = {0};
  CHECK_EQ_INT(mc_engine_notify_gated(A, "", "x", 1, &o, &err), MC_EINVAL);
  CHECK_EQ_INT(mc_engine_notify_gated(A, mc_engine_segment_name(B), "x",
                                      (size_t)MC_ENGINE_MAX_MSG + 1, &o, &err), MC_ETOOBIG);
  o.cuda_event = 1;
  o.cuda_device = -1;
  CHECK_EQ_INT(mc_engine_notify_gated(A, mc_engine_segment_name(B), "x", 1, &o, &err),
               MC_EINVAL);
  CHECK_CONTAINS(err.msg, "cuda_device");
}

int main(void) {
  mc_err_t err = {0};
  api = mc_cuda_api(&err);
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  stream_hold = h ? (void (*)(void *, uint64_t))dlsym(h, "fakecuda_stream_hold") : NULL;
  event_fail = h ? (void (*)(void *))dlsym(h, "fakecuda_event_fail") : NULL;
  if (!api || !stream_hold || !event_fail) {
    fprintf(stderr, "test_gate_notes needs the libcuda stand-in (tests/c/fakecuda.c) on "
                    "LD_LIBRARY_PATH: run it through `make test-c`\n");
    return 1;
  }
  for (int round = 0; round < 2; round++) { /* same-host, then over TCP */
    if (round == 1 && setenv("MC_SAME_HOST_CPU", "0", 1) != 0)
      return 1;
    if (two_engines_up(1 << 20) < 0)
      return 1;
    RUN(test_order_kept);
    RUN(test_failed_event_drops_the_note);
    RUN(test_bound_and_destroy_with_notes_queued);
    if (round == 0)
      RUN(test_bad_arguments);
    two_engines_down();
  }
  TEST_MAIN_END();
}
