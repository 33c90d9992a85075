/* Private state of the RDMA transport (rdma_*.c). */
#ifndef MC_TRANSPORT_RDMA_INTERNAL_H
#define MC_TRANSPORT_RDMA_INTERNAL_H

#include <infiniband/verbs.h>
#include <pthread.h>
#include <stdatomic.h>

#include "transport/rdma/rdma.h"
#include "transport/rdma/rdma_record.h"
#include "transport/rdma/verbs_api.h"

typedef struct mc_rdma_nic {
  int idx;
  char name[64];
  struct ibv_context *ctx;
  struct ibv_pd *pd;
  struct ibv_comp_channel *ch;
  struct ibv_cq *cq;
  uint8_t port;
  int gid_index;
  char gid_why[64];
  mc_rdma_nic_info_t info; /* what peers need: lid, gid, mtu, link layer */
  int max_rd_atomic;
  int numa_node; /* sysfs; -1 unknown */
  atomic_int down; /* the port reported PORT_ERR (async event) and not yet ACTIVE */
} mc_rdma_nic_t;

/* One registered region: an MR on every NIC (the MR cache). */
typedef struct mc_rdma_mr {
  uint64_t addr, len;
  uint64_t region; /* the registered range's start (several MRs: one per GPU chunk) */
  struct ibv_mr *mr[MC_RDMA_MAX_NICS];
  int pref_nic; /* NIC on the memory's NUMA node / PCIe switch, or -1 */
} mc_rdma_mr_t;

typedef struct mc_rdma_req mc_rdma_req_t;
typedef struct mc_rdma_qp mc_rdma_qp_t;

/* One work request (one slice). */
typedef struct mc_rdma_wr {
  mc_rdma_req_t *req;
  mc_rdma_qp_t *qp;
  struct mc_rdma_wr *prev, *next; /* pending FIFO, then posted list */
  uint64_t local, remote;
  uint32_t len, lkey, rkey;
} mc_rdma_wr_t;

/* One engine op in flight. */
struct mc_rdma_req {
  mc_xfer_op_t *op;
  struct mc_rdma_ep *ep;
  pthread_mutex_t mu;
  size_t left; /* WRs not finished */
  int code;
  char msg[MC_ERR_MSG_MAX];
  mc_rdma_wr_t *wrs;
  size_t nwrs;
  struct ibv_mr **tmp_mrs; /* for local buffers outside registered regions */
  size_t ntmp;
};

enum { QP_IDLE = 0, QP_UP, QP_BROKEN };

struct mc_rdma_qp {
  struct mc_rdma_ep *ep;
  mc_rdma_nic_t *nic;
  struct ibv_qp *qp;
  uint32_t psn;
  pthread_mutex_t mu;
  int state;
  int fail_code;
  char fail_msg[MC_ERR_MSG_MAX];
  mc_rdma_wr_t *pend_head, *pend_tail; /* not posted yet */
  mc_rdma_wr_t *post_head, *post_tail; /* posted, not completed */
  int outstanding;
  uint64_t inflight_bytes; /* posted, not completed (capped: opts.qp_inflight_bytes) */
  struct ibv_send_wr *wrbuf; /* max_wr, for chaining */
  struct ibv_sge *sgebuf;
  uint32_t remote_qpn;
  uint32_t remote_nic_idx; /* index into the peer's NICs (rkey column) */
  char remote_nic[64];
};

enum { EP_CONNECTING = 0, EP_UP, EP_BROKEN, EP_FAILED };

typedef struct mc_rdma_ep {
  struct mc_rdma_ep *next;
  mc_rdma_t *t;
  char segment[320];
  uint64_t epoch;
  int initiator;
  int state;       /* under t->mu */
  int refs;        /* under t->mu: the list + each request in flight + users */
  int listed;      /* in t->eps / t->accepted */
  char fail_msg[MC_ERR_MSG_MAX]; /* EP_FAILED: why the connect failed */
  int fail_code;
  uint32_t nqp;
  mc_rdma_qp_t qps[MC_RDMA_MAX_QPS];
  uint32_t qp_nic[MC_RDMA_MAX_QPS];
  pthread_mutex_t mu; /* regions, rr */
  mc_rdma_region_info_t *regions;
  size_t nregions;
  uint32_t remote_nnics;
  uint32_t rr;
} mc_rdma_ep_t;

struct mc_rdma {
  const mc_verbs_t *v;
  mc_rdma_opts_t o;
  mc_rdma_hooks_t hooks;
  int nnic;
  mc_rdma_nic_t nics[MC_RDMA_MAX_NICS];

  pthread_mutex_t mu; /* eps, accepted, states, refs */
  pthread_cond_t cv;  /* an endpoint left EP_CONNECTING */
  mc_rdma_ep_t *eps;      /* ours (initiator), by segment */
  mc_rdma_ep_t *accepted; /* peers' (target side) */
  uint64_t next_epoch;

  pthread_rwlock_t mr_lock;
  mc_rdma_mr_t *mrs; /* sorted by addr */
  size_t nmr, cap_mr;

  pthread_t cq_thread;
  int cq_running;
  int epfd, efd;
  atomic_int stop;
  atomic_long inflight; /* WRs posted and not completed */
};

/* rdma_qp.c: QP state transitions. */
int mc_rdma_qp_create(mc_rdma_t *t, mc_rdma_qp_t *q, mc_rdma_nic_t *nic, mc_err_t *err);
int mc_rdma_qp_connect(mc_rdma_t *t, mc_rdma_qp_t *q, const mc_rdma_nic_info_t *rnic,
                       const mc_rdma_qp_info_t *rqp, mc_err_t *err);
void mc_rdma_qp_set_error(mc_rdma_t *t, mc_rdma_qp_t *q);
void mc_rdma_qp_destroy(mc_rdma_t *t, mc_rdma_qp_t *q);

/* rdma_ep.c: endpoints. */
mc_rdma_ep_t *mc_rdma_ep_get(mc_rdma_t *t, const char *segment, mc_err_t *err);
void mc_rdma_ep_put(mc_rdma_t *t, mc_rdma_ep_t *ep);
/* Every live endpoint, each with a reference taken (give each back with
 * mc_rdma_ep_put, then free the array); NULL with *n 0 when there are none
 * or no memory. */
mc_rdma_ep_t **mc_rdma_eps_hold(mc_rdma_t *t, size_t *n);
/* Marks the endpoint broken (replaced on the next transfer) and, with
 * flush, moves its QPs to the error state so posted WRs complete now. */
void mc_rdma_ep_break(mc_rdma_t *t, mc_rdma_ep_t *ep, int code, const char *msg, int flush);
/* Only marks it broken: replaced on the next transfer, QPs left alone. */
void mc_rdma_ep_mark_broken(mc_rdma_t *t, mc_rdma_ep_t *ep);
int mc_rdma_ep_refresh_regions(mc_rdma_t *t, mc_rdma_ep_t *ep, mc_err_t *err);
void mc_rdma_ep_free_all(mc_rdma_t *t);
/* The port of `nic` went down: flush every QP on it now (their requests
 * fail with msg) and mark their endpoints for reconnection. */
void mc_rdma_nic_down(mc_rdma_t *t, mc_rdma_nic_t *nic, const char *msg);

/* rdma_mr.c: the MR cache.  lookup: the region containing [addr,len), with
 * mr_lock read-held by the caller. */
const mc_rdma_mr_t *mc_rdma_mr_find(mc_rdma_t *t, uint64_t addr, uint64_t len);
void mc_rdma_mr_free_all(mc_rdma_t *t);
/* Fills regions with (addr, len, rkey per NIC) of every MR (malloc'ed). */
int mc_rdma_mr_export(mc_rdma_t *t, mc_rdma_region_info_t **out, size_t *n);

/* rdma_post.c: posting and completing work requests. */
void mc_rdma_post_some(mc_rdma_t *t, mc_rdma_qp_t *q);
void mc_rdma_wr_complete(mc_rdma_t *t, mc_rdma_wr_t *w, int code, const char *msg);
/* One work completion (completion thread). */
void mc_rdma_wc(mc_rdma_t *t, const struct ibv_wc *wc);

/* rdma_cq.c: the completion thread. */
int mc_rdma_cq_start(mc_rdma_t *t, mc_err_t *err);
void mc_rdma_cq_stop(mc_rdma_t *t);
/* Polls every CQ once (also used while draining at stop). */
int mc_rdma_cq_poll_all(mc_rdma_t *t);

#endif
