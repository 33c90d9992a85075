/* A verbs smoke test for the SoftRoCE guest: two RC queue pairs on two rxe
 * devices (rxe0 <-> rxe1 over a veth pair), an RDMA WRITE and an RDMA READ of
 * `size` bytes, both verified byte for byte.  Exit 0 on success.
 *
 *   verbs_smoke [dev_a] [dev_b] [gid_index] [size]
 */
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct side {
  struct ibv_context *ctx;
  struct ibv_pd *pd;
  struct ibv_cq *cq;
  struct ibv_qp *qp;
  struct ibv_mr *mr;
  uint8_t *buf;
  union ibv_gid gid;
  struct ibv_port_attr port;
} side_t;

static int fail(const char *what, int code) {
  fprintf(stderr, "verbs_smoke: %s failed (%d: %s)\n", what, code, strerror(code < 0 ? -code : code));
  return 1;
}

static int open_side(const char *name, int gid_index, size_t size, side_t *s) {
  int n = 0;
  struct ibv_device **list = ibv_get_device_list(&n);
  for (int i = 0; list && i < n && !s->ctx; i++)
    if (!strcmp(ibv_get_device_name(list[i]), name))
      s->ctx = ibv_open_device(list[i]);
  ibv_free_device_list(list);
  if (!s->ctx) {
    fprintf(stderr, "verbs_smoke: device %s not found\n", name);
    return 1;
  }
  if (ibv_query_port(s->ctx, 1, &s->port))
    return fail("ibv_query_port", 0);
  if (ibv_query_gid(s->ctx, 1, gid_index, &s->gid))
    return fail("ibv_query_gid", 0);
  s->pd = ibv_alloc_pd(s->ctx);
  s->buf = calloc(1, size);
  if (!s->pd || !s->buf)
    return fail("ibv_alloc_pd/calloc", 0);
  s->mr = ibv_reg_mr(s->pd, s->buf, size,
                     IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
  s->cq = ibv_create_cq(s->ctx, 16, NULL, NULL, 0);
  if (!s->mr || !s->cq)
    return fail("ibv_reg_mr/ibv_create_cq", 0);
  struct ibv_qp_init_attr qa = {
      .send_cq = s->cq,
      .recv_cq = s->cq,
      .qp_type = IBV_QPT_RC,
      .cap = {.max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1},
  };
  s->qp = ibv_create_qp(s->pd, &qa);
  return s->qp ? 0 : fail("ibv_create_qp", 0);
}

static int connect_qp(side_t *s, const side_t *peer, int gid_index) {
  struct ibv_qp_attr a = {
      .qp_state = IBV_QPS_INIT,
      .pkey_index = 0,
      .port_num = 1,
      .qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ,
  };
  int rc = ibv_modify_qp(s->qp, &a,
                         IBV_QP_STATE |
                         IBV_QP_PKEY_INDEX |
                         IBV_QP_PORT |
                         IBV_QP_ACCESS_FLAGS);
  if (rc)
    return fail("modify QP to INIT", rc);
  memset(&a, 0, sizeof a);
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = s->port.active_mtu < peer->port.active_mtu ? s->port.active_mtu
                                                          : peer->port.active_mtu;
  a.dest_qp_num = peer->qp->qp_num;
  a.rq_psn = 0;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;
  a.ah_attr.is_global = 1;
  a.ah_attr.grh.dgid = peer->gid;
  a.ah_attr.grh.sgid_index = (uint8_t)gid_index;
  a.ah_attr.grh.hop_limit = 1;
  a.ah_attr.dlid = peer->port.lid;
  a.ah_attr.port_num = 1;
  rc = ibv_modify_qp(s->qp, &a,
                     IBV_QP_STATE |
                     IBV_QP_AV |
                     IBV_QP_PATH_MTU |
                     IBV_QP_DEST_QPN |
                     IBV_QP_RQ_PSN |
                     IBV_QP_MAX_DEST_RD_ATOMIC |
                     IBV_QP_MIN_RNR_TIMER);
  if (rc)
    return fail("modify QP to RTR", rc);
  memset(&a, 0, sizeof a);
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 14;
  a.retry_cnt = 7;
  a.rnr_retry = 7;
  a.sq_psn = 0;
  a.max_rd_atomic = 1;
  rc = ibv_modify_qp(s->qp, &a,
                     IBV_QP_STATE |
                     IBV_QP_TIMEOUT |
                     IBV_QP_RETRY_CNT |
                     IBV_QP_RNR_RETRY |
                     IBV_QP_SQ_PSN |
                     IBV_QP_MAX_QP_RD_ATOMIC);
  return rc ? fail("modify QP to RTS", rc) : 0;
}

/* One signaled RDMA op from a to b; waits for its completion. */
static int rdma_op(side_t *a, const side_t *b, enum ibv_wr_opcode op, size_t off, size_t len) {
  struct ibv_sge sge = {.addr = (uintptr_t)(a->buf + off), .length = (uint32_t)len,
                        .lkey = a->mr->lkey};
  struct ibv_send_wr wr = {.wr_id = 7, .sg_list = &sge, .num_sge = 1, .opcode = op,
                           .send_flags = IBV_SEND_SIGNALED};
  wr.wr.rdma.remote_addr = (uintptr_t)(b->buf + off);
  wr.wr.rdma.rkey = b->mr->rkey;
  struct ibv_send_wr *bad = NULL;
  int rc = ibv_post_send(a->qp, &wr, &bad);
  if (rc)
    return fail("ibv_post_send", rc);
  struct ibv_wc wc;
  for (long spins = 0; spins < 2000000000L; spins++) {
    int n = ibv_poll_cq(a->cq, 1, &wc);
    if (n < 0)
      return fail("ibv_poll_cq", n);
    if (n == 1) {
      if (wc.status != IBV_WC_SUCCESS || wc.wr_id != 7) {
        fprintf(stderr, "verbs_smoke: completion failed: %s\n", ibv_wc_status_str(wc.status));
        return 1;
      }
      return 0;
    }
  }
  fprintf(stderr, "verbs_smoke: no completion\n");
  return 1;
}

int main(int argc, char **argv) {
  const char *da = argc > 1 ? argv[1] : "rxe0", *db = argc > 2 ? argv[2] : "rxe1";
  int gid_index = argc > 3 ? atoi(argv[3]) : 0;
  size_t size = argc > 4 ? strtoull(argv[4], NULL, 0) : (1u << 20);
  side_t a = {0}, b = {0};
  if (open_side(da, gid_index, 2 * size, &a) || open_side(db, gid_index, 2 * size, &b) ||
      connect_qp(&a, &b, gid_index) || connect_qp(&b, &a, gid_index))
    return 1;
  for (size_t i = 0; i < size; i++) {
    a.buf[i] = (uint8_t)(i * 31 + 7);
    b.buf[size + i] = (uint8_t)(i * 17 + 3);
  }
  int bad = 0;
  if (rdma_op(&a, &b, IBV_WR_RDMA_WRITE, 0, size))
    return 1;
  bad |= memcmp(a.buf, b.buf, size) != 0;
  printf("%s RDMA WRITE %zu bytes %s -> %s\n", bad ? "FAIL" : "ok  ", size, da, db);
  if (rdma_op(&a, &b, IBV_WR_RDMA_READ, size, size))
    return 1;
  int bad2 = memcmp(a.buf + size, b.buf + size, size) != 0;
  printf("%s RDMA READ  %zu bytes %s <- %s\n", bad2 ? "FAIL" : "ok  ", size, da, db);
  return bad || bad2;
}
