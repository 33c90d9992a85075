/* Sending side of a connection: building requests and gathering queued
 * requests/responses into as few sendmsg() calls as possible. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "transport/tcp/tcp_internal.h"
#include "util/log.h"

static void opw_free(void *w) { free(w); }

int mc_tcp_op_encode(mc_xfer_op_t *op, mc_err_t *err) {
  mc_xfer_op_drop_tp(op);
  mc_wire_hdr_t h = {.type = (uint8_t)op->type};
  int niov = 1;
  size_t tlen = 0;
  int data = op->type == MC_WIRE_WRITE || op->type == MC_WIRE_READ;
  if (data) {
    if (op->nent == 0 || op->nent > MC_WIRE_MAX_ENTRIES)
      return mc_err_set(err, MC_EINVAL, "an op must carry 1..%u entries", MC_WIRE_MAX_ENTRIES);
    tlen = (size_t)op->nent * MC_WIRE_ENT_SIZE;
    h.count = op->nent;
    h.length = tlen;
    niov = 2;
    if (op->type == MC_WIRE_WRITE) {
      h.length += op->total;
      niov += (int)op->nent;
    }
  } else {
    h.length = op->ctrl_len;
    niov = op->ctrl_len ? 2 : 1;
  }
  /* One allocation: the state, the iovecs, then the table. */
  mc_tcp_opw_t *w = malloc(sizeof *w + (size_t)niov * sizeof(struct iovec) + tlen);
  if (!w)
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  w->iov = (struct iovec *)(w + 1);
  w->table = tlen ? (uint8_t *)(w->iov + niov) : NULL;
  w->niov = niov;
  w->iov_idx = 0;
  w->iov_off = 0;
  mc_wire_encode(&h, w->hdr);
  w->iov[0] = (struct iovec){w->hdr, MC_WIRE_HDR_SIZE};
  if (data) {
    for (uint32_t i = 0; i < op->nent; i++) {
      mc_put_u64(w->table + 16 * i, op->ent[i].remote);
      mc_put_u64(w->table + 16 * i + 8, op->ent[i].len);
    }
    w->iov[1] = (struct iovec){w->table, tlen};
    if (op->type == MC_WIRE_WRITE)
      for (uint32_t i = 0; i < op->nent; i++)
        w->iov[2 + i] = (struct iovec){op->ent[i].local, op->ent[i].len};
  } else if (op->ctrl_len) {
    w->iov[1] = (struct iovec){op->ctrl, op->ctrl_len};
  }
  op->tp = w;
  op->tp_free = opw_free;
  return 0;
}

void mc_op_finalize(mc_xfer_op_t *op, int code, const char *msg) {
  if (op->finalized)
    return;
  op->finalized = 1;
  /* The flag lives in the submitter's memory, which may be freed as soon as
   * done() returns, while a finalized op can stay queued (a reply still to
   * be read past): nothing may look at it after this point. */
  op->cancel = NULL;
  if (op->done)
    op->done(op, code, msg);
}

/* Request ids are stamped into the header when the op enters the send
 * queue, so they follow send order. */
static void stamp_req_id(mc_conn_t *c, mc_xfer_op_t *op) {
  op->req_id = ++c->next_req_id;
  mc_put_u64(MC_OPW(op)->hdr + 16, op->req_id);
}

/* Gathers iovecs from a chain of (iov, niov, idx, off) items. */
typedef struct gather {
  struct iovec v[MC_TCP_IOV_BATCH];
  int n;
} gather_t;

static int gather_add(gather_t *g, const struct iovec *iov, int niov, int idx, size_t off) {
  for (int i = idx; i < niov && g->n < MC_TCP_IOV_BATCH; i++) {
    size_t o = (i == idx) ? off : 0;
    if (iov[i].iov_len == o)
      continue;
    g->v[g->n++] = (struct iovec){(char *)iov[i].iov_base + o, iov[i].iov_len - o};
  }
  return g->n < MC_TCP_IOV_BATCH;
}

/* Advances (idx, off) over `n` bytes; returns bytes left unconsumed. */
static size_t advance(const struct iovec *iov, int niov, int *idx, size_t *off, size_t n) {
  while (*idx < niov) {
    size_t left = iov[*idx].iov_len - *off;
    if (n < left) {
      *off += n;
      return 0;
    }
    n -= left;
    (*idx)++;
    *off = 0;
  }
  return n;
}

static ssize_t send_gather(mc_conn_t *c, gather_t *g) {
  struct msghdr mh = {.msg_iov = g->v, .msg_iovlen = (size_t)g->n};
  for (;;) {
    ssize_t n = sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0)
      return n;
    if (errno == EINTR)
      continue;
    return -errno;
  }
}

/* Sends what g gathered: the bytes sent, SEND_BLOCKED (the socket is
 * full: EPOLLOUT armed, the loop calls again) or SEND_KILLED. */
enum { SEND_BLOCKED = -1, SEND_KILLED = -2 };
static inline ssize_t send_out(mc_conn_t *c, gather_t *g) {
  ssize_t n = send_gather(c, g);
  if (n == -EAGAIN || n == -EWOULDBLOCK) {
    mc_conn_set_out(c, 1);
    return SEND_BLOCKED;
  }
  if (n < 0) {
    mc_conn_kill(c, MC_EPEERCLOSED, "send to %s failed: %s", c->peer, strerror((int)-n));
    return SEND_KILLED;
  }
  return n;
}

/* Outgoing connection: drops queued ops canceled before their first byte
 * left. */
static void drop_canceled(mc_conn_t *c) {
  while (c->sendq_head && !c->sendq_head->started && c->sendq_head->cancel &&
         atomic_load(c->sendq_head->cancel)) {
    mc_xfer_op_t *op = c->sendq_head;
    c->sendq_head = op->next;
    if (!c->sendq_head)
      c->sendq_tail = NULL;
    mc_op_finalize(op, MC_ECANCELED, "canceled before it was sent");
    mc_xfer_op_free(op);
  }
}

/* Outgoing connection: the queued requests' bytes, in order. */
static void gather_requests(mc_conn_t *c, gather_t *g) {
  for (mc_xfer_op_t *op = c->sendq_head; op; op = op->next) {
    if (op != c->sendq_head && !op->started && op->cancel && atomic_load(op->cancel))
      break; /* let drop_canceled drop it */
    if (c->auth_hold && op->type != MC_WIRE_HELLO)
      break; /* not before the target proved it knows the secret */
    if (!gather_add(g, MC_OPW(op)->iov, MC_OPW(op)->niov, MC_OPW(op)->iov_idx,
                    MC_OPW(op)->iov_off))
      break;
  }
}

/* Outgoing connection: `left` bytes went out; fully sent requests now wait
 * for their responses. */
static void sent_requests(mc_conn_t *c, size_t left) {
  while (c->sendq_head) {
    mc_xfer_op_t *op = c->sendq_head;
    if (left > 0)
      op->started = 1;
    mc_tcp_opw_t *w = MC_OPW(op);
    left = advance(w->iov, w->niov, &w->iov_idx, &w->iov_off, left);
    if (w->iov_idx < w->niov)
      break;
    c->sendq_head = op->next;
    if (!c->sendq_head)
      c->sendq_tail = NULL;
    op->next = NULL;
    if (c->await_tail)
      c->await_tail->next = op;
    else
      c->await_head = op;
    c->await_tail = op;
  }
}

/* Incoming connection: the queued responses' bytes, up to the first one
 * whose GPU copy is still in flight. */
static void gather_responses(mc_conn_t *c, gather_t *g) {
  for (mc_resp_t *r = c->resp_head; r; r = r->next)
    if (atomic_load(&r->gate) || !gather_add(g, r->iov, r->niov, r->iov_idx, r->iov_off))
      break;
}

/* Incoming connection: `left` bytes went out; fully sent responses are done. */
static void sent_responses(mc_conn_t *c, size_t left) {
  while (c->resp_head) {
    mc_resp_t *r = c->resp_head;
    left = advance(r->iov, r->niov, &r->iov_idx, &r->iov_off, left);
    if (r->iov_idx < r->niov)
      break;
    c->resp_head = r->next;
    if (!c->resp_head)
      c->resp_tail = NULL;
    mc_conn_resp_done(c, r);
  }
}

/* Sends what is queued (requests on an outgoing connection, responses on an
 * incoming one) until done or the socket is full.  0, or -1 (conn killed). */
int mc_conn_flush(mc_conn_t *c) {
  if (c->state != CONN_OPEN)
    return 0;
  for (;;) {
    gather_t g;
    g.n = 0;
    if (c->outgoing) {
      drop_canceled(c);
      gather_requests(c, &g);
    } else {
      gather_responses(c, &g);
    }
    if (g.n == 0)
      break;
    ssize_t n = send_out(c, &g);
    if (n < 0)
      return n == SEND_BLOCKED ? 0 : -1;
    if (c->outgoing)
      sent_requests(c, (size_t)n);
    else
      sent_responses(c, (size_t)n);
  }
  mc_conn_set_out(c, 0);
  return 0;
}

/* Used by the loop when draining the inbox (and to resend an op). */
void mc_conn_enqueue_op(mc_conn_t *c, mc_xfer_op_t *op) {
  op->next = NULL;
  stamp_req_id(c, op);
  if (c->sendq_tail)
    c->sendq_tail->next = op;
  else
    c->sendq_head = op;
  c->sendq_tail = op;
}
