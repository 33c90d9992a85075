/* RC queue pairs: creation, RESET -> INIT -> RTR -> RTS with the peer's
 * connection record, moving to ERROR (flush), destruction. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "transport/rdma/rdma_internal.h"

static enum ibv_mtu mtu_enum(uint32_t bytes) {
  return bytes >= 4096 ? IBV_MTU_4096
         : bytes >= 2048 ? IBV_MTU_2048
         : bytes >= 1024 ? IBV_MTU_1024
         : bytes >= 512  ? IBV_MTU_512
                         : IBV_MTU_256;
}

int mc_rdma_qp_create(mc_rdma_t *t, mc_rdma_qp_t *q, mc_rdma_nic_t *nic, mc_err_t *err) {
  q->nic = nic;
  pthread_mutex_init(&q->mu, NULL);
  q->wrbuf = calloc((size_t)t->o.max_wr, sizeof *q->wrbuf);
  q->sgebuf = calloc((size_t)t->o.max_wr, sizeof *q->sgebuf);
  if (!q->wrbuf || !q->sgebuf)
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  struct ibv_qp_init_attr ia = {
      .send_cq = nic->cq,
      .recv_cq = nic->cq,
      .cap = {.max_send_wr = (uint32_t)t->o.max_wr, .max_recv_wr = 1, .max_send_sge = 1,
              .max_recv_sge = 1},
      .qp_type = IBV_QPT_RC,
      .sq_sig_all = 0,
  };
  q->qp = t->v->create_qp(nic->pd, &ia);
  if (!q->qp)
    return mc_err_sys(err, MC_ESYS, errno, "ibv_create_qp on %s (send queue %d) failed",
                      nic->name, t->o.max_wr);
  q->psn = (uint32_t)(random() & 0xffffff);
  struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = nic->port,
                          .qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                             IBV_ACCESS_REMOTE_READ};
  int rc = t->v->modify_qp(q->qp, &a,
                           IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
  if (rc)
    return mc_err_sys(err, MC_ESYS, rc, "modify QP %u on %s to INIT failed", q->qp->qp_num,
                      nic->name);
  return 0;
}

int mc_rdma_qp_connect(mc_rdma_t *t, mc_rdma_qp_t *q, const mc_rdma_nic_info_t *rnic,
                       const mc_rdma_qp_info_t *rqp, mc_err_t *err) {
  mc_rdma_nic_t *n = q->nic;
  if (rnic->ethernet != n->info.ethernet)
    return mc_err_set(err, MC_EINVAL, "%s is %s but the peer's %s is %s: they cannot connect",
                      n->name, n->info.ethernet ? "RoCE" : "InfiniBand", rnic->name,
                      rnic->ethernet ? "RoCE" : "InfiniBand");
  uint32_t mtu = rnic->mtu < n->info.mtu ? rnic->mtu : n->info.mtu;
  struct ibv_qp_attr a = {
      .qp_state = IBV_QPS_RTR,
      .path_mtu = mtu_enum(mtu),
      .dest_qp_num = rqp->qpn,
      .rq_psn = rqp->psn,
      .max_dest_rd_atomic = (uint8_t)n->max_rd_atomic,
      .min_rnr_timer = 12,
      .ah_attr = {.port_num = n->port, .dlid = rnic->lid},
  };
  if (n->info.ethernet) {
    a.ah_attr.is_global = 1;
    memcpy(a.ah_attr.grh.dgid.raw, rnic->gid, 16);
    a.ah_attr.grh.sgid_index = (uint8_t)n->gid_index;
    a.ah_attr.grh.hop_limit = 64;
  }
  int rc = t->v->modify_qp(q->qp, &a,
                           IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                               IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                               IBV_QP_MIN_RNR_TIMER);
  if (rc)
    return mc_err_sys(err, MC_ECONNECT, rc,
                      "modify QP %u on %s to RTR (peer %s QP %u) failed: check that both NICs "
                      "are on one network and the GID (MC_GID_INDEX; chose %d: %s) is routable",
                      q->qp->qp_num, n->name, rnic->name, rqp->qpn, n->gid_index, n->gid_why);
  memset(&a, 0, sizeof a);
  a.qp_state = IBV_QPS_RTS;
  a.timeout = (uint8_t)t->o.timeout;
  a.retry_cnt = (uint8_t)t->o.retry_cnt;
  a.rnr_retry = (uint8_t)t->o.rnr_retry;
  a.sq_psn = q->psn;
  a.max_rd_atomic = (uint8_t)n->max_rd_atomic;
  rc = t->v->modify_qp(q->qp, &a,
                       IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                           IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
  if (rc)
    return mc_err_sys(err, MC_ECONNECT, rc, "modify QP %u on %s to RTS failed", q->qp->qp_num,
                      n->name);
  q->remote_qpn = rqp->qpn;
  snprintf(q->remote_nic, sizeof q->remote_nic, "%s", rnic->name);
  q->state = QP_UP;
  return 0;
}

void mc_rdma_qp_set_error(mc_rdma_t *t, mc_rdma_qp_t *q) {
  if (!q->qp)
    return;
  struct ibv_qp_attr a = {.qp_state = IBV_QPS_ERR};
  t->v->modify_qp(q->qp, &a, IBV_QP_STATE);
}

void mc_rdma_qp_destroy(mc_rdma_t *t, mc_rdma_qp_t *q) {
  if (q->qp)
    t->v->destroy_qp(q->qp);
  q->qp = NULL;
  free(q->wrbuf);
  free(q->sgebuf);
  q->wrbuf = NULL;
  q->sgebuf = NULL;
  if (q->nic)
    pthread_mutex_destroy(&q->mu);
  q->nic = NULL;
}
