/* The data path: ops are cut into slices (one work request each), striped
 * over the endpoint's QPs, and posted as chains (one doorbell per QP per
 * call); completions finish ops and refill the send queues. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "transport/rdma/rdma_internal.h"
#include "transport/rdma/rdma_plan.h"
#include "util/log.h"

static void fail_op(mc_xfer_op_t *op, int code, const char *msg) {
  if (op->done)
    op->done(op, code, msg);
  mc_xfer_op_free(op);
}

static void req_finish(mc_rdma_t *t, mc_rdma_req_t *r) {
  for (size_t i = 0; i < r->ntmp; i++)
    if (r->tmp_mrs[i])
      t->v->dereg_mr(r->tmp_mrs[i]);
  free(r->tmp_mrs);
  fail_op(r->op, r->code, r->code ? r->msg : NULL);
  free(r->wrs);
  mc_rdma_ep_put(t, r->ep);
  pthread_mutex_destroy(&r->mu);
  free(r);
}

void mc_rdma_wr_complete(mc_rdma_t *t, mc_rdma_wr_t *w, int code, const char *msg) {
  mc_rdma_req_t *r = w->req;
  pthread_mutex_lock(&r->mu);
  if (code && !r->code) {
    r->code = code;
    snprintf(r->msg, sizeof r->msg, "%s", msg ? msg : mc_strerror(code));
  }
  int last = --r->left == 0;
  pthread_mutex_unlock(&r->mu);
  if (last)
    req_finish(t, r);
}

static void list_push(mc_rdma_wr_t **head, mc_rdma_wr_t **tail, mc_rdma_wr_t *w) {
  w->next = NULL;
  w->prev = *tail;
  if (*tail)
    (*tail)->next = w;
  else
    *head = w;
  *tail = w;
}

static void list_remove(mc_rdma_wr_t **head, mc_rdma_wr_t **tail, mc_rdma_wr_t *w) {
  if (w->prev)
    w->prev->next = w->next;
  else
    *head = w->next;
  if (w->next)
    w->next->prev = w->prev;
  else
    *tail = w->prev;
  w->next = w->prev = NULL;
}

void mc_rdma_post_some(mc_rdma_t *t, mc_rdma_qp_t *q) {
  mc_rdma_wr_t *fail = NULL, *fail_tail = NULL;
  int fcode = 0;
  char fmsg[MC_ERR_MSG_MAX] = "";
  pthread_mutex_lock(&q->mu);
  if (q->state != QP_UP) {
    fail = q->pend_head;
    q->pend_head = q->pend_tail = NULL;
    fcode = q->fail_code ? q->fail_code : MC_ECLOSED;
    snprintf(fmsg, sizeof fmsg, "%s", q->fail_msg[0] ? q->fail_msg : "the QP is not connected");
  } else {
    int room = t->o.max_wr - q->outstanding, n = 0;
    uint64_t bytes = q->inflight_bytes;
    /* Bounded by the send queue and by the bytes in flight: enough for the
     * bandwidth-delay product of a fast NIC, without flooding a slow path
     * into drops and retransmissions. */
    while (q->pend_head && n < room &&
           (bytes + q->pend_head->len <= t->o.qp_inflight_bytes || (n == 0 && bytes == 0))) {
      mc_rdma_wr_t *w = q->pend_head;
      bytes += w->len;
      list_remove(&q->pend_head, &q->pend_tail, w);
      struct ibv_send_wr *s = &q->wrbuf[n];
      struct ibv_sge *g = &q->sgebuf[n];
      *g = (struct ibv_sge){.addr = w->local, .length = w->len, .lkey = w->lkey};
      memset(s, 0, sizeof *s);
      s->wr_id = (uint64_t)(uintptr_t)w;
      s->sg_list = g;
      s->num_sge = 1;
      s->opcode = w->req->op->type == MC_XFER_WRITE ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
      s->send_flags = IBV_SEND_SIGNALED;
      s->wr.rdma.remote_addr = w->remote;
      s->wr.rdma.rkey = w->rkey;
      s->next = NULL;
      if (n)
        q->wrbuf[n - 1].next = s;
      list_push(&q->post_head, &q->post_tail, w);
      n++;
    }
    if (n) {
      struct ibv_send_wr *bad = NULL;
      int rc = ibv_post_send(q->qp, q->wrbuf, &bad);
      int posted = n;
      if (rc) {
        posted = bad ? (int)(bad - q->wrbuf) : 0;
        /* The WRs from `bad` on were not posted: fail them. */
        for (int i = posted; i < n; i++) {
          mc_rdma_wr_t *w = (mc_rdma_wr_t *)(uintptr_t)q->wrbuf[i].wr_id;
          bytes -= w->len;
          list_remove(&q->post_head, &q->post_tail, w);
          list_push(&fail, &fail_tail, w);
        }
        q->state = QP_BROKEN;
        q->fail_code = MC_EPROTO;
        snprintf(q->fail_msg, sizeof q->fail_msg,
                 "ibv_post_send on %s QP %u failed: %s (send queue %d, %d outstanding)",
                 q->nic->name, q->qp->qp_num, strerror(rc), t->o.max_wr, q->outstanding);
        fcode = q->fail_code;
        snprintf(fmsg, sizeof fmsg, "%s", q->fail_msg);
        /* Whatever is still pending fails too. */
        while (q->pend_head) {
          mc_rdma_wr_t *w = q->pend_head;
          list_remove(&q->pend_head, &q->pend_tail, w);
          list_push(&fail, &fail_tail, w);
        }
      }
      q->outstanding += posted;
      q->inflight_bytes = bytes;
      atomic_fetch_add(&t->inflight, posted);
    }
  }
  pthread_mutex_unlock(&q->mu);
  if (fail && q->ep && q->state != QP_UP)
    mc_rdma_ep_mark_broken(t, q->ep);
  while (fail) {
    mc_rdma_wr_t *n = fail->next;
    mc_rdma_wr_complete(t, fail, fcode, fmsg);
    fail = n;
  }
}

/* The region of the peer holding [addr, addr+len), or -1 (ep->mu held). */
static long find_remote(mc_rdma_ep_t *ep, uint64_t addr, uint64_t len) {
  for (size_t i = 0; i < ep->nregions; i++) {
    const mc_rdma_region_info_t *g = &ep->regions[i];
    if (addr >= g->addr && addr - g->addr <= g->len && len <= g->len - (addr - g->addr))
      return (long)i;
  }
  return -1;
}

/* Builds the WRs of one op and queues them on their QPs (marked in
 * *touched); an op that fails here, or whose every entry was refused, is
 * finished at once. */
static void queue_op(mc_rdma_t *t, mc_rdma_ep_t *ep, mc_xfer_op_t *op, int *refreshed,
                     uint64_t *touched) {
  const char *what = op->type == MC_XFER_WRITE ? "WRITE" : "READ";
  /* Remote keys: entries outside the peer's regions fail alone. */
  uint32_t *rkeys = malloc((size_t)(op->nent ? op->nent : 1) * MC_RDMA_MAX_NICS * sizeof *rkeys);
  if (!rkeys) {
    fail_op(op, MC_ENOMEM, "out of memory");
    return;
  }
  for (uint32_t i = 0; i < op->nent;) {
    mc_xfer_ent_t *e = &op->ent[i];
    pthread_mutex_lock(&ep->mu);
    long g = find_remote(ep, e->remote, e->len);
    pthread_mutex_unlock(&ep->mu);
    if (g < 0 && !*refreshed) {
      /* The peer may have registered it since we connected. */
      mc_err_t err;
      *refreshed = 1;
      if (mc_rdma_ep_refresh_regions(t, ep, &err) < 0)
        mc_log_warn("rdma: refreshing the regions of segment %s failed: %s", ep->segment,
                    err.msg);
      continue;
    }
    if (g < 0) {
      char msg[MC_ERR_MSG_MAX];
      snprintf(msg, sizeof msg,
               "RDMA %s range [0x%llx, 0x%llx) is not inside any memory region registered by "
               "segment %s (it has %zu registered regions)",
               what, (unsigned long long)e->remote, (unsigned long long)(e->remote + e->len),
               ep->segment, ep->nregions);
      if (op->entry_failed)
        op->entry_failed(op, i, MC_ERANGE, msg);
      else {
        free(rkeys);
        fail_op(op, MC_ERANGE, msg);
        return;
      }
      memmove(op->ent + i, op->ent + i + 1, (op->nent - i - 1) * sizeof *op->ent);
      op->nent--;
      continue;
    }
    pthread_mutex_lock(&ep->mu);
    memcpy(rkeys + (size_t)i * MC_RDMA_MAX_NICS, ep->regions[g].rkey,
           sizeof ep->regions[g].rkey);
    pthread_mutex_unlock(&ep->mu);
    i++;
  }
  if (op->nent == 0) {
    free(rkeys);
    fail_op(op, 0, NULL);
    return;
  }
  mc_rdma_req_t *r = calloc(1, sizeof *r);
  uint64_t *lens = malloc(op->nent * sizeof *lens);
  int *pref = malloc(op->nent * sizeof *pref);
  uint32_t *lkeys = malloc((size_t)op->nent * MC_RDMA_MAX_NICS * sizeof *lkeys);
  mc_rdma_slice_t *sl = NULL;
  if (!r || !lens || !pref || !lkeys)
    goto oom;
  pthread_mutex_init(&r->mu, NULL);
  r->op = op;
  r->ep = ep;
  /* Local keys: the MR cache, else a temporary MR for this op. */
  pthread_rwlock_rdlock(&t->mr_lock);
  for (uint32_t i = 0; i < op->nent; i++) {
    mc_xfer_ent_t *e = &op->ent[i];
    lens[i] = e->len;
    const mc_rdma_mr_t *m = mc_rdma_mr_find(t, (uint64_t)(uintptr_t)e->local, e->len);
    pref[i] = m ? m->pref_nic : -1;
    for (int k = 0; k < t->nnic; k++)
      lkeys[(size_t)i * MC_RDMA_MAX_NICS + k] = m ? m->mr[k]->lkey : 0;
    if (!m) {
      if (!r->tmp_mrs && !(r->tmp_mrs = calloc((size_t)op->nent * (size_t)(unsigned)t->nnic, sizeof *r->tmp_mrs))) {
        pthread_rwlock_unlock(&t->mr_lock);
        goto oom;
      }
      for (int k = 0; k < t->nnic; k++) {
        struct ibv_mr *mr = t->v->reg_mr(t->nics[k].pd, e->local, e->len,
                                         IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                             IBV_ACCESS_REMOTE_READ);
        if (!mr) {
          pthread_rwlock_unlock(&t->mr_lock);
          char msg[MC_ERR_MSG_MAX];
          snprintf(msg, sizeof msg,
                   "RDMA %s: local buffer 0x%llx (%llu bytes) is not registered and "
                   "registering it on %s failed (%s); register it with register_memory",
                   what, (unsigned long long)(uintptr_t)e->local, (unsigned long long)e->len,
                   t->nics[k].name, strerror(errno));
          r->code = MC_ERANGE;
          snprintf(r->msg, sizeof r->msg, "%s", msg);
          goto fail_req;
        }
        r->tmp_mrs[r->ntmp++] = mr;
        lkeys[(size_t)i * MC_RDMA_MAX_NICS + k] = mr->lkey;
      }
    }
  }
  pthread_rwlock_unlock(&t->mr_lock);
  size_t ns = mc_rdma_plan_count(lens, op->nent, t->o.slice_size);
  sl = malloc(ns * sizeof *sl);
  r->wrs = calloc(ns, sizeof *r->wrs);
  if (!sl || !r->wrs)
    goto oom;
  pthread_mutex_lock(&ep->mu);
  mc_rdma_plan(lens, pref, op->nent, t->o.slice_size, ep->qp_nic, ep->nqp, &ep->rr, sl);
  pthread_mutex_unlock(&ep->mu);
  r->nwrs = r->left = ns;
  pthread_mutex_lock(&t->mu);
  ep->refs++; /* held by the request */
  pthread_mutex_unlock(&t->mu);
  for (size_t k = 0; k < ns; k++) {
    mc_rdma_wr_t *w = &r->wrs[k];
    mc_xfer_ent_t *e = &op->ent[sl[k].ent];
    mc_rdma_qp_t *q = &ep->qps[sl[k].qp];
    w->req = r;
    w->qp = q;
    w->local = (uint64_t)(uintptr_t)e->local + sl[k].off;
    w->remote = e->remote + sl[k].off;
    w->len = sl[k].len;
    w->lkey = lkeys[(size_t)sl[k].ent * MC_RDMA_MAX_NICS + q->nic->idx];
    w->rkey = rkeys[(size_t)sl[k].ent * MC_RDMA_MAX_NICS + q->remote_nic_idx];
  }
  /* Queue per QP in plan order. */
  for (size_t k = 0; k < ns; k++) {
    mc_rdma_qp_t *q = r->wrs[k].qp;
    pthread_mutex_lock(&q->mu);
    list_push(&q->pend_head, &q->pend_tail, &r->wrs[k]);
    pthread_mutex_unlock(&q->mu);
    *touched |= 1ull << sl[k].qp;
  }
  free(sl);
  free(lens);
  free(pref);
  free(lkeys);
  free(rkeys);
  return;
oom:
  if (r) {
    r->code = MC_ENOMEM;
    snprintf(r->msg, sizeof r->msg, "out of memory");
  }
fail_req:
  free(sl);
  free(lens);
  free(pref);
  free(lkeys);
  free(rkeys);
  if (r) {
    for (size_t i = 0; i < r->ntmp; i++)
      t->v->dereg_mr(r->tmp_mrs[i]);
    free(r->tmp_mrs);
    free(r->wrs);
    int code = r->code;
    char msg[MC_ERR_MSG_MAX];
    snprintf(msg, sizeof msg, "%s", r->msg);
    pthread_mutex_destroy(&r->mu);
    free(r);
    fail_op(op, code, msg);
  } else {
    fail_op(op, MC_ENOMEM, "out of memory");
  }
}

void mc_rdma_submit(mc_rdma_t *t, const char *segment, mc_xfer_op_t **ops, size_t nops) {
  mc_err_t err = {0};
  mc_rdma_ep_t *ep = mc_rdma_ep_get(t, segment, &err);
  if (!ep) {
    for (size_t i = 0; i < nops; i++)
      fail_op(ops[i], err.code ? err.code : MC_ECONNECT, err.msg);
    return;
  }
  int refreshed = 0;
  uint64_t touched = 0;
  for (size_t i = 0; i < nops; i++)
    queue_op(t, ep, ops[i], &refreshed, &touched);
  for (uint32_t q = 0; q < ep->nqp; q++)
    if (touched & (1ull << q))
      mc_rdma_post_some(t, &ep->qps[q]);
  mc_rdma_ep_put(t, ep);
}

static int canceled(const mc_rdma_wr_t *w) {
  atomic_int *c = w->req->op->cancel;
  return c && atomic_load(c);
}

void mc_rdma_cancel_sweep(mc_rdma_t *t) {
  size_t n;
  mc_rdma_ep_t **eps = mc_rdma_eps_hold(t, &n);
  for (size_t i = 0; i < n; i++) {
    mc_rdma_ep_t *ep = eps[i];
    for (uint32_t k = 0; k < ep->nqp; k++) {
      mc_rdma_qp_t *q = &ep->qps[k];
      mc_rdma_wr_t *fail = NULL, *fail_tail = NULL;
      int flush = 0;
      pthread_mutex_lock(&q->mu);
      for (mc_rdma_wr_t *w = q->pend_head, *nx; w; w = nx) {
        nx = w->next;
        if (canceled(w)) {
          list_remove(&q->pend_head, &q->pend_tail, w);
          list_push(&fail, &fail_tail, w);
        }
      }
      for (mc_rdma_wr_t *w = q->post_head; w && !flush; w = w->next)
        flush = canceled(w);
      if (flush && q->state == QP_UP) {
        q->state = QP_BROKEN;
        q->fail_code = MC_ECANCELED;
        snprintf(q->fail_msg, sizeof q->fail_msg,
                 "canceled while posted on %s QP %u (the QP was flushed and will be "
                 "reconnected)", q->nic->name, q->qp->qp_num);
        mc_rdma_qp_set_error(t, q);
      }
      pthread_mutex_unlock(&q->mu);
      if (flush)
        mc_rdma_ep_mark_broken(t, ep);
      while (fail) {
        mc_rdma_wr_t *nx = fail->next;
        mc_rdma_wr_complete(t, fail, MC_ECANCELED, "canceled before it was posted");
        fail = nx;
      }
    }
    mc_rdma_ep_put(t, ep);
  }
  free(eps);
}

void mc_rdma_wc(mc_rdma_t *t, const struct ibv_wc *wc) {
  mc_rdma_wr_t *w = (mc_rdma_wr_t *)(uintptr_t)wc->wr_id;
  mc_rdma_qp_t *q = w->qp;
  int code = 0, first = 0;
  char msg[MC_ERR_MSG_MAX] = "";
  pthread_mutex_lock(&q->mu);
  list_remove(&q->post_head, &q->post_tail, w);
  q->outstanding--;
  q->inflight_bytes -= w->len;
  if (wc->status != IBV_WC_SUCCESS) {
    if (wc->status == IBV_WC_WR_FLUSH_ERR && q->state != QP_UP) {
      code = q->fail_code;
      snprintf(msg, sizeof msg, "%s", q->fail_msg);
    } else {
      enum ibv_wc_status s = wc->status;
      code = s == IBV_WC_REM_ACCESS_ERR || s == IBV_WC_LOC_PROT_ERR || s == IBV_WC_REM_INV_REQ_ERR
                 ? MC_ERANGE
             : s == IBV_WC_RETRY_EXC_ERR || s == IBV_WC_RNR_RETRY_EXC_ERR ? MC_EPEERCLOSED
                                                                           : MC_EPROTO;
      const char *hint =
          code == MC_ERANGE ? " (the remote address or rkey is not valid there: memory "
                              "unregistered by the peer?)"
          : code == MC_EPEERCLOSED ? " (no answer from the peer within the retry timeout: "
                                     "its process exited, the link is down, or the GID is "
                                     "not routable)"
                                   : "";
      snprintf(msg, sizeof msg,
               "RDMA %s of %u bytes to segment %s (remote 0x%llx, rkey 0x%x) via %s QP %u -> "
               "%s QP %u failed: %s (wc status %d, vendor error 0x%x)%s",
               w->req->op->type == MC_XFER_WRITE ? "WRITE" : "READ", w->len,
               q->ep->segment, (unsigned long long)w->remote, w->rkey, q->nic->name,
               q->qp->qp_num, q->remote_nic, q->remote_qpn, t->v->wc_status_str(s), (int)s,
               wc->vendor_err, hint);
      if (q->state == QP_UP) {
        q->state = QP_BROKEN;
        q->fail_code = code;
        snprintf(q->fail_msg, sizeof q->fail_msg, "flushed after an earlier failure: %s", msg);
        first = 1;
      }
    }
  }
  pthread_mutex_unlock(&q->mu);
  atomic_fetch_sub(&t->inflight, 1);
  /* w's request keeps the endpoint (and q) alive until w completes, so
   * refill the send queue first, then complete w. */
  if (first) {
    mc_log_warn("rdma: %s; the endpoint will be reconnected", msg);
    mc_rdma_ep_mark_broken(t, q->ep);
  }
  mc_rdma_post_some(t, q);
  mc_rdma_wr_complete(t, w, code, msg);
}
