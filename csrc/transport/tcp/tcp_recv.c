/* Receiving side of a connection: a small state machine (header, body,
 * payload) that validates everything read from the network before acting
 * on it.  Payloads are scattered straight into their destinations. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "transport/tcp/tcp_internal.h"
#include "util/log.h"
#include "util/clock.h"
#include "util/rpc_conn.h"

#define READ_BUDGET (64u << 20) /* bytes per readiness event, for fairness */

static void resp_free_now(mc_tcp_t *t, mc_resp_t *r) {
  if (r->gbuf)
    mc_gpu_buf_put(t->hooks.gpu, r->gbuf);
  for (int i = 0; i < r->nrefs; i++)
    mc_regions_release(t->hooks.regions, r->refs[i]);
  free(r->refs);
  if (r->iov != r->small)
    free(r->iov);
  free(r->text);
  free(r);
}

/* Past the reply budget: this connection has replies queued and either
 * they alone or all connections' together exceed their limits. */
static int over_reply_budget(const mc_conn_t *c) {
  const mc_tcp_opts_t *o = &c->tcp->opts;
  return c->resp_bytes > 0 && (c->resp_bytes > o->reply_conn_limit ||
                               atomic_load(&c->tcp->reply_bytes) > o->reply_total_limit);
}

void mc_conn_resp_done(mc_conn_t *c, mc_resp_t *r) {
  c->resp_bytes -= r->cost;
  atomic_fetch_sub(&c->tcp->reply_bytes, r->cost);
  mc_resp_free(c->tcp, r);
  if (c->rx_paused && c->state == CONN_OPEN && !over_reply_budget(c)) {
    c->rx_paused = 0;
    c->rx_resume = 1;
    atomic_fetch_sub(&c->tcp->paused_conns, 1);
    mc_conn_update_events(c);
  }
}

void mc_resp_free(mc_tcp_t *t, mc_resp_t *r) {
  int pending = 1;
  if (atomic_compare_exchange_strong(&r->gate, &pending, 2))
    return; /* a GPU copy is in flight: the copy worker frees it */
  resp_free_now(t, r);
}

static void release_prefs(mc_conn_t *c) {
  for (int i = 0; i < c->pnrefs; i++)
    mc_regions_release(c->tcp->hooks.regions, c->prefs[i]);
  free(c->prefs);
  c->prefs = NULL;
  c->pnrefs = 0;
}

static void drop_pjob(mc_conn_t *c) {
  if (c->pjob) {
    mc_gpu_buf_put(c->tcp->hooks.gpu, c->pjob->buf);
    mc_gpu_job_free(c->pjob);
    c->pjob = NULL;
  }
}

void mc_conn_free_recv(mc_conn_t *c) {
  drop_pjob(c);
  release_prefs(c);
  free(c->body);
  c->body = NULL;
  free(c->piov);
  c->piov = NULL;
  free(c->rbuf);
  c->rbuf = NULL;
}

/* ---- responses (target side) ---- */

/* What a queued response holds: its node, its iovec array, and the bytes it
 * will send (text bodies are ours; READ data pins registered memory). */
static void queue_resp(mc_conn_t *c, mc_resp_t *r) {
  r->cost = sizeof *r + (r->iov != r->small ? (uint64_t)r->niov * sizeof *r->iov : 0) +
            mc_get_u64(r->hdr + 24);
  c->resp_bytes += r->cost;
  atomic_fetch_add(&c->tcp->reply_bytes, r->cost);
  r->next = NULL;
  if (c->resp_tail)
    c->resp_tail->next = r;
  else
    c->resp_head = r;
  c->resp_tail = r;
}

/* A response with no payload, or with `text` as body. Takes `text`. */
static int resp_simple(mc_conn_t *c, int type, int32_t status, char *text) {
  mc_resp_t *r = calloc(1, sizeof *r);
  if (!r) {
    free(text);
    mc_conn_kill(c, MC_ENOMEM, "out of memory answering %s", c->peer);
    return -1;
  }
  size_t tl = text ? strlen(text) : 0;
  mc_wire_hdr_t h = {.type = (uint8_t)type, .status = status, .req_id = c->rh.req_id,
                     .length = tl};
  mc_wire_encode(&h, r->hdr);
  r->text = text;
  r->iov = r->small;
  r->small[0] = (struct iovec){r->hdr, MC_WIRE_HDR_SIZE};
  r->niov = 1;
  if (tl) {
    r->small[1] = (struct iovec){text, tl};
    r->niov = 2;
  }
  queue_resp(c, r);
  return 0;
}

static int resp_error(mc_conn_t *c, int type, int code, const char *msg) {
  char *t = strdup(msg && *msg ? msg : mc_strerror(code));
  if (resp_simple(c, type, code, t) < 0)
    return -1;
  if (type == MC_WIRE_WRITE_ACK || type == MC_WIRE_READ_DATA) {
    /* Name the refused entry so the initiator can fail just that request. */
    mc_resp_t *r = c->resp_tail;
    mc_put_u32(r->hdr + 8, c->pbad);
  }
  return 0;
}

/* ---- helpers ---- */

static mc_xfer_op_t *pop_await(mc_conn_t *c) {
  mc_xfer_op_t *op = c->await_head;
  if (op) {
    c->await_head = op->next;
    if (!c->await_head)
      c->await_tail = NULL;
    op->next = NULL;
  }
  return op;
}

static int start_body(mc_conn_t *c, size_t len) {
  free(c->body);
  c->body = malloc(len + 1); /* +1: room for a NUL on text bodies */
  if (!c->body) {
    mc_conn_kill(c, MC_ENOMEM, "out of memory reading from %s", c->peer);
    return -1;
  }
  c->body_len = len;
  c->body_got = 0;
  c->rstate = RS_BODY;
  return 0;
}

static int expected_response(int req_type) {
  switch (req_type) {
  case MC_WIRE_HELLO: return MC_WIRE_HELLO_ACK;
  case MC_WIRE_WRITE: return MC_WIRE_WRITE_ACK;
  case MC_WIRE_READ: return MC_WIRE_READ_DATA;
  case MC_WIRE_NOTIFY: return MC_WIRE_NOTIFY_ACK;
  case MC_WIRE_RPC: return MC_WIRE_RPC_REPLY;
  default: return -1;
  }
}

/* Parses the entry table into (addr,len) pairs and pins each range.
 * On a range failure sets c->pstatus/perr and leaves nothing pinned. */
static int pin_table(mc_conn_t *c, uint64_t *sum_out) {
  uint32_t n = c->rh.count;
  uint64_t sum = 0;
  c->pstatus = 0;
  c->pbad = 0;
  c->perr[0] = '\0';
  free(c->piov);
  c->piov = malloc((size_t)n * sizeof *c->piov);
  c->prefs = malloc((size_t)n * sizeof *c->prefs);
  if (!c->piov || !c->prefs) {
    mc_conn_kill(c, MC_ENOMEM, "out of memory reading from %s", c->peer);
    return -1;
  }
  c->pnrefs = 0;
  for (uint32_t i = 0; i < n; i++) {
    uint64_t addr = mc_get_u64(c->body + 16 * i);
    uint64_t len = mc_get_u64(c->body + 16 * i + 8);
    if (sum + len < sum) {
      mc_conn_kill(c, MC_EPROTO, "entry lengths from %s overflow 64 bits", c->peer);
      return -1;
    }
    sum += len;
    if (c->pstatus == 0) {
      mc_err_t e;
      mc_region_t *reg;
      if (mc_regions_acquire_by(c->tcp->hooks.regions, addr, len, c->tcp->hooks.local_name,
                                c->peer, &reg, &e) < 0) {
        c->pstatus = e.code;
        c->pbad = i + 1;
        snprintf(c->perr, sizeof c->perr, "%s %s", mc_wire_type_name(c->rh.type), e.msg);
        release_prefs(c);
        c->prefs = malloc((size_t)n * sizeof *c->prefs);
        if (!c->prefs) {
          mc_conn_kill(c, MC_ENOMEM, "out of memory");
          return -1;
        }
      } else {
        c->prefs[c->pnrefs++] = reg;
        c->piov[i] = (struct iovec){(void *)(uintptr_t)addr, (size_t)len};
      }
    }
  }
  *sum_out = sum;
  return 0;
}

static void start_payload(mc_conn_t *c, uint64_t len, int discard) {
  c->pidx = 0;
  c->poff = 0;
  c->premain = len;
  c->pdiscard = discard;
  c->rstate = RS_PAYLOAD;
}

/* ---- GPU staging of cuda regions (target side) ---- */

/* The copy worker finished the copies a gated response waited for. */
static void target_job_done(mc_gpu_job_t *j, int code, const char *msg) {
  mc_resp_t *r = j->arg;
  mc_conn_t *c = j->arg2;
  if (code < 0) {
    /* Answer an error instead of data that never arrived / never left. */
    mc_log_warn("GPU staging for %s failed: %s", c->peer, msg ? msg : "");
    mc_put_u32(r->hdr + 12, (uint32_t)MC_EUNAVAIL);
    mc_put_u64(r->hdr + 24, 0);
    mc_put_u32(r->hdr + 8, 0);
    r->niov = 1;
    r->iov_idx = 0;
    r->iov_off = 0;
  }
  int pending = 1;
  if (atomic_compare_exchange_strong(&r->gate, &pending, 0))
    mc_loop_post(c->loop, CMD_KICK, c);
  else
    resp_free_now(c->tcp, r); /* the connection died meanwhile */
  mc_conn_unhold(c);
  mc_gpu_job_free(j);
}

/* Points the pinned entries that lie in cuda regions at one staging buffer
 * and prepares the copies (H2D for a WRITE payload, D2H for READ data).
 * 0: no cuda entry; 1: staged (c->pjob); <0: no staging possible (*e). */
static int stage_entries(mc_conn_t *c, int dir, mc_err_t *e) {
  uint64_t bytes = 0;
  int dev = -1;
  for (int i = 0; i < c->pnrefs; i++)
    if (c->prefs[i]->cuda_dev >= 0) {
      bytes += c->piov[i].iov_len;
      if (dev < 0)
        dev = c->prefs[i]->cuda_dev;
    }
  if (bytes == 0)
    return 0;
  if (!c->tcp->hooks.gpu)
    return mc_err_set(e, MC_EUNAVAIL, "segment %s has no GPU staging",
                      c->tcp->hooks.local_name);
  mc_gpu_buf_t *b = mc_gpu_buf_get(c->tcp->hooks.gpu, dev, bytes, e);
  mc_gpu_job_t *j = b ? mc_gpu_job_new(dev, dir) : NULL;
  if (!j) {
    mc_gpu_buf_put(c->tcp->hooks.gpu, b);
    return b ? mc_err_set(e, MC_ENOMEM, "out of memory") : e->code;
  }
  j->buf = b;
  uint64_t off = 0;
  for (int i = 0; i < c->pnrefs; i++) {
    if (c->prefs[i]->cuda_dev < 0)
      continue;
    char *host = (char *)b->p + off;
    mc_cu_ptr dptr = (mc_cu_ptr)(uintptr_t)c->piov[i].iov_base;
    size_t n = c->piov[i].iov_len;
    int rc = dir == MC_GPU_H2D ? mc_gpu_job_add(j, dptr, (mc_cu_ptr)(uintptr_t)host, n)
                               : mc_gpu_job_add(j, (mc_cu_ptr)(uintptr_t)host, dptr, n);
    if (rc < 0) {
      mc_gpu_buf_put(c->tcp->hooks.gpu, b);
      mc_gpu_job_free(j);
      return mc_err_set(e, MC_ENOMEM, "out of memory");
    }
    c->piov[i].iov_base = host;
    off += n;
  }
  c->pjob = j;
  return 1;
}

/* Hands the staged copies to the worker; `r` goes out once they are done. */
static void submit_staged(mc_conn_t *c, mc_resp_t *r) {
  mc_gpu_job_t *j = c->pjob;
  c->pjob = NULL;
  r->gbuf = j->buf;
  j->buf = NULL;
  atomic_store(&r->gate, 1);
  j->arg = r;
  j->arg2 = c;
  j->complete = target_job_done;
  mc_conn_hold(c);
  mc_gpu_stager_submit(c->tcp->hooks.gpu, j);
}

/* Hands a NOTIFY to the engine; a refusal (a budget is full) goes back to
 * the sender as the ACK's error. */
static int deliver_notify(mc_conn_t *c, const void *body) {
  mc_err_t e = {0};
  if (c->tcp->hooks.on_notify &&
      c->tcp->hooks.on_notify(c->tcp->hooks.ctx, c->segment, body, c->body_len, &e) < 0) {
    c->pbad = 0;
    return resp_error(c, MC_WIRE_NOTIFY_ACK, e.code ? e.code : MC_EBUSY, e.msg);
  }
  return resp_simple(c, MC_WIRE_NOTIFY_ACK, 0, NULL);
}

/* ---- header handling ---- */

static int on_header_initiator(mc_conn_t *c) {
  mc_xfer_op_t *op = c->await_head;
  if (!op || op->req_id != c->rh.req_id || expected_response(op->type) != c->rh.type) {
    mc_conn_kill(c, MC_EPROTO,
                 "unexpected %s (request id %llu) from %s; dropping the connection",
                 mc_wire_type_name(c->rh.type), (unsigned long long)c->rh.req_id, c->peer);
    return -1;
  }
  if (c->rh.status < 0 || c->rh.type == MC_WIRE_HELLO_ACK || c->rh.type == MC_WIRE_RPC_REPLY) {
    if (c->rh.length == 0 && c->rh.type == MC_WIRE_RPC_REPLY && c->rh.status == 0) {
      pop_await(c);
      mc_op_finalize(op, 0, NULL);
      mc_xfer_op_free(op);
      return 0;
    }
    if (c->rh.length == 0) {
      if (c->rh.status < 0) {
        pop_await(c);
        mc_op_finalize(op, c->rh.status, "refused by the target");
        mc_xfer_op_free(op);
        c->rstate = RS_HDR;
        return 0;
      }
      mc_conn_kill(c, MC_EPROTO, "empty HELLO_ACK from %s", c->peer);
      return -1;
    }
    return start_body(c, c->rh.length);
  }
  switch (c->rh.type) {
  case MC_WIRE_WRITE_ACK:
  case MC_WIRE_NOTIFY_ACK:
    if (c->rh.length != 0) {
      mc_conn_kill(c, MC_EPROTO, "%s with a body from %s", mc_wire_type_name(c->rh.type),
                   c->peer);
      return -1;
    }
    pop_await(c);
    mc_op_finalize(op, 0, NULL);
    mc_xfer_op_free(op);
    return 0;
  case MC_WIRE_READ_DATA: {
    if (c->rh.length != op->total) {
      mc_conn_kill(c, MC_EPROTO, "READ_DATA of %llu bytes from %s, expected %llu",
                   (unsigned long long)c->rh.length, c->peer, (unsigned long long)op->total);
      return -1;
    }
    free(c->piov);
    c->piov = malloc((size_t)op->nent * sizeof *c->piov);
    if (!c->piov) {
      mc_conn_kill(c, MC_ENOMEM, "out of memory");
      return -1;
    }
    for (uint32_t i = 0; i < op->nent; i++)
      c->piov[i] = (struct iovec){op->ent[i].local, (size_t)op->ent[i].len};
    c->pniov = (int)op->nent;
    start_payload(c, op->total, op->finalized);
    return 0;
  }
  default:
    mc_conn_kill(c, MC_EPROTO, "unexpected %s from %s", mc_wire_type_name(c->rh.type), c->peer);
    return -1;
  }
}

static int on_header_target(mc_conn_t *c) {
  if (!c->hello_ok && c->rh.type != MC_WIRE_HELLO) {
    /* The HELLO's refusal (wrong segment, authentication) goes out first:
     * the peer learns why, not just that the connection closed. */
    mc_conn_flush(c);
    mc_conn_kill(c, MC_EPROTO, "first message from %s is %s, not HELLO; dropping",
                 c->peer, mc_wire_type_name(c->rh.type));
    return -1;
  }
  if (!c->hello_ok && c->rh.length > MC_TCP_HELLO_MAX) {
    mc_conn_kill(c, MC_EPROTO, "HELLO of %llu bytes from %s (at most %d); dropping",
                 (unsigned long long)c->rh.length, c->peer, MC_TCP_HELLO_MAX);
    return -1;
  }
  if (c->prehandshake && !atomic_load(&c->pre_hello_ns)) /* a HELLO is being read: */
    atomic_store(&c->pre_hello_ns, mc_now_ns());        /* not evicted for a while */
  switch (c->rh.type) {
  case MC_WIRE_HELLO:
  case MC_WIRE_NOTIFY:
  case MC_WIRE_RPC:
    if (c->rh.length == 0 && c->rh.type == MC_WIRE_RPC)
      return resp_error(c, MC_WIRE_RPC_REPLY, MC_EPROTO, "empty RPC request");
    if (c->rh.length == 0 && c->rh.type == MC_WIRE_NOTIFY) {
      c->body_len = 0;
      return deliver_notify(c, "");
    }
    return start_body(c, c->rh.length);
  case MC_WIRE_WRITE:
  case MC_WIRE_READ:
    return start_body(c, (size_t)c->rh.count * MC_WIRE_ENT_SIZE);
  default:
    mc_conn_kill(c, MC_EPROTO, "unexpected %s from %s", mc_wire_type_name(c->rh.type), c->peer);
    return -1;
  }
}

/* ---- body handling ---- */

static int on_body_initiator(mc_conn_t *c) {
  mc_xfer_op_t *op = c->await_head;
  c->body[c->body_len] = '\0';
  c->rstate = RS_HDR;
  if (c->rh.type == MC_WIRE_HELLO_ACK && c->rh.status == 0) {
    cJSON *j = cJSON_ParseWithLength((const char *)c->body, c->body_len);
    const cJSON *seg = j ? cJSON_GetObjectItemCaseSensitive(j, "segment") : NULL;
    if (!cJSON_IsString(seg)) {
      cJSON_Delete(j);
      mc_conn_kill(c, MC_EPROTO, "malformed HELLO_ACK from %s", c->peer);
      return -1;
    }
    int same = strcmp(seg->valuestring, c->segment) == 0;
    char got[320];
    snprintf(got, sizeof got, "%s", seg->valuestring);
    mc_err_t ae = {0};
    int arc = same || !c->segment[0] ? mc_auth_initiator_ack(c, j, got, &ae) : 0;
    cJSON_Delete(j);
    if (!same && c->segment[0]) {
      mc_conn_kill(c, MC_ENOTFOUND, "%s serves segment \"%s\", not \"%s\"", c->peer, got,
                   c->segment);
      return -1;
    }
    if (arc < 0) {
      mc_conn_kill(c, ae.code, "%s", ae.msg);
      return -1;
    }
    c->hello_ok = 1;
    pop_await(c);
    mc_xfer_op_free(op);
    return 0;
  }
  if (c->rh.type == MC_WIRE_RPC_REPLY && c->rh.status == 0) {
    pop_await(c);
    op->resp = (char *)c->body; /* NUL-terminated above */
    op->resp_len = c->body_len;
    c->body = NULL;
    mc_op_finalize(op, 0, NULL);
    mc_xfer_op_free(op);
    return 0;
  }
  /* An error text for the op at the head. */
  if (op->type == MC_WIRE_HELLO) {
    mc_conn_kill(c, c->rh.status, "%s refused the connection: %.300s", c->peer,
                 (char *)c->body);
    return -1;
  }
  char msg[MC_ERR_MSG_MAX];
  snprintf(msg, sizeof msg, "target %s refused: %.400s", c->segment, (char *)c->body);
  pop_await(c);
  uint32_t bad = c->rh.count;
  if (bad >= 1 && bad <= op->nent && op->entry_failed && !op->finalized) {
    /* Fail the one refused entry; resend the others. */
    op->entry_failed(op, bad - 1, c->rh.status, msg);
    memmove(op->ent + bad - 1, op->ent + bad, (op->nent - bad) * sizeof *op->ent);
    op->nent--;
    op->started = 0;
    mc_err_t e;
    if (op->nent == 0) {
      mc_op_finalize(op, 0, NULL);
      mc_xfer_op_free(op);
    } else if (mc_xfer_op_seal(op, &e) < 0 || mc_tcp_op_encode(op, &e) < 0) {
      mc_op_finalize(op, e.code, e.msg);
      mc_xfer_op_free(op);
    } else {
      mc_conn_enqueue_op(c, op);
    }
    return 0;
  }
  mc_op_finalize(op, c->rh.status, msg);
  mc_xfer_op_free(op);
  return 0;
}

static int on_body_target(mc_conn_t *c) {
  c->rstate = RS_HDR;
  switch (c->rh.type) {
  case MC_WIRE_HELLO: {
    c->body[c->body_len] = '\0';
    cJSON *j = cJSON_ParseWithLength((const char *)c->body, c->body_len);
    const cJSON *seg = j ? cJSON_GetObjectItemCaseSensitive(j, "segment") : NULL;
    const cJSON *from = j ? cJSON_GetObjectItemCaseSensitive(j, "from") : NULL;
    if (!cJSON_IsString(seg)) {
      cJSON_Delete(j);
      mc_conn_kill(c, MC_EPROTO, "malformed HELLO from %s", c->peer);
      return -1;
    }
    if (cJSON_IsString(from) && !c->auth_state)
      snprintf(c->segment, sizeof c->segment, "%s", from->valuestring);
    const char *local = c->tcp->hooks.local_name;
    if (seg->valuestring[0] && strcmp(seg->valuestring, local) != 0) {
      char msg[MC_ERR_MSG_MAX];
      snprintf(msg, sizeof msg, "this port serves segment \"%s\", not \"%.200s\"", local,
               seg->valuestring);
      cJSON_Delete(j);
      return resp_error(c, MC_WIRE_HELLO_ACK, MC_ENOTFOUND, msg);
    }
    if (c->tcp->hooks.auth_secret && c->tcp->hooks.auth_secret[0]) {
      char *txt;
      mc_err_t ae = {0};
      int arc = mc_auth_target_hello(c, j, &txt, &ae);
      cJSON_Delete(j);
      if (arc < 0) {
        mc_log_warn_rated("%s", ae.msg); /* any host can fail a handshake at will */
        return resp_error(c, MC_WIRE_HELLO_ACK, ae.code, ae.msg);
      }
      return resp_simple(c, MC_WIRE_HELLO_ACK, 0, txt);
    }
    mc_auth_target_plain(c, j);
    cJSON_Delete(j);
    if (mc_conn_prehandshake_done(c)) { /* evicted: its initiator dials again */
      mc_conn_kill(c, MC_EPEERCLOSED, "a HELLO from %s arrived after its connection was "
                   "dropped (MC_TCP_MAX_PREHANDSHAKE)", c->peer);
      return -1;
    }
    c->hello_ok = 1;
    cJSON *r = cJSON_CreateObject();
    char *txt = NULL;
    if (r && cJSON_AddStringToObject(r, "segment", local))
      txt = cJSON_PrintUnformatted(r);
    cJSON_Delete(r);
    if (!txt) {
      mc_conn_kill(c, MC_ENOMEM, "out of memory");
      return -1;
    }
    return resp_simple(c, MC_WIRE_HELLO_ACK, 0, txt);
  }
  case MC_WIRE_NOTIFY:
    return deliver_notify(c, c->body);
  case MC_WIRE_RPC: {
    c->body[c->body_len] = '\0';
    if (!c->tcp->hooks.on_rpc)
      return resp_error(c, MC_WIRE_RPC_REPLY, MC_EUNAVAIL,
                        "this engine serves no RPCs (is it running the same protocol?)");
    char *reply = NULL;
    mc_err_t e = {0};
    mc_rpc_conn_set(c->fd); /* the handler may bind its answer to this connection */
    int rrc = c->tcp->hooks.on_rpc(c->tcp->hooks.ctx, c->segment, (const char *)c->body,
                                   c->body_len, &reply, &e);
    mc_rpc_conn_set(-1);
    if (rrc < 0)
      return resp_error(c, MC_WIRE_RPC_REPLY, e.code ? e.code : MC_EPROTO, e.msg);
    return resp_simple(c, MC_WIRE_RPC_REPLY, 0, reply);
  }
  case MC_WIRE_WRITE: {
    uint64_t sum;
    if (pin_table(c, &sum) < 0)
      return -1;
    if (sum != c->rh.length - (uint64_t)c->rh.count * MC_WIRE_ENT_SIZE) {
      mc_conn_kill(c, MC_EPROTO, "WRITE from %s announces %llu payload bytes but its "
                   "entries sum to %llu", c->peer,
                   (unsigned long long)(c->rh.length - (uint64_t)c->rh.count * 16),
                   (unsigned long long)sum);
      return -1;
    }
    c->pniov = (int)c->rh.count;
    if (c->pstatus == 0) {
      mc_err_t e;
      if (stage_entries(c, MC_GPU_H2D, &e) < 0) {
        c->pstatus = e.code;
        c->pbad = 0; /* the whole message */
        snprintf(c->perr, sizeof c->perr, "WRITE into GPU memory: %s", e.msg);
        release_prefs(c);
      }
    }
    start_payload(c, sum, c->pstatus != 0);
    if (sum == 0) {
      c->rstate = RS_HDR;
      release_prefs(c);
      return c->pstatus ? resp_error(c, MC_WIRE_WRITE_ACK, c->pstatus, c->perr)
                        : resp_simple(c, MC_WIRE_WRITE_ACK, 0, NULL);
    }
    return 0;
  }
  case MC_WIRE_READ: {
    uint64_t sum;
    if (pin_table(c, &sum) < 0)
      return -1;
    if (c->pstatus) {
      release_prefs(c);
      return resp_error(c, MC_WIRE_READ_DATA, c->pstatus, c->perr);
    }
    mc_err_t se;
    if (stage_entries(c, MC_GPU_D2H, &se) < 0) {
      release_prefs(c);
      c->pbad = 0;
      return resp_error(c, MC_WIRE_READ_DATA, se.code, se.msg);
    }
    mc_resp_t *r = calloc(1, sizeof *r);
    if (!r || !(r->iov = malloc(((size_t)c->rh.count + 1) * sizeof *r->iov))) {
      free(r);
      drop_pjob(c);
      mc_conn_kill(c, MC_ENOMEM, "out of memory");
      return -1;
    }
    mc_wire_hdr_t h = {.type = MC_WIRE_READ_DATA, .req_id = c->rh.req_id, .length = sum};
    mc_wire_encode(&h, r->hdr);
    r->iov[0] = (struct iovec){r->hdr, MC_WIRE_HDR_SIZE};
    memcpy(r->iov + 1, c->piov, (size_t)c->rh.count * sizeof *r->iov);
    r->niov = (int)c->rh.count + 1;
    r->refs = c->prefs; /* pinned until the data is sent */
    r->nrefs = c->pnrefs;
    c->prefs = NULL;
    c->pnrefs = 0;
    queue_resp(c, r);
    if (c->pjob)
      submit_staged(c, r); /* sent once the D2H copies are done */
    return 0;
  }
  default:
    return 0;
  }
}

static int on_payload_done(mc_conn_t *c) {
  c->rstate = RS_HDR;
  if (c->outgoing) {
    mc_xfer_op_t *op = pop_await(c);
    if (op) {
      mc_op_finalize(op, 0, NULL);
      mc_xfer_op_free(op);
    }
    return 0;
  }
  if (c->pjob && c->pstatus == 0) {
    /* Payload staged in pinned memory: acknowledge once it is on the GPU;
     * the regions stay pinned until then. */
    if (resp_simple(c, MC_WIRE_WRITE_ACK, 0, NULL) < 0)
      return -1;
    mc_resp_t *r = c->resp_tail;
    r->refs = c->prefs;
    r->nrefs = c->pnrefs;
    c->prefs = NULL;
    c->pnrefs = 0;
    submit_staged(c, r);
    return 0;
  }
  drop_pjob(c);
  release_prefs(c);
  if (c->pstatus)
    return resp_error(c, MC_WIRE_WRITE_ACK, c->pstatus, c->perr);
  return resp_simple(c, MC_WIRE_WRITE_ACK, 0, NULL);
}

/* ---- the read loop ---- */

/* Reads more bytes into rbuf. >0 bytes, 0 on EOF, -errno otherwise. */
static ssize_t fill(mc_conn_t *c, size_t want) {
  if (c->rpos == c->rlen) {
    c->rpos = c->rlen = 0;
  } else if (c->rpos > 0 && MC_TCP_RBUF - c->rlen < MC_WIRE_HDR_SIZE) {
    memmove(c->rbuf, c->rbuf + c->rpos, c->rlen - c->rpos);
    c->rlen -= c->rpos;
    c->rpos = 0;
  }
  /* Read no more than asked (rounded up to a small chunk) so that payload
   * bytes mostly land straight in their destination instead of being
   * copied out of rbuf. */
  size_t room = MC_TCP_RBUF - c->rlen;
  /* After small messages, read more at once so that the next small message
   * (header, table and payload) arrives in one read; during bulk transfers
   * read little beyond the header, so payloads land in place. */
  size_t min_read = c->small_msgs ? 16384 : 4096;
  if (want < min_read)
    want = min_read;
  if (want < room)
    room = want;
  for (;;) {
    ssize_t n = read(c->fd, c->rbuf + c->rlen, room);
    if (n > 0)
      c->rlen += (size_t)n;
    c->drained = n >= 0 && (size_t)n < room;
    if (n >= 0)
      return n;
    if (errno == EINTR)
      continue;
    return -errno;
  }
}

static int read_failed(mc_conn_t *c, ssize_t n) {
  if (n == 0)
    mc_conn_kill(c, MC_EPEERCLOSED, "connection to %s closed by the peer%s", c->peer,
                 c->rstate == RS_HDR ? "" : " in the middle of a message");
  else
    mc_conn_kill(c, MC_EPEERCLOSED, "read from %s failed: %s", c->peer, strerror((int)-n));
  return -1;
}

/* Copies/reads payload bytes into the scatter list (or drops them). */
static int payload_step(mc_conn_t *c, size_t *budget) {
  /* Bytes already buffered first. */
  while (c->premain && c->rpos < c->rlen) {
    size_t avail = c->rlen - c->rpos;
    size_t want = c->premain < avail ? (size_t)c->premain : avail;
    if (!c->pdiscard) {
      size_t room = c->piov[c->pidx].iov_len - c->poff;
      if (want > room)
        want = room;
      memcpy((char *)c->piov[c->pidx].iov_base + c->poff, c->rbuf + c->rpos, want);
      c->poff += want;
      if (c->poff == c->piov[c->pidx].iov_len) {
        c->pidx++;
        c->poff = 0;
      }
    }
    c->rpos += want;
    c->premain -= want;
  }
  while (c->premain && *budget) {
    ssize_t n;
    if (c->pdiscard) {
      size_t want = c->premain < MC_TCP_RBUF ? (size_t)c->premain : MC_TCP_RBUF;
      n = read(c->fd, c->rbuf, want);
    } else {
      struct iovec v[64];
      int k = 0;
      uint64_t acc = 0;
      for (int i = c->pidx; i < c->pniov && k < 64 && acc < c->premain; i++, k++) {
        size_t o = (i == c->pidx) ? c->poff : 0;
        v[k] = (struct iovec){(char *)c->piov[i].iov_base + o, c->piov[i].iov_len - o};
        acc += v[k].iov_len;
      }
      n = readv(c->fd, v, k);
    }
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
      return 1;
    if (n <= 0)
      return read_failed(c, n < 0 ? -errno : 0);
    c->premain -= (uint64_t)n;
    *budget = (size_t)n >= *budget ? 0 : *budget - (size_t)n;
    if (!c->pdiscard) {
      size_t left = (size_t)n;
      while (left) {
        size_t room = c->piov[c->pidx].iov_len - c->poff;
        size_t step = left < room ? left : room;
        c->poff += step;
        left -= step;
        if (c->poff == c->piov[c->pidx].iov_len) {
          c->pidx++;
          c->poff = 0;
        }
      }
    }
  }
  if (c->premain)
    return *budget ? 1 : 2;
  return on_payload_done(c) < 0 ? -1 : 0;
}

int mc_conn_on_readable(mc_conn_t *c) {
  size_t budget = READ_BUDGET;
  c->drained = 0; /* we were told there is something to read */
  while (c->state == CONN_OPEN && budget) {
    if (c->rstate == RS_HDR) {
      if (!c->outgoing && over_reply_budget(c)) {
      /* Backpressure: stop reading a peer that does not read its replies
       * (resumed by mc_conn_resp_done once they drain). */
      if (!c->rx_paused) {
        c->rx_paused = 1;
        atomic_fetch_add(&c->tcp->paused_conns, 1);
        mc_conn_update_events(c);
      }
      break;
    }
    if (c->rlen - c->rpos < MC_WIRE_HDR_SIZE) {
        if (c->drained && c->small_msgs && c->rpos == c->rlen)
          break; /* the last read emptied the socket: wait for epoll */
        ssize_t n = fill(c, MC_WIRE_HDR_SIZE);
        if (n == -EAGAIN || n == -EWOULDBLOCK)
          break;
        if (n <= 0)
          return read_failed(c, n);
        continue;
      }
      mc_err_t e;
      if (mc_wire_decode(c->rbuf + c->rpos, c->outgoing, &c->rh, &e) < 0) {
        mc_conn_kill(c, MC_EPROTO, "invalid message from %s: %s; dropping the connection",
                     c->peer, e.msg);
        return -1;
      }
      c->rpos += MC_WIRE_HDR_SIZE;
      c->small_msgs = c->rh.length <= 12288;
      int rc = c->outgoing ? on_header_initiator(c) : on_header_target(c);
      if (rc < 0)
        return -1;
    } else if (c->rstate == RS_BODY) {
      size_t avail = c->rlen - c->rpos;
      size_t want = c->body_len - c->body_got;
      if (avail) {
        size_t k = want < avail ? want : avail;
        memcpy(c->body + c->body_got, c->rbuf + c->rpos, k);
        c->rpos += k;
        c->body_got += k;
      } else if (want) {
        ssize_t n = fill(c, want);
        if (n == -EAGAIN || n == -EWOULDBLOCK)
          break;
        if (n <= 0)
          return read_failed(c, n);
        continue;
      }
      if (c->body_got == c->body_len) {
        int rc = c->outgoing ? on_body_initiator(c) : on_body_target(c);
        if (rc < 0)
          return -1;
      }
    } else {
      int rc = payload_step(c, &budget);
      if (rc < 0)
        return -1;
      if (rc == 1)
        break; /* EAGAIN */
    }
  }
  if (c->state != CONN_OPEN)
    return -1;
  return mc_conn_flush(c);
}

const mc_region_t *mc_conn_revoked_region(const mc_conn_t *c) {
  for (const mc_resp_t *r = c->resp_head; r; r = r->next)
    for (int i = 0; i < r->nrefs; i++)
      if (__atomic_load_n(&r->refs[i]->revoked, __ATOMIC_ACQUIRE))
        return r->refs[i];
  for (int i = 0; i < c->pnrefs; i++)
    if (__atomic_load_n(&c->prefs[i]->revoked, __ATOMIC_ACQUIRE))
      return c->prefs[i];
  return NULL;
}
