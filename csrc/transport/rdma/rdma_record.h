/* Connection records exchanged out of band over the engine's TCP control
 * connection (an RPC; docs/rdma.md "Handshake").  JSON text, versioned.
 *
 *   connect  initiator -> target: its NICs and one entry per QP it created
 *   accept   target -> initiator: its NICs, the QPs it created and connected
 *            (same order as the request), and its memory regions with one
 *            rkey per NIC
 *   regions  initiator -> target: "send me your regions again"; answered
 *            with an accept that carries only regions
 *
 * Pure encoding/decoding; unit-tested on hosts without RDMA. */
#ifndef MC_TRANSPORT_RDMA_RECORD_H
#define MC_TRANSPORT_RDMA_RECORD_H

#include <stddef.h>
#include <stdint.h>

#include "util/errors.h"

#define MC_RDMA_MAX_NICS 8
#define MC_RDMA_MAX_QPS 64
#define MC_RDMA_RECORD_VERSION 1

enum { MC_RDMA_REC_CONNECT = 1, MC_RDMA_REC_ACCEPT = 2, MC_RDMA_REC_REGIONS = 3 };

typedef struct mc_rdma_nic_info {
  char name[64];
  uint16_t lid;
  uint8_t gid[16];
  uint32_t mtu; /* active MTU in bytes */
  int ethernet; /* RoCE (GRH addressing) rather than InfiniBand (LID) */
} mc_rdma_nic_info_t;

typedef struct mc_rdma_qp_info {
  uint32_t nic; /* index into the sender's nics[] */
  uint32_t qpn;
  uint32_t psn;
} mc_rdma_qp_info_t;

typedef struct mc_rdma_region_info {
  uint64_t addr, len;
  uint32_t rkey[MC_RDMA_MAX_NICS]; /* per NIC of the sender, same order */
} mc_rdma_region_info_t;

typedef struct mc_rdma_record {
  int kind;
  char from[320], to[320]; /* segment names */
  uint64_t epoch;          /* initiator's endpoint generation */
  uint32_t nnics;
  mc_rdma_nic_info_t nics[MC_RDMA_MAX_NICS];
  uint32_t nqps;
  mc_rdma_qp_info_t qps[MC_RDMA_MAX_QPS];
  size_t nregions;
  mc_rdma_region_info_t *regions; /* malloc'ed */
} mc_rdma_record_t;

/* malloc'ed JSON, NULL when out of memory. */
char *mc_rdma_record_encode(const mc_rdma_record_t *r);
/* MC_EPROTO naming the field that is missing or out of range. */
int mc_rdma_record_decode(const char *txt, size_t len, mc_rdma_record_t *out, mc_err_t *err);
void mc_rdma_record_free(mc_rdma_record_t *r);

#endif
