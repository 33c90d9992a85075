/* The same-host CPU path's copies: process_vm_readv/writev over a list of
 * (local, remote) iovec pairs, split by bytes across a small pool of copy
 * threads when the list is large.  With 4 KiB pages the kernel pins and
 * copies the target's pages one by one, so one thread reaches 0.3-0.6x of
 * a memcpy; several threads (one list, disjoint byte ranges, at least
 * MC_CMA_SPLIT_KB = 128 KiB of work a thread, a pair counting 4 KiB on top
 * of its bytes) add up.
 *
 * The caller keeps whatever makes the remote ranges valid (the target's
 * region pin, cma_table.h) for the whole call: helpers touch nothing but
 * the iovecs they are handed.  Threads: MC_CMA_THREADS (1..16; default
 * min(online CPUs, 8)), started on the first large copy. */
#ifndef MC_TRANSPORT_CMA_CMA_COPY_H
#define MC_TRANSPORT_CMA_CMA_COPY_H

#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

typedef struct mc_cma_copier mc_cma_copier_t;

/* NULL on out of memory (copies then run on the caller alone). */
mc_cma_copier_t *mc_cma_copier_new(void);
void mc_cma_copier_free(mc_cma_copier_t *cp);

/* MC_CMA_THREADS's default on a host with ncpu online CPUs. */
int mc_cma_default_threads(long ncpu);

/* Threads a copy may use (the caller counts as one). */
int mc_cma_copier_threads(mc_cma_copier_t *cp);

/* Copies n pairs (l[i].iov_len == r[i].iov_len) to (write) or from process
 * pid; the arrays may be modified.  Returns 0, or the errno of the first
 * failed call (EFAULT also for a call that copied nothing). */
int mc_cma_copy(mc_cma_copier_t *cp, pid_t pid, int write, struct iovec *l, struct iovec *r,
                int n, uint64_t bytes);

#endif
