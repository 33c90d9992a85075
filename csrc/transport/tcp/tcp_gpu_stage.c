/* Local GPU buffers over TCP (initiator side): an op whose entries include
 * GPU memory (ent.dev >= 0) is staged through a pinned buffer by the copy
 * worker -- D2H before a WRITE is sent, H2D after a READ's data arrived. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "transport/tcp/tcp_internal.h"
#include "util/bsearch.h"

/* ---- local GPU buffers over TCP (initiator side) ---- */

typedef struct staged {
  mc_tcp_t *t;
  mc_gpu_stager_t *gpu;
  mc_gpu_buf_t *buf;
  mc_xfer_done_fn done; /* the batch's */
  char host[256];
  int port;
  char segment[320];
  int dev;
  size_t n; /* staged entries: staging offset -> device pointer */
  uint64_t *soff;
  mc_cu_ptr *dptr;
  uint64_t *len;
  uint8_t *is_gpu; /* per entry at staging time */
} staged_t;

static void staged_free(staged_t *st) {
  free(st->soff);
  free(st->dptr);
  free(st->len);
  free(st->is_gpu);
  free(st);
}

/* op->done of a staged WRITE (or a failed READ): returns the buffer. */
static void staged_done(mc_xfer_op_t *op, int code, const char *msg) {
  staged_t *st = op->owner;
  mc_gpu_buf_put(st->gpu, st->buf);
  op->done = st->done;
  staged_free(st);
  op->done(op, code, msg);
}

static void read_h2d_done(mc_gpu_job_t *j, int code, const char *msg) {
  mc_xfer_op_t *op2 = j->arg;
  staged_t *st = j->arg2;
  mc_gpu_buf_put(st->gpu, st->buf);
  staged_free(st);
  op2->done(op2, code, msg);
  mc_xfer_op_free(op2);
  mc_gpu_job_free(j);
}

/* op->done of a staged READ (I/O thread): the data is in staging; copy it
 * to the GPU on the worker, then complete. */
static void staged_read_done(mc_xfer_op_t *op, int code, const char *msg) {
  staged_t *st = op->owner;
  mc_xfer_op_t *op2 = code == 0 ? mc_xfer_op_new(op->type, op->nent, 0) : NULL;
  mc_gpu_job_t *j = op2 ? mc_gpu_job_new(st->dev, MC_GPU_H2D) : NULL;
  if (!j) {
    mc_xfer_op_free(op2);
    staged_done(op, code ? code : MC_ENOMEM, code ? msg : "out of memory");
    return;
  }
  memcpy(op2->ent, op->ent, op->nent * sizeof *op->ent);
  op2->arg = op->arg;
  op2->done = st->done;
  char *base = st->buf->p;
  for (uint32_t i = 0; i < op->nent; i++) {
    char *p = op->ent[i].local;
    if (p < base || p >= base + st->buf->size)
      continue; /* host memory: already in place */
    uint64_t off = (uint64_t)(p - base);
#define SOFF(k) st->soff[k]
    size_t lo = MC_COUNT_LE(st->n, SOFF, off); /* the staged entry at this offset */
#undef SOFF
    if (lo > 0 && st->soff[lo - 1] == off)
      mc_gpu_job_add(j, st->dptr[lo - 1], (mc_cu_ptr)(uintptr_t)p, op->ent[i].len);
  }
  j->arg = op2;
  j->arg2 = st;
  j->complete = read_h2d_done;
  mc_gpu_stager_submit(st->gpu, j);
}

/* Worker: takes the staging buffer's place in the op's entries. */
static int stage_prepare(mc_gpu_job_t *j, mc_err_t *err) {
  mc_xfer_op_t *op = j->arg;
  staged_t *st = j->arg2;
  st->buf = j->buf;
  j->buf = NULL;
  uint64_t off = 0;
  st->n = 0;
  for (uint32_t i = 0; i < op->nent; i++) {
    if (!st->is_gpu[i])
      continue;
    char *host = (char *)st->buf->p + off;
    mc_cu_ptr dev = (mc_cu_ptr)(uintptr_t)op->ent[i].local;
    st->soff[st->n] = off;
    st->dptr[st->n] = dev;
    st->len[st->n] = op->ent[i].len;
    st->n++;
    if (op->type == MC_XFER_WRITE &&
        mc_gpu_job_add(j, (mc_cu_ptr)(uintptr_t)host, dev, op->ent[i].len) < 0)
      return mc_err_set(err, MC_ENOMEM, "out of memory");
    op->ent[i].local = host;
    off += op->ent[i].len;
  }
  mc_xfer_op_drop_tp(op); /* the transport encodes the new entries */
  return mc_xfer_op_seal(op, err);
}

/* Worker: the D2H copies of a WRITE are done (or a READ's buffer is in
 * place): send it. */
static void stage_ready(mc_gpu_job_t *j, int code, const char *msg) {
  mc_xfer_op_t *op = j->arg;
  staged_t *st = j->arg2;
  if (!st->buf && j->buf) { /* failed before prepare */
    st->buf = j->buf;
    j->buf = NULL;
  }
  if (code == 0 && op->cancel && atomic_load(op->cancel)) {
    code = MC_ECANCELED;
    msg = "canceled before it was sent";
  }
  if (code < 0) {
    op->done = staged_done;
    if (!st->buf) { /* nothing to return */
      op->done = st->done;
      staged_free(st);
    }
    op->done(op, code, msg);
    mc_xfer_op_free(op);
  } else {
    mc_tcp_submit(st->t, st->host, st->port, st->segment, &op, 1);
  }
  mc_gpu_job_free(j);
}

void mc_tcp_stage_op(mc_tcp_t *t, mc_xfer_op_t *op, const char *host, int port,
                     const char *segment) {
  staged_t *st = calloc(1, sizeof *st);
  mc_gpu_job_t *j = NULL;
  if (st) {
    st->soff = malloc(op->nent * sizeof *st->soff);
    st->dptr = malloc(op->nent * sizeof *st->dptr);
    st->len = malloc(op->nent * sizeof *st->len);
    st->is_gpu = calloc(op->nent, 1);
  }
  uint64_t bytes = 0;
  int dev = -1;
  if (st && st->soff && st->dptr && st->len && st->is_gpu) {
    for (uint32_t i = 0; i < op->nent; i++) {
      int d = op->ent[i].dev;
      if (d < 0)
        continue;
      st->is_gpu[i] = 1;
      bytes += op->ent[i].len;
      if (dev < 0)
        dev = d;
    }
    j = mc_gpu_job_new(dev, op->type == MC_XFER_WRITE ? MC_GPU_D2H : MC_GPU_H2D);
  }
  if (!j) {
    if (st)
      staged_free(st);
    op->done(op, MC_ENOMEM, "out of memory staging GPU memory");
    mc_xfer_op_free(op);
    return;
  }
  st->t = t;
  st->gpu = t->hooks.gpu;
  st->done = op->done;
  snprintf(st->host, sizeof st->host, "%s", host);
  st->port = port;
  snprintf(st->segment, sizeof st->segment, "%s", segment);
  st->dev = dev;
  op->owner = st;
  op->done = op->type == MC_XFER_WRITE ? staged_done : staged_read_done;
  j->want_buf = bytes;
  j->prepare = stage_prepare;
  j->complete = stage_ready;
  j->arg = op;
  j->arg2 = st;
  mc_gpu_stager_submit(t->hooks.gpu, j);
}
