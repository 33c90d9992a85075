/* The same-host CPU transport (csrc/transport/cma): the hello parser, the
 * target-owned region table (pins vs unregister), and real copies between
 * two processes through the transport's ops table (WRITE, READ, ranges
 * outside the target's regions, a target that died, a pid that is not the
 * engine it claims to be), and the copy splitter (cma_copy.c: byte ranges
 * cut inside iovecs across copy threads, checked byte for byte). */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "testlib.h"
#include "transport/cma/cma.h"
#include "transport/cma/cma_copy.h"
#include "transport/cma/cma_hello.h"
#include "transport/cma/cma_table.h"
#include "util/rpc_conn.h"

static void hello_roundtrip(void) {
  mc_cma_hello_t h, g;
  mc_cma_hello_self(&h);
  h.fd = 7;
  h.addr = 0x7f0012345000ull;
  h.token = 0xdeadbeefcafef00dull;
  char buf[512];
  size_t n = mc_cma_hello_encode(&h, buf, sizeof buf);
  mc_err_t err;
  CHECK_EQ_INT(mc_cma_hello_parse(buf, n, &g, &err), 0);
  CHECK(!strcmp(g.boot, h.boot));
  CHECK_EQ_INT(g.pid, h.pid);
  CHECK_EQ_INT(g.fd, 7);
  CHECK(g.addr == h.addr && g.token == h.token && g.pidns == h.pidns && g.uid == h.uid);
  CHECK_EQ_INT(g.has_sock, 0); /* an older target's hello: no sock */
  h.has_sock = 1;
  h.sock = 17;
  n = mc_cma_hello_encode(&h, buf, sizeof buf);
  CHECK_EQ_INT(mc_cma_hello_parse(buf, n, &g, &err), 0);
  CHECK(g.has_sock == 1 && g.sock == 17);
  CHECK_EQ_INT(mc_cma_hello_parse("cma1 boot=b pidns=1 userns=1 netns=1 uid=0 pid=2 fd=3 addr=4 "
                                  "token=5 sock=x", 75, &g, &err), MC_EPROTO);
  CHECK_CONTAINS(err.msg, "sock");
  CHECK_EQ_INT(mc_cma_hello_parse("off tired", 9, &g, &err), 0);
  CHECK(g.off && !strcmp(g.why, "tired"));
}

static void hello_rejects(void) {
  static const char *bad[] = {
      "",
      "cma2 boot=x",
      "cma1 boot=x pidns=1 userns=1 netns=1 uid=0 pid=5 fd=3 addr=10",   /* token missing */
      "cma1 boot=x pidns=1 userns=1 netns=1 uid=0 pid=5 fd=3 addr=zz token=1",
      "cma1 boot=x pidns=1 userns=1 netns=1 uid=0 pid=5 pid=5 fd=3 addr=1 token=1",
      "cma1 boot=x pidns=1 userns=1 netns=1 uid=0 pid=0 fd=3 addr=1 token=1",
      "cma1 boot=x pidns=1 userns=1 netns=1 uid=0 pid=99999999999 fd=3 addr=1 token=1",
      "cma1 boot=x pidns=1 userns=1 netns=1 uid=0 pid=5 fd=3 addr=11111111111111111 token=1",
      "cma1 boot=x pidns=1 userns=1 netns=1 uid=0 pid=5 fd=3 addr=1 token=1 extra=2",
      "cma1 boot= pidns=1 userns=1 netns=1 uid=0 pid=5 fd=3 addr=1 token=1",
      "cma1 boot=x pidns=1 userns=1 netns=1 uid=0 pid=5 fd=3 addr=1 token",
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    mc_cma_hello_t g;
    mc_err_t err = {0};
    int rc = mc_cma_hello_parse(bad[i], strlen(bad[i]), &g, &err);
    if (rc != MC_EPROTO)
      fprintf(stderr, "  accepted: %s\n", bad[i]);
    CHECK_EQ_INT(rc, MC_EPROTO);
    CHECK_CONTAINS(err.msg, "same-host hello");
  }
}

/* The table seen by this very process (process_vm_* on ourselves works). */
static void table_pins_block_remove(void) {
  mc_cma_table_t *t;
  mc_err_t err;
  CHECK_EQ_INT(mc_cma_table_create(&t, &err), 0);
  static char region[8192];
  CHECK_EQ_INT(mc_cma_table_add(t, (uint64_t)(uintptr_t)region, sizeof region, 0, &err), 0);
  mc_cma_view_t v;
  CHECK_EQ_INT(mc_cma_view_open(&v, getpid(), mc_cma_table_fd(t), mc_cma_table_token(t),
                                (uint64_t)(uintptr_t)mc_cma_table_addr(t), &err),
               0);
  const mc_cma_ent_t *e = mc_cma_view_find(&v, (uint64_t)(uintptr_t)region + 100, 200);
  CHECK(e != NULL);
  CHECK(mc_cma_view_find(&v, (uint64_t)(uintptr_t)region + 8000, 200) == NULL);
  CHECK_EQ_INT(mc_cma_view_pin(&v, e), 0);
  uint32_t idx = e->idx;
  CHECK_EQ_INT(mc_cma_table_remove(t, (uint64_t)(uintptr_t)region, 50, &err), MC_EBUSY);
  CHECK_CONTAINS(err.msg, "still being copied by process");
  /* Dead: a new pin is refused, the cached entry is stale. */
  mc_cma_view_refresh(&v, 0);
  CHECK(mc_cma_view_find(&v, (uint64_t)(uintptr_t)region, 1) == NULL);
  mc_cma_view_unpin(&v, idx);
  CHECK_EQ_INT(mc_cma_table_remove(t, (uint64_t)(uintptr_t)region, 50, &err), 0);
  CHECK_EQ_INT(mc_cma_table_remove(t, (uint64_t)(uintptr_t)region, 50, &err), MC_ENOTFOUND);
  /* A wrong token is refused (a pid reused by another engine). */
  mc_cma_view_t w;
  CHECK(mc_cma_view_open(&w, getpid(), mc_cma_table_fd(t), mc_cma_table_token(t) ^ 2,
                         (uint64_t)(uintptr_t)mc_cma_table_addr(t), &err) < 0);
  CHECK_CONTAINS(err.msg, "pid reused");
  /* Closing the table: the view says so. */
  mc_cma_table_destroy(t);
  CHECK(mc_cma_view_alive(&v, "seg", &err) < 0);
  CHECK_CONTAINS(err.msg, "closed its engine");
  mc_cma_view_close(&v);
}

/* A copier pins, copies, unpins in a loop while the main thread removes the
 * region: after remove() returns, not one more byte lands. */
typedef struct race {
  mc_cma_view_t *v;
  char *dst;
  atomic_int stop;
  atomic_long copies;
} race_t;

static void *copier(void *arg) {
  race_t *r = arg;
  char src[4096];
  memset(src, 'x', sizeof src);
  while (!atomic_load(&r->stop)) {
    mc_cma_view_refresh(r->v, 0);
    const mc_cma_ent_t *e = mc_cma_view_find(r->v, (uint64_t)(uintptr_t)r->dst, sizeof src);
    if (!e || mc_cma_view_pin(r->v, e) < 0)
      continue;
    struct iovec l = {src, sizeof src}, rr = {r->dst, sizeof src};
    process_vm_writev(getpid(), &l, 1, &rr, 1, 0);
    mc_cma_view_unpin(r->v, e->idx);
    atomic_fetch_add(&r->copies, 1);
  }
  return NULL;
}

static void table_remove_races_copies(void) {
  mc_cma_table_t *t;
  mc_err_t err;
  CHECK_EQ_INT(mc_cma_table_create(&t, &err), 0);
  char *dst = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECK(dst != MAP_FAILED);
  mc_cma_view_t v;
  CHECK_EQ_INT(mc_cma_view_open(&v, getpid(), mc_cma_table_fd(t), mc_cma_table_token(t),
                                (uint64_t)(uintptr_t)mc_cma_table_addr(t), &err),
               0);
  for (int round = 0; round < 200; round++) {
    CHECK_EQ_INT(mc_cma_table_add(t, (uint64_t)(uintptr_t)dst, 4096, 0, &err), 0);
    race_t r = {.v = &v, .dst = dst};
    pthread_t th;
    pthread_create(&th, NULL, copier, &r);
    while (atomic_load(&r.copies) < 3)
      sched_yield();
    CHECK_EQ_INT(mc_cma_table_remove(t, (uint64_t)(uintptr_t)dst, 5000, &err), 0);
    memset(dst, 0, 4096);
    for (int k = 0; k < 50; k++)
      sched_yield();
    atomic_store(&r.stop, 1);
    pthread_join(th, NULL);
    for (int k = 0; k < 4096; k++)
      if (dst[k]) {
        fprintf(stderr, "  round %d: byte %d written after remove\n", round, k);
        CHECK(0);
      }
  }
  mc_cma_view_close(&v);
  mc_cma_table_destroy(t);
  munmap(dst, 4096);
}

/* ---- two processes through the ops table ---- */

typedef struct child {
  pid_t pid;
  char hello[512];
  char *shared; /* the child's registered region (MAP_SHARED: we can check it) */
  size_t len;
  char *gpu; /* 64 KiB the child registers with location "cuda:0" (a claim
                this transport only records: no GPU needed) */
  int cmd; /* write end: closing it ends the child */
  int port; /* the "connection" the hello was asked on: 127.0.0.1:port */
  int conn; /* our end of it */
} child_t;

/* A loopback TCP connection: *ours connected to *theirs (accepted on a
 * listener at 127.0.0.1:*port, closed again). */
static int loop_conn(int *ours, int *theirs, int *port) {
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t al = sizeof a;
  int l = socket(AF_INET, SOCK_STREAM, 0);
  if (l < 0 || bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 1) ||
      getsockname(l, (struct sockaddr *)&a, &al))
    return -1;
  *ours = socket(AF_INET, SOCK_STREAM, 0);
  if (*ours < 0 || connect(*ours, (struct sockaddr *)&a, sizeof a))
    return -1;
  *theirs = accept(l, NULL, NULL);
  close(l);
  *port = ntohs(a.sin_port);
  return *theirs < 0 ? -1 : 0;
}

static int fake_rpc(void *ctx, const char *segment, const char *req, size_t len,
                    int64_t timeout_ms, char **reply, mc_err_t *err) {
  (void)segment, (void)req, (void)len, (void)timeout_ms, (void)err;
  *reply = strdup(((child_t *)ctx)->hello);
  return 0;
}

/* The target: a started transport with `shared` registered; its hello goes
 * up a pipe (in the engine it is the answer to the mc.shm.hello RPC). */
static int start_child(child_t *c, size_t len) {
  c->len = len;
  c->shared = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  c->gpu = mmap(NULL, 65536, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  int up[2], down[2], theirs;
  if (c->shared == MAP_FAILED || c->gpu == MAP_FAILED || pipe(up) || pipe(down) ||
      loop_conn(&c->conn, &theirs, &c->port))
    return -1;
  c->pid = fork();
  if (c->pid == 0) {
    close(up[0]);
    close(down[1]);
    close(c->conn);
    mc_rpc_conn_set(theirs); /* as the TCP transport does around an RPC */
    mc_transport_env_t env = {.local_name = "target"};
    void *impl;
    mc_err_t err;
    if (mc_cma_transport_ops.start(&env, &impl, &err) < 0 ||
        mc_cma_transport_ops.mem_register(impl, c->shared, len, "cpu", &err) < 0 ||
        mc_cma_transport_ops.mem_register(impl, c->gpu, 65536, "cuda:0", &err) < 0)
      _exit(2);
    char *reply = NULL;
    mc_cma_transport_ops.serve_rpc(impl, "x", MC_CMA_RPC_HELLO, strlen(MC_CMA_RPC_HELLO), &reply,
                                   &err);
    if (write(up[1], reply, strlen(reply) + 1) < 0)
      _exit(3);
    free(reply);
    char b;
    while (read(down[0], &b, 1) == 1) {
      if (b != 'u')
        continue;
      /* unregister (waiting 200 ms at most), then say how it went:
       * 'u' done, 'B' refused as busy (the message names the pinner) */
      int rc = mc_cma_transport_ops.mem_unregister(impl, c->shared, 200, &err);
      char ans = rc == 0 ? 'u' : rc == MC_EBUSY && strstr(err.msg, "still being copied") ? 'B'
                                                                                        : 'X';
      if (write(up[1], &ans, 1) < 0)
        _exit(3);
    }
    mc_cma_transport_ops.stop(impl);
    _exit(0);
  }
  close(up[1]);
  close(down[0]);
  close(theirs);
  c->cmd = down[1];
  ssize_t n = read(up[0], c->hello, sizeof c->hello - 1);
  c->hello[n > 0 ? n : 0] = '\0';
  c->cmd = down[1];
  c->shared[0] = 0;
  /* keep up[0] for 'u' acks */
  c->len = len;
  return up[0];
}

typedef struct res {
  int code;
  char msg[512];
  int failed_entries;
  char entry_msg[512];
  int done;
} res_t;

static void on_done(mc_xfer_op_t *op, int code, const char *msg) {
  res_t *r = op->arg;
  r->code = code;
  snprintf(r->msg, sizeof r->msg, "%s", msg ? msg : "");
  r->done++;
}

static void on_entry(mc_xfer_op_t *op, uint32_t idx, int code, const char *msg) {
  (void)idx, (void)code;
  res_t *r = op->arg;
  r->failed_entries++;
  snprintf(r->entry_msg, sizeof r->entry_msg, "%s", msg);
}

static int one_op(void *impl, const mc_peer_t *peer, int type, void *local, uint64_t remote,
                  uint64_t len, res_t *r) {
  memset(r, 0, sizeof *r);
  mc_xfer_op_t *op = mc_xfer_op_new(type, 1, 0);
  if (!op)
    return -1;
  op->ent[0] = (mc_xfer_ent_t){local, remote, len, 0, -1};
  op->nent = 1;
  op->done = on_done;
  op->entry_failed = on_entry;
  op->arg = r;
  mc_cma_transport_ops.submit(impl, peer, &op, 1);
  return r->done == 1 ? 0 : -1;
}

static void two_processes(void) {
  child_t c = {0};
  int ack = start_child(&c, 1 << 20);
  CHECK(ack >= 0);
  mc_transport_env_t env = {.local_name = "initiator", .ctx = &c, .rpc = fake_rpc};
  void *impl;
  mc_err_t err;
  CHECK_EQ_INT(mc_cma_transport_ops.start(&env, &impl, &err), 0);
  mc_peer_t peer = {.segment = "target:1", .host = "127.0.0.1", .port = 1, .same_host = 1,
                    .pid = c.pid};
  char why[256] = "";
  /* The hello was asked on a connection to 127.0.0.1:c.port, not :1 (a
   * relayed hello): refused, nothing opened. */
  CHECK_EQ_INT(mc_cma_transport_ops.reaches(impl, &peer, MC_MEM_HOST, why, sizeof why), 0);
  CHECK_CONTAINS(why, "does not hold the other end of this engine's connection");
  mc_cma_stats_t cs;
  mc_cma_get_stats(impl, &cs);
  CHECK_EQ_INT(cs.refused_unbound, 1);
  peer.port = c.port;
  CHECK_EQ_INT(mc_cma_transport_ops.reaches(impl, &peer, MC_MEM_HOST, why, sizeof why), 1);
  static char buf[1 << 20];
  for (size_t i = 0; i < sizeof buf; i++)
    buf[i] = (char)(i * 7 + 1);
  res_t r;
  uint64_t base = (uint64_t)(uintptr_t)c.shared;
  CHECK_EQ_INT(one_op(impl, &peer, MC_XFER_WRITE, buf, base, sizeof buf, &r), 0);
  CHECK_EQ_INT(r.code, 0);
  CHECK(memcmp(c.shared, buf, sizeof buf) == 0);
  static char back[4096];
  CHECK_EQ_INT(one_op(impl, &peer, MC_XFER_READ, back, base + 4096, 4096, &r), 0);
  CHECK_EQ_INT(r.code, 0);
  CHECK(memcmp(back, buf + 4096, 4096) == 0);
  /* Outside the target's regions: the TCP path's words, nothing written. */
  CHECK_EQ_INT(one_op(impl, &peer, MC_XFER_WRITE, buf, base + (1 << 20) - 100, 200, &r), 0);
  CHECK_EQ_INT(r.failed_entries, 1);
  CHECK_CONTAINS(r.entry_msg, "is not inside any memory region registered by segment target:1");
  CHECK_EQ_INT(one_op(impl, &peer, MC_XFER_READ, back, 0x1000, 16, &r), 0);
  CHECK_EQ_INT(r.failed_entries, 1);
  mc_cma_stats_t st;
  mc_cma_get_stats(impl, &st);
  CHECK_EQ_INT(st.bytes_written, 1 << 20);
  CHECK_EQ_INT(st.bytes_read, 4096);
  /* One op of entries adjacent on both sides (merged into one pair), adjacent
   * on one side only (not merged), and one outside the regions (refused,
   * the others still land): every entry reads exactly its own bytes. */
  {
    for (size_t i = 0; i < sizeof buf; i++) /* a pattern that differs page by page */
      buf[i] = (char)(i * 7 + 1 + (i >> 12) * 13);
    CHECK_EQ_INT(one_op(impl, &peer, MC_XFER_WRITE, buf, base, sizeof buf, &r), 0);
    CHECK_EQ_INT(r.code, 0);
    static char rb[6 * 4096];
    memset(rb, 0, sizeof rb);
    mc_xfer_op_t *op = mc_xfer_op_new(MC_XFER_READ, 6, 0);
    CHECK(op != NULL);
    /* local offsets, remote offsets (pages) */
    static const int lo_pg[6] = {0, 1, 2, 3, 5, 4}, re_pg[6] = {10, 11, 12, 20, 21, -1};
    for (int k = 0; k < 6; k++)
      op->ent[k] = (mc_xfer_ent_t){rb + lo_pg[k] * 4096,
                                   re_pg[k] < 0 ? 0x1000 : base + (uint64_t)re_pg[k] * 4096,
                                   4096, (uint32_t)k, -1};
    op->nent = 6;
    op->done = on_done;
    op->entry_failed = on_entry;
    op->arg = &r;
    memset(&r, 0, sizeof r);
    mc_cma_transport_ops.submit(impl, &peer, &op, 1);
    CHECK_EQ_INT(r.done, 1);
    CHECK_EQ_INT(r.code, 0);
    CHECK_EQ_INT(r.failed_entries, 1);
    for (int k = 0; k < 5; k++)
      CHECK(memcmp(rb + lo_pg[k] * 4096, buf + re_pg[k] * 4096, 4096) == 0);
    static const char zero[4096];
    CHECK(memcmp(rb + 4 * 4096, zero, 4096) == 0); /* the refused entry's */
    mc_cma_get_stats(impl, &st);
    CHECK_EQ_INT(st.bytes_read, 4096 + 5 * 4096);
  }
  /* The target's GPU region: this path declines it (the engine sends it
   * over TCP, which stages it); host memory and unknown ranges it takes. */
  uint64_t gbase = (uint64_t)(uintptr_t)c.gpu;
  uint64_t lo = 0, hi = 0;
  CHECK_EQ_INT(mc_cma_transport_ops.takes(impl, &peer, gbase + 4096, 4096, &lo, &hi), 0);
  CHECK(lo == gbase && hi == gbase + 65536); /* the answer holds for the region */
  CHECK_EQ_INT(mc_cma_transport_ops.takes(impl, &peer, base, 4096, &lo, &hi), 1);
  CHECK(lo == base && hi == base + (1 << 20));
  lo = hi = 0x1000;
  CHECK_EQ_INT(mc_cma_transport_ops.takes(impl, &peer, 0x1000, 16, &lo, &hi), 1);
  CHECK(lo == 0x1000 && hi == 0x1000); /* no region: no range to remember */
  /* A copy in flight (a pin held past the wait) fails the unregister
   * with MC_EBUSY; once it finished, the unregister succeeds. */
  mc_cma_view_t v = {.pidfd = -1};
  mc_cma_hello_t h;
  CHECK_EQ_INT(mc_cma_hello_parse(c.hello, strlen(c.hello), &h, &err), 0);
  CHECK_EQ_INT(mc_cma_view_open(&v, (pid_t)h.pid, (int)h.fd, h.token, h.addr, &err), 0);
  mc_cma_view_refresh(&v, 1);
  const mc_cma_ent_t *ce = mc_cma_view_find(&v, base, 64);
  CHECK(ce != NULL);
  CHECK_EQ_INT(mc_cma_view_pin(&v, ce), 0);
  char b = 'u';
  CHECK_EQ_INT(write(c.cmd, &b, 1), 1);
  CHECK_EQ_INT(read(ack, &b, 1), 1);
  CHECK_EQ_INT(b, 'B');
  mc_cma_view_unpin(&v, ce->idx);
  mc_cma_view_close(&v);
  /* The target unregisters: the next copy is refused like any other range. */
  b = 'u';
  CHECK_EQ_INT(write(c.cmd, &b, 1), 1);
  CHECK_EQ_INT(read(ack, &b, 1), 1);
  CHECK_EQ_INT(b, 'u');
  CHECK_EQ_INT(one_op(impl, &peer, MC_XFER_WRITE, buf, base, 64, &r), 0);
  CHECK_EQ_INT(r.failed_entries, 1);
  /* The target dies: a clear error, no crash, no hang. */
  kill(c.pid, SIGKILL);
  waitpid(c.pid, NULL, 0);
  CHECK_EQ_INT(one_op(impl, &peer, MC_XFER_WRITE, buf, base, 64, &r), 0);
  CHECK_EQ_INT(r.code, MC_EPEERCLOSED);
  CHECK_CONTAINS(r.msg, "exited");
  /* First contact with a dead pid: reaches() says why. */
  CHECK_EQ_INT(mc_cma_transport_ops.reaches(impl, &peer, MC_MEM_HOST, why, sizeof why), 0);
  CHECK(why[0] != '\0');
  mc_cma_transport_ops.stop(impl);
  close(c.cmd);
  close(ack);
  munmap(c.shared, c.len);
  munmap(c.gpu, 65536);
}

/* A hello naming a process that is not that engine (pid reused). */
static void pid_not_the_engine(void) {
  pid_t p = fork();
  if (p == 0) {
    pause();
    _exit(0);
  }
  child_t c = {0};
  mc_cma_hello_t h;
  mc_cma_hello_self(&h);
  h.pid = (uint64_t)p;
  h.fd = 0;
  h.addr = 0x1000;
  h.token = 42;
  h.has_sock = 1;
  mc_cma_hello_encode(&h, c.hello, sizeof c.hello);
  mc_transport_env_t env = {.local_name = "initiator", .ctx = &c, .rpc = fake_rpc};
  void *impl;
  mc_err_t err;
  CHECK_EQ_INT(mc_cma_transport_ops.start(&env, &impl, &err), 0);
  mc_peer_t peer = {.segment = "t:2", .host = "h", .port = 2, .same_host = 1, .pid = p};
  char why[256] = "";
  CHECK_EQ_INT(mc_cma_transport_ops.reaches(impl, &peer, MC_MEM_HOST, why, sizeof why), 0);
  CHECK_CONTAINS(why, "reused");
  /* Another pid namespace / host: no attempt at all. */
  h.pidns ^= 1;
  mc_cma_hello_encode(&h, c.hello, sizeof c.hello);
  CHECK_EQ_INT(mc_cma_transport_ops.reaches(impl, &peer, MC_MEM_HOST, why, sizeof why), 0);
  CHECK_CONTAINS(why, "pid namespace");
  snprintf(c.hello, sizeof c.hello, "off switched off by its owner");
  CHECK_EQ_INT(mc_cma_transport_ops.reaches(impl, &peer, MC_MEM_HOST, why, sizeof why), 0);
  CHECK_CONTAINS(why, "switched the same-host CPU path off");
  peer.same_host = -1;
  CHECK_EQ_INT(mc_cma_transport_ops.reaches(impl, &peer, MC_MEM_HOST, why, sizeof why), 0);
  CHECK_CONTAINS(why, "another host");
  mc_cma_transport_ops.stop(impl);
  kill(p, SIGKILL);
  waitpid(p, NULL, 0);
}

static void switched_off(void) {
  setenv("MC_SAME_HOST_CPU", "0", 1);
  mc_transport_env_t env = {.local_name = "x"};
  void *impl;
  mc_err_t err;
  CHECK_EQ_INT(mc_cma_transport_ops.start(&env, &impl, &err), 0);
  mc_peer_t peer = {.segment = "t:2", .host = "h", .port = 2, .same_host = 1};
  char why[256] = "";
  CHECK_EQ_INT(mc_cma_transport_ops.reaches(impl, &peer, MC_MEM_HOST, why, sizeof why), 0);
  CHECK_CONTAINS(why, "switched off here");
  char *reply = NULL;
  CHECK_EQ_INT(mc_cma_transport_ops.serve_rpc(impl, "p", MC_CMA_RPC_HELLO,
                                              strlen(MC_CMA_RPC_HELLO), &reply, &err),
               0);
  CHECK(!strncmp(reply, "off ", 4));
  free(reply);
  mc_cma_transport_ops.stop(impl);
  unsetenv("MC_SAME_HOST_CPU");
  /* Off by the engine's configuration (mooncake.json "same_host_cpu": false). */
  env.off = 1;
  CHECK_EQ_INT(mc_cma_transport_ops.start(&env, &impl, &err), 0);
  CHECK_EQ_INT(mc_cma_transport_ops.reaches(impl, &peer, MC_MEM_HOST, why, sizeof why), 0);
  CHECK_CONTAINS(why, "\"same_host_cpu\": false");
  CHECK_EQ_INT(mc_cma_transport_ops.serve_rpc(impl, "p", MC_CMA_RPC_HELLO,
                                              strlen(MC_CMA_RPC_HELLO), &reply, &err),
               0);
  CHECK(!strncmp(reply, "off ", 4));
  CHECK_CONTAINS(reply, "mooncake.json");
  free(reply);
  mc_cma_transport_ops.stop(impl);
}

/* A child that only waits: the target of a test's copies (a MAP_SHARED
 * mapping made before the fork is the same pages in both).  Closing
 * *release lets it exit. */
static pid_t fork_target(int *release) {
  int pipefd[2];
  if (pipe(pipefd) != 0)
    return -1;
  pid_t kid = fork();
  if (kid == 0) {
    char c;
    close(pipefd[1]);
    (void)!read(pipefd[0], &c, 1);
    _exit(0);
  }
  close(pipefd[0]);
  *release = pipefd[1];
  return kid;
}

/* The splitter: a child process holds a patterned buffer; lists of pairs
 * of many shapes (one huge pair, many small ones, zero-length ones, runs
 * that cut pairs at slice boundaries) are read and written back with 1..4
 * threads; every byte lands where its pair says.  A pair outside the
 * child's mappings fails with EFAULT, whatever thread copies it. */
static void copy_splits(void) {
  const size_t N = 24u << 20;
  uint8_t *shared = mmap(NULL, N, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  uint8_t *mine = mmap(NULL, N, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHECK(shared != MAP_FAILED && mine != MAP_FAILED);
  for (size_t i = 0; i < N; i++)
    shared[i] = (uint8_t)(i * 131 + (i >> 12));
  int release;
  pid_t kid = fork_target(&release); /* its copy of `shared` is the same pages */
  CHECK(kid > 0);
  static const char *threads[] = {"1", "2", "3", "4"};
  for (size_t t = 0; t < 4; t++) {
    setenv("MC_CMA_THREADS", threads[t], 1);
    mc_cma_copier_t *cp = mc_cma_copier_new();
    CHECK(cp && mc_cma_copier_threads(cp) == (int)t + 1);
    /* shapes: pair sizes cycling through these (bytes), 0 = an empty pair */
    static const size_t shape_a[] = {N / 2};
    static const size_t shape_b[] = {4096};
    static const size_t shape_c[] = {65536, 0, 4096, 300000, 1, 777777};
    const size_t *shapes[] = {shape_a, shape_b, shape_c};
    size_t nshape[] = {1, 1, 6};
    for (int sh = 0; sh < 3; sh++) {
      struct iovec *l = calloc(8192, sizeof *l), *r = calloc(8192, sizeof *r);
      CHECK(l && r);
      size_t off = 0;
      int n = 0;
      uint64_t bytes = 0;
      /* Remote ranges in reverse order of the local ones: a slip would show. */
      while (n < 4096) {
        size_t len = shapes[sh][n % nshape[sh]];
        if (off + len > N / 2)
          break;
        l[n] = (struct iovec){mine + off, len};
        r[n] = (struct iovec){shared + N - off - len, len};
        off += len;
        bytes += len;
        n++;
      }
      memset(mine, 0, N);
      struct iovec *l2 = calloc(8192, sizeof *l2), *r2 = calloc(8192, sizeof *r2);
      memcpy(l2, l, n * sizeof *l);
      memcpy(r2, r, n * sizeof *r);
      CHECK_EQ_INT(mc_cma_copy(cp, kid, 0, l2, r2, n, bytes), 0);
      for (int i = 0; i < n; i++)
        if (memcmp(l[i].iov_base, r[i].iov_base, l[i].iov_len) != 0) {
          fprintf(stderr, "  threads %zu shape %d pair %d differs\n", t + 1, sh, i);
          CHECK(0);
        }
      CHECK(mine[off] == 0); /* nothing past the last pair */
      /* WRITE the bytes back to the child's other half, read them again. */
      for (int i = 0; i < n; i++)
        r2[i] = (struct iovec){(uint8_t *)r[i].iov_base - N / 2, r[i].iov_len};
      memcpy(l2, l, n * sizeof *l);
      struct iovec *rw = calloc(8192, sizeof *rw);
      memcpy(rw, r2, n * sizeof *r2);
      CHECK_EQ_INT(mc_cma_copy(cp, kid, 1, l2, rw, n, bytes), 0);
      uint8_t *back = malloc(bytes ? bytes : 1);
      struct iovec lb = {back, bytes}, rb;
      size_t pos = 0;
      for (int i = 0; i < n; i++) {
        rb = r2[i];
        struct iovec one = {back + pos, rb.iov_len};
        CHECK(rb.iov_len == 0 || process_vm_readv(kid, &one, 1, &rb, 1, 0) == (ssize_t)rb.iov_len);
        CHECK(memcmp(back + pos, l[i].iov_base, rb.iov_len) == 0);
        pos += rb.iov_len;
      }
      (void)lb;
      free(back);
      free(rw);
      free(l2);
      free(r2);
      free(l);
      free(r);
    }
    /* A bad remote range in the middle of a large list: EFAULT. */
    struct iovec bl[64], br[64];
    for (int i = 0; i < 64; i++) {
      bl[i] = (struct iovec){mine + (size_t)i * 65536, 65536};
      br[i] = (struct iovec){shared + (size_t)i * 65536, 65536};
    }
    br[40].iov_base = (void *)(uintptr_t)0x10000; /* not mapped in the child */
    CHECK_EQ_INT(mc_cma_copy(cp, kid, 0, bl, br, 64, 64u * 65536), EFAULT);
    mc_cma_copier_free(cp);
  }
  unsetenv("MC_CMA_THREADS");
  close(release);
  int st;
  waitpid(kid, &st, 0);
  munmap(shared, N);
  munmap(mine, N);
}

/* Several threads copy through one copier at once (more slices than idle
 * helpers: a slice waits for a helper busy with another caller's copy, and
 * the helpers' idle stack changes under them); every caller gets its own
 * bytes, and freeing the copier afterwards joins every helper. */
typedef struct co_caller {
  mc_cma_copier_t *cp;
  pid_t kid;
  const uint8_t *src; /* the child's view: same pages as ours */
  uint8_t *dst;
  size_t len;
  int bad;
} co_caller_t;

static void *co_main(void *arg) {
  co_caller_t *c = arg;
  for (int round = 0; round < 40 && !c->bad; round++) {
    memset(c->dst, 0, c->len);
    /* 4 KiB pairs, remote order shifted by the round */
    size_t n = c->len / 4096;
    struct iovec *l = calloc(n, sizeof *l), *r = calloc(n, sizeof *r);
    if (!l || !r) {
      c->bad = 1;
      break;
    }
    for (size_t i = 0; i < n; i++) {
      size_t j = (i + (size_t)round) % n;
      l[i] = (struct iovec){c->dst + i * 4096, 4096};
      r[i] = (struct iovec){(void *)(c->src + j * 4096), 4096};
    }
    if (mc_cma_copy(c->cp, c->kid, 0, l, r, (int)n, c->len) != 0)
      c->bad = 1;
    for (size_t i = 0; i < n && !c->bad; i++)
      if (memcmp(c->dst + i * 4096, c->src + ((i + (size_t)round) % n) * 4096, 4096) != 0)
        c->bad = 1;
    free(l);
    free(r);
  }
  return NULL;
}

static void copy_concurrent_callers(void) {
  const size_t per = 1u << 20, ncall = 4;
  uint8_t *shared = mmap(NULL, per * ncall, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                         -1, 0);
  uint8_t *mine = mmap(NULL, per * ncall, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                       -1, 0);
  CHECK(shared != MAP_FAILED && mine != MAP_FAILED);
  for (size_t i = 0; i < per * ncall; i++)
    shared[i] = (uint8_t)(i * 7 + (i >> 12) * 13);
  int release;
  pid_t kid = fork_target(&release);
  CHECK(kid > 0);
  setenv("MC_CMA_THREADS", "8", 1);
  mc_cma_copier_t *cp = mc_cma_copier_new();
  CHECK(cp && mc_cma_copier_threads(cp) == 8);
  co_caller_t c[4];
  pthread_t th[4];
  for (size_t i = 0; i < ncall; i++) {
    c[i] = (co_caller_t){.cp = cp, .kid = kid, .src = shared + i * per, .dst = mine + i * per,
                         .len = per};
    CHECK(pthread_create(&th[i], NULL, co_main, &c[i]) == 0);
  }
  for (size_t i = 0; i < ncall; i++) {
    pthread_join(th[i], NULL);
    CHECK(!c[i].bad);
  }
  mc_cma_copier_free(cp);
  unsetenv("MC_CMA_THREADS");
  close(release);
  waitpid(kid, NULL, 0);
  munmap(shared, per * ncall);
  munmap(mine, per * ncall);
}

/* MC_CMA_THREADS's default: min(online CPUs, 8), at least 1; a copier
 * made without the variable uses it for this host's CPUs. */
static void copy_default_threads(void) {
  CHECK_EQ_INT(mc_cma_default_threads(-1), 1); /* sysconf failed */
  CHECK_EQ_INT(mc_cma_default_threads(0), 1);
  CHECK_EQ_INT(mc_cma_default_threads(1), 1);
  CHECK_EQ_INT(mc_cma_default_threads(2), 2);
  CHECK_EQ_INT(mc_cma_default_threads(3), 3);
  CHECK_EQ_INT(mc_cma_default_threads(8), 8);
  CHECK_EQ_INT(mc_cma_default_threads(192), 8);
  unsetenv("MC_CMA_THREADS");
  mc_cma_copier_t *cp = mc_cma_copier_new();
  CHECK(cp);
  CHECK_EQ_INT(mc_cma_copier_threads(cp), mc_cma_default_threads(sysconf(_SC_NPROCESSORS_ONLN)));
  mc_cma_copier_free(cp);
}

int main(void) {
  RUN(hello_roundtrip);
  RUN(hello_rejects);
  RUN(table_pins_block_remove);
  RUN(table_remove_races_copies);
  RUN(two_processes);
  RUN(pid_not_the_engine);
  RUN(switched_off);
  RUN(copy_default_threads);
  RUN(copy_splits);
  RUN(copy_concurrent_callers);
  TEST_MAIN_END();
}
