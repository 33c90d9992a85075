/* KV control messages: encoding and decoding (kv_msg.h).  Pure. */
#include "kv/kv_msg.h"

#include <string.h>

#include "util/bytes.h"

uint32_t kv_msg_magic(const void *m, size_t len) {
  return len >= 4 ? mc_get_u32(m) : 0;
}

uint64_t kv_msg_peek_id(const void *m, size_t len) {
  return len >= 16 ? mc_get_u64((const uint8_t *)m + 8) : 0;
}

kv_ext_t kv_msg_extent(const uint8_t *extents, size_t i) {
  const uint8_t *p = extents + KV_EXT_LEN * i;
  return (kv_ext_t){.addr = mc_get_u64(p), .len = mc_get_u64(p + 8)};
}

static void put_extent(uint8_t *p, uint64_t addr, uint64_t len) {
  mc_put_u64(p, addr);
  mc_put_u64(p + 8, len);
}

/* Common checks of an encoder: width, buffer size.  Returns 0 or < 0. */
static int enc_check(const char *what, uint64_t need, size_t cap, mc_err_t *err) {
  if (need > cap)
    return mc_err_set(err, MC_ETOOBIG, "%s: %llu bytes do not fit the %zu-byte buffer", what,
                      (unsigned long long)need, cap);
  return 0;
}

/* The header every KV message starts with: magic, version, id (at byte 8),
 * the rest of the fixed header zeroed for the encoder to fill. */
static void enc_head(uint8_t *buf, size_t hdr, uint32_t magic, uint64_t id) {
  memset(buf, 0, hdr);
  mc_put_u32(buf, magic);
  buf[4] = KV_VERSION;
  mc_put_u64(buf + 8, id);
}

static int width_ok(unsigned width) { return width == 4 || width == 8; }

/* Starts a decoder: magic, version, fixed header length (exact if `exact`). */
static int dec_head(const uint8_t *m, size_t len, uint32_t magic, size_t hdr, int exact,
                    const char *what, mc_err_t *err) {
  if (len < hdr || (exact && len != hdr))
    return mc_err_set(err, MC_EPROTO, "malformed %s: %zu bytes, expected %s%zu", what, len,
                      exact ? "" : "at least ", hdr);
  if (mc_get_u32(m) != magic)
    return mc_err_set(err, MC_EPROTO, "malformed %s: magic 0x%08x, expected 0x%08x", what,
                      mc_get_u32(m), magic);
  if (m[4] != KV_VERSION)
    return mc_err_set(err, MC_EPROTO, "malformed %s: version %u, this engine speaks %u (mixed "
                      "releases? upgrade both sides)", what, m[4], KV_VERSION);
  return 0;
}

/* ---- KVRQ ---- */

uint64_t kv_msg_req_size(const kv_msg_req_t *r) {
  return KV_REQ_HDR + (uint64_t)r->ntok * r->width +
         ((uint64_t)r->ndest + r->nhid) * KV_EXT_LEN;
}

long kv_msg_req_encode(const kv_msg_req_t *r, uint8_t *buf, size_t cap, mc_err_t *err) {
  if (!width_ok(r->width) || r->epb == 0)
    return mc_err_set(err, MC_EINVAL, "recv_kv request: token width %u (4 or 8) or extents per "
                      "block %u (>= 1) out of range", r->width, r->epb);
  if ((r->ntok && !r->tokens) || (r->ndest && !r->dest) || (r->nhid && !r->hidden))
    return mc_err_set(err, MC_EINVAL, "recv_kv request: tokens or extents missing");
  uint64_t need = kv_msg_req_size(r);
  int rc = enc_check("recv_kv request", need, cap, err);
  if (rc < 0)
    return rc;
  enc_head(buf, KV_REQ_HDR, KV_REQ_MAGIC, r->id);
  buf[5] = r->width;
  mc_put_u16(buf + 6, r->epb);
  mc_put_u32(buf + 16, r->timeout_ms);
  mc_put_u32(buf + 20, r->nhid);
  mc_put_u32(buf + 24, r->ntok);
  mc_put_u32(buf + 28, r->ndest);
  uint8_t *p = buf + KV_REQ_HDR;
  if (r->ntok)
    memcpy(p, r->tokens, (size_t)r->ntok * r->width);
  p += (size_t)r->ntok * r->width;
  for (uint32_t i = 0; i < r->ndest; i++, p += KV_EXT_LEN)
    put_extent(p, r->dest[i].addr, r->dest[i].len);
  for (uint32_t i = 0; i < r->nhid; i++, p += KV_EXT_LEN)
    put_extent(p, r->hidden[i].addr, r->hidden[i].len);
  return (long)need;
}

int kv_msg_req_decode(const void *msg, size_t len, kv_msg_req_t *out, mc_err_t *err) {
  const uint8_t *m = msg;
  memset(out, 0, sizeof *out);
  int rc = dec_head(m, len, KV_REQ_MAGIC, KV_REQ_HDR, 0, "recv_kv request", err);
  if (rc < 0)
    return rc;
  out->id = mc_get_u64(m + 8);
  out->width = m[5];
  out->epb = mc_get_u16(m + 6);
  out->timeout_ms = mc_get_u32(m + 16);
  out->nhid = mc_get_u32(m + 20);
  out->ntok = mc_get_u32(m + 24);
  out->ndest = mc_get_u32(m + 28);
  if (!width_ok(out->width))
    return mc_err_set(err, MC_EPROTO, "malformed recv_kv request: token width %u (4 or 8)",
                      out->width);
  if (out->epb == 0)
    return mc_err_set(err, MC_EPROTO, "malformed recv_kv request: 0 extents per block");
  uint64_t need = kv_msg_req_size(out); /* < 2^38: no overflow */
  if (need != len)
    return mc_err_set(err, MC_EPROTO, "malformed recv_kv request: %u tokens x %u bytes, %u KV "
                      "and %u hidden-state extents need %llu bytes, got %zu", out->ntok,
                      out->width, out->ndest, out->nhid, (unsigned long long)need, len);
  out->tokens = m + KV_REQ_HDR;
  out->ext = m + KV_REQ_HDR + (size_t)out->ntok * out->width;
  return 0;
}

/* ---- KVRP ---- */

static size_t rep_text_len(int32_t status, const char *text, size_t text_len) {
  return status < 0 && text ? text_len : 0;
}

uint64_t kv_msg_rep_size(const kv_msg_rep_t *r) {
  return KV_REP_HDR + (uint64_t)rep_text_len(r->status, r->text, r->text_len);
}

long kv_msg_rep_encode(const kv_msg_rep_t *r, uint8_t *buf, size_t cap, mc_err_t *err) {
  uint64_t need = kv_msg_rep_size(r);
  int rc = enc_check("recv_kv answer", need, cap, err);
  if (rc < 0)
    return rc;
  enc_head(buf, KV_REP_HDR, KV_REP_MAGIC, r->id);
  mc_put_u32(buf + 16, (uint32_t)r->status);
  mc_put_u32(buf + 20, r->matched);
  size_t tl = rep_text_len(r->status, r->text, r->text_len);
  if (tl)
    memcpy(buf + KV_REP_HDR, r->text, tl);
  return (long)need;
}

int kv_msg_rep_decode(const void *msg, size_t len, kv_msg_rep_t *out, mc_err_t *err) {
  const uint8_t *m = msg;
  memset(out, 0, sizeof *out);
  int rc = dec_head(m, len, KV_REP_MAGIC, KV_REP_HDR, 0, "recv_kv answer", err);
  if (rc < 0)
    return rc;
  out->id = mc_get_u64(m + 8);
  out->status = (int32_t)mc_get_u32(m + 16);
  out->matched = mc_get_u32(m + 20);
  out->text = (const char *)m + KV_REP_HDR;
  out->text_len = len - KV_REP_HDR;
  return 0;
}

/* ---- KVPQ ---- */

uint64_t kv_msg_lease_req_size(const kv_msg_lease_req_t *q) {
  return KV_PULL_HDR + (uint64_t)q->ntok * q->width;
}

long kv_msg_lease_req_encode(const kv_msg_lease_req_t *q, uint8_t *buf, size_t cap,
                             mc_err_t *err) {
  if (!width_ok(q->width))
    return mc_err_set(err, MC_EINVAL, "KV lease request: token width %u (4 or 8)", q->width);
  if (q->ntok && !q->tokens)
    return mc_err_set(err, MC_EINVAL, "KV lease request: tokens missing");
  uint64_t need = kv_msg_lease_req_size(q);
  int rc = enc_check("KV lease request", need, cap, err);
  if (rc < 0)
    return rc;
  enc_head(buf, KV_PULL_HDR, KV_PULL_MAGIC, q->id);
  buf[5] = q->width;
  mc_put_u16(buf + 6, q->epb);
  mc_put_u32(buf + 16, q->lease_ms);
  mc_put_u32(buf + 20, q->ntok);
  mc_put_u32(buf + 24, q->skip);
  if (q->ntok)
    memcpy(buf + KV_PULL_HDR, q->tokens, (size_t)q->ntok * q->width);
  return (long)need;
}

int kv_msg_lease_req_decode(const void *msg, size_t len, kv_msg_lease_req_t *out,
                            mc_err_t *err) {
  const uint8_t *m = msg;
  memset(out, 0, sizeof *out);
  int rc = dec_head(m, len, KV_PULL_MAGIC, KV_PULL_HDR, 0, "KV lease request", err);
  if (rc < 0)
    return rc;
  out->hdr_ok = 1;
  out->id = mc_get_u64(m + 8);
  out->width = m[5];
  out->epb = mc_get_u16(m + 6);
  out->lease_ms = mc_get_u32(m + 16);
  out->ntok = mc_get_u32(m + 20);
  out->skip = mc_get_u32(m + 24);
  if (!width_ok(out->width))
    return mc_err_set(err, MC_EPROTO, "malformed KV lease request: token width %u (4 or 8)",
                      out->width);
  uint64_t need = kv_msg_lease_req_size(out);
  if (need != len)
    return mc_err_set(err, MC_EPROTO, "malformed KV lease request: %u tokens x %u bytes need "
                      "%llu bytes, got %zu", out->ntok, out->width, (unsigned long long)need,
                      len);
  out->tokens = m + KV_PULL_HDR;
  return 0;
}

/* ---- KVPP ---- */

static uint64_t lease_ans_nx(const kv_msg_lease_ans_t *a) {
  return a->status < 0 ? 0 : (uint64_t)a->nb * a->epb; /* < 2^64: u32 x u32 */
}

uint64_t kv_msg_lease_ans_size(const kv_msg_lease_ans_t *a) {
  uint64_t nx = lease_ans_nx(a);
  if (nx > (UINT64_MAX - KV_PANS_HDR) / KV_EXT_LEN)
    return UINT64_MAX;
  return KV_PANS_HDR + nx * KV_EXT_LEN + rep_text_len(a->status, a->text, a->text_len);
}

size_t kv_msg_lease_ans_max_blocks(uint32_t epb, size_t max_len) {
  if (epb == 0 || max_len < KV_PANS_HDR)
    return 0;
  return (max_len - KV_PANS_HDR) / ((size_t)KV_EXT_LEN * epb);
}

long kv_msg_lease_ans_encode(const kv_msg_lease_ans_t *a, uint8_t *buf, size_t cap,
                             mc_err_t *err) {
  uint64_t nx = lease_ans_nx(a);
  if (nx && !a->block)
    return mc_err_set(err, MC_EINVAL, "KV lease answer: %u blocks but no extents", a->nb);
  uint64_t need = kv_msg_lease_ans_size(a);
  int rc = enc_check("KV lease answer", need, cap, err);
  if (rc < 0)
    return rc;
  enc_head(buf, KV_PANS_HDR, KV_PANS_MAGIC, a->id);
  mc_put_u32(buf + 16, (uint32_t)a->status);
  mc_put_u32(buf + 20, a->matched);
  mc_put_u64(buf + 24, a->lease_id);
  mc_put_u32(buf + 32, a->status < 0 ? 0 : a->nb);
  mc_put_u32(buf + 36, a->epb);
  uint8_t *p = buf + KV_PANS_HDR;
  for (size_t b = 0; nx && b < a->nb; b++) {
    const mc_lookup_extent_t *x = a->block(a->ctx, b);
    for (uint32_t k = 0; k < a->epb; k++, p += KV_EXT_LEN)
      put_extent(p, x[k].addr, x[k].len);
  }
  size_t tl = rep_text_len(a->status, a->text, a->text_len);
  if (tl)
    memcpy(p, a->text, tl);
  return (long)need;
}

int kv_msg_lease_ans_decode(const void *msg, size_t len, kv_msg_lease_ans_t *out,
                            mc_err_t *err) {
  const uint8_t *m = msg;
  memset(out, 0, sizeof *out);
  int rc = dec_head(m, len, KV_PANS_MAGIC, KV_PANS_HDR, 0, "KV lease answer", err);
  if (rc < 0)
    return rc;
  out->hdr_ok = 1;
  out->id = mc_get_u64(m + 8);
  out->status = (int32_t)mc_get_u32(m + 16);
  out->matched = mc_get_u32(m + 20);
  out->lease_id = mc_get_u64(m + 24);
  out->nb = mc_get_u32(m + 32);
  out->epb = mc_get_u32(m + 36);
  size_t body = len - KV_PANS_HDR;
  if (out->status < 0) {
    out->text = (const char *)m + KV_PANS_HDR;
    out->text_len = body;
    return 0;
  }
  if (out->epb == 0)
    return mc_err_set(err, MC_EPROTO, "malformed KV lease answer: 0 extents per block");
  uint64_t nx = (uint64_t)out->nb * out->epb;
  if (nx > body / KV_EXT_LEN || body != nx * KV_EXT_LEN)
    return mc_err_set(err, MC_EPROTO, "malformed KV lease answer: %u blocks x %u extents in a "
                      "%zu-byte body (needs %u x %u x 16)", out->nb, out->epb, body, out->nb,
                      out->epb);
  out->ext = m + KV_PANS_HDR;
  return 0;
}

/* ---- KVPR ---- */

long kv_msg_release_encode(uint64_t lease_id, uint8_t *buf, size_t cap, mc_err_t *err) {
  int rc = enc_check("KV lease release", KV_PREL_LEN, cap, err);
  if (rc < 0)
    return rc;
  enc_head(buf, KV_PREL_LEN, KV_PREL_MAGIC, lease_id);
  return KV_PREL_LEN;
}

int kv_msg_release_decode(const void *msg, size_t len, uint64_t *lease_id, mc_err_t *err) {
  const uint8_t *m = msg;
  *lease_id = 0;
  int rc = dec_head(m, len, KV_PREL_MAGIC, KV_PREL_LEN, 1, "KV lease release", err);
  if (rc < 0)
    return rc;
  *lease_id = mc_get_u64(m + 8);
  return 0;
}
