/* Driver-mapped GPU memory (cuMem: several cuMemCreate chunks mapped back to
 * back into one range, as vLLM 0.34's extensible KV cache) between two
 * processes on one GPU:
 *   - the chunk walk (a fake lookup, everywhere; the driver's, on a GPU):
 *     holes, device changes and ranges running past the last chunk fail;
 *   - a target whose chunks were created with POSIX fd handles: the
 *     same-host GPU path maps them (fds over a Unix socket) and moves bytes
 *     byte-exact both ways (scattered blocks, several chunks on both sides);
 *   - the same over TCP with GPU staging (MC_GPU_IPC=0);
 *   - chunks created without a shareable handle type: TCP, byte-exact, and
 *     the export says why; classic cuMemAlloc memory still takes CUDA IPC;
 *   - a wrong export secret or a malformed export name is refused.
 * Prints GB/s of every path and allocation (same run, same sizes).
 * The target is a forked child (forked before CUDA starts).  Skips without
 * a GPU. */
#include <dlfcn.h>
#include <inttypes.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "engine/engine.h"
#include "gpu/cuda_driver.h"
#include "gpu/gpu_ipc.h"
#include "gpu/gpu_vmm.h"
#include "gpu_testlib.h"
#include "testlib.h"
#include "util/log.h"

#define NCHUNK 4
#define CHUNK (16u << 20)
#define TOTAL ((size_t)NCHUNK * CHUNK)
#define BLK (64u << 10)
#define NBLK (TOTAL / BLK)
#define PASSES (ipc ? 20 : 2) /* timed passes: TCP is ~100x slower */

/* ---- the walk over a fake address space -------------------------------- */

typedef struct {
  uint64_t base[8], size[8];
  int n;
} fake_t;

static int fake_range(void *ctx, uint64_t a, uint64_t *b, uint64_t *s) {
  fake_t *f = ctx;
  for (int i = 0; i < f->n; i++)
    if (a >= f->base[i] && a < f->base[i] + f->size[i]) {
      *b = f->base[i];
      *s = f->size[i];
      return 0;
    }
  return -1;
}

static void test_walk_fake(void) {
  fake_t f = {.base = {0x100000, 0x300000, 0x500000, 0x900000},
              .size = {0x200000, 0x200000, 0x200000, 0x100000}, .n = 4};
  mc_gpu_chunk_t *ch = NULL;
  size_t n = 0;
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_gpu_vmm_walk(fake_range, &f, 0x180000, 0x300000, &ch, &n, &err), 0);
  CHECK_EQ_INT(n, 2);
  CHECK(ch[0].base == 0x100000 && ch[1].base == 0x300000 && ch[1].size == 0x200000);
  free(ch);
  /* Exactly to the end of the third chunk. */
  CHECK_EQ_INT(mc_gpu_vmm_walk(fake_range, &f, 0x100000, 0x600000, &ch, &n, &err), 0);
  CHECK_EQ_INT(n, 3);
  free(ch);
  /* One byte more runs into the hole at 0x700000. */
  CHECK_EQ_INT(mc_gpu_vmm_walk(fake_range, &f, 0x100000, 0x600001, &ch, &n, &err), MC_EINVAL);
  CHECK(ch == NULL);
  CHECK_CONTAINS(err.msg, "nothing usable is mapped at 0x700000");
  CHECK_EQ_INT(mc_gpu_vmm_walk(fake_range, &f, 0x50, 16, &ch, &n, &err), MC_EUNAVAIL);
  CHECK_EQ_INT(mc_gpu_vmm_walk(fake_range, &f, UINT64_MAX - 4, 16, &ch, &n, &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "wraps");
  /* Length 0 is the chunk holding addr. */
  CHECK_EQ_INT(mc_gpu_vmm_walk(fake_range, &f, 0x900010, 0, &ch, &n, &err), 0);
  CHECK_EQ_INT(n, 1);
  free(ch);
}

/* The per-chunk RDMA pieces of a range: clipped to it, tiling it. */
static void test_clip_fake(void) {
  fake_t f = {.base = {0x100000, 0x300000, 0x500000},
              .size = {0x200000, 0x200000, 0x200000}, .n = 3};
  mc_gpu_chunk_t *ch = NULL;
  size_t n = 0;
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_gpu_vmm_walk(fake_range, &f, 0x180000, 0x480000, &ch, &n, &err), 0);
  uint64_t *p = NULL;
  CHECK_EQ_INT(mc_gpu_chunks_clip(ch, n, 0x180000, 0x480000, &p), 3);
  CHECK(p[0] == 0x180000 && p[1] == 0x180000);
  CHECK(p[2] == 0x300000 && p[3] == 0x200000);
  CHECK(p[4] == 0x500000 && p[5] == 0x100000);
  free(p);
  free(ch);
}

/* Export names come from peers' descriptors: malformed ones are refused
 * before anything else (no driver needed). */
static void test_import_name_parse(void) {
  static const char *bad[] = {
      "vmm1:", "vmm1:12", "vmm1:12:abc:1",
      "vmm1:12:00000000000000000000000000000000:1", /* no tag */
      "vmm1:0:0123456789abcdef:00000000000000000000000000000000:1",
      "vmm1:-5:0123456789abcdef:00000000000000000000000000000000:1",
      "vmm1:12:0123456789abcdef:0000000000000000000000000000000g:1",
      "vmm1:12:0123456789abcdef:00000000000000000000000000000000:1x",
      "vmm1:12:0123456789abcdef:000000000000000000000000000000000:1", /* 33 hex digits */
      "vmm1:12:0123456789abcde:00000000000000000000000000000000:1",   /* 15 */
      "vmm2:12:0123456789abcdef:00000000000000000000000000000000:1", "",
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    uint64_t m = 0;
    mc_err_t err = {0};
    CHECK_EQ_INT(mc_gpu_vmm_import(bad[i], 0, &m, &err), MC_EINVAL);
    CHECK_CONTAINS(err.msg, "malformed GPU memory export");
  }
}

/* ---- driver-mapped memory ---------------------------------------------- */

typedef int (*create_fn)(mc_cu_mem_handle *, size_t, const mc_cu_mem_alloc_prop_t *,
                         unsigned long long);

/* NCHUNK chunks of CHUNK bytes on cuda:0 mapped back to back; 0 on failure. */
static uint64_t vmm_alloc(int handle_types) {
  mc_cu_mem_alloc_prop_t prop;
  memset(&prop, 0, sizeof prop);
  prop.type = MC_CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requested_handle_types = handle_types;
  prop.location.type = MC_CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  size_t g = 0;
  if (!api->cuMemCreate || api->cuMemGetAllocationGranularity(&g, &prop, 0) != 0 ||
      CHUNK % g)
    return 0;
  mc_cu_ptr va = 0;
  if (api->cuMemAddressReserve(&va, TOTAL, 0, 0, 0) != 0)
    return 0;
  for (int i = 0; i < NCHUNK; i++) {
    mc_cu_mem_handle h = 0;
    if (api->cuMemCreate(&h, CHUNK, &prop, 0) != 0 ||
        api->cuMemMap(va + (uint64_t)i * CHUNK, CHUNK, 0, h, 0) != 0)
      return 0;
    api->cuMemRelease(h); /* the mapping holds it */
  }
  mc_cu_mem_access_desc_t d = {.location = {MC_CU_MEM_LOCATION_TYPE_DEVICE, 0},
                               .flags = MC_CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  if (api->cuMemSetAccess(va, TOTAL, &d, 1) != 0)
    return 0;
  return va;
}

static uint64_t fnv(const uint8_t *p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++)
    h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

/* The target process: three regions, then answers hashes until told to stop. */
enum { R_FD = 0, R_NOFD = 1, R_CLASSIC = 2, NREG = 3 };
typedef struct {
  char segment[256];
  uint64_t addr[NREG];
  char export_name[MC_GPU_IPC_B64_MAX];
  char export_again[MC_GPU_IPC_B64_MAX]; /* the same range exported once more */
  char nofd_why[400];
  size_t walk_n;
  uint64_t walk_base0, walk_size1;
  int skip;
} info_t;

static void child(int wfd, int rfd) {
  info_t in;
  memset(&in, 0, sizeof in);
  if (!have_gpu()) {
    in.skip = 1;
    (void)!write(wfd, &in, sizeof in);
    _exit(0);
  }
  mc_engine_t *B;
  mc_err_t err = {0};
  if (engine_new(&B, &err) < 0)
    _exit(2);
  in.addr[R_FD] = vmm_alloc(MC_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  in.addr[R_NOFD] = vmm_alloc(0);
  in.addr[R_CLASSIC] = dalloc(TOTAL);
  for (int i = 0; i < NREG; i++)
    if (!in.addr[i] || mc_engine_register(B, (void *)(uintptr_t)in.addr[i], TOTAL, "cuda:0",
                                          &err) < 0) {
      fprintf(stderr, "child: region %d: %s\n", i, err.msg);
      _exit(3);
    }
  mc_gpu_chunk_t *ch = NULL;
  if (mc_gpu_vmm_chunks(in.addr[R_FD] + 100, TOTAL - 200, &ch, &in.walk_n, &err) == 0) {
    in.walk_base0 = ch[0].base;
    in.walk_size1 = ch[1 < in.walk_n ? 1 : 0].size;
    free(ch);
  }
  uint64_t b = 0;
  if (mc_gpu_ipc_export_range(in.addr[R_FD], TOTAL, 0, in.export_name, &b, &err) < 0)
    snprintf(in.export_name, sizeof in.export_name, "export failed: %s", err.msg);
  if (mc_gpu_ipc_export_range(in.addr[R_FD], TOTAL, 0, in.export_again, &b, &err) < 0)
    snprintf(in.export_again, sizeof in.export_again, "export failed");
  if (mc_gpu_ipc_export_range(in.addr[R_NOFD], TOTAL, 0, (char[MC_GPU_IPC_B64_MAX]){0}, &b,
                              &err) == 0)
    snprintf(in.nofd_why, sizeof in.nofd_why, "(exported)");
  else
    snprintf(in.nofd_why, sizeof in.nofd_why, "%s", err.msg);
  snprintf(in.segment, sizeof in.segment, "%s", mc_engine_segment_name(B));
  (void)!write(wfd, &in, sizeof in);
  uint8_t *host = malloc(TOTAL);
  for (;;) {
    uint32_t which = 0;
    if (read(rfd, &which, sizeof which) != (ssize_t)sizeof which || which >= NREG)
      break;
    uint64_t h = 0;
    if (api->cuMemcpyDtoH(host, in.addr[which], TOTAL) == 0)
      h = fnv(host, TOTAL);
    (void)!write(wfd, &h, sizeof h);
  }
  mc_engine_destroy(B);
  _exit(0);
}

static pid_t g_child;
static int g_w = -1, g_r = -1;
static info_t g_in;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static size_t perm(size_t i) {
  return (i * 7 + 3) % NBLK;
}

static int run_batch(mc_engine_t *A, int op, uint64_t local, uint64_t remote, mc_err_t *err) {
  mc_request_t *r = calloc(NBLK, sizeof *r);
  for (size_t i = 0; i < NBLK; i++)
    r[i] = (mc_request_t){.opcode = op, .local = (void *)(uintptr_t)(local + i * BLK),
                          .remote = remote + perm(i) * BLK, .len = BLK};
  mc_batch_t *b = mc_batch_new(A, NBLK);
  int rc = mc_batch_submit(A, b, g_in.segment, r, NBLK, err);
  if (rc == 0)
    rc = mc_batch_wait(A, b, 120000, err);
  mc_batch_free(A, b);
  free(r);
  return rc;
}

static uint64_t child_hash(uint32_t which) {
  uint64_t h = 0;
  if (write(g_w, &which, sizeof which) != (ssize_t)sizeof which ||
      read(g_r, &h, sizeof h) != (ssize_t)sizeof h)
    return 0;
  return h;
}

/* One case: fresh initiator engine (so its path log line is fresh), local
 * memory `local` (driver-mapped), target region `which`.  Checks bytes both
 * ways and which path the log names. */
static void one_case(uint64_t local, int which, int ipc, const char *want_log,
                     const char *label) {
  setenv("MC_GPU_IPC", ipc ? "1" : "0", 1);
  mc_engine_t *A;
  mc_err_t err = {0};
  int rc = engine_new(&A, &err);
  unsetenv("MC_GPU_IPC");
  CHECK_EQ_INT(rc, 0);
  CHECK_EQ_INT(mc_engine_register(A, (void *)(uintptr_t)local, TOTAL, "cuda:0", &err), 0);
  uint8_t *ref = malloc(TOTAL), *exp = malloc(TOTAL), *back = malloc(TOTAL);
  fill(ref, TOTAL, (uint32_t)(which * 2 + ipc + 1));
  for (size_t i = 0; i < NBLK; i++)
    memcpy(exp + perm(i) * BLK, ref + i * BLK, BLK);
  CHECK_EQ_INT(api->cuMemcpyHtoD(local, ref, TOTAL), 0);
  /* Path log: stderr into a file for the first transfer. */
  fflush(stderr);
  char path[] = "/tmp/mc_test_gpu_vmm_XXXXXX";
  int lf = mkstemp(path), saved = dup(2);
  dup2(lf, 2);
  int lvl = mc_log_level();
  mc_log_set_level(MC_LOG_INFO);
  rc = run_batch(A, MC_OP_WRITE, local, g_in.addr[which], &err);
  mc_log_set_level(lvl);
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  char logbuf[8192] = "";
  ssize_t k = pread(lf, logbuf, sizeof logbuf - 1, 0);
  logbuf[k > 0 ? k : 0] = '\0';
  close(lf);
  unlink(path);
  if (rc)
    fprintf(stderr, "  %s write: %s\n", label, err.msg);
  CHECK_EQ_INT(rc, 0);
  CHECK(child_hash((uint32_t)which) == fnv(exp, TOTAL));
  if (want_log)
    CHECK_CONTAINS(logbuf, want_log);
  if (ipc == 0)
    CHECK(strstr(logbuf, "moves directly") == NULL);
  /* Timed passes (after that first one, which set the path up). */
  double t0 = now_s();
  for (int p = 0; p < PASSES && rc == 0; p++)
    rc = run_batch(A, MC_OP_WRITE, local, g_in.addr[which], &err);
  double tw = now_s() - t0;
  CHECK_EQ_INT(rc, 0);
  memset(back, 0, TOTAL);
  CHECK_EQ_INT(api->cuMemcpyHtoD(local, back, TOTAL), 0);
  t0 = now_s();
  for (int p = 0; p < PASSES && rc == 0; p++)
    rc = run_batch(A, MC_OP_READ, local, g_in.addr[which], &err);
  double tr = now_s() - t0;
  if (rc)
    fprintf(stderr, "  %s read: %s\n", label, err.msg);
  CHECK_EQ_INT(rc, 0);
  CHECK_EQ_INT(api->cuMemcpyDtoH(back, local, TOTAL), 0);
  CHECK(memcmp(back, ref, TOTAL) == 0);
  printf("  %-44s WRITE %8.1f GB/s  READ %8.1f GB/s  (%u x %u KiB blocks, %d passes)\n", label,
         (double)PASSES * TOTAL / tw / 1e9, (double)PASSES * TOTAL / tr / 1e9, (unsigned)NBLK,
         BLK >> 10, PASSES);
  mc_engine_destroy(A);
  free(ref);
  free(exp);
  free(back);
}

static uint64_t g_local;

static void test_walk_driver(void) {
  SKIP_NO_GPU();
  CHECK_EQ_INT(g_in.walk_n, NCHUNK);
  CHECK(g_in.walk_base0 == g_in.addr[R_FD]);
  CHECK(g_in.walk_size1 == CHUNK);
  /* Here too: a range past the last chunk, and classic memory. */
  mc_gpu_chunk_t *ch = NULL;
  size_t n = 0;
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_gpu_vmm_chunks(g_local, TOTAL, &ch, &n, &err), 0);
  CHECK_EQ_INT(n, NCHUNK);
  free(ch);
  CHECK_EQ_INT(mc_gpu_vmm_chunks(g_local + 8, TOTAL, &ch, &n, &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "not driver-mapped memory of one GPU throughout");
  /* RDMA pieces: one per chunk, tiling the range. */
  uint64_t *p = NULL;
  CHECK_EQ_INT(mc_gpu_vmm_pieces(g_local + 4096, TOTAL - 8192, &p, &err), NCHUNK);
  CHECK(p[0] == g_local + 4096 && p[1] == CHUNK - 4096);
  CHECK(p[2] == g_local + CHUNK && p[3] == CHUNK);
  CHECK(p[2 * (NCHUNK - 1) + 1] == CHUNK - 4096);
  free(p);
  CHECK_EQ_INT(mc_gpu_vmm_pieces(g_local + 4096, 8192, &p, &err), 0); /* one chunk */
  uint64_t d = dalloc(1 << 20);
  CHECK(d);
  CHECK_EQ_INT(mc_gpu_vmm_is_mapped(d), 0);
  CHECK_EQ_INT(mc_gpu_vmm_pieces(d, 4096, &p, &err), 0);
  CHECK_EQ_INT(mc_gpu_vmm_is_mapped(g_local + TOTAL - 1), 1);
  cu_free(d);
}

static void test_same_host_fd(void) {
  SKIP_NO_GPU();
  CHECK(!strncmp(g_in.export_name, MC_GPU_VMM_PREFIX, strlen(MC_GPU_VMM_PREFIX)));
  /* A re-export (vLLM re-registers after re-committing new chunks at the
   * same addresses) gets a new name: peers never reuse a stale mapping. */
  CHECK(!strncmp(g_in.export_again, MC_GPU_VMM_PREFIX, strlen(MC_GPU_VMM_PREFIX)));
  CHECK(strcmp(g_in.export_name, g_in.export_again) != 0);
  one_case(g_local, R_FD, 1, "same host: GPU memory moves directly",
           "cuMem 4 chunks, POSIX fd, same-host GPU");
}

static void test_tcp_staging_fd(void) {
  SKIP_NO_GPU();
  one_case(g_local, R_FD, 0, NULL, "cuMem 4 chunks, POSIX fd, TCP GPU staging");
}

static void test_no_handle_type(void) {
  SKIP_NO_GPU();
  CHECK_CONTAINS(g_in.nofd_why, "without a POSIX file descriptor handle type");
  CHECK_CONTAINS(g_in.nofd_why, "KVCacheAccess.EXPORTS_FD");
  one_case(g_local, R_NOFD, 1, "TCP with pinned staging",
           "cuMem 4 chunks, no handle type, TCP fallback");
}

static void test_classic(void) {
  SKIP_NO_GPU();
  one_case(g_local, R_CLASSIC, 1, "same host: GPU memory moves directly",
           "cuMemAlloc (classic), same-host GPU");
  one_case(g_local, R_CLASSIC, 0, NULL, "cuMemAlloc (classic), TCP GPU staging");
}

static void test_import_refusals(void) {
  SKIP_NO_GPU();
  char bad[MC_GPU_IPC_B64_MAX];
  snprintf(bad, sizeof bad, "%s", g_in.export_name);
  char *colon = strchr(bad + strlen(MC_GPU_VMM_PREFIX), ':');
  CHECK(colon && (colon = strchr(colon + 1, ':')));
  colon[1] = colon[1] == 'a' ? 'b' : 'a'; /* same socket, another secret */
  uint64_t m = 0;
  mc_err_t err = {0};
  CHECK(mc_gpu_vmm_import(bad, 0, &m, &err) < 0);
  CHECK_CONTAINS(err.msg, "wrong export secret");
  CHECK_EQ_INT(mc_gpu_vmm_import("vmm1:12:zz:1", 0, &m, &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "malformed GPU memory export");
  CHECK_EQ_INT(mc_gpu_ipc_open("vmm1:1:0123456789abcdef:00000000000000000000000000000000:0x", 0,
                               &m, &err), MC_EINVAL);
  /* Another index: the owner has no such export. */
  snprintf(bad, sizeof bad, "%s", g_in.export_name);
  strcat(bad, "7");
  CHECK(mc_gpu_vmm_import(bad, 0, &m, &err) < 0);
  CHECK_CONTAINS(err.msg, "no such GPU memory export");
  /* The real one maps the child's bytes at the same offsets. */
  CHECK_EQ_INT(mc_gpu_vmm_import(g_in.export_name, 0, &m, &err), 0);
  uint8_t *a = malloc(TOTAL);
  CHECK_EQ_INT(api->cuMemcpyDtoH(a, m, TOTAL), 0);
  CHECK(fnv(a, TOTAL) == child_hash(R_FD));
  free(a);
  /* Undone once (what the same-host path's last user of a mapping does),
   * then no longer known. */
  CHECK_EQ_INT(mc_gpu_vmm_unimport(m, &err), 0);
  CHECK_EQ_INT(mc_gpu_vmm_unimport(m, &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "no GPU memory import");
}

int main(void) {
  RUN(test_walk_fake);
  RUN(test_clip_fake);
  RUN(test_import_name_parse);
  signal(SIGPIPE, SIG_IGN); /* a target that exited early: write fails, no signal */
  int to_child[2], from_child[2];
  if (pipe(to_child) || pipe(from_child))
    return 1;
  fflush(stdout);
  fflush(stderr);
  g_child = fork();
  if (g_child == 0) {
    close(to_child[1]);
    close(from_child[0]);
    child(from_child[1], to_child[0]);
  }
  close(to_child[0]);
  close(from_child[1]);
  g_w = to_child[1];
  g_r = from_child[0];
  if (read(g_r, &g_in, sizeof g_in) != (ssize_t)sizeof g_in) {
    fprintf(stderr, "target process failed to start\n");
    return 1;
  }
  if (!g_in.skip && have_gpu())
    g_local = vmm_alloc(MC_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (!g_in.skip) {
    RUN(test_walk_driver);
    RUN(test_same_host_fd);
    RUN(test_tcp_staging_fd);
    RUN(test_no_handle_type);
    RUN(test_classic);
    RUN(test_import_refusals);
  } else {
    fprintf(stderr, "  (GPU tests skipped: no GPU visible)\n");
  }
  uint32_t stop = NREG;
  (void)!write(g_w, &stop, sizeof stop);
  close(g_w);
  int st = 0;
  waitpid(g_child, &st, 0);
  TEST_MAIN_END();
}
