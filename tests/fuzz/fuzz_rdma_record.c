/* RDMA connection records (the RPC body a peer sends during RDMA connection
 * setup): decode arbitrary bytes; what decodes must re-encode and decode to
 * the same record. */
#include "fuzz_common.h"

#include "transport/rdma/rdma_record.h"

FUZZ_INIT_QUIET()

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  mc_rdma_record_t r;
  mc_err_t err = {0};
  if (mc_rdma_record_decode((const char *)data, size, &r, &err) < 0) {
    if (!err.msg[0])
      abort();
    return 0;
  }
  if (r.nnics > MC_RDMA_MAX_NICS || r.nqps > MC_RDMA_MAX_QPS)
    abort();
  char *txt = mc_rdma_record_encode(&r);
  if (txt) {
    mc_rdma_record_t r2;
    if (mc_rdma_record_decode(txt, strlen(txt), &r2, &err) < 0) {
      fprintf(stderr, "re-encoded record does not decode: %s\n%s\n", err.msg, txt);
      abort();
    }
    if (r2.kind != r.kind || r2.nnics != r.nnics || r2.nqps != r.nqps ||
        r2.nregions != r.nregions || r2.epoch != r.epoch)
      abort();
    mc_rdma_record_free(&r2);
    free(txt);
  }
  mc_rdma_record_free(&r);
  return 0;
}
