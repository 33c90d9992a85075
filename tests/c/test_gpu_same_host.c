/* The same-host GPU path across chunks of one batch: one submit call shares
 * the peer's descriptor and one check among its chunks.
 *   - (no GPU needed) the regions version page a peer names in its
 *     descriptor: sealed, token as named, the version bumped by register
 *     and unregister (before unregister returns), equal to the descriptor's
 *     "gen"; a malformed "gen" is refused naming the field;
 *   - a cached descriptor whose peer unregistered the region while the
 *     copies ran (the version moved between submit and completion) fails
 *     with the "re-registered" error (the RPC check the changed version
 *     falls back to);
 *   - a batch whose later chunks reach a region the peer registered after
 *     the descriptor was cached gets a fresh descriptor for them and lands
 *     byte-exact (scattered blocks);
 *   - a batch using a cached descriptor whose region the peer has since
 *     unregistered fails, in every chunk, with the "re-registered" error
 *     (the check runs alongside the copies);
 *   - a local buffer that runs past its CUDA allocation in a later chunk
 *     (located chunk by chunk) fails the submit naming that request, and
 *     freeing the batch waits for the chunks already started;
 *   - a trusted batch's local buffers outside the engine's regions are
 *     located by the driver (also mixed with a registered region's) and
 *     one running past its allocation fails naming its request.
 * Two engines in one process (same address space).  Skips without a GPU. */
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "engine/engine.h"
#include "engine/engine_internal.h"
#include "gpu/cuda_driver.h"
#include "meta/segment_desc.h"
#include "gpu_testlib.h"
#include "testlib.h"

#define BLK 4096u
#define NBLK 2048u /* 8 MiB per region: several chunks of the batch */

/* Block i of src goes to block perm(i) of the destination: a scatter. */
static size_t perm(size_t i) {
  return (i * 7 + 3) % NBLK;
}

static void test_later_chunks_fresh_descriptor(void) {
  SKIP_NO_GPU();
  mc_engine_t *A, *B;
  mc_err_t err = {0};
  CHECK_EQ_INT(engine_pair(&A, &B, &err), 0);
  size_t sz = (size_t)NBLK * BLK;
  uint64_t src = dalloc(2 * sz), r1 = dalloc(sz), r2 = dalloc(sz);
  CHECK(src && r1 && r2);
  uint8_t *ref = malloc(2 * sz), *back = malloc(2 * sz);
  for (size_t i = 0; i < 2 * sz; i++)
    ref[i] = (uint8_t)(i * 131 + (i >> 12) * 7);
  CHECK_EQ_INT(api->cuMemcpyHtoD(src, ref, 2 * sz), 0);
  CHECK_EQ_INT(mc_engine_register(B, (void *)(uintptr_t)r1, sz, "cuda:0", &err), 0);
  CHECK_EQ_INT(mc_engine_register(A, (void *)(uintptr_t)src, 2 * sz, "cuda:0", &err), 0);
  /* First contact: A caches B's descriptor (r1 only). */
  mc_request_t one = {.opcode = MC_OP_WRITE, .local = (void *)(uintptr_t)src, .remote = r1,
                      .len = BLK};
  CHECK_EQ_INT(xfer(A, B, &one, 1, &err), 0);
  /* B registers r2; one batch writes r1 then r2, blocks scattered: the
   * requests into r2 come in later chunks and miss the cached descriptor. */
  CHECK_EQ_INT(mc_engine_register(B, (void *)(uintptr_t)r2, sz, "cuda:0", &err), 0);
  size_t n = 2 * NBLK;
  mc_request_t *r = calloc(n, sizeof *r);
  for (size_t i = 0; i < n; i++) {
    uint64_t dst = (i < NBLK ? r1 : r2) + perm(i % NBLK) * BLK;
    r[i] = (mc_request_t){.opcode = MC_OP_WRITE, .local = (void *)(uintptr_t)(src + i * BLK),
                          .remote = dst, .len = BLK};
  }
  int rc = xfer(A, B, r, n, &err);
  if (rc)
    fprintf(stderr, "  write: %s\n", err.msg);
  CHECK_EQ_INT(rc, 0);
  CHECK_EQ_INT(api->cuMemcpyDtoH(back, r1, sz), 0);
  CHECK_EQ_INT(api->cuMemcpyDtoH(back + sz, r2, sz), 0);
  size_t bad = 0;
  for (size_t i = 0; i < n; i++)
    bad += memcmp(back + (i / NBLK) * sz + perm(i % NBLK) * BLK, ref + i * BLK, BLK) != 0;
  CHECK_EQ_INT(bad, 0);
  mc_engine_destroy(A);
  mc_engine_destroy(B);
  cu_free(src);
  cu_free(r1);
  cu_free(r2);
  free(r);
  free(ref);
  free(back);
}

/* Engines A and B; src (A's) and dst (B's), sz bytes of GPU memory each,
 * registered with them as cuda:0; ok once all that worked.  r: the
 * requests, made by the caller (scatter_open: NBLK blocks, block i of src
 * written to block perm(i) of dst), freed by pair_close. */
typedef struct {
  mc_engine_t *A, *B;
  uint64_t src, dst;
  mc_request_t *r;
  int ok;
} gpu_pair_t;

static void pair_open(gpu_pair_t *p, size_t sz) {
  mc_err_t err = {0};
  memset(p, 0, sizeof *p);
  CHECK_EQ_INT(engine_pair(&p->A, &p->B, &err), 0);
  p->src = dalloc(sz);
  p->dst = dalloc(sz);
  CHECK(p->src && p->dst);
  CHECK_EQ_INT(mc_engine_register(p->B, (void *)(uintptr_t)p->dst, sz, "cuda:0", &err), 0);
  CHECK_EQ_INT(mc_engine_register(p->A, (void *)(uintptr_t)p->src, sz, "cuda:0", &err), 0);
  p->ok = 1;
}

static void scatter_open(gpu_pair_t *p) {
  pair_open(p, (size_t)NBLK * BLK);
  if (!p->ok)
    return;
  p->r = calloc(NBLK, sizeof *p->r);
  for (size_t i = 0; p->r && i < NBLK; i++)
    p->r[i] = (mc_request_t){.opcode = MC_OP_WRITE,
                             .local = (void *)(uintptr_t)(p->src + i * BLK),
                             .remote = p->dst + perm(i) * BLK, .len = BLK};
  p->ok = p->r != NULL;
}

static void pair_close(gpu_pair_t *p) {
  mc_engine_destroy(p->A);
  mc_engine_destroy(p->B);
  if (p->src)
    cu_free(p->src);
  if (p->dst)
    cu_free(p->dst);
  free(p->r);
}

static void test_unregistered_since_cached_fails(void) {
  SKIP_NO_GPU();
  gpu_pair_t p;
  scatter_open(&p);
  CHECK(p.ok);
  mc_err_t err = {0};
  CHECK_EQ_INT(xfer(p.A, p.B, p.r, NBLK, &err), 0); /* caches the descriptor */
  /* B drops the region (the memory stays allocated here, so the copies
   * themselves are harmless): the check must fail the whole batch. */
  CHECK_EQ_INT(mc_engine_unregister(p.B, (void *)(uintptr_t)p.dst, &err), 0);
  mc_batch_t *b = mc_batch_new(p.A, NBLK);
  CHECK_EQ_INT(mc_batch_submit(p.A, b, mc_engine_segment_name(p.B), p.r, NBLK, &err), 0);
  CHECK(mc_batch_wait(p.A, b, 60000, &err) < 0);
  CHECK_CONTAINS(err.msg, "re-registered its GPU memory");
  size_t failed = 0;
  for (size_t i = 0; i < NBLK; i++) {
    mc_task_status_t st;
    CHECK_EQ_INT(mc_batch_status(b, i, &st), 0);
    failed += st.state == MC_TASK_FAILED;
  }
  CHECK_EQ_INT(failed, NBLK); /* every chunk, not only the first */
  mc_batch_free(p.A, b);
  /* With the cache refreshed by that check, the next batch is refused up
   * front (no region there) rather than copied. */
  CHECK(xfer(p.A, p.B, p.r, NBLK, &err) < 0);
  pair_close(&p);
}

static void test_later_chunk_runs_past_allocation(void) {
  SKIP_NO_GPU();
  gpu_pair_t p;
  scatter_open(&p);
  CHECK(p.ok);
  mc_err_t err = {0};
  size_t badi = NBLK - 5;
  p.r[badi].local = (void *)(uintptr_t)(p.src + (size_t)NBLK * BLK - BLK / 2); /* half past */
  mc_batch_t *b = mc_batch_new(p.A, NBLK);
  CHECK_EQ_INT(mc_batch_submit(p.A, b, mc_engine_segment_name(p.B), p.r, NBLK, &err),
               MC_EINVAL);
  char want[64];
  snprintf(want, sizeof want, "request %zu", badi);
  CHECK_CONTAINS(err.msg, want);
  /* Local buffers must lie in registered memory: refused before any chunk
   * starts (the locator's "runs past its end" can no longer be reached). */
  CHECK_CONTAINS(err.msg, "not inside any memory region registered with this engine");
  mc_batch_free(p.A, b);
  /* The engine still works afterwards. */
  p.r[badi].local = (void *)(uintptr_t)(p.src + badi * BLK);
  CHECK_EQ_INT(xfer(p.A, p.B, p.r, NBLK, &err), 0);
  pair_close(&p);
}

/* Local buffers outside the engine's regions in a trusted batch
 * (mc_batch_trust_locals, as the KV layer's pushes): the driver says where
 * they live (the locator, chunk by chunk).  Every other block from a
 * registered region, the rest from an allocation never registered: lands
 * byte-exact; the same batch untrusted is refused at the first unregistered
 * block; a trusted one whose block runs past its allocation in a later
 * chunk fails the submit naming that request. */
static void test_trusted_unregistered_locals(void) {
  SKIP_NO_GPU();
  gpu_pair_t p;
  scatter_open(&p);
  CHECK(p.ok);
  mc_err_t err = {0};
  size_t sz = (size_t)NBLK * BLK;
  uint64_t loose = dalloc(sz); /* A's, not registered */
  uint8_t *ref = malloc(sz), *back = malloc(sz);
  CHECK(loose && ref && back);
  for (size_t i = 0; i < sz; i++)
    ref[i] = (uint8_t)(i * 29 + (i >> 12) * 5);
  CHECK_EQ_INT(api->cuMemcpyHtoD(p.src, ref, sz), 0);
  CHECK_EQ_INT(api->cuMemcpyHtoD(loose, ref, sz), 0);
  for (size_t i = 1; i < NBLK; i += 2)
    p.r[i].local = (void *)(uintptr_t)(loose + i * BLK);
  mc_batch_t *b = mc_batch_new(p.A, NBLK);
  CHECK_EQ_INT(mc_batch_submit(p.A, b, mc_engine_segment_name(p.B), p.r, NBLK, &err),
               MC_EINVAL);
  CHECK_CONTAINS(err.msg, "request 1: local range");
  mc_batch_trust_locals(b);
  CHECK_EQ_INT(mc_batch_submit(p.A, b, mc_engine_segment_name(p.B), p.r, NBLK, &err), 0);
  int rc = mc_batch_wait(p.A, b, 60000, &err);
  if (rc)
    fprintf(stderr, "  trusted write: %s\n", err.msg);
  CHECK_EQ_INT(rc, 0);
  mc_batch_free(p.A, b);
  CHECK_EQ_INT(api->cuMemcpyDtoH(back, p.dst, sz), 0);
  size_t bad = 0;
  for (size_t i = 0; i < NBLK; i++)
    bad += memcmp(back + perm(i) * BLK, ref + i * BLK, BLK) != 0;
  CHECK_EQ_INT(bad, 0);
  /* All from the unregistered allocation, one running half past its end
   * in the last chunk. */
  for (size_t i = 0; i < NBLK; i++)
    p.r[i].local = (void *)(uintptr_t)(loose + i * BLK);
  size_t badi = NBLK - 5;
  p.r[badi].local = (void *)(uintptr_t)(loose + sz - BLK / 2);
  b = mc_batch_new(p.A, NBLK);
  mc_batch_trust_locals(b);
  CHECK_EQ_INT(mc_batch_submit(p.A, b, mc_engine_segment_name(p.B), p.r, NBLK, &err),
               MC_EINVAL);
  char want[64];
  snprintf(want, sizeof want, "request %zu (local buffer)", badi);
  CHECK_CONTAINS(err.msg, want);
  CHECK_CONTAINS(err.msg, "runs past its end");
  mc_batch_free(p.A, b);
  cu_free(loose);
  free(ref);
  free(back);
  pair_close(&p);
}

static void test_gen_page(void) {
  mc_engine_t *A, *B;
  mc_err_t err = {0};
  CHECK_EQ_INT(engine_pair(&A, &B, &err), 0);
  char *buf = malloc(1 << 16), *buf2 = malloc(1 << 16);
  CHECK_EQ_INT(mc_engine_register(B, buf, 1 << 16, "cpu", &err), 0);
  mc_remote_desc_t rd;
  describe(A, B, &rd);
  CHECK_EQ_INT(rd.has_gen, 1);
  CHECK_EQ_INT(rd.pid, getpid());
  char path[64], link[128];
  snprintf(path, sizeof path, "/proc/%ld/fd/%d", rd.pid, rd.gen_fd);
  ssize_t ln = readlink(path, link, sizeof link - 1);
  CHECK(ln > 0);
  link[ln > 0 ? ln : 0] = '\0';
  CHECK_CONTAINS(link, "memfd:mc-regions-gen");
  int f = open(path, O_RDONLY);
  CHECK(f >= 0);
  CHECK(fcntl(f, F_GET_SEALS) & F_SEAL_SHRINK); /* mapping it can never fault */
  const volatile uint64_t *w = mmap(NULL, 4096, PROT_READ, MAP_SHARED, f, 0);
  close(f);
  CHECK(w != MAP_FAILED);
  CHECK(w[1] == rd.gen_token);
  CHECK(w[0] == rd.gen);
  uint64_t g0 = w[0];
  /* A change moves the version; the next descriptor names the new one. */
  CHECK_EQ_INT(mc_engine_register(B, buf2, 1 << 16, "cpu", &err), 0);
  CHECK(w[0] > g0);
  mc_remote_desc_free(&rd);
  describe(A, B, &rd);
  CHECK(rd.gen == w[0]);
  uint64_t g1 = w[0];
  CHECK_EQ_INT(mc_engine_unregister(B, buf2, &err), 0);
  CHECK(w[0] > g1); /* bumped by the time unregister returned */
  mc_remote_desc_free(&rd);
  /* The other engine's page is another one. */
  describe(B, A, &rd);
  CHECK(rd.has_gen);
  mc_remote_desc_free(&rd);
  munmap((void *)w, 4096);
  /* A malformed "gen" is refused, naming it. */
  const char *bad[] = {
      "{\"buffers\":[],\"gen\":{\"v\":1,\"fd\":3,\"token\":\"xyz\"}}",
      "{\"buffers\":[],\"gen\":{\"v\":-1,\"fd\":3,\"token\":\"0123456789abcdef\"}}",
      "{\"buffers\":[],\"gen\":{\"v\":1,\"fd\":1e12,\"token\":\"0123456789abcdef\"}}",
      "{\"buffers\":[],\"gen\":{\"v\":1,\"fd\":3,\"token\":\"0123456789ABCDEF\"}}",
      "{\"buffers\":[],\"gen\":7}"};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    mc_err_t e2 = {0};
    CHECK_EQ_INT(mc_segment_desc_decode_regions(bad[i], strlen(bad[i]), &rd, &e2), MC_EPROTO);
    CHECK_CONTAINS(e2.msg, "\"gen\"");
  }
  const char *good = "{\"buffers\":[],\"gen\":{\"v\":9,\"fd\":3,\"token\":\"00000000000000ff\"}}";
  CHECK_EQ_INT(mc_segment_desc_decode_regions(good, strlen(good), &rd, &err), 0);
  CHECK(rd.has_gen && rd.gen == 9 && rd.gen_fd == 3 && rd.gen_token == 0xff);
  mc_remote_desc_free(&rd);
  mc_engine_destroy(A);
  mc_engine_destroy(B);
  free(buf);
  free(buf2);
}

/* The version moves while the copies run (B unregisters the region right
 * after the submit returned; one 1 GiB request keeps the GPU busy for
 * ~1 ms): the op's completion sees it and falls back to the RPC check,
 * which fails it. */
static void test_unregistered_during_copies_fails(void) {
  SKIP_NO_GPU();
  size_t sz = 1ull << 30;
  gpu_pair_t p;
  pair_open(&p, sz);
  CHECK(p.ok);
  mc_err_t err = {0};
  mc_request_t small = {.opcode = MC_OP_WRITE, .local = (void *)(uintptr_t)p.src, .remote = p.dst,
                        .len = BLK};
  CHECK_EQ_INT(xfer(p.A, p.B, &small, 1, &err), 0); /* first contact */
  CHECK_EQ_INT(xfer(p.A, p.B, &small, 1, &err), 0); /* the cached descriptor, version unchanged */
  mc_request_t big = {.opcode = MC_OP_WRITE, .local = (void *)(uintptr_t)p.src, .remote = p.dst,
                      .len = sz};
  mc_batch_t *b = mc_batch_new(p.A, 1);
  CHECK_EQ_INT(mc_batch_submit(p.A, b, mc_engine_segment_name(p.B), &big, 1, &err), 0);
  CHECK_EQ_INT(mc_engine_unregister(p.B, (void *)(uintptr_t)p.dst, &err), 0);
  CHECK(mc_batch_wait(p.A, b, 60000, &err) < 0);
  CHECK_CONTAINS(err.msg, "re-registered its GPU memory");
  mc_batch_free(p.A, b);
  pair_close(&p);
}

/* Copies of mixed sizes and alignments in one launch of the copy kernel
 * (up to 128 travel in its parameters, each cut into 64 KiB pieces on the
 * GPU; more go through the pinned table): 1, 128 and 129 requests, every
 * byte checked, and nothing written outside them. */
static void test_mixed_sizes_kernel(void) {
  SKIP_NO_GPU();
  size_t slot = 320u << 10, nmax = 129, sz = slot * nmax;
  gpu_pair_t p;
  pair_open(&p, sz);
  CHECK(p.ok);
  mc_err_t err = {0};
  uint8_t *ref = malloc(sz), *back = malloc(sz), *want = malloc(sz);
  for (size_t i = 0; i < sz; i++)
    ref[i] = (uint8_t)(i * 131 + (i >> 13) * 7 + 1);
  CHECK_EQ_INT(api->cuMemcpyHtoD(p.src, ref, sz), 0);
  mc_request_t *r = p.r = calloc(nmax, sizeof *r);
  static const size_t counts[] = {1, 128, 129};
  for (size_t c = 0; c < 3; c++) {
    size_t n = counts[c];
    memset(want, 0, sz);
    CHECK_EQ_INT(api->cuMemcpyHtoD(p.dst, want, sz), 0);
    for (size_t i = 0; i < n; i++) {
      /* 1 byte .. ~300 KiB, odd offsets on either side, slots scattered. */
      size_t len = 1 + (i * 7919u * 13u + c * 4099u) % (300u << 10);
      size_t lo = i * slot + (i % 5) * 3, ro = ((i * 37 + 11) % nmax) * slot + (i % 7);
      r[i] = (mc_request_t){.opcode = MC_OP_WRITE, .local = (void *)(uintptr_t)(p.src + lo),
                            .remote = p.dst + ro, .len = len};
      memcpy(want + ro, ref + lo, len);
    }
    int rc = xfer(p.A, p.B, r, n, &err);
    if (rc)
      fprintf(stderr, "  %zu requests: %s\n", n, err.msg);
    CHECK_EQ_INT(rc, 0);
    CHECK_EQ_INT(api->cuMemcpyDtoH(back, p.dst, sz), 0);
    CHECK(memcmp(back, want, sz) == 0);
  }
  pair_close(&p);
  free(ref);
  free(back);
  free(want);
}

int main(void) {
  RUN(test_gen_page);
  RUN(test_mixed_sizes_kernel);
  RUN(test_unregistered_during_copies_fails);
  RUN(test_later_chunks_fresh_descriptor);
  RUN(test_unregistered_since_cached_fails);
  RUN(test_later_chunk_runs_past_allocation);
  RUN(test_trusted_unregistered_locals);
  TEST_MAIN_END();
}
