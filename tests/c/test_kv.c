/* send_kv / recv_kv between two engines in one process (runs under ASan). */
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "engine/engine.h"
#include "kv/kv_internal.h" /* test_errors looks at the waiter list */
#include "kv/kv_transfer.h"
#include "lookup/lookup_buffer.h"
#include "testlib.h"

#define BB 4096
static mc_engine_t *P, *C;
static mc_lookup_t *LB;
static mc_kv_t *KP, *KC;
static uint8_t *pbuf, *cbuf;

static mc_engine_t *mk(void) {
  mc_engine_opts_t o = {.local_hostname = "127.0.0.1", .metadata_server = "P2PHANDSHAKE"};
  mc_err_t err = {0};
  mc_engine_t *e = NULL;
  if (mc_engine_create(&o, &e, &err) < 0)
    fprintf(stderr, "%s\n", err.msg);
  return e;
}

static void test_push_longest_prefix(void) {
  int32_t t[80];
  for (int i = 0; i < 80; i++)
    t[i] = 1000 + i * 7;
  for (size_t i = 0; i < 5 * BB; i++)
    pbuf[i] = (uint8_t)(i * 13 + 1);
  mc_lookup_extent_t src[5], dst[5];
  for (int i = 0; i < 5; i++) {
    src[i] = (mc_lookup_extent_t){.addr = (uint64_t)(uintptr_t)(pbuf + i * BB), .len = BB};
    dst[i] = (mc_lookup_extent_t){.addr = (uint64_t)(uintptr_t)(cbuf + (9 - i) * BB), .len = BB};
  }
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_lookup_insert(LB, t, 64, 4, src, NULL, 0, 0, NULL, &err), 4);
  long n = mc_kv_recv(KC, mc_engine_segment_name(P), t, 80, 4, dst, 5, 1, 5000, &err);
  CHECK_EQ_INT(n, 64);
  for (int i = 0; i < 4; i++)
    CHECK(memcmp(pbuf + i * BB, cbuf + (9 - i) * BB, BB) == 0);
  t[20] = 3; /* changes block 1: only block 0 matches */
  CHECK_EQ_INT(mc_kv_recv(KC, mc_engine_segment_name(P), t, 64, 4, dst, 4, 1, 5000, &err), 16);
  mc_kv_stats_t s;
  mc_kv_get_stats(KP, &s);
  CHECK_EQ_INT(s.requests_served, 2);
  CHECK_EQ_INT(s.bytes_served, 5 * BB);
}

static void test_errors(void) {
  int64_t t[32] = {0};
  mc_lookup_extent_t dst[2] = {{.addr = (uint64_t)(uintptr_t)cbuf, .len = BB},
                               {.addr = (uint64_t)(uintptr_t)cbuf + BB, .len = BB}};
  mc_err_t err = {0};
  /* Asking the consumer, which holds no KV. */
  long n = mc_kv_recv(KP, mc_engine_segment_name(C), t, 32, 8, dst, 2, 1, 5000, &err);
  CHECK_EQ_INT(n, MC_EINVAL);
  CHECK_CONTAINS(err.msg, "not a producer");
  CHECK_EQ_INT(mc_kv_recv(KC, "", t, 32, 8, dst, 2, 1, 100, &err), MC_EINVAL);
  CHECK_EQ_INT(mc_kv_recv(KC, mc_engine_segment_name(P), t, 32, 3, dst, 2, 1, 100, &err),
               MC_EINVAL);
}

static void test_pull_with_skip_and_release(void) {
  int32_t t[64];
  for (int i = 0; i < 64; i++)
    t[i] = 5000 + i * 3;
  for (size_t i = 0; i < 4 * BB; i++)
    pbuf[8 * BB + i] = (uint8_t)(i * 7 + 5);
  mc_lookup_extent_t src[4], dst[4];
  for (int i = 0; i < 4; i++) {
    src[i] = (mc_lookup_extent_t){.addr = (uint64_t)(uintptr_t)(pbuf + (8 + i) * BB), .len = BB};
    dst[i] = (mc_lookup_extent_t){.addr = (uint64_t)(uintptr_t)(cbuf + (12 + i) * BB), .len = BB};
  }
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_lookup_insert(LB, t, 64, 4, src, NULL, 0, 0, NULL, &err), 4);
  memset(cbuf + 12 * BB, 0, 4 * BB);
  /* The consumer has block 0 already: dst starts at block 1. */
  long n = mc_kv_pull_ex(KC, mc_engine_segment_name(P), t, 64, 4, 1, dst + 1, 3, 1, 5000, &err);
  CHECK_EQ_INT(n, 64);
  for (int i = 1; i < 4; i++)
    CHECK(memcmp(pbuf + (8 + i) * BB, cbuf + (12 + i) * BB, BB) == 0);
  CHECK(cbuf[12 * BB] == 0 && cbuf[13 * BB - 1] == 0); /* block 0 untouched */
  /* A destination of the wrong length: an error naming it, lease released. */
  mc_lookup_extent_t bad = {.addr = (uint64_t)(uintptr_t)cbuf, .len = BB / 2};
  CHECK(mc_kv_pull(KC, mc_engine_segment_name(P), t, 16, 4, &bad, 1, 1, 5000, &err) < 0);
  CHECK_CONTAINS(err.msg, "destination extent 0 is 2048 bytes");
  /* A miss leases nothing. */
  t[0] = 1;
  CHECK_EQ_INT(mc_kv_pull(KC, mc_engine_segment_name(P), t, 64, 4, dst, 4, 1, 5000, &err), 0);
  mc_kv_stats_t s;
  for (int i = 0; i < 500; i++) { /* releases go out in the background */
    mc_kv_get_stats(KP, &s);
    if (s.leases_released == 2)
      break;
    usleep(2000);
  }
  CHECK_EQ_INT(s.leases_granted, 2);
  CHECK_EQ_INT(s.leases_released, 2);
  CHECK_EQ_INT(s.leases_expired, 0);
  mc_kv_get_stats(KC, &s);
  CHECK_EQ_INT(s.pull_hits, 1);
  CHECK_EQ_INT(s.pull_bytes, 3 * BB);
  CHECK_EQ_INT(s.pull_errors, 1);
}

/* Different TP sizes / sliding windows: a dest tagged MC_KV_DEST_SLICE | off
 * READs len bytes from byte off of the producer's extent; length 0 skips it;
 * a slice past the extent is refused before any READ. */
static void test_pull_slices_and_skips(void) {
  int32_t t[32];
  for (int i = 0; i < 32; i++)
    t[i] = 7000 + i * 5;
  for (size_t i = 0; i < 2 * BB; i++)
    pbuf[10 * BB + i] = (uint8_t)(i * 13 + 1);
  mc_lookup_extent_t src[2];
  for (int i = 0; i < 2; i++)
    src[i] = (mc_lookup_extent_t){.addr = (uint64_t)(uintptr_t)(pbuf + (10 + i) * BB), .len = BB};
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_lookup_insert(LB, t, 32, 4, src, NULL, 0, 0, NULL, &err), 2);
  memset(cbuf + 4 * BB, 0, 2 * BB);
  mc_lookup_extent_t dst[2] = {
      {.addr = (uint64_t)(uintptr_t)(cbuf + 4 * BB), .len = BB / 2,
       .tag = MC_KV_DEST_SLICE | (BB / 2)},
      {.addr = (uint64_t)(uintptr_t)(cbuf + 5 * BB), .len = 0, .tag = MC_KV_DEST_SLICE}};
  CHECK_EQ_INT(mc_kv_pull(KC, mc_engine_segment_name(P), t, 32, 4, dst, 2, 1, 5000, &err), 32);
  CHECK(memcmp(pbuf + 10 * BB + BB / 2, cbuf + 4 * BB, BB / 2) == 0);
  CHECK(cbuf[4 * BB + BB / 2] == 0 && cbuf[5 * BB] == 0 && cbuf[6 * BB - 1] == 0);
  CHECK_EQ_INT(mc_lookup_insert(LB, t, 32, 4, src, NULL, 0, 0, NULL, &err), 2);
  dst[1] = (mc_lookup_extent_t){.addr = (uint64_t)(uintptr_t)(cbuf + 5 * BB), .len = BB / 2,
                                .tag = MC_KV_DEST_SLICE | (BB / 2 + 1)};
  CHECK(mc_kv_pull(KC, mc_engine_segment_name(P), t, 32, 4, dst, 2, 1, 5000, &err) < 0);
  CHECK_CONTAINS(err.msg, "destination extent 1 is 2048 bytes (at offset 2049)");
  CHECK(cbuf[5 * BB] == 0);
}

static void test_async_pull(void) {
  int32_t t[32];
  for (int i = 0; i < 32; i++)
    t[i] = 9000 + i;
  mc_lookup_extent_t src[2], dst[2];
  for (int i = 0; i < 2; i++) {
    src[i] = (mc_lookup_extent_t){.addr = (uint64_t)(uintptr_t)(pbuf + (14 + i) * BB), .len = BB};
    dst[i] = (mc_lookup_extent_t){.addr = (uint64_t)(uintptr_t)(cbuf + (2 + i) * BB), .len = BB};
  }
  memset(pbuf + 14 * BB, 0x5a, 2 * BB);
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_lookup_insert(LB, t, 32, 4, src, NULL, 0, 0, NULL, &err), 2);
  uint64_t id = 0, id2 = 0;
  CHECK_EQ_INT(mc_kv_pull_start(KC, mc_engine_segment_name(P), t, 32, 4, 0, dst, 2, 1, 5000,
                                &id, &err), 0);
  long res = -1;
  double secs = -1;
  int done = 0;
  for (int i = 0; i < 5000 && !done; i++) {
    done = mc_kv_pull_poll(KC, id, &res, &secs, &err);
    if (!done)
      usleep(1000);
  }
  CHECK_EQ_INT(done, 1);
  CHECK_EQ_INT(res, 32);
  CHECK(secs >= 0 && secs < 5);
  CHECK(cbuf[2 * BB] == 0x5a && cbuf[4 * BB - 1] == 0x5a);
  CHECK(mc_kv_pull_poll(KC, id, &res, &secs, &err) < 0); /* reported once */
  CHECK_CONTAINS(err.msg, "already reported");
  /* Left running / unpolled at shutdown: destroy joins and frees it (ASan). */
  CHECK_EQ_INT(mc_kv_pull_start(KC, "127.0.0.1:1", t, 32, 4, 0, dst, 2, 1, 200, &id2, &err), 0);
}

static void test_probe_and_pull_wait(void) {
  int32_t t[48];
  for (int i = 0; i < 48; i++)
    t[i] = 12000 + i * 5;
  mc_lookup_extent_t src[2], dst[2];
  for (int i = 0; i < 2; i++) {
    src[i] = (mc_lookup_extent_t){.addr = (uint64_t)(uintptr_t)(pbuf + (6 + i) * BB), .len = BB};
    dst[i] = (mc_lookup_extent_t){.addr = (uint64_t)(uintptr_t)(cbuf + (8 + i) * BB), .len = BB};
  }
  memset(pbuf + 6 * BB, 0x3c, 2 * BB);
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_lookup_insert(LB, t, 32, 4, src, NULL, 0, 0, NULL, &err), 2);
  const char *prod = mc_engine_segment_name(P);
  /* 48 tokens asked, 2 blocks held: 32; nothing pinned by the probe. */
  CHECK_EQ_INT(mc_kv_probe(KC, prod, t, 48, 4, 0, 2000, &err), 32);
  CHECK_EQ_INT(mc_kv_probe(KC, prod, t, 48, 4, 1, 2000, &err), 32);
  CHECK_EQ_INT(mc_kv_probe(KC, prod, t, 48, 4, 2, 2000, &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "expects 2 extents per block");
  mc_lookup_stats_t ls;
  mc_lookup_get_stats(LB, &ls);
  CHECK_EQ_INT(ls.pinned_blocks, 0);
  CHECK(mc_kv_probe(KC, "", t, 48, 4, 0, 100, &err) == MC_EINVAL);
  /* pull_wait: blocks until the pull is done; poll then reports it. */
  uint64_t id = 0;
  memset(cbuf + 8 * BB, 0, 2 * BB);
  CHECK_EQ_INT(mc_kv_pull_start(KC, prod, t, 32, 4, 0, dst, 2, 1, 5000, &id, &err), 0);
  CHECK_EQ_INT(mc_kv_pull_wait(KC, &id, 1, 5000, &err), 1);
  long res = -1;
  CHECK_EQ_INT(mc_kv_pull_poll(KC, id, &res, NULL, &err), 1);
  CHECK_EQ_INT(res, 32);
  CHECK(memcmp(pbuf + 6 * BB, cbuf + 8 * BB, 2 * BB) == 0);
  CHECK_EQ_INT(mc_kv_pull_wait(KC, &id, 1, 10, &err), MC_EINVAL); /* reported already */
  mc_kv_stats_t s;
  mc_kv_get_stats(KP, &s);
  CHECK_EQ_INT(s.probes_served, 3);
  mc_kv_get_stats(KC, &s);
  CHECK_EQ_INT(s.probes, 3);
}

/* Last: it moves the pull/probe counters the tests above check. */
static void test_too_big_leaves_no_waiter(void) {
  int64_t t[32] = {0};
  mc_lookup_extent_t dst[2] = {{.addr = (uint64_t)(uintptr_t)cbuf, .len = BB},
                               {.addr = (uint64_t)(uintptr_t)cbuf + BB, .len = BB}};
  mc_err_t err = {0};
  /* Requests too big for one message are refused before sending (the
   * tokens are not read) and leave no waiter behind. */
  size_t huge = (MC_ENGINE_MAX_MSG / 8) + 1;
  CHECK_EQ_INT(mc_kv_pull(KC, mc_engine_segment_name(P), t, huge, 8, dst, 2, 1, 100, &err),
               MC_ETOOBIG);
  CHECK_EQ_INT(mc_kv_probe(KC, mc_engine_segment_name(P), t, huge, 8, 1, 100, &err),
               MC_ETOOBIG);
  CHECK_CONTAINS(err.msg, "split the prompt");
  CHECK_EQ_INT(mc_kv_recv(KC, mc_engine_segment_name(P), t, huge, 8, dst, 2, 1, 100, &err),
               MC_ETOOBIG);
  pthread_mutex_lock(&KC->mu);
  int left = KC->waiters != NULL;
  pthread_mutex_unlock(&KC->mu);
  CHECK(!left);
}

int main(void) {
  pbuf = calloc(16, BB);
  cbuf = calloc(16, BB);
  P = mk();
  C = mk();
  mc_err_t err = {0};
  mc_lookup_opts_t lo = {.capacity_bytes = 64 * BB};
  if (!P || !C || mc_lookup_create(&lo, &LB, &err) < 0 ||
      mc_engine_register(C, cbuf, 16 * BB, "cpu", &err) < 0 ||
      mc_engine_register(P, pbuf, 16 * BB, "cpu", &err) < 0 ||
      mc_kv_create(P, LB, 2, &KP, &err) < 0 || mc_kv_create(C, NULL, 0, &KC, &err) < 0) {
    fprintf(stderr, "setup: %s\n", err.msg);
    return 1;
  }
  RUN(test_push_longest_prefix);
  RUN(test_errors);
  RUN(test_pull_with_skip_and_release);
  RUN(test_pull_slices_and_skips);
  RUN(test_async_pull);
  RUN(test_probe_and_pull_wait);
  RUN(test_too_big_leaves_no_waiter);
  mc_kv_destroy(KC);
  mc_kv_destroy(KP);
  mc_lookup_destroy(LB);
  mc_engine_destroy(C);
  mc_engine_destroy(P);
  free(pbuf);
  free(cbuf);
  TEST_MAIN_END();
}
