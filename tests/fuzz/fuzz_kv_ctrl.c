/* KV control messages (send_kv/recv_kv and the pull protocol, csrc/kv/) as
 * a peer delivers them: through the engine's notification handler, to a
 * producer (requests, lease releases) or to a consumer (answers).
 *
 * Two real engines in this process (P2P handshake, TCP on 127.0.0.1): P is
 * a producer with a lookup buffer holding tokens 1..16 (4 blocks of 4, one
 * 4 KiB extent each, at FUZZ_P); C is a consumer with 64 KiB registered at
 * FUZZ_C, where requests may ask P to write.  P runs one KV worker, so jobs
 * are served in order: after the fuzz message the harness queues a probe
 * and waits until it is served, then ends every lease (state does not leak
 * from one input into the next).
 *
 * Input: byte 0 = flags (bit 0: deliver to C as an answer from P, else to P
 * as a request from C; bit 1: C has a recv_kv/pull waiter with id 7 pending
 * for P), then the message. */
#include "fuzz_common.h"

#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include "engine/engine.h"
#include "util/bytes.h"
#include "engine/engine_internal.h"
#include "kv/kv_internal.h"
#include "lookup/lookup_buffer.h"

#define FUZZ_P 0x50000000ul
#define FUZZ_C 0x40000000ul
#define FUZZ_LEN (64u << 10)

static mc_engine_t *P, *C;
static mc_lookup_t *LB;
static mc_kv_t *KP, *KC;
static char pname[128], cname[128];

static mc_engine_t *mk(void) {
  mc_engine_opts_t o = {.local_hostname = "127.0.0.1", .metadata_server = "P2PHANDSHAKE"};
  mc_err_t err = {0};
  mc_engine_t *e = NULL;
  if (mc_engine_create(&o, &e, &err) < 0) {
    fprintf(stderr, "fuzz_kv_ctrl: engine: %s\n", err.msg);
    exit(2);
  }
  return e;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  fuzz_quiet();
  P = mk();
  C = mk();
  snprintf(pname, sizeof pname, "%s", mc_engine_segment_name(P));
  snprintf(cname, sizeof cname, "%s", mc_engine_segment_name(C));
  fuzz_map_fixed(FUZZ_P, FUZZ_LEN);
  fuzz_map_fixed(FUZZ_C, FUZZ_LEN);
  mc_err_t err = {0};
  mc_lookup_opts_t lo = {.capacity_bytes = FUZZ_LEN, .block_size = 4, .extents_per_block = 1};
  int32_t tok[16];
  mc_lookup_extent_t ext[4];
  for (int i = 0; i < 16; i++)
    tok[i] = i + 1;
  for (int b = 0; b < 4; b++)
    ext[b] = (mc_lookup_extent_t){.addr = FUZZ_P + 4096u * b, .len = 4096, .tag = (uint64_t)b};
  if (mc_lookup_create(&lo, &LB, &err) < 0 ||
      mc_engine_register(P, (void *)FUZZ_P, FUZZ_LEN, "cpu", &err) < 0 ||
      mc_engine_register(C, (void *)FUZZ_C, FUZZ_LEN, "cpu", &err) < 0 ||
      mc_lookup_insert(LB, tok, 16, 4, ext, NULL, 0, 0, NULL, &err) != 4 ||
      mc_kv_create(P, LB, 1, &KP, &err) < 0 || mc_kv_create(C, NULL, 0, &KC, &err) < 0) {
    fprintf(stderr, "fuzz_kv_ctrl: setup: %s\n", err.msg);
    exit(2);
  }
  return 0;
}

static void deliver(mc_engine_t *e, const char *from, const void *msg, size_t len) {
  pthread_rwlock_rdlock(&e->handler_lock);
  if (e->notify_cb) {
    mc_err_t err = {0};
    /* A refusal (budget, bad message) is an error code, not a finding. */
    (void)e->notify_cb(e->notify_arg, from, msg, len, &err);
  }
  pthread_rwlock_unlock(&e->handler_lock);
}

static void drop_msg(void *arg, const char *from, const void *msg, size_t len) {
  (void)arg;
  (void)from;
  (void)msg;
  (void)len;
}

static uint64_t probes_served(void) {
  mc_kv_stats_t s;
  mc_kv_get_stats(KP, &s);
  return s.probes_served;
}

/* Mirrors kv_pull_serve: which messages it counts as probes served. */
static int counts_as_probe(const uint8_t *m, size_t len) {
  return len >= KV_PULL_HDR && mc_get_u32(m) == KV_PULL_MAGIC && m[4] == KV_VERSION &&
         mc_get_u32(m + 16) == 0;
}

static void to_producer(const uint8_t *m, size_t len) {
  uint64_t want = probes_served() + 1 + (uint64_t)counts_as_probe(m, len);
  deliver(P, cname, m, len);
  uint8_t probe[KV_PULL_HDR + 4] = {0};
  mc_put_u32(probe, KV_PULL_MAGIC);
  probe[4] = KV_VERSION;
  probe[5] = 4;
  mc_put_u16(probe + 6, 1);
  mc_put_u64(probe + 8, 0xfeed);
  mc_put_u32(probe + 20, 1);
  mc_put_u32(probe + KV_PULL_HDR, 1);
  deliver(P, cname, probe, sizeof probe);
  for (int i = 0; i < 20000 && probes_served() < want; i++)
    usleep(100);
  pthread_mutex_lock(&KP->mu);
  kv_pull_expire_locked(KP, 0, NULL, 1);
  pthread_mutex_unlock(&KP->mu);
}

static void to_consumer(const uint8_t *m, size_t len, int with_waiter) {
  kv_waiter_t *w = NULL;
  if (with_waiter) {
    w = calloc(1, sizeof *w);
    if (!w)
      abort();
    w->id = 7;
    snprintf(w->producer, sizeof w->producer, "%s", pname);
    pthread_mutex_lock(&KC->mu);
    w->next = KC->waiters;
    KC->waiters = w;
    pthread_mutex_unlock(&KC->mu);
  }
  deliver(C, pname, m, len);
  if (w) {
    pthread_mutex_lock(&KC->mu);
    kv_waiter_unlink_locked(KC, w);
    pthread_mutex_unlock(&KC->mu);
    free(w->extents);
    free(w);
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1 || size > MC_ENGINE_MAX_MSG)
    return 0;
  int flags = data[0];
  /* An exact-size copy: reads past the message are caught. */
  uint8_t *m = malloc(size - 1 ? size - 1 : 1);
  if (!m)
    abort();
  memcpy(m, data + 1, size - 1);
  if (flags & 1)
    to_consumer(m, size - 1, flags & 2);
  else
    to_producer(m, size - 1);
  free(m);
  /* Messages that are not KV's are queued for get_notifies: drop them. */
  mc_engine_drain_notifies(P, (size_t)-1, drop_msg, NULL);
  mc_engine_drain_notifies(C, (size_t)-1, drop_msg, NULL);
  return 0;
}
