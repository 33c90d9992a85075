/* GPU copy engine of the connector: a pool of pinned host staging buffers
 * and one copy worker thread that runs device<->host (and device<->device)
 * copies on CUDA streams and reports when they are done.
 *
 * Used by the TCP transport for cuda regions (data is staged through pinned
 * host memory: D2H before sendmsg, readv then H2D on receive) and by the
 * engine for local GPU buffers and the same-host IPC path.  Nothing here
 * blocks the thread that submits a job: I/O threads only queue work, the
 * worker enqueues the copies (one cuMemcpyBatchAsync per job where the
 * driver has it), records an event and polls it, then calls the job's
 * complete() on the worker thread.  Copies of one direction run in order on
 * one stream per device, so a job's copies overlap the network I/O of the
 * jobs before and after it.
 */
#ifndef MC_GPU_GPU_STAGING_H
#define MC_GPU_GPU_STAGING_H

#include <stddef.h>
#include <stdint.h>

#include "gpu/cuda_driver.h"
#include "util/errors.h"

typedef struct mc_gpu_stager mc_gpu_stager_t;
typedef struct mc_gpu_job mc_gpu_job_t;

typedef struct mc_gpu_buf {
  struct mc_gpu_buf *next; /* pool-private */
  void *p;                 /* pinned host memory */
  size_t size;
} mc_gpu_buf_t;

enum { MC_GPU_H2D = 0, MC_GPU_D2H = 1, MC_GPU_D2D = 2 };

struct mc_gpu_job {
  int device; /* whose stream (and context) runs the copies */
  int dir;    /* MC_GPU_H2D / D2H / D2D */
  /* Optional: the worker first takes a staging buffer of want_buf bytes
   * (waiting for room in the pool's budget), stores it in buf and calls
   * prepare(), which adds the copies (and may submit network work). */
  uint64_t want_buf;
  mc_gpu_buf_t *buf;
  int (*prepare)(mc_gpu_job_t *job, mc_err_t *err);
  /* Copies, added with mc_gpu_job_add. */
  mc_cu_ptr *dsts, *srcs;
  size_t *sizes;
  size_t n, cap;
  /* Called once on the worker thread after the copies finished (code 0) or
   * failed; it owns the job from then on (mc_gpu_job_free). */
  void (*complete)(mc_gpu_job_t *job, int code, const char *msg);
  void *arg, *arg2, *arg3;
  /* Worker-private. */
  mc_gpu_job_t *next;
  void *event;
  int ev_dev, ev_stream;
  int synced; /* no event and none needed: done when started */
  mc_gpu_buf_t *kbuf; /* copy kernel's piece table */
  void *tev[2]; /* MC_GPU_DIAG: timing events around the copy kernel */
  mc_gpu_job_t *riders; /* jobs whose copies this one's launch carries (they finish with it) */
  int inline_arrays; /* dsts/srcs/sizes live in the job's own allocation (mc_gpu_job_new_inline) */
  int direct; /* launched by the submitting thread; then finished by 1 a waiter, 2 the worker */
  uint64_t t_queued, t_picked, t_launched; /* MC_GPU_TRACE=1 only */
};

/* Creates a stager whose pool keeps at most budget_bytes of pinned memory
 * for jobs that wait for room (want_buf); the worker starts on first use. */
int mc_gpu_stager_create(size_t budget_bytes, mc_gpu_stager_t **out, mc_err_t *err);
/* Waits for every job to finish, stops the worker, frees the pool. */
void mc_gpu_stager_destroy(mc_gpu_stager_t *s);
/* Waits until no job is queued or in flight. */
void mc_gpu_stager_drain(mc_gpu_stager_t *s);

/* Pre-allocates `bytes` of staging buffers (blocking; call off I/O threads). */
int mc_gpu_stager_reserve(mc_gpu_stager_t *s, int device, size_t bytes, mc_err_t *err);

/* Takes a pinned buffer of >= n bytes without waiting: reuses a free one,
 * else allocates (over the budget if need be). NULL with err on failure. */
mc_gpu_buf_t *mc_gpu_buf_get(mc_gpu_stager_t *s, int device, size_t n, mc_err_t *err);
/* Returns a buffer to the pool.  Any thread; never calls CUDA. */
void mc_gpu_buf_put(mc_gpu_stager_t *s, mc_gpu_buf_t *b);

mc_gpu_job_t *mc_gpu_job_new(int device, int dir);
/* A job with room for `cap` copies and `extra` bytes for the caller (*extra,
 * 16-byte aligned, zeroed, freed with the job) in one allocation: one
 * malloc per job instead of four.  Adding more than cap copies moves the
 * arrays out as mc_gpu_job_reserve does; mc_gpu_job_free frees it all. */
mc_gpu_job_t *mc_gpu_job_new_inline(int device, int dir, size_t cap, size_t extra,
                                    void **extra_out);
/* The same in memory the caller has: mc_gpu_job_inline_bytes(cap, extra)
 * of it, from malloc (mc_gpu_job_free frees it), e.g. a block kept for
 * reuse. */
size_t mc_gpu_job_inline_bytes(size_t cap, size_t extra);
mc_gpu_job_t *mc_gpu_job_init_inline(void *mem, int device, int dir, size_t cap, size_t extra,
                                     void **extra_out);
/* Room for n copies (fewer reallocations while adding). */
int mc_gpu_job_reserve(mc_gpu_job_t *j, size_t n);
/* Adds a copy (inline: a batch adds one per request). */
static inline int mc_gpu_job_add(mc_gpu_job_t *j, mc_cu_ptr dst, mc_cu_ptr src, size_t n) {
  if (j->n == j->cap && mc_gpu_job_reserve(j, j->cap ? j->cap * 2 : 16) < 0)
    return MC_ENOMEM;
  size_t k = j->n;
  /* Adjacent pieces merge into one copy. */
  if (k && j->dsts[k - 1] + j->sizes[k - 1] == dst && j->srcs[k - 1] + j->sizes[k - 1] == src) {
    j->sizes[k - 1] += n;
    return 0;
  }
  j->dsts[k] = dst;
  j->srcs[k] = src;
  j->sizes[k] = n;
  j->n = k + 1;
  return 0;
}
void mc_gpu_job_free(mc_gpu_job_t *j); /* does not return buf */

/* How device-to-device jobs copy (MC_GPU_D2D_COPY), for logs. */
const char *mc_gpu_d2d_copy_name(void);

/* Queues a job.  Never blocks on the GPU. */
void mc_gpu_stager_submit(mc_gpu_stager_t *s, mc_gpu_job_t *j);
/* For a thread waiting for GPU copies: finishes the job a submitting thread
 * launched itself (MC_GPU_DIRECT) if its copies are done, here, so the
 * completion needs no other thread.  Any thread; cheap when there is none.
 * A call also says that the caller waits for its copies: the stager
 * launches directly only for a caller whose last submits each came after
 * such a wait.  1 if it finished one. */
int mc_gpu_stager_reap(mc_gpu_stager_t *s);
/* Jobs submitted so far, and how many of them the submitting thread
 * launched itself (MC_GPU_DIRECT). */
void mc_gpu_stager_counts(mc_gpu_stager_t *s, uint64_t *jobs, uint64_t *direct);
/* MC_GPU_DIAG=1: what the copy worker did (benchmarks' diagnostics; zero
 * otherwise).  Times are sums over the jobs (queue: submit to the worker's
 * pick-up; launch: the worker's enqueue calls; done: launch to completion
 * seen). */
typedef struct {
  uint64_t launches, copies, table_launches, queue_ns, launch_ns, done_ns, done_jobs, loops,
      queries, sleeps, cpu_moves, same_cpu;
  /* The copy kernels' own time on the GPU (CUDA events around each launch,
   * where the driver has cuEventElapsedTime): sum and how many. */
  uint64_t gpu_ns, gpu_jobs;
  /* The worker's completion side: time inside its completion queries,
   * time finishing completed launches (riders and callbacks included),
   * passes over the launches in flight. */
  uint64_t query_ns, finish_ns, polls;
  int worker_cpu, submit_cpu;
} mc_gpu_diag_t;
/* Reads the counters (and zeroes them when reset; with MC_GPU_DIAG=2 a
 * reset, made with no copies in flight from a thread whose current context
 * is the copies' device's, also restarts the launch timeline). */
void mc_gpu_stager_diag(mc_gpu_stager_t *s, mc_gpu_diag_t *out, int reset);
/* MC_GPU_DIAG=2: one timed copy-kernel launch, times from the timeline's
 * restart: the worker picked the job up and had launched it (host clock),
 * its kernel's start and end events passed on the GPU, and the worker saw
 * it done (host clock). */
typedef struct {
  double picked_us, launched_us, gpu_start_us, gpu_end_us, done_us;
  uint32_t copies;
  uint8_t stream, table; /* the stream's index; the copies read from a pinned table */
} mc_gpu_tl_t;
/* Copies up to cap launches of the timeline (completion order) into out;
 * how many. */
size_t mc_gpu_stager_timeline(mc_gpu_stager_t *s, mc_gpu_tl_t *out, size_t cap);
/* A batch with GPU copies is being planned: a copy thread that went to
 * sleep polls again for a while, so the first job finds it awake (a
 * sleeping thread's wake-up costs tens of microseconds).  No-op before the
 * first job. */
void mc_gpu_stager_poke(mc_gpu_stager_t *s);

#endif
