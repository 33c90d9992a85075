/* Slicing and striping plans (pure logic; unit-tested on hosts without
 * RDMA).  Each transfer entry is cut into slices of at most `slice` bytes
 * (one work request each); slices go round-robin over the peer's QPs,
 * which are ordered so that consecutive QPs sit on different NICs (QP i
 * is on local NIC qp_nic[i]).  An entry whose memory has a preferred NIC
 * (same NUMA node / PCIe switch) is striped over that NIC's QPs only. */
#ifndef MC_TRANSPORT_RDMA_PLAN_H
#define MC_TRANSPORT_RDMA_PLAN_H

#include <stddef.h>
#include <stdint.h>

typedef struct mc_rdma_slice {
  uint32_t ent; /* entry index */
  uint64_t off; /* offset inside the entry */
  uint32_t len;
  uint32_t qp; /* QP index */
} mc_rdma_slice_t;

/* Slices needed for n entries. */
size_t mc_rdma_plan_count(const uint64_t *lens, size_t n, uint64_t slice);

/* Fills out[mc_rdma_plan_count()].  pref[i]: preferred local NIC of entry
 * i or -1 (pref may be NULL).  *rr carries the round-robin position across
 * calls so that small entries still spread over all QPs. */
void mc_rdma_plan(const uint64_t *lens, const int *pref, size_t n, uint64_t slice,
                  const uint32_t *qp_nic, uint32_t nqp, uint32_t *rr, mc_rdma_slice_t *out);

/* QP order for nnic NICs with per_nic QPs each: QP i is on NIC i % nnic. */
static inline uint32_t mc_rdma_qp_nic(uint32_t qp, uint32_t nnic) { return qp % nnic; }

#endif
