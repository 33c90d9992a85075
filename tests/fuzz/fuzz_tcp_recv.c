/* The TCP transport's receive state machine (tcp_recv.c + wire.c) fed with
 * arbitrary bytes from a peer, both as target (requests) and as initiator
 * (responses to requests it has in flight).
 *
 * No listener or event loop: the harness builds one connection whose socket
 * is one end of a socketpair, writes the input into the other end and calls
 * mc_conn_on_readable() as the I/O thread would on EPOLLIN, draining the
 * responses the connection sends back.  At the end of the input the peer
 * half-closes; the connection must then die (EOF) within a bounded number
 * of calls: a parser that neither progresses nor fails is a finding.
 *
 * Input: byte 0 = flags (bit 0: initiator, bit 1: the HELLO exchange is
 * already done, bit 2: peer authentication on, with secret "fuzz-secret"),
 * then the bytes the peer sends.  The target owns a 64 KiB
 * region at FUZZ_REG (seeds use it); the initiator has ops in flight with
 * request ids 1..6: HELLO, WRITE, READ, NOTIFY, RPC, READ. */
#include "fuzz_common.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "transport/tcp/tcp_internal.h"

#define FUZZ_REG 0x40000000ul
#define FUZZ_REG_LEN (64u << 10)
#define DRAIN_CAP (4u << 20) /* response bytes read back per input */

static mc_tcp_t T;
static mc_loop_t L;
static mc_regions_t R;
static uint8_t local_src[8192], local_dst[8192];

static int on_notify(void *ctx, const char *from, const void *msg, size_t len, mc_err_t *err) {
  (void)ctx;
  (void)from;
  (void)msg;
  (void)len;
  (void)err;
  return 0;
}

static int on_rpc(void *ctx, const char *from, const char *req, size_t len, char **reply,
                  mc_err_t *err) {
  (void)ctx;
  (void)from;
  if (len && req[0] == 'E')
    return mc_err_set(err, MC_EINVAL, "refused %.20s", req);
  *reply = strdup("{\"ok\":true}");
  return *reply ? 0 : mc_err_set(err, MC_ENOMEM, "oom");
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  fuzz_quiet();
  mc_err_t e;
  if (mc_regions_init(&R) ||
      (fuzz_map_fixed(FUZZ_REG, FUZZ_REG_LEN),
       mc_regions_add(&R, FUZZ_REG, FUZZ_REG_LEN, "cpu", &e) < 0)) {
    fprintf(stderr, "fuzz_tcp_recv: setup failed\n");
    exit(2);
  }
  /* Defaults and setup as mc_tcp_start does them, minus listener and threads. */
  mc_tcp_opts_t o = {.conns_per_peer = 1, .io_threads = 1};
  mc_tcp_hooks_t h = {.local_name = "fuzz-target", .regions = &R, .on_notify = on_notify,
                      .on_rpc = on_rpc};
  mc_tcp_init(&T, &o, &h);
  T.loops = &L;
  T.nloops = 1;
  if (mc_tcp_loop_init(&T, &L, 0, &e) < 0) {
    fprintf(stderr, "fuzz_tcp_recv: %s\n", e.msg);
    exit(2);
  }
  return 0;
}

static void op_done(mc_xfer_op_t *op, int code, const char *msg) {
  (void)op;
  (void)code;
  (void)msg;
}

static void op_entry_failed(mc_xfer_op_t *op, uint32_t idx, int code, const char *msg) {
  (void)op;
  (void)idx;
  (void)code;
  (void)msg;
}

static mc_xfer_op_t *make_op(int type, const char *ctrl) {
  uint32_t nent = (type == MC_WIRE_WRITE || type == MC_WIRE_READ) ? 2 : 0;
  size_t cl = ctrl ? strlen(ctrl) : 0;
  mc_xfer_op_t *op = mc_xfer_op_new(type, nent, cl);
  if (!op)
    abort();
  if (cl)
    memcpy(op->ctrl, ctrl, cl);
  uint8_t *local = type == MC_WIRE_READ ? local_dst : local_src;
  for (uint32_t i = 0; i < nent; i++)
    op->ent[i] = (mc_xfer_ent_t){.local = local + 4096 * i, .remote = FUZZ_REG + 4096 * i,
                                 .len = 4096, .cookie = i};
  op->done = op_done;
  op->entry_failed = op_entry_failed;
  mc_err_t e;
  if (mc_xfer_op_seal(op, &e) < 0 || mc_tcp_op_encode(op, &e) < 0)
    abort();
  return op;
}

static void add_awaiting(mc_conn_t *c) {
  static const int types[] = {MC_WIRE_HELLO,  MC_WIRE_WRITE, MC_WIRE_READ,
                              MC_WIRE_NOTIFY, MC_WIRE_RPC,   MC_WIRE_READ};
  for (size_t i = 0; i < sizeof types / sizeof *types; i++) {
    if (types[i] == MC_WIRE_HELLO && c->hello_ok)
      continue;
    mc_xfer_op_t *op = make_op(types[i], types[i] == MC_WIRE_HELLO    ? "{\"segment\":\"s\"}"
                                         : types[i] == MC_WIRE_NOTIFY ? "note"
                                         : types[i] == MC_WIRE_RPC    ? "{}"
                                                                      : NULL);
    op->req_id = i + 1;
    mc_put_u64(MC_OPW(op)->hdr + 16, op->req_id);
    MC_OPW(op)->iov_idx = MC_OPW(op)->niov; /* already sent */
    op->started = 1;
    if (c->await_tail)
      c->await_tail->next = op;
    else
      c->await_head = op;
    c->await_tail = op;
  }
  c->next_req_id = 6;
}

/* Reads back what the connection sent (responses / resent requests). */
static void drain(int fd, size_t *drained) {
  static uint8_t sink[65536];
  while (*drained < DRAIN_CAP) {
    ssize_t n = read(fd, sink, sizeof sink);
    if (n <= 0)
      return;
    *drained += (size_t)n;
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1)
    return 0;
  int flags = data[0];
  data++;
  size--;
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) < 0)
    abort();
  mc_conn_t *c = mc_conn_new(&T, sv[0], flags & 1, "fuzz-peer:1", flags & 1 ? "fuzz-target" : "");
  if (!c)
    abort();
  c->state = CONN_OPEN;
  c->hello_ok = (flags >> 1) & 1;
  T.hooks.auth_secret = flags & 4 ? "fuzz-secret" : NULL;
  if (c->outgoing && !c->hello_ok && (flags & 4)) {
    c->auth_state = 1; /* as mc_auth_hello leaves it (nonce: zeros) */
    c->auth_hold = 1;
  }
  if (c->outgoing)
    add_awaiting(c);

  size_t off = 0, drained = 0;
  int closed = 0;
  for (int calls = 0; c->state == CONN_OPEN; calls++) {
    if (calls > 100000) {
      fprintf(stderr, "fuzz_tcp_recv: connection neither progresses nor fails\n");
      abort();
    }
    if (off < size) {
      ssize_t n = send(sv[1], data + off, size - off, MSG_NOSIGNAL);
      if (n > 0)
        off += (size_t)n;
    } else if (!closed) {
      shutdown(sv[1], SHUT_WR);
      closed = 1;
    }
    mc_conn_on_readable(c);
    drain(sv[1], &drained);
  }
  close(sv[1]);
  if (c->state != CONN_DEAD)
    mc_conn_kill(c, MC_ECLOSED, "fuzz input done");
  mc_conn_free(c);
  return 0;
}
