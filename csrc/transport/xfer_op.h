/* The unit of work the engine hands to a transport (transport/transport.h):
 * one op of up to a few thousand (local, remote, len) entries of one
 * opcode, or one control message.  Each op's done() runs exactly once;
 * after it returns the transport never touches the op's local buffers.
 * Independent of any transport: a transport keeps its own per-op state
 * (e.g. TCP's encoded header and iovecs) behind `tp`.  Implemented in
 * transport/xfer_op.c. */
#ifndef MC_TRANSPORT_XFER_OP_H
#define MC_TRANSPORT_XFER_OP_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "util/errors.h"

/* Op types.  The values are the TCP wire's message types (tcp/wire.h checks
 * that they match) but mean the same to every transport. */
enum {
  MC_XFER_WRITE = 3,
  MC_XFER_READ = 5,
  MC_XFER_NOTIFY = 7,
  MC_XFER_RPC = 9,
};
#define MC_XFER_MAX_ENTRIES 4096u     /* entries in one op */
#define MC_XFER_MAX_CTRL (16u << 20)  /* NOTIFY / RPC body, reply text */

typedef struct mc_xfer_op mc_xfer_op_t;

/* One request of a submit call as the caller gave it (engine.h's
 * mc_request_t is this type): a transport that takes whole calls
 * (transport.h submit_call) reads them as they are. */
enum { MC_XFER_REQ_READ = 0, MC_XFER_REQ_WRITE = 1 };
typedef struct mc_xfer_req {
  int opcode;      /* MC_XFER_REQ_READ: remote -> local; MC_XFER_REQ_WRITE: local -> remote */
  void *local;     /* local buffer */
  uint64_t remote; /* address in the target segment */
  uint64_t len;
} mc_xfer_req_t;

typedef struct mc_xfer_ent {
  void *local;     /* source (WRITE) or destination (READ) */
  uint64_t remote; /* address in the target segment */
  uint64_t len;
  uint32_t cookie; /* owner's tag (task index) */
  int32_t dev;     /* local memory: cuda device, or -1 for host memory */
} mc_xfer_ent_t;

typedef void (*mc_xfer_done_fn)(mc_xfer_op_t *op, int code, const char *msg);

struct mc_xfer_op {
  /* Filled by the submitter. */
  int type; /* MC_XFER_WRITE, MC_XFER_READ, MC_XFER_NOTIFY or MC_XFER_RPC */
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
  /* For the transport holding the op. */
  mc_xfer_op_t *next; /* its queues */
  uint64_t req_id;
  int finalized;
  int started; /* first byte handed to the kernel / posted */
  void *tp;    /* its per-op state, freed by tp_free (mc_xfer_op_free) */
  void (*tp_free)(void *tp);
  uint32_t cap; /* entries the op's memory has room for (>= nent) */
  mc_xfer_ent_t ent[];
};

/* Allocates an op with room for nent entries (and ctrl_len body bytes). */
mc_xfer_op_t *mc_xfer_op_new(int type, uint32_t nent, size_t ctrl_len);
/* A WRITE / READ op in memory the caller has (MC_XFER_OP_BYTES(nent) of
 * it, from malloc: mc_xfer_op_free frees it; e.g. a block kept for reuse),
 * whose nent entries the caller fills, every one (not zeroed: a large
 * batch's entries are written once). */
#define MC_XFER_OP_BYTES(nent) (sizeof(mc_xfer_op_t) + (size_t)(nent) * sizeof(mc_xfer_ent_t))
mc_xfer_op_t *mc_xfer_op_init(void *mem, int type, uint32_t nent);
/* Checks the entry count and computes total.  Call after filling ent. */
int mc_xfer_op_seal(mc_xfer_op_t *op, mc_err_t *err);
/* Frees a transport's per-op state (entries changed: it encodes again). */
void mc_xfer_op_drop_tp(mc_xfer_op_t *op);
/* Frees an op that was never submitted. */
void mc_xfer_op_free(mc_xfer_op_t *op);

#endif
