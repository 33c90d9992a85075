/* The unit of work the engine hands to a transport (TCP or RDMA): one op of
 * up to a few thousand (local, remote, len) entries of one opcode, or one
 * control message.  Each op's done() runs exactly once; after it returns
 * the transport never touches the op's local buffers.  Implemented in
 * transport/tcp/tcp_send.c (the TCP wire encoding lives in the same
 * struct). */
#ifndef MC_TRANSPORT_XFER_OP_H
#define MC_TRANSPORT_XFER_OP_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "util/errors.h"

typedef struct mc_xfer_op mc_xfer_op_t;

typedef struct mc_xfer_ent {
  void *local;     /* source (WRITE) or destination (READ) */
  uint64_t remote; /* address in the target segment */
  uint64_t len;
  uint32_t cookie; /* owner's tag (task index) */
} mc_xfer_ent_t;

typedef void (*mc_xfer_done_fn)(mc_xfer_op_t *op, int code, const char *msg);

struct mc_xfer_op {
  /* Filled by the submitter. */
  int type; /* MC_WIRE_WRITE, MC_WIRE_READ, MC_WIRE_NOTIFY or MC_WIRE_RPC */
  uint32_t nent;
  uint64_t total; /* sum of ent[].len, set by mc_xfer_op_seal */
  mc_xfer_done_fn done;
  /* Optional: one entry was refused by the target (e.g. out of range).  The
   * transport drops that entry and resends the rest of the op, so requests
   * that share a wire op with a bad one still complete. */
  void (*entry_failed)(mc_xfer_op_t *op, uint32_t idx, int code, const char *msg);
  void *arg;
  atomic_int *cancel; /* optional: non-zero asks to stop (see sweep) */
  void *owner;        /* submitter's, untouched by the transport */
  uint8_t *ctrl;      /* NOTIFY / RPC body, owned */
  size_t ctrl_len;
  /* RPC: the reply text (NUL-terminated, owned by the op; done() may take
   * it by setting resp to NULL). */
  char *resp;
  size_t resp_len;
  /* Transport-private. */
  mc_xfer_op_t *next;
  uint64_t req_id;
  int finalized;
  int started; /* first byte handed to the kernel */
  uint8_t hdr[32];
  uint8_t *table;
  struct iovec *iov;
  int niov;
  int iov_idx;
  size_t iov_off;
  mc_xfer_ent_t ent[];
};

/* Allocates an op with room for nent entries (and ctrl_len body bytes). */
mc_xfer_op_t *mc_xfer_op_new(int type, uint32_t nent, size_t ctrl_len);
/* Computes totals and encodes header/table/iovecs. Call after filling ent. */
int mc_xfer_op_seal(mc_xfer_op_t *op, mc_err_t *err);
/* Frees an op that was never submitted. */
void mc_xfer_op_free(mc_xfer_op_t *op);

#endif
