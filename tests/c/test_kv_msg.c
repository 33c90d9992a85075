/* KV control messages (csrc/kv/kv_msg.[ch]): golden bytes written by hand
 * from docs/protocol.md "KV control messages" (a format change fails here),
 * round trips, and malformed input.  Pure: no engine. Runs under ASan. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv/kv_msg.h"
#include "testlib.h"

/* ---- golden messages (docs/protocol.md) ---- */

static const uint8_t G_REQ[] = {
    'K', 'V', 'R', 'Q', 0x01, 0x04, 0x02, 0x00,     /* magic, version, width 4, epb 2 */
    0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11, /* id */
    0xe8, 0x03, 0x00, 0x00,                         /* timeout 1000 ms */
    0x01, 0x00, 0x00, 0x00,                         /* nhidden 1 */
    0x02, 0x00, 0x00, 0x00,                         /* ntok 2 */
    0x02, 0x00, 0x00, 0x00,                         /* ndest 2 */
    0x00, 0x00, 0x00, 0x00,                         /* reserved */
    0x07, 0x00, 0x00, 0x00, 0x09, 0x00, 0x00, 0x01, /* tokens 7, 0x01000009 */
    0x00, 0x10, 0, 0, 0, 0, 0, 0, 0x20, 0, 0, 0, 0, 0, 0, 0, /* dest 0x1000 +32 */
    0x00, 0x20, 0, 0, 0, 0, 0, 0, 0x20, 0, 0, 0, 0, 0, 0, 0, /* dest 0x2000 +32 */
    0x00, 0x30, 0, 0, 0, 0, 0, 0, 0x08, 0, 0, 0, 0, 0, 0, 0, /* hidden 0x3000 +8 */
};

static const uint8_t G_REP_ERR[] = {
    'K', 'V', 'R', 'P', 0x01, 0x00, 0x00, 0x00,     /* magic, version, 3 x 0 */
    0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11, /* id */
    0xfd, 0xff, 0xff, 0xff,                         /* status -3 */
    0x00, 0x00, 0x00, 0x00,                         /* matched 0 */
    'n', 'o',                                       /* error text */
};

static const uint8_t G_REP_OK[] = {
    'K', 'V', 'R', 'P', 0x01, 0x00, 0x00, 0x00, 0x02, 0, 0, 0, 0, 0, 0, 0, /* id 2 */
    0x00, 0x00, 0x00, 0x00,                                               /* status 0 */
    0x20, 0x00, 0x00, 0x00,                                               /* matched 32 */
};

static const uint8_t G_LREQ[] = {
    'K', 'V', 'P', 'Q', 0x01, 0x08, 0x03, 0x00,     /* magic, version, width 8, epb 3 */
    0x05, 0, 0, 0, 0, 0, 0, 0,                      /* id 5 */
    0x30, 0x75, 0x00, 0x00,                         /* lease 30000 ms */
    0x01, 0x00, 0x00, 0x00,                         /* ntok 1 */
    0x02, 0x00, 0x00, 0x00,                         /* skip 2 */
    0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01, /* token 0x0102030405060708 */
};

static const uint8_t G_LANS[] = {
    'K', 'V', 'P', 'P', 0x01, 0x00, 0x00, 0x00, /* magic, version, 3 x 0 */
    0x05, 0, 0, 0, 0, 0, 0, 0,                  /* id 5 */
    0x00, 0x00, 0x00, 0x00,                     /* status 0 */
    0x08, 0x00, 0x00, 0x00,                     /* matched 8 */
    0x09, 0, 0, 0, 0, 0, 0, 0,                  /* lease id 9 */
    0x01, 0x00, 0x00, 0x00,                     /* nblocks 1 */
    0x02, 0x00, 0x00, 0x00,                     /* epb 2 */
    0x00, 0xa0, 0, 0, 0, 0, 0, 0, 0x00, 0x01, 0, 0, 0, 0, 0, 0, /* 0xa000 +256 */
    0x00, 0xb0, 0, 0, 0, 0, 0, 0, 0x00, 0x01, 0, 0, 0, 0, 0, 0, /* 0xb000 +256 */
};

static const uint8_t G_LANS_ERR[] = {
    'K', 'V', 'P', 'P', 0x01, 0x00, 0x00, 0x00, 0x05, 0, 0, 0, 0, 0, 0, 0, /* id 5 */
    0xfb, 0xff, 0xff, 0xff,                                               /* status -5 */
    0x00, 0x00, 0x00, 0x00,                                               /* matched 0 */
    0x00, 0, 0, 0, 0, 0, 0, 0,                                            /* no lease */
    0x00, 0x00, 0x00, 0x00, /* nblocks: 0 when status < 0 */
    0x02, 0x00, 0x00, 0x00, /* epb 2 */
    'x',
};

static const uint8_t G_REL[] = {
    'K', 'V', 'P', 'R', 0x01, 0x00, 0x00, 0x00, 0x09, 0, 0, 0, 0, 0, 0, 0x80, /* lease 2^63+9 */
};

static const mc_lookup_extent_t DEST[] = {{0x1000, 32, 0}, {0x2000, 32, 0}};
static const mc_lookup_extent_t HID[] = {{0x3000, 8, 0}};
static const mc_lookup_extent_t LBLK[] = {{0xa000, 256, 0}, {0xb000, 256, 0}};
static const uint32_t TOK4[] = {7, 0x01000009};
static const uint64_t TOK8[] = {0x0102030405060708ull};

static const mc_lookup_extent_t *one_block(const void *ctx, size_t b) {
  (void)b;
  return ctx;
}

/* A heap copy of exactly n bytes, so ASan sees any read past the end. */
static uint8_t *dup_n(const uint8_t *m, size_t n) {
  uint8_t *p = malloc(n ? n : 1);
  if (p && n)
    memcpy(p, m, n);
  return p;
}

static kv_msg_req_t golden_req(void) {
  return (kv_msg_req_t){.id = 0x1122334455667788ull, .width = 4, .epb = 2, .timeout_ms = 1000,
                        .ntok = 2, .ndest = 2, .nhid = 1, .tokens = TOK4, .dest = DEST,
                        .hidden = HID};
}

/* ---- encoders produce the golden bytes ---- */

static void test_encode_golden(void) {
  uint8_t buf[256];
  mc_err_t err = {0};
  kv_msg_req_t q = golden_req();
  CHECK_EQ_INT(kv_msg_req_size(&q), sizeof G_REQ);
  CHECK_EQ_INT(kv_msg_req_encode(&q, buf, sizeof buf, &err), sizeof G_REQ);
  CHECK(!memcmp(buf, G_REQ, sizeof G_REQ));

  kv_msg_rep_t r = {.id = 0x1122334455667788ull, .status = -3, .text = "no", .text_len = 2};
  CHECK_EQ_INT(kv_msg_rep_encode(&r, buf, sizeof buf, &err), sizeof G_REP_ERR);
  CHECK(!memcmp(buf, G_REP_ERR, sizeof G_REP_ERR));
  /* status >= 0: no text on the wire even if the caller passes one */
  r = (kv_msg_rep_t){.id = 2, .status = 0, .matched = 32, .text = "ignored", .text_len = 7};
  CHECK_EQ_INT(kv_msg_rep_encode(&r, buf, sizeof buf, &err), sizeof G_REP_OK);
  CHECK(!memcmp(buf, G_REP_OK, sizeof G_REP_OK));

  kv_msg_lease_req_t l = {.id = 5, .width = 8, .epb = 3, .lease_ms = 30000, .ntok = 1,
                          .skip = 2, .tokens = TOK8};
  CHECK_EQ_INT(kv_msg_lease_req_encode(&l, buf, sizeof buf, &err), sizeof G_LREQ);
  CHECK(!memcmp(buf, G_LREQ, sizeof G_LREQ));

  kv_msg_lease_ans_t a = {.id = 5, .lease_id = 9, .matched = 8, .nb = 1, .epb = 2,
                          .block = one_block, .ctx = LBLK};
  CHECK_EQ_INT(kv_msg_lease_ans_encode(&a, buf, sizeof buf, &err), sizeof G_LANS);
  CHECK(!memcmp(buf, G_LANS, sizeof G_LANS));
  /* status < 0: nblocks sent as 0, no extents, the text */
  a = (kv_msg_lease_ans_t){.id = 5, .status = -5, .nb = 3, .epb = 2, .block = one_block,
                           .ctx = LBLK, .text = "x", .text_len = 1};
  CHECK_EQ_INT(kv_msg_lease_ans_encode(&a, buf, sizeof buf, &err), sizeof G_LANS_ERR);
  CHECK(!memcmp(buf, G_LANS_ERR, sizeof G_LANS_ERR));

  CHECK_EQ_INT(kv_msg_release_encode(0x8000000000000009ull, buf, sizeof buf, &err),
               sizeof G_REL);
  CHECK(!memcmp(buf, G_REL, sizeof G_REL));
}

/* ---- decoders read the golden bytes ---- */

static void test_decode_golden(void) {
  mc_err_t err = {0};
  kv_msg_req_t q;
  CHECK_EQ_INT(kv_msg_req_decode(G_REQ, sizeof G_REQ, &q, &err), 0);
  CHECK(q.id == 0x1122334455667788ull && q.width == 4 && q.epb == 2 && q.timeout_ms == 1000);
  CHECK(q.ntok == 2 && q.ndest == 2 && q.nhid == 1);
  CHECK(!memcmp(q.tokens, TOK4, 8)); /* little-endian host */
  for (int i = 0; i < 2; i++) {
    kv_ext_t x = kv_msg_extent(q.ext, (size_t)i);
    CHECK(x.addr == DEST[i].addr && x.len == DEST[i].len);
  }
  kv_ext_t h = kv_msg_extent(q.ext, 2);
  CHECK(h.addr == 0x3000 && h.len == 8);
  CHECK_EQ_INT(kv_msg_magic(G_REQ, sizeof G_REQ), KV_REQ_MAGIC);
  CHECK(kv_msg_peek_id(G_REQ, sizeof G_REQ) == 0x1122334455667788ull);

  kv_msg_rep_t r;
  CHECK_EQ_INT(kv_msg_rep_decode(G_REP_ERR, sizeof G_REP_ERR, &r, &err), 0);
  CHECK(r.id == 0x1122334455667788ull && r.status == -3 && r.matched == 0);
  CHECK(r.text_len == 2 && !memcmp(r.text, "no", 2));
  CHECK_EQ_INT(kv_msg_rep_decode(G_REP_OK, sizeof G_REP_OK, &r, &err), 0);
  CHECK(r.id == 2 && r.status == 0 && r.matched == 32 && r.text_len == 0);

  kv_msg_lease_req_t l;
  CHECK_EQ_INT(kv_msg_lease_req_decode(G_LREQ, sizeof G_LREQ, &l, &err), 0);
  CHECK(l.hdr_ok && l.id == 5 && l.width == 8 && l.epb == 3 && l.lease_ms == 30000);
  CHECK(l.ntok == 1 && l.skip == 2 && !memcmp(l.tokens, TOK8, 8));

  kv_msg_lease_ans_t a;
  CHECK_EQ_INT(kv_msg_lease_ans_decode(G_LANS, sizeof G_LANS, &a, &err), 0);
  CHECK(a.hdr_ok && a.id == 5 && a.lease_id == 9 && a.status == 0 && a.matched == 8);
  CHECK(a.nb == 1 && a.epb == 2);
  for (int i = 0; i < 2; i++) {
    kv_ext_t x = kv_msg_extent(a.ext, (size_t)i);
    CHECK(x.addr == LBLK[i].addr && x.len == LBLK[i].len);
  }
  CHECK_EQ_INT(kv_msg_lease_ans_decode(G_LANS_ERR, sizeof G_LANS_ERR, &a, &err), 0);
  CHECK(a.status == -5 && a.nb == 0 && a.text_len == 1 && a.text[0] == 'x' && !a.ext);

  uint64_t lease = 0;
  CHECK_EQ_INT(kv_msg_release_decode(G_REL, sizeof G_REL, &lease, &err), 0);
  CHECK(lease == 0x8000000000000009ull);
}

/* ---- round trips over varied shapes ---- */

static void test_round_trips(void) {
  uint64_t tok[40];
  mc_lookup_extent_t ext[64];
  for (int i = 0; i < 40; i++)
    tok[i] = 0x0101010101010101ull * (uint64_t)(i + 1);
  for (int i = 0; i < 64; i++)
    ext[i] = (mc_lookup_extent_t){.addr = 0xfff0000000000000ull + (uint64_t)i * 4096,
                                  .len = (uint64_t)i * 3 + 1};
  static uint8_t buf[4096];
  mc_err_t err = {0};
  for (uint32_t ntok = 0; ntok <= 40; ntok += 13)
    for (int w = 4; w <= 8; w += 4)
      for (uint32_t nd = 0; nd <= 48; nd += 16)
        for (uint32_t nh = 0; nh <= 16; nh += 8) {
          kv_msg_req_t q = {.id = ntok * 1000u + nd, .width = (uint8_t)w, .epb = 0xffff,
                            .timeout_ms = 0xffffffffu, .ntok = ntok, .ndest = nd, .nhid = nh,
                            .tokens = tok, .dest = ext, .hidden = ext + 48};
          long n = kv_msg_req_encode(&q, buf, sizeof buf, &err);
          CHECK_EQ_INT(n, 36 + ntok * (uint32_t)w + (nd + nh) * 16);
          kv_msg_req_t d;
          CHECK_EQ_INT(kv_msg_req_decode(buf, (size_t)n, &d, &err), 0);
          CHECK(d.id == q.id && d.width == w && d.epb == 0xffff && d.timeout_ms == 0xffffffffu);
          CHECK(d.ntok == ntok && d.ndest == nd && d.nhid == nh);
          CHECK(!memcmp(d.tokens, tok, (size_t)ntok * (size_t)w));
          for (uint32_t i = 0; i < nd + nh; i++) {
            kv_ext_t x = kv_msg_extent(d.ext, i);
            const mc_lookup_extent_t *o = i < nd ? &ext[i] : &ext[48 + i - nd];
            CHECK(x.addr == o->addr && x.len == o->len);
          }
        }
  for (uint32_t nb = 0; nb <= 4; nb++)
    for (uint32_t epb = 1; epb <= 16; epb *= 4) {
      kv_msg_lease_ans_t a = {.id = ~0ull, .lease_id = nb, .matched = nb * 16, .nb = nb,
                              .epb = epb, .block = one_block, .ctx = ext};
      long n = kv_msg_lease_ans_encode(&a, buf, sizeof buf, &err);
      CHECK_EQ_INT(n, 40 + nb * epb * 16);
      kv_msg_lease_ans_t d;
      CHECK_EQ_INT(kv_msg_lease_ans_decode(buf, (size_t)n, &d, &err), 0);
      CHECK(d.id == ~0ull && d.lease_id == nb && d.matched == nb * 16 && d.nb == nb &&
            d.epb == epb);
      for (uint32_t i = 0; i < nb * epb; i++) {
        kv_ext_t x = kv_msg_extent(d.ext, i);
        CHECK(x.addr == ext[i % epb].addr && x.len == ext[i % epb].len);
      }
    }
  for (uint32_t ntok = 0; ntok < 40; ntok += 7) {
    kv_msg_lease_req_t l = {.id = ntok, .width = 8, .epb = 0, .lease_ms = 0, .ntok = ntok,
                            .skip = 0xffffffffu, .tokens = tok};
    long n = kv_msg_lease_req_encode(&l, buf, sizeof buf, &err);
    kv_msg_lease_req_t d;
    CHECK_EQ_INT(kv_msg_lease_req_decode(buf, (size_t)n, &d, &err), 0);
    CHECK(d.id == ntok && d.epb == 0 && d.lease_ms == 0 && d.ntok == ntok &&
          d.skip == 0xffffffffu && !memcmp(d.tokens, tok, ntok * 8u));
  }
  char text[300];
  memset(text, 'e', sizeof text);
  kv_msg_rep_t r = {.id = 1, .status = MC_ETIMEDOUT, .matched = 0, .text = text,
                    .text_len = sizeof text};
  long n = kv_msg_rep_encode(&r, buf, sizeof buf, &err);
  kv_msg_rep_t d;
  CHECK_EQ_INT(kv_msg_rep_decode(buf, (size_t)n, &d, &err), 0);
  CHECK(d.status == MC_ETIMEDOUT && d.text_len == sizeof text && !memcmp(d.text, text, 300));
}

/* ---- encoders refuse what does not fit or is out of range ---- */

static void test_encode_checks(void) {
  uint8_t buf[256];
  mc_err_t err = {0};
  kv_msg_req_t q = golden_req();
  for (size_t cap = 0; cap < sizeof G_REQ; cap++) {
    err = (mc_err_t){0};
    CHECK_EQ_INT(kv_msg_req_encode(&q, buf, cap, &err), MC_ETOOBIG);
    CHECK_CONTAINS(err.msg, "do not fit");
  }
  q.width = 2;
  CHECK_EQ_INT(kv_msg_req_encode(&q, buf, sizeof buf, &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "width 2");
  q = golden_req();
  q.epb = 0;
  CHECK_EQ_INT(kv_msg_req_encode(&q, buf, sizeof buf, &err), MC_EINVAL);
  q = golden_req();
  q.dest = NULL;
  CHECK_EQ_INT(kv_msg_req_encode(&q, buf, sizeof buf, &err), MC_EINVAL);
  kv_msg_rep_t r = {.status = -1, .text = "abc", .text_len = 3};
  CHECK_EQ_INT(kv_msg_rep_encode(&r, buf, KV_REP_HDR + 2, &err), MC_ETOOBIG);
  kv_msg_lease_req_t l = {.width = 5};
  CHECK_EQ_INT(kv_msg_lease_req_encode(&l, buf, sizeof buf, &err), MC_EINVAL);
  kv_msg_lease_ans_t a = {.nb = 1, .epb = 1};
  CHECK_EQ_INT(kv_msg_lease_ans_encode(&a, buf, sizeof buf, &err), MC_EINVAL); /* no block() */
  a = (kv_msg_lease_ans_t){.nb = 0xffffffffu, .epb = 0xffffffffu, .block = one_block};
  CHECK(kv_msg_lease_ans_size(&a) == UINT64_MAX); /* does not wrap */
  CHECK_EQ_INT(kv_msg_lease_ans_encode(&a, buf, sizeof buf, &err), MC_ETOOBIG);
  CHECK_EQ_INT(kv_msg_release_encode(1, buf, KV_PREL_LEN - 1, &err), MC_ETOOBIG);
  /* how many blocks one answer holds (the producer caps its lease with it) */
  CHECK_EQ_INT(kv_msg_lease_ans_max_blocks(2, KV_PANS_HDR + 64), 2);
  CHECK_EQ_INT(kv_msg_lease_ans_max_blocks(2, KV_PANS_HDR + 63), 1);
  CHECK_EQ_INT(kv_msg_lease_ans_max_blocks(1, KV_PANS_HDR - 1), 0);
  CHECK_EQ_INT(kv_msg_lease_ans_max_blocks(0, 1 << 20), 0);
  a = (kv_msg_lease_ans_t){.nb = (uint32_t)kv_msg_lease_ans_max_blocks(3, 16u << 20), .epb = 3};
  CHECK(kv_msg_lease_ans_size(&a) <= 16u << 20);
  a.nb++;
  CHECK(kv_msg_lease_ans_size(&a) > 16u << 20);
}

/* ---- malformed input ---- */

typedef int (*dec_fn)(const uint8_t *m, size_t len, mc_err_t *err);
static int dec_req(const uint8_t *m, size_t len, mc_err_t *err) {
  kv_msg_req_t o;
  return kv_msg_req_decode(m, len, &o, err);
}
static int dec_rep(const uint8_t *m, size_t len, mc_err_t *err) {
  kv_msg_rep_t o;
  return kv_msg_rep_decode(m, len, &o, err);
}
static int dec_lreq(const uint8_t *m, size_t len, mc_err_t *err) {
  kv_msg_lease_req_t o;
  return kv_msg_lease_req_decode(m, len, &o, err);
}
static int dec_lans(const uint8_t *m, size_t len, mc_err_t *err) {
  kv_msg_lease_ans_t o;
  return kv_msg_lease_ans_decode(m, len, &o, err);
}
static int dec_rel(const uint8_t *m, size_t len, mc_err_t *err) {
  uint64_t id;
  return kv_msg_release_decode(m, len, &id, err);
}

static const struct {
  const char *name;
  const uint8_t *m;
  size_t len, min_ok; /* truncations shorter than min_ok fail; longer ones decode */
  dec_fn dec;
} ALL[] = {
    {"req", G_REQ, sizeof G_REQ, sizeof G_REQ, dec_req},
    {"rep err", G_REP_ERR, sizeof G_REP_ERR, KV_REP_HDR, dec_rep}, /* text may be any length */
    {"rep ok", G_REP_OK, sizeof G_REP_OK, KV_REP_HDR, dec_rep},
    {"lease req", G_LREQ, sizeof G_LREQ, sizeof G_LREQ, dec_lreq},
    {"lease ans", G_LANS, sizeof G_LANS, sizeof G_LANS, dec_lans},
    {"lease ans err", G_LANS_ERR, sizeof G_LANS_ERR, KV_PANS_HDR, dec_lans},
    {"release", G_REL, sizeof G_REL, sizeof G_REL, dec_rel},
};
#define NALL (sizeof ALL / sizeof ALL[0])

static void test_truncated_at_every_byte(void) {
  for (size_t t = 0; t < NALL; t++) {
    for (size_t n = 0; n <= ALL[t].len; n++) {
      uint8_t *m = dup_n(ALL[t].m, n);
      mc_err_t err = {0};
      int rc = ALL[t].dec(m, n, &err);
      free(m);
      if (n < ALL[t].min_ok) {
        if (rc != MC_EPROTO)
          fprintf(stderr, "  %s truncated to %zu bytes: rc %d\n", ALL[t].name, n, rc);
        CHECK_EQ_INT(rc, MC_EPROTO);
        CHECK_CONTAINS(err.msg, "malformed");
      } else {
        CHECK_EQ_INT(rc, 0);
      }
    }
  }
}

static void test_bad_magic_and_version(void) {
  for (size_t t = 0; t < NALL; t++) {
    uint8_t *m = dup_n(ALL[t].m, ALL[t].len);
    mc_err_t err = {0};
    m[0] ^= 0x20;
    CHECK_EQ_INT(ALL[t].dec(m, ALL[t].len, &err), MC_EPROTO);
    CHECK_CONTAINS(err.msg, "magic");
    m[0] ^= 0x20;
    m[4] = 2;
    CHECK_EQ_INT(ALL[t].dec(m, ALL[t].len, &err), MC_EPROTO);
    CHECK_CONTAINS(err.msg, "version 2");
    free(m);
  }
  /* each decoder refuses the other kinds */
  for (size_t t = 0; t < NALL; t++)
    for (size_t u = 0; u < NALL; u++) {
      if (ALL[t].dec == ALL[u].dec)
        continue;
      mc_err_t err = {0};
      CHECK_EQ_INT(ALL[t].dec(ALL[u].m, ALL[u].len, &err), MC_EPROTO);
    }
}

static void put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

static void test_bad_counts(void) {
  uint8_t m[160];
  mc_err_t err = {0};
  /* request: counts larger than the body, huge counts, trailing bytes,
   * width and epb out of range */
  static const size_t req_off[] = {20, 24, 28}; /* nhid, ntok, ndest */
  for (int k = 0; k < 3; k++) {
    memcpy(m, G_REQ, sizeof G_REQ);
    put32(m + req_off[k], 3);
    CHECK_EQ_INT(dec_req(m, sizeof G_REQ, &err), MC_EPROTO);
    CHECK_CONTAINS(err.msg, "need");
    put32(m + req_off[k], 0xffffffffu);
    CHECK_EQ_INT(dec_req(m, sizeof G_REQ, &err), MC_EPROTO);
  }
  memcpy(m, G_REQ, sizeof G_REQ);
  put32(m + 20, 0xffffffffu);
  put32(m + 24, 0xffffffffu);
  put32(m + 28, 0xffffffffu);
  m[5] = 8;
  CHECK_EQ_INT(dec_req(m, sizeof G_REQ, &err), MC_EPROTO);
  memcpy(m, G_REQ, sizeof G_REQ);
  m[sizeof G_REQ] = 0;
  CHECK_EQ_INT(dec_req(m, sizeof G_REQ + 1, &err), MC_EPROTO); /* trailing byte */
  m[5] = 8;
  CHECK_EQ_INT(dec_req(m, sizeof G_REQ, &err), MC_EPROTO);
  m[5] = 0;
  CHECK_EQ_INT(dec_req(m, sizeof G_REQ, &err), MC_EPROTO);
  CHECK_CONTAINS(err.msg, "token width 0");
  m[5] = 4;
  m[6] = 0;
  CHECK_EQ_INT(dec_req(m, sizeof G_REQ, &err), MC_EPROTO);
  CHECK_CONTAINS(err.msg, "extents per block");

  /* lease request */
  memcpy(m, G_LREQ, sizeof G_LREQ);
  put32(m + 20, 2);
  CHECK_EQ_INT(dec_lreq(m, sizeof G_LREQ, &err), MC_EPROTO);
  put32(m + 20, 0xffffffffu);
  CHECK_EQ_INT(dec_lreq(m, sizeof G_LREQ, &err), MC_EPROTO);
  {
    kv_msg_lease_req_t o; /* the header still tells the id and lease (a probe is counted) */
    CHECK_EQ_INT(kv_msg_lease_req_decode(m, sizeof G_LREQ, &o, &err), MC_EPROTO);
    CHECK(o.hdr_ok && o.id == 5 && o.lease_ms == 30000);
  }
  memcpy(m, G_LREQ, sizeof G_LREQ);
  m[5] = 7;
  CHECK_EQ_INT(dec_lreq(m, sizeof G_LREQ, &err), MC_EPROTO);

  /* lease answer: nb * epb * 16 wraps to 0 in 64 bits; counts past the
   * body; epb 0; a body that is not whole extents */
  memcpy(m, G_LANS, KV_PANS_HDR);
  put32(m + 32, 1u << 30);
  put32(m + 36, 1u << 30);
  CHECK_EQ_INT(dec_lans(m, KV_PANS_HDR, &err), MC_EPROTO);
  put32(m + 32, 0xffffffffu);
  put32(m + 36, 0xffffffffu);
  memcpy(m + KV_PANS_HDR, G_LANS + KV_PANS_HDR, 32);
  CHECK_EQ_INT(dec_lans(m, sizeof G_LANS, &err), MC_EPROTO);
  CHECK_CONTAINS(err.msg, "4294967295 blocks");
  {
    kv_msg_lease_ans_t o; /* header read: the consumer fails its waiter by id */
    CHECK_EQ_INT(kv_msg_lease_ans_decode(m, sizeof G_LANS, &o, &err), MC_EPROTO);
    CHECK(o.hdr_ok && o.id == 5 && o.lease_id == 9 && !o.ext);
  }
  memcpy(m, G_LANS, sizeof G_LANS);
  put32(m + 32, 2);
  CHECK_EQ_INT(dec_lans(m, sizeof G_LANS, &err), MC_EPROTO);
  put32(m + 32, 1);
  put32(m + 36, 0);
  CHECK_EQ_INT(dec_lans(m, sizeof G_LANS, &err), MC_EPROTO);
  CHECK_CONTAINS(err.msg, "0 extents per block");
  put32(m + 36, 2);
  m[sizeof G_LANS] = 0;
  CHECK_EQ_INT(dec_lans(m, sizeof G_LANS + 1, &err), MC_EPROTO);
  put32(m + 36, 1); /* 32 bytes of body for 1 x 1 extents */
  CHECK_EQ_INT(dec_lans(m, sizeof G_LANS, &err), MC_EPROTO);

  /* release: exactly 16 bytes */
  memcpy(m, G_REL, sizeof G_REL);
  m[sizeof G_REL] = 0;
  CHECK_EQ_INT(dec_rel(m, sizeof G_REL + 1, &err), MC_EPROTO);
}

/* Every single-byte change of every golden message decodes or fails cleanly
 * (ASan/UBSan watch the reads); the decoded extents lie inside the message. */
static void test_byte_flips(void) {
  for (size_t t = 0; t < NALL; t++) {
    for (size_t i = 0; i < ALL[t].len; i++) {
      static const uint8_t vals[] = {0x00, 0x01, 0x7f, 0x80, 0xff};
      for (size_t v = 0; v < sizeof vals; v++) {
        uint8_t *m = dup_n(ALL[t].m, ALL[t].len);
        m[i] = vals[v];
        mc_err_t err = {0};
        int rc = ALL[t].dec(m, ALL[t].len, &err);
        CHECK(rc == 0 || rc == MC_EPROTO);
        if (rc < 0)
          CHECK(err.msg[0] != '\0');
        if (ALL[t].dec == dec_req && rc == 0) {
          kv_msg_req_t o;
          kv_msg_req_decode(m, ALL[t].len, &o, &err);
          CHECK(o.ext + ((size_t)o.ndest + o.nhid) * KV_EXT_LEN == m + ALL[t].len);
        }
        free(m);
      }
    }
  }
}

int main(void) {
  RUN(test_encode_golden);
  RUN(test_decode_golden);
  RUN(test_round_trips);
  RUN(test_encode_checks);
  RUN(test_truncated_at_every_byte);
  RUN(test_bad_magic_and_version);
  RUN(test_bad_counts);
  RUN(test_byte_flips);
  TEST_MAIN_END();
}
