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
 * for P), then the message.  Every input also goes through each decoder of
 * kv_msg.c directly (cheap, no engine): what they accept must lie inside the
 * message and encode back to the same length. */
#include "fuzz_common.h"

#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include "engine/engine.h"
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
  kv_msg_lease_req_t q;
  kv_msg_lease_req_decode(m, len, &q, NULL);
  return q.hdr_ok && q.lease_ms == 0;
}

static void must(int cond, const char *what) {
  if (!cond) {
    fprintf(stderr, "fuzz_kv_ctrl: decoder invariant broken: %s\n", what);
    abort();
  }
}

static const mc_lookup_extent_t *no_block(const void *ctx, size_t b) {
  (void)b;
  return ctx;
}

/* The decoders alone, on the raw bytes. */
static void decode_all(const uint8_t *m, size_t len) {
  static uint8_t out[MC_ENGINE_MAX_MSG];
  mc_err_t err = {0};
  kv_msg_req_t q;
  if (kv_msg_req_decode(m, len, &q, &err) == 0) {
    size_t next = (size_t)(q.ext - m) + ((size_t)q.ndest + q.nhid) * KV_EXT_LEN;
    must(next == len && (const uint8_t *)q.tokens == m + KV_REQ_HDR, "KVRQ extents");
    for (size_t i = 0; i < (size_t)q.ndest + q.nhid; i++)
      (void)kv_msg_extent(q.ext, i); /* ASan: inside the message */
  } else {
    must(err.code == MC_EPROTO && err.msg[0], "KVRQ error");
  }
  kv_msg_rep_t r;
  if (kv_msg_rep_decode(m, len, &r, &err) == 0) {
    must((const uint8_t *)r.text + r.text_len == m + len, "KVRP text");
    must(kv_msg_rep_encode(&r, out, sizeof out, &err) ==
             (long)(r.status < 0 ? len : KV_REP_HDR), "KVRP re-encode");
  }
  kv_msg_lease_req_t l;
  if (kv_msg_lease_req_decode(m, len, &l, &err) == 0)
    must(kv_msg_lease_req_encode(&l, out, sizeof out, &err) == (long)len, "KVPQ re-encode");
  kv_msg_lease_ans_t a;
  if (kv_msg_lease_ans_decode(m, len, &a, &err) == 0) {
    must(a.hdr_ok, "KVPP header");
    if (a.status >= 0) {
      must(a.ext + (size_t)a.nb * a.epb * KV_EXT_LEN == m + len, "KVPP extents");
      for (size_t i = 0; i < (size_t)a.nb * a.epb; i++)
        (void)kv_msg_extent(a.ext, i);
    }
    kv_msg_lease_ans_t b = a;
    b.nb = 0; /* length check only: the extents themselves were read above */
    b.block = no_block;
    must(kv_msg_lease_ans_encode(&b, out, sizeof out, &err) ==
             (long)(a.status < 0 ? len : KV_PANS_HDR), "KVPP re-encode");
  }
  uint64_t lease;
  if (kv_msg_release_decode(m, len, &lease, &err) == 0)
    must(len == KV_PREL_LEN && lease == kv_msg_peek_id(m, len), "KVPR");
}

static void to_producer(const uint8_t *m, size_t len) {
  uint64_t want = probes_served() + 1 + (uint64_t)counts_as_probe(m, len);
  deliver(P, cname, m, len);
  static const int32_t one = 1;
  kv_msg_lease_req_t q = {.id = 0xfeed, .width = 4, .epb = 1, .ntok = 1, .tokens = &one};
  uint8_t probe[KV_PULL_HDR + 4];
  kv_msg_lease_req_encode(&q, probe, sizeof probe, NULL);
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
  decode_all(m, size - 1);
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
