/* Private structures of the TCP transport, shared by its .c files. */
#ifndef MC_TRANSPORT_TCP_INTERNAL_H
#define MC_TRANSPORT_TCP_INTERNAL_H

#include <pthread.h>
#include <stdint.h>
#include <sys/uio.h>

#include "gpu/gpu_staging.h"
#include "transport/tcp/tcp.h"
#include "transport/tcp/wire.h"

#define MC_TCP_RBUF (256u * 1024u)
#define MC_AUTH_NONCE 32
#define MC_TCP_IOV_BATCH 1024

/* TCP's per-op state (op->tp): the op encoded for the wire -- header,
 * entry table, and the iovecs still to send.  One allocation. */
typedef struct mc_tcp_opw {
  uint8_t hdr[MC_WIRE_HDR_SIZE];
  uint8_t *table;
  struct iovec *iov;
  int niov, iov_idx;
  size_t iov_off;
} mc_tcp_opw_t;
#define MC_OPW(op) ((mc_tcp_opw_t *)(op)->tp)
/* (Re-)encodes a sealed op for the wire (replacing any earlier encoding). */
int mc_tcp_op_encode(mc_xfer_op_t *op, mc_err_t *err);

typedef struct mc_loop mc_loop_t;
typedef struct mc_conn mc_conn_t;

/* A response queued by the target side. */
typedef struct mc_resp {
  struct mc_resp *next;
  uint8_t hdr[MC_WIRE_HDR_SIZE];
  struct iovec *iov;
  int niov, iov_idx;
  size_t iov_off;
  mc_region_t **refs; /* regions pinned until sent (READ_DATA) */
  int nrefs;
  char *text; /* owned error text / body */
  struct iovec small[2];
  /* GPU staging (cuda regions): while gate is 1 a copy is in flight and the
   * response must not be sent; 2 = its connection died meanwhile and the
   * copy worker frees it. */
  atomic_int gate;
  mc_gpu_buf_t *gbuf;
  uint64_t cost; /* counted against the reply budgets while queued */
} mc_resp_t;

enum { CONN_CONNECTING, CONN_OPEN, CONN_DEAD };
enum { RS_HDR, RS_BODY, RS_PAYLOAD };

struct mc_conn {
  mc_tcp_t *tcp;
  mc_loop_t *loop;
  int fd;
  int outgoing; /* 1: we are the initiator */
  int state;
  char peer[320];     /* "host:port" for messages */
  char segment[320];  /* target segment name (outgoing) / peer name (incoming) */
  uint64_t connect_deadline_ns;
  int want_out; /* EPOLLOUT armed */

  /* Cross-thread inbox, under mu. */
  pthread_mutex_t mu;
  mc_xfer_op_t *inbox_head, *inbox_tail;
  int kick_pending;
  int dead_flag;
  /* Who may touch the loop-thread-only state below (under mu): the loop
   * sets loop_busy while it works on the connection; a caller thread may
   * take the connection over (owner_caller) while it is idle, to send and
   * poll its own small request without two thread hand-offs. */
  int loop_busy;
  int owner_caller;
  int kick_deferred; /* a KICK arrived while caller-owned: redo on hand-back */

  /* Loop-thread-only state. */
  mc_xfer_op_t *sendq_head, *sendq_tail; /* requests to send (outgoing) */
  mc_xfer_op_t *await_head, *await_tail; /* sent, awaiting responses */
  mc_resp_t *resp_head, *resp_tail;      /* responses to send (incoming) */
  uint64_t next_req_id;
  int hello_ok;
  /* Peer authentication (tcp_auth.c).  Initiator: 1 HELLO sent, 2 proof
   * sent, 3 done; target: 1 challenged, 2 done, 3 failed. */
  int auth_state;
  int auth_hold; /* initiator: requests wait until the target proved itself */
  uint8_t auth_ni[MC_AUTH_NONCE], auth_nt[MC_AUTH_NONCE];

  /* Receive side. */
  uint8_t *rbuf;
  size_t rpos, rlen;
  int drained;    /* the last read returned less than asked for */
  int small_msgs; /* the last message was small: read ahead more */
  int rstate;
  mc_wire_hdr_t rh;
  uint8_t *body; /* control body / entry table being gathered */
  size_t body_len, body_got;
  /* Payload scatter target. */
  struct iovec *piov;
  int pniov, pidx;
  size_t poff;
  uint64_t premain;  /* payload bytes still to read */
  int pdiscard;      /* drop payload bytes instead of storing */
  int pstatus;       /* target side: status to answer after a WRITE */
  uint32_t pbad;     /* 1 + index of the first refused entry, 0 if none */
  char perr[MC_ERR_MSG_MAX];
  mc_region_t **prefs;
  int pnrefs;
  mc_gpu_job_t *pjob; /* H2D copies of the WRITE payload being staged */

  /* Budgets (loop-thread-only): bytes of queued responses; reading paused
   * because of them; the loop should read again (buffered requests). */
  uint64_t resp_bytes;
  int rx_paused, rx_resume;
  int prehandshake; /* counted in tcp->prehandshake until its HELLO */
  /* While prehandshake: in tcp's FIFO of such connections (pre_mu), or
   * evicted from it (its socket shut down to make room for a newer one). */
  mc_conn_t *pre_prev, *pre_next;
  int pre_evicted;
  _Atomic uint64_t pre_hello_ns; /* when its HELLO's header arrived (0: not yet) */
  /* Initiator: a connection reset before the target's HELLO_ACK is dialed
   * again (its requests moved to the new one) up to MC_TCP_REDIALS times
   * while now < redial_until_ns (the first dial's connect deadline). */
  int redials;
  uint64_t redial_until_ns;

  int rst; /* close with RST (SO_LINGER 0): the kernel drops what is unsent */
  int cmd_refs; /* commands queued that name this conn (loop->mu) */
  mc_conn_t *next_in_loop;
};

typedef struct mc_cmd {
  struct mc_cmd *next;
  int kind; /* CMD_ADD, CMD_KICK, CMD_SWEEP, CMD_CUT */
  mc_conn_t *conn;
  void *arg; /* CMD_CUT: its mc_tcp_cut_t (tcp_loop.c) */
} mc_cmd_t;

enum { CMD_ADD = 1, CMD_KICK, CMD_SWEEP, CMD_CUT };

struct mc_loop {
  mc_tcp_t *tcp;
  int idx;
  int epfd;
  int evfd;
  pthread_t thread;
  pthread_mutex_t mu;
  mc_cmd_t *cmd_head, *cmd_tail;
  atomic_int stopping;
  mc_conn_t *conns; /* loop-thread-only list */
};

typedef struct mc_tcp_peer {
  char host[256];
  int port;
  char segment[320];
  mc_conn_t **conns; /* conns_per_peer slots, NULL when absent */
  unsigned rr;
} mc_tcp_peer_t;

struct mc_tcp {
  mc_tcp_opts_t opts;
  mc_tcp_hooks_t hooks;
  int listen_fd;
  int port;
  mc_loop_t *loops;
  int nloops;
  atomic_uint next_loop;
  pthread_mutex_t peers_mu;
  mc_tcp_peer_t **peers;
  size_t npeers, cap_peers;
  atomic_ullong reply_bytes, prehandshake_refused;
  atomic_int paused_conns, prehandshake;
  /* Connections before their HELLO, oldest first: when the budget is full
   * a new one evicts the oldest (an idle flood cannot keep peers out). */
  pthread_mutex_t pre_mu;
  mc_conn_t *pre_head, *pre_tail;
  atomic_int pre_evicting; /* evicted, not yet reaped by their loop */
  atomic_ullong prehandshake_evicted;
  atomic_ullong redials; /* initiator: handshakes dialed again after a reset */
};

/* tcp_loop.c */
void mc_loop_post(mc_loop_t *l, int kind, mc_conn_t *c);
int mc_conn_loop_acquire(mc_conn_t *c);
void mc_conn_loop_release(mc_conn_t *c);
void mc_conn_set_out(mc_conn_t *c, int on);
/* Re-applies epoll interest: EPOLLIN unless reading is paused, EPOLLOUT if
 * armed. */
void mc_conn_update_events(mc_conn_t *c);
/* The peer finished (or failed) its handshake: it no longer counts against
 * the pre-handshake budget. */
int mc_conn_prehandshake_done(mc_conn_t *c);
void mc_conn_kill(mc_conn_t *c, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Keeps a connection's memory alive (like a queued command) for a thread
 * that will post to it later (the GPU copy worker). */
void mc_conn_hold(mc_conn_t *c);
void mc_conn_unhold(mc_conn_t *c);

/* tcp_send.c */
int mc_conn_flush(mc_conn_t *c);
void mc_conn_enqueue_op(mc_conn_t *c, mc_xfer_op_t *op);
void mc_op_finalize(mc_xfer_op_t *op, int code, const char *msg);
/* tcp_loop.c: fills t (options with defaults, hooks, peers lock; no
 * listener, no loops) and sets up loop l's epoll and eventfd. */
void mc_tcp_init(mc_tcp_t *t, const mc_tcp_opts_t *opts, const mc_tcp_hooks_t *hooks);
int mc_tcp_loop_init(mc_tcp_t *t, mc_loop_t *l, int idx, mc_err_t *err);

/* tcp_auth.c */
struct cJSON;
/* The initiator's first HELLO (with its nonce) for connection c. */
mc_xfer_op_t *mc_auth_hello(mc_conn_t *c, mc_err_t *err);
/* Target: a HELLO arrived (j: its JSON) and the engine has a secret.
 * 0 with *reply the HELLO_ACK body (malloc'ed), or < 0 (err: send it back
 * as the error answer). */
int mc_auth_target_hello(mc_conn_t *c, const struct cJSON *j, char **reply, mc_err_t *err);
/* Target without a secret: warns when the peer offers authentication. */
void mc_auth_target_plain(const mc_conn_t *c, const struct cJSON *j);
/* Initiator: a HELLO_ACK from `target` arrived.  Checks the target's proof
 * and queues ours ahead of the held requests.  0 or < 0 (err). */
int mc_auth_initiator_ack(mc_conn_t *c, const struct cJSON *j, const char *target,
                          mc_err_t *err);

/* tcp_recv.c */
int mc_conn_on_readable(mc_conn_t *c);
void mc_resp_free(mc_tcp_t *t, mc_resp_t *r);
/* Takes a sent (or abandoned) response off the connection's budget, frees
 * it, and resumes reading when the queue has drained. */
void mc_conn_resp_done(mc_conn_t *c, mc_resp_t *r);
void mc_conn_free_recv(mc_conn_t *c);
/* tcp_loop.c: a connection on fd (CONN_CONNECTING if outgoing, else
 * CONN_OPEN) on the next loop, and its memory freed (after it is dead). */
mc_conn_t *mc_conn_new(mc_tcp_t *t, int fd, int outgoing, const char *peer,
                       const char *segment);
void mc_conn_free(mc_conn_t *c);
/* A region this incoming connection holds (a READ answer queued, a WRITE
 * payload being received) that an unregister revoked, or NULL. */
const mc_region_t *mc_conn_revoked_region(const mc_conn_t *c);

#endif
