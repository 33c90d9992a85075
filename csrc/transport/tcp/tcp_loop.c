/* Event loops, connection lifecycle and the peer table of the TCP
 * transport. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <linux/sockios.h>

#include "transport/tcp/tcp_internal.h"
#include "util/array.h"
#include "util/clock.h"
#include "util/log.h"

/* The listener's epoll tag; connections use their mc_conn_t pointer. */
static char listener_tag;
static char eventfd_tag;

/* ---- commands ---- */

static int loop_post_arg(mc_loop_t *l, int kind, mc_conn_t *c, void *arg) {
  mc_cmd_t *cmd = malloc(sizeof *cmd);
  if (!cmd) {
    mc_log_error("out of memory posting to I/O thread %d", l->idx);
    return -1;
  }
  cmd->kind = kind;
  cmd->conn = c;
  cmd->arg = arg;
  cmd->next = NULL;
  pthread_mutex_lock(&l->mu);
  if (c)
    c->cmd_refs++;
  int was_empty = l->cmd_head == NULL;
  if (l->cmd_tail)
    l->cmd_tail->next = cmd;
  else
    l->cmd_head = cmd;
  l->cmd_tail = cmd;
  pthread_mutex_unlock(&l->mu);
  if (was_empty) {
    uint64_t one = 1;
    ssize_t r;
    do {
      r = write(l->evfd, &one, sizeof one);
    } while (r < 0 && errno == EINTR);
  }
  return 0;
}

void mc_loop_post(mc_loop_t *l, int kind, mc_conn_t *c) { loop_post_arg(l, kind, c, NULL); }

/* ---- connections ---- */

void mc_conn_hold(mc_conn_t *c) {
  pthread_mutex_lock(&c->loop->mu);
  c->cmd_refs++;
  pthread_mutex_unlock(&c->loop->mu);
}

void mc_conn_unhold(mc_conn_t *c) {
  pthread_mutex_lock(&c->loop->mu);
  c->cmd_refs--;
  pthread_mutex_unlock(&c->loop->mu);
}

int mc_conn_loop_acquire(mc_conn_t *c) {
  pthread_mutex_lock(&c->mu);
  int ok = !c->owner_caller;
  if (ok)
    c->loop_busy = 1;
  pthread_mutex_unlock(&c->mu);
  return ok;
}

void mc_conn_loop_release(mc_conn_t *c) {
  pthread_mutex_lock(&c->mu);
  c->loop_busy = 0;
  pthread_mutex_unlock(&c->mu);
}

void mc_conn_set_out(mc_conn_t *c, int on) {
  if (c->want_out == on || c->state == CONN_DEAD)
    return;
  if (c->owner_caller) { /* applied when the caller hands the conn back */
    c->want_out = on;
    return;
  }
  struct epoll_event ev = {.events = (c->rx_paused ? 0 : EPOLLIN) | (on ? EPOLLOUT : 0),
                           .data.ptr = c};
  if (epoll_ctl(c->loop->epfd, EPOLL_CTL_MOD, c->fd, &ev) == 0)
    c->want_out = on;
}

void mc_conn_update_events(mc_conn_t *c) {
  if (c->state == CONN_DEAD || c->owner_caller)
    return;
  struct epoll_event ev = {.events = (c->rx_paused ? 0 : EPOLLIN) | (c->want_out ? EPOLLOUT : 0),
                           .data.ptr = c};
  epoll_ctl(c->loop->epfd, EPOLL_CTL_MOD, c->fd, &ev);
}

static void pre_unlink(mc_tcp_t *t, mc_conn_t *c) {
  if (c->pre_prev)
    c->pre_prev->pre_next = c->pre_next;
  else
    t->pre_head = c->pre_next;
  if (c->pre_next)
    c->pre_next->pre_prev = c->pre_prev;
  else
    t->pre_tail = c->pre_prev;
  c->pre_prev = c->pre_next = NULL;
}

/* Returns 1 when the connection had been evicted (its socket shut down):
 * a HELLO that arrives on it must not be answered, nor anything after it
 * served, so that its initiator may dial again and resend all of it. */
int mc_conn_prehandshake_done(mc_conn_t *c) {
  int evicted = 0;
  if (c->prehandshake) {
    mc_tcp_t *t = c->tcp;
    pthread_mutex_lock(&t->pre_mu);
    if (c->pre_evicted) {
      atomic_fetch_sub(&t->pre_evicting, 1);
      evicted = 1;
    } else {
      pre_unlink(t, c);
      atomic_fetch_sub(&t->prehandshake, 1);
    }
    pthread_mutex_unlock(&t->pre_mu);
    c->prehandshake = 0;
  }
  return evicted;
}

void mc_tcp_get_stats(mc_tcp_t *t, mc_tcp_stats_t *out) {
  out->reply_bytes = atomic_load(&t->reply_bytes);
  out->paused_conns = (uint64_t)atomic_load(&t->paused_conns);
  out->prehandshake = (uint64_t)atomic_load(&t->prehandshake);
  out->prehandshake_refused = atomic_load(&t->prehandshake_refused);
  out->prehandshake_evicted = atomic_load(&t->prehandshake_evicted);
  out->redials = atomic_load(&t->redials);
  out->conn_bytes_each = MC_TCP_RBUF + MC_TCP_HELLO_MAX + sizeof(mc_conn_t);
  pthread_mutex_lock(&t->peers_mu);
  out->peers = t->npeers;
  pthread_mutex_unlock(&t->peers_mu);
}

static void fail_chain(mc_xfer_op_t *op, int code, const char *msg) {
  while (op) {
    mc_xfer_op_t *next = op->next;
    mc_op_finalize(op, code, msg);
    mc_xfer_op_free(op);
    op = next;
  }
}

/* Under peers_mu: drops peer i if none of its connections is left (the last
 * entry takes its place): a peer gone for good (restarted under a new name,
 * scaled away) leaves nothing behind; one still wanted gets a fresh entry
 * at the next submit.  No pointer to an entry outlives peers_mu. */
static void peer_drop_if_empty(mc_tcp_t *t, size_t i) {
  mc_tcp_peer_t *p = t->peers[i];
  for (int k = 0; k < t->opts.conns_per_peer; k++)
    if (p->conns[k])
      return;
  t->peers[i] = t->peers[--t->npeers];
  free(p->conns);
  free(p);
}

static void peer_remove_conn(mc_tcp_t *t, mc_conn_t *c) {
  pthread_mutex_lock(&t->peers_mu);
  for (size_t i = 0; i < t->npeers; i++) {
    mc_tcp_peer_t *p = t->peers[i];
    int had = 0;
    for (int k = 0; k < t->opts.conns_per_peer; k++)
      if (p->conns[k] == c) {
        p->conns[k] = NULL;
        had = 1;
      }
    if (had) { /* a connection is in one peer's slots only */
      peer_drop_if_empty(t, i);
      break;
    }
  }
  pthread_mutex_unlock(&t->peers_mu);
}

static int redial(mc_conn_t *c, int code, const char *why);

/* Outgoing: WRITE data handed to the kernel that the target has not
 * answered (a started op in the send queue, or one awaiting its answer). */
static int write_unanswered(const mc_conn_t *c) {
  for (const mc_xfer_op_t *op = c->await_head; op; op = op->next)
    if (op->type == MC_XFER_WRITE)
      return 1;
  for (const mc_xfer_op_t *op = c->sendq_head; op && op->started; op = op->next)
    if (op->type == MC_XFER_WRITE)
      return 1;
  return 0;
}

void mc_conn_kill(mc_conn_t *c, int code, const char *fmt, ...) {
  if (c->state == CONN_DEAD)
    return;
  char msg[MC_ERR_MSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (c->outgoing && !c->hello_ok && c->redials && code == MC_EPEERCLOSED) {
    size_t l = strlen(msg);
    snprintf(msg + l, sizeof msg - l, " (the last of %d handshakes, each cut before the "
             "target's HELLO_ACK; is the target overloaded or flooded?)", c->redials + 1);
  }
  /* A connection killed to cancel or fence a transfer, or holding WRITE
   * data not yet answered, is reset, not closed: a plain close() leaves the
   * kernel sending the socket's queued bytes (megabytes, seconds on a slow
   * link) into memory the target may have reused meanwhile. */
  if (code == MC_ECANCELED || (c->outgoing && write_unanswered(c)))
    c->rst = 1;
  if (redial(c, code, msg)) /* its requests now wait on a fresh connection */
    code = MC_ECLOSED;
  else if (code == MC_EPROTO && !c->outgoing) /* a peer can repeat these at will */
    mc_log_warn_rated("%s", msg);
  else if (code == MC_EPROTO)
    mc_log_warn("%s", msg);
  else if (!c->outgoing)
    mc_log_info_rated("%s", msg);
  else
    mc_log_info("%s", msg);
  if (c->outgoing)
    peer_remove_conn(c->tcp, c);
  if (c->outgoing && (code == MC_ECONNECT || code == MC_ENOTFOUND || code == MC_EPEERCLOSED) &&
      c->tcp->hooks.on_peer_failed)
    c->tcp->hooks.on_peer_failed(c->tcp->hooks.ctx, c->segment);
  if (!c->outgoing && c->hello_ok && c->segment[0] && c->tcp->hooks.on_incoming_closed)
    c->tcp->hooks.on_incoming_closed(c->tcp->hooks.ctx, c->segment);
  pthread_mutex_lock(&c->mu);
  c->dead_flag = 1;
  mc_xfer_op_t *inbox = c->inbox_head;
  c->inbox_head = c->inbox_tail = NULL;
  pthread_mutex_unlock(&c->mu);
  c->state = CONN_DEAD;
  epoll_ctl(c->loop->epfd, EPOLL_CTL_DEL, c->fd, NULL);
  mc_conn_prehandshake_done(c); /* before close: the acceptor may shut its fd down */
  if (c->rst) {
    struct linger lg = {.l_onoff = 1, .l_linger = 0};
    setsockopt(c->fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
  }
  close(c->fd);
  c->fd = -1;
  if (code == MC_EPROTO && !c->outgoing)
    code = MC_EPEERCLOSED;
  fail_chain(c->await_head, code, msg);
  fail_chain(c->sendq_head, code, msg);
  fail_chain(inbox, code, msg);
  c->await_head = c->await_tail = c->sendq_head = c->sendq_tail = NULL;
  while (c->resp_head) {
    mc_resp_t *r = c->resp_head;
    c->resp_head = r->next;
    mc_conn_resp_done(c, r);
  }
  c->resp_tail = NULL;
  if (c->rx_paused) {
    c->rx_paused = 0;
    atomic_fetch_sub(&c->tcp->paused_conns, 1);
  }
  mc_conn_prehandshake_done(c);
  mc_conn_free_recv(c);
}

mc_conn_t *mc_conn_new(mc_tcp_t *t, int fd, int outgoing, const char *peer,
                       const char *segment) {
  mc_conn_t *c = calloc(1, sizeof *c);
  if (!c)
    return NULL;
  c->rbuf = malloc(MC_TCP_RBUF);
  if (!c->rbuf || pthread_mutex_init(&c->mu, NULL)) {
    free(c->rbuf);
    free(c);
    return NULL;
  }
  c->tcp = t;
  c->fd = fd;
  c->outgoing = outgoing;
  c->state = outgoing ? CONN_CONNECTING : CONN_OPEN;
  snprintf(c->peer, sizeof c->peer, "%s", peer);
  snprintf(c->segment, sizeof c->segment, "%s", segment ? segment : "");
  c->loop = &t->loops[atomic_fetch_add(&t->next_loop, 1) % (unsigned)t->nloops];
  return c;
}

void mc_conn_free(mc_conn_t *c) {
  pthread_mutex_destroy(&c->mu);
  free(c->rbuf);
  free(c->body);
  free(c->piov);
  free(c->prefs);
  free(c);
}

static void set_sock_opts(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  int idle = 10, intvl = 5, cnt = 3;
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
  /* Unacknowledged data for this long means the peer is gone. */
  unsigned uto = 30000;
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &uto, sizeof uto);
}

static void drain_inbox(mc_conn_t *c) {
  pthread_mutex_lock(&c->mu);
  mc_xfer_op_t *op = c->inbox_head;
  c->inbox_head = c->inbox_tail = NULL;
  c->kick_pending = 0;
  pthread_mutex_unlock(&c->mu);
  while (op) {
    mc_xfer_op_t *next = op->next;
    mc_conn_enqueue_op(c, op);
    op = next;
  }
}

static void on_connected(mc_conn_t *c) {
  int soerr = 0;
  socklen_t sl = sizeof soerr;
  if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) < 0)
    soerr = errno;
  if (soerr) {
    mc_conn_kill(c, MC_ECONNECT, "connect to segment %s at %s failed: %s", c->segment, c->peer,
                 strerror(soerr));
    return;
  }
  c->state = CONN_OPEN;
  c->want_out = -1;
  mc_conn_set_out(c, 0);
  drain_inbox(c);
  mc_conn_flush(c);
}

static void loop_add(mc_loop_t *l, mc_conn_t *c) {
  c->next_in_loop = l->conns;
  l->conns = c;
  struct epoll_event ev = {.events = c->state == CONN_CONNECTING ? EPOLLOUT : EPOLLIN,
                           .data.ptr = c};
  c->want_out = c->state == CONN_CONNECTING;
  if (epoll_ctl(l->epfd, EPOLL_CTL_ADD, c->fd, &ev) < 0) {
    mc_conn_kill(c, MC_ESYS, "epoll_ctl failed for %s: %s", c->peer, strerror(errno));
    return;
  }
  if (c->state == CONN_OPEN && c->outgoing) {
    drain_inbox(c);
    mc_conn_flush(c);
  }
}

/* Cancels ops whose flag is set, in every queue of every connection. */
static void sweep_conn(mc_conn_t *c) {
  if (c->state == CONN_DEAD)
    return;
  /* A peer holding a region being unregistered past the grace period
   * (MC_UNREGISTER_GRACE_MS) loses its connection: its accesses end, its
   * next one finds the region gone (engine.c, on_unregister_stall). */
  const mc_region_t *rv = c->outgoing ? NULL : mc_conn_revoked_region(c);
  if (rv) {
    mc_log_warn("revoked peer %s's access to region 0x%llx (%llu bytes), which is being "
                "unregistered: it held it past the grace period (MC_UNREGISTER_GRACE_MS); "
                "its connection is closed",
                c->peer, (unsigned long long)rv->addr, (unsigned long long)rv->len);
    mc_conn_kill(c, MC_ECANCELED, "connection from %s closed: region 0x%llx revoked", c->peer,
                 (unsigned long long)rv->addr);
    return;
  }
  /* Not started yet: dropped by flush; started but not finished: the stream
   * cannot be cut mid-message, so the connection goes. */
  for (mc_xfer_op_t *op = c->sendq_head; op; op = op->next) {
    if (op->cancel && atomic_load(op->cancel) && op->started) {
      mc_conn_kill(c, MC_ECANCELED,
                   "connection to %s closed to cancel a transfer that was being sent",
                   c->peer);
      return;
    }
  }
  /* Sent and awaiting: READ data is dropped on arrival; WRITE data the
   * kernel still holds unacknowledged (SIOCOUTQ) would land after the
   * cancel reported it gone, so the connection is reset (the kernel drops
   * it).  Bytes the target's kernel acknowledged are the target's to fence
   * (mc_tcp_cut_peer). */
  for (mc_xfer_op_t *op = c->await_head; op; op = op->next) {
    /* finalized first: a finalized op's batch (and *op->cancel) may be gone */
    if (!op->finalized && op->cancel && atomic_load(op->cancel)) {
      int unacked = 0;
      if (op->type == MC_XFER_WRITE && ioctl(c->fd, SIOCOUTQ, &unacked) == 0 && unacked > 0) {
        mc_conn_kill(c, MC_ECANCELED,
                     "connection to %s reset to cancel a transfer whose data (%d bytes "
                     "queued) was not yet acknowledged", c->peer, unacked);
        return;
      }
      if (op == c->await_head && c->rstate == RS_PAYLOAD)
        c->pdiscard = 1;
      mc_op_finalize(op, MC_ECANCELED, "canceled while waiting for the target");
    }
  }
  pthread_mutex_lock(&c->mu);
  mc_xfer_op_t **pp = &c->inbox_head, *keep_tail = NULL;
  mc_xfer_op_t *canceled = NULL;
  while (*pp) {
    mc_xfer_op_t *op = *pp;
    if (op->cancel && atomic_load(op->cancel)) {
      *pp = op->next;
      op->next = canceled;
      canceled = op;
    } else {
      keep_tail = op;
      pp = &op->next;
    }
  }
  c->inbox_tail = keep_tail;
  pthread_mutex_unlock(&c->mu);
  fail_chain(canceled, MC_ECANCELED, "canceled before it was sent");
  mc_conn_flush(c);
}

/* Its replies drained (mc_conn_resp_done set rx_resume): read the requests
 * it sent meanwhile, some of which may already sit in its receive buffer. */
static void resume_reading(mc_conn_t *c) {
  int alive = 1;
  while (alive && c->rx_resume && c->state == CONN_OPEN) {
    c->rx_resume = 0;
    alive = mc_conn_on_readable(c) == 0;
  }
}

/* ---- fencing a peer (mc_tcp_cut_peer) ---- */

/* One cut, shared by the loops and the caller; freed by the last of them. */
typedef struct mc_tcp_cut {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  char segment[320];
  int pending; /* loops yet to answer */
  int refs;
  int ncut;
  int held; /* a cut connection was still held (a GPU staging copy) */
} mc_tcp_cut_t;

static void cut_put(mc_tcp_cut_t *k, int answered, int ncut, int held) {
  pthread_mutex_lock(&k->mu);
  k->ncut += ncut;
  k->held |= held;
  if (answered && --k->pending == 0)
    pthread_cond_broadcast(&k->cv);
  int last = --k->refs == 0;
  pthread_mutex_unlock(&k->mu);
  if (last) {
    pthread_mutex_destroy(&k->mu);
    pthread_cond_destroy(&k->cv);
    free(k);
  }
}

/* On loop l's thread: resets l's incoming connections from k->segment.
 * Their receive state (payload scatter into registered memory) lives on
 * this thread, so once this returns none of them writes anything more. */
static void cut_on_loop(mc_loop_t *l, mc_tcp_cut_t *k) {
  int n = 0, held = 0;
  for (mc_conn_t *c = l->conns; c; c = c->next_in_loop) {
    if (c->outgoing || c->state == CONN_DEAD || strcmp(c->segment, k->segment) != 0)
      continue;
    if (!mc_conn_loop_acquire(c))
      continue; /* caller-owned: outgoing only, never reached */
    c->rst = 1;
    mc_conn_kill(c, MC_ECANCELED,
                 "connection from %s (%s) cut: its transfers into our memory are fenced "
                 "(cut_peer)", k->segment, c->peer);
    mc_conn_loop_release(c);
    pthread_mutex_lock(&l->mu);
    held |= c->cmd_refs > 0;
    pthread_mutex_unlock(&l->mu);
    n++;
  }
  cut_put(k, 1, n, held);
}

int mc_tcp_cut_peer(mc_tcp_t *t, const char *segment, int64_t timeout_ms, mc_err_t *err) {
  if (!segment || !segment[0] || strlen(segment) >= sizeof(((mc_conn_t *)0)->segment))
    return mc_err_set(err, MC_EINVAL, "cut_peer: segment name %s (give the peer's "
                      "\"host:port\" as it named itself, under 320 bytes)",
                      !segment || !segment[0] ? "is empty" : "is too long");
  mc_tcp_cut_t *k = calloc(1, sizeof *k);
  if (!k)
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_mutex_init(&k->mu, NULL);
  pthread_cond_init(&k->cv, &ca);
  pthread_condattr_destroy(&ca);
  snprintf(k->segment, sizeof k->segment, "%s", segment);
  k->pending = t->nloops;
  k->refs = t->nloops + 1;
  int lost = 0;
  for (int i = 0; i < t->nloops; i++)
    if (loop_post_arg(&t->loops[i], CMD_CUT, NULL, k) < 0) {
      cut_put(k, 1, 0, 0);
      lost = 1;
    }
  struct timespec until;
  clock_gettime(CLOCK_MONOTONIC, &until);
  int64_t ms = timeout_ms < 0 ? 5000 : timeout_ms;
  until.tv_sec += ms / 1000;
  until.tv_nsec += (ms % 1000) * 1000000L;
  if (until.tv_nsec >= 1000000000L) {
    until.tv_sec++;
    until.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&k->mu);
  int rc = 0;
  while (k->pending > 0 && rc != ETIMEDOUT)
    rc = pthread_cond_timedwait(&k->cv, &k->mu, &until);
  int pending = k->pending, ncut = k->ncut, held = k->held;
  pthread_mutex_unlock(&k->mu);
  cut_put(k, 0, 0, 0);
  if (pending > 0 || lost)
    return mc_err_set(err, lost ? MC_ENOMEM : MC_ETIMEDOUT,
                      "cut_peer %s: %d of %d I/O threads did not confirm the cut within %lld "
                      "ms%s; its connections may still write into our memory", segment,
                      pending, t->nloops, (long long)ms, lost ? " (out of memory)" : "");
  /* A WRITE payload staged for a GPU region is copied by the copy worker
   * after its connection went: wait for those copies to finish. */
  if (held && t->hooks.gpu)
    mc_gpu_stager_drain(t->hooks.gpu);
  return ncut;
}

static void handle_cmds(mc_loop_t *l) {
  uint64_t v;
  while (read(l->evfd, &v, sizeof v) < 0 && errno == EINTR) {
  }
  pthread_mutex_lock(&l->mu);
  mc_cmd_t *cmd = l->cmd_head;
  l->cmd_head = l->cmd_tail = NULL;
  pthread_mutex_unlock(&l->mu);
  while (cmd) {
    mc_cmd_t *next = cmd->next;
    switch (cmd->kind) {
    case CMD_ADD:
      if (mc_conn_loop_acquire(cmd->conn)) {
        loop_add(l, cmd->conn);
        mc_conn_loop_release(cmd->conn);
      }
      break;
    case CMD_KICK:
      /* A caller-owned conn is kicked again by its caller on hand-back. */
      pthread_mutex_lock(&cmd->conn->mu);
      if (cmd->conn->owner_caller)
        cmd->conn->kick_deferred = 1;
      pthread_mutex_unlock(&cmd->conn->mu);
      if (mc_conn_loop_acquire(cmd->conn)) {
        if (cmd->conn->state == CONN_OPEN) {
          drain_inbox(cmd->conn);
          /* A flush here can drain the replies a paused connection waited
           * for (GPU-staged READ data is sent after its copy, on a kick):
           * the requests already in its receive buffer are read now, or
           * nothing would ever wake them. */
          if (mc_conn_flush(cmd->conn) == 0)
            resume_reading(cmd->conn);
        }
        mc_conn_loop_release(cmd->conn);
      }
      break;
    case CMD_SWEEP:
      for (mc_conn_t *c = l->conns; c; c = c->next_in_loop) {
        if (mc_conn_loop_acquire(c)) {
          sweep_conn(c);
          mc_conn_loop_release(c);
        }
      }
      break;
    case CMD_CUT:
      cut_on_loop(l, cmd->arg);
      break;
    }
    if (cmd->conn) {
      pthread_mutex_lock(&l->mu);
      cmd->conn->cmd_refs--;
      pthread_mutex_unlock(&l->mu);
    }
    free(cmd);
    cmd = next;
  }
}

/* At most ACCEPT_BATCH connections per wake-up (the listener is level-
 * triggered: the rest wait for the next turn), so under a flood this loop
 * also gets to reap the connections it evicted. */
#define ACCEPT_BATCH 16
#define EVICTING_MAX(t) ((t)->opts.max_prehandshake)
/* A connection whose HELLO header arrived is safe from eviction this long
 * (a peer that sends a header and stalls is not). */
#define HELLO_GRACE_NS 500000000ull

/* A whole HELLO waits in the kernel's buffer of this socket (read without
 * taking it): its loop is about to handshake it, so it is not evicted. */
static int hello_waiting(int fd) {
  unsigned char h[MC_WIRE_HDR_SIZE];
  if (recv(fd, h, sizeof h, MSG_PEEK | MSG_DONTWAIT) != (ssize_t)sizeof h)
    return 0;
  uint32_t magic;
  uint64_t len;
  memcpy(&magic, h, 4);
  memcpy(&len, h + 24, 8);
  int avail = 0;
  return magic == MC_WIRE_MAGIC && h[5] == MC_WIRE_HELLO && len <= MC_TCP_HELLO_MAX &&
         ioctl(fd, FIONREAD, &avail) == 0 && (uint64_t)avail >= sizeof h + len;
}

/* The oldest pre-handshake connection that has no whole HELLO waiting
 * (pre_mu held), or NULL. */
static mc_conn_t *evict_candidate(mc_tcp_t *t) {
  int looked = 0;
  uint64_t now = mc_now_ns();
  for (mc_conn_t *c = t->pre_head; c && looked < 2 * ACCEPT_BATCH; c = c->pre_next, looked++) {
    uint64_t seen = atomic_load(&c->pre_hello_ns); /* its loop is reading a HELLO */
    if ((!seen || now - seen > HELLO_GRACE_NS) && !hello_waiting(c->fd))
      return c;
  }
  return NULL;
}

static void accept_all(mc_tcp_t *t) {
  for (int batch = 0; batch < ACCEPT_BATCH; batch++) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    int fd = accept4(t->listen_fd, (struct sockaddr *)&ss, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR)
        continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        mc_log_warn("accept on port %d failed: %s", t->port, strerror(errno));
      return;
    }
    set_sock_opts(fd);
    char host[INET6_ADDRSTRLEN] = "?", peer[320];
    int port = 0;
    if (ss.ss_family == AF_INET) {
      struct sockaddr_in *a = (struct sockaddr_in *)&ss;
      inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
      port = ntohs(a->sin_port);
    } else if (ss.ss_family == AF_INET6) {
      struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;
      inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
      port = ntohs(a->sin6_port);
    }
    snprintf(peer, sizeof peer, "%s:%d", host, port);
    /* Budget: connections that have not said HELLO yet.  When it is full
     * the oldest of them makes room (its socket is shut down; its loop reaps
     * it): a flood of idle sockets then only ever holds the newest slots,
     * and a peer that sends its HELLO at once gets in.  Refused only while
     * as many evicted ones still wait for their loops (the bound: twice
     * MC_TCP_MAX_PREHANDSHAKE connections at most). */
    pthread_mutex_lock(&t->pre_mu);
    int admit = atomic_load(&t->prehandshake) < t->opts.max_prehandshake;
    char old_peer[320] = "";
    mc_conn_t *old = NULL;
    if (!admit && atomic_load(&t->pre_evicting) < EVICTING_MAX(t) &&
        (old = evict_candidate(t)) != NULL) {
      pre_unlink(t, old);
      old->pre_evicted = 1;
      shutdown(old->fd, SHUT_RDWR);
      snprintf(old_peer, sizeof old_peer, "%s", old->peer);
      atomic_fetch_sub(&t->prehandshake, 1);
      atomic_fetch_add(&t->pre_evicting, 1);
      atomic_fetch_add(&t->prehandshake_evicted, 1);
      admit = 1;
    }
    pthread_mutex_unlock(&t->pre_mu);
    if (old_peer[0])
      mc_log_warn_rated("%d connections have not completed their handshake "
                        "(MC_TCP_MAX_PREHANDSHAKE): dropped the oldest, from %s, to admit %s",
                        t->opts.max_prehandshake, old_peer, peer);
    if (!admit) {
      atomic_fetch_add(&t->prehandshake_refused, 1);
      mc_log_warn_rated("refused a connection from %s: %d connections have not completed their "
                        "handshake and as many are being dropped (MC_TCP_MAX_PREHANDSHAKE)",
                        peer, t->opts.max_prehandshake);
      close(fd);
      continue;
    }
    mc_conn_t *c = mc_conn_new(t, fd, 0, peer, "");
    if (!c) {
      close(fd);
      continue;
    }
    c->prehandshake = 1;
    pthread_mutex_lock(&t->pre_mu);
    c->pre_prev = t->pre_tail;
    if (t->pre_tail)
      t->pre_tail->pre_next = c;
    else
      t->pre_head = c;
    t->pre_tail = c;
    atomic_fetch_add(&t->prehandshake, 1);
    pthread_mutex_unlock(&t->pre_mu);
    c->connect_deadline_ns = mc_now_ns() + (uint64_t)t->opts.hello_timeout_ms * 1000000ull;
    mc_loop_post(c->loop, CMD_ADD, c);
  }
}

/* Frees dead connections; only safe between event batches. */
static void reap(mc_loop_t *l) {
  mc_conn_t **pp = &l->conns;
  while (*pp) {
    mc_conn_t *c = *pp;
    pthread_mutex_lock(&l->mu);
    int busy = c->cmd_refs > 0;
    pthread_mutex_unlock(&l->mu);
    pthread_mutex_lock(&c->mu);
    busy |= c->owner_caller;
    pthread_mutex_unlock(&c->mu);
    if (c->state == CONN_DEAD && !busy) {
      *pp = c->next_in_loop;
      mc_conn_free(c);
    } else {
      pp = &c->next_in_loop;
    }
  }
}

static void check_connect_deadlines(mc_loop_t *l) {
  uint64_t now = mc_now_ns();
  for (mc_conn_t *c = l->conns; c; c = c->next_in_loop) {
    if (!mc_conn_loop_acquire(c))
      continue;
    if (c->state == CONN_CONNECTING && c->connect_deadline_ns && now > c->connect_deadline_ns)
      mc_conn_kill(c, MC_ECONNECT, "connect to segment %s at %s timed out after %d ms",
                   c->segment, c->peer, c->tcp->opts.connect_timeout_ms);
    else if (c->state == CONN_OPEN && c->prehandshake && now > c->connect_deadline_ns)
      mc_conn_kill(c, MC_EPROTO, "%s sent no HELLO within %d ms (MC_TCP_HELLO_TIMEOUT_MS); "
                   "dropping the connection", c->peer, c->tcp->opts.hello_timeout_ms);
    mc_conn_loop_release(c);
  }
}

static void *loop_main(void *arg) {
  mc_loop_t *l = arg;
  struct epoll_event evs[64];
  uint64_t poll_ns = (uint64_t)l->tcp->opts.busy_poll_us * 1000ull;
  uint64_t last_activity = 0;
  while (!l->stopping) {
    /* Optionally keep polling for a while after activity: answers to
     * back-to-back small requests then skip a thread wake-up. */
    int tmo = poll_ns && mc_now_ns() - last_activity < poll_ns ? 0 : 100;
    int n = epoll_wait(l->epfd, evs, 64, tmo);
    if (n > 0)
      last_activity = mc_now_ns();
    if (n < 0) {
      if (errno == EINTR)
        continue;
      mc_log_error("epoll_wait failed on I/O thread %d: %s", l->idx, strerror(errno));
      break;
    }
    for (int i = 0; i < n; i++) {
      void *tag = evs[i].data.ptr;
      if (tag == &eventfd_tag) {
        handle_cmds(l);
        continue;
      }
      if (tag == &listener_tag) {
        accept_all(l->tcp);
        continue;
      }
      mc_conn_t *c = tag;
      if (!mc_conn_loop_acquire(c))
        continue; /* a caller thread is driving it right now */
      uint32_t e = evs[i].events;
      if (c->state == CONN_CONNECTING) {
        on_connected(c);
      } else if (c->state == CONN_OPEN) {
        int alive = 1;
        if (e & (EPOLLIN | EPOLLERR | EPOLLHUP))
          alive = mc_conn_on_readable(c) == 0;
        if (alive && (e & (EPOLLOUT | EPOLLERR | EPOLLHUP)) && c->state == CONN_OPEN)
          alive = mc_conn_flush(c) == 0;
        if (alive)
          resume_reading(c);
      }
      mc_conn_loop_release(c);
    }
    check_connect_deadlines(l);
    reap(l);
  }
  return NULL;
}

/* ---- peers and submission ---- */

static mc_tcp_peer_t *peer_get(mc_tcp_t *t, const char *host, int port, const char *segment) {
  for (size_t i = 0; i < t->npeers; i++) {
    mc_tcp_peer_t *p = t->peers[i];
    if (p->port == port && !strcmp(p->host, host) && !strcmp(p->segment, segment))
      return p;
  }
  mc_tcp_peer_t **nv = mc_array_room(t->peers, t->npeers, &t->cap_peers, sizeof *nv, 8);
  if (!nv)
    return NULL;
  t->peers = nv;
  mc_tcp_peer_t *p = calloc(1, sizeof *p);
  if (!p || !(p->conns = calloc((size_t)t->opts.conns_per_peer, sizeof *p->conns))) {
    free(p);
    return NULL;
  }
  snprintf(p->host, sizeof p->host, "%s", host);
  p->port = port;
  snprintf(p->segment, sizeof p->segment, "%s", segment);
  t->peers[t->npeers++] = p;
  return p;
}

/* Starts a non-blocking connect; the HELLO is the first op queued. */
static mc_conn_t *connect_peer(mc_tcp_t *t, const char *host, int port, const char *segment,
                               mc_err_t *err) {
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
  struct addrinfo *ai = NULL;
  char ports[16];
  snprintf(ports, sizeof ports, "%d", port);
  int gai = getaddrinfo(host, ports, &hints, &ai);
  if (gai != 0) {
    mc_err_set(err, MC_ECONNECT, "cannot resolve host \"%s\" of segment %s: %s", host, segment,
               gai_strerror(gai));
    return NULL;
  }
  int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    mc_err_sys(err, MC_ESYS, errno, "socket() failed");
    freeaddrinfo(ai);
    return NULL;
  }
  set_sock_opts(fd);
  int rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
  freeaddrinfo(ai);
  if (rc < 0 && errno != EINPROGRESS) {
    mc_err_sys(err, MC_ECONNECT, errno, "connect to segment %s at %s:%d failed", segment, host,
               port);
    close(fd);
    return NULL;
  }
  char peer[320];
  snprintf(peer, sizeof peer, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port);
  mc_conn_t *c = mc_conn_new(t, fd, 1, peer, segment);
  if (!c) {
    close(fd);
    mc_err_set(err, MC_ENOMEM, "out of memory");
    return NULL;
  }
  c->connect_deadline_ns = mc_now_ns() + (uint64_t)t->opts.connect_timeout_ms * 1000000ull;
  c->redial_until_ns = c->connect_deadline_ns;
  /* HELLO first: names the segment we expect and who we are, and starts
   * peer authentication (tcp_auth.c). */
  mc_xfer_op_t *hello = mc_auth_hello(c, err);
  if (!hello) {
    close(fd);
    mc_conn_free(c);
    return NULL;
  }
  c->inbox_head = c->inbox_tail = hello;
  return c;
}

/* Initiator: the target reset or closed the connection before its
 * HELLO_ACK (e.g. it evicted the connection to admit newer ones while the
 * HELLO was still on its way: docs/security.md).  The target answers
 * nothing on a connection before its HELLO and serves nothing on one it
 * evicted, so no request on it took effect: they all move, unsent, to a
 * fresh connection in the same peer slot.  Bounded: MC_TCP_REDIALS times,
 * and only before the first dial's connect deadline.  No timer between
 * attempts: each one is paced by the target's reset of the one before.
 * Returns 1 when the requests moved (c then holds none). */
#define MC_TCP_REDIALS 8
static int redial(mc_conn_t *c, int code, const char *why) {
  mc_tcp_t *t = c->tcp;
  if (!c->outgoing || c->hello_ok || code != MC_EPEERCLOSED || c->state != CONN_OPEN ||
      c->redials >= MC_TCP_REDIALS || mc_now_ns() >= c->redial_until_ns || c->loop->stopping)
    return 0;
  pthread_mutex_lock(&t->peers_mu);
  mc_tcp_peer_t *p = NULL;
  int slot = -1;
  for (size_t i = 0; i < t->npeers && slot < 0; i++)
    for (int k = 0; k < t->opts.conns_per_peer; k++)
      if (t->peers[i]->conns[k] == c) {
        p = t->peers[i];
        slot = k;
        break;
      }
  mc_err_t err = {0};
  mc_conn_t *n = slot >= 0 ? connect_peer(t, p->host, p->port, p->segment, &err) : NULL;
  if (!n) {
    pthread_mutex_unlock(&t->peers_mu);
    return 0;
  }
  n->redials = c->redials + 1;
  n->redial_until_ns = c->redial_until_ns;
  /* Everything c holds, in order: sent and awaiting an answer, queued,
   * and not yet taken from its inbox.  Its HELLO is dropped (n has its own);
   * the rest is sent again from its first byte. */
  pthread_mutex_lock(&c->mu);
  mc_xfer_op_t *inbox = c->inbox_head;
  c->inbox_head = c->inbox_tail = NULL;
  pthread_mutex_unlock(&c->mu);
  mc_xfer_op_t *chains[3] = {c->await_head, c->sendq_head, inbox};
  c->await_head = c->await_tail = c->sendq_head = c->sendq_tail = NULL;
  mc_xfer_op_t *tail = n->inbox_tail;
  for (int ch = 0; ch < 3; ch++) {
    for (mc_xfer_op_t *op = chains[ch], *next; op; op = next) {
      next = op->next;
      op->next = NULL;
      if (op->type == MC_WIRE_HELLO || op->finalized) { /* finalized: answered (canceled) */
        mc_xfer_op_free(op);
        continue;
      }
      if (op->cancel && atomic_load(op->cancel)) { /* a canceled op is never sent again */
        mc_op_finalize(op, MC_ECANCELED, "canceled before its connection's handshake");
        mc_xfer_op_free(op);
        continue;
      }
      op->started = 0;
      if (op->tp) {
        MC_OPW(op)->iov_idx = 0;
        MC_OPW(op)->iov_off = 0;
      }
      tail->next = op;
      tail = op;
    }
  }
  n->inbox_tail = tail;
  p->conns[slot] = n;
  atomic_fetch_add(&t->redials, 1);
  mc_log_info_rated("%s before the handshake completed; dialing %s again (attempt %d of %d)", why,
                    n->peer, n->redials + 1, MC_TCP_REDIALS + 1);
  mc_loop_post(n->loop, CMD_ADD, n); /* under peers_mu, as in mc_tcp_submit */
  pthread_mutex_unlock(&t->peers_mu);
  return 1;
}

/* Encodes ops not yet encoded; one that cannot be fails (done) and its slot
 * becomes NULL when `fail`, else returns -1 with nothing failed. */
static int encode_ops(mc_xfer_op_t **ops, size_t nops, int fail) {
  for (size_t i = 0; i < nops; i++) {
    mc_err_t e;
    if (!ops[i] || ops[i]->tp)
      continue;
    if (mc_tcp_op_encode(ops[i], &e) < 0) {
      if (!fail)
        return -1;
      mc_op_finalize(ops[i], e.code, e.msg);
      mc_xfer_op_free(ops[i]);
      ops[i] = NULL;
    }
  }
  return 0;
}

void mc_tcp_submit(mc_tcp_t *t, const char *host, int port, const char *segment,
                   mc_xfer_op_t **ops, size_t nops) {
  mc_err_t err = {0};
  encode_ops(ops, nops, 1);
  pthread_mutex_lock(&t->peers_mu);
  mc_tcp_peer_t *p = peer_get(t, host, port, segment);
  if (!p) {
    pthread_mutex_unlock(&t->peers_mu);
    for (size_t i = 0; i < nops; i++) {
      if (!ops[i])
        continue;
      mc_op_finalize(ops[i], MC_ENOMEM, "out of memory");
      mc_xfer_op_free(ops[i]);
    }
    return;
  }
  /* Make sure every stripe has a connection (connect is non-blocking; name
   * resolution may block, which is why callers release the GIL). */
  mc_conn_t *fresh[64];
  int nfresh = 0;
  for (int k = 0; k < t->opts.conns_per_peer; k++) {
    if (p->conns[k])
      continue;
    mc_conn_t *c = connect_peer(t, host, port, segment, &err);
    if (!c)
      break;
    p->conns[k] = c;
    if (nfresh < 64)
      fresh[nfresh++] = c;
  }
  int have = 0;
  for (int k = 0; k < t->opts.conns_per_peer; k++)
    have += p->conns[k] != NULL;
  if (!have) {
    for (size_t i = 0; i < t->npeers; i++)
      if (t->peers[i] == p) {
        peer_drop_if_empty(t, i); /* a peer never reached keeps no entry either */
        break;
      }
    pthread_mutex_unlock(&t->peers_mu);
    if (t->hooks.on_peer_failed)
      t->hooks.on_peer_failed(t->hooks.ctx, segment);
    for (size_t i = 0; i < nops; i++) {
      if (!ops[i])
        continue;
      mc_op_finalize(ops[i], err.code ? err.code : MC_ECONNECT, err.msg);
      mc_xfer_op_free(ops[i]);
    }
    return;
  }
  mc_conn_t *kick[64];
  int nkick = 0;
  for (size_t i = 0; i < nops; i++) {
    if (!ops[i])
      continue;
    mc_conn_t *c = NULL;
    for (int tries = 0; tries < t->opts.conns_per_peer && !c; tries++)
      c = p->conns[p->rr++ % (unsigned)t->opts.conns_per_peer];
    ops[i]->next = NULL;
    pthread_mutex_lock(&c->mu);
    if (c->inbox_tail)
      c->inbox_tail->next = ops[i];
    else
      c->inbox_head = ops[i];
    c->inbox_tail = ops[i];
    int need_kick = !c->kick_pending;
    c->kick_pending = 1;
    pthread_mutex_unlock(&c->mu);
    if (need_kick && nkick < 64)
      kick[nkick++] = c;
  }
  /* New connections are handed to their loop (which drains the inbox once
   * connected); existing ones get a kick.  Posted under peers_mu: a
   * connection still in the peer table is not dead, and once a command
   * names it, its loop will not free it before handling the command. */
  for (int i = 0; i < nfresh; i++)
    mc_loop_post(fresh[i]->loop, CMD_ADD, fresh[i]);
  for (int i = 0; i < nkick; i++) {
    int is_fresh = 0;
    for (int k = 0; k < nfresh; k++)
      is_fresh |= fresh[k] == kick[i];
    if (!is_fresh)
      mc_loop_post(kick[i]->loop, CMD_KICK, kick[i]);
  }
  pthread_mutex_unlock(&t->peers_mu);
}

/* The caller-driven fast path: see mc_tcp_submit_poll in tcp.h. */
int mc_tcp_submit_poll(mc_tcp_t *t, const char *host, int port, const char *segment,
                       mc_xfer_op_t **ops, size_t nops, int (*finished)(void *), void *arg,
                       uint64_t spin_ns) {
  if (encode_ops(ops, nops, 0) < 0)
    return 0; /* mc_tcp_submit fails them */
  mc_conn_t *c = NULL;
  pthread_mutex_lock(&t->peers_mu);
  for (size_t i = 0; i < t->npeers && !c; i++) {
    mc_tcp_peer_t *p = t->peers[i];
    if (p->port == port && !strcmp(p->host, host) && !strcmp(p->segment, segment))
      c = p->conns[p->rr % (unsigned)t->opts.conns_per_peer];
  }
  int owned = 0;
  if (c) {
    pthread_mutex_lock(&c->mu);
    /* Quiescent: the loop is not in it, nothing queued or outstanding. */
    owned = !c->owner_caller && !c->loop_busy && !c->dead_flag && c->state == CONN_OPEN &&
            c->hello_ok && !c->inbox_head && !c->sendq_head && !c->await_head &&
            c->rstate == RS_HDR && c->rpos == c->rlen && !c->want_out;
    if (owned)
      c->owner_caller = 1;
    pthread_mutex_unlock(&c->mu);
  }
  pthread_mutex_unlock(&t->peers_mu);
  if (!owned)
    return 0;
  /* Mute the loop's interest; epoll still reports errors, which it skips. */
  struct epoll_event ev = {.events = 0, .data.ptr = c};
  epoll_ctl(c->loop->epfd, EPOLL_CTL_MOD, c->fd, &ev);
  for (size_t i = 0; i < nops; i++)
    mc_conn_enqueue_op(c, ops[i]);
  int alive = mc_conn_flush(c) == 0 && c->state == CONN_OPEN;
  uint64_t until = mc_now_ns() + spin_ns;
  while (alive && !finished(arg) && mc_now_ns() < until) {
    /* poll() checks the receive queue without taking the socket lock, so
     * spinning here does not slow down the kernel delivering the answer
     * (a spinning read() would contend for that lock). */
    struct pollfd pfd = {.fd = c->fd, .events = POLLIN};
    if (poll(&pfd, 1, 0) > 0)
      alive = mc_conn_on_readable(c) == 0 && c->state == CONN_OPEN;
    else
      __builtin_ia32_pause();
  }
  /* Hand back: restore interest, and kick the loop if others queued work
   * meanwhile.  The kick is posted under mu together with the hand-back: a
   * live connection with a queued command is never freed by its loop. */
  int dead = c->state == CONN_DEAD;
  if (!dead) {
    ev.events = EPOLLIN | (c->want_out ? EPOLLOUT : 0);
    epoll_ctl(c->loop->epfd, EPOLL_CTL_MOD, c->fd, &ev);
  }
  pthread_mutex_lock(&c->mu);
  c->owner_caller = 0;
  if (!dead && (c->inbox_head || c->sendq_head || c->kick_deferred)) {
    c->kick_deferred = 0;
    mc_loop_post(c->loop, CMD_KICK, c);
  }
  pthread_mutex_unlock(&c->mu);
  return 1;
}

void mc_tcp_cancel_sweep(mc_tcp_t *t) {
  for (int i = 0; i < t->nloops; i++)
    mc_loop_post(&t->loops[i], CMD_SWEEP, NULL);
}

/* ---- start / stop ---- */

static int make_listener(mc_tcp_t *t, mc_err_t *err) {
  const char *bind_host = t->opts.bind_host && *t->opts.bind_host ? t->opts.bind_host : "0.0.0.0";
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                           .ai_flags = AI_PASSIVE | AI_NUMERICHOST};
  struct addrinfo *ai = NULL;
  char ports[16];
  snprintf(ports, sizeof ports, "%d", t->opts.port);
  int gai = getaddrinfo(bind_host, ports, &hints, &ai);
  if (gai)
    return mc_err_set(err, MC_EINVAL, "bind address \"%s\" is not a numeric IP: %s", bind_host,
                      gai_strerror(gai));
  int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    freeaddrinfo(ai);
    return mc_err_sys(err, MC_ESYS, errno, "socket() failed");
  }
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(fd, ai->ai_addr, ai->ai_addrlen) < 0) {
    int e = errno;
    freeaddrinfo(ai);
    close(fd);
    if (e == EADDRINUSE)
      return mc_err_sys(err, MC_ESYS, e,
                        "cannot listen on %s:%d (port in use by another process; pick another "
                        "port in prefill_url/decode_url or local_hostname)",
                        bind_host, t->opts.port);
    return mc_err_sys(err, MC_ESYS, e, "bind to %s:%d failed", bind_host, t->opts.port);
  }
  freeaddrinfo(ai);
  if (listen(fd, 512) < 0) {
    int e = errno;
    close(fd);
    return mc_err_sys(err, MC_ESYS, e, "listen failed");
  }
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  getsockname(fd, (struct sockaddr *)&ss, &sl);
  t->port = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                     : ntohs(((struct sockaddr_in *)&ss)->sin_port);
  t->listen_fd = fd;
  return 0;
}

int mc_tcp_loop_init(mc_tcp_t *t, mc_loop_t *l, int idx, mc_err_t *err) {
  l->tcp = t;
  l->idx = idx;
  l->epfd = epoll_create1(EPOLL_CLOEXEC);
  l->evfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (l->epfd < 0 || l->evfd < 0)
    return mc_err_sys(err, MC_ESYS, errno, "epoll/eventfd creation failed");
  pthread_mutex_init(&l->mu, NULL);
  struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &eventfd_tag};
  if (epoll_ctl(l->epfd, EPOLL_CTL_ADD, l->evfd, &ev) < 0)
    return mc_err_sys(err, MC_ESYS, errno, "epoll_ctl failed");
  return 0;
}

/* Options with their defaults filled in, hooks, no listener, no loops
 * (shared with the receive-path fuzz harness, which builds its own loop). */
void mc_tcp_init(mc_tcp_t *t, const mc_tcp_opts_t *opts, const mc_tcp_hooks_t *hooks) {
  t->opts = *opts;
  if (t->opts.io_threads < 1)
    t->opts.io_threads = 1;
  if (t->opts.io_threads > 64)
    t->opts.io_threads = 64;
  if (t->opts.conns_per_peer < 1)
    t->opts.conns_per_peer = 1;
  if (t->opts.conns_per_peer > 64)
    t->opts.conns_per_peer = 64;
  if (t->opts.connect_timeout_ms <= 0)
    t->opts.connect_timeout_ms = 5000;
  if (!t->opts.reply_conn_limit)
    t->opts.reply_conn_limit = 16ull << 20;
  if (!t->opts.reply_total_limit)
    t->opts.reply_total_limit = 256ull << 20;
  if (t->opts.max_prehandshake <= 0)
    t->opts.max_prehandshake = 64;
  if (t->opts.hello_timeout_ms <= 0)
    t->opts.hello_timeout_ms = 5000;
  t->hooks = *hooks;
  t->listen_fd = -1;
  pthread_mutex_init(&t->peers_mu, NULL);
  pthread_mutex_init(&t->pre_mu, NULL);
}

int mc_tcp_start(const mc_tcp_opts_t *opts, const mc_tcp_hooks_t *hooks, mc_tcp_t **out,
                 mc_err_t *err) {
  mc_tcp_t *t = calloc(1, sizeof *t);
  if (!t)
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  mc_tcp_init(t, opts, hooks);
  int rc = make_listener(t, err);
  if (rc < 0) {
    pthread_mutex_destroy(&t->peers_mu);
    free(t);
    return rc;
  }
  t->nloops = t->opts.io_threads;
  t->loops = calloc((size_t)t->nloops, sizeof *t->loops);
  if (!t->loops) {
    close(t->listen_fd);
    free(t);
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  }
  int started = 0;
  for (int i = 0; i < t->nloops; i++) {
    t->loops[i].epfd = t->loops[i].evfd = -1;
    if ((rc = mc_tcp_loop_init(t, &t->loops[i], i, err)) < 0)
      goto fail;
  }
  struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &listener_tag};
  if (epoll_ctl(t->loops[0].epfd, EPOLL_CTL_ADD, t->listen_fd, &ev) < 0) {
    rc = mc_err_sys(err, MC_ESYS, errno, "epoll_ctl(listener) failed");
    goto fail;
  }
  for (; started < t->nloops; started++) {
    if (pthread_create(&t->loops[started].thread, NULL, loop_main, &t->loops[started])) {
      rc = mc_err_set(err, MC_ESYS, "cannot start I/O thread");
      goto fail;
    }
  }
  *out = t;
  return 0;
fail:
  for (int i = 0; i < started; i++) {
    t->loops[i].stopping = 1;
    mc_loop_post(&t->loops[i], CMD_SWEEP, NULL);
    pthread_join(t->loops[i].thread, NULL);
  }
  for (int i = 0; i < t->nloops; i++) {
    if (t->loops[i].epfd >= 0)
      close(t->loops[i].epfd);
    if (t->loops[i].evfd >= 0)
      close(t->loops[i].evfd);
  }
  close(t->listen_fd);
  free(t->loops);
  free(t);
  return rc;
}

int mc_tcp_port(const mc_tcp_t *t) { return t->port; }

void mc_tcp_stop(mc_tcp_t *t) {
  if (!t)
    return;
  for (int i = 0; i < t->nloops; i++) {
    t->loops[i].stopping = 1;
    mc_loop_post(&t->loops[i], CMD_SWEEP, NULL);
  }
  for (int i = 0; i < t->nloops; i++)
    pthread_join(t->loops[i].thread, NULL);
  /* GPU copies still in flight post to connections: let them finish. */
  mc_gpu_stager_drain(t->hooks.gpu);
  /* Threads are gone: fail and free whatever is left, on this thread. */
  for (int i = 0; i < t->nloops; i++) {
    mc_loop_t *l = &t->loops[i];
    mc_cmd_t *cmd = l->cmd_head;
    while (cmd) {
      mc_cmd_t *next = cmd->next;
      if (cmd->kind == CMD_ADD) {
        cmd->conn->next_in_loop = l->conns;
        l->conns = cmd->conn;
        /* Not in epoll yet: give the kill path a valid loop. */
      }
      if (cmd->kind == CMD_CUT) /* its connections are killed below */
        cut_put(cmd->arg, 1, 0, 0);
      if (cmd->conn)
        cmd->conn->cmd_refs--;
      free(cmd);
      cmd = next;
    }
    for (mc_conn_t *c = l->conns; c; c = c->next_in_loop)
      mc_conn_kill(c, MC_ECLOSED, "engine shut down");
    reap(l);
    close(l->epfd);
    close(l->evfd);
    pthread_mutex_destroy(&l->mu);
  }
  close(t->listen_fd);
  for (size_t i = 0; i < t->npeers; i++) {
    free(t->peers[i]->conns);
    free(t->peers[i]);
  }
  free(t->peers);
  pthread_mutex_destroy(&t->peers_mu);
  pthread_mutex_destroy(&t->pre_mu);
  free(t->loops);
  free(t);
}
