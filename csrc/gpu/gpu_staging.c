#include "gpu/gpu_staging.h"

#include <errno.h>
#include <stdatomic.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpu/gpu_copy_kernel.h"
#include "util/array.h"
#include "util/clock.h"
#include "util/env.h"
#include "util/log.h"

#define MC_GPU_MAX_DEV 64
#define MC_GPU_CHUNK (1u << 20) /* buffer sizes are rounded up to this */
/* D2D jobs of one device go round-robin to this many streams: one chunk's
 * copy kernel can start while the previous one drains its last pieces
 * (copies of different requests have no order among them). */
#define MC_GPU_D2D_STREAMS 2
#define MC_GPU_NSTREAMS (2 + MC_GPU_D2D_STREAMS)
/* A single D2D copy up to this size goes through the copy kernel too: its
 * launch and completion are quicker than a copy engine's for a few KiB;
 * larger single copies stay with the copy engine. */
#define MC_GPU_SINGLE_MAX (256u << 10)
/* D2D jobs queued behind one another for one device go out as one kernel
 * launch of up to this many copies (a launch costs the worker several
 * microseconds of driver time; MC_GPU_MERGE=0: one launch per job). */
#define MC_GPU_MERGE_MAX 4096u
#define DIRECT_SKIP 64
/* While jobs keep coming, the worker looks at the launches in flight at
 * least this often between two launches, so their completions (and the
 * callers' waits) run alongside the launching instead of all after it
 * (issue 30: a pipelining caller otherwise finished 128 batches in one go
 * once the last was launched). */
#define POLL_BETWEEN_NS 16000ull
/* Direct launches need this many submits in a row each made after a wait
 * for GPU copies (a caller that waits batch by batch); one submit right
 * after another (a pipelining caller) starts the count again. */
#define DIRECT_RUN 2

/* MC_GPU_DIAG's counters (mc_gpu_diag_t's, in its order). */
enum { DG_LAUNCHES, DG_COPIES, DG_TABLE, DG_QUEUE, DG_LAUNCH, DG_DONE, DG_DONE_JOBS, DG_LOOPS,
       DG_QUERIES, DG_SLEEPS, DG_CPU_MOVES, DG_SAME_CPU, DG_GPU, DG_GPU_JOBS, DG_QUERY_NS,
       DG_FINISH_NS, DG_POLLS, DG_N };

struct mc_gpu_stager {
  pthread_mutex_t mu;
  pthread_cond_t cv;      /* work for the worker, or room in the pool */
  pthread_cond_t idle_cv; /* drain waiters */
  size_t budget;
  int kernel_warned;
  int d2d_mode; /* MC_GPU_D2D_COPY: 0 kernel, 1 batch API, 2 one cuMemcpyAsync each */
  int single_kernel; /* a single D2D copy of <= MC_COPY_PARAM_PIECES pieces: the kernel
                        too (MC_GPU_SINGLE_COPY=driver: cuMemcpyAsync) */
  int trace;    /* MC_GPU_TRACE=1: log each D2D job's timeline */
  int merge;    /* MC_GPU_MERGE != 0: queued D2D jobs of one device share a launch */
  /* Pool (under mu). */
  mc_gpu_buf_t *free_list;
  size_t pinned;  /* bytes allocated, free or in use */
  /* Jobs (under mu). */
  mc_gpu_job_t *q_head, *q_tail;
  int stop;
  atomic_int started;
  /* Lock-free signals, so the polling worker never holds up a submitter
   * on mu: q_gen changes (under mu) whenever the queue may hold a job that
   * can start now (a job queued, a staging buffer returned, stop); the
   * worker takes mu only when it changed. */
  atomic_uint q_gen;
  atomic_size_t busy;  /* jobs queued or in flight */
  atomic_int poked;    /* mc_gpu_stager_poke: poll again before sleeping */
  atomic_int sleeping; /* the worker waits on cv */
  pthread_t thread;
  /* Worker-only. */
  mc_gpu_job_t *fl_head, *fl_tail; /* in flight, submission order */
  mc_cu_stream streams[MC_GPU_MAX_DEV][MC_GPU_NSTREAMS];
  unsigned d2d_next[MC_GPU_MAX_DEV]; /* round-robin over the D2D streams */
  /* Per stream: the job in flight last launched on it when that job has
   * no event yet (lazy_events): its completion is the stream's.  A job
   * launched behind it first records the event it then needs. */
  mc_gpu_job_t *unmarked[MC_GPU_MAX_DEV][MC_GPU_NSTREAMS];
  int lazy_events; /* cuStreamQuery exists and MC_GPU_LAZY_EVENTS != 0 */
  mc_cu_event *events[MC_GPU_MAX_DEV];
  size_t nevents[MC_GPU_MAX_DEV], cap_events[MC_GPU_MAX_DEV];
  /* Direct launches (MC_GPU_DIRECT != 0): with nothing queued or in flight,
   * the submitting thread launches a D2D job itself on its device's direct
   * stream (one such job at a time), and whoever waits for it sees its
   * completion (mc_gpu_stager_reap); the worker finishes it after
   * direct_grace_ns if nobody did. */
  char pad_[64]; /* last, apart: the fields above keep their places */
  atomic_int direct_off;
  uint64_t direct_grace_ns;
  atomic_int direct_claim;  /* a direct job is being launched or in flight */
  atomic_int reaping;       /* a thread is checking the direct job */
  _Atomic(mc_gpu_job_t *) direct_job; /* launched, not finished */
  atomic_uint_least64_t direct_t;      /* when it was launched */
  /* A waiter looked at the direct job.  One that the worker finished with
   * no waiter in sight and no submit since means the caller waits too late
   * for its batches: the next DIRECT_SKIP chances go to the worker, which
   * then launches while the caller does other work. */
  atomic_int direct_waited, direct_skip;
  mc_cu_stream dstreams[MC_GPU_MAX_DEV]; /* under direct_claim */
  /* The caller's pattern, per eligible submit (after dstreams: apart from
   * direct_job, which the worker polls): a thread waited for GPU copies
   * (mc_gpu_stager_reap) since the last one (wait_mark), and how many
   * submits in a row came after such a wait (waited_run, capped at
   * DIRECT_RUN).  A pipelining caller submits again before it waits: its
   * jobs go to the worker, which launches while the caller plans the next
   * batch, whether or not the worker looks idle. */
  atomic_int wait_mark, waited_run;
  atomic_uint_least64_t njobs, ndirect; /* jobs submitted, launched directly */
  /* MC_GPU_DIAG=1 (diag): counters for mc_gpu_stager_diag, written by the
   * worker (submit_cpu by submitters).  MC_GPU_WORKER_CPU: the worker's
   * CPU (-1: the scheduler's choice).  MC_GPU_POLL_NS: between two looks at
   * jobs in flight the worker spins this long on cheap checks (pause)
   * instead of sched_yield (0). */
  int diag, pin_cpu;
  uint64_t poll_ns;
  uint64_t polled_ns; /* worker-only: when it last looked at the launches in flight */
  atomic_int submit_cpu, last_cpu;
  _Atomic uint64_t dg[DG_N]; /* mc_gpu_diag_t's counters, in its order */
  /* MC_GPU_DIAG=2 (diag 2): each timed launch's host and GPU times since
   * the last reset (tl_base: an event recorded then, at host time
   * tl_base_ns), written by the worker, read once the jobs are done. */
  mc_cu_event tl_base;
  uint64_t tl_base_ns;
  mc_gpu_tl_t *tl;
  atomic_size_t ntl;
  /* MC_GPU_D2D_STREAMS (1..MC_GPU_D2D_STREAMS): D2D jobs rotate over this
   * many streams per device. */
  unsigned d2d_streams;
};
#define MC_GPU_TL_MAX 8192

#define DG_ADD(s, k, v)                                                                        \
  do {                                                                                         \
    if ((s)->diag)                                                                             \
      atomic_fetch_add_explicit(&(s)->dg[k], (v), memory_order_relaxed);                      \
  } while (0)

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int d2d_mode(void) {
  const char *m = getenv("MC_GPU_D2D_COPY");
  return !m || !*m || !strcmp(m, "kernel") ? 0 : !strcmp(m, "batch") ? 1 : 2;
}

const char *mc_gpu_d2d_copy_name(void) {
  static const char *const names[] = {"one copy-kernel launch per batch",
                                      "cuMemcpyBatchAsync", "one cuMemcpyAsync per block"};
  return names[d2d_mode()];
}

static size_t round_size(size_t n) {
  return (n + MC_GPU_CHUNK - 1) / MC_GPU_CHUNK * MC_GPU_CHUNK;
}

mc_gpu_job_t *mc_gpu_job_new(int device, int dir) {
  mc_gpu_job_t *j = calloc(1, sizeof *j);
  if (j) {
    j->device = device;
    j->dir = dir;
  }
  return j;
}

#define JOB_HEAD ((sizeof(mc_gpu_job_t) + 15) & ~(size_t)15)
#define JOB_ARRAYS(cap) (((cap) * (2 * sizeof(mc_cu_ptr) + sizeof(size_t)) + 15) & ~(size_t)15)

size_t mc_gpu_job_inline_bytes(size_t cap, size_t extra) {
  return JOB_HEAD + JOB_ARRAYS(cap) + extra;
}

mc_gpu_job_t *mc_gpu_job_new_inline(int device, int dir, size_t cap, size_t extra,
                                    void **extra_out) {
  void *mem = malloc(mc_gpu_job_inline_bytes(cap, extra));
  return mem ? mc_gpu_job_init_inline(mem, device, dir, cap, extra, extra_out) : NULL;
}

mc_gpu_job_t *mc_gpu_job_init_inline(void *mem, int device, int dir, size_t cap, size_t extra,
                                     void **extra_out) {
  size_t head = JOB_HEAD, arrays = JOB_ARRAYS(cap);
  mc_gpu_job_t *j = mem;
  memset(j, 0, sizeof *j);
  j->device = device;
  j->dir = dir;
  j->dsts = (mc_cu_ptr *)((char *)j + head);
  j->srcs = j->dsts + cap;
  j->sizes = (size_t *)(j->srcs + cap);
  j->cap = cap;
  j->inline_arrays = 1;
  if (extra_out) {
    *extra_out = (char *)j + head + arrays;
    memset(*extra_out, 0, extra);
  }
  return j;
}

int mc_gpu_job_reserve(mc_gpu_job_t *j, size_t nc) {
  if (nc <= j->cap)
    return 0;
  if (j->inline_arrays) { /* the arrays move out of the job's allocation */
    mc_cu_ptr *d = malloc(nc * sizeof *d), *s = malloc(nc * sizeof *s);
    size_t *z = malloc(nc * sizeof *z);
    if (!d || !s || !z) {
      free(d);
      free(s);
      free(z);
      return MC_ENOMEM;
    }
    memcpy(d, j->dsts, j->n * sizeof *d);
    memcpy(s, j->srcs, j->n * sizeof *s);
    memcpy(z, j->sizes, j->n * sizeof *z);
    j->dsts = d;
    j->srcs = s;
    j->sizes = z;
    j->cap = nc;
    j->inline_arrays = 0;
    return 0;
  }
  mc_cu_ptr *d = realloc(j->dsts, nc * sizeof *d);
  if (d)
    j->dsts = d;
  mc_cu_ptr *s = realloc(j->srcs, nc * sizeof *s);
  if (s)
    j->srcs = s;
  size_t *z = realloc(j->sizes, nc * sizeof *z);
  if (z)
    j->sizes = z;
  if (!d || !s || !z)
    return MC_ENOMEM;
  j->cap = nc;
  return 0;
}

void mc_gpu_job_free(mc_gpu_job_t *j) {
  if (!j)
    return;
  if (!j->inline_arrays) {
    free(j->dsts);
    free(j->srcs);
    free(j->sizes);
  }
  free(j);
}

int mc_gpu_stager_create(size_t budget_bytes, mc_gpu_stager_t **out, mc_err_t *err) {
  mc_gpu_stager_t *s = calloc(1, sizeof *s);
  if (!s)
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv, NULL);
  pthread_cond_init(&s->idle_cv, NULL);
  s->budget = budget_bytes ? budget_bytes : (64u << 20);
  s->d2d_mode = d2d_mode();
  const char *le = getenv("MC_GPU_LAZY_EVENTS");
  s->lazy_events = !(le && !strcmp(le, "0")); /* and cuStreamQuery: checked per job */
  const char *sc = getenv("MC_GPU_SINGLE_COPY");
  s->single_kernel = !(sc && !strcmp(sc, "driver"));
  s->trace = getenv("MC_GPU_TRACE") && getenv("MC_GPU_TRACE")[0] == '1';
  const char *mg = getenv("MC_GPU_MERGE");
  s->merge = !(mg && !strcmp(mg, "0"));
  const char *dl = getenv("MC_GPU_DIRECT");
  atomic_store(&s->direct_off, dl && !strcmp(dl, "0"));
  const char *dg = getenv("MC_GPU_DIRECT_GRACE_US");
  long grace = dg && *dg ? strtol(dg, NULL, 10) : 50;
  s->direct_grace_ns = (uint64_t)(grace < 0 ? 0 : grace > 1000000 ? 1000000 : grace) * 1000u;
  const char *dd = getenv("MC_GPU_DIAG");
  s->diag = dd && (dd[0] == '1' || dd[0] == '2') ? dd[0] - '0' : 0;
  s->d2d_streams = (unsigned)mc_env_long("MC_GPU_D2D_STREAMS", MC_GPU_D2D_STREAMS, 1,
                                         MC_GPU_D2D_STREAMS);
  s->pin_cpu = (int)mc_env_long("MC_GPU_WORKER_CPU", -1, -1, CPU_SETSIZE - 1);
  s->poll_ns = (uint64_t)mc_env_long("MC_GPU_POLL_NS", 0, 0, 1000000);
  atomic_store(&s->last_cpu, -1);
  atomic_store(&s->submit_cpu, -1);
  *out = s;
  return 0;
}

/* ---- pinned pool ---- */

static mc_gpu_buf_t *pool_alloc(int device, size_t size, mc_err_t *err) {
  const mc_cuda_api_t *api = mc_cuda_api(err);
  if (!api)
    return NULL;
  if (mc_cuda_use_device(device, err) < 0)
    return NULL;
  mc_gpu_buf_t *b = calloc(1, sizeof *b);
  if (!b) {
    mc_err_set(err, MC_ENOMEM, "out of memory");
    return NULL;
  }
  mc_cu_result r = api->cuMemHostAlloc(&b->p, size,
                                       MC_CU_MEMHOSTALLOC_PORTABLE | MC_CU_MEMHOSTALLOC_DEVICEMAP);
  if (r != 0) {
    char m[160];
    mc_err_set(err, MC_ENOMEM, "cannot allocate %zu bytes of pinned host memory for GPU "
               "staging: %s (lower MC_GPU_STAGING_MB or raise the memlock limit)",
               size, mc_cuda_strerror(api, r, m, sizeof m));
    free(b);
    return NULL;
  }
  b->size = size;
  return b;
}

/* Under mu: a free buffer of >= n bytes (not more than 4x), or NULL. */
static mc_gpu_buf_t *pool_take(mc_gpu_stager_t *s, size_t n) {
  for (mc_gpu_buf_t **pp = &s->free_list; *pp; pp = &(*pp)->next) {
    mc_gpu_buf_t *b = *pp;
    if (b->size >= n && b->size <= 4 * n + MC_GPU_CHUNK) {
      *pp = b->next;
      b->next = NULL;
      return b;
    }
  }
  return NULL;
}

mc_gpu_buf_t *mc_gpu_buf_get(mc_gpu_stager_t *s, int device, size_t n, mc_err_t *err) {
  size_t size = round_size(n ? n : 1);
  pthread_mutex_lock(&s->mu);
  mc_gpu_buf_t *b = pool_take(s, size);
  if (!b)
    s->pinned += size;
  pthread_mutex_unlock(&s->mu);
  if (b)
    return b;
  b = pool_alloc(device, size, err);
  if (!b) {
    pthread_mutex_lock(&s->mu);
    s->pinned -= size;
    atomic_fetch_add(&s->q_gen, 1); /* room again: a job waiting for it may start */
    pthread_mutex_unlock(&s->mu);
  }
  return b;
}

void mc_gpu_buf_put(mc_gpu_stager_t *s, mc_gpu_buf_t *b) {
  if (!b)
    return;
  pthread_mutex_lock(&s->mu);
  b->next = s->free_list;
  s->free_list = b;
  atomic_fetch_add(&s->q_gen, 1); /* a job waiting for room may start now */
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
}

int mc_gpu_stager_reserve(mc_gpu_stager_t *s, int device, size_t bytes, mc_err_t *err) {
  size_t chunk = 4u << 20;
  for (;;) {
    pthread_mutex_lock(&s->mu);
    int enough = s->pinned + chunk > bytes;
    if (!enough)
      s->pinned += chunk;
    pthread_mutex_unlock(&s->mu);
    if (enough)
      return 0;
    mc_gpu_buf_t *b = pool_alloc(device, chunk, err);
    if (!b) {
      pthread_mutex_lock(&s->mu);
      s->pinned -= chunk;
      atomic_fetch_add(&s->q_gen, 1);
      pthread_mutex_unlock(&s->mu);
      return err ? err->code : MC_ENOMEM;
    }
    mc_gpu_buf_put(s, b);
  }
}

/* Worker, under mu: a buffer for a job that may wait.  Frees idle buffers
 * of the wrong size to stay within the budget.  NULL = wait. */
static mc_gpu_buf_t *pool_get_budgeted(mc_gpu_stager_t *s, int device, size_t n,
                                       mc_err_t *err, int *failed) {
  size_t size = round_size(n ? n : 1);
  mc_gpu_buf_t *b = pool_take(s, size);
  if (b)
    return b;
  const mc_cuda_api_t *api = mc_cuda_api(NULL);
  while (s->pinned + size > s->budget && s->free_list && api) {
    mc_gpu_buf_t *f = s->free_list; /* a free buffer of a size we cannot use */
    s->free_list = f->next;
    s->pinned -= f->size;
    api->cuMemFreeHost(f->p);
    free(f);
  }
  if (s->pinned + size > s->budget && s->pinned > 0)
    return NULL; /* wait for buffers in use to come back */
  s->pinned += size;
  pthread_mutex_unlock(&s->mu);
  b = pool_alloc(device, size, err);
  pthread_mutex_lock(&s->mu);
  if (!b) {
    s->pinned -= size;
    *failed = 1;
  }
  return b;
}

/* ---- the worker ---- */

static mc_cu_event event_get(mc_gpu_stager_t *s, int dev) {
  if (s->nevents[dev])
    return s->events[dev][--s->nevents[dev]];
  mc_cu_event e = NULL;
  const mc_cuda_api_t *api = mc_cuda_api(NULL);
  if (api && api->cuEventCreate(&e, MC_CU_EVENT_DISABLE_TIMING) != 0)
    e = NULL;
  return e;
}

static void event_put(mc_gpu_stager_t *s, int dev, mc_cu_event e) {
  mc_cu_event *v = mc_array_room(s->events[dev], s->nevents[dev], &s->cap_events[dev], sizeof *v, 16);
  if (!v) {
    mc_cuda_api(NULL)->cuEventDestroy(e);
    return;
  }
  s->events[dev] = v;
  s->events[dev][s->nevents[dev]++] = e;
}

/* MC_GPU_DIAG: the kernel's own GPU time, from its timing events (then
 * freed); not counted where it failed or the events are not done. */
static void diag_gpu_time(mc_gpu_stager_t *s, mc_gpu_job_t *j, int code) {
  const mc_cuda_api_t *api = mc_cuda_api(NULL);
  float ms = 0, a = 0, b = 0;
  if (code == 0 && api->cuEventElapsedTime(&ms, j->tev[0], j->tev[1]) == 0) {
    DG_ADD(s, DG_GPU, (uint64_t)((double)ms * 1e6));
    DG_ADD(s, DG_GPU_JOBS, 1);
    size_t k = s->tl ? atomic_load(&s->ntl) : MC_GPU_TL_MAX;
    if (k < MC_GPU_TL_MAX && api->cuEventElapsedTime(&a, s->tl_base, j->tev[0]) == 0 &&
        api->cuEventElapsedTime(&b, s->tl_base, j->tev[1]) == 0) {
      s->tl[k] = (mc_gpu_tl_t){.picked_us = (double)(int64_t)(j->t_picked - s->tl_base_ns) / 1e3,
                               .launched_us =
                                   (double)(int64_t)(j->t_launched - s->tl_base_ns) / 1e3,
                               .gpu_start_us = (double)a * 1e3,
                               .gpu_end_us = (double)b * 1e3,
                               .done_us = (double)(int64_t)(now_ns() - s->tl_base_ns) / 1e3,
                               .copies = (uint32_t)j->n,
                               .stream = (uint8_t)j->ev_stream,
                               .table = (uint8_t)(j->kbuf != NULL)};
      atomic_store(&s->ntl, k + 1);
    }
  }
  for (int k = 0; k < 2; k++)
    if (j->tev[k])
      api->cuEventDestroy(j->tev[k]);
  j->tev[0] = j->tev[1] = NULL;
}

/* MC_GPU_DIAG: records timing event k of j on st (both or none kept). */
static void diag_gpu_mark(mc_gpu_stager_t *s, mc_gpu_job_t *j, int k, mc_cu_stream st) {
  const mc_cuda_api_t *api = mc_cuda_api(NULL);
  if (!s->diag || !api || !api->cuEventElapsedTime || (k == 1 && !j->tev[0]))
    return;
  if (api->cuEventCreate(&j->tev[k], 0) != 0) {
    j->tev[k] = NULL;
  } else if (api->cuEventRecord(j->tev[k], st) == 0) {
    return;
  }
  diag_gpu_time(s, j, 1); /* failed: drop what is there */
}

static void finish(mc_gpu_stager_t *s, mc_gpu_job_t *j, int code, const char *msg) {
  if (j->tev[0])
    diag_gpu_time(s, j, code);
  mc_gpu_job_t *riders = j->riders;
  j->riders = NULL;
  for (mc_gpu_job_t *r = riders; r; r = r->next) {
    r->t_picked = j->t_picked;
    r->t_launched = j->t_launched;
  }
  if (s->trace && j->dir == MC_GPU_D2D)
    mc_log_info("gpu trace: D2D job cuda:%d, %zu copies: queued at %.1f us, launched +%.1f us, "
                "done seen +%.1f us, picked up +%.1f us%s", j->device, j->n,
                (double)(j->t_queued / 1000 % 100000000), (j->t_launched - j->t_queued) / 1e3,
                (now_ns() - j->t_queued) / 1e3, (j->t_picked - j->t_queued) / 1e3,
                j->direct == 1 ? " (direct, seen by the waiter)"
                : j->direct == 2 ? " (direct, seen by the copy worker)" : "");
  if (j->kbuf) {
    mc_gpu_buf_put(s, j->kbuf);
    j->kbuf = NULL;
  }
  if (j->complete)
    j->complete(j, code, msg);
  else
    mc_gpu_job_free(j);
  /* The last job: busy goes to 0 under mu (a drain checks it under mu: no
   * lost wake-up), so a drain that returns finds this thread done with s
   * (a waiter reaping a direct job is not joined by destroy). */
  size_t b = atomic_load(&s->busy);
  while (b > 1 && !atomic_compare_exchange_weak(&s->busy, &b, b - 1))
    ;
  if (b <= 1) {
    pthread_mutex_lock(&s->mu);
    if (atomic_fetch_sub(&s->busy, 1) == 1)
      pthread_cond_broadcast(&s->idle_cv);
    pthread_mutex_unlock(&s->mu);
  }
  while (riders) { /* their copies went with j's launch */
    mc_gpu_job_t *r = riders;
    riders = r->next;
    r->next = NULL;
    finish(s, r, code, msg);
  }
}

/* A D2D job of the copy kernel that may carry others' copies. */
static int mergeable(const mc_gpu_stager_t *s, const mc_gpu_job_t *j) {
  return s->merge && s->d2d_mode == 0 && j->dir == MC_GPU_D2D && !j->prepare && !j->want_buf &&
         j->n > 0;
}

/* Under mu, j just taken off the queue: the D2D jobs queued after it for
 * its device come along (unlinked; returned as a list, at most
 * MC_GPU_MERGE_MAX copies in all). */
static mc_gpu_job_t *take_riders(mc_gpu_stager_t *s, mc_gpu_job_t *j) {
  if (!mergeable(s, j))
    return NULL;
  size_t total = j->n;
  mc_gpu_job_t *head = NULL, **tail = &head;
  mc_gpu_job_t **pp = &s->q_head, *prev = NULL;
  while (*pp) {
    mc_gpu_job_t *k = *pp;
    if (!mergeable(s, k) || k->device != j->device || total + k->n > MC_GPU_MERGE_MAX)
      break; /* in order: no job overtakes one that cannot come along */
    *pp = k->next;
    if (s->q_tail == k)
      s->q_tail = prev;
    k->next = NULL;
    *tail = k;
    tail = &k->next;
    total += k->n;
  }
  return head;
}

/* No lock: appends the riders' copies to j's (they finish with j).  Out
 * of memory: the riders stay separate jobs, returned for start_job. */
static mc_gpu_job_t *carry_riders(mc_gpu_job_t *j, mc_gpu_job_t *riders) {
  size_t total = j->n;
  for (mc_gpu_job_t *r = riders; r; r = r->next)
    total += r->n;
  if (!riders || mc_gpu_job_reserve(j, total) < 0)
    return riders;
  for (mc_gpu_job_t *r = riders; r; r = r->next) {
    memcpy(j->dsts + j->n, r->dsts, r->n * sizeof *j->dsts);
    memcpy(j->srcs + j->n, r->srcs, r->n * sizeof *j->srcs);
    memcpy(j->sizes + j->n, r->sizes, r->n * sizeof *j->sizes);
    j->n += r->n;
  }
  j->riders = riders;
  return NULL;
}

/* A D2D job the copy kernel moves (else driver copies). */
static int kernel_job(const mc_gpu_stager_t *s, const mc_gpu_job_t *j) {
  return j->dir == MC_GPU_D2D && s->d2d_mode == 0 &&
         (j->n > 1 || (j->n == 1 && s->single_kernel && j->sizes[0] <= MC_GPU_SINGLE_MAX));
}

/* Enqueues a job's copies and records its event; completes it on error. */
static void start_job(mc_gpu_stager_t *s, mc_gpu_job_t *j) {
  if (s->trace || s->diag)
    j->t_picked = now_ns();
  if (s->diag && j->dir == MC_GPU_D2D) {
    int cpu = sched_getcpu(), last = atomic_exchange(&s->last_cpu, cpu);
    DG_ADD(s, DG_CPU_MOVES, (uint64_t)(cpu != last && last >= 0));
    DG_ADD(s, DG_SAME_CPU, (uint64_t)(cpu == atomic_load(&s->submit_cpu)));
    DG_ADD(s, DG_LAUNCHES, 1);
    DG_ADD(s, DG_COPIES, j->n);
    uint64_t q = j->t_queued && j->t_picked > j->t_queued ? j->t_picked - j->t_queued : 0;
    for (mc_gpu_job_t *r = j->riders; r; r = r->next)
      q += r->t_queued && j->t_picked > r->t_queued ? j->t_picked - r->t_queued : 0;
    DG_ADD(s, DG_QUEUE, q);
  }
  mc_err_t err = {0};
  const mc_cuda_api_t *api = mc_cuda_api(&err);
  int dev = j->device;
  int rc = api ? 0 : err.code;
  if (rc == 0 && (dev < 0 || dev >= MC_GPU_MAX_DEV))
    rc = mc_err_set(&err, MC_EINVAL, "GPU copy names device %d", dev);
  if (rc == 0)
    rc = mc_cuda_use_device(dev, &err);
  if (rc == 0 && j->prepare)
    rc = j->prepare(j, &err);
  int si = j->dir;
  if (j->dir == MC_GPU_D2D)
    si += (int)(s->d2d_next[dev]++ % s->d2d_streams);
  mc_cu_stream *st = rc == 0 ? &s->streams[dev][si] : NULL;
  int lazy = s->lazy_events && api && api->cuStreamQuery;
  if (rc == 0 && !*st) {
    mc_cu_result r = api->cuStreamCreate(st, MC_CU_STREAM_NON_BLOCKING);
    if (r != 0) {
      char m[160];
      rc = mc_err_set(&err, MC_EUNAVAIL, "cannot create a CUDA stream on cuda:%d: %s", dev,
                      mc_cuda_strerror(api, r, m, sizeof m));
      *st = NULL;
    }
  }
  mc_gpu_job_t *prev = rc == 0 ? s->unmarked[dev][si] : NULL;
  if (prev) {
    /* The job before this one on the stream completes with its own event,
     * recorded here, before this job's copies: exactly where it ends. */
    s->unmarked[dev][si] = NULL;
    prev->event = event_get(s, dev);
    if (!prev->event || api->cuEventRecord(prev->event, *st) != 0) {
      if (prev->event)
        event_put(s, dev, prev->event);
      prev->event = NULL;
      api->cuStreamSynchronize(*st); /* slow path, never expected */
      prev->synced = 1;
    }
  }
  int done = 0;
  if (rc == 0 && kernel_job(s, j)) {
    /* Many pieces between GPUs: one kernel launch moves them all; a few
     * travel in its parameters, more in a pinned table. */
    mc_err_t kerr = {0};
    diag_gpu_mark(s, j, 0, *st);
    if (j->n <= MC_COPY_PARAM_REQS &&
        mc_copy_kernel_launch(dev, j->dsts, j->srcs, j->sizes, j->n, NULL, *st, &kerr) == 0) {
      done = 1;
    } else {
      size_t tb = mc_copy_kernel_table_bytes(j->sizes, j->n);
      kerr.msg[0] = '\0';
      j->kbuf = mc_gpu_buf_get(s, dev, tb, &kerr);
      if (j->kbuf && mc_copy_kernel_launch(dev, j->dsts, j->srcs, j->sizes, j->n, j->kbuf->p,
                                           *st, &kerr) == 0)
        done = 1;
    }
    if (done)
      diag_gpu_mark(s, j, 1, *st);
    else if (j->tev[0])
      diag_gpu_time(s, j, 1); /* no kernel to time */
    if (!done && !s->kernel_warned++)
      mc_log_warn("GPU copy kernel not used (%s); using driver copies", kerr.msg);
  }
  if (rc == 0 && !done) {
    const mc_cuda_api_t *a = api;
    if (j->dir == MC_GPU_D2D && s->d2d_mode == 2) {
      for (size_t i = 0; i < j->n && rc == 0; i++) {
        mc_cu_result r = a->cuMemcpyAsync(j->dsts[i], j->srcs[i], j->sizes[i], *st);
        if (r != 0)
          rc = mc_err_set(&err, MC_ESYS, "GPU copy failed (CUDA error %d)", r);
      }
    } else {
      rc = mc_cuda_copy_batch(j->dsts, j->srcs, j->sizes, j->n, *st, &err);
    }
  }
  if (rc == 0 && lazy) {
    /* No event until a later job needs one (see unmarked): the common
     * single job in flight costs one driver call less. */
    j->event = NULL;
    j->ev_dev = dev;
    j->ev_stream = si;
    j->synced = 0;
    s->unmarked[dev][si] = j;
  } else if (rc == 0) {
    j->event = event_get(s, dev);
    j->ev_dev = dev;
    j->ev_stream = si;
    j->synced = 1; /* no event: synchronized below */
    mc_cu_result r = j->event ? api->cuEventRecord(j->event, *st) : 1;
    if (r != 0) {
      /* No event: wait for the stream here (slow path, never expected). */
      if (j->event)
        event_put(s, dev, j->event);
      j->event = NULL;
      api->cuStreamSynchronize(*st);
    }
  }
  if (s->trace || s->diag)
    j->t_launched = now_ns();
  if (s->diag && j->dir == MC_GPU_D2D) {
    DG_ADD(s, DG_LAUNCH, j->t_launched - j->t_picked);
    DG_ADD(s, DG_TABLE, (uint64_t)(j->kbuf != NULL));
  }
  if (rc < 0) {
    finish(s, j, rc, err.msg);
    return;
  }
  j->next = NULL;
  if (s->fl_tail)
    s->fl_tail->next = j;
  else
    s->fl_head = j;
  s->fl_tail = j;
}

/* Completes finished jobs; returns how many.  Events of one stream
 * complete in order: after one that is not ready, the later ones of its
 * stream are not asked (many jobs in flight would otherwise cost a driver
 * call each per pass). */
static int poll_inflight(mc_gpu_stager_t *s) {
  const mc_cuda_api_t *api = mc_cuda_api(NULL);
  s->polled_ns = now_ns();
  DG_ADD(s, DG_POLLS, 1);
  int done = 0, cur_dev = -1;
  unsigned char busy[MC_GPU_MAX_DEV][MC_GPU_NSTREAMS];
  memset(busy, 0, sizeof busy);
  mc_gpu_job_t **pp = &s->fl_head, *prev = NULL;
  while (*pp) {
    mc_gpu_job_t *j = *pp;
    mc_cu_result r = 0;
    int waits = j->event || !j->synced; /* an event, or the stream (unmarked) */
    if (waits && busy[j->ev_dev][j->ev_stream]) {
      r = MC_CU_ERROR_NOT_READY;
    } else if (waits) {
      if (j->ev_dev != cur_dev)
        mc_cuda_use_device(cur_dev = j->ev_dev, NULL);
      uint64_t q0 = s->diag ? now_ns() : 0;
      r = j->event ? api->cuEventQuery(j->event)
                   : api->cuStreamQuery(s->streams[j->ev_dev][j->ev_stream]);
      DG_ADD(s, DG_QUERIES, 1);
      DG_ADD(s, DG_QUERY_NS, s->diag ? now_ns() - q0 : 0);
      if (r == MC_CU_ERROR_NOT_READY)
        busy[j->ev_dev][j->ev_stream] = 1;
    }
    if (r == MC_CU_ERROR_NOT_READY) {
      prev = j;
      pp = &j->next;
      continue;
    }
    *pp = j->next;
    if (s->fl_tail == j)
      s->fl_tail = prev;
    if (!j->event && s->unmarked[j->ev_dev][j->ev_stream] == j)
      s->unmarked[j->ev_dev][j->ev_stream] = NULL;
    if (j->event)
      event_put(s, j->ev_dev, j->event);
    j->event = NULL;
    if (s->diag && j->dir == MC_GPU_D2D && j->t_launched) {
      DG_ADD(s, DG_DONE, now_ns() - j->t_launched);
      DG_ADD(s, DG_DONE_JOBS, 1);
    }
    char m[200] = "";
    if (r != 0) {
      char b[160];
      snprintf(m, sizeof m, "GPU copy failed: %s", mc_cuda_strerror(api, r, b, sizeof b));
    }
    uint64_t f0 = s->diag ? now_ns() : 0;
    finish(s, j, r ? MC_ESYS : 0, r ? m : NULL);
    DG_ADD(s, DG_FINISH_NS, s->diag ? now_ns() - f0 : 0);
    done++;
  }
  return done;
}

/* Under mu: starts what can start.  A job waiting for staging room does
 * not hold up later jobs that need none (their completion frees room).
 * Returns how many started (or failed). */
static int start_queued(mc_gpu_stager_t *s) {
  int blocked = 0, started = 0;
  mc_gpu_job_t **pp = &s->q_head, *prev = NULL;
  while (*pp) {
    mc_gpu_job_t *j = *pp;
    int failed = 0;
    mc_err_t err = {0};
    if (j->want_buf && !j->buf) {
      if (!blocked)
        j->buf = pool_get_budgeted(s, j->device, j->want_buf, &err, &failed);
      if (!j->buf && !failed) {
        blocked = 1;
        prev = j;
        pp = &j->next;
        continue;
      }
    }
    *pp = j->next;
    if (s->q_tail == j)
      s->q_tail = prev;
    mc_gpu_job_t *riders = failed ? NULL : take_riders(s, j);
    pthread_mutex_unlock(&s->mu);
    if (failed) {
      finish(s, j, err.code, err.msg);
    } else {
      riders = carry_riders(j, riders);
      start_job(s, j);
      while (riders) { /* could not come along (out of memory) */
        mc_gpu_job_t *r = riders;
        riders = r->next;
        r->next = NULL;
        start_job(s, r);
      }
    }
    if (s->fl_head && now_ns() - s->polled_ns >= POLL_BETWEEN_NS)
      poll_inflight(s); /* completions keep pace with the launches */
    started++;
    pthread_mutex_lock(&s->mu);
    /* The queue may have changed meanwhile: rescan from the head. */
    pp = &s->q_head;
    prev = NULL;
    blocked = 0;
  }
  return started;
}

/* ---- direct launches ---- */

/* Finishes the direct job if its copies are done (by: 1 a waiter, 2 the
 * worker, which leaves it to waiters for direct_grace_ns).  1 if it did. */
static int reap_direct(mc_gpu_stager_t *s, int by) {
  if (by == 1 && !atomic_load_explicit(&s->wait_mark, memory_order_relaxed))
    atomic_store_explicit(&s->wait_mark, 1, memory_order_relaxed); /* once per wait */
  if (!atomic_load_explicit(&s->direct_job, memory_order_acquire))
    return 0;
  if (by == 1)
    atomic_store_explicit(&s->direct_waited, 1, memory_order_relaxed);
  else if (now_ns() - atomic_load(&s->direct_t) < s->direct_grace_ns)
    return 0;
  int z = 0;
  if (!atomic_compare_exchange_strong(&s->reaping, &z, 1))
    return 0; /* another thread is looking */
  /* Only a reaper clears direct_job, and none is launched until it is
   * clear: j stays valid while we hold `reaping`. */
  mc_gpu_job_t *j = atomic_load_explicit(&s->direct_job, memory_order_acquire);
  const mc_cuda_api_t *api = mc_cuda_api(NULL);
  mc_cu_result r = MC_CU_ERROR_NOT_READY;
  mc_cu_context saved;
  mc_err_t err = {0};
  int ch = j && api ? mc_cuda_enter_device(j->device, &saved, &err) : -1;
  if (j && ch < 0)
    r = MC_CU_ERROR_NOT_READY + 1; /* cannot ask: fail it (err says why) rather than hang */
  if (ch >= 0) {
    r = api->cuStreamQuery(s->dstreams[j->device]);
    mc_cuda_leave_device(saved, ch);
  }
  if (r == MC_CU_ERROR_NOT_READY || !j) {
    atomic_store(&s->reaping, 0);
    return 0;
  }
  atomic_store(&s->direct_job, NULL);
  atomic_store(&s->reaping, 0);
  atomic_store(&s->direct_claim, 0);
  char m[200] = "";
  if (r != 0 && ch < 0) {
    snprintf(m, sizeof m, "GPU copy: cannot check its completion: %s", err.msg);
  } else if (r != 0) {
    char b[160];
    snprintf(m, sizeof m, "GPU copy failed: %s", mc_cuda_strerror(api, r, b, sizeof b));
  }
  j->direct = by;
  /* Unwaited: if the caller has submitted again since (waited_run fell
   * back), it pipelines and waits_each_batch already keeps its jobs with
   * the worker; a sequential caller that follows must not lose DIRECT_SKIP
   * chances for it.  Else it waits too late for its batches: back off. */
  if (by == 2 && !atomic_load_explicit(&s->direct_waited, memory_order_relaxed) &&
      atomic_load_explicit(&s->waited_run, memory_order_relaxed) >= DIRECT_RUN)
    atomic_store(&s->direct_skip, DIRECT_SKIP);
  finish(s, j, r ? MC_ESYS : 0, r ? m : NULL);
  return 1;
}

int mc_gpu_stager_reap(mc_gpu_stager_t *s) { return s ? reap_direct(s, 1) : 0; }

/* Per eligible submit: 1 if the caller waits batch by batch (its last
 * DIRECT_RUN submits each came after a wait for GPU copies). */
static int waits_each_batch(mc_gpu_stager_t *s) {
  int w = atomic_load_explicit(&s->wait_mark, memory_order_relaxed);
  if (w)
    atomic_store_explicit(&s->wait_mark, 0, memory_order_relaxed);
  int r = atomic_load_explicit(&s->waited_run, memory_order_relaxed);
  int nr = w ? (r < DIRECT_RUN ? r + 1 : r) : 0;
  if (nr != r)
    atomic_store_explicit(&s->waited_run, nr, memory_order_relaxed);
  return nr >= DIRECT_RUN;
}

/* The submitting thread launches j itself when the worker has nothing
 * queued or in flight (so j overtakes nothing), no direct job is in
 * flight and the caller waits batch by batch (waits_each_batch, and
 * direct_skip): no hop to the worker.  1 if launched; 0: queue it (a failed
 * launch turns direct launches off, logged; the worker then launches j
 * and reports its error). */
static int try_direct(mc_gpu_stager_t *s, mc_gpu_job_t *j) {
  int dev = j->device;
  if (atomic_load_explicit(&s->direct_off, memory_order_relaxed) || !mergeable(s, j) ||
      !kernel_job(s, j) || j->n > MC_COPY_PARAM_REQS || dev < 0 || dev >= MC_GPU_MAX_DEV ||
      !waits_each_batch(s) || !atomic_load(&s->started) || atomic_load(&s->busy) != 0)
    return 0;
  if (atomic_load_explicit(&s->direct_skip, memory_order_relaxed) > 0) {
    atomic_fetch_sub(&s->direct_skip, 1);
    return 0;
  }
  int z = 0;
  if (!atomic_compare_exchange_strong(&s->direct_claim, &z, 1))
    return 0;
  const mc_cuda_api_t *api = mc_cuda_api(NULL);
  mc_err_t err = {0};
  mc_cu_context saved;
  int ok = 0, ch = atomic_load(&s->busy) == 0 && api && api->cuStreamQuery
                       ? mc_cuda_enter_device(dev, &saved, &err) : -1;
  if (ch >= 0) {
    if (s->trace)
      j->t_queued = j->t_picked = now_ns();
    if (!s->dstreams[dev]) {
      mc_cu_result r = api->cuStreamCreate(&s->dstreams[dev], MC_CU_STREAM_NON_BLOCKING);
      if (r != 0) {
        char m[160];
        mc_err_set(&err, MC_EUNAVAIL, "cannot create a CUDA stream on cuda:%d: %s", dev,
                   mc_cuda_strerror(api, r, m, sizeof m));
        s->dstreams[dev] = NULL;
      }
    }
    ok = s->dstreams[dev] &&
         mc_copy_kernel_launch(dev, j->dsts, j->srcs, j->sizes, j->n, NULL, s->dstreams[dev],
                               &err) == 0;
    mc_cuda_leave_device(saved, ch);
    if (!ok && !atomic_exchange(&s->direct_off, 1))
      mc_log_warn("GPU copies: launching from the submitting thread failed (%s); the copy "
                  "worker launches them from now on", err.msg);
  }
  if (!ok) {
    atomic_store(&s->direct_claim, 0);
    return 0;
  }
  uint64_t t = now_ns();
  if (s->trace)
    j->t_launched = t;
  j->next = NULL;
  atomic_fetch_add(&s->busy, 1);
  atomic_fetch_add_explicit(&s->ndirect, 1, memory_order_relaxed);
  atomic_store(&s->direct_t, t);
  atomic_store_explicit(&s->direct_waited, 0, memory_order_relaxed);
  atomic_store_explicit(&s->direct_job, j, memory_order_release);
  mc_gpu_stager_poke(s); /* a sleeping worker watches it too (after the grace) */
  return 1;
}

static void *worker_main(void *arg) {
  mc_gpu_stager_t *s = arg;
  pthread_setname_np(pthread_self(), "mc-gpu-copy");
  if (s->pin_cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(s->pin_cpu, &set);
    int e = pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    if (e)
      mc_log_warn("MC_GPU_WORKER_CPU=%d: cannot pin the GPU copy thread there (%s)", s->pin_cpu,
                  strerror(e));
  }
  int idle = 0;
  unsigned seen = atomic_load(&s->q_gen) - 1; /* scan first */
  uint64_t idle_since = 0;
  for (;;) {
    int started = 0, done = 0;
    DG_ADD(s, DG_LOOPS, 1);
    unsigned g = atomic_load(&s->q_gen);
    if (g != seen) {
      seen = g;
      pthread_mutex_lock(&s->mu);
      started = start_queued(s);
      int stop = s->stop && !s->q_head && !s->fl_head && !atomic_load(&s->direct_job);
      pthread_mutex_unlock(&s->mu);
      if (stop)
        break;
    }
    if (s->fl_head)
      done = poll_inflight(s);
    done += reap_direct(s, 2);
    int inflight = s->fl_head || atomic_load(&s->direct_job);
    if (done || started || atomic_exchange(&s->poked, 0)) {
      idle = 0;
      continue;
    }
    if (!idle) {
      idle = 1;
      idle_since = now_ns();
    }
    if (now_ns() - idle_since < (inflight ? 20000000ull : 1000000ull)) {
      /* Copies in flight (up to 20 ms) or just finished (1 ms: the next
       * batch often follows): poll closely, without mu, instead of
       * sleeping, since a wake-up costs tens of microseconds.  Then back
       * off. */
      if (s->poll_ns) {
        uint64_t until = now_ns() + s->poll_ns;
        while (atomic_load(&s->q_gen) == seen && !atomic_load(&s->poked) && now_ns() < until)
          mc_cpu_relax();
      } else {
        sched_yield();
      }
      continue;
    }
    pthread_mutex_lock(&s->mu);
    DG_ADD(s, DG_SLEEPS, 1);
    atomic_store(&s->sleeping, 1);
    if (atomic_load(&s->q_gen) == seen && !atomic_load(&s->poked)) {
      if (!s->fl_head && !atomic_load(&s->direct_job)) {
        pthread_cond_wait(&s->cv, &s->mu);
      } else {
        /* Copies in flight: look again shortly (or when new work comes). */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 20000;
        if (ts.tv_nsec >= 1000000000L) {
          ts.tv_sec++;
          ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&s->cv, &s->mu, &ts);
      }
    }
    atomic_store(&s->sleeping, 0);
    pthread_mutex_unlock(&s->mu);
  }
  return NULL;
}

void mc_gpu_stager_submit(mc_gpu_stager_t *s, mc_gpu_job_t *j) {
  j->next = NULL;
  atomic_fetch_add_explicit(&s->njobs, 1, memory_order_relaxed);
  if (s->diag)
    atomic_store_explicit(&s->submit_cpu, sched_getcpu(), memory_order_relaxed);
  if (try_direct(s, j))
    return;
  if (s->trace || s->diag)
    j->t_queued = now_ns();
  pthread_mutex_lock(&s->mu);
  if (!atomic_load(&s->started)) {
    if (pthread_create(&s->thread, NULL, worker_main, s) != 0) {
      pthread_mutex_unlock(&s->mu);
      mc_log_error("cannot start the GPU copy thread");
      if (j->complete)
        j->complete(j, MC_ESYS, "cannot start the GPU copy thread");
      else
        mc_gpu_job_free(j);
      return;
    }
    atomic_store(&s->started, 1);
  }
  atomic_fetch_add(&s->busy, 1);
  if (s->q_tail)
    s->q_tail->next = j;
  else
    s->q_head = j;
  s->q_tail = j;
  atomic_fetch_add(&s->q_gen, 1);
  int wake = atomic_load(&s->sleeping);
  if (wake)
    pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
}

void mc_gpu_stager_counts(mc_gpu_stager_t *s, uint64_t *jobs, uint64_t *direct) {
  *jobs = s ? atomic_load_explicit(&s->njobs, memory_order_relaxed) : 0;
  *direct = s ? atomic_load_explicit(&s->ndirect, memory_order_relaxed) : 0;
}

/* MC_GPU_DIAG=2, no copies in flight: the timeline restarts here (a
 * timing event recorded on the calling thread's current context's null
 * stream, waited for: its host time is the timeline's zero). */
static void timeline_reset(mc_gpu_stager_t *s) {
  const mc_cuda_api_t *api = mc_cuda_api(NULL);
  if (!api || !api->cuEventElapsedTime)
    return;
  if (!s->tl && !(s->tl = calloc(MC_GPU_TL_MAX, sizeof *s->tl)))
    return;
  if (!s->tl_base && api->cuEventCreate(&s->tl_base, 0) != 0)
    s->tl_base = NULL;
  if (s->tl_base && api->cuEventRecord(s->tl_base, NULL) == 0 &&
      api->cuEventSynchronize(s->tl_base) == 0) {
    s->tl_base_ns = now_ns();
    atomic_store(&s->ntl, 0);
  } else {
    s->tl_base_ns = 0;
    atomic_store(&s->ntl, MC_GPU_TL_MAX); /* nothing recorded */
  }
}

size_t mc_gpu_stager_timeline(mc_gpu_stager_t *s, mc_gpu_tl_t *out, size_t cap) {
  size_t n = s && s->tl && s->tl_base_ns ? atomic_load(&s->ntl) : 0;
  n = n < cap ? n : cap;
  if (n)
    memcpy(out, s->tl, n * sizeof *out);
  return n;
}

void mc_gpu_stager_diag(mc_gpu_stager_t *s, mc_gpu_diag_t *out, int reset) {
  uint64_t v[DG_N] = {0};
  for (int k = 0; s && k < DG_N; k++)
    v[k] = reset ? atomic_exchange_explicit(&s->dg[k], 0, memory_order_relaxed)
                 : atomic_load_explicit(&s->dg[k], memory_order_relaxed);
  *out = (mc_gpu_diag_t){.launches = v[DG_LAUNCHES], .copies = v[DG_COPIES],
                         .table_launches = v[DG_TABLE], .queue_ns = v[DG_QUEUE],
                         .launch_ns = v[DG_LAUNCH], .done_ns = v[DG_DONE],
                         .done_jobs = v[DG_DONE_JOBS], .loops = v[DG_LOOPS],
                         .queries = v[DG_QUERIES], .sleeps = v[DG_SLEEPS],
                         .cpu_moves = v[DG_CPU_MOVES], .same_cpu = v[DG_SAME_CPU],
                         .gpu_ns = v[DG_GPU], .gpu_jobs = v[DG_GPU_JOBS],
                         .query_ns = v[DG_QUERY_NS], .finish_ns = v[DG_FINISH_NS],
                         .polls = v[DG_POLLS],
                         .worker_cpu = s ? atomic_load(&s->last_cpu) : -1,
                         .submit_cpu = s ? atomic_load(&s->submit_cpu) : -1};
  if (s && reset && s->diag == 2)
    timeline_reset(s);
}

void mc_gpu_stager_poke(mc_gpu_stager_t *s) {
  if (!s || !atomic_load(&s->started))
    return;
  /* No lock unless the worker sleeps: it sets `sleeping` before it
   * checks `poked` under mu, so one of the two sees the other. */
  atomic_store(&s->poked, 1);
  if (atomic_load(&s->sleeping)) {
    pthread_mutex_lock(&s->mu);
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
  }
}

void mc_gpu_stager_drain(mc_gpu_stager_t *s) {
  if (!s)
    return;
  pthread_mutex_lock(&s->mu);
  while (atomic_load(&s->busy) > 0)
    pthread_cond_wait(&s->idle_cv, &s->mu);
  pthread_mutex_unlock(&s->mu);
}

void mc_gpu_stager_destroy(mc_gpu_stager_t *s) {
  if (!s)
    return;
  mc_gpu_stager_drain(s);
  pthread_mutex_lock(&s->mu);
  s->stop = 1;
  atomic_fetch_add(&s->q_gen, 1);
  pthread_cond_broadcast(&s->cv);
  int started = atomic_load(&s->started);
  pthread_mutex_unlock(&s->mu);
  if (started)
    pthread_join(s->thread, NULL);
  const mc_cuda_api_t *api = mc_cuda_api(NULL);
  while (s->free_list) {
    mc_gpu_buf_t *b = s->free_list;
    s->free_list = b->next;
    if (api)
      api->cuMemFreeHost(b->p);
    free(b);
  }
  for (int d = 0; d < MC_GPU_MAX_DEV; d++) {
    for (size_t i = 0; api && i < s->nevents[d]; i++)
      api->cuEventDestroy(s->events[d][i]);
    free(s->events[d]);
    for (int k = 0; k < MC_GPU_NSTREAMS; k++)
      if (s->streams[d][k] && api)
        api->cuStreamDestroy(s->streams[d][k]);
    if (s->dstreams[d] && api)
      api->cuStreamDestroy(s->dstreams[d]);
  }
  if (s->tl_base && api)
    api->cuEventDestroy(s->tl_base);
  free(s->tl);
  pthread_cond_destroy(&s->cv);
  pthread_cond_destroy(&s->idle_cv);
  pthread_mutex_destroy(&s->mu);
  free(s);
}
