#include "transport/rdma/verbs_api.h"

#include <pthread.h>
#include <string.h>

#include "util/dynlib.h"

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static mc_verbs_t table;
static int loaded;

#define SYM(field, name)                                                                \
  do {                                                                                  \
    void *p = mc_dynlib_sym(h, &mc_dynlib_ibverbs, name, err);                          \
    if (!p)                                                                             \
      goto fail;                                                                        \
    memcpy(&t.field, &p, sizeof p);                                                     \
  } while (0)

const mc_verbs_t *mc_verbs_load(mc_err_t *err) {
  pthread_mutex_lock(&mu);
  if (loaded) {
    pthread_mutex_unlock(&mu);
    return &table;
  }
  mc_verbs_t t;
  void *h = mc_dynlib_open(&mc_dynlib_ibverbs, err);
  if (!h)
    goto fail;
  SYM(get_device_list, "ibv_get_device_list");
  SYM(free_device_list, "ibv_free_device_list");
  SYM(get_device_name, "ibv_get_device_name");
  SYM(open_device, "ibv_open_device");
  SYM(close_device, "ibv_close_device");
  SYM(query_device, "ibv_query_device");
  SYM(query_port, "ibv_query_port");
  SYM(query_gid, "ibv_query_gid");
  SYM(alloc_pd, "ibv_alloc_pd");
  SYM(dealloc_pd, "ibv_dealloc_pd");
  SYM(reg_mr, "ibv_reg_mr");
  SYM(dereg_mr, "ibv_dereg_mr");
  SYM(create_comp_channel, "ibv_create_comp_channel");
  SYM(destroy_comp_channel, "ibv_destroy_comp_channel");
  SYM(create_cq, "ibv_create_cq");
  SYM(destroy_cq, "ibv_destroy_cq");
  SYM(get_cq_event, "ibv_get_cq_event");
  SYM(ack_cq_events, "ibv_ack_cq_events");
  SYM(create_qp, "ibv_create_qp");
  SYM(modify_qp, "ibv_modify_qp");
  SYM(destroy_qp, "ibv_destroy_qp");
  SYM(wc_status_str, "ibv_wc_status_str");
  SYM(get_async_event, "ibv_get_async_event");
  SYM(ack_async_event, "ibv_ack_async_event");
  SYM(event_type_str, "ibv_event_type_str");
  table = t;
  loaded = 1;
  pthread_mutex_unlock(&mu);
  return &table;
fail:
  pthread_mutex_unlock(&mu);
  return NULL;
}
