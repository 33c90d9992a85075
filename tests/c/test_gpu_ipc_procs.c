/* The same-host GPU path between two processes (the CUDA IPC branch that
 * vLLM's prefill and decode workers take): a target process registers
 * 8 MiB of device memory; this process WRITEs 128 scattered 64 KiB blocks
 * into it from 4 threads at once (32 each, one batch each: the first
 * contact's descriptor and IPC opens race), READs them back in one batch
 * into another buffer, and checks the bytes.  Under the host libcuda stand-in (make test-c loads
 * build/fakecuda/libcuda.so.1 for this test) the path must be the IPC one:
 * the peer's handle was opened here (fakecuda_ipc_opens) -- the TCP
 * pinned-staging fallback (MC_GPU_IPC=0) moves the same bytes and fails
 * that check.  On a GPU only the bytes are checked.  Skips without a GPU
 * (or the stand-in).
 * Then our mappings of a peer's memory going with it: a target killed and
 * restarted on one port, one re-registering its memory, and one exiting
 * while our copy into it is in flight (targets are this program exec'ed
 * with "target": fresh processes, as a GPU needs). */
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "engine/engine.h"
#include "engine/engine_internal.h"
#include "gpu/cuda_driver.h"
#include "gpu/gpu_ipc.h"
#include "gpu_testlib.h"
#include "testlib.h"

#define BLK (64u << 10)
#define NBLK 128u /* 8 MiB: one batch of the issue 30 row's shape */

typedef struct {
  char segment[256];
  uint64_t addr;
  int ok;
} target_t;

/* Block i of the batch goes to block perm(i) of the target: a scatter. */
static size_t perm(size_t i) { return (i * 37 + 11) % NBLK; }

/* What a target registers: NBLK blocks, or MC_TEST_PEER_MIB MiB (the GPU
 * check of test_peer_restarts: a leak then shows in cuMemGetInfo). */
static size_t target_bytes(void) {
  const char *m = getenv("MC_TEST_PEER_MIB");
  size_t n = m ? (size_t)strtoul(m, NULL, 10) << 20 : 0;
  return n > (size_t)NBLK * BLK ? n : (size_t)NBLK * BLK;
}

#define VMM_CHUNKS 4

/* n bytes of driver-mapped memory on cuda:0 (cuMem*, as vLLM 0.34's KV
 * cache): VMM_CHUNKS physical chunks exportable as POSIX fds, mapped back
 * to back; 0 when it cannot be had. */
static uint64_t vmm_alloc(size_t n) {
  mc_cu_mem_alloc_prop_t prop;
  memset(&prop, 0, sizeof prop);
  prop.type = MC_CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requested_handle_types = MC_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location = (mc_cu_mem_location_t){MC_CU_MEM_LOCATION_TYPE_DEVICE, 0};
  size_t g = 0;
  if (!api->cuMemCreate || !api->cuMemAddressReserve || !api->cuMemMap ||
      !api->cuMemGetAllocationGranularity ||
      api->cuMemGetAllocationGranularity(&g, &prop, MC_CU_MEM_ALLOC_GRANULARITY_MINIMUM) || !g)
    return 0;
  size_t chunk = (n / VMM_CHUNKS + g - 1) / g * g;
  mc_cu_ptr va = 0;
  if (api->cuMemAddressReserve(&va, chunk * VMM_CHUNKS, g, 0, 0) != 0)
    return 0;
  for (int i = 0; i < VMM_CHUNKS; i++) {
    mc_cu_mem_handle h = 0;
    if (api->cuMemCreate(&h, chunk, &prop, 0) != 0 ||
        api->cuMemMap(va + (size_t)i * chunk, chunk, 0, h, 0) != 0)
      return 0; /* the process exits: nothing to give back */
    api->cuMemRelease(h);
  }
  mc_cu_mem_access_desc_t d = {.location = {MC_CU_MEM_LOCATION_TYPE_DEVICE, 0},
                               .flags = MC_CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  return api->cuMemSetAccess(va, chunk * VMM_CHUNKS, &d, 1) == 0 ? va : 0;
}

/* The target (a fresh process: this program exec'ed with "target"): an
 * engine on 127.0.0.1:port (0: any) registers its memory (vmm: driver-mapped
 * memory, else cuMemAlloc's) and tells the
 * parent where; 'r' from the parent: re-registers (unregisters and frees
 * it, registers a new allocation, tells where); 'h': exits at once, its
 * connections held open by a child of its own until the parent closes
 * its end of the pipe (a death no connection reports); EOF: exits. */
static int target(int port, int wfd, int rfd, int vmm) {
  target_t t;
  memset(&t, 0, sizeof t);
  mc_engine_t *B = NULL;
  mc_err_t err = {0};
  char host[64] = "127.0.0.1";
  if (port > 0)
    snprintf(host, sizeof host, "127.0.0.1:%d", port);
  mc_engine_opts_t o = {.local_hostname = host, .metadata_server = "P2PHANDSHAKE"};
  size_t n = target_bytes();
  if (have_gpu() && mc_engine_create(&o, &B, &err) == 0 &&
      (t.addr = vmm ? vmm_alloc(n) : dalloc(n)) &&
      mc_engine_register(B, (void *)(uintptr_t)t.addr, n, "cuda:0", &err) == 0) {
    snprintf(t.segment, sizeof t.segment, "%s", mc_engine_segment_name(B));
    t.ok = 1;
  }
  (void)!write(wfd, &t, sizeof t);
  char c;
  while (read(rfd, &c, 1) == 1) {
    if (c == 'h') {
      if (fork() == 0)
        while (read(rfd, &c, 1) == 1)
          ;
      _exit(0);
    }
    if (c != 'r' || !t.ok)
      continue;
    uint64_t old = t.addr;
    t.ok = mc_engine_unregister(B, (void *)(uintptr_t)old, &err) == 0 && (t.addr = dalloc(n)) &&
           mc_engine_register(B, (void *)(uintptr_t)t.addr, n, "cuda:0", &err) == 0;
    cu_free(old);
    (void)!write(wfd, &t, sizeof t);
  }
  if (B)
    mc_engine_destroy(B);
  _exit(0); /* as before the exec: the parent's checks are the test (no leak check here) */
}

typedef struct {
  pid_t pid;
  int down, up; /* our ends: commands to it, its answers */
  target_t t;
} child_t;

/* Starts a target on `port` (0: any) as a fresh process (no CUDA state
 * inherited, as a GPU needs), its memory driver-mapped with `vmm`: 1 when
 * it registered its memory. */
static int spawn_kind(child_t *c, int port, int vmm) {
  int down[2], up[2];
  memset(c, 0, sizeof *c);
  c->pid = -1;
  c->down = c->up = -1;
  if (pipe2(down, O_CLOEXEC) || pipe2(up, O_CLOEXEC))
    return 0;
  fflush(stdout);
  fflush(stderr);
  c->pid = fork();
  if (c->pid == 0) {
    char a[3][16];
    snprintf(a[0], sizeof a[0], "%d", port);
    snprintf(a[1], sizeof a[1], "%d", up[1]);
    snprintf(a[2], sizeof a[2], "%d", down[0]);
    fcntl(up[1], F_SETFD, 0);
    fcntl(down[0], F_SETFD, 0);
    execl("/proc/self/exe", "test_gpu_ipc_procs", "target", a[0], a[1], a[2], vmm ? "vmm" : "ipc",
          (char *)NULL);
    _exit(127);
  }
  close(down[0]);
  close(up[1]);
  c->down = down[1];
  c->up = up[0];
  return c->pid > 0 && read(c->up, &c->t, sizeof c->t) == (ssize_t)sizeof c->t && c->t.ok;
}

static int spawn(child_t *c, int port) { return spawn_kind(c, port, 0); }

/* Tells the target to re-register: 1 with its new address in c->t. */
static int reregister(child_t *c) {
  return write(c->down, "r", 1) == 1 && read(c->up, &c->t, sizeof c->t) == (ssize_t)sizeof c->t &&
         c->t.ok;
}

/* Ends the target and waits for it to exit. */
static void reap(child_t *c) {
  if (c->down >= 0)
    close(c->down);
  if (c->pid > 0)
    waitpid(c->pid, NULL, 0);
  if (c->up >= 0)
    close(c->up);
  c->pid = -1;
  c->down = c->up = -1;
}

/* Blocks [from, to) of the batch in one batch: 0 or the error code. */
static int batch(mc_engine_t *A, const char *segment, int op, uint64_t local, uint64_t remote,
                 size_t from, size_t to, mc_err_t *err) {
  mc_request_t r[NBLK];
  for (size_t i = from; i < to; i++)
    r[i - from] = (mc_request_t){.opcode = op, .local = (void *)(uintptr_t)(local + i * BLK),
                                 .remote = remote + perm(i) * BLK, .len = BLK};
  mc_batch_t *b = mc_batch_new(A, to - from);
  int rc = b ? mc_batch_submit(A, b, segment, r, to - from, err) : MC_ENOMEM;
  if (rc == 0)
    rc = mc_batch_wait(A, b, 60000, err);
  if (b)
    mc_batch_free(A, b);
  return rc;
}

typedef struct {
  mc_engine_t *A;
  const char *segment;
  uint64_t local, remote;
  size_t from, to;
  int rc;
  mc_err_t err;
} part_t;

static void *write_part(void *arg) {
  part_t *p = arg;
  p->rc = batch(p->A, p->segment, MC_OP_WRITE, p->local, p->remote, p->from, p->to, &p->err);
  return NULL;
}

/* The WRITE from 4 threads at once, a quarter each: 0 or the first error. */
static int write_concurrently(mc_engine_t *A, const char *segment, uint64_t local,
                              uint64_t remote, mc_err_t *err) {
  part_t p[4];
  pthread_t th[4];
  int started[4] = {0};
  for (int i = 0; i < 4; i++) {
    p[i] = (part_t){.A = A, .segment = segment, .local = local, .remote = remote,
                    .from = (size_t)i * NBLK / 4, .to = (size_t)(i + 1) * NBLK / 4};
    started[i] = pthread_create(&th[i], NULL, write_part, &p[i]) == 0;
    if (!started[i])
      write_part(&p[i]);
  }
  int rc = 0;
  for (int i = 0; i < 4; i++) {
    if (started[i])
      pthread_join(th[i], NULL);
    if (p[i].rc && !rc) {
      rc = p[i].rc;
      *err = p[i].err;
    }
  }
  return rc;
}

/* A function of the stand-in libcuda (NULL on a GPU). */
static void *fake_fn(const char *name) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  return h ? dlsym(h, name) : NULL;
}

static void test_two_processes_take_ipc(void) {
  child_t c;
  int up = spawn(&c, 0); /* before CUDA starts here (not needed since the exec) */
  mc_engine_t *A = NULL;
  mc_err_t err = {0};
  uint64_t src = 0, back = 0;
  size_t n = (size_t)NBLK * BLK;
  uint8_t *want = malloc(n), *have = malloc(n);
  int skip = !up || !have_gpu();
  int rc = skip ? 0 : engine_new(&A, &err);
  if (!skip && rc == 0) {
    src = dalloc(n);
    back = dalloc(n);
    fill(want, n, 30);
    rc = !src || !back || !want || !have || api->cuMemcpyHtoD(src, want, n) != 0 ||
         mc_engine_register(A, (void *)(uintptr_t)src, n, "cuda:0", &err) != 0 ||
         mc_engine_register(A, (void *)(uintptr_t)back, n, "cuda:0", &err) != 0;
  }
  if (!skip && rc == 0 && (rc = write_concurrently(A, c.t.segment, src, c.t.addr, &err)) == 0)
    rc = batch(A, c.t.segment, MC_OP_READ, back, c.t.addr, 0, NBLK, &err);
  mc_engine_stats_t st = {0};
  if (A)
    mc_engine_get_stats(A, &st);
  int (*opens)(void) = NULL;
  if (!skip)
    *(void **)&opens = fake_fn("fakecuda_ipc_opens");
  int same = !skip && rc == 0 && api->cuMemcpyDtoH(have, back, n) == 0 && !memcmp(have, want, n);
  reap(&c);
  if (A)
    mc_engine_destroy(A);
  free(want);
  free(have);
  if (skip) {
    fprintf(stderr, "  (skipped: no GPU visible)\n");
    return;
  }
  if (rc)
    fprintf(stderr, "  transfer failed: %s\n", err.msg);
  CHECK_EQ_INT(rc, 0);
  CHECK(same);
  CHECK(st.gpu_jobs >= 2); /* copy jobs ran (TCP's staging runs them too) */
  if (opens) /* the stand-in: the peer's handle was opened here */
    CHECK(opens() >= 1);
}

/* ---- our mappings of a peer's GPU memory go with the peer ----
 * The peer's process exits (or re-registers its memory): once nothing of
 * ours uses the old mapping it is unmapped, so a restarted prefill gets its
 * GPU memory back and nothing accumulates per restart. */

/* Peer mappings open in this process: the stand-in's count of imports open
 * (what it really has mapped: IPC handles, and cuMem imports of VMM_CHUNKS
 * chunks each) where it runs, with ours checked equal. */
static int open_now(void) {
  int (*f)(void) = NULL, (*v)(void) = NULL;
  *(void **)&f = fake_fn("fakecuda_ipc_open_now");
  *(void **)&v = fake_fn("fakecuda_vmm_imports_mapped");
  int ours = (int)mc_gpu_ipc_open_count(), real = f && v ? f() + v() / VMM_CHUNKS : ours;
  if (real != ours) {
    fprintf(stderr, "  FAIL: the stand-in has %d peer mappings open, our table %d\n", real, ours);
    tl_failures++;
  }
  return real;
}

/* Waits up to 5 s for open_now() to reach `want`; returns what it was. */
static int open_settles(int want) {
  int k = open_now();
  for (int i = 0; i < 500 && k != want; i++) {
    usleep(10000);
    k = open_now();
  }
  return k;
}

/* Free memory of cuda:0 by cuMemGetInfo (a GPU), or 0 (the stand-in). */
static uint64_t gpu_free(void) {
  typedef int (*info_fn)(size_t *, size_t *);
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  info_fn f = h ? (info_fn)dlsym(h, "cuMemGetInfo_v2") : NULL;
  size_t fr = 0, tot = 0;
  return f && mc_cuda_use_device(0, NULL) == 0 && f(&fr, &tot) == 0 ? fr : 0;
}

typedef struct {
  mc_engine_t *A;
  uint64_t src, back;
  uint8_t *want, *have;
  size_t n;
} side_t;

/* Our engine with a source and a read-back buffer registered: 1 if so. */
static int side_new(side_t *s) {
  mc_err_t err = {0};
  memset(s, 0, sizeof *s);
  s->n = (size_t)NBLK * BLK;
  s->want = malloc(s->n);
  s->have = malloc(s->n);
  return s->want && s->have && engine_new(&s->A, &err) == 0 && (s->src = dalloc(s->n)) &&
         (s->back = dalloc(s->n)) &&
         mc_engine_register(s->A, (void *)(uintptr_t)s->src, s->n, "cuda:0", &err) == 0 &&
         mc_engine_register(s->A, (void *)(uintptr_t)s->back, s->n, "cuda:0", &err) == 0;
}

static void side_free(side_t *s) {
  if (s->A)
    mc_engine_destroy(s->A);
  if (s->src)
    cu_free(s->src);
  if (s->back)
    cu_free(s->back);
  free(s->want);
  free(s->have);
}

/* side_new where the test can run (a GPU or the stand-in, and `can`: what
 * else it needs); else nothing made, the skip said (why) and 0. */
static int side_up(side_t *s, int can, const char *why) {
  memset(s, 0, sizeof *s);
  if (have_gpu() && can && side_new(s))
    return 1;
  side_free(s);
  fprintf(stderr, "  (skipped: %s)\n", why);
  return 0;
}

/* WRITEs seed's bytes into the target's memory and READs them back: 1 if
 * they came back right (else says why). */
static int roundtrip(side_t *s, const target_t *t, uint32_t seed) {
  mc_err_t err = {0};
  fill(s->want, s->n, seed);
  int rc = api->cuMemcpyHtoD(s->src, s->want, s->n) != 0 ? MC_EUNAVAIL : 0;
  if (rc == 0)
    rc = batch(s->A, t->segment, MC_OP_WRITE, s->src, t->addr, 0, NBLK, &err);
  if (rc == 0)
    rc = batch(s->A, t->segment, MC_OP_READ, s->back, t->addr, 0, NBLK, &err);
  if (rc)
    fprintf(stderr, "  transfer to %s failed: %s\n", t->segment, err.msg);
  return rc == 0 && api->cuMemcpyDtoH(s->have, s->back, s->n) == 0 &&
         !memcmp(s->have, s->want, s->n);
}

/* A peer process on one port, killed and restarted ROUNDS times: each new
 * one works (bytes right) and, once the old one exited, our mapping of its
 * memory is closed without any further transfer (the control connection's
 * loss) -- before: one more mapping (a whole KV cache on a GPU) per
 * restart, and the first transfer to the successor failed ("re-registered
 * ... retry").  On a GPU with MC_TEST_PEER_MIB=N the free memory returns
 * too. */
#define ROUNDS 4
/* `rounds` restarts of a target of one kind (vmm: driver-mapped memory) on
 * one port, each checked as above; *ran: not skipped (a GPU or the
 * stand-in). */
static void restart_rounds(int vmm, int rounds, uint32_t seed, int *ran) {
  side_t s;
  child_t c = {.pid = -1, .down = -1, .up = -1};
  if (!side_up(&s, !vmm || (api && api->cuMemCreate), "no GPU visible"))
    return;
  *ran = 1;
  int base = open_now(), port = 0;
  for (int k = 0; k < rounds; k++) {
    CHECK(spawn_kind(&c, port, vmm));
    const char *colon = strrchr(c.t.segment, ':');
    if (k == 0 && colon)
      port = atoi(colon + 1); /* its successors serve the same segment name */
    CHECK(roundtrip(&s, &c.t, seed + (uint32_t)k));
    CHECK_EQ_INT(open_now(), base + 1);
    if (k % 2)
      kill(c.pid, SIGKILL); /* killed, as a crashed server; else it closes its engine */
    reap(&c);
    CHECK_EQ_INT(open_settles(base), base);
  }
  side_free(&s);
}

static void test_peer_restarts_release_mappings(void) {
  uint64_t free0 = gpu_free();
  int ran = 0;
  restart_rounds(0, ROUNDS, 40, &ran);
  if (!ran || tl_failures)
    return;
  uint64_t free1 = gpu_free();
  if (free0 && free1) { /* a GPU: what the peers held came back (within 1 GiB) */
    fprintf(stderr, "  cuda:0 free before %.2f GiB, after %d restarts %.2f GiB\n",
            free0 / 1073741824.0, ROUNDS, free1 / 1073741824.0);
    CHECK(free1 + (1ull << 30) >= free0);
  }
}

/* The same-host GPU path's entries of peers (our engine's stats). */
static uint64_t gpu_peers(mc_engine_t *A) {
  mc_engine_stats_t st;
  mc_engine_get_stats(A, &st);
  return st.same_host_gpu_peers;
}

/* Peers restarted on a new port each time (a new segment name: a
 * container rescheduled): each one's entry goes with it once it exited, so
 * a long-lived engine keeps one entry per live peer (before: one more per
 * restart, kept for good). */
static void test_peers_on_new_ports_leave_no_entries(void) {
  side_t s;
  child_t c = {.pid = -1, .down = -1, .up = -1};
  if (!side_up(&s, 1, "no GPU visible"))
    return;
  uint64_t base = gpu_peers(s.A);
  int open0 = open_now();
  for (int k = 0; k < ROUNDS; k++) {
    CHECK(spawn(&c, 0));
    CHECK(roundtrip(&s, &c.t, 90 + (uint32_t)k));
    CHECK_EQ_INT((int)gpu_peers(s.A), (int)base + 1);
    if (k % 2)
      kill(c.pid, SIGKILL);
    reap(&c);
    uint64_t n = gpu_peers(s.A);
    for (int i = 0; i < 500 && n != base; i++) {
      usleep(10000);
      n = gpu_peers(s.A);
    }
    CHECK_EQ_INT((int)n, (int)base);
  }
  CHECK_EQ_INT(open_settles(open0), open0);
  side_free(&s);
}

/* The same with driver-mapped memory (vLLM 0.34's cumem KV cache, a
 * "vmm1:" export): each restarted target's chunks are imported and, once it
 * exited, unmapped and the range freed (before: kept). */
static void test_vmm_peer_restarts_release_mappings(void) {
  int ran = 0;
  restart_rounds(1, 3, 80, &ran);
}

/* The peer re-registers its memory (unregister, free, a new allocation):
 * the next transfer refetches its descriptor and, once its copies into
 * the old one are done, the old mapping is closed (before: kept). */
static void test_reregister_releases_old_mapping(void) {
  side_t s;
  child_t c = {.pid = -1, .down = -1, .up = -1};
  if (!side_up(&s, 1, "no GPU visible"))
    return;
  int base = open_now();
  CHECK(spawn(&c, 0));
  CHECK(roundtrip(&s, &c.t, 50));
  CHECK_EQ_INT(open_now(), base + 1);
  for (int k = 0; k < 3; k++) {
    CHECK(reregister(&c));
    CHECK(roundtrip(&s, &c.t, 51 + (uint32_t)k));
    CHECK_EQ_INT(open_settles(base + 1), base + 1); /* the new one only */
  }
  reap(&c);
  CHECK_EQ_INT(open_settles(base), base);
  side_free(&s);
}

/* A peer dies with its connections still open (a process of its own holds
 * them): no connection's loss says so, the sweep of peers' pidfds does --
 * here at the next submit call to another peer (a second target); the
 * dead one's mapping goes, the other's stays (before: kept). */
static void test_dead_peer_swept(void) {
  side_t s;
  child_t c = {.pid = -1, .down = -1, .up = -1}, c2 = c;
  if (!side_up(&s, 1, "no GPU visible"))
    return;
  int base = open_now();
  CHECK(spawn(&c, 0));
  CHECK(spawn(&c2, 0));
  CHECK(roundtrip(&s, &c.t, 70));
  CHECK(write(c.down, "h", 1) == 1);
  waitpid(c.pid, NULL, 0); /* dead; its connections are not */
  c.pid = -1;
  usleep(1100000); /* past the sweep's once a second */
  CHECK_EQ_INT(open_now(), base + 1);
  CHECK(roundtrip(&s, &c2.t, 71)); /* the sweep runs first */
  CHECK_EQ_INT(open_settles(base + 1), base + 1); /* c2's only */
  reap(&c); /* its holder exits */
  reap(&c2);
  CHECK_EQ_INT(open_settles(base), base);
  side_free(&s);
}

/* A copy in flight keeps its mapping: the peer is killed while our WRITE's
 * copy job is still running (the stand-in holds it 1 s); its mapping
 * must stay until that job completed, then go.  The stand-in counts a
 * close of a mapping a copy still uses (a GPU would fault). */
static void test_copy_in_flight_keeps_mapping(void) {
  void (*lat)(uint64_t) = NULL;
  int (*in_use)(void) = NULL;
  side_t s;
  child_t c = {.pid = -1, .down = -1, .up = -1};
  *(void **)&lat = fake_fn("fakecuda_set_latency_ns");
  *(void **)&in_use = fake_fn("fakecuda_ipc_closes_in_use");
  if (!side_up(&s, lat && in_use, "needs the stand-in libcuda"))
    return;
  int base = open_now();
  CHECK(spawn(&c, 0));
  CHECK(roundtrip(&s, &c.t, 60));
  lat(1000000000ull);
  mc_request_t r[NBLK];
  for (size_t i = 0; i < NBLK; i++)
    r[i] = (mc_request_t){.opcode = MC_OP_WRITE, .local = (void *)(uintptr_t)(s.src + i * BLK),
                          .remote = c.t.addr + perm(i) * BLK, .len = BLK};
  mc_err_t err = {0};
  mc_batch_t *b = mc_batch_new(s.A, NBLK);
  CHECK(b && mc_batch_submit(s.A, b, c.t.segment, r, NBLK, &err) == 0);
  usleep(20000); /* the job is launched (if not: the call holds it all the same) */
  kill(c.pid, SIGKILL);
  reap(&c); /* the peer is gone: its descriptor is dropped (peer_lost) */
  usleep(100000);
  CHECK_EQ_INT(open_now(), base + 1); /* the copy still holds it */
  if (b) {
    mc_batch_wait(s.A, b, 60000, &err); /* fails or not: its copies landed */
    mc_batch_free(s.A, b);
  }
  CHECK_EQ_INT(open_settles(base), base);
  CHECK_EQ_INT(in_use(), 0);
  lat(20000);
  side_free(&s);
}

/* The same-host GPU path's blocks (stats): kept for reuse, at most 16. */
static void block_stats(mc_engine_t *A, uint64_t *cached, uint64_t *reuses) {
  mc_engine_stats_t st;
  mc_engine_get_stats(A, &st);
  *cached = st.same_host_gpu_cached_blocks;
  *reuses = st.same_host_gpu_block_reuses;
}

/* Submits r[0, n) as one batch and waits: 0 or the error code. */
static int run_batch(mc_engine_t *A, const char *segment, const mc_request_t *r, size_t n,
                     mc_err_t *err) {
  mc_batch_t *b = mc_batch_new(A, n);
  int rc = b ? mc_batch_submit(A, b, segment, r, n, err) : MC_ENOMEM;
  if (rc == 0)
    rc = mc_batch_wait(A, b, 60000, err);
  if (b)
    mc_batch_free(A, b);
  return rc;
}

/* One batch of both opcodes, interleaved in runs of 4 (one pass builds the
 * WRITE op and the READ op side by side): runs of WRITEs of adjacent blocks
 * (local and remote back to back: their copies merge into one) and runs of
 * READs of other blocks into scattered places; every byte checked on both
 * sides.  Then the blocks of finished calls are reused (16 batches one
 * after another) and their cache stays bounded when a burst of 24 batches
 * in flight at once comes back together (before: a malloc and free per op,
 * job and call). */
static void test_mixed_batch_and_block_reuse(void) {
  side_t s;
  child_t c = {.pid = -1, .down = -1, .up = -1};
  if (!side_up(&s, 1, "no GPU visible"))
    return;
  CHECK(spawn(&c, 0));
  mc_err_t err = {0};
  size_t n = s.n;
  uint8_t *a = malloc(n), *bb = malloc(n), *back = malloc(n);
  CHECK(a && bb && back);
  mc_request_t r[NBLK];
  /* The target's memory holds a; then the local source b. */
  fill(a, n, 11);
  fill(bb, n, 12);
  CHECK_EQ_INT(api->cuMemcpyHtoD(s.src, a, n), 0);
  for (size_t i = 0; i < NBLK; i++)
    r[i] = (mc_request_t){.opcode = MC_OP_WRITE, .local = (void *)(uintptr_t)(s.src + i * BLK),
                          .remote = c.t.addr + i * BLK, .len = BLK};
  CHECK_EQ_INT(run_batch(s.A, c.t.segment, r, NBLK, &err), 0);
  CHECK_EQ_INT(api->cuMemcpyHtoD(s.src, bb, n), 0);
  for (size_t i = 0; i < NBLK; i++) {
    int wr = (i / 4) % 2 == 0;
    r[i] = wr ? (mc_request_t){.opcode = MC_OP_WRITE,
                               .local = (void *)(uintptr_t)(s.src + i * BLK),
                               .remote = c.t.addr + i * BLK, .len = BLK}
              : (mc_request_t){.opcode = MC_OP_READ,
                               .local = (void *)(uintptr_t)(s.back + perm(i) * BLK),
                               .remote = c.t.addr + i * BLK, .len = BLK};
  }
  int rc = run_batch(s.A, c.t.segment, r, NBLK, &err);
  if (rc)
    fprintf(stderr, "  mixed batch: %s\n", err.msg);
  CHECK_EQ_INT(rc, 0);
  int reads_ok = api->cuMemcpyDtoH(back, s.back, n) == 0;
  for (size_t i = 0; i < NBLK && reads_ok; i++)
    if ((i / 4) % 2 == 1)
      reads_ok = !memcmp(back + perm(i) * BLK, a + i * BLK, BLK);
  CHECK(reads_ok); /* the READs got the target's a */
  for (size_t i = 0; i < NBLK; i++)
    r[i] = (mc_request_t){.opcode = MC_OP_READ, .local = (void *)(uintptr_t)(s.back + i * BLK),
                          .remote = c.t.addr + i * BLK, .len = BLK};
  CHECK_EQ_INT(run_batch(s.A, c.t.segment, r, NBLK, &err), 0);
  int target_ok = api->cuMemcpyDtoH(back, s.back, n) == 0;
  for (size_t i = 0; i < NBLK && target_ok; i++)
    target_ok = !memcmp(back + i * BLK, ((i / 4) % 2 == 0 ? bb : a) + i * BLK, BLK);
  CHECK(target_ok); /* the WRITEs' runs hold b, the rest still a */

  uint64_t cached, reuses0, reuses;
  block_stats(s.A, &cached, &reuses0);
  for (int k = 0; k < 8; k++)
    CHECK(roundtrip(&s, &c.t, 100 + (uint32_t)k));
  block_stats(s.A, &cached, &reuses);
  fprintf(stderr, "  16 batches one after another: %llu blocks reused, %llu cached\n",
          (unsigned long long)(reuses - reuses0), (unsigned long long)cached);
  CHECK(reuses > reuses0);
  CHECK(cached <= 16);
  enum { BURST = 24 };
  mc_batch_t *b[BURST];
  for (size_t i = 0; i < NBLK; i++)
    r[i] = (mc_request_t){.opcode = MC_OP_WRITE, .local = (void *)(uintptr_t)(s.src + i * BLK),
                          .remote = c.t.addr + perm(i) * BLK, .len = BLK};
  for (int k = 0; k < BURST; k++) {
    b[k] = mc_batch_new(s.A, NBLK);
    CHECK(b[k] && mc_batch_submit(s.A, b[k], c.t.segment, r, NBLK, &err) == 0);
  }
  for (int k = 0; k < BURST; k++)
    if (b[k]) {
      CHECK_EQ_INT(mc_batch_wait(s.A, b[k], 60000, &err), 0);
      mc_batch_free(s.A, b[k]);
    }
  usleep(20000); /* the last completions handed their blocks back */
  CHECK(roundtrip(&s, &c.t, 120)); /* its submit takes them back: 3 a batch */
  block_stats(s.A, &cached, &reuses);
  fprintf(stderr, "  after a burst of %d batches: %llu cached\n", BURST,
          (unsigned long long)cached);
  CHECK(cached >= 1 && cached <= 16);
  reap(&c);
  free(a);
  free(bb);
  free(back);
  side_free(&s);
}

int main(int argc, char **argv) {
  if (argc == 6 && !strcmp(argv[1], "target"))
    return target(atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), !strcmp(argv[5], "vmm"));
  signal(SIGPIPE, SIG_IGN);
  RUN(test_two_processes_take_ipc);
  RUN(test_peer_restarts_release_mappings);
  RUN(test_vmm_peer_restarts_release_mappings);
  RUN(test_peers_on_new_ports_leave_no_entries);
  RUN(test_reregister_releases_old_mapping);
  RUN(test_dead_peer_swept);
  RUN(test_copy_in_flight_keeps_mapping);
  RUN(test_mixed_batch_and_block_reuse);
  TEST_MAIN_END();
}
