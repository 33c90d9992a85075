/* GPU memory through the engine: the staging pool and copy worker, TCP with
 * cuda regions on either or both sides (pinned staging), the same-host
 * direct path, wrong location claims, DMA-BUF export.  Every test skips
 * (and says so) where no GPU is visible, so this binary also runs in CI. */
#include <dirent.h>
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "engine/engine.h"
#include "engine/engine_internal.h"
#include "gpu/gpu_ipc.h"
#include "gpu/cuda_driver.h"
#include "gpu/gpu_dmabuf.h"
#include "gpu/gpu_staging.h"
#include "gpu_testlib.h"
#include "testlib.h"

static void test_no_gpu_is_clear(void) {
  if (have_gpu())
    return;
  /* Registering as cuda without a driver/GPU: a clear refusal. */
  mc_engine_t *e;
  mc_err_t err = {0};
  CHECK_EQ_INT(engine_new(&e, &err), 0);
  char *buf = malloc(4096);
  int rc = mc_engine_register(e, buf, 4096, "cuda:0", &err);
  CHECK(rc == MC_EUNAVAIL || rc == MC_EINVAL);
  CHECK(strstr(err.msg, "libcuda") || strstr(err.msg, "host memory"));
  free(buf);
  mc_engine_destroy(e);
}

/* The same-host path asks a peer for its descriptor with the RPC
 * mc.describe; this part needs no GPU. */
static void test_describe_rpc(void) {
  mc_engine_t *A, *B;
  mc_err_t err = {0};
  CHECK_EQ_INT(engine_pair(&A, &B, &err), 0);
  char *buf = malloc(1 << 16);
  CHECK_EQ_INT(mc_engine_register(B, buf, 1 << 16, "cpu", &err), 0);
  mc_remote_desc_t rd = {0};
  describe(A, B, &rd);
  CHECK_EQ_INT(rd.n, 1);
  CHECK_EQ_INT(rd.regions[0].addr, (uint64_t)(uintptr_t)buf);
  CHECK_EQ_INT(rd.regions[0].cuda_dev, -1);
  CHECK(strcmp(rd.host_id, mc_host_identity()) == 0);
  CHECK_EQ_INT(rd.pid, getpid());
  mc_remote_desc_free(&rd);
  mc_engine_destroy(A);
  mc_engine_destroy(B);
  free(buf);
}

/* The copy-worker tests' data: dn bytes of device memory (*d) whose first
 * n hold *src (fill(seed)), and *back (n bytes) to read results into.
 * 0, or -1 where an allocation or the copy failed. */
static int dev_data(size_t n, size_t dn, uint32_t seed, uint64_t *d, uint8_t **src,
                    uint8_t **back) {
  *d = dalloc(dn);
  *src = malloc(n);
  *back = malloc(n);
  if (!*d || !*src || !*back)
    return -1;
  fill(*src, n, seed);
  return api->cuMemcpyHtoD(*d, *src, n) == 0 ? 0 : -1;
}

static void dev_data_free(uint64_t d, uint8_t *src, uint8_t *back) {
  if (d)
    cu_free(d);
  free(src);
  free(back);
}

/* A stager with a 16 MiB pool, or NULL (why on stderr). */
static mc_gpu_stager_t *stager(void) {
  mc_gpu_stager_t *s = NULL;
  mc_err_t err = {0};
  if (mc_gpu_stager_create(16u << 20, &s, &err) < 0)
    fprintf(stderr, "  stager: %s\n", err.msg);
  return s;
}

static void test_stager_roundtrip(void) {
  SKIP_NO_GPU();
  size_t n = 8u << 20;
  uint64_t d;
  uint8_t *src, *back;
  CHECK_EQ_INT(dev_data(n, n, 3, &d, &src, &back), 0);
  mc_gpu_stager_t *s = stager();
  CHECK(s);
  mc_err_t err = {0};
  mc_gpu_buf_t *b = mc_gpu_buf_get(s, 0, n, &err);
  CHECK(b && b->size >= n);
  /* D2H in 64 KiB pieces (one batch), then H2D back shifted by 1 MiB. */
  mc_gpu_job_t *j = mc_gpu_job_new(0, MC_GPU_D2H);
  for (size_t off = 0; off < n; off += 65536)
    CHECK_EQ_INT(mc_gpu_job_add(j, (mc_cu_ptr)(uintptr_t)((char *)b->p + off), d + off, 65536),
                 0);
  CHECK_EQ_INT((int)j->n, 1); /* adjacent pieces merge */
  mc_gpu_stager_submit(s, j);
  mc_gpu_stager_drain(s);
  CHECK(memcmp(b->p, src, n) == 0);
  j = mc_gpu_job_new(0, MC_GPU_H2D);
  for (size_t off = 0; off + (1u << 20) < n; off += 3 * 65536) /* gaps: many copies */
    mc_gpu_job_add(j, d + off + (1u << 20), (mc_cu_ptr)(uintptr_t)((char *)b->p + off), 65536);
  CHECK(j->n > 1);
  mc_gpu_stager_submit(s, j);
  mc_gpu_stager_drain(s);
  CHECK_EQ_INT(api->cuMemcpyDtoH(back, d, n), 0);
  int ok = 1;
  for (size_t off = 0; off + (1u << 20) < n; off += 3 * 65536)
    ok &= memcmp(back + off + (1u << 20), src + off, 65536) == 0;
  CHECK(ok);
  mc_gpu_buf_put(s, b);
  mc_gpu_stager_destroy(s);
  dev_data_free(d, src, back);
}

/* A job whose arrays (and the caller's extra bytes) share its allocation
 * (mc_gpu_job_new_inline, what the same-host path builds per op): adding
 * past its room moves the arrays out; a D2D run of it moves the bytes. */
static void test_inline_job(void) {
  SKIP_NO_GPU();
  void *extra = NULL;
  mc_gpu_job_t *j = mc_gpu_job_new_inline(0, MC_GPU_D2D, 4, 600, &extra);
  CHECK(j && extra && j->inline_arrays && j->cap == 4);
  CHECK(((uintptr_t)extra & 15) == 0);
  int zero = 1;
  for (size_t i = 0; i < 600; i++)
    zero &= ((unsigned char *)extra)[i] == 0;
  CHECK(zero);
  memset(extra, 0xab, 600); /* the caller's: never overlaps the arrays */
  size_t n = 1u << 20, piece = 4096;
  uint64_t d;
  uint8_t *src, *back;
  CHECK_EQ_INT(dev_data(n, 2 * n, 7, &d, &src, &back), 0);
  /* 16 separate copies (every other piece): the 5th moves the arrays out. */
  for (size_t k = 0; k < 16; k++)
    CHECK_EQ_INT(mc_gpu_job_add(j, d + n + 2 * k * piece, d + 2 * k * piece, piece), 0);
  CHECK(!j->inline_arrays && j->n == 16 && j->cap >= 16);
  CHECK(((unsigned char *)extra)[0] == 0xab && ((unsigned char *)extra)[599] == 0xab);
  mc_gpu_stager_t *s = stager();
  CHECK(s);
  mc_gpu_stager_submit(s, j); /* freed by the worker: arrays and all */
  mc_gpu_stager_drain(s);
  CHECK_EQ_INT(api->cuMemcpyDtoH(back, d + n, n), 0);
  int ok = 1;
  for (size_t k = 0; k < 16; k++)
    ok &= memcmp(back + 2 * k * piece, src + 2 * k * piece, piece) == 0;
  CHECK(ok);
  /* One that stays within its room (arrays inline to the end). */
  j = mc_gpu_job_new_inline(0, MC_GPU_D2D, 2, 0, NULL);
  CHECK(j);
  CHECK_EQ_INT(mc_gpu_job_add(j, d + n, d + piece, piece), 0);
  CHECK_EQ_INT(mc_gpu_job_add(j, d + n + 8 * piece, d + 9 * piece, piece), 0);
  CHECK(j->inline_arrays && j->n == 2);
  mc_gpu_stager_submit(s, j);
  mc_gpu_stager_drain(s);
  CHECK_EQ_INT(api->cuMemcpyDtoH(back, d + n, 9 * piece), 0);
  CHECK(memcmp(back, src + piece, piece) == 0 && memcmp(back + 8 * piece, src + 9 * piece, piece) == 0);
  mc_gpu_stager_destroy(s);
  dev_data_free(d, src, back);
}

/* Direct launches (MC_GPU_DIRECT, gpu_staging.c): with the worker idle
 * and a caller that waits batch by batch, the submitting thread launches a
 * D2D job itself, and a thread that reaps sees it finish (complete() on
 * that thread); a job submitted while one is in flight goes through the
 * worker; unreaped, the worker finishes it after the grace and the next
 * chances go to the worker (the caller pipelines); MC_GPU_DIRECT=0 never
 * launches directly. */
typedef struct {
  atomic_int done;
  int direct, code;
  pthread_t th;
} direct_seen_t;

static void direct_done(mc_gpu_job_t *j, int code, const char *msg) {
  (void)msg;
  direct_seen_t *d = j->arg;
  d->direct = j->direct;
  d->code = code;
  d->th = pthread_self();
  mc_gpu_job_free(j);
  atomic_store(&d->done, 1);
}

static mc_gpu_job_t *direct_job(uint64_t d, size_t n, direct_seen_t *seen) {
  mc_gpu_job_t *j = mc_gpu_job_new(0, MC_GPU_D2D);
  /* Two separate copies (a kernel job): first and second quarter to the back half. */
  mc_gpu_job_add(j, d + n, d, n / 4);
  mc_gpu_job_add(j, d + n + n / 2, d + n / 4 + 4096, n / 4);
  j->complete = direct_done;
  j->arg = seen;
  return j;
}

static int reap_until(mc_gpu_stager_t *s, direct_seen_t *seen) {
  for (int k = 0; k < 2000000 && !atomic_load(&seen->done); k++)
    if (!mc_gpu_stager_reap(s))
      sched_yield();
  return atomic_load(&seen->done);
}

/* A caller that waits batch by batch: submit, wait (reap) until done, and
 * let the worker settle (drain: busy back to 0; it reaps nothing).  The
 * job's `direct` (0: the worker launched it, 1: this thread, which also
 * saw it finish); -1 if it failed or did not finish. */
static int seq_round(mc_gpu_stager_t *s, uint64_t d, size_t n) {
  direct_seen_t x = {0};
  mc_gpu_stager_submit(s, direct_job(d, n, &x));
  int ok = reap_until(s, &x) && x.code == 0;
  mc_gpu_stager_drain(s);
  if (!ok || (x.direct == 1 && !pthread_equal(x.th, pthread_self())))
    return -1;
  return x.direct;
}

static void test_direct_launch(void) {
  SKIP_NO_GPU();
  size_t n = 1u << 20;
  uint64_t d;
  uint8_t *src, *back;
  CHECK_EQ_INT(dev_data(n, 2 * n, 11, &d, &src, &back), 0);
  setenv("MC_GPU_DIRECT_GRACE_US", "1000000", 1); /* the worker leaves it to us for 1 s */
  mc_gpu_stager_t *s = stager();
  CHECK(s);
  /* The first starts the worker; the caller has not yet waited twice in a row. */
  CHECK_EQ_INT(seq_round(s, d, n), 0);
  CHECK_EQ_INT(seq_round(s, d, n), 0);
  direct_seen_t a = {0}, b = {0}, c = {0};
  mc_gpu_stager_submit(s, direct_job(d, n, &a)); /* idle, waits each batch: launched here */
  mc_gpu_stager_submit(s, direct_job(d, n, &b)); /* one in flight: through the worker */
  CHECK(reap_until(s, &a));
  CHECK(a.code == 0 && a.direct == 1 && pthread_equal(a.th, pthread_self()));
  mc_gpu_stager_drain(s);
  CHECK(atomic_load(&b.done) && b.code == 0 && b.direct == 0);
  CHECK_EQ_INT(api->cuMemcpyDtoH(back, d + n, n), 0);
  CHECK(memcmp(back, src, n / 4) == 0 && memcmp(back + n / 2, src + n / 4 + 4096, n / 4) == 0);
  mc_gpu_stager_destroy(s);
  /* Nobody reaps: the worker finishes it after the grace (drain waits). */
  setenv("MC_GPU_DIRECT_GRACE_US", "50", 1);
  CHECK((s = stager()) != NULL);
  for (int k = 0; k < 3; k++)
    CHECK(seq_round(s, d, n) >= 0);
  mc_gpu_stager_submit(s, direct_job(d, n, &c));
  mc_gpu_stager_drain(s);
  CHECK(atomic_load(&c.done) && c.code == 0 && c.direct == 2 && !pthread_equal(c.th, pthread_self()));
  /* Nobody waited for it: the caller pipelines, the next chances go
   * through the worker even to a caller that waits again. */
  for (int k = 0; k < 4; k++)
    CHECK_EQ_INT(seq_round(s, d, n), 0);
  mc_gpu_stager_destroy(s);
  unsetenv("MC_GPU_DIRECT_GRACE_US");
  /* Off: never direct. */
  setenv("MC_GPU_DIRECT", "0", 1);
  CHECK((s = stager()) != NULL);
  for (int k = 0; k < 4; k++)
    CHECK_EQ_INT(seq_round(s, d, n), 0);
  mc_gpu_stager_destroy(s);
  unsetenv("MC_GPU_DIRECT");
  dev_data_free(d, src, back);
}

/* A pipelining caller (several submits, then the waits) gets no direct
 * launches, even where the worker is idle at a burst's first submit and
 * the waits come within the grace (so the worker never sees an unwaited
 * direct job and the back-off never starts): the worker launches while
 * the caller plans its next batch.  A caller that then waits batch by
 * batch again gets them back from its second submit (DIRECT_RUN 2).  The
 * counters (mc_gpu_stager_counts) say the same. */
static void test_direct_pipelining(void) {
  SKIP_NO_GPU();
  size_t n = 64u << 10;
  uint64_t d = dalloc(2 * n);
  CHECK(d);
  setenv("MC_GPU_DIRECT_GRACE_US", "1000000", 1); /* every direct job is the waiter's */
  mc_gpu_stager_t *s = stager();
  CHECK(s);
  int direct = 0;
  for (int k = 0; k < 4; k++) {
    int r = seq_round(s, d, n);
    CHECK(r == 0 || r == 1);
    direct += r == 1;
  }
  CHECK(direct >= 2); /* waits each batch: direct (from the third on) */
  int burst_direct = 0, first_direct = 0;
  for (int r = 0; r < 20; r++) {
    direct_seen_t x[4];
    memset(x, 0, sizeof x);
    for (int k = 0; k < 4; k++)
      mc_gpu_stager_submit(s, direct_job(d, n, &x[k]));
    for (int k = 0; k < 4; k++) {
      CHECK(reap_until(s, &x[k]) && x[k].code == 0);
      if (r == 0)
        first_direct += x[k].direct != 0;
      else
        burst_direct += x[k].direct != 0;
    }
    mc_gpu_stager_drain(s); /* the worker idle again before the next burst */
  }
  /* The first burst's first job came after waits each batch: it may go
   * direct (the pattern shows only at the second submit); none after. */
  CHECK(first_direct <= 1);
  if (burst_direct)
    fprintf(stderr, "  pipelined bursts 2-20: %d of 76 jobs launched by the submitting "
            "thread\n", burst_direct);
  CHECK_EQ_INT(burst_direct, 0);
  int again = 0;
  for (int k = 0; k < 4; k++)
    again += seq_round(s, d, n) == 1;
  CHECK_EQ_INT(again, 3); /* the burst's waits count: the second submit on goes direct */
  uint64_t jobs = 0, ndirect = 0;
  mc_gpu_stager_counts(s, &jobs, &ndirect);
  CHECK_EQ_INT(jobs, 4 + 80 + 4);
  CHECK_EQ_INT(ndirect, (uint64_t)(direct + first_direct + burst_direct + again));
  mc_gpu_stager_destroy(s);
  /* A burst right after waits each batch: its first job goes direct and
   * nobody waits for it within the grace (the worker finishes it).  The
   * caller submitted again meanwhile, so that is the pipelining already
   * seen, not a late waiter: a sequential caller after it gets direct
   * launches back at once, not after DIRECT_SKIP (64) chances. */
  setenv("MC_GPU_DIRECT_GRACE_US", "50", 1);
  CHECK((s = stager()) != NULL);
  for (int k = 0; k < 3; k++)
    CHECK(seq_round(s, d, n) >= 0);
  direct_seen_t y[4];
  memset(y, 0, sizeof y);
  for (int k = 0; k < 4; k++)
    mc_gpu_stager_submit(s, direct_job(d, n, &y[k]));
  mc_gpu_stager_drain(s); /* no reap: the worker finishes the direct one after the grace */
  CHECK(y[0].direct == 2 && y[1].direct == 0 && y[3].direct == 0);
  again = 0;
  for (int k = 0; k < 4; k++)
    again += seq_round(s, d, n) == 1;
  CHECK_EQ_INT(again, 2); /* nobody waited after the burst: from the third on */
  mc_gpu_stager_destroy(s);
  unsetenv("MC_GPU_DIRECT_GRACE_US");
  cu_free(d);
}

/* The copy worker's diagnostics (MC_GPU_DIAG=1, mc_gpu_stager_diag), its
 * placement (MC_GPU_WORKER_CPU) and the gentler poll (MC_GPU_POLL_NS): a
 * pipelined burst through the worker (MC_GPU_DIRECT=0) is counted launch by
 * launch (merged or not, every copy once, each launch seen done), the
 * thread is named mc-gpu-copy and pinned where asked; reset zeroes the
 * counters; without MC_GPU_DIAG they stay zero. */
static char *worker_status(void) {
  DIR *dir = opendir("/proc/self/task");
  static char st[4096];
  char *found = NULL;
  for (struct dirent *e; dir && !found && (e = readdir(dir));) {
    char path[128], comm[64] = "";
    snprintf(path, sizeof path, "/proc/self/task/%s/comm", e->d_name);
    FILE *f = fopen(path, "r");
    if (!f)
      continue;
    if (fgets(comm, sizeof comm, f) && !strncmp(comm, "mc-gpu-copy", 11)) {
      snprintf(path, sizeof path, "/proc/self/task/%s/status", e->d_name);
      FILE *g = fopen(path, "r");
      size_t n = g ? fread(st, 1, sizeof st - 1, g) : 0;
      st[n] = '\0';
      if (g)
        fclose(g);
      found = st;
    }
    fclose(f);
  }
  if (dir)
    closedir(dir);
  return found;
}

/* Issue 30: a worker that keeps launching (a queue that never empties)
 * still looks at the launches in flight between launches, so completions
 * (and the callers waiting for them) keep pace instead of all coming after
 * the last launch.  The first job holds the worker (its prepare waits)
 * until 128 more are queued; MC_GPU_DIAG=2's timeline then shows jobs seen
 * done before the last one was launched. */
static atomic_int hold_entered, hold_go;

static int hold_prepare(mc_gpu_job_t *j, mc_err_t *err) {
  (void)err;
  atomic_store(&hold_entered, 1);
  while (!atomic_load(&hold_go))
    sched_yield();
  j->prepare = NULL;
  return 0;
}

static void test_worker_polls_while_launching(void) {
  SKIP_NO_GPU();
  size_t n = 128u << 10;
  uint64_t d = dalloc(2 * n);
  CHECK(d);
  setenv("MC_GPU_DIAG", "2", 1);
  setenv("MC_GPU_MERGE", "0", 1);
  setenv("MC_GPU_DIRECT", "0", 1);
  mc_gpu_stager_t *s = NULL;
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_gpu_stager_create(16u << 20, &s, &err), 0);
  mc_gpu_diag_t g;
  mc_gpu_stager_diag(s, &g, 1);
  enum { NJ = 128 };
  static direct_seen_t x[NJ + 1];
  memset(x, 0, sizeof x);
  atomic_store(&hold_entered, 0);
  atomic_store(&hold_go, 0);
  mc_gpu_job_t *first = direct_job(d, n, &x[0]);
  first->prepare = hold_prepare;
  mc_gpu_stager_submit(s, first);
  while (!atomic_load(&hold_entered))
    sched_yield();
  for (int k = 1; k <= NJ; k++)
    mc_gpu_stager_submit(s, direct_job(d, n, &x[k]));
  atomic_store(&hold_go, 1);
  mc_gpu_stager_drain(s);
  for (int k = 0; k <= NJ; k++)
    CHECK(atomic_load(&x[k].done) && x[k].code == 0);
  static mc_gpu_tl_t tl[NJ + 8];
  size_t nt = mc_gpu_stager_timeline(s, tl, NJ + 8);
  if (api->cuEventElapsedTime) {
    CHECK_EQ_INT(nt, NJ + 1);
    double last_launch = 0;
    for (size_t i = 0; i < nt; i++)
      last_launch = tl[i].launched_us > last_launch ? tl[i].launched_us : last_launch;
    int early = 0;
    for (size_t i = 0; i < nt; i++)
      early += tl[i].done_us < last_launch;
    CHECK(early > 0); /* before: 0 (every completion after the last launch) */
  }
  mc_gpu_stager_destroy(s);
  unsetenv("MC_GPU_DIAG");
  unsetenv("MC_GPU_MERGE");
  unsetenv("MC_GPU_DIRECT");
  cu_free(d);
}

static void test_worker_diag(void) {
  SKIP_NO_GPU();
  size_t n = 64u << 10;
  uint64_t d;
  uint8_t *src, *back;
  CHECK_EQ_INT(dev_data(n, 2 * n, 5, &d, &src, &back), 0);
  cpu_set_t allowed;
  CHECK_EQ_INT(sched_getaffinity(0, sizeof allowed, &allowed), 0);
  int cpu = -1;
  for (int c = 0; c < CPU_SETSIZE; c++)
    if (CPU_ISSET(c, &allowed))
      cpu = c; /* the last allowed CPU */
  char cs[16];
  snprintf(cs, sizeof cs, "%d", cpu);
  setenv("MC_GPU_DIAG", "1", 1);
  setenv("MC_GPU_WORKER_CPU", cs, 1);
  setenv("MC_GPU_POLL_NS", "2000", 1);
  setenv("MC_GPU_DIRECT", "0", 1);
  mc_gpu_stager_t *s = NULL;
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_gpu_stager_create(16u << 20, &s, &err), 0);
  for (int round = 0; round < 2; round++) {
    mc_gpu_diag_t g;
    mc_gpu_stager_diag(s, &g, 1); /* from here */
    direct_seen_t x[8];
    memset(x, 0, sizeof x);
    for (int k = 0; k < 8; k++)
      mc_gpu_stager_submit(s, direct_job(d, n, &x[k])); /* 2 copies each */
    mc_gpu_stager_drain(s);
    for (int k = 0; k < 8; k++)
      CHECK(atomic_load(&x[k].done) && x[k].code == 0 && x[k].direct == 0);
    mc_gpu_stager_diag(s, &g, 0);
    CHECK(g.launches >= 1 && g.launches <= 8);
    CHECK_EQ_INT(g.copies, 16);
    CHECK_EQ_INT(g.done_jobs, g.launches);
    CHECK(g.queries >= g.launches && g.loops > 0);
    CHECK_EQ_INT(g.worker_cpu, cpu);
    CHECK(g.submit_cpu >= 0);
    /* Each kernel launch timed on the GPU where the driver can. */
    CHECK(api->cuEventElapsedTime ? g.gpu_jobs == g.launches && g.gpu_ns > 0 : g.gpu_jobs == 0);
  }
  mc_gpu_diag_t z;
  mc_gpu_stager_diag(s, &z, 1);
  mc_gpu_stager_diag(s, &z, 0);
  CHECK(z.launches == 0 && z.copies == 0 && z.done_jobs == 0);
  char *st = worker_status();
  CHECK(st != NULL);
  char *al = st ? strstr(st, "Cpus_allowed_list:") : NULL;
  char line[64] = "";
  if (al)
    sscanf(al + strlen("Cpus_allowed_list:"), " %63s", line);
  CHECK(atoi(line) == cpu && !strchr(line, '-') && !strchr(line, ','));
  CHECK_EQ_INT(api->cuMemcpyDtoH(back, d + n, n), 0);
  CHECK(memcmp(back, src, n / 4) == 0 && memcmp(back + n / 2, src + n / 4 + 4096, n / 4) == 0);
  mc_gpu_stager_destroy(s);
  /* MC_GPU_DIAG=2: the launch timeline, one record per timed launch. */
  setenv("MC_GPU_DIAG", "2", 1);
  CHECK_EQ_INT(mc_gpu_stager_create(16u << 20, &s, &err), 0);
  mc_gpu_diag_t g2;
  mc_gpu_stager_diag(s, &g2, 1);
  direct_seen_t x2[8];
  memset(x2, 0, sizeof x2);
  for (int k = 0; k < 8; k++)
    mc_gpu_stager_submit(s, direct_job(d, n, &x2[k]));
  mc_gpu_stager_drain(s);
  mc_gpu_stager_diag(s, &g2, 0);
  mc_gpu_tl_t tl[16];
  size_t ntl = mc_gpu_stager_timeline(s, tl, 16);
  CHECK_EQ_INT(ntl, api->cuEventElapsedTime ? g2.launches : 0);
  uint32_t copies = 0;
  for (size_t i = 0; i < ntl; i++) {
    CHECK(tl[i].launched_us >= tl[i].picked_us && tl[i].gpu_end_us >= tl[i].gpu_start_us);
    CHECK(tl[i].stream >= 2 && tl[i].stream < 4); /* the D2D streams */
    copies += tl[i].copies;
  }
  CHECK_EQ_INT(copies, ntl ? 16 : 0);
  mc_gpu_stager_diag(s, &g2, 1); /* a restart empties it */
  CHECK_EQ_INT(mc_gpu_stager_timeline(s, tl, 16), 0);
  mc_gpu_stager_destroy(s);
  unsetenv("MC_GPU_DIAG");
  unsetenv("MC_GPU_WORKER_CPU");
  unsetenv("MC_GPU_POLL_NS");
  CHECK_EQ_INT(mc_gpu_stager_create(16u << 20, &s, &err), 0);
  direct_seen_t y[4];
  memset(y, 0, sizeof y);
  for (int k = 0; k < 4; k++)
    mc_gpu_stager_submit(s, direct_job(d, n, &y[k]));
  mc_gpu_stager_drain(s);
  mc_gpu_stager_diag(s, &z, 0);
  CHECK(z.launches == 0 && z.loops == 0 && z.worker_cpu == -1);
  mc_gpu_stager_destroy(s);
  unsetenv("MC_GPU_DIRECT");
  dev_data_free(d, src, back);
}

/* Direct launches from several threads at once: each submits and reaps
 * (seeing others' jobs finish too), one more thread only reaps; every job
 * completes exactly once, and the stager drains and closes after. */
typedef struct {
  mc_gpu_stager_t *s;
  uint64_t d;
  size_t n;
  int iters;
  atomic_int *stop;
  int bad, direct;
} direct_thr_t;

static void *direct_submitter(void *arg) {
  direct_thr_t *t = arg;
  for (int k = 0; k < t->iters; k++) {
    direct_seen_t seen = {0};
    mc_gpu_stager_submit(t->s, direct_job(t->d, t->n, &seen));
    if (!reap_until(t->s, &seen) || seen.code != 0)
      t->bad++;
    t->direct += seen.direct != 0;
    /* A thread of the caller's: no context before, none after. */
    mc_cu_context cur = NULL;
    if (api->cuCtxGetCurrent(&cur) != 0 || cur != NULL)
      t->bad++;
  }
  return NULL;
}

static void *direct_reaper(void *arg) {
  direct_thr_t *t = arg;
  while (!atomic_load(t->stop))
    if (!mc_gpu_stager_reap(t->s))
      sched_yield();
  return NULL;
}

static void test_direct_concurrent(void) {
  SKIP_NO_GPU();
  size_t n = 64u << 10;
  uint64_t d = dalloc(2 * n);
  CHECK(d);
  mc_gpu_stager_t *s = stager();
  CHECK(s);
  direct_seen_t first = {0};
  mc_gpu_stager_submit(s, direct_job(d, n, &first)); /* starts the worker */
  mc_gpu_stager_drain(s);
  atomic_int stop = 0;
  direct_thr_t t[4];
  pthread_t th[4];
  for (int i = 0; i < 4; i++) {
    t[i] = (direct_thr_t){.s = s, .d = dalloc(2 * n), .n = n, .iters = 300, .stop = &stop};
    CHECK(t[i].d);
    pthread_create(&th[i], NULL, i == 3 ? direct_reaper : direct_submitter, &t[i]);
  }
  for (int i = 0; i < 3; i++)
    pthread_join(th[i], NULL);
  atomic_store(&stop, 1);
  pthread_join(th[3], NULL);
  int direct = 0;
  for (int i = 0; i < 3; i++) {
    CHECK_EQ_INT(t[i].bad, 0);
    direct += t[i].direct;
  }
  CHECK(direct > 0); /* the direct path ran (else this tests only the worker) */
  mc_gpu_stager_destroy(s);
  for (int i = 0; i < 4; i++)
    cu_free(t[i].d);
  cu_free(d);
}

static void test_wrong_claims(void) {
  SKIP_NO_GPU();
  mc_engine_t *e;
  mc_err_t err = {0};
  CHECK_EQ_INT(engine_new(&e, &err), 0);
  uint64_t d = dalloc(1 << 20);
  CHECK_EQ_INT(mc_engine_register(e, (void *)(uintptr_t)d, 1 << 20, "cpu", &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "GPU memory on cuda:0");
  CHECK_EQ_INT(mc_engine_register(e, (void *)(uintptr_t)d, 1 << 20, "cuda:1", &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "\"cuda:0\"");
  char *h = malloc(4096);
  CHECK_EQ_INT(mc_engine_register(e, h, 4096, "cuda:0", &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "host memory");
  CHECK_EQ_INT(mc_engine_register(e, (void *)(uintptr_t)d, 1 << 20, "*", &err), 0);
  char *desc = mc_engine_describe(e);
  CHECK(desc && strstr(desc, "\"cuda:0\"") && strstr(desc, "cuda_ipc"));
  free(desc);
  CHECK_EQ_INT(mc_engine_unregister(e, (void *)(uintptr_t)d, &err), 0);
  mc_engine_destroy(e);
  cu_free(d);
  free(h);
}

/* n bytes at addr (device memory if gpu, else host memory) into dst. */
static int to_host(uint8_t *dst, uint64_t addr, int gpu, size_t n) {
  if (gpu)
    return api->cuMemcpyDtoH(dst, addr, n);
  memcpy(dst, (void *)(uintptr_t)addr, n);
  return 0;
}

/* One pair of engines; local/remote memory chosen per case. */
static void run_pair(int local_gpu, int remote_gpu, int ipc, size_t total, size_t block) {
  setenv("MC_GPU_IPC", ipc ? "1" : "0", 1);
  mc_engine_t *A, *B;
  mc_err_t err = {0};
  int rc = engine_pair(&A, &B, &err);
  unsetenv("MC_GPU_IPC");
  CHECK_EQ_INT(rc, 0);
  uint8_t *ref = malloc(total), *back = malloc(total);
  fill(ref, total, (uint32_t)(local_gpu * 4 + remote_gpu * 2 + ipc));
  uint64_t la = local_gpu ? dalloc(total) : (uint64_t)(uintptr_t)calloc(1, total);
  uint64_t ra = remote_gpu ? dalloc(total) : (uint64_t)(uintptr_t)calloc(1, total);
  CHECK(la && ra);
  if (local_gpu)
    CHECK_EQ_INT(api->cuMemcpyHtoD(la, ref, total), 0);
  else
    memcpy((void *)(uintptr_t)la, ref, total);
  CHECK_EQ_INT(mc_engine_register(B, (void *)(uintptr_t)ra, total, "*", &err), 0);
  /* Local buffers must be registered with their engine too. */
  CHECK_EQ_INT(mc_engine_register(A, (void *)(uintptr_t)la, total, "*", &err), 0);
  size_t n = total / block;
  mc_request_t *r = calloc(n, sizeof *r);
  /* WRITE local -> remote with blocks in reversed order (a scatter). */
  for (size_t i = 0; i < n; i++)
    r[i] = (mc_request_t){.opcode = MC_OP_WRITE, .local = (void *)(uintptr_t)(la + i * block),
                          .remote = ra + (n - 1 - i) * block, .len = block};
  rc = xfer(A, B, r, n, &err);
  if (rc)
    fprintf(stderr, "  write: %s\n", err.msg);
  CHECK_EQ_INT(rc, 0);
  CHECK_EQ_INT(to_host(back, ra, remote_gpu, total), 0);
  int ok = 1;
  for (size_t i = 0; i < n; i++)
    ok &= memcmp(back + (n - 1 - i) * block, ref + i * block, block) == 0;
  CHECK(ok);
  /* READ it back into cleared local memory. */
  if (local_gpu) {
    memset(back, 0, total);
    CHECK_EQ_INT(api->cuMemcpyHtoD(la, back, total), 0);
  } else {
    memset((void *)(uintptr_t)la, 0, total);
  }
  for (size_t i = 0; i < n; i++)
    r[i].opcode = MC_OP_READ;
  rc = xfer(A, B, r, n, &err);
  if (rc)
    fprintf(stderr, "  read: %s\n", err.msg);
  CHECK_EQ_INT(rc, 0);
  CHECK_EQ_INT(to_host(back, la, local_gpu, total), 0);
  CHECK(memcmp(back, ref, total) == 0);
  /* An address outside B's regions still fails cleanly. */
  mc_request_t bad = {.opcode = MC_OP_WRITE, .local = (void *)(uintptr_t)la,
                      .remote = ra + total, .len = block};
  mc_batch_t *b = mc_batch_new(A, 1);
  CHECK_EQ_INT(mc_batch_submit(A, b, mc_engine_segment_name(B), &bad, 1, &err), 0);
  CHECK(mc_batch_wait(A, b, 10000, &err) < 0);
  CHECK_CONTAINS(err.msg, "not inside any memory region");
  mc_batch_free(A, b);
  mc_engine_destroy(A);
  mc_engine_destroy(B);
  if (local_gpu)
    cu_free(la);
  else
    free((void *)(uintptr_t)la);
  if (remote_gpu)
    cu_free(ra);
  else
    free((void *)(uintptr_t)ra);
  free(r);
  free(ref);
  free(back);
}

static void test_tcp_gpu_target_host_initiator(void) {
  SKIP_NO_GPU();
  run_pair(0, 1, 0, 32u << 20, 65536);
}
static void test_tcp_host_target_gpu_initiator(void) {
  SKIP_NO_GPU();
  run_pair(1, 0, 0, 32u << 20, 65536);
}
static void test_tcp_gpu_both(void) {
  SKIP_NO_GPU();
  run_pair(1, 1, 0, 64u << 20, 65536);
  run_pair(1, 1, 0, 64u << 20, 2u << 20);
  run_pair(1, 1, 0, 12345 * 7, 12345); /* odd sizes */
}
static void test_same_host_direct(void) {
  SKIP_NO_GPU();
  run_pair(1, 1, 1, 64u << 20, 65536);
  run_pair(1, 1, 1, 64u << 20, 2u << 20);
}
static void test_local_segment_gpu(void) {
  SKIP_NO_GPU();
  mc_engine_t *e;
  mc_err_t err = {0};
  CHECK_EQ_INT(engine_new(&e, &err), 0);
  size_t n = 1 << 20;
  uint64_t d = dalloc(n);
  uint8_t *src = malloc(n), *back = malloc(n);
  fill(src, n, 9);
  CHECK_EQ_INT(mc_engine_register(e, (void *)(uintptr_t)d, n, "cuda:0", &err), 0);
  CHECK_EQ_INT(mc_engine_register(e, src, n, "cpu", &err), 0);
  mc_request_t r = {.opcode = MC_OP_WRITE, .local = src, .remote = d, .len = n};
  mc_batch_t *b = mc_batch_new(e, 1);
  CHECK_EQ_INT(mc_batch_submit(e, b, mc_engine_segment_name(e), &r, 1, &err), 0);
  CHECK_EQ_INT(mc_batch_wait(e, b, 10000, &err), 0);
  mc_batch_free(e, b);
  CHECK_EQ_INT(api->cuMemcpyDtoH(back, d, n), 0);
  CHECK(memcmp(back, src, n) == 0);
  mc_engine_destroy(e);
  cu_free(d);
  free(src);
  free(back);
}

static void test_dmabuf_export(void) {
  SKIP_NO_GPU();
  uint64_t d = dalloc(4u << 20);
  int fd = -1;
  uint64_t off = 0, span = 0;
  mc_err_t err = {0};
  int rc = mc_gpu_dmabuf_fd(d + 4096 + 100, 65536, &fd, &off, &span, &err);
  if (rc == 0) {
    fprintf(stderr, "  (DMA-BUF fd %d, offset %llu, span %llu)\n", fd, (unsigned long long)off,
            (unsigned long long)span);
    CHECK(fd >= 0);
    CHECK_EQ_INT(off, 100);
    CHECK(span >= 65536 + 100);
    close(fd);
  } else {
    fprintf(stderr, "  (DMA-BUF unavailable here: %s)\n", err.msg);
    CHECK_EQ_INT(rc, MC_EUNAVAIL);
    CHECK(strstr(err.msg, "DMA-BUF") || strstr(err.msg, "cuMemGetHandleForAddressRange"));
  }
  /* Host memory is refused with a reason. */
  char *h = malloc(4096);
  CHECK_EQ_INT(mc_gpu_dmabuf_fd((uint64_t)(uintptr_t)h, 4096, &fd, &off, &span, &err),
               MC_EINVAL);
  CHECK_CONTAINS(err.msg, "not GPU memory");
  free(h);
  cu_free(d);
}

int main(void) {
  RUN(test_no_gpu_is_clear);
  RUN(test_describe_rpc);
  RUN(test_stager_roundtrip);
  RUN(test_inline_job);
  RUN(test_direct_launch);
  RUN(test_direct_pipelining);
  RUN(test_direct_concurrent);
  RUN(test_worker_diag);
  RUN(test_worker_polls_while_launching);
  RUN(test_wrong_claims);
  RUN(test_local_segment_gpu);
  RUN(test_tcp_gpu_target_host_initiator);
  RUN(test_tcp_host_target_gpu_initiator);
  RUN(test_tcp_gpu_both);
  RUN(test_same_host_direct);
  RUN(test_dmabuf_export);
  TEST_MAIN_END();
}
