/* RDMA transport test, run inside the SoftRoCE guest (run-in-guest.sh):
 * two processes (fork), a target on rxe1 and an initiator on rxe0, P2P
 * mode (no metadata server), the engine API with protocol "rdma".
 *
 *   rdma_transfer_test [all | bench [MiB per point, default 64] | auth] [NAME=VALUE...]
 *
 * all:   READ and WRITE of 1 B .. 64 MiB and a batch of 10,000 blocks,
 *        byte-exact; then faults: an address outside the target's regions,
 *        a stale rkey (the target unregistered), the link set down
 *        mid-transfer, the target killed mid-batch -- each must fail with a
 *        clear error within its timeout, never hang.
 * bench: our WRITE bandwidth vs ib_write_bw (if present) for 64 KiB and
 *        1 MiB, and our CPU time per GB.
 * auth:  run with MC_AUTH_SECRET=... (both processes): RDMA connection setup
 *        behind peer authentication (docs/security.md): the right secret
 *        moves 1 MiB both ways byte-exact; a wrong or missing one is refused
 *        (MC_EAUTH) before any QP or rkey is exchanged.
 * Exit status 0 when every check passed. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "engine/engine.h"

#define TBUF (80ull << 20) /* target region */
#define LBUF (80ull << 20) /* initiator buffers */

static int failures, passes;
#define CHECK(cond, ...)                                                                \
  do {                                                                                  \
    if (cond) {                                                                         \
      passes++;                                                                         \
      printf("ok   ");                                                                  \
    } else {                                                                            \
      failures++;                                                                       \
      printf("FAIL ");                                                                  \
    }                                                                                   \
    printf(__VA_ARGS__);                                                                \
    printf("\n");                                                                       \
    fflush(stdout);                                                                     \
  } while (0)

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static double cpu_s(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec +
         ru.ru_stime.tv_usec / 1e6;
}

static void fill(uint8_t *p, size_t n, unsigned seed) {
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; i++) {
    x = x * 1103515245u + 12345u;
    p[i] = (uint8_t)(x >> 16);
  }
}

static mc_engine_t *make_engine_auth(const char *dev, const char *secret) {
  mc_engine_opts_t o = {.local_hostname = "127.0.0.1", .metadata_server = "P2PHANDSHAKE",
                        .protocol = "rdma", .device_name = dev, .auth_secret = secret};
  mc_engine_t *e = NULL;
  mc_err_t err = {0};
  if (mc_engine_create(&o, &e, &err) < 0) {
    printf("FAIL engine on %s: %s\n", dev, err.msg);
    return NULL;
  }
  return e;
}

static mc_engine_t *make_engine(const char *dev) { return make_engine_auth(dev, NULL); }

/* ---- target: serves its region; commands on a pipe ---- */
static int target_main(int cmd_fd, int ans_fd) {
  /* Two NICs: peers stripe over both, each with its own rkey. */
  mc_engine_t *e = make_engine("rxe1,rxe0");
  if (!e)
    return 1;
  uint8_t *buf = aligned_alloc(4096, TBUF);
  fill(buf, TBUF, 7);
  mc_err_t err;
  if (mc_engine_register(e, buf, TBUF, "cpu", &err) < 0) {
    printf("FAIL target register: %s\n", err.msg);
    return 1;
  }
  char line[512];
  int n = snprintf(line, sizeof line, "%s %llu\n", mc_engine_segment_name(e),
                   (unsigned long long)(uintptr_t)buf);
  if (write(ans_fd, line, (size_t)n) != n)
    return 1;
  char c;
  while (read(cmd_fd, &c, 1) == 1) {
    int rc = 0;
    if (c == 'u')
      rc = mc_engine_unregister(e, buf, &err);
    else if (c == 'r')
      rc = mc_engine_register(e, buf, TBUF, "cpu", &err);
    else if (c == 'q')
      break;
    char a = rc == 0 ? 'k' : 'e';
    if (write(ans_fd, &a, 1) != 1)
      break;
  }
  mc_engine_destroy(e);
  free(buf);
  return 0;
}

static char cmd(int cmd_fd, int ans_fd, char c) {
  char a = 0;
  if (write(cmd_fd, &c, 1) != 1 || read(ans_fd, &a, 1) != 1)
    return 0;
  return a;
}

static int xfer(mc_engine_t *e, const char *seg, int op, void *local, uint64_t remote,
                uint64_t len, int64_t tmo, mc_err_t *err) {
  mc_batch_t *b = mc_batch_new(e, 1);
  mc_request_t r = {.opcode = op, .local = local, .remote = remote, .len = len};
  int rc = mc_batch_submit(e, b, seg, &r, 1, err);
  if (rc == 0)
    rc = mc_batch_wait(e, b, tmo, err);
  mc_batch_free(e, b);
  return rc;
}

static void test_sizes(mc_engine_t *e, const char *seg, uint64_t raddr, uint8_t *src,
                       uint8_t *dst) {
  static const uint64_t sizes[] = {1, 7, 4096, 65535, 65536, 65537, 1 << 20, (4 << 20) + 3,
                                   64ull << 20};
  /* READ first: the target filled its region with seed 7. */
  uint8_t *expect = malloc(64ull << 20);
  fill(expect, 64ull << 20, 7);
  mc_err_t err;
  memset(dst, 0, 64ull << 20);
  double t0 = now_s();
  int rc = xfer(e, seg, MC_OP_READ, dst, raddr, 64ull << 20, 60000, &err);
  CHECK(rc == 0 && !memcmp(dst, expect, 64ull << 20), "READ 64 MiB of the target's pattern "
        "byte-exact (%.2f s)%s%s", now_s() - t0, rc ? ": " : "", rc ? err.msg : "");
  free(expect);
  for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
    uint64_t n = sizes[i], off = (i * 4099) % 4096 + 4096; /* unaligned remote offsets */
    fill(src, n, (unsigned)(100 + i));
    memset(dst, 0xEE, n);
    t0 = now_s();
    int w = xfer(e, seg, MC_OP_WRITE, src, raddr + off, n, 60000, &err);
    if (w)
      printf("     WRITE error: %s\n", err.msg);
    int r = w ? w : xfer(e, seg, MC_OP_READ, dst, raddr + off, n, 60000, &err);
    if (r && !w)
      printf("     READ error: %s\n", err.msg);
    CHECK(w == 0 && r == 0 && !memcmp(src, dst, n),
          "WRITE then READ %llu bytes at remote offset %llu byte-exact (%.3f s)",
          (unsigned long long)n, (unsigned long long)off, now_s() - t0);
  }
}

static void test_batch(mc_engine_t *e, const char *seg, uint64_t raddr, uint8_t *src,
                       uint8_t *dst) {
  enum { N = 10000, BS = 4096 };
  mc_request_t *rq = calloc(N, sizeof *rq);
  uint32_t *perm = malloc(N * sizeof *perm);
  for (uint32_t i = 0; i < N; i++)
    perm[i] = i;
  srand(42);
  for (uint32_t i = N - 1; i > 0; i--) {
    uint32_t j = (uint32_t)rand() % (i + 1), t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  fill(src, (size_t)N * BS, 555);
  memset(dst, 0, (size_t)N * BS);
  for (int pass = 0; pass < 2; pass++) {
    for (uint32_t i = 0; i < N; i++)
      rq[i] = (mc_request_t){.opcode = pass ? MC_OP_READ : MC_OP_WRITE,
                             .local = (pass ? dst : src) + (size_t)i * BS,
                             .remote = raddr + (uint64_t)perm[i] * BS, .len = BS};
    mc_batch_t *b = mc_batch_new(e, N);
    mc_err_t err;
    double t0 = now_s();
    int rc = mc_batch_submit(e, b, seg, rq, N, &err);
    if (rc == 0)
      rc = mc_batch_wait(e, b, 120000, &err);
    mc_batch_free(e, b);
    CHECK(rc == 0, "batch of %d %s blocks of %d bytes (scattered remote offsets) in %.2f s%s%s",
          N, pass ? "READ" : "WRITE", BS, now_s() - t0, rc ? ": " : "", rc ? err.msg : "");
  }
  CHECK(!memcmp(src, dst, (size_t)N * BS), "batch of %d blocks byte-exact after WRITE + READ",
        N);
  free(rq);
  free(perm);
}

/* Our WRITE bandwidth for one block size: `iters` blocks per batch. */
static double our_bw(mc_engine_t *e, const char *seg, uint64_t raddr, uint8_t *src,
                     uint64_t bs, int iters, double *cpu_per_gb) {
  mc_request_t *rq = calloc((size_t)iters, sizeof *rq);
  uint64_t span = (64ull << 20) / bs;
  for (int i = 0; i < iters; i++)
    rq[i] = (mc_request_t){.opcode = MC_OP_WRITE, .local = src + (i % span) * bs,
                           .remote = raddr + (i % span) * bs, .len = bs};
  mc_err_t err;
  double c0 = cpu_s(), t0 = now_s();
  mc_batch_t *b = mc_batch_new(e, (size_t)iters);
  int rc = mc_batch_submit(e, b, seg, rq, (size_t)iters, &err);
  if (rc == 0)
    rc = mc_batch_wait(e, b, 120000, &err);
  mc_batch_free(e, b);
  double dt = now_s() - t0, dc = cpu_s() - c0;
  free(rq);
  if (rc) {
    printf("FAIL bandwidth run: %s\n", err.msg);
    failures++;
    return 0;
  }
  double gb = (double)bs * iters / 1e9;
  *cpu_per_gb = dc / gb;
  return gb / dt * 1000.0; /* MB/s */
}

/* ib_write_bw (perftest) between rxe1 (server) and rxe0, same volume;
 * tx_depth 0: perftest's default.  MB/s (10^6), and the CPU seconds per GB
 * of both perftest processes (RUSAGE_CHILDREN). */
static double perftest_bw(uint64_t bs, int iters, int tx_depth, double *cpu_per_gb) {
  if (access("/usr/bin/ib_write_bw", X_OK) != 0)
    return -1;
  char cmdline[600], tx[32] = "";
  if (tx_depth)
    snprintf(tx, sizeof tx, "-t %d", tx_depth);
  snprintf(cmdline, sizeof cmdline,
           "timeout 150 /usr/bin/ib_write_bw -d rxe1 -x 0 -s %llu -n %d %s -F >/dev/null 2>&1 & "
           "sleep 3; timeout 120 /usr/bin/ib_write_bw -d rxe0 -x 0 -s %llu -n %d %s -F "
           "127.0.0.1 2>&1; wait",
           (unsigned long long)bs, iters, tx, (unsigned long long)bs, iters, tx);
  struct rusage r0, r1;
  getrusage(RUSAGE_CHILDREN, &r0);
  FILE *p = popen(cmdline, "r");
  if (!p)
    return -1;
  char line[512];
  double bw = -1;
  while (fgets(line, sizeof line, p)) {
    unsigned long long b;
    int it;
    double peak, avg;
    if (sscanf(line, " %llu %d %lf %lf", &b, &it, &peak, &avg) == 4 && b == bs) {
      bw = avg * 1.048576; /* perftest's MB is MiB */
      printf("     ib_write_bw %s: %s", tx[0] ? tx : "(default tx depth)", line);
    } else if (strstr(line, "rror") || strstr(line, "ailed") || strstr(line, "annot")) {
      printf("     ib_write_bw: %s", line);
    }
  }
  pclose(p);
  getrusage(RUSAGE_CHILDREN, &r1);
  double cpu = (double)(r1.ru_utime.tv_sec - r0.ru_utime.tv_sec) +
               (r1.ru_utime.tv_usec - r0.ru_utime.tv_usec) / 1e6 +
               (double)(r1.ru_stime.tv_sec - r0.ru_stime.tv_sec) +
               (r1.ru_stime.tv_usec - r0.ru_stime.tv_usec) / 1e6;
  *cpu_per_gb = cpu / ((double)bs * iters / 1e9);
  return bw;
}

static int bench_mb = 64; /* bytes per point: `bench MB` */

static void bench(mc_engine_t *e, const char *seg, uint64_t raddr, uint8_t *src) {
  static const uint64_t sizes[] = {65536, 262144, 1 << 20};
  uint64_t total = (uint64_t)bench_mb << 20;
  for (size_t i = 0; i < 3; i++) {
    uint64_t bs = sizes[i];
    int iters = (int)(total / bs);
    double cpu = 0, pcpu = 0, pcpu2 = 0;
    our_bw(e, seg, raddr, src, bs, iters / 8 ? iters / 8 : 1, &cpu); /* warm-up */
    double ours = our_bw(e, seg, raddr, src, bs, iters, &cpu);
    double ref = perftest_bw(bs, iters, 0, &pcpu);
    double ref2 = perftest_bw(bs, iters, 16, &pcpu2);
    if (ref2 > ref) {
      ref = ref2;
      pcpu = pcpu2;
    }
    printf("BENCH size=%llu bytes=%llu ours_MBps=%.1f ib_write_bw_best_MBps=%.1f ratio=%.2f "
           "ours_cpu_s_per_GB=%.1f ib_write_bw_cpu_s_per_GB=%.1f\n",
           (unsigned long long)bs, (unsigned long long)total, ours, ref,
           ref > 0 ? ours / ref : 0, cpu, pcpu);
    fflush(stdout);
  }
}

static void test_faults(mc_engine_t *e, const char *seg, uint64_t raddr, uint8_t *src,
                        int cmd_fd, int ans_fd, pid_t target) {
  mc_err_t err;
  /* 1. An address outside every region the target registered. */
  double t0 = now_s();
  int rc = xfer(e, seg, MC_OP_WRITE, src, raddr + TBUF + 4096, 4096, 10000, &err);
  CHECK(rc == MC_ERANGE && strstr(err.msg, "not inside any memory region"),
        "WRITE outside the target's regions fails in %.2f s: %s", now_s() - t0, err.msg);
  rc = xfer(e, seg, MC_OP_READ, src, raddr + 4096, 4096, 10000, &err);
  CHECK(rc == 0, "the next request on the same connection still works%s%s", rc ? ": " : "",
        rc ? err.msg : "");

  /* 2. A stale rkey: the target deregistered the region after we cached it. */
  CHECK(cmd(cmd_fd, ans_fd, 'u') == 'k', "target unregistered its region");
  t0 = now_s();
  rc = xfer(e, seg, MC_OP_WRITE, src, raddr, 65536, 20000, &err);
  CHECK(rc != 0 && (strstr(err.msg, "remote access") || strstr(err.msg, "not inside")),
        "WRITE with a stale rkey fails in %.2f s with the verbs status: %s", now_s() - t0,
        err.msg);
  CHECK(cmd(cmd_fd, ans_fd, 'r') == 'k', "target registered its region again");
  t0 = now_s();
  rc = xfer(e, seg, MC_OP_WRITE, src, raddr, 65536, 20000, &err);
  CHECK(rc == 0, "after the failed QP the endpoint reconnects and WRITE works (%.2f s)%s%s",
        now_s() - t0, rc ? ": " : "", rc ? err.msg : "");

  /* 3. The link goes down mid-transfer. */
  {
    enum { N = 256 };
    mc_request_t rq[N];
    for (int i = 0; i < N; i++)
      rq[i] = (mc_request_t){.opcode = MC_OP_WRITE, .local = src + (size_t)(i % 64) * (1 << 20),
                             .remote = raddr + (uint64_t)(i % 64) * (1 << 20), .len = 1 << 20};
    mc_batch_t *b = mc_batch_new(e, N);
    t0 = now_s();
    rc = mc_batch_submit(e, b, seg, rq, N, &err);
    usleep(300000);
    if (system("/usr/sbin/ip link set v1 down") != 0)
      printf("     (ip link set v1 down failed)\n");
    double t1 = now_s();
    if (rc == 0)
      rc = mc_batch_wait(e, b, 30000, &err);
    double waited = now_s() - t1;
    mc_batch_free(e, b);
    CHECK(rc != 0 && waited < 31, "link down mid-batch (256 x 1 MiB WRITE): fails %.2f s after "
          "the link went down: %s", waited, rc ? err.msg : "(completed?)");
    if (system("/usr/sbin/ip link set v1 up") != 0)
      printf("     (ip link set v1 up failed)\n");
    /* The ports come back after a moment; a caller retries. */
    t0 = now_s();
    int tries = 0;
    do {
      usleep(500000);
      rc = xfer(e, seg, MC_OP_WRITE, src, raddr, 1 << 20, 30000, &err);
      if (rc)
        printf("     (try %d: %s)\n", tries + 1, err.msg);
    } while (rc && ++tries < 10);
    CHECK(rc == 0, "after the link is back a new endpoint works (%.2f s)%s%s", now_s() - t0,
          rc ? ": " : "", rc ? err.msg : "");
  }

  /* 4. The target is killed mid-batch. */
  {
    enum { N = 256 };
    mc_request_t rq[N];
    for (int i = 0; i < N; i++)
      rq[i] = (mc_request_t){.opcode = i % 2 ? MC_OP_READ : MC_OP_WRITE,
                             .local = src + (size_t)(i % 64) * (1 << 20),
                             .remote = raddr + (uint64_t)(i % 64) * (1 << 20), .len = 1 << 20};
    mc_batch_t *b = mc_batch_new(e, N);
    rc = mc_batch_submit(e, b, seg, rq, N, &err);
    usleep(300000);
    kill(target, SIGKILL);
    double t1 = now_s();
    if (rc == 0)
      rc = mc_batch_wait(e, b, 30000, &err);
    double waited = now_s() - t1;
    mc_batch_free(e, b);
    CHECK(rc != 0 && waited < 31, "target killed mid-batch: fails %.2f s after the kill: %s",
          waited, rc ? err.msg : "(completed?)");
  }
}

/* Mode auth: the target and `e` share MC_AUTH_SECRET. */
static void test_auth(mc_engine_t *e, const char *seg, uint64_t raddr, uint8_t *src,
                      uint8_t *dst) {
  mc_err_t err = {0};
  fill(src, 1 << 20, 11);
  int rc = xfer(e, seg, MC_OP_WRITE, src, raddr, 1 << 20, 20000, &err);
  memset(dst, 0, 1 << 20);
  int r2 = rc ? rc : xfer(e, seg, MC_OP_READ, dst, raddr, 1 << 20, 20000, &err);
  CHECK(rc == 0 && r2 == 0 && !memcmp(src, dst, 1 << 20),
        "RDMA WRITE + READ 1 MiB with the shared secret byte-exact%s%s", rc || r2 ? ": " : "",
        rc || r2 ? err.msg : "");
  static const char *const others[] = {"a-different-secret-0123456789", ""};
  for (int i = 0; i < 2; i++) {
    mc_engine_t *x = make_engine_auth("rxe0", others[i]);
    err = (mc_err_t){0};
    double t0 = now_s();
    /* The engine refuses unregistered local buffers before any handshake:
     * register src with x, so the refusal tested is the target's. */
    rc = x ? mc_engine_register(x, src, 4096, "cpu", &err) : -1;
    if (rc == 0)
      rc = xfer(x, seg, MC_OP_WRITE, src, raddr, 4096, 20000, &err);
    CHECK(rc == MC_EAUTH && strstr(err.msg, i ? "requires peer authentication"
                                                : "failed authentication"),
          "%s secret: refused with MC_EAUTH in %.2f s: %s", i ? "no" : "a wrong", now_s() - t0,
          err.msg);
    mc_engine_destroy(x);
  }
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "all";
  if (argc > 2 && atoi(argv[2]) > 0)
    bench_mb = atoi(argv[2]);
  for (int i = 2; i < argc; i++) /* NAME=VALUE: engine settings for this run */
    if (strchr(argv[i], '='))
      putenv(argv[i]);
  setenv("MC_SAME_HOST_CPU", "0", 0); /* both engines share this guest: keep the bytes on RDMA */
  setenv("MC_GID_INDEX", "0", 0); /* fe80 GIDs: rxe0<->rxe1 in one guest (see README) */
  setenv("MC_LOG_LEVEL", "info", 0); /* connects, GID choice, freed QPs */
  setvbuf(stdout, NULL, _IOLBF, 0);
  signal(SIGPIPE, SIG_IGN);
  int to_t[2], from_t[2];
  if (pipe(to_t) || pipe(from_t))
    return 2;
  pid_t pid = fork();
  if (pid == 0) {
    close(to_t[1]);
    close(from_t[0]);
    _exit(target_main(to_t[0], from_t[1]));
  }
  close(to_t[0]);
  close(from_t[1]);
  char line[512] = "";
  ssize_t n = read(from_t[0], line, sizeof line - 1);
  char seg[320];
  unsigned long long raddr;
  if (n <= 0 || sscanf(line, "%319s %llu", seg, &raddr) != 2) {
    printf("FAIL the target did not start\n");
    return 1;
  }
  printf("target segment %s, region 0x%llx (%llu MiB)\n", seg, raddr, TBUF >> 20);
  mc_engine_t *e = make_engine("rxe0");
  if (!e)
    return 1;
  uint8_t *src = aligned_alloc(4096, LBUF), *dst = aligned_alloc(4096, LBUF);
  mc_err_t err;
  int rc = mc_engine_register(e, src, LBUF, "cpu", &err);
  if (rc == 0)
    rc = mc_engine_register(e, dst, LBUF, "cpu", &err);
  CHECK(rc == 0, "initiator registered its buffers%s%s", rc ? ": " : "", rc ? err.msg : "");
  double t0 = now_s();
  if (!strcmp(mode, "bench")) {
    bench(e, seg, raddr, src);
    cmd(to_t[1], from_t[0], 'q');
  } else if (!strcmp(mode, "auth")) {
    test_auth(e, seg, raddr, src, dst);
    cmd(to_t[1], from_t[0], 'q');
  } else {
    test_sizes(e, seg, raddr, src, dst);
    test_batch(e, seg, raddr, src, dst);
    /* An unregistered local buffer is refused before anything is posted
     * (local buffers must lie in memory registered with the engine). */
    uint8_t *tmp = malloc(100000);
    fill(tmp, 100000, 9);
    rc = xfer(e, seg, MC_OP_WRITE, tmp, raddr + 12345, 100000, 20000, &err);
    CHECK(rc == MC_EINVAL && strstr(err.msg, "not inside any memory region registered with"),
          "WRITE from an unregistered local buffer is refused naming it (%s)", err.msg);
    free(tmp);
    /* A second initiator on both NICs (QPs alternate rxe0 / rxe1, slices
     * striped over them; lkeys from MRs on each NIC) connects, moves 4 MiB
     * both ways and goes away: the target frees the QPs it had accepted
     * from it (logged by the target). */
    {
      mc_engine_t *e2 = make_engine("rxe0,rxe1");
      uint8_t *s2 = aligned_alloc(4096, 8 << 20);
      fill(s2, 4 << 20, 77);
      memset(s2 + (4 << 20), 0, 4 << 20);
      rc = e2 ? mc_engine_register(e2, s2, 8 << 20, "cpu", &err) : -1;
      if (rc == 0)
        rc = xfer(e2, seg, MC_OP_WRITE, s2, raddr + 8192, 4 << 20, 30000, &err);
      if (rc == 0)
        rc = xfer(e2, seg, MC_OP_READ, s2 + (4 << 20), raddr + 8192, 4 << 20, 30000, &err);
      CHECK(rc == 0 && !memcmp(s2, s2 + (4 << 20), 4 << 20),
            "an initiator on two NICs (rxe0,rxe1) WRITEs and READs 4 MiB striped over both, "
            "byte-exact%s%s", rc ? ": " : "", rc ? err.msg : "");
      mc_engine_destroy(e2);
      free(s2);
      usleep(500000);
    }
    test_faults(e, seg, raddr, src, to_t[1], from_t[0], pid);
  }
  double t1 = now_s();
  mc_engine_destroy(e);
  printf("engine destroyed in %.2f s; tests took %.1f s\n", now_s() - t1, t1 - t0);
  int st = 0;
  waitpid(pid, &st, 0);
  printf("%d passed, %d failed\n", passes, failures);
  free(src);
  free(dst);
  return failures ? 1 : 0;
}
