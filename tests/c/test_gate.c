/* Gated write batches (csrc/engine/gate.c): the writes start only once the
 * CUDA event completed (the engine's gate thread waits for it in the
 * driver), the engine notifies the target once every write completed and
 * never for a failed or canceled batch; bad arguments are refused.  Runs
 * against the host-memory libcuda stand-in (tests/c/fakecuda.c, built as
 * build/fakecuda/libcuda.so.1: `make test-c` puts it on LD_LIBRARY_PATH
 * for this test); fakecuda_stream_hold makes an event complete later. */
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "engine/engine.h"
#include "gpu/cuda_driver.h"
#include "testlib.h"
#include "two_engines.h"
#include "util/clock.h"

#define BUFSZ (8u << 20)
static const mc_cuda_api_t *api;
static void (*stream_hold)(void *stream, uint64_t ns);
static int over_tcp; /* this round's engines move bytes over TCP (MC_SAME_HOST_CPU=0) */

typedef struct {
  int n;
  char last[256];
} got_t;

static void collect(void *arg, const char *from, const void *msg, size_t len) {
  (void)from;
  got_t *g = arg;
  g->n++;
  snprintf(g->last, sizeof g->last, "%.*s", (int)len, (const char *)msg);
}

/* Notifications B received within ms milliseconds (waits for the first). */
static int drain_b(got_t *g, int ms) {
  uint64_t until = mc_now_ns() + (uint64_t)ms * 1000000ull;
  while (mc_now_ns() < until && g->n == 0) {
    mc_engine_wait_notifies(B, 10000);
    mc_engine_drain_notifies(B, 16, collect, g);
  }
  return g->n;
}

static mc_request_t wreq(size_t off, uint64_t len) {
  return (mc_request_t){.opcode = MC_OP_WRITE, .local = abuf + off,
                        .remote = (uint64_t)(uintptr_t)(bbuf + off), .len = len};
}

/* The event gated batches wait for: a new stream held hold_ns and an event
 * recorded on it behind the hold; abuf's first len bytes filled from seed,
 * bbuf's zeroed.  0, or the failing driver call's nonzero result (the
 * caller CHECKs it: the test stops there).  The caller destroys both. */
static mc_cu_result held_event(mc_cu_stream *s, mc_cu_event *ev, size_t len, uint32_t seed,
                               uint64_t hold_ns) {
  mc_cu_result rc = api->cuStreamCreate(s, 0);
  if (rc == 0)
    rc = api->cuEventCreate(ev, 0);
  if (rc != 0)
    return rc;
  fill(abuf, len, seed);
  memset(bbuf, 0, len);
  stream_hold(*s, hold_ns);
  return api->cuEventRecord(*ev, *s);
}

/* An event 300 ms away: nothing is written, nothing told, the batch is
 * pending; once the event completed the bytes land and then the message
 * comes. */
static void test_waits_for_the_event_then_notifies(void) {
  mc_err_t err = {0};
  mc_cu_stream s = NULL;
  mc_cu_event ev = NULL;
  CHECK(held_event(&s, &ev, 1 << 20, 7, 300000000ull) == 0);
  mc_request_t r = wreq(0, 1 << 20);
  mc_batch_t *b = mc_batch_new(A, 1);
  mc_gate_opts_t o = {.cuda_event = (uint64_t)(uintptr_t)ev, .cuda_device = 0,
                      .notify = "layer 3", .notify_len = 7};
  uint64_t t0 = mc_now_ns();
  CHECK_EQ_INT(mc_batch_submit_gated(A, b, mc_engine_segment_name(B), &r, 1, &o, &err), 0);
  got_t g = {0};
  usleep(150000);
  CHECK_EQ_INT((int)mc_batch_pending(b), 1);
  CHECK_EQ_INT(drain_b(&g, 1), 0);
  CHECK(bbuf[0] == 0 && bbuf[(1 << 20) - 1] == 0); /* sources not read yet */
  CHECK_EQ_INT(mc_batch_wait(A, b, 5000, &err), 0);
  uint64_t waited = mc_now_ns() - t0;
  CHECK(waited >= 290000000ull);
  CHECK(memcmp(abuf, bbuf, 1 << 20) == 0);
  CHECK_EQ_INT(drain_b(&g, 2000), 1);
  CHECK(strcmp(g.last, "layer 3") == 0);
  mc_batch_free(A, b);
  mc_engine_stats_t st; /* counted once the notifier's send returned: just after */
  uint64_t until = mc_now_ns() + 1000000000ull;
  do
    mc_engine_get_stats(A, &st);
  while (st.gate_notified < 1 && mc_now_ns() < until && usleep(1000) == 0);
  CHECK(st.gate_notified >= 1);
  api->cuEventDestroy(ev);
  api->cuStreamDestroy(s);
}

/* A write that fails (outside B's memory) sends nothing; the batch says why. */
static void test_failed_batch_sends_nothing(void) {
  mc_err_t err = {0};
  mc_request_t r[2] = {wreq(0, 4096), wreq(4096, 4096)};
  r[1].remote = 0x10; /* not registered on B */
  mc_batch_t *b = mc_batch_new(A, 2);
  mc_gate_opts_t o = {.notify = "never", .notify_len = 5};
  CHECK_EQ_INT(mc_batch_submit_gated(A, b, mc_engine_segment_name(B), r, 2, &o, &err), 0);
  CHECK(mc_batch_wait(A, b, 5000, &err) < 0);
  mc_batch_free(A, b);
  got_t g = {0};
  CHECK_EQ_INT(drain_b(&g, 300), 0);
}

/* Canceled while waiting for its event (a wait's timeout): the wait
 * returns at once, the requests end timed out, and when the event
 * completes later nothing is written and nothing told. */
static void test_cancel_before_the_event(void) {
  mc_err_t err = {0};
  mc_cu_stream s = NULL;
  mc_cu_event ev = NULL;
  CHECK(held_event(&s, &ev, 65536, 9, 200000000ull) == 0);
  mc_request_t r = wreq(0, 65536);
  mc_batch_t *b = mc_batch_new(A, 1);
  mc_gate_opts_t o = {.cuda_event = (uint64_t)(uintptr_t)ev, .notify = "x", .notify_len = 1};
  CHECK_EQ_INT(mc_batch_submit_gated(A, b, mc_engine_segment_name(B), &r, 1, &o, &err), 0);
  uint64_t t0 = mc_now_ns();
  CHECK(mc_batch_wait(A, b, 20, &err) < 0);
  CHECK(mc_now_ns() - t0 < 150000000ull); /* not held until the event */
  mc_task_status_t ts;
  CHECK_EQ_INT(mc_batch_status(b, 0, &ts), 0);
  CHECK(ts.state == MC_TASK_TIMEOUT || ts.state == MC_TASK_CANCELED);
  mc_batch_free(A, b);
  usleep(300000); /* the event completed meanwhile */
  got_t g = {0};
  CHECK_EQ_INT(drain_b(&g, 100), 0);
  CHECK(bbuf[0] == 0 && bbuf[65535] == 0);
  api->cuEventDestroy(ev);
  api->cuStreamDestroy(s);
}

/* Many layers' batches in flight, one event each, in order: all land and
 * each is told once. */
static void test_many_in_order(void) {
  mc_err_t err = {0};
  enum { N = 64 };
  mc_cu_stream s = NULL;
  mc_cu_event ev[N];
  mc_batch_t *b[N];
  CHECK(api->cuStreamCreate(&s, 0) == 0);
  fill(abuf, N * 4096, 11);
  memset(bbuf, 0, N * 4096);
  for (int i = 0; i < N; i++) {
    CHECK(api->cuEventCreate(&ev[i], 0) == 0);
    stream_hold(s, 1000000ull);
    api->cuEventRecord(ev[i], s);
    mc_request_t r = wreq((size_t)i * 4096, 4096);
    b[i] = mc_batch_new(A, 1);
    char m[16];
    int ml = snprintf(m, sizeof m, "%d", i);
    mc_gate_opts_t o = {.cuda_event = (uint64_t)(uintptr_t)ev[i], .notify = m,
                        .notify_len = (size_t)ml};
    CHECK_EQ_INT(mc_batch_submit_gated(A, b[i], mc_engine_segment_name(B), &r, 1, &o, &err), 0);
  }
  for (int i = 0; i < N; i++) {
    CHECK_EQ_INT(mc_batch_wait(A, b[i], 5000, &err), 0);
    mc_batch_free(A, b[i]);
    api->cuEventDestroy(ev[i]);
  }
  CHECK(memcmp(abuf, bbuf, N * 4096) == 0);
  got_t g = {0};
  uint64_t until = mc_now_ns() + 3000000000ull;
  while (g.n < N && mc_now_ns() < until) {
    mc_engine_wait_notifies(B, 10000);
    mc_engine_drain_notifies(B, 64, collect, &g);
  }
  CHECK_EQ_INT(g.n, N);
  api->cuStreamDestroy(s);
}

/* A gated batch without an event queued for the gate thread
 * (on_gate_thread: vLLM's forward thread hands a CPU layer over instead of
 * copying it): the caller only queues -- held here behind a batch whose
 * event is 200 ms away, nothing is written and the batch is pending when
 * the submit returned -- then the gate thread submits it in its turn, the
 * bytes land and only then the message comes, once.  Counted in
 * gate_host_batches.  mc_engine_route_copies_here: 1 once the same-host
 * CPU path carries host memory to the peer, 0 over TCP or before the
 * route is known. */
static void test_host_batch_on_the_gate_thread(void) {
  mc_err_t err = {0};
  const char *seg = mc_engine_segment_name(B);
  const char *sh = getenv("MC_SAME_HOST_CPU");
  int cma = !(sh && !strcmp(sh, "0"));
  mc_engine_t *C = mk(); /* a peer A has not written to yet: its route unknown */
  CHECK(C != NULL);
  CHECK_EQ_INT(mc_engine_route_copies_here(A, mc_engine_segment_name(C)), 0);
  mc_engine_destroy(C);
  mc_request_t w = wreq(0, 64); /* the route to B known */
  mc_batch_t *b0 = mc_batch_new(A, 1);
  CHECK_EQ_INT(mc_batch_submit(A, b0, seg, &w, 1, &err), 0);
  CHECK_EQ_INT(mc_batch_wait(A, b0, 5000, &err), 0);
  mc_batch_free(A, b0);
  CHECK_EQ_INT(mc_engine_route_copies_here(A, seg), cma);
  mc_engine_stats_t st0, st1;
  mc_engine_get_stats(A, &st0);
  mc_cu_stream s = NULL;
  mc_cu_event ev = NULL;
  const size_t n = 4u << 20;
  CHECK(held_event(&s, &ev, n + 4096, 13, 200000000ull) == 0);
  mc_request_t r1 = wreq(n, 4096), r2 = wreq(0, n);
  mc_batch_t *b1 = mc_batch_new(A, 1), *b2 = mc_batch_new(A, 1);
  mc_gate_opts_t o1 = {.cuda_event = (uint64_t)(uintptr_t)ev, .notify = "first",
                       .notify_len = 5};
  mc_gate_opts_t o2 = {.on_gate_thread = 1, .notify = "host layer", .notify_len = 10};
  CHECK_EQ_INT(mc_batch_submit_gated(A, b1, seg, &r1, 1, &o1, &err), 0);
  uint64_t t0 = mc_now_ns();
  CHECK_EQ_INT(mc_batch_submit_gated(A, b2, seg, &r2, 1, &o2, &err), 0);
  CHECK(mc_now_ns() - t0 < 50000000ull); /* queued, not copied here */
  CHECK_EQ_INT((int)mc_batch_pending(b2), 1);
  usleep(100000);
  CHECK_EQ_INT((int)mc_batch_pending(b2), 1); /* behind the held event */
  CHECK(bbuf[0] == 0 && bbuf[n - 1] == 0);
  got_t g = {0};
  CHECK_EQ_INT(drain_b(&g, 1), 0);
  CHECK_EQ_INT(mc_batch_wait(A, b2, 5000, &err), 0);
  CHECK(mc_now_ns() - t0 >= 150000000ull);
  CHECK(memcmp(abuf, bbuf, n) == 0);
  /* both messages, in the gate's order, each once */
  uint64_t until = mc_now_ns() + 3000000000ull;
  while (g.n < 2 && mc_now_ns() < until) {
    mc_engine_wait_notifies(B, 10000);
    mc_engine_drain_notifies(B, 16, collect, &g);
  }
  CHECK_EQ_INT(g.n, 2);
  CHECK(strcmp(g.last, "host layer") == 0);
  CHECK_EQ_INT(mc_batch_wait(A, b1, 5000, &err), 0);
  mc_batch_free(A, b1);
  mc_batch_free(A, b2);
  mc_engine_get_stats(A, &st1);
  CHECK(st1.gate_host_batches == st0.gate_host_batches + 1);
  api->cuEventDestroy(ev);
  api->cuStreamDestroy(s);
}

/* The message a host batch on the gate thread carries comes only after
 * its bytes landed: many layers in a row, each checked on B as its
 * message arrives. */
typedef struct {
  int n, bad;
  size_t per;
} landed_t;

static void check_landed(void *arg, const char *from, const void *msg, size_t len) {
  (void)from;
  landed_t *l = arg;
  int i = atoi((const char *)msg);
  (void)len;
  if (i != l->n || memcmp(abuf + (size_t)i * l->per, bbuf + (size_t)i * l->per, l->per) != 0)
    l->bad++;
  l->n++;
}

static void test_host_batches_told_after_their_bytes(void) {
  mc_err_t err = {0};
  enum { N = 32 };
  const size_t per = 128u << 10;
  mc_batch_t *b[N];
  fill(abuf, N * per, 17);
  memset(bbuf, 0, N * per);
  for (int i = 0; i < N; i++) {
    mc_request_t r = wreq((size_t)i * per, per);
    b[i] = mc_batch_new(A, 1);
    char m[16];
    int ml = snprintf(m, sizeof m, "%d", i);
    mc_gate_opts_t o = {.on_gate_thread = 1, .notify = m, .notify_len = (size_t)ml + 1};
    CHECK_EQ_INT(mc_batch_submit_gated(A, b[i], mc_engine_segment_name(B), &r, 1, &o, &err),
                 0);
  }
  landed_t l = {.per = per};
  uint64_t until = mc_now_ns() + 5000000000ull;
  while (l.n < N && mc_now_ns() < until) {
    mc_engine_wait_notifies(B, 10000);
    mc_engine_drain_notifies(B, 64, check_landed, &l);
  }
  CHECK_EQ_INT(l.n, N);
  CHECK_EQ_INT(l.bad, 0);
  for (int i = 0; i < N; i++) {
    CHECK_EQ_INT(mc_batch_wait(A, b[i], 5000, &err), 0);
    mc_batch_free(A, b[i]);
  }
}

/* Host batches canceled (freed: a target's cancel, a lease's end) while
 * queued behind a held event and while their copy runs: the free returns
 * once no thread touches them; nothing is written after it, nothing told,
 * and the gate is left empty (the engine stops clean: ASan's leak check). */
static void test_host_batches_canceled_leave_nothing(void) {
  mc_err_t err = {0};
  const char *seg = mc_engine_segment_name(B);
  mc_cu_stream s = NULL;
  mc_cu_event ev = NULL;
  enum { N = 8 };
  const size_t per = 1u << 20;
  CHECK(held_event(&s, &ev, N * per, 19, 150000000ull) == 0);
  mc_request_t r0 = wreq(0, 4096);
  mc_batch_t *h = mc_batch_new(A, 1), *b[N];
  mc_gate_opts_t oh = {.cuda_event = (uint64_t)(uintptr_t)ev};
  CHECK_EQ_INT(mc_batch_submit_gated(A, h, seg, &r0, 1, &oh, &err), 0);
  for (int i = 0; i < N; i++) {
    mc_request_t r = wreq((size_t)i * per, per);
    b[i] = mc_batch_new(A, 1);
    mc_gate_opts_t o = {.on_gate_thread = 1, .notify = "never", .notify_len = 5};
    CHECK_EQ_INT(mc_batch_submit_gated(A, b[i], seg, &r, 1, &o, &err), 0);
  }
  /* the queued ones: freed at once, before the event */
  uint64_t t0 = mc_now_ns();
  for (int i = N / 2; i < N; i++)
    mc_batch_free(A, b[i]);
  CHECK(mc_now_ns() - t0 < 100000000ull);
  /* the first ones: freed as the gate thread takes them (some mid-copy) */
  CHECK_EQ_INT(mc_batch_wait(A, h, 5000, &err), 0);
  for (int i = 0; i < N / 2; i++)
    mc_batch_free(A, b[i]);
  /* Over TCP the bytes B's kernel already took are B's to fence (tcp_loop.c:
   * a free resets only what A's kernel still holds unacknowledged), as the
   * consumer does before it reuses lent blocks: B cuts A's connections, so
   * its I/O thread writes nothing more from them.  Without the cut, the
   * check below failed under ASan on a loaded host (CI, 2026-12-06): B's
   * thread was still applying acknowledged bytes.  Over the same-host CPU
   * path A copies, so the free alone must be enough. */
  if (over_tcp)
    CHECK(mc_engine_cut_peer(B, mc_engine_segment_name(A), 5000, &err) >= 0);
  uint8_t *snap = malloc(N * per);
  CHECK(snap != NULL);
  memcpy(snap, bbuf, N * per);
  usleep(100000);
  CHECK(memcmp(snap, bbuf, N * per) == 0); /* nothing written after the frees */
  for (size_t i = (N / 2) * per; i < N * per; i += 4096)
    CHECK(bbuf[i] == 0); /* the queued ones never ran */
  free(snap);
  got_t g = {0}; /* told: at most the ones that ran whole before their free */
  uint64_t until = mc_now_ns() + 300000000ull;
  while (mc_now_ns() < until) {
    mc_engine_wait_notifies(B, 10000);
    mc_engine_drain_notifies(B, 16, collect, &g);
  }
  CHECK(g.n <= N / 2);
  mc_batch_free(A, h);
  api->cuEventDestroy(ev);
  api->cuStreamDestroy(s);
}

/* submit_by_ns (a push target's lease minus the producer's margin): a
 * batch whose turn on the gate thread comes after it -- queued behind an
 * event 200 ms away, its time ending 50 ms from now -- is not submitted:
 * MC_ETIMEDOUT, nothing written, nothing told (the consumer may have freed
 * the blocks, and the same-host CPU path's copies cannot be fenced from
 * its side).  Its neighbour in the queue with time left is written and
 * told.  Before submit_by_ns the gate thread wrote whatever its turn. */
static void test_no_submit_past_its_time(void) {
  mc_err_t err = {0};
  const char *seg = mc_engine_segment_name(B);
  mc_cu_stream s = NULL;
  mc_cu_event ev = NULL;
  const size_t n = 1u << 20;
  CHECK(held_event(&s, &ev, 2 * n + 4096, 23, 200000000ull) == 0);
  mc_request_t r0 = wreq(2 * n, 4096), r1 = wreq(0, n), r2 = wreq(n, n);
  mc_batch_t *h = mc_batch_new(A, 1), *late = mc_batch_new(A, 1), *ok = mc_batch_new(A, 1);
  mc_gate_opts_t oh = {.cuda_event = (uint64_t)(uintptr_t)ev};
  mc_gate_opts_t ol = {.on_gate_thread = 1, .notify = "late", .notify_len = 4,
                       .submit_by_ns = mc_wall_ns() + 50000000ll};
  mc_gate_opts_t oo = {.on_gate_thread = 1, .notify = "in time", .notify_len = 7,
                       .submit_by_ns = mc_wall_ns() + 60000000000ll};
  CHECK_EQ_INT(mc_batch_submit_gated(A, h, seg, &r0, 1, &oh, &err), 0);
  CHECK_EQ_INT(mc_batch_submit_gated(A, late, seg, &r1, 1, &ol, &err), 0);
  CHECK_EQ_INT(mc_batch_submit_gated(A, ok, seg, &r2, 1, &oo, &err), 0);
  CHECK_EQ_INT(mc_batch_wait(A, h, 5000, &err), 0);
  CHECK_EQ_INT(mc_batch_wait(A, late, 5000, &err), MC_ETIMEDOUT);
  CHECK_CONTAINS(err.msg, "nothing written");
  CHECK_EQ_INT(mc_batch_wait(A, ok, 5000, &err), 0);
  for (size_t i = 0; i < n; i += 4096)
    CHECK(bbuf[i] == 0); /* the late one never ran */
  CHECK(memcmp(abuf + n, bbuf + n, n) == 0);
  got_t g = {0};
  uint64_t until = mc_now_ns() + 300000000ull;
  while (mc_now_ns() < until) {
    mc_engine_wait_notifies(B, 10000);
    mc_engine_drain_notifies(B, 16, collect, &g);
  }
  CHECK_EQ_INT(g.n, 1);
  CHECK(strcmp(g.last, "in time") == 0);
  mc_batch_free(A, h);
  mc_batch_free(A, late);
  mc_batch_free(A, ok);
  api->cuEventDestroy(ev);
  api->cuStreamDestroy(s);
}

static void test_bad_arguments(void) {
  mc_err_t err = {0};
  mc_request_t r = wreq(0, 4096);
  mc_batch_t *b = mc_batch_new(A, 1);
  mc_gate_opts_t o = {0};
  CHECK_EQ_INT(mc_batch_submit_gated(A, b, mc_engine_segment_name(B), &r, 0, &o, &err),
               MC_EINVAL);
  CHECK_CONTAINS(err.msg, "at least one request");
  mc_request_t rd = r;
  rd.opcode = MC_OP_READ;
  CHECK_EQ_INT(mc_batch_submit_gated(A, b, mc_engine_segment_name(B), &rd, 1, &o, &err),
               MC_EINVAL);
  CHECK_CONTAINS(err.msg, "WRITEs only");
  o.cuda_event = 1;
  o.cuda_device = -1;
  CHECK_EQ_INT(mc_batch_submit_gated(A, b, mc_engine_segment_name(B), &r, 1, &o, &err),
               MC_EINVAL);
  CHECK_CONTAINS(err.msg, "cuda_device");
  o = (mc_gate_opts_t){0};
  CHECK_EQ_INT(mc_batch_submit_gated(A, b, mc_engine_segment_name(B), &r, 1, &o, &err), 0);
  CHECK_EQ_INT(mc_batch_submit_gated(A, b, mc_engine_segment_name(B), &r, 1, &o, &err),
               MC_EINVAL);
  CHECK_CONTAINS(err.msg, "new batch");
  CHECK_EQ_INT(mc_batch_wait(A, b, 5000, &err), 0);
  mc_batch_free(A, b);
}

/* The engine's own gate events (mc_engine_gate_record, gate_events.c): an
 * event recorded on a held stream gates the write like the caller's own;
 * the ring makes MC_GATE_EVENTS events at most and hands each out again
 * only that many records later; another device is refused.  And
 * mc_engine_notifies_pending: a look that takes nothing. */
static void test_engine_events_and_the_pending_look(void) {
  mc_err_t err = {0};
  mc_cu_stream s = NULL;
  CHECK(api->cuStreamCreate(&s, 0) == 0);
  fill(abuf, 4096, 9);
  memset(bbuf, 0, 4096);
  stream_hold(s, 200000000ull);
  uint64_t ev = 0, first = 0;
  CHECK_EQ_INT(mc_engine_gate_record(A, 0, (uint64_t)(uintptr_t)s, &ev, &err), 0);
  CHECK(ev != 0);
  first = ev;
  mc_request_t r = wreq(0, 4096);
  mc_batch_t *b = mc_batch_new(A, 1);
  mc_gate_opts_t o = {.cuda_event = ev, .cuda_device = 0, .notify = "own", .notify_len = 3};
  uint64_t t0 = mc_now_ns();
  CHECK_EQ_INT(mc_batch_submit_gated(A, b, mc_engine_segment_name(B), &r, 1, &o, &err), 0);
  CHECK_EQ_INT(mc_engine_notifies_pending(B), 0);
  CHECK_EQ_INT(mc_batch_wait(A, b, 5000, &err), 0);
  CHECK(mc_now_ns() - t0 >= 190000000ull);
  CHECK(memcmp(abuf, bbuf, 4096) == 0);
  uint64_t until = mc_now_ns() + 2000000000ull;
  while (!mc_engine_notifies_pending(B) && mc_now_ns() < until)
    usleep(1000);
  CHECK_EQ_INT(mc_engine_notifies_pending(B), 1); /* and still there: nothing taken */
  got_t g = {0};
  CHECK_EQ_INT(drain_b(&g, 1000), 1);
  CHECK(strcmp(g.last, "own") == 0);
  CHECK_EQ_INT(mc_engine_notifies_pending(B), 0);
  mc_batch_free(A, b);
  /* the ring: the first event comes back after MC_GATE_EVENTS records */
  uint64_t seen_again = 0;
  for (int i = 1; i <= MC_GATE_EVENTS; i++) {
    CHECK_EQ_INT(mc_engine_gate_record(A, 0, (uint64_t)(uintptr_t)s, &ev, &err), 0);
    if (ev == first && !seen_again)
      seen_again = (uint64_t)i;
  }
  CHECK_EQ_INT((int)seen_again, MC_GATE_EVENTS);
  CHECK_EQ_INT(mc_engine_gate_record(A, 1, (uint64_t)(uintptr_t)s, &ev, &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "one device per engine");
  api->cuStreamDestroy(s);
}

int main(void) {
  mc_err_t err = {0};
  api = mc_cuda_api(&err);
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  stream_hold = h ? (void (*)(void *, uint64_t))dlsym(h, "fakecuda_stream_hold") : NULL;
  if (!api || !stream_hold) {
    fprintf(stderr, "test_gate needs the libcuda stand-in (tests/c/fakecuda.c) on "
                    "LD_LIBRARY_PATH: run it through `make test-c`\n");
    return 1;
  }
  /* Twice: the gate and notifier threads sleeping between batches, then
   * spinning first (MC_WAKE_SPIN_US, read when an engine starts; the gate
   * then looks at each event with cuEventQuery before it sleeps). */
  for (int round = 0; round < 3; round++) {
    if (round == 1 && setenv("MC_WAKE_SPIN_US", "3000", 1) != 0)
      return 1;
    if (round == 2 && (unsetenv("MC_WAKE_SPIN_US") != 0 || /* then over TCP */
                       setenv("MC_SAME_HOST_CPU", "0", 1) != 0))
      return 1;
    over_tcp = round == 2;
    if (two_engines_up(BUFSZ) < 0)
      return 1;
    RUN(test_waits_for_the_event_then_notifies);
    RUN(test_failed_batch_sends_nothing);
    RUN(test_cancel_before_the_event);
    RUN(test_many_in_order);
    RUN(test_host_batch_on_the_gate_thread);
    RUN(test_host_batches_told_after_their_bytes);
    RUN(test_host_batches_canceled_leave_nothing);
    RUN(test_no_submit_past_its_time);
    if (round == 0) {
      RUN(test_bad_arguments);
      RUN(test_engine_events_and_the_pending_look);
    }
    two_engines_down();
  }
  TEST_MAIN_END();
}
