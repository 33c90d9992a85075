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
 * (or the stand-in). */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "engine/engine.h"
#include "engine/engine_internal.h"
#include "gpu/cuda_driver.h"
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

/* The target: registers its memory, tells the parent where, and lives
 * until the parent closes its pipe. */
static void target(int wfd, int rfd) {
  target_t t;
  memset(&t, 0, sizeof t);
  mc_engine_t *B = NULL;
  mc_err_t err = {0};
  if (have_gpu() && engine_new(&B, &err) == 0 && (t.addr = dalloc((size_t)NBLK * BLK)) &&
      mc_engine_register(B, (void *)(uintptr_t)t.addr, (size_t)NBLK * BLK, "cuda:0", &err) == 0) {
    snprintf(t.segment, sizeof t.segment, "%s", mc_engine_segment_name(B));
    t.ok = 1;
  }
  (void)!write(wfd, &t, sizeof t);
  char c;
  while (read(rfd, &c, 1) == 1)
    ;
  if (B)
    mc_engine_destroy(B);
  _exit(0);
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

static void test_two_processes_take_ipc(void) {
  int down[2], up[2];
  CHECK(pipe(down) == 0 && pipe(up) == 0);
  pid_t pid = fork(); /* before CUDA starts here */
  CHECK(pid >= 0);
  if (pid == 0) {
    close(down[1]);
    close(up[0]);
    target(up[1], down[0]);
  }
  close(down[0]);
  close(up[1]);
  target_t t;
  int got = (int)read(up[0], &t, sizeof t);
  mc_engine_t *A = NULL;
  mc_err_t err = {0};
  uint64_t src = 0, back = 0;
  size_t n = (size_t)NBLK * BLK;
  uint8_t *want = malloc(n), *have = malloc(n);
  int skip = got != (int)sizeof t || !t.ok || !have_gpu();
  int rc = skip ? 0 : engine_new(&A, &err);
  if (!skip && rc == 0) {
    src = dalloc(n);
    back = dalloc(n);
    fill(want, n, 30);
    rc = !src || !back || !want || !have || api->cuMemcpyHtoD(src, want, n) != 0 ||
         mc_engine_register(A, (void *)(uintptr_t)src, n, "cuda:0", &err) != 0 ||
         mc_engine_register(A, (void *)(uintptr_t)back, n, "cuda:0", &err) != 0;
  }
  if (!skip && rc == 0 && (rc = write_concurrently(A, t.segment, src, t.addr, &err)) == 0)
    rc = batch(A, t.segment, MC_OP_READ, back, t.addr, 0, NBLK, &err);
  mc_engine_stats_t st = {0};
  if (A)
    mc_engine_get_stats(A, &st);
  int (*opens)(void) = NULL;
  void *h = skip ? NULL : dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (h)
    *(void **)&opens = dlsym(h, "fakecuda_ipc_opens");
  int same = !skip && rc == 0 && api->cuMemcpyDtoH(have, back, n) == 0 && !memcmp(have, want, n);
  close(down[1]);
  int status = 0;
  waitpid(pid, &status, 0);
  close(up[0]);
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

int main(void) {
  RUN(test_two_processes_take_ipc);
  TEST_MAIN_END();
}
