/* Lookup buffer: hashing, prefix sharing, partial matches, misses, capacity
 * (evict / backpressure), expiry, consume vs keep, threads, collisions. */
#include <pthread.h>
#include <stdint.h>
#include <unistd.h>

#include "lookup/lookup_buffer.h"
#include "util/clock.h"
#include "testlib.h"

#define BS 16

typedef struct {
  uint64_t t;
} fake_clock_t;
static uint64_t fake_now(void *ctx) { return ((fake_clock_t *)ctx)->t; }

static mc_lookup_t *mk(uint64_t cap, int mode, int policy, uint32_t weak) {
  mc_lookup_opts_t o = {.capacity_bytes = cap, .block_size = BS, .seed = 7, .mode = mode,
                        .policy = policy, .test_weak_hash_bits = weak};
  mc_lookup_t *lb = NULL;
  mc_err_t err = {0};
  if (mc_lookup_create(&o, &lb, &err) < 0)
    fprintf(stderr, "  create: %s\n", err.msg);
  return lb;
}

/* tokens[i] = base + i; extents tagged base*1000 + block, EXT bytes each
 * (large next to a block's index memory, which counts against capacity too:
 * capacities below are in EXTs). */
#define EXT 10000
static void seq(int32_t *t, size_t n, int32_t base) {
  for (size_t i = 0; i < n; i++)
    t[i] = base + (int32_t)i;
}
static void exts(mc_lookup_extent_t *x, size_t nb, uint64_t base) {
  for (size_t i = 0; i < nb; i++)
    x[i] = (mc_lookup_extent_t){.addr = 0x10000 + base * 0x1000 + i * 0x100, .len = EXT,
                                .tag = base * 1000 + i};
}

static long ins(mc_lookup_t *lb, const int32_t *t, size_t n, uint64_t base, int timeout,
                mc_err_t *err) {
  mc_lookup_extent_t x[64];
  exts(x, n / BS, base);
  return mc_lookup_insert(lb, t, n, 4, x, NULL, 0, timeout, NULL, err);
}

static void test_hash_chain(void) {
  mc_token_hasher_t h;
  CHECK(mc_token_hasher_init(&h, BS, 1, NULL) == 0);
  int32_t a[64];
  int64_t a64[64];
  seq(a, 64, 5);
  for (int i = 0; i < 64; i++)
    a64[i] = a[i];
  mc_block_hash_t h1[4], h2[4], h3[4];
  CHECK_EQ_INT(mc_token_hash_blocks(&h, a, 64, 4, h1, 4, NULL, NULL), 4);
  CHECK_EQ_INT(mc_token_hash_blocks(&h, a64, 63, 8, h2, 4, NULL, NULL), 3);
  CHECK(!memcmp(h1, h2, 3 * sizeof h1[0])); /* width does not matter */
  a[3] = 999; /* change block 0: every later hash changes (prefix chaining) */
  CHECK_EQ_INT(mc_token_hash_blocks(&h, a, 64, 4, h3, 4, NULL, NULL), 4);
  for (int i = 0; i < 4; i++)
    CHECK(h1[i].lo != h3[i].lo);
  mc_token_hasher_t h9;
  CHECK(mc_token_hasher_init(&h9, BS, 2, NULL) == 0); /* seed matters */
  CHECK_EQ_INT(mc_token_hash_blocks(&h9, a64, 16, 8, h3, 4, NULL, NULL), 1);
  CHECK(h3[0].lo != h1[0].lo);
  mc_err_t err = {0};
  a64[20] = -1;
  CHECK_EQ_INT(mc_token_hash_blocks(&h, a64, 64, 8, h2, 4, NULL, &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "index 20");
  CHECK_EQ_INT(mc_token_hasher_init(&h9, 0, 0, &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "block_size 0");
}

static void test_prefix_sharing_and_partial(void) {
  mc_lookup_t *lb = mk(1 << 20, MC_LOOKUP_KEEP, MC_LOOKUP_EVICT, 0);
  CHECK(lb);
  int32_t a[64], b[64];
  seq(a, 64, 0);
  seq(b, 64, 0);
  b[40] = 777; /* b shares blocks 0,1 with a, diverges in block 2 */
  mc_err_t err = {0};
  size_t reused = 9;
  mc_lookup_extent_t x[4];
  exts(x, 4, 1);
  CHECK_EQ_INT(mc_lookup_insert(lb, a, 64, 4, x, NULL, 0, 0, &reused, &err), 4);
  CHECK_EQ_INT(reused, 0);
  exts(x, 4, 2);
  CHECK_EQ_INT(mc_lookup_insert(lb, b, 64, 4, x, NULL, 0, 0, &reused, &err), 4);
  CHECK_EQ_INT(reused, 2);
  mc_lookup_stats_t st;
  mc_lookup_get_stats(lb, &st);
  CHECK_EQ_INT(st.blocks, 6); /* 2 shared + 2 + 2 */
  CHECK_EQ_INT(st.used_bytes, 6 * EXT);
  mc_lookup_match_t *m;
  /* partial: query = a's first 50 tokens -> 3 blocks (48 tokens) */
  CHECK_EQ_INT(mc_lookup_find(lb, a, 50, 4, &m, &err), 48);
  CHECK_EQ_INT(mc_lookup_match_blocks(m), 3);
  CHECK_EQ_INT(mc_lookup_match_kv(m, 0)->tag, 1000);
  CHECK_EQ_INT(mc_lookup_match_kv(m, 2)->tag, 1002);
  mc_lookup_release(lb, m);
  /* b's blocks 0,1 are a's (shared), 2,3 its own */
  CHECK_EQ_INT(mc_lookup_find(lb, b, 64, 4, &m, &err), 64);
  CHECK_EQ_INT(mc_lookup_match_kv(m, 1)->tag, 1001);
  CHECK_EQ_INT(mc_lookup_match_kv(m, 3)->tag, 2003);
  mc_lookup_release(lb, m);
  /* longer query than stored: match stops at the stored end */
  int32_t c[80];
  seq(c, 80, 0);
  CHECK_EQ_INT(mc_lookup_find(lb, c, 80, 4, &m, &err), 64);
  mc_lookup_release(lb, m);
  /* miss: first block differs; too short */
  c[0] = 12345;
  CHECK_EQ_INT(mc_lookup_find(lb, c, 80, 4, &m, &err), 0);
  CHECK(m == NULL);
  CHECK_EQ_INT(mc_lookup_find(lb, a, 15, 4, &m, &err), 0);
  /* remove a: b and the shared prefix stay */
  CHECK_EQ_INT(mc_lookup_remove(lb, a, 64, 4, &err), 1);
  CHECK_EQ_INT(mc_lookup_find(lb, a, 64, 4, &m, &err), 32);
  mc_lookup_release(lb, m);
  mc_lookup_get_stats(lb, &st);
  CHECK_EQ_INT(st.blocks, 4);
  CHECK_EQ_INT(st.hits, 4);
  CHECK_EQ_INT(st.misses, 2);
  mc_lookup_destroy(lb);
}

static void test_eviction_lru(void) {
  mc_lookup_t *lb = mk(10 * EXT, MC_LOOKUP_KEEP, MC_LOOKUP_EVICT, 0); /* 10 blocks */
  CHECK(lb);
  int32_t t[3][64];
  mc_err_t err = {0};
  for (int i = 0; i < 2; i++) {
    seq(t[i], 64, 1000 * (i + 1));
    CHECK_EQ_INT(ins(lb, t[i], 64, (uint64_t)i, 0, &err), 4);
  }
  mc_lookup_match_t *m;
  CHECK_EQ_INT(mc_lookup_find(lb, t[0], 64, 4, &m, &err), 64); /* t0 most recent now */
  mc_lookup_release(lb, m);
  seq(t[2], 64, 3000);
  CHECK_EQ_INT(ins(lb, t[2], 64, 2, 0, &err), 4); /* 12 blocks > 10: evicts t1 */
  CHECK_EQ_INT(mc_lookup_find(lb, t[1], 64, 4, &m, &err), 0);
  CHECK_EQ_INT(mc_lookup_find(lb, t[0], 64, 4, &m, &err), 64);
  mc_lookup_release(lb, m);
  mc_lookup_stats_t st;
  mc_lookup_get_stats(lb, &st);
  CHECK_EQ_INT(st.evicted, 1);
  CHECK(st.used_bytes <= 10 * EXT);
  /* too big for the whole buffer */
  int32_t big[256];
  seq(big, 176, 9000);
  mc_lookup_extent_t x[11];
  exts(x, 11, 9);
  CHECK_EQ_INT(mc_lookup_insert(lb, big, 176, 4, x, NULL, 0, 0, NULL, &err), MC_ETOOBIG);
  CHECK_CONTAINS(err.msg, "110000 bytes");
  /* pinned blocks are not freed by eviction: the match stays readable */
  CHECK_EQ_INT(mc_lookup_find(lb, t[0], 64, 4, &m, &err), 64);
  seq(big, 160, 9000);
  exts(x, 10, 9);
  CHECK_EQ_INT(mc_lookup_insert(lb, big, 160, 4, x, NULL, 0, 0, NULL, &err), MC_EBUSY);
  CHECK_CONTAINS(err.msg, "pinned");
  CHECK_EQ_INT(mc_lookup_match_kv(m, 3)->tag, 3);
  mc_lookup_release(lb, m);
  CHECK_EQ_INT(mc_lookup_insert(lb, big, 160, 4, x, NULL, 0, 0, NULL, &err), 10);
  mc_lookup_destroy(lb);
}

typedef struct {
  mc_lookup_t *lb;
  int32_t *t;
} bp_arg_t;
static void *consumer(void *p) {
  bp_arg_t *a = p;
  usleep(100000);
  mc_lookup_match_t *m = NULL;
  mc_lookup_find(a->lb, a->t, 64, 4, &m, NULL);
  mc_lookup_release(a->lb, m);
  return NULL;
}

static void test_backpressure(void) {
  mc_lookup_t *lb = mk(7 * EXT, MC_LOOKUP_CONSUME, MC_LOOKUP_BACKPRESSURE, 0);
  CHECK(lb);
  int32_t a[64], b[64];
  seq(a, 64, 1);
  seq(b, 64, 500);
  mc_err_t err = {0};
  CHECK_EQ_INT(ins(lb, a, 64, 1, 0, &err), 4);
  CHECK_EQ_INT(ins(lb, b, 64, 2, 0, &err), MC_EBUSY); /* no wait */
  CHECK_CONTAINS(err.msg, "full");
  uint64_t t0 = mc_now_ns();
  CHECK_EQ_INT(ins(lb, b, 64, 2, 50, &err), MC_ETIMEDOUT);
  CHECK(mc_now_ns() - t0 >= 45000000ull);
  CHECK_CONTAINS(err.msg, "after waiting 50 ms");
  /* a consumer frees room while the producer waits */
  pthread_t th;
  bp_arg_t arg = {lb, a};
  pthread_create(&th, NULL, consumer, &arg);
  CHECK_EQ_INT(ins(lb, b, 64, 2, 5000, &err), 4);
  pthread_join(th, NULL);
  mc_lookup_destroy(lb);
}

static void test_expiry(void) {
  fake_clock_t clk = {.t = 1000};
  mc_lookup_opts_t o = {.capacity_bytes = 1 << 20, .block_size = BS, .ttl_ns = 5000000000ull,
                        .clock = fake_now, .clock_ctx = &clk};
  mc_lookup_t *lb = NULL;
  CHECK(mc_lookup_create(&o, &lb, NULL) == 0);
  int32_t a[32], b[32];
  seq(a, 32, 1);
  seq(b, 32, 100);
  mc_err_t err = {0};
  CHECK_EQ_INT(ins(lb, a, 32, 1, 0, &err), 2);
  clk.t += 3000000000ull;
  CHECK_EQ_INT(ins(lb, b, 32, 2, 0, &err), 2);
  clk.t += 2500000000ull; /* a is 5.5 s old, b 2.5 s */
  mc_lookup_match_t *m;
  CHECK_EQ_INT(mc_lookup_find(lb, a, 32, 4, &m, &err), 0);
  CHECK_EQ_INT(mc_lookup_find(lb, b, 32, 4, &m, &err), 32);
  mc_lookup_release(lb, m);
  clk.t += 3000000000ull;
  CHECK_EQ_INT(mc_lookup_expire(lb), 1);
  mc_lookup_stats_t st;
  mc_lookup_get_stats(lb, &st);
  CHECK_EQ_INT(st.expired, 2);
  CHECK_EQ_INT(st.entries, 0);
  CHECK_EQ_INT(st.used_bytes, 0);
  mc_lookup_destroy(lb);
}

static void test_consume_vs_keep(void) {
  mc_lookup_t *keep = mk(1 << 20, MC_LOOKUP_KEEP, MC_LOOKUP_EVICT, 0);
  mc_lookup_t *cons = mk(1 << 20, MC_LOOKUP_CONSUME, MC_LOOKUP_EVICT, 0);
  CHECK(keep && cons);
  int32_t a[64], b[64];
  seq(a, 64, 3);
  seq(b, 64, 3);
  b[50] = 1; /* shares 3 blocks */
  mc_err_t err = {0};
  mc_lookup_match_t *m;
  for (int i = 0; i < 2; i++) {
    CHECK_EQ_INT(ins(keep, a, 64, 1, 0, &err), 4);
    CHECK_EQ_INT(ins(cons, a, 64, 1, 0, &err), 4); /* twice: two entries */
  }
  CHECK_EQ_INT(ins(cons, b, 64, 2, 0, &err), 4);
  for (int i = 0; i < 3; i++) {
    CHECK_EQ_INT(mc_lookup_find(keep, a, 64, 4, &m, &err), 64);
    mc_lookup_release(keep, m);
  }
  CHECK_EQ_INT(mc_lookup_find(cons, a, 64, 4, &m, &err), 64);
  mc_lookup_release(cons, m);
  CHECK_EQ_INT(mc_lookup_find(cons, a, 64, 4, &m, &err), 64); /* second copy */
  /* the consumed entry's memory stays valid while pinned */
  CHECK_EQ_INT(mc_lookup_match_kv(m, 3)->tag, 1003);
  mc_lookup_release(cons, m);
  /* a's exclusive block 3 is gone; shared blocks 0-2 remain (b's) */
  CHECK_EQ_INT(mc_lookup_find(cons, a, 64, 4, &m, &err), 48);
  mc_lookup_release(cons, m); /* that consumed b */
  CHECK_EQ_INT(mc_lookup_find(cons, b, 64, 4, &m, &err), 0);
  mc_lookup_stats_t st;
  mc_lookup_get_stats(cons, &st);
  CHECK_EQ_INT(st.consumed, 3);
  CHECK_EQ_INT(st.blocks, 0);
  CHECK_EQ_INT(st.used_bytes, 0);
  mc_lookup_destroy(keep);
  mc_lookup_destroy(cons);
}

static void test_copy_hidden_and_freed(void) {
  mc_lookup_opts_t o = {.capacity_bytes = 1 << 20, .extents_per_block = 2, .track_freed = 1,
                        .mode = MC_LOOKUP_CONSUME};
  mc_lookup_t *lb = NULL;
  CHECK(mc_lookup_create(&o, &lb, NULL) == 0);
  char kvbuf[4][32], hid[2][8];
  memset(kvbuf, 'k', sizeof kvbuf);
  memset(hid, 'h', sizeof hid);
  mc_lookup_extent_t x[4], h[2];
  for (int i = 0; i < 4; i++)
    x[i] = (mc_lookup_extent_t){(uint64_t)(uintptr_t)kvbuf[i], 32, (uint64_t)i};
  for (int i = 0; i < 2; i++)
    h[i] = (mc_lookup_extent_t){(uint64_t)(uintptr_t)hid[i], 8, 100 + (uint64_t)i};
  int64_t t[32];
  for (int i = 0; i < 32; i++)
    t[i] = i;
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_lookup_insert(lb, t, 32, 8, x, h, MC_LOOKUP_COPY, 0, NULL, &err), 2);
  memset(kvbuf, 'X', sizeof kvbuf); /* copies are independent of the source */
  mc_lookup_match_t *m;
  CHECK_EQ_INT(mc_lookup_find(lb, t, 32, 8, &m, &err), 32);
  const mc_lookup_extent_t *k1 = mc_lookup_match_kv(m, 1);
  CHECK(k1[1].addr != (uint64_t)(uintptr_t)kvbuf[3]);
  CHECK(((const char *)(uintptr_t)k1[1].addr)[31] == 'k');
  CHECK_EQ_INT(k1[1].tag, 3);
  CHECK(((const char *)(uintptr_t)mc_lookup_match_hidden(m, 1)->addr)[0] == 'h');
  mc_lookup_release(lb, m);
  mc_lookup_extent_t fr[8];
  CHECK_EQ_INT(mc_lookup_take_freed(lb, fr, 8), 0); /* copies are not reported */
  /* zero copy: freed tags are reported once unreferenced and unpinned */
  CHECK_EQ_INT(mc_lookup_insert(lb, t, 32, 8, x, NULL, 0, 0, NULL, &err), 2);
  CHECK_EQ_INT(mc_lookup_find(lb, t, 32, 8, &m, &err), 32);
  CHECK_EQ_INT(mc_lookup_take_freed(lb, fr, 8), 0); /* still pinned */
  mc_lookup_release(lb, m);
  CHECK_EQ_INT(mc_lookup_take_freed(lb, fr, 8), 4);
  /* A second entry sharing block 0: the extents given for that block are
   * not stored, so they are reported at once (each extent exactly once). */
  mc_lookup_extent_t y[4];
  for (int i = 0; i < 4; i++)
    y[i] = (mc_lookup_extent_t){(uint64_t)(uintptr_t)kvbuf[i], 32, 10 + (uint64_t)i};
  int64_t u[32];
  memcpy(u, t, sizeof u);
  u[20] = 999; /* block 1 differs */
  size_t reused = 0;
  CHECK_EQ_INT(mc_lookup_insert(lb, t, 32, 8, x, NULL, 0, 0, NULL, &err), 2);
  CHECK_EQ_INT(mc_lookup_take_freed(lb, fr, 8), 0);
  CHECK_EQ_INT(mc_lookup_insert(lb, u, 32, 8, y, NULL, 0, 0, &reused, &err), 2);
  CHECK_EQ_INT(reused, 1);
  CHECK_EQ_INT(mc_lookup_take_freed(lb, fr, 8), 2);
  CHECK_EQ_INT(fr[0].tag, 10);
  CHECK_EQ_INT(fr[1].tag, 11);
  CHECK_EQ_INT(mc_lookup_expire(lb), 0);
  CHECK_EQ_INT(mc_lookup_remove(lb, t, 32, 8, &err), 1);
  CHECK_EQ_INT(mc_lookup_take_freed(lb, fr, 8), 2); /* t's block 1; block 0 serves u */
  CHECK_EQ_INT(mc_lookup_remove(lb, u, 32, 8, &err), 1);
  CHECK_EQ_INT(mc_lookup_take_freed(lb, fr, 8), 4);
  CHECK_EQ_INT(mc_lookup_insert(lb, t, 8, 8, x, NULL, 0, 0, NULL, &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "do not fill one block");
  mc_lookup_destroy(lb);
}

/* wait_freed: times out with nothing freed; returns as soon as another
 * thread's release frees a zero-copy block (not at the timeout). */
typedef struct {
  mc_lookup_t *lb;
  mc_lookup_match_t *m;
} release_arg_t;

static void *release_later(void *p) {
  release_arg_t *a = p;
  struct timespec ts = {0, 100 * 1000000L};
  nanosleep(&ts, NULL);
  mc_lookup_release(a->lb, a->m);
  return NULL;
}

static void test_wait_freed(void) {
  mc_lookup_opts_t o = {.capacity_bytes = 1 << 20, .extents_per_block = 1, .track_freed = 1,
                        .mode = MC_LOOKUP_CONSUME};
  mc_lookup_t *lb = NULL;
  CHECK(mc_lookup_create(&o, &lb, NULL) == 0);
  static char kvbuf[2][32];
  mc_lookup_extent_t x[2];
  for (int i = 0; i < 2; i++)
    x[i] = (mc_lookup_extent_t){(uint64_t)(uintptr_t)kvbuf[i], 32, (uint64_t)i};
  int64_t t[32];
  for (int i = 0; i < 32; i++)
    t[i] = 500 + i;
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_lookup_insert(lb, t, 32, 8, x, NULL, 0, 0, NULL, &err), 2);
  uint64_t t0 = mc_now_ns();
  CHECK_EQ_INT(mc_lookup_wait_freed(lb, 80), 0); /* nothing freed: the timeout */
  uint64_t waited = mc_now_ns() - t0;
  CHECK(waited >= 75000000ull && waited < 2000000000ull);
  mc_lookup_match_t *m;
  CHECK_EQ_INT(mc_lookup_find(lb, t, 32, 8, &m, &err), 32); /* consumed, still pinned */
  release_arg_t a = {lb, m};
  pthread_t th;
  t0 = mc_now_ns();
  pthread_create(&th, NULL, release_later, &a);
  CHECK_EQ_INT(mc_lookup_wait_freed(lb, 5000), 1);
  waited = mc_now_ns() - t0;
  CHECK(waited >= 90000000ull && waited < 3000000000ull); /* woken by the release */
  pthread_join(th, NULL);
  mc_lookup_extent_t fr[4];
  CHECK_EQ_INT(mc_lookup_take_freed(lb, fr, 4), 2);
  CHECK_EQ_INT(mc_lookup_wait_freed(lb, 0), 0); /* taken: nothing queued */
  mc_lookup_destroy(lb);
}

/* Weakened 4-bit hashes: many distinct blocks share a key.  Every match
 * must still return exactly the stored sequence's own KV. */
static void test_collisions_never_return_wrong_kv(void) {
  mc_lookup_t *lb = mk(1 << 24, MC_LOOKUP_KEEP, MC_LOOKUP_EVICT, 4);
  CHECK(lb);
  enum { N = 200 };
  static int32_t t[N][64];
  mc_err_t err = {0};
  for (int i = 0; i < N; i++) {
    seq(t[i], 64, 0);
    t[i][(i % 4) * 16 + 5] = 100000 + i; /* differ in block i%4 */
    CHECK_EQ_INT(ins(lb, t[i], 64, (uint64_t)i + 1, 0, &err), 4);
  }
  mc_lookup_stats_t st;
  mc_lookup_get_stats(lb, &st);
  CHECK(st.collisions > 0);
  for (int i = 0; i < N; i++) {
    mc_lookup_match_t *m;
    CHECK_EQ_INT(mc_lookup_find(lb, t[i], 64, 4, &m, &err), 64);
    int d = i % 4;
    for (int b = d; b < 4; b++)
      CHECK_EQ_INT(mc_lookup_match_kv(m, (size_t)b)->tag / 1000, i + 1);
    mc_lookup_release(lb, m);
    /* an unseen sequence colliding in hash: matches only its true prefix */
    int32_t q[64];
    memcpy(q, t[i], sizeof q);
    q[63] = 555555;
    CHECK_EQ_INT(mc_lookup_find(lb, q, 64, 4, &m, &err), 48);
    mc_lookup_release(lb, m);
  }
  mc_lookup_destroy(lb);
}

enum { THREADS = 6, ITERS = 2000 };
typedef struct {
  mc_lookup_t *lb;
  int id, bad;
} th_arg_t;
static void *worker(void *p) {
  th_arg_t *a = p;
  int32_t t[64];
  for (int i = 0; i < ITERS; i++) {
    int key = (a->id * 7 + i) % 50;
    seq(t, 64, key * 100);
    mc_lookup_extent_t x[4];
    exts(x, 4, (uint64_t)key);
    mc_lookup_insert(a->lb, t, 64, 4, x, NULL, 0, 0, NULL, NULL);
    mc_lookup_match_t *m = NULL;
    long r = mc_lookup_find(a->lb, t, 64, 4, &m, NULL);
    for (size_t b = 0; r > 0 && b < mc_lookup_match_blocks(m); b++)
      if (mc_lookup_match_kv(m, b)->tag != (uint64_t)key * 1000 + b)
        a->bad++;
    mc_lookup_release(a->lb, m);
  }
  return NULL;
}

static void test_threads(void) {
  for (int mode = 0; mode < 2; mode++) {
    mc_lookup_t *lb = mk(30 * EXT, mode, MC_LOOKUP_EVICT, 0); /* forces eviction */
    CHECK(lb);
    pthread_t th[THREADS];
    th_arg_t arg[THREADS];
    for (int i = 0; i < THREADS; i++) {
      arg[i] = (th_arg_t){lb, i, 0};
      pthread_create(&th[i], NULL, worker, &arg[i]);
    }
    int bad = 0;
    for (int i = 0; i < THREADS; i++) {
      pthread_join(th[i], NULL);
      bad += arg[i].bad;
    }
    CHECK_EQ_INT(bad, 0);
    mc_lookup_stats_t st;
    mc_lookup_get_stats(lb, &st);
    CHECK(st.used_bytes <= 30 * EXT);
    CHECK_EQ_INT(st.pinned_blocks, 0);
    CHECK(st.hits > 0);
    mc_lookup_destroy(lb);
  }
}

int main(void) {
  RUN(test_hash_chain);
  RUN(test_prefix_sharing_and_partial);
  RUN(test_eviction_lru);
  RUN(test_backpressure);
  RUN(test_expiry);
  RUN(test_consume_vs_keep);
  RUN(test_copy_hidden_and_freed);
  RUN(test_wait_freed);
  RUN(test_collisions_never_return_wrong_kv);
  RUN(test_threads);
  TEST_MAIN_END();
}
