/* KV control messages (docs/protocol.md "KV control messages"): encoding
 * and decoding only -- no I/O, no engine, no state, no allocation.
 *
 * Every message starts with a u32 magic and a u8 version (KV_VERSION) at
 * byte 4; the request id (lease id for a release) is the u64 at byte 8.
 * All integers little-endian.
 *
 * Encoders write into a caller buffer of `cap` bytes: they return the bytes
 * written, or MC_EINVAL (a field out of range) / MC_ETOOBIG (cap too small)
 * with err naming what.  kv_msg_*_size() says how big the buffer must be.
 * Decoders read untrusted bytes: every count is checked against the bytes
 * received (64-bit arithmetic, no overflow); they return 0 or MC_EPROTO
 * with err naming what was wrong.  Decoded pointers (tokens, extents, text)
 * point into the message. */
#ifndef MC_KV_KV_MSG_H
#define MC_KV_KV_MSG_H

#include <stddef.h>
#include <stdint.h>

#include "lookup/lookup_buffer.h" /* mc_lookup_extent_t */
#include "util/errors.h"

#define KV_REQ_MAGIC 0x5152564Bu  /* "KVRQ" recv_kv request (push) */
#define KV_REP_MAGIC 0x5052564Bu  /* "KVRP" its answer */
#define KV_PULL_MAGIC 0x5150564Bu /* "KVPQ" lease request (pull, probe) */
#define KV_PANS_MAGIC 0x5050564Bu /* "KVPP" its answer: extents + lease id */
#define KV_PREL_MAGIC 0x5250564Bu /* "KVPR" lease release */
#define KV_VERSION 1
#define KV_REQ_HDR 36
#define KV_REP_HDR 24
#define KV_PULL_HDR 28
#define KV_PANS_HDR 40
#define KV_PREL_LEN 16
#define KV_EXT_LEN 16 /* one extent on the wire: u64 addr, u64 len */

/* The magic (0 if shorter than 4 bytes) and the u64 at byte 8 (0 if
 * shorter than 16): enough to route a message and to answer a malformed
 * request by id. */
uint32_t kv_msg_magic(const void *m, size_t len);
uint64_t kv_msg_peek_id(const void *m, size_t len);

/* Extent i of a decoded extent array (16-byte records, unaligned). */
typedef struct kv_ext {
  uint64_t addr, len;
} kv_ext_t;
kv_ext_t kv_msg_extent(const uint8_t *extents, size_t i);

/* ---- KVRQ: recv_kv request (consumer -> producer) ----
 * header, ntok token ids of `width` bytes, ndest KV destinations
 * (block-major, epb per block), nhid hidden-state destinations. */
typedef struct kv_msg_req {
  uint64_t id;
  uint8_t width;   /* 4 or 8 */
  uint16_t epb;    /* extents per block, >= 1 */
  uint32_t timeout_ms;
  uint32_t ntok, ndest, nhid;
  const void *tokens; /* encode: ntok * width bytes; decode: into the message */
  /* encode only: */
  const mc_lookup_extent_t *dest, *hidden;
  /* decode only: ndest then nhid extents (kv_msg_extent(ext, i)) */
  const uint8_t *ext;
} kv_msg_req_t;
uint64_t kv_msg_req_size(const kv_msg_req_t *r);
long kv_msg_req_encode(const kv_msg_req_t *r, uint8_t *buf, size_t cap, mc_err_t *err);
int kv_msg_req_decode(const void *m, size_t len, kv_msg_req_t *out, mc_err_t *err);

/* ---- KVRP: its answer (producer -> consumer) ----
 * header, then (status < 0 only) UTF-8 error text, not terminated. */
typedef struct kv_msg_rep {
  uint64_t id;
  int32_t status; /* 0 or a negative MC_E* code */
  uint32_t matched;
  const char *text; /* status < 0: the error text (encode: may be NULL) */
  size_t text_len;
} kv_msg_rep_t;
uint64_t kv_msg_rep_size(const kv_msg_rep_t *r);
long kv_msg_rep_encode(const kv_msg_rep_t *r, uint8_t *buf, size_t cap, mc_err_t *err);
int kv_msg_rep_decode(const void *m, size_t len, kv_msg_rep_t *out, mc_err_t *err);

/* ---- KVPQ: lease request / probe (consumer -> producer) ----
 * header, then ntok token ids.  lease_ms 0 = probe; epb 0 = not checked
 * (probe only: the caller's logic). */
typedef struct kv_msg_lease_req {
  uint64_t id;
  uint8_t width; /* 4 or 8 */
  uint16_t epb;
  uint32_t lease_ms, ntok, skip;
  const void *tokens;
  /* decode: 1 when the fixed header (magic, version, size) was read, so
   * id and lease_ms hold even if the rest is malformed. */
  int hdr_ok;
} kv_msg_lease_req_t;
uint64_t kv_msg_lease_req_size(const kv_msg_lease_req_t *q);
long kv_msg_lease_req_encode(const kv_msg_lease_req_t *q, uint8_t *buf, size_t cap,
                             mc_err_t *err);
int kv_msg_lease_req_decode(const void *m, size_t len, kv_msg_lease_req_t *out, mc_err_t *err);

/* ---- KVPP: lease answer (producer -> consumer) ----
 * header, then (status >= 0) nb * epb extents, block-major, or (status < 0)
 * error text; nb is sent as 0 when status < 0. */
typedef struct kv_msg_lease_ans {
  uint64_t id, lease_id; /* lease 0 = none */
  int32_t status;
  uint32_t matched, nb, epb;
  /* encode (status >= 0): block(ctx, b) returns block b's epb extents */
  const mc_lookup_extent_t *(*block)(const void *ctx, size_t b);
  const void *ctx;
  const uint8_t *ext; /* decode: nb * epb extents */
  const char *text;   /* status < 0 */
  size_t text_len;
  int hdr_ok; /* decode: as in kv_msg_lease_req_t (id valid) */
} kv_msg_lease_ans_t;
uint64_t kv_msg_lease_ans_size(const kv_msg_lease_ans_t *a);
/* The most blocks of epb (>= 1) extents a lease answer of at most max_len
 * bytes carries. */
size_t kv_msg_lease_ans_max_blocks(uint32_t epb, size_t max_len);
long kv_msg_lease_ans_encode(const kv_msg_lease_ans_t *a, uint8_t *buf, size_t cap,
                             mc_err_t *err);
int kv_msg_lease_ans_decode(const void *m, size_t len, kv_msg_lease_ans_t *out, mc_err_t *err);

/* ---- KVPR: lease release (consumer -> producer): KV_PREL_LEN bytes ---- */
long kv_msg_release_encode(uint64_t lease_id, uint8_t *buf, size_t cap, mc_err_t *err);
int kv_msg_release_decode(const void *m, size_t len, uint64_t *lease_id, mc_err_t *err);

#endif
