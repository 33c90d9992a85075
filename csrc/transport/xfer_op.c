/* The op type every transport takes (xfer_op.h). */
#include "transport/xfer_op.h"

#include <stdlib.h>
#include <string.h>

mc_xfer_op_t *mc_xfer_op_new(int type, uint32_t nent, size_t ctrl_len) {
  mc_xfer_op_t *op = calloc(1, MC_XFER_OP_BYTES(nent));
  if (!op)
    return NULL;
  op->type = type;
  op->nent = op->cap = nent;
  for (uint32_t i = 0; i < nent; i++)
    op->ent[i].dev = -1;
  if (ctrl_len) {
    op->ctrl = malloc(ctrl_len);
    if (!op->ctrl) {
      free(op);
      return NULL;
    }
    op->ctrl_len = ctrl_len;
  }
  return op;
}

mc_xfer_op_t *mc_xfer_op_init(void *mem, int type, uint32_t nent) {
  mc_xfer_op_t *op = mem;
  memset(op, 0, sizeof *op); /* the entries are the caller's to fill, every one */
  op->type = type;
  op->nent = op->cap = nent;
  return op;
}

void mc_xfer_op_drop_tp(mc_xfer_op_t *op) {
  if (op->tp_free)
    op->tp_free(op->tp);
  op->tp = NULL;
  op->tp_free = NULL;
}

void mc_xfer_op_free(mc_xfer_op_t *op) {
  if (!op)
    return;
  mc_xfer_op_drop_tp(op);
  free(op->ctrl);
  free(op->resp);
  free(op);
}

int mc_xfer_op_seal(mc_xfer_op_t *op, mc_err_t *err) {
  op->total = 0;
  if (op->type == MC_XFER_WRITE || op->type == MC_XFER_READ) {
    if (op->nent == 0 || op->nent > MC_XFER_MAX_ENTRIES)
      return mc_err_set(err, MC_EINVAL, "an op must carry 1..%u entries", MC_XFER_MAX_ENTRIES);
    for (uint32_t i = 0; i < op->nent; i++)
      op->total += op->ent[i].len;
  } else if (op->ctrl_len > MC_XFER_MAX_CTRL) {
    return mc_err_set(err, MC_ETOOBIG, "a control message of %zu bytes exceeds %u",
                      op->ctrl_len, MC_XFER_MAX_CTRL);
  }
  return 0;
}
