/* Engine + TCP transport, two engines in one process over loopback. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "engine/engine.h"
#include "mem/regions.h"
#include "testlib.h"
#include "transport/tcp/wire.h"
#include "two_engines.h"
#include "util/clock.h"

#define BUFSZ (64u << 20)

static int xfer(int op, size_t off_local, size_t off_remote, uint64_t len, mc_err_t *err) {
  mc_request_t r = {.opcode = op, .local = abuf + off_local,
                    .remote = (uint64_t)(uintptr_t)(bbuf + off_remote), .len = len};
  mc_batch_t *b = mc_batch_new(A, 1);
  int rc = mc_batch_submit(A, b, mc_engine_segment_name(B), &r, 1, err);
  if (rc == 0)
    rc = mc_batch_wait(A, b, 10000, err);
  mc_batch_free(A, b);
  return rc;
}

static void test_sizes_write_read(void) {
  static const uint64_t sizes[] = {1, 7, 4096, 65536, 65537, 1u << 20, (4u << 20) + 3, 48u << 20};
  for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++) {
    uint64_t n = sizes[k];
    mc_err_t err = {0};
    fill(abuf, n, (uint32_t)k);
    memset(bbuf, 0, n);
    CHECK_EQ_INT(xfer(MC_OP_WRITE, 0, 0, n, &err), 0);
    CHECK(memcmp(abuf, bbuf, n) == 0);
    memset(abuf, 0, n);
    CHECK_EQ_INT(xfer(MC_OP_READ, 0, 0, n, &err), 0);
    CHECK(memcmp(abuf, bbuf, n) == 0);
  }
}

/* mc_batch_wait_idle: returns once the write completed (woken by the I/O
 * thread, not at its timeout), cancelling and freeing nothing. */
static void test_wait_idle(void) {
  uint64_t n = 48u << 20;
  fill(abuf, n, 5);
  memset(bbuf, 0, n);
  mc_request_t r = {.opcode = MC_OP_WRITE, .local = abuf,
                    .remote = (uint64_t)(uintptr_t)bbuf, .len = n};
  mc_err_t err = {0};
  mc_batch_t *b = mc_batch_new(A, 1);
  CHECK_EQ_INT(mc_batch_submit(A, b, mc_engine_segment_name(B), &r, 1, &err), 0);
  uint64_t t0 = mc_now_ns();
  CHECK_EQ_INT(mc_batch_wait_idle(b, 20000000000ull), 1);
  CHECK(mc_now_ns() - t0 < 10000000000ull);
  CHECK_EQ_INT((int)mc_batch_pending(b), 0);
  CHECK_EQ_INT(mc_batch_wait_idle(b, 0), 1); /* idle: at once */
  mc_task_status_t s;
  mc_batch_status(b, 0, &s);
  CHECK_EQ_INT(s.state, MC_TASK_COMPLETED);
  CHECK(memcmp(abuf, bbuf, n) == 0);
  CHECK_EQ_INT(mc_batch_wait(A, b, 1000, &err), 0);
  mc_batch_free(A, b);
}

static void test_batch_10k_blocks(void) {
  enum { N = 10000, BLK = 4096 };
  mc_request_t *r = calloc(N, sizeof *r);
  fill(abuf, (size_t)N * BLK, 99);
  memset(bbuf, 0, (size_t)N * BLK);
  /* Scatter: block i goes to slot (i * 7919) % N. */
  for (size_t i = 0; i < N; i++)
    r[i] = (mc_request_t){.opcode = MC_OP_WRITE, .local = abuf + i * BLK,
                          .remote = (uint64_t)(uintptr_t)(bbuf + ((i * 7919) % N) * BLK),
                          .len = BLK};
  mc_err_t err = {0};
  mc_batch_t *b = mc_batch_new(A, N);
  CHECK_EQ_INT(mc_batch_submit(A, b, mc_engine_segment_name(B), r, N, &err), 0);
  CHECK_EQ_INT(mc_batch_wait(A, b, 20000, &err), 0);
  for (size_t i = 0; i < N; i++) {
    mc_task_status_t s;
    mc_batch_status(b, i, &s);
    CHECK_EQ_INT(s.state, MC_TASK_COMPLETED);
    CHECK_EQ_INT(s.transferred, BLK);
    CHECK(memcmp(abuf + i * BLK, bbuf + ((i * 7919) % N) * BLK, BLK) == 0);
  }
  mc_batch_free(A, b);
  free(r);
}

static void test_out_of_range_refused(void) {
  mc_err_t err = {0};
  bbuf[BUFSZ - 1] = 0x5a;
  memset(abuf, 0xee, 64);
  /* Straddles the end of the region: refused, nothing written. */
  int rc = xfer(MC_OP_WRITE, 0, BUFSZ - 1, 64, &err);
  CHECK_EQ_INT(rc, MC_ERANGE);
  CHECK_CONTAINS(err.msg, "not inside any memory region");
  CHECK_EQ_INT(bbuf[BUFSZ - 1], 0x5a);
  rc = xfer(MC_OP_READ, 0, BUFSZ, 1, &err);
  CHECK_EQ_INT(rc, MC_ERANGE);
  /* The connection survives a refusal. */
  CHECK_EQ_INT(xfer(MC_OP_WRITE, 0, 0, 64, &err), 0);
}

static void test_mixed_batch_partial_failure(void) {
  mc_request_t r[3] = {
      {.opcode = MC_OP_WRITE, .local = abuf, .remote = (uint64_t)(uintptr_t)bbuf, .len = 100},
      {.opcode = MC_OP_WRITE, .local = abuf, .remote = 16, .len = 100},
      {.opcode = MC_OP_READ, .local = abuf + 200, .remote = (uint64_t)(uintptr_t)bbuf, .len = 100},
  };
  mc_err_t err = {0};
  mc_batch_t *b = mc_batch_new(A, 3);
  /* Separate submits so that each request is its own op. */
  for (int i = 0; i < 3; i++)
    CHECK_EQ_INT(mc_batch_submit(A, b, mc_engine_segment_name(B), &r[i], 1, &err), 0);
  CHECK_EQ_INT(mc_batch_wait(A, b, 5000, &err), MC_ERANGE);
  mc_task_status_t s;
  mc_batch_status(b, 0, &s);
  CHECK_EQ_INT(s.state, MC_TASK_COMPLETED);
  mc_batch_status(b, 1, &s);
  CHECK_EQ_INT(s.state, MC_TASK_FAILED);
  CHECK_EQ_INT(s.code, MC_ERANGE);
  mc_batch_status(b, 2, &s);
  CHECK_EQ_INT(s.state, MC_TASK_COMPLETED);
  mc_batch_free(A, b);
}

/* One wire op carrying a refused entry: only that request fails. */
static void test_bad_entry_inside_one_op(void) {
  mc_request_t r[6];
  fill(abuf, 6 * 1000, 77);
  memset(bbuf, 0, 6 * 1000);
  for (int i = 0; i < 6; i++)
    r[i] = (mc_request_t){.opcode = MC_OP_WRITE, .local = abuf + i * 1000,
                          .remote = (uint64_t)(uintptr_t)(bbuf + i * 1000), .len = 1000};
  r[2].remote = 64;             /* not registered */
  r[4].remote = BUFSZ - 10 + (uint64_t)(uintptr_t)bbuf; /* straddles the end */
  mc_err_t err = {0};
  mc_batch_t *b = mc_batch_new(A, 6);
  CHECK_EQ_INT(mc_batch_submit(A, b, mc_engine_segment_name(B), r, 6, &err), 0);
  CHECK_EQ_INT(mc_batch_wait(A, b, 5000, &err), MC_ERANGE);
  for (int i = 0; i < 6; i++) {
    mc_task_status_t s;
    mc_batch_status(b, (size_t)i, &s);
    if (i == 2 || i == 4) {
      CHECK_EQ_INT(s.state, MC_TASK_FAILED);
      CHECK_CONTAINS(s.msg, "not inside any memory region");
    } else {
      CHECK_EQ_INT(s.state, MC_TASK_COMPLETED);
      CHECK(memcmp(abuf + i * 1000, bbuf + i * 1000, 1000) == 0);
    }
  }
  mc_batch_free(A, b);
}

static void test_bad_arguments(void) {
  mc_err_t err = {0};
  mc_request_t r = {.opcode = 7, .local = abuf, .remote = 1, .len = 1};
  mc_batch_t *b = mc_batch_new(A, 1);
  CHECK_EQ_INT(mc_batch_submit(A, b, mc_engine_segment_name(B), &r, 1, &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "opcode");
  r.opcode = MC_OP_WRITE;
  r.len = 0;
  CHECK_EQ_INT(mc_batch_submit(A, b, mc_engine_segment_name(B), &r, 1, &err), MC_EINVAL);
  r.len = 1;
  CHECK_EQ_INT(mc_batch_submit(A, b, "not a segment", &r, 1, &err), MC_EINVAL);
  mc_request_t two[2] = {r, r};
  CHECK_EQ_INT(mc_batch_submit(A, b, mc_engine_segment_name(B), two, 2, &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "room");
  mc_batch_free(A, b);
  CHECK_EQ_INT(mc_engine_register(B, bbuf + 10, 10, "cpu", &err), MC_EOVERLAP);
  CHECK_EQ_INT(mc_engine_register(B, abuf, 10, "gpu", &err), MC_EINVAL);
  /* Local buffers outside A's regions, and unmapped or read-only memory. */
  uint8_t *stray = malloc(4096);
  mc_request_t loose = {.opcode = MC_OP_READ, .local = stray, .remote = (uintptr_t)bbuf, .len = 8};
  b = mc_batch_new(A, 1);
  CHECK_EQ_INT(mc_batch_submit(A, b, mc_engine_segment_name(B), &loose, 1, &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "not inside any memory region registered with this engine");
  loose.local = abuf + BUFSZ - 4; /* runs 4 bytes past a region */
  CHECK_EQ_INT(mc_batch_submit(A, b, mc_engine_segment_name(B), &loose, 1, &err), MC_EINVAL);
  mc_batch_free(A, b);
  free(stray);
  /* 1 TiB: unmapped in a plain process, ASan's no-access shadow gap under SAN=1. */
  CHECK_EQ_INT(mc_engine_register(B, (void *)(1ull << 40), 4096, "cpu", &err), MC_EINVAL);
  CHECK(strstr(err.msg, "not mapped at 0x10000000000") ||
        strstr(err.msg, "not writable at 0x10000000000"));
  CHECK_EQ_INT(mc_engine_register(B, (void *)"read-only text", 8, "cpu", &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "not writable");
  CHECK_EQ_INT(mc_engine_unregister(B, bbuf + 1, &err), MC_ENOTFOUND);
}

/* The checks of one submit, request by request: a request after one in the
 * same region (the pass's cached region) is checked as fully as the first,
 * and a failing check further on is reported before a lookup failure
 * earlier in the batch (every request is checked before any is looked up). */
static void test_checks_after_a_cached_region(void) {
  mc_err_t err = {0};
  uint64_t rb = (uint64_t)(uintptr_t)bbuf;
  mc_request_t ok = {.opcode = MC_OP_WRITE, .local = abuf, .remote = rb, .len = 8};
  struct {
    mc_request_t r;
    const char *msg;
  } bad[] = {
      {{.opcode = 2, .local = abuf + 64, .remote = rb, .len = 8}, "request 1: opcode 2 is not"},
      {{.opcode = -1, .local = abuf + 64, .remote = rb, .len = 8}, "request 1: opcode -1 is not"},
      {{.opcode = MC_OP_READ, .local = abuf + 64, .remote = rb, .len = 0},
       "request 1: length is 0"},
      {{.opcode = MC_OP_READ, .local = NULL, .remote = rb, .len = 8},
       "request 1: local address is NULL"},
      {{.opcode = MC_OP_READ, .local = abuf + 64, .remote = UINT64_MAX - 3, .len = 8},
       "request 1: address + length wraps around"},
      {{.opcode = MC_OP_READ, .local = abuf + 64, .remote = rb, .len = UINT64_MAX - 8},
       "request 1: address + length wraps around"},
      {{.opcode = MC_OP_READ, .local = abuf + BUFSZ - 4, .remote = rb, .len = 8},
       "request 1: local range"},
      {{.opcode = MC_OP_READ, .local = abuf + BUFSZ, .remote = rb, .len = 8},
       "request 1: local range"},
  };
  for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
    mc_request_t two[2] = {ok, bad[k].r};
    mc_batch_t *b = mc_batch_new(A, 2);
    CHECK_EQ_INT(mc_batch_submit(A, b, mc_engine_segment_name(B), two, 2, &err), MC_EINVAL);
    CHECK_CONTAINS(err.msg, bad[k].msg);
    CHECK_EQ_INT((int)mc_batch_size(b), 0); /* nothing of it submitted */
    mc_batch_free(A, b);
  }
  /* A buffer outside every region at 0, a length 0 at 2: the check wins;
   * the other way round too (the first failing check). */
  uint8_t stray[64];
  mc_request_t three[3] = {ok, ok, ok};
  three[0].local = stray;
  three[2].len = 0;
  mc_batch_t *b = mc_batch_new(A, 3);
  CHECK_EQ_INT(mc_batch_submit(A, b, mc_engine_segment_name(B), three, 3, &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "request 2: length is 0");
  three[0] = ok;
  three[1].local = stray;
  three[2] = ok;
  three[2].opcode = 9;
  CHECK_EQ_INT(mc_batch_submit(A, b, mc_engine_segment_name(B), three, 3, &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "request 2: opcode 9");
  three[2] = ok;
  CHECK_EQ_INT(mc_batch_submit(A, b, mc_engine_segment_name(B), three, 3, &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "request 1: local range");
  CHECK_CONTAINS(err.msg, "not inside any memory region registered with this engine");
  mc_batch_free(A, b);
}

/* A batch over more regions than its own pin slots (4): every region
 * pinned once, the transfer correct, and each region unregisters at once
 * after the wait (no pin left behind); the same batch shape failing at its
 * last request pins nothing. */
static void test_many_regions_pinned(void) {
  enum { NREG = 9, SZ = 4096 };
  mc_err_t err = {0};
  uint8_t *reg[NREG];
  mc_request_t r[2 * NREG + 1];
  for (int k = 0; k < NREG; k++) {
    reg[k] = malloc(SZ);
    memset(reg[k], 0x30 + k, SZ);
    CHECK_EQ_INT(mc_engine_register(A, reg[k], SZ, "cpu", &err), 0);
  }
  /* Regions alternate: each is met again after the others. */
  for (int i = 0; i < 2 * NREG; i++)
    r[i] = (mc_request_t){.opcode = MC_OP_WRITE, .local = reg[i % NREG] + (i / NREG) * 2048,
                          .remote = (uint64_t)(uintptr_t)(bbuf + (size_t)i * 2048),
                          .len = 2048};
  mc_batch_t *b = mc_batch_new(A, 2 * NREG + 1);
  CHECK_EQ_INT(mc_batch_submit(A, b, mc_engine_segment_name(B), r, 2 * NREG, &err), 0);
  CHECK_EQ_INT(mc_batch_wait(A, b, 10000, &err), 0);
  for (int i = 0; i < 2 * NREG; i++)
    CHECK(memcmp(bbuf + (size_t)i * 2048, reg[i % NREG] + (i / NREG) * 2048, 2048) == 0);
  mc_batch_free(A, b);
  /* The same, the last request outside every region: refused whole. */
  uint8_t stray[16];
  r[2 * NREG] = r[0];
  r[2 * NREG].local = stray;
  r[2 * NREG].len = sizeof stray;
  b = mc_batch_new(A, 2 * NREG + 1);
  CHECK_EQ_INT(mc_batch_submit(A, b, mc_engine_segment_name(B), r, 2 * NREG + 1, &err),
               MC_EINVAL);
  CHECK_CONTAINS(err.msg, "request 18: local range");
  for (int k = 0; k < NREG; k++) {
    uint64_t t0 = mc_now_ns();
    CHECK_EQ_INT(mc_engine_unregister(A, reg[k], &err), 0);
    CHECK(mc_now_ns() - t0 < 500000000ull); /* not pinned: no grace period waited */
    free(reg[k]);
  }
  mc_batch_free(A, b);
}

static void test_unknown_peer(void) {
  mc_err_t err = {0};
  mc_request_t r = {.opcode = MC_OP_WRITE, .local = abuf, .remote = 4096, .len = 10};
  mc_batch_t *b = mc_batch_new(A, 1);
  /* P2P: the submit's handshake finds nobody there (as Mooncake's P2P
   * mode fails the submit, not the later status). */
  uint64_t t0 = mc_now_ns();
  int rc = mc_batch_submit(A, b, "127.0.0.1:1", &r, 1, &err);
  mc_batch_free(A, b);
  CHECK_EQ_INT(rc, MC_ECONNECT);
  CHECK(mc_now_ns() - t0 < 2000000000ull);
  CHECK_CONTAINS(err.msg, "P2P handshake with segment 127.0.0.1:1");
}

static void test_local_segment(void) {
  mc_err_t err = {0};
  uint8_t *tgt = malloc(1 << 20);
  CHECK_EQ_INT(mc_engine_register(A, tgt, 1 << 20, "cpu", &err), 0);
  fill(abuf, 1000, 5);
  mc_request_t r = {.opcode = MC_OP_WRITE, .local = abuf, .remote = (uint64_t)(uintptr_t)tgt,
                    .len = 1000};
  mc_batch_t *b = mc_batch_new(A, 1);
  CHECK_EQ_INT(mc_batch_submit(A, b, mc_engine_segment_name(A), &r, 1, &err), 0);
  CHECK_EQ_INT(mc_batch_wait(A, b, 1000, &err), 0);
  mc_batch_free(A, b);
  CHECK(memcmp(abuf, tgt, 1000) == 0);
  CHECK_EQ_INT(mc_engine_unregister(A, tgt, &err), 0);
  free(tgt);
}

static void collect(void *arg, const char *from, const void *msg, size_t len) {
  char *out = arg;
  snprintf(out, 256, "%s|%.*s", from, (int)len, (const char *)msg);
}

static void test_notify(void) {
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_engine_notify(A, mc_engine_segment_name(B), "blocks 1-3 done", 15, 2000, &err),
               0);
  char got[256] = "";
  CHECK_EQ_INT(mc_engine_drain_notifies(B, 10, collect, got), 1);
  char want[256];
  snprintf(want, sizeof want, "%s|blocks 1-3 done", mc_engine_segment_name(A));
  CHECK(strcmp(got, want) == 0);
}

static int collect_h(void *arg, const char *from, const void *msg, size_t len, mc_err_t *err) {
  (void)err;
  collect(arg, from, msg, len);
  return 0;
}

static int refuse_h(void *arg, const char *from, const void *msg, size_t len, mc_err_t *err) {
  (void)arg, (void)from, (void)msg, (void)len;
  return mc_err_set(err, MC_EBUSY, "handler budget full");
}

static void count_only(void *arg, const char *from, const void *msg, size_t len) {
  (void)from, (void)msg;
  *(size_t *)arg += len;
}

/* A peer whose connection to us closes (its engine is destroyed: as a
 * process dying) is noted once for mc_engine_take_lost_peers, and a waiter
 * in mc_engine_wait_notifies wakes for it at once. */
static void test_lost_peer_noted_and_wakes(void) {
  mc_engine_t *C = mk();
  CHECK(C != NULL);
  if (!C)
    return;
  char name[256];
  snprintf(name, sizeof name, "%s", mc_engine_segment_name(C));
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_engine_notify(C, mc_engine_segment_name(B), "hi", 2, 2000, &err), 0);
  char got[256] = "";
  CHECK_EQ_INT(mc_engine_drain_notifies(B, 10, collect, got), 1);
  char *lost[MC_LOST_PEERS_MAX];
  size_t n = mc_engine_take_lost_peers(B, lost, MC_LOST_PEERS_MAX);
  for (size_t i = 0; i < n; i++) /* earlier tests' peers */
    free(lost[i]);
  (void)mc_engine_wait_notifies(B, 0); /* and their wake-up */
  mc_engine_destroy(C);
  uint64_t t0 = mc_now_ns();
  CHECK_EQ_INT(mc_engine_wait_notifies(B, 5000000), 1);
  CHECK(mc_now_ns() - t0 < 2000000000ull);
  n = mc_engine_take_lost_peers(B, lost, MC_LOST_PEERS_MAX);
  int seen = 0;
  for (size_t i = 0; i < n; i++) {
    seen += !strcmp(lost[i], name);
    free(lost[i]);
  }
  CHECK_EQ_INT(seen, 1);
  CHECK_EQ_INT((int)mc_engine_take_lost_peers(B, lost, MC_LOST_PEERS_MAX), 0);
  /* A loss wakes a waiter once: a caller that never takes the names does
   * not spin on it. */
  CHECK_EQ_INT(mc_engine_wait_notifies(B, 0), 0);
}

/* Engine.cut_peer: D resets C's incoming connections while C writes 48 MiB
 * into D over TCP; once it returned, nothing of that write lands any more
 * (a sentinel D writes afterwards stays).  Then: a second cut finds
 * nothing, bad names are refused, and C's next write connects afresh.
 * (TCP only: the same-host CPU path copies without a connection of D's,
 * docs/connector.md "The lease".) */
#define CUT_N 768 /* 64 KiB requests: 48 MiB */
static mc_engine_t *C, *D;
static uint8_t *cbuf, *dbuf;
static int cut_rc;

static int cut_write(size_t nreq) {
  static mc_request_t r[CUT_N];
  for (size_t i = 0; i < nreq; i++)
    r[i] = (mc_request_t){.opcode = MC_OP_WRITE, .local = cbuf + i * 65536,
                          .remote = (uint64_t)(uintptr_t)(dbuf + i * 65536), .len = 65536};
  mc_err_t err = {0};
  mc_batch_t *b = mc_batch_new(C, nreq);
  int rc = mc_batch_submit(C, b, mc_engine_segment_name(D), r, nreq, &err);
  if (rc == 0)
    rc = mc_batch_wait(C, b, 10000, &err);
  mc_batch_free(C, b);
  return rc;
}

static void *cut_writer(void *arg) {
  (void)arg;
  cut_rc = cut_write(CUT_N);
  return NULL;
}

static void test_cut_peer(void) {
  const size_t n = (size_t)CUT_N * 65536;
  setenv("MC_SAME_HOST_CPU", "0", 1);
  C = mk();
  D = mk();
  unsetenv("MC_SAME_HOST_CPU");
  cbuf = malloc(n);
  dbuf = malloc(n);
  mc_err_t err = {0};
  CHECK(C && D && cbuf && dbuf);
  if (!C || !D || !cbuf || !dbuf || mc_engine_register(C, cbuf, n, "cpu", &err) < 0 ||
      mc_engine_register(D, dbuf, n, "cpu", &err) < 0)
    goto out;
  fill(cbuf, n, 77);
  memset(dbuf, 0, n);
  CHECK_EQ_INT(cut_write(1), 0); /* connected */
  pthread_t th;
  pthread_create(&th, NULL, cut_writer, NULL);
  /* The write is under way (its second block landed): the cut meets it in
   * flight, not a later submit's fresh connection. */
  uint64_t until = mc_now_ns() + 5000000000ull;
  while (memcmp(dbuf + 65536, cbuf + 65536, 4096) != 0 && mc_now_ns() < until)
    usleep(100);
  int cut = mc_engine_cut_peer(D, mc_engine_segment_name(C), 2000, &err);
  CHECK_EQ_INT(cut, 1);
  memset(dbuf, 0xA5, n);
  pthread_join(th, NULL);
  usleep(200000);
  size_t bad = 0;
  for (size_t i = 0; i < n; i++)
    bad += dbuf[i] != 0xA5;
  CHECK_EQ_INT((int)bad, 0);
  printf("  (the write %s the cut)\n", cut_rc == 0 ? "finished before" : "was cut by");
  CHECK_EQ_INT(mc_engine_cut_peer(D, mc_engine_segment_name(C), 2000, &err), 0);
  CHECK_EQ_INT(mc_engine_cut_peer(D, "", 2000, &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "empty");
  CHECK_EQ_INT(mc_engine_cut_peer(D, mc_engine_segment_name(D), 2000, &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "own segment");
  CHECK_EQ_INT(mc_engine_cut_peer(D, "10.9.9.9:1", 2000, &err), 0);
  int rc = -1;
  for (int k = 0; k < 3 && rc != 0; k++) /* the reset may reach C just after a submit */
    rc = cut_write(16);
  CHECK_EQ_INT(rc, 0);
  CHECK(memcmp(cbuf, dbuf, 16 * 65536) == 0);
out:
  mc_engine_destroy(C);
  mc_engine_destroy(D);
  free(cbuf);
  free(dbuf);
}

/* A waiter that never takes the lost names is woken once per loss, then
 * waits again (it would spin if a noted name kept it awake). */
static void test_lost_peer_wakes_once(void) {
  mc_engine_t *C = mk();
  CHECK(C != NULL);
  if (!C)
    return;
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_engine_notify(C, mc_engine_segment_name(B), "hi", 2, 2000, &err), 0);
  char got[256] = "";
  CHECK_EQ_INT(mc_engine_drain_notifies(B, 10, collect, got), 1);
  (void)mc_engine_wait_notifies(B, 0);
  mc_engine_destroy(C);
  CHECK_EQ_INT(mc_engine_wait_notifies(B, 5000000), 1);
  uint64_t t0 = mc_now_ns();
  CHECK_EQ_INT(mc_engine_wait_notifies(B, 50000), 0); /* names not taken: still waits */
  CHECK(mc_now_ns() - t0 >= 40000000ull);
  char *lost[MC_LOST_PEERS_MAX];
  size_t n = mc_engine_take_lost_peers(B, lost, MC_LOST_PEERS_MAX);
  CHECK(n >= 1);
  for (size_t i = 0; i < n; i++)
    free(lost[i]);
}

/* Unread notifications are bounded in bytes (MC_NOTIFY_QUEUE_MB=1 here):
 * the sender gets the refusal, nothing is dropped; draining makes room. */
static void test_notify_budget(void) {
  size_t n = 600 << 10;
  char *big = calloc(1, n);
  mc_err_t err = {0};
  const char *bs = mc_engine_segment_name(B);
  CHECK_EQ_INT(mc_engine_notify(A, bs, big, n, 5000, &err), 0);
  CHECK(mc_engine_notify(A, bs, big, n, 5000, &err) < 0);
  CHECK_CONTAINS(err.msg, "MC_NOTIFY_QUEUE_MB");
  mc_engine_stats_t st;
  mc_engine_get_stats(B, &st);
  CHECK(st.notify_queue_bytes > n && st.notify_queue_bytes <= st.notify_queue_limit);
  CHECK_EQ_INT(st.notify_refused, 1);
  size_t got = 0;
  CHECK_EQ_INT(mc_engine_drain_notifies(B, 10, count_only, &got), 1);
  CHECK_EQ_INT(got, n);
  CHECK_EQ_INT(mc_engine_notify(A, bs, big, n, 5000, &err), 0);
  CHECK_EQ_INT(mc_engine_drain_notifies(B, 10, count_only, &got), 1);
  mc_engine_get_stats(B, &st);
  CHECK_EQ_INT(st.notify_queue_bytes, 0);
  /* A handler's refusal reaches the sender too. */
  mc_engine_set_notify_handler(B, refuse_h, NULL);
  CHECK(mc_engine_notify(A, bs, "x", 1, 5000, &err) < 0);
  CHECK_CONTAINS(err.msg, "handler budget full");
  mc_engine_set_notify_handler(B, NULL, NULL);
  free(big);
}

static void test_notify_handler(void) {
  char got[256] = "";
  mc_engine_set_notify_handler(B, collect_h, got);
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_engine_notify(A, mc_engine_segment_name(B), "via handler", 11, 2000, &err), 0);
  mc_engine_set_notify_handler(B, NULL, NULL);
  char want[256];
  snprintf(want, sizeof want, "%s|via handler", mc_engine_segment_name(A));
  CHECK(strcmp(got, want) == 0);
  char none[256] = "";
  CHECK_EQ_INT(mc_engine_drain_notifies(B, 10, collect, none), 0); /* not queued */
}

/* A target that accepts and never answers: the waiter times out, and the
 * destination buffer is never written afterwards. */
static int silent_fd;
static atomic_int silent_stop;
static void *silent_server(void *arg) {
  (void)arg;
  int c = accept(silent_fd, NULL, NULL);
  struct timeval tv = {.tv_sec = 0, .tv_usec = 50000};
  if (c >= 0)
    setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  char buf[65536];
  while (c >= 0 && !silent_stop && read(c, buf, sizeof buf) != 0) {
  }
  if (c >= 0)
    close(c);
  return NULL;
}

/* The silent server started on a loopback port: seg names it.  0, or -1. */
static int silent_open(char *seg, size_t n, pthread_t *th) {
  silent_stop = 0;
  silent_fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  if (silent_fd < 0 || bind(silent_fd, (struct sockaddr *)&sa, sizeof sa) != 0)
    return -1;
  listen(silent_fd, 4);
  socklen_t sl = sizeof sa;
  getsockname(silent_fd, (struct sockaddr *)&sa, &sl);
  snprintf(seg, n, "127.0.0.1:%d", ntohs(sa.sin_port));
  return pthread_create(th, NULL, silent_server, NULL) == 0 ? 0 : -1;
}

static void silent_close(pthread_t th) {
  silent_stop = 1;
  shutdown(silent_fd, SHUT_RDWR);
  close(silent_fd);
  pthread_join(th, NULL);
}

static void test_timeout_cancels(void) {
  char seg[64];
  pthread_t th;
  CHECK_EQ_INT(silent_open(seg, sizeof seg, &th), 0);
  mc_request_t r = {.opcode = MC_OP_READ, .local = abuf, .remote = 4096, .len = 1 << 20};
  mc_err_t err = {0};
  mc_batch_t *b = mc_batch_new(A, 1);
  CHECK_EQ_INT(mc_batch_submit(A, b, seg, &r, 1, &err), 0);
  /* Waiting for idleness times out without cancelling: still pending. */
  uint64_t t0 = mc_now_ns();
  CHECK_EQ_INT(mc_batch_wait_idle(b, 100000000ull), 0);
  CHECK(mc_now_ns() - t0 >= 95000000ull);
  CHECK_EQ_INT((int)mc_batch_pending(b), 1);
  mc_task_status_t s0;
  mc_batch_status(b, 0, &s0);
  CHECK_EQ_INT(s0.state, MC_TASK_PENDING);
  t0 = mc_now_ns();
  CHECK_EQ_INT(mc_batch_wait(A, b, 300, &err), MC_ETIMEDOUT);
  uint64_t dt = mc_now_ns() - t0;
  CHECK(dt >= 290000000ull && dt < 2000000000ull);
  CHECK_CONTAINS(err.msg, "timed out");
  mc_task_status_t s;
  mc_batch_status(b, 0, &s);
  CHECK_EQ_INT(s.state, MC_TASK_TIMEOUT);
  mc_batch_free(A, b);
  silent_close(th);
}

/* A submit that fails (a local buffer outside every region) pins nothing,
 * even while the batch has an earlier op in flight: the region of its
 * first request unregisters at once, and the batch's op in flight is not
 * canceled for it (before, the failed submit's pins stayed until the batch
 * went idle: the unregister waited MC_UNREGISTER_GRACE_MS and canceled the
 * batch). */
static void test_failed_submit_pins_nothing(void) {
  char seg[64];
  pthread_t th;
  CHECK_EQ_INT(silent_open(seg, sizeof seg, &th), 0);
  mc_err_t err = {0};
  mc_request_t r = {.opcode = MC_OP_READ, .local = abuf, .remote = 4096, .len = 4096};
  mc_batch_t *b = mc_batch_new(A, 3);
  CHECK_EQ_INT(mc_batch_submit(A, b, seg, &r, 1, &err), 0); /* stays in flight */
  uint8_t *x = malloc(4096), stray[16];
  CHECK_EQ_INT(mc_engine_register(A, x, 4096, "cpu", &err), 0);
  mc_request_t two[2] = {{.opcode = MC_OP_READ, .local = x, .remote = 4096, .len = 8},
                         {.opcode = MC_OP_READ, .local = stray, .remote = 4096, .len = 8}};
  CHECK_EQ_INT(mc_batch_submit(A, b, seg, two, 2, &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "request 1: local range");
  CHECK_EQ_INT((int)mc_batch_size(b), 1);
  uint64_t t0 = mc_now_ns();
  CHECK_EQ_INT(mc_engine_unregister(A, x, &err), 0);
  CHECK(mc_now_ns() - t0 < 500000000ull);
  free(x);
  mc_task_status_t s;
  CHECK_EQ_INT(mc_batch_status(b, 0, &s), 0);
  CHECK_EQ_INT(s.state, MC_TASK_PENDING); /* not canceled by that unregister */
  CHECK_EQ_INT(mc_batch_wait(A, b, 100, &err), MC_ETIMEDOUT);
  mc_batch_free(A, b);
  silent_close(th);
}

/* A target that resets (RST) its first `resets` connections once their
 * HELLO arrived, then answers HELLO and WRITEs, keeping the last payload. */
static struct {
  int fd, resets, conns;
  atomic_int stop;
  uint8_t payload[65536];
  size_t got;
  char seg[64];
} rs;

static int read_full(int fd, void *p, size_t n) {
  size_t off = 0;
  while (off < n) {
    ssize_t k = read(fd, (char *)p + off, n - off);
    if (k <= 0)
      return -1;
    off += (size_t)k;
  }
  return 0;
}

static void *resetting_server(void *arg) {
  (void)arg;
  while (!rs.stop) {
    int c = accept(rs.fd, NULL, NULL);
    if (c < 0)
      break;
    int k = rs.conns++;
    struct timeval tv = {.tv_sec = 0, .tv_usec = 500000}; /* idle: closed, so join ends */
    setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    uint8_t h[MC_WIRE_HDR_SIZE], body[8192];
    uint64_t len, rid;
    uint32_t count;
    if (read_full(c, h, sizeof h) < 0 || (memcpy(&len, h + 24, 8), len > sizeof body) ||
        read_full(c, body, len) < 0 || h[5] != MC_WIRE_HELLO) {
      close(c);
      continue;
    }
    memcpy(&rid, h + 16, 8);
    if (k < rs.resets) {
      struct linger lg = {1, 0};
      setsockopt(c, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
      close(c);
      continue;
    }
    char ack[128];
    int al = snprintf(ack, sizeof ack, "{\"segment\":\"%s\"}", rs.seg);
    mc_wire_hdr_t ah = {.type = MC_WIRE_HELLO_ACK, .req_id = rid, .length = (uint64_t)al};
    uint8_t out[MC_WIRE_HDR_SIZE + 128];
    mc_wire_encode(&ah, out);
    memcpy(out + MC_WIRE_HDR_SIZE, ack, (size_t)al);
    (void)!write(c, out, MC_WIRE_HDR_SIZE + (size_t)al);
    while (read_full(c, h, sizeof h) == 0 && h[5] == MC_WIRE_WRITE) {
      memcpy(&len, h + 24, 8);
      memcpy(&rid, h + 16, 8);
      memcpy(&count, h + 8, 4);
      uint64_t table = (uint64_t)count * MC_WIRE_ENT_SIZE;
      if (table > sizeof body || len < table || len - table > sizeof rs.payload ||
          read_full(c, body, table) < 0 || read_full(c, rs.payload, len - table) < 0)
        break;
      rs.got = len - table;
      mc_wire_hdr_t wh = {.type = MC_WIRE_WRITE_ACK, .req_id = rid};
      mc_wire_encode(&wh, out);
      (void)!write(c, out, MC_WIRE_HDR_SIZE);
    }
    close(c);
  }
  return NULL;
}

/* Our connection reset before the target's HELLO_ACK is dialed again with
 * the same requests (at most 8 times); a target that always resets fails
 * the write after 9 handshakes, saying so. */
static void test_reset_before_hello_ack_redials(void) {
  for (int round = 0; round < 2; round++) {
    memset(&rs, 0, sizeof rs);
    rs.resets = round == 0 ? 3 : 1000;
    rs.fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    CHECK(bind(rs.fd, (struct sockaddr *)&sa, sizeof sa) == 0);
    listen(rs.fd, 16);
    socklen_t sl = sizeof sa;
    getsockname(rs.fd, (struct sockaddr *)&sa, &sl);
    snprintf(rs.seg, sizeof rs.seg, "127.0.0.1:%d", ntohs(sa.sin_port));
    pthread_t th;
    pthread_create(&th, NULL, resetting_server, NULL);
    mc_engine_stats_t st0, st1;
    mc_engine_get_stats(A, &st0);
    fill(abuf, 65536, 77u + (uint32_t)round);
    mc_request_t r = {.opcode = MC_OP_WRITE, .local = abuf, .remote = 4096, .len = 65536};
    mc_err_t err = {0};
    mc_batch_t *b = mc_batch_new(A, 1);
    CHECK_EQ_INT(mc_batch_submit(A, b, rs.seg, &r, 1, &err), 0);
    int rc = mc_batch_wait(A, b, 10000, &err);
    mc_batch_free(A, b);
    mc_engine_get_stats(A, &st1);
    if (round == 0) {
      CHECK_EQ_INT(rc, 0);
      CHECK(rs.conns >= 4); /* a 5th: the engine's RPC after the write, which it refuses */
      CHECK(rs.got == 65536 && memcmp(rs.payload, abuf, 65536) == 0);
      /* 3 reset handshakes: all redials of the write, or one of them the
       * P2P reachability check that a first submit to an unknown segment
       * makes (a plain connect, closed at once) */
      CHECK(st1.handshake_redials - st0.handshake_redials >= 2 &&
            st1.handshake_redials - st0.handshake_redials <= 3);
    } else {
      CHECK_EQ_INT(rc, MC_EPEERCLOSED);
      CHECK_CONTAINS(err.msg, "the last of 9 handshakes");
      CHECK(rs.got == 0);
      /* 9 handshakes for the write (the engine's route may dial the segment
       * for an RPC of its own too, counted alike) */
      CHECK(rs.conns >= 9);
      CHECK(st1.handshake_redials - st0.handshake_redials >= 8);
    }
    rs.stop = 1;
    shutdown(rs.fd, SHUT_RDWR);
    close(rs.fd);
    pthread_join(th, NULL);
  }
}

/* Detached notifications to a peer that never answers (a listener that
 * never accepts: its HELLO never comes): the first MC_ENGINE_DETACHED_MAX
 * return at once and are held, the next one waits for its receipt (the
 * bound: nothing grows past it), and every held one is canceled at its
 * deadline (300 ms; the handshake timeout would be 5 s) and freed. */
static void test_detached_notifications_are_bounded(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  CHECK(bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0);
  listen(fd, 16);
  socklen_t sl = sizeof sa;
  getsockname(fd, (struct sockaddr *)&sa, &sl);
  char seg[64];
  snprintf(seg, sizeof seg, "127.0.0.1:%d", ntohs(sa.sin_port));
  mc_engine_t *e = mk();
  CHECK(e != NULL);
  mc_err_t err = {0};
  char msg[16] = "hello";
  uint64_t t0 = mc_now_ns();
  for (int i = 0; i < MC_ENGINE_DETACHED_MAX; i++)
    CHECK_EQ_INT(mc_engine_notify_detached(e, seg, msg, sizeof msg, 300, "test", &err), 0);
  CHECK(mc_now_ns() - t0 < 2000000000ull); /* none waited for a receipt */
  mc_engine_stats_t st;
  mc_engine_get_stats(e, &st);
  CHECK(st.detached_msgs > 0 && st.detached_msgs <= MC_ENGINE_DETACHED_MAX);
  CHECK(st.detached_bytes == st.detached_msgs * sizeof msg);
  /* Full (or nearly: reaping may have freed some): one more call past the
   * budget waits for its own receipt and fails at its timeout. */
  uint64_t t1 = mc_now_ns();
  int rc = 0;
  for (int i = 0; i < 64 && rc == 0; i++)
    rc = mc_engine_notify_detached(e, seg, msg, sizeof msg, 300, "test", &err);
  CHECK(rc < 0);
  CHECK(mc_now_ns() - t1 >= 250000000ull);
  mc_engine_get_stats(e, &st);
  CHECK(st.detached_msgs <= MC_ENGINE_DETACHED_MAX);
  /* Past their deadline: canceled and freed (reaped when stats are read). */
  uint64_t until = mc_now_ns() + 3000000000ull;
  do {
    struct timespec ts = {0, 20000000};
    nanosleep(&ts, NULL);
    mc_engine_get_stats(e, &st);
  } while (st.detached_msgs > 0 && mc_now_ns() < until);
  CHECK_EQ_INT(st.detached_msgs, 0);
  CHECK_EQ_INT(st.detached_bytes, 0);
  mc_engine_destroy(e);
  close(fd);
}

/* Garbage on the data port: that connection is dropped, the engine keeps
 * serving others. */
static void test_garbage_connection(void) {
  int port = mc_engine_rpc_port(B);
  for (int round = 0; round < 3; round++) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    CHECK(connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0);
    uint8_t junk[4096];
    fill(junk, sizeof junk, 1234u + (uint32_t)round);
    if (round == 1) { /* a valid magic and version, then an absurd WRITE */
      mc_wire_hdr_t h = {.type = MC_WIRE_WRITE, .count = 1u << 30, .length = 1};
      mc_wire_encode(&h, junk);
    }
    if (round == 2) { /* truncated header */
      (void)!write(fd, junk, 10);
      close(fd);
      continue;
    }
    (void)!write(fd, junk, sizeof junk);
    char c;
    ssize_t n = read(fd, &c, 1); /* the engine closes on us */
    CHECK(n <= 0);
    close(fd);
  }
  mc_err_t err = {0};
  CHECK_EQ_INT(xfer(MC_OP_WRITE, 0, 0, 4096, &err), 0);
}

/* Callers taking the connection over for small sync requests while other
 * threads stream large batches through the I/O thread. */
static void *small_sync_worker(void *arg) {
  long id = (long)arg;
  uint8_t *src = abuf + (40u << 20) + (size_t)id * 8192;
  uint8_t *dst = bbuf + (40u << 20) + (size_t)id * 8192;
  for (int i = 0; i < 1500; i++) {
    if (!(i & 1))
      memset(src, (int)(id * 31 + i) & 0xff, 4096);
    mc_request_t r = {.opcode = (i & 1) ? MC_OP_READ : MC_OP_WRITE,
                      .local = (i & 1) ? src + 4096 : src,
                      .remote = (uint64_t)(uintptr_t)dst, .len = 4096};
    mc_err_t err = {0};
    mc_batch_t *b = mc_batch_new(A, 1);
    int rc = mc_batch_submit_sync(A, b, mc_engine_segment_name(B), &r, 1, &err);
    if (rc == 0)
      rc = mc_batch_wait(A, b, 10000, &err);
    mc_batch_free(A, b);
    if (rc != 0) {
      fprintf(stderr, "worker %ld: %s\n", id, err.msg);
      return (void *)1;
    }
    if ((i & 1) && memcmp(src, src + 4096, 4096) != 0)
      return (void *)2; /* read back what this thread wrote last */
  }
  return NULL;
}

static void *bulk_worker(void *arg) {
  (void)arg;
  enum { N = 512, BLK = 65536 };
  static mc_request_t r[N];
  for (int rep = 0; rep < 6; rep++) {
    for (int i = 0; i < N; i++)
      r[i] = (mc_request_t){.opcode = rep & 1 ? MC_OP_READ : MC_OP_WRITE,
                            .local = abuf + (size_t)i * BLK,
                            .remote = (uint64_t)(uintptr_t)(bbuf + (size_t)i * BLK), .len = BLK};
    mc_err_t err = {0};
    mc_batch_t *b = mc_batch_new(A, N);
    int rc = mc_batch_submit(A, b, mc_engine_segment_name(B), r, N, &err);
    if (rc == 0)
      rc = mc_batch_wait(A, b, 20000, &err);
    mc_batch_free(A, b);
    if (rc != 0) {
      fprintf(stderr, "bulk: %s\n", err.msg);
      return (void *)1;
    }
  }
  return NULL;
}

static void test_fast_path_and_bulk_concurrently(void) {
  pthread_t th[5];
  for (long i = 0; i < 4; i++)
    pthread_create(&th[i], NULL, small_sync_worker, (void *)i);
  pthread_create(&th[4], NULL, bulk_worker, NULL);
  int bad = 0;
  for (int i = 0; i < 5; i++) {
    void *rv;
    pthread_join(th[i], &rv);
    bad |= rv != NULL;
  }
  CHECK(!bad);
}

/* Where a local buffer lives, from the regions table (the GPU locate pass
 * asks it before the driver): the region's device, -1 for host memory,
 * -2 outside every region or straddling its end. */
/* An unregister that waited its grace period calls the stall hook once
 * (which may cut the holders short), then waits out the rest. */
typedef struct stall_ctx {
  mc_regions_t *r;
  mc_region_t *pin;
  int calls, release;
} stall_ctx_t;

static void stall_hook(void *arg, mc_region_t *reg) {
  stall_ctx_t *s = arg;
  s->calls++;
  CHECK(reg == s->pin);
  if (s->release)
    mc_regions_release(s->r, s->pin);
}

static void test_regions_remove_stall(void) {
  mc_regions_t r;
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_regions_init(&r), 0);
  CHECK_EQ_INT(mc_regions_add(&r, 0x10000, 0x1000, "cpu", &err), 0);
  stall_ctx_t s = {.r = &r, .release = 1};
  mc_regions_lock(&r);
  s.pin = mc_regions_pin_local_locked(&r, 0x10100, 16);
  CHECK(mc_regions_pin_local_locked(&r, 0x20000, 16) == NULL); /* no region there */
  mc_regions_unlock(&r);
  CHECK(s.pin != NULL);
  CHECK_EQ_INT(mc_regions_remove_cb(&r, 0x10000, 5000, 20, stall_hook, &s, &err), 0);
  CHECK_EQ_INT(s.calls, 1);
  CHECK_EQ_INT((int)mc_regions_count(&r), 0);
  /* A hook that cannot cut it: the bounded wait fails, naming the holder. */
  CHECK_EQ_INT(mc_regions_add(&r, 0x10000, 0x1000, "cpu", &err), 0);
  s = (stall_ctx_t){.r = &r, .release = 0};
  mc_regions_lock(&r);
  s.pin = mc_regions_pin_local_locked(&r, 0x10000, 0x1000);
  mc_regions_unlock(&r);
  CHECK_EQ_INT(mc_regions_remove_cb(&r, 0x10000, 100, 20, stall_hook, &s, &err), MC_EBUSY);
  CHECK_EQ_INT(s.calls, 1);
  CHECK(strstr(err.msg, "last pinned by a transfer of this engine") != NULL);
  /* No grace shorter than the wait: no hook. */
  s.calls = 0;
  CHECK_EQ_INT(mc_regions_remove_cb(&r, 0x10000, 30, 30, stall_hook, &s, &err), MC_EBUSY);
  CHECK_EQ_INT(s.calls, 0);
  mc_regions_release(&r, s.pin);
  CHECK_EQ_INT(mc_regions_remove_cb(&r, 0x10000, 100, 20, stall_hook, &s, &err), 0);
  CHECK_EQ_INT(s.calls, 0);
  mc_regions_destroy(&r);
}

static void test_regions_device_of(void) {
  mc_regions_t r;
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_regions_init(&r), 0);
  CHECK_EQ_INT(mc_regions_add(&r, 0x10000, 0x1000, "cpu", &err), 0);
  CHECK_EQ_INT(mc_regions_add(&r, 0x40000, 0x4000, "cuda:3", &err), 0);
  uint64_t lo = 0, hi = 0;
  CHECK_EQ_INT(mc_regions_device_of(&r, 0x10800, 0x100, &lo, &hi), -1);
  CHECK(lo == 0x10000 && hi == 0x11000);
  CHECK_EQ_INT(mc_regions_device_of(&r, 0x42000, 0x2000, &lo, &hi), 3);
  CHECK(lo == 0x40000 && hi == 0x44000);
  CHECK_EQ_INT(mc_regions_device_of(&r, 0x43000, 0x2000, &lo, &hi), -2); /* past the end */
  CHECK_EQ_INT(mc_regions_device_of(&r, 0x20000, 0x10, &lo, &hi), -2);
  CHECK_EQ_INT(mc_regions_device_of(&r, 0x10000, 0, &lo, &hi), -2);
  CHECK_EQ_INT(mc_regions_remove(&r, 0x40000, -1, &err), 0);
  /* A pinned region: the bounded wait fails naming the holder; the region
   * refuses new accesses meanwhile and a later remove finishes. */
  mc_region_t *pin;
  static const char who[] = "10.0.0.9:4242";
  CHECK_EQ_INT(mc_regions_acquire_by(&r, 0x10000, 16, "me", who, &pin, &err), 0);
  CHECK_EQ_INT(mc_regions_remove(&r, 0x10000, 50, &err), MC_EBUSY);
  CHECK_CONTAINS(err.msg, "10.0.0.9:4242");
  CHECK_EQ_INT(mc_regions_device_of(&r, 0x10000, 16, &lo, &hi), -2);
  mc_regions_release(&r, pin);
  CHECK_EQ_INT(mc_regions_remove(&r, 0x10000, 50, &err), 0);
  CHECK_EQ_INT(mc_regions_device_of(&r, 0x42000, 0x10, &lo, &hi), -2);
  mc_regions_destroy(&r);
}

/* mc.describe's reply (what same-host GPU peers fetch with every transfer)
 * is kept between changes and rebuilt after each: registering, and
 * unregistering, show at once. */
static void test_describe_follows_changes(void) {
  mc_engine_opts_t o = {.local_hostname = "127.0.0.1", .metadata_server = "P2PHANDSHAKE"};
  mc_engine_t *e = NULL;
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_engine_create(&o, &e, &err), 0);
  char *x = malloc(8192), *y = malloc(8192);
  char ax[32], ay[32];
  snprintf(ax, sizeof ax, "%llu", (unsigned long long)(uintptr_t)x);
  snprintf(ay, sizeof ay, "%llu", (unsigned long long)(uintptr_t)y);
  CHECK_EQ_INT(mc_engine_register(e, x, 8192, "cpu", &err), 0);
  char *d1 = mc_engine_describe(e), *d2 = mc_engine_describe(e);
  CHECK(d1 && d2 && strstr(d1, ax) && !strstr(d1, ay));
  CHECK(!strcmp(d1, d2)); /* unchanged: the same text */
  CHECK_EQ_INT(mc_engine_register(e, y, 8192, "cpu", &err), 0);
  char *d3 = mc_engine_describe(e);
  CHECK(d3 && strstr(d3, ax) && strstr(d3, ay));
  CHECK_EQ_INT(mc_engine_unregister(e, x, &err), 0);
  char *d4 = mc_engine_describe(e);
  CHECK(d4 && !strstr(d4, ax) && strstr(d4, ay));
  CHECK_EQ_INT(mc_engine_unregister(e, y, &err), 0);
  free(d1);
  free(d2);
  free(d3);
  free(d4);
  mc_engine_destroy(e);
  free(x);
  free(y);
}

int main(void) {
  setenv("MC_NOTIFY_QUEUE_MB", "1", 1); /* test_notify_budget */
  if (two_engines_up(BUFSZ) < 0)
    return 1;
  RUN(test_regions_device_of);
  RUN(test_regions_remove_stall);
  RUN(test_sizes_write_read);
  RUN(test_wait_idle);
  RUN(test_batch_10k_blocks);
  RUN(test_out_of_range_refused);
  RUN(test_mixed_batch_partial_failure);
  RUN(test_bad_entry_inside_one_op);
  RUN(test_bad_arguments);
  RUN(test_checks_after_a_cached_region);
  RUN(test_many_regions_pinned);
  RUN(test_unknown_peer);
  RUN(test_local_segment);
  RUN(test_notify);
  RUN(test_notify_handler);
  RUN(test_lost_peer_noted_and_wakes);
  RUN(test_lost_peer_wakes_once);
  RUN(test_notify_budget);
  RUN(test_fast_path_and_bulk_concurrently);
  RUN(test_timeout_cancels);
  RUN(test_failed_submit_pins_nothing);
  RUN(test_detached_notifications_are_bounded);
  RUN(test_garbage_connection);
  RUN(test_describe_follows_changes);
  RUN(test_reset_before_hello_ack_redials);
  RUN(test_cut_peer);
  two_engines_down();
  TEST_MAIN_END();
}
