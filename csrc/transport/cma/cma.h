/* The same-host CPU transport: host memory moves between two engines on
 * one host with process_vm_readv/writev (cross-memory attach), one kernel
 * copy, no socket on the data path.  The target's region table lives in
 * shared memory the target owns (cma_table.h): the initiator pins the
 * target's region there before every copy, so the target's check stays
 * authoritative and an unregister waits for copies in flight.
 *
 * Chosen at first contact (reaches(): RPC "mc.shm.hello" over the TCP
 * control channel, namespace/uid/boot checks, a real probe read); anything
 * that rules it out is one sentence the engine logs once per peer.  Off
 * with MC_SAME_HOST_CPU=0.  docs/architecture.md, "Same-host CPU path". */
#ifndef MC_TRANSPORT_CMA_CMA_H
#define MC_TRANSPORT_CMA_CMA_H

#include <stdint.h>

#include "transport/transport.h"

extern const mc_transport_ops_t mc_cma_transport_ops;

typedef struct mc_cma_stats {
  uint64_t bytes_written; /* WRITE bytes this engine copied into peers */
  uint64_t bytes_read;    /* READ bytes this engine copied from peers */
  uint64_t ops;           /* ops finished through this path */
  uint64_t peers;         /* peers reached through this path */
  uint64_t refused_unbound; /* peers refused: hello not bound to the connection */
  uint64_t entries;       /* peers with an entry now (dropped when lost) */
} mc_cma_stats_t;

/* impl as returned by ops->start (NULL: all zero). */
void mc_cma_get_stats(void *impl, mc_cma_stats_t *out);
/* 1 unless MC_SAME_HOST_CPU=0. */
int mc_cma_enabled(void);

#endif
