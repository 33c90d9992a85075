/* Kernel-side scaling of process_vm_writev/readv with several threads, no
 * engine in the way: where do N copy threads stop helping?
 *
 *   build/bench/cma_contention [MiB] [hugepages 0|1]
 *
 * A child process holds a pre-faulted target buffer; the parent's threads
 * copy --MiB between a local buffer and it in 128 KiB pieces (two 64 KiB
 * pairs, like the same-host CPU path's merged 4 KiB blocks), free-running,
 * no synchronisation between pieces.  Layouts:
 *   interleaved  thread t takes pieces t, t+T, t+2T, ...: all threads work
 *                inside the same 2 MiB of the target at once (one op of
 *                adjacent blocks split across threads)
 *   spread       thread t takes its own contiguous 1/T of the buffer: the
 *                threads work in different 2 MiB regions (page-table pages)
 * Prints GB/s per (direction, layout, threads, pass); pass 1 is the first
 * copy into the target's pages, pass 2 a repeat. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define PIECE (128u << 10)
#define PAIR (64u << 10)

static pid_t child;
static char *local, *remote;
static size_t total;
static int nthreads, writing, spread;

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void *worker(void *arg) {
  long t = (long)arg;
  size_t pieces = total / PIECE;
  size_t per = pieces / (size_t)nthreads;
  for (size_t j = 0; j < per; j++) {
    size_t p = spread ? (size_t)t * per + j : j * (size_t)nthreads + (size_t)t;
    size_t off = p * PIECE;
    struct iovec l[2] = {{local + off, PAIR}, {local + off + PAIR, PAIR}};
    struct iovec r[2] = {{remote + off, PAIR}, {remote + off + PAIR, PAIR}};
    ssize_t got = writing ? process_vm_writev(child, l, 2, r, 2, 0)
                          : process_vm_readv(child, l, 2, r, 2, 0);
    if (got != (ssize_t)PIECE) {
      perror("process_vm");
      exit(1);
    }
  }
  return NULL;
}

static char *map(size_t n, int huge) {
  char *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    perror("mmap");
    exit(1);
  }
  madvise(p, n, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  memset(p, 1, n);
  return p;
}

int main(int argc, char **argv) {
  total = (size_t)(argc > 1 ? atol(argv[1]) : 1024) << 20;
  int huge = argc > 2 ? atoi(argv[2]) : 0;
  int pfd[2];
  if (pipe(pfd) < 0)
    return 1;
  child = fork();
  if (child == 0) {
    char *r = map(total, huge);
    if (write(pfd[1], &r, sizeof r) != sizeof r)
      _exit(1);
    pause();
    _exit(0);
  }
  if (read(pfd[0], &remote, sizeof remote) != sizeof remote)
    return 1;
  local = map(total, huge);
  printf("# %zu MiB, %s pages, %ld CPUs\n", total >> 20, huge ? "huge" : "4 KiB",
         sysconf(_SC_NPROCESSORS_ONLN));
  int counts[] = {1, 2, 4, 8};
  for (writing = 1; writing >= 0; writing--)
    for (spread = 0; spread <= 1; spread++)
      for (size_t c = 0; c < sizeof counts / sizeof *counts; c++) {
        nthreads = counts[c];
        if (nthreads == 1 && spread)
          continue;
        for (int pass = 1; pass <= 2; pass++) {
          pthread_t th[8];
          double t0 = now();
          for (long t = 0; t < nthreads; t++)
            pthread_create(&th[t], NULL, worker, (void *)t);
          for (int t = 0; t < nthreads; t++)
            pthread_join(th[t], NULL);
          double dt = now() - t0;
          printf("%-5s %-11s threads %d pass %d  %6.2f GB/s\n", writing ? "write" : "read",
                 nthreads == 1 ? "one" : spread ? "spread" : "interleaved", nthreads, pass,
                 (double)total / dt / 1e9);
          fflush(stdout);
        }
      }
  kill(child, SIGKILL);
  waitpid(child, NULL, 0);
  return 0;
}
