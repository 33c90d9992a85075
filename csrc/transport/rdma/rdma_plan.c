#include "transport/rdma/rdma_plan.h"

size_t mc_rdma_plan_count(const uint64_t *lens, size_t n, uint64_t slice) {
  size_t k = 0;
  for (size_t i = 0; i < n; i++)
    k += (size_t)((lens[i] + slice - 1) / slice);
  return k;
}

void mc_rdma_plan(const uint64_t *lens, const int *pref, size_t n, uint64_t slice,
                  const uint32_t *qp_nic, uint32_t nqp, uint32_t *rr, mc_rdma_slice_t *out) {
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    int want = pref ? pref[i] : -1;
    /* Is any QP on the preferred NIC?  Otherwise stripe over all. */
    int have = 0;
    for (uint32_t q = 0; want >= 0 && q < nqp && !have; q++)
      have = (int)qp_nic[q] == want;
    if (!have)
      want = -1;
    for (uint64_t off = 0; off < lens[i]; off += slice) {
      uint32_t q = *rr % nqp;
      if (want >= 0)
        while ((int)qp_nic[q] != want)
          q = (q + 1) % nqp;
      *rr = q + 1;
      uint64_t len = lens[i] - off < slice ? lens[i] - off : slice;
      out[k++] = (mc_rdma_slice_t){.ent = (uint32_t)i, .off = off, .len = (uint32_t)len, .qp = q};
    }
  }
}
