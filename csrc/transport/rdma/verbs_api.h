/* The libibverbs entry points the RDMA transport uses, looked up at run
 * time (dlopen): the extension links no verbs library, so one build imports
 * on hosts without RDMA.  The data-path calls (ibv_post_send, ibv_poll_cq,
 * ibv_req_notify_cq) are inline in verbs.h and dispatch through the device
 * context, so they need no lookup. */
#ifndef MC_TRANSPORT_RDMA_VERBS_API_H
#define MC_TRANSPORT_RDMA_VERBS_API_H

#include <infiniband/verbs.h>

#include "util/errors.h"

typedef struct mc_verbs {
  struct ibv_device **(*get_device_list)(int *num);
  void (*free_device_list)(struct ibv_device **list);
  const char *(*get_device_name)(struct ibv_device *dev);
  struct ibv_context *(*open_device)(struct ibv_device *dev);
  int (*close_device)(struct ibv_context *ctx);
  int (*query_device)(struct ibv_context *ctx, struct ibv_device_attr *attr);
  int (*query_port)(struct ibv_context *ctx, uint8_t port, struct ibv_port_attr *attr);
  int (*query_gid)(struct ibv_context *ctx, uint8_t port, int index, union ibv_gid *gid);
  struct ibv_pd *(*alloc_pd)(struct ibv_context *ctx);
  int (*dealloc_pd)(struct ibv_pd *pd);
  struct ibv_mr *(*reg_mr)(struct ibv_pd *pd, void *addr, size_t len, int access);
  int (*dereg_mr)(struct ibv_mr *mr);
  struct ibv_comp_channel *(*create_comp_channel)(struct ibv_context *ctx);
  int (*destroy_comp_channel)(struct ibv_comp_channel *ch);
  struct ibv_cq *(*create_cq)(struct ibv_context *ctx, int cqe, void *cq_ctx,
                              struct ibv_comp_channel *ch, int comp_vector);
  int (*destroy_cq)(struct ibv_cq *cq);
  int (*get_cq_event)(struct ibv_comp_channel *ch, struct ibv_cq **cq, void **cq_ctx);
  void (*ack_cq_events)(struct ibv_cq *cq, unsigned int n);
  struct ibv_qp *(*create_qp)(struct ibv_pd *pd, struct ibv_qp_init_attr *attr);
  int (*modify_qp)(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask);
  int (*destroy_qp)(struct ibv_qp *qp);
  const char *(*wc_status_str)(enum ibv_wc_status status);
  int (*get_async_event)(struct ibv_context *ctx, struct ibv_async_event *ev);
  void (*ack_async_event)(struct ibv_async_event *ev);
  const char *(*event_type_str)(enum ibv_event_type type);
} mc_verbs_t;

/* Loads libibverbs and every symbol above (once; thread-safe).  NULL with
 * MC_EUNAVAIL naming the library or symbol and the package to install. */
const mc_verbs_t *mc_verbs_load(mc_err_t *err);

#endif
