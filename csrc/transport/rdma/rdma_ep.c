/* Endpoints: the QPs to one peer segment (several per NIC), connected
 * lazily on the first transfer through the handshake RPC; the target side
 * of that handshake; breaking and replacing an endpoint whose QP failed. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "transport/rdma/rdma_internal.h"
#include "util/clock.h"
#include "util/log.h"

static mc_rdma_ep_t *ep_new(mc_rdma_t *t, const char *segment, int initiator) {
  mc_rdma_ep_t *ep = calloc(1, sizeof *ep);
  if (!ep)
    return NULL;
  ep->t = t;
  snprintf(ep->segment, sizeof ep->segment, "%s", segment);
  ep->initiator = initiator;
  pthread_mutex_init(&ep->mu, NULL);
  return ep;
}

static void ep_destroy(mc_rdma_t *t, mc_rdma_ep_t *ep) {
  for (uint32_t i = 0; i < MC_RDMA_MAX_QPS; i++)
    if (ep->qps[i].nic)
      mc_rdma_qp_destroy(t, &ep->qps[i]);
  free(ep->regions);
  pthread_mutex_destroy(&ep->mu);
  free(ep);
}

void mc_rdma_ep_put(mc_rdma_t *t, mc_rdma_ep_t *ep) {
  pthread_mutex_lock(&t->mu);
  int last = --ep->refs == 0;
  pthread_mutex_unlock(&t->mu);
  if (last)
    ep_destroy(t, ep);
}

/* Removes ep from list *head (t->mu held); the caller drops the list's
 * reference afterwards. */
static int unlink_ep(mc_rdma_ep_t **head, mc_rdma_ep_t *ep) {
  for (mc_rdma_ep_t **p = head; *p; p = &(*p)->next) {
    if (*p == ep) {
      *p = ep->next;
      ep->next = NULL;
      ep->listed = 0;
      return 1;
    }
  }
  return 0;
}

static int encode_reply(mc_rdma_record_t *r, char **out, mc_err_t *err) {
  *out = mc_rdma_record_encode(r);
  return *out ? 0 : mc_err_set(err, MC_ENOMEM, "out of memory encoding an RDMA record");
}

static void local_nics(mc_rdma_t *t, mc_rdma_record_t *r) {
  r->nnics = (uint32_t)t->nnic;
  for (int i = 0; i < t->nnic; i++)
    r->nics[i] = t->nics[i].info;
}

/* Initiator: create QPs, exchange records, bring QPs to RTS. */
/* Sends an RDMA record to the endpoint's peer over the engine's RPC hook;
 * *reply (malloc'ed) gets the answer. */
static int ask_peer(mc_rdma_t *t, mc_rdma_ep_t *ep, const mc_rdma_record_t *req, char **reply,
                    mc_err_t *err) {
  char *txt = mc_rdma_record_encode(req);
  if (!txt)
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  int rc = t->hooks.rpc(t->hooks.ctx, ep->segment, txt, strlen(txt), t->o.connect_timeout_ms,
                        reply, err);
  free(txt);
  return rc;
}

static int ep_connect(mc_rdma_t *t, mc_rdma_ep_t *ep, mc_err_t *err) {
  for (int i = 0; i < t->nnic; i++) {
    /* Down since an async event said so: ask the port again (the
     * PORT_ACTIVE event may still be on its way). */
    struct ibv_port_attr pa;
    if (atomic_load(&t->nics[i].down) &&
        t->v->query_port(t->nics[i].ctx, t->nics[i].port, &pa) == 0 &&
        pa.state == IBV_PORT_ACTIVE)
      atomic_store(&t->nics[i].down, 0);
    if (atomic_load(&t->nics[i].down))
      return mc_err_set(err, MC_ECONNECT, "RDMA connection to segment %s: port %u of %s is "
                        "down (link down?); check `ibv_devinfo -d %s`", ep->segment,
                        t->nics[i].port, t->nics[i].name, t->nics[i].name);
  }
  uint32_t nqp = (uint32_t)(t->nnic * t->o.qps_per_nic);
  if (nqp > MC_RDMA_MAX_QPS)
    nqp = MC_RDMA_MAX_QPS;
  mc_rdma_record_t req = {.kind = MC_RDMA_REC_CONNECT, .epoch = ep->epoch, .nqps = nqp};
  snprintf(req.from, sizeof req.from, "%s", t->hooks.local_name);
  snprintf(req.to, sizeof req.to, "%s", ep->segment);
  local_nics(t, &req);
  for (uint32_t i = 0; i < nqp; i++) {
    ep->qp_nic[i] = i % (uint32_t)t->nnic;
    ep->qps[i].ep = ep;
    int rc = mc_rdma_qp_create(t, &ep->qps[i], &t->nics[ep->qp_nic[i]], err);
    if (rc < 0)
      return rc;
    req.qps[i] = (mc_rdma_qp_info_t){.nic = ep->qp_nic[i], .qpn = ep->qps[i].qp->qp_num,
                                     .psn = ep->qps[i].psn};
  }
  ep->nqp = nqp;
  char *reply = NULL;
  int rc = ask_peer(t, ep, &req, &reply, err);
  if (rc < 0)
    return mc_err_prefix(err, "RDMA handshake with segment %s (over its TCP control port)",
                         ep->segment);
  mc_rdma_record_t acc;
  rc = mc_rdma_record_decode(reply, strlen(reply), &acc, err);
  free(reply);
  if (rc < 0)
    return mc_err_prefix(err, "RDMA handshake with segment %s", ep->segment);
  if (acc.kind != MC_RDMA_REC_ACCEPT || acc.nqps != nqp) {
    mc_rdma_record_free(&acc);
    return mc_err_set(err, MC_EPROTO, "RDMA handshake with segment %s: expected an accept "
                      "with %u QPs, got kind %d with %u", ep->segment, nqp, acc.kind, acc.nqps);
  }
  for (uint32_t i = 0; i < nqp && rc == 0; i++) {
    rc = mc_rdma_qp_connect(t, &ep->qps[i], &acc.nics[acc.qps[i].nic], &acc.qps[i], err);
    ep->qps[i].remote_nic_idx = acc.qps[i].nic;
  }
  if (rc < 0) {
    mc_rdma_record_free(&acc);
    return mc_err_prefix(err, "RDMA connection to segment %s", ep->segment);
  }
  ep->regions = acc.regions;
  ep->nregions = acc.nregions;
  ep->remote_nnics = acc.nnics;
  mc_log_info("rdma: connected to segment %s: %u QPs over %d local and %u remote NICs, %zu "
              "remote regions",
              ep->segment, nqp, t->nnic, acc.nnics, acc.nregions);
  return 0;
}

mc_rdma_ep_t *mc_rdma_ep_get(mc_rdma_t *t, const char *segment, mc_err_t *err) {
  pthread_mutex_lock(&t->mu);
  mc_rdma_ep_t *ep;
  for (;;) {
    for (ep = t->eps; ep && strcmp(ep->segment, segment) != 0; ep = ep->next)
      ;
    if (!ep)
      break;
    if (ep->state == EP_UP) {
      ep->refs++;
      pthread_mutex_unlock(&t->mu);
      return ep;
    }
    if (ep->state == EP_CONNECTING) { /* another caller is connecting */
      struct timespec ts = mc_deadline_ts(mc_now_ns() + 100000000ull);
      pthread_cond_timedwait(&t->cv, &t->mu, &ts);
      continue;
    }
    /* Broken: replace it; it is freed once its requests finish. */
    unlink_ep(&t->eps, ep);
    if (--ep->refs == 0) {
      pthread_mutex_unlock(&t->mu);
      ep_destroy(t, ep);
      pthread_mutex_lock(&t->mu);
    }
  }
  ep = ep_new(t, segment, 1);
  if (!ep) {
    pthread_mutex_unlock(&t->mu);
    mc_err_set(err, MC_ENOMEM, "out of memory");
    return NULL;
  }
  ep->epoch = ++t->next_epoch;
  ep->refs = 2; /* the list and the caller */
  ep->listed = 1;
  ep->next = t->eps;
  t->eps = ep;
  pthread_mutex_unlock(&t->mu);

  int rc = ep_connect(t, ep, err);

  pthread_mutex_lock(&t->mu);
  ep->state = rc == 0 ? EP_UP : EP_FAILED;
  if (rc < 0 && unlink_ep(&t->eps, ep))
    ep->refs--;
  pthread_cond_broadcast(&t->cv);
  pthread_mutex_unlock(&t->mu);
  if (rc < 0) {
    mc_rdma_ep_put(t, ep);
    return NULL;
  }
  return ep;
}

void mc_rdma_ep_mark_broken(mc_rdma_t *t, mc_rdma_ep_t *ep) {
  pthread_mutex_lock(&t->mu);
  if (ep->state == EP_UP)
    ep->state = EP_BROKEN;
  pthread_mutex_unlock(&t->mu);
}

void mc_rdma_ep_break(mc_rdma_t *t, mc_rdma_ep_t *ep, int code, const char *msg, int flush) {
  pthread_mutex_lock(&t->mu);
  if (ep->state == EP_UP)
    ep->state = EP_BROKEN;
  pthread_mutex_unlock(&t->mu);
  for (uint32_t i = 0; i < ep->nqp; i++) {
    mc_rdma_qp_t *q = &ep->qps[i];
    pthread_mutex_lock(&q->mu);
    if (q->state == QP_UP) {
      q->state = QP_BROKEN;
      q->fail_code = code;
      snprintf(q->fail_msg, sizeof q->fail_msg, "%s", msg);
    }
    if (flush)
      mc_rdma_qp_set_error(t, q);
    pthread_mutex_unlock(&q->mu);
    mc_rdma_post_some(t, q); /* fails what was not posted */
  }
}

mc_rdma_ep_t **mc_rdma_eps_hold(mc_rdma_t *t, size_t *n) {
  *n = 0;
  pthread_mutex_lock(&t->mu);
  size_t count = 0;
  for (mc_rdma_ep_t *ep = t->eps; ep; ep = ep->next)
    count++;
  mc_rdma_ep_t **eps = count ? malloc(count * sizeof *eps) : NULL;
  if (eps) {
    for (mc_rdma_ep_t *ep = t->eps; ep; ep = ep->next) {
      ep->refs++;
      eps[(*n)++] = ep;
    }
  } else if (count) {
    mc_log_error("out of memory listing %zu RDMA endpoints", count);
  }
  pthread_mutex_unlock(&t->mu);
  return eps;
}

void mc_rdma_nic_down(mc_rdma_t *t, mc_rdma_nic_t *nic, const char *msg) {
  size_t n;
  mc_rdma_ep_t **eps = mc_rdma_eps_hold(t, &n);
  for (size_t i = 0; i < n; i++) {
    mc_rdma_ep_t *ep = eps[i];
    int hit = 0;
    for (uint32_t k = 0; k < ep->nqp; k++) {
      mc_rdma_qp_t *q = &ep->qps[k];
      if (q->nic != nic)
        continue;
      hit = 1;
      pthread_mutex_lock(&q->mu);
      if (q->state == QP_UP) {
        q->state = QP_BROKEN;
        q->fail_code = MC_EPEERCLOSED;
        snprintf(q->fail_msg, sizeof q->fail_msg, "%s", msg);
      }
      mc_rdma_qp_set_error(t, q);
      pthread_mutex_unlock(&q->mu);
      mc_rdma_post_some(t, q);
    }
    if (hit)
      mc_rdma_ep_mark_broken(t, ep);
    mc_rdma_ep_put(t, ep);
  }
  free(eps);
}

void mc_rdma_peer_lost(mc_rdma_t *t, const char *segment) {
  pthread_mutex_lock(&t->mu);
  mc_rdma_ep_t *ep;
  for (ep = t->eps; ep && strcmp(ep->segment, segment) != 0; ep = ep->next)
    ;
  if (ep && ep->state == EP_UP)
    ep->refs++;
  else
    ep = NULL;
  pthread_mutex_unlock(&t->mu);
  if (!ep)
    return;
  char msg[MC_ERR_MSG_MAX];
  snprintf(msg, sizeof msg, "the control connection to segment %s closed (its process exited "
           "or the network failed); RDMA requests to it were flushed", segment);
  mc_log_warn("rdma: %s", msg);
  mc_rdma_ep_break(t, ep, MC_EPEERCLOSED, msg, 1);
  mc_rdma_ep_put(t, ep);
}

int mc_rdma_ep_refresh_regions(mc_rdma_t *t, mc_rdma_ep_t *ep, mc_err_t *err) {
  mc_rdma_record_t req = {.kind = MC_RDMA_REC_REGIONS, .epoch = ep->epoch};
  snprintf(req.from, sizeof req.from, "%s", t->hooks.local_name);
  snprintf(req.to, sizeof req.to, "%s", ep->segment);
  char *reply = NULL;
  int rc = ask_peer(t, ep, &req, &reply, err);
  if (rc < 0)
    return rc;
  mc_rdma_record_t acc;
  rc = mc_rdma_record_decode(reply, strlen(reply), &acc, err);
  free(reply);
  if (rc < 0)
    return rc;
  if (acc.nnics != ep->remote_nnics) {
    mc_rdma_record_free(&acc);
    return mc_err_set(err, MC_EPROTO, "segment %s now reports %u NICs, not %u", ep->segment,
                      acc.nnics, ep->remote_nnics);
  }
  pthread_mutex_lock(&ep->mu);
  free(ep->regions);
  ep->regions = acc.regions;
  ep->nregions = acc.nregions;
  pthread_mutex_unlock(&ep->mu);
  return 0;
}

/* ---- target side ---- */

static int serve_connect(mc_rdma_t *t, mc_rdma_record_t *rq, char **reply, mc_err_t *err) {
  if (strcmp(rq->to, t->hooks.local_name) != 0)
    return mc_err_set(err, MC_ENOTFOUND, "RDMA connect for segment \"%s\" reached segment "
                      "\"%s\"", rq->to, t->hooks.local_name);
  if (rq->nqps == 0)
    return mc_err_set(err, MC_EPROTO, "RDMA connect with no QPs");
  mc_rdma_ep_t *ep = ep_new(t, rq->from, 0);
  if (!ep)
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  ep->epoch = rq->epoch;
  mc_rdma_record_t acc = {.kind = MC_RDMA_REC_ACCEPT, .epoch = rq->epoch, .nqps = rq->nqps};
  snprintf(acc.from, sizeof acc.from, "%s", t->hooks.local_name);
  snprintf(acc.to, sizeof acc.to, "%s", rq->from);
  local_nics(t, &acc);
  int rc = 0;
  for (uint32_t i = 0; i < rq->nqps && rc == 0; i++) {
    uint32_t nic = i % (uint32_t)t->nnic;
    ep->qps[i].ep = ep;
    ep->qp_nic[i] = nic;
    rc = mc_rdma_qp_create(t, &ep->qps[i], &t->nics[nic], err);
    if (rc == 0)
      rc = mc_rdma_qp_connect(t, &ep->qps[i], &rq->nics[rq->qps[i].nic], &rq->qps[i], err);
    if (rc == 0)
      acc.qps[i] = (mc_rdma_qp_info_t){.nic = nic, .qpn = ep->qps[i].qp->qp_num,
                                       .psn = ep->qps[i].psn};
  }
  ep->nqp = rq->nqps;
  if (rc == 0 && mc_rdma_mr_export(t, &acc.regions, &acc.nregions) < 0)
    rc = mc_err_set(err, MC_ENOMEM, "out of memory");
  if (rc == 0)
    rc = encode_reply(&acc, reply, err);
  mc_rdma_record_free(&acc);
  if (rc < 0) {
    ep_destroy(t, ep);
    return rc;
  }
  /* Older endpoints of the same initiator are replaced by this one; the
   * newest of them is kept, since the initiator may still be finishing
   * requests on its predecessor (an endpoint is replaced while its healthy
   * QPs drain). */
  mc_rdma_ep_t *old = NULL;
  pthread_mutex_lock(&t->mu);
  uint64_t keep = 0;
  for (mc_rdma_ep_t *e = t->accepted; e; e = e->next)
    if (!strcmp(e->segment, rq->from) && e->epoch < rq->epoch && e->epoch > keep)
      keep = e->epoch;
  for (mc_rdma_ep_t **p = &t->accepted; *p;) {
    mc_rdma_ep_t *e = *p;
    if (!strcmp(e->segment, rq->from) && e->epoch != keep) {
      *p = e->next;
      e->next = old;
      old = e;
    } else {
      p = &e->next;
    }
  }
  ep->refs = 1;
  ep->listed = 1;
  ep->state = EP_UP;
  ep->next = t->accepted;
  t->accepted = ep;
  pthread_mutex_unlock(&t->mu);
  while (old) {
    mc_rdma_ep_t *n = old->next;
    ep_destroy(t, old);
    old = n;
  }
  mc_log_info("rdma: accepted %u QPs from segment %s", rq->nqps, rq->from);
  return 0;
}

int mc_rdma_serve_rpc(mc_rdma_t *t, const char *from, const char *req, size_t len,
                      char **reply, mc_err_t *err) {
  (void)from;
  mc_rdma_record_t rq;
  int rc = mc_rdma_record_decode(req, len, &rq, err);
  if (rc < 0)
    return rc;
  if (rq.kind == MC_RDMA_REC_CONNECT) {
    rc = serve_connect(t, &rq, reply, err);
  } else if (rq.kind == MC_RDMA_REC_REGIONS) {
    mc_rdma_record_t acc = {.kind = MC_RDMA_REC_ACCEPT, .epoch = rq.epoch};
    snprintf(acc.from, sizeof acc.from, "%s", t->hooks.local_name);
    snprintf(acc.to, sizeof acc.to, "%s", rq.from);
    local_nics(t, &acc);
    rc = mc_rdma_mr_export(t, &acc.regions, &acc.nregions) < 0
             ? mc_err_set(err, MC_ENOMEM, "out of memory")
             : encode_reply(&acc, reply, err);
    mc_rdma_record_free(&acc);
  } else {
    rc = mc_err_set(err, MC_EPROTO, "unexpected RDMA record kind %d in a request", rq.kind);
  }
  mc_rdma_record_free(&rq);
  return rc;
}

void mc_rdma_peer_closed(mc_rdma_t *t, const char *segment) {
  mc_rdma_ep_t *old = NULL;
  pthread_mutex_lock(&t->mu);
  for (mc_rdma_ep_t **p = &t->accepted; *p;) {
    mc_rdma_ep_t *e = *p;
    if (!strcmp(e->segment, segment)) {
      *p = e->next;
      e->next = old;
      old = e;
    } else {
      p = &e->next;
    }
  }
  pthread_mutex_unlock(&t->mu);
  int n = 0;
  while (old) {
    mc_rdma_ep_t *nx = old->next;
    ep_destroy(t, old);
    old = nx;
    n++;
  }
  if (n)
    mc_log_info("rdma: segment %s closed its control connection; freed the %d QP set(s) it "
                "had connected to us", segment, n);
}

/* ---- shutdown ---- */

void mc_rdma_ep_free_all(mc_rdma_t *t) {
  /* Flush everything posted, reap the flushes, then free. */
  pthread_mutex_lock(&t->mu);
  mc_rdma_ep_t *lists[2] = {t->eps, t->accepted};
  t->eps = t->accepted = NULL;
  pthread_mutex_unlock(&t->mu);
  for (int l = 0; l < 2; l++)
    for (mc_rdma_ep_t *ep = lists[l]; ep; ep = ep->next)
      if (ep->initiator)
        mc_rdma_ep_break(t, ep, MC_ECLOSED, "the engine is shutting down", 1);
  uint64_t until = mc_now_ns() + 5000000000ull;
  while (atomic_load(&t->inflight) > 0 && mc_now_ns() < until)
    if (mc_rdma_cq_poll_all(t) == 0) {
      struct timespec ts = {0, 1000000};
      nanosleep(&ts, NULL);
    }
  if (atomic_load(&t->inflight) > 0)
    mc_log_error("rdma: %ld work requests still posted after 5 s at shutdown; their buffers "
                 "may still be accessed", (long)atomic_load(&t->inflight));
  for (int l = 0; l < 2; l++) {
    mc_rdma_ep_t *ep = lists[l];
    while (ep) {
      mc_rdma_ep_t *n = ep->next;
      pthread_mutex_lock(&t->mu);
      ep->listed = 0;
      int last = --ep->refs <= 0;
      pthread_mutex_unlock(&t->mu);
      if (last)
        ep_destroy(t, ep);
      ep = n;
    }
  }
}
