/* Peer authentication (docs/security.md): SHA-256 / HMAC-SHA256 against
 * the FIPS 180-4 and RFC 4231 vectors, then engines in one process over
 * loopback with the same, a different and no shared secret, and a raw
 * socket peer that skips the handshake. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdint.h>
#include <sys/socket.h>
#include <unistd.h>

#include "engine/engine.h"
#include "engine/engine_internal.h" /* mc_engine_rpc */
#include "testlib.h"
#include "transport/tcp/wire.h"
#include "util/sha256.h"

static void tohex(const uint8_t *p, size_t n, char *out) {
  for (size_t i = 0; i < n; i++)
    sprintf(out + 2 * i, "%02x", p[i]);
}

static void test_sha256_vectors(void) {
  static const struct {
    const char *msg;
    const char *want;
  } v[] = {
      {"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
      {"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"},
      {"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
       "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"},
  };
  uint8_t d[MC_SHA256_LEN];
  char h[65];
  for (size_t i = 0; i < sizeof v / sizeof *v; i++) {
    mc_sha256(v[i].msg, strlen(v[i].msg), d);
    tohex(d, sizeof d, h);
    CHECK(strcmp(h, v[i].want) == 0);
  }
  /* A million 'a', fed in uneven pieces (buffering across blocks). */
  mc_sha256_t s;
  mc_sha256_init(&s);
  char a[1024];
  memset(a, 'a', sizeof a);
  size_t left = 1000000, step = 1;
  while (left) {
    size_t k = step < left ? step : left;
    mc_sha256_update(&s, a, k);
    left -= k;
    step = step % 997 + 13;
  }
  mc_sha256_final(&s, d);
  tohex(d, sizeof d, h);
  CHECK(strcmp(h, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0") == 0);
}

/* RFC 4231 test cases 1, 2, 3, 4, 6 and 7 (5 is a truncated output). */
static void test_hmac_rfc4231(void) {
  uint8_t k20b[20], k20a[20], d50d[50], k25[25], d50c[50], k131[131];
  memset(k20b, 0x0b, 20);
  memset(k20a, 0xaa, 20);
  memset(d50d, 0xdd, 50);
  for (int i = 0; i < 25; i++)
    k25[i] = (uint8_t)(i + 1);
  memset(d50c, 0xcd, 50);
  memset(k131, 0xaa, 131);
  static const char m6[] = "Test Using Larger Than Block-Size Key - Hash Key First";
  static const char m7[] = "This is a test using a larger than block-size key and a larger than "
                           "block-size data. The key needs to be hashed before being used by the "
                           "HMAC algorithm.";
  const struct {
    const void *key;
    size_t kl;
    const void *msg;
    size_t ml;
    const char *want;
  } v[] = {
      {k20b, 20, "Hi There", 8, "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"},
      {"Jefe", 4, "what do ya want for nothing?", 28,
       "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"},
      {k20a, 20, d50d, 50, "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"},
      {k25, 25, d50c, 50, "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"},
      {k131, 131, m6, sizeof m6 - 1,
       "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"},
      {k131, 131, m7, sizeof m7 - 1,
       "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"},
  };
  for (size_t i = 0; i < sizeof v / sizeof *v; i++) {
    uint8_t d[MC_SHA256_LEN];
    char h[65];
    mc_hmac_sha256(v[i].key, v[i].kl, v[i].msg, v[i].ml, d);
    tohex(d, sizeof d, h);
    if (strcmp(h, v[i].want) != 0)
      fprintf(stderr, "  RFC 4231 case index %zu: %s\n", i, h);
    CHECK(strcmp(h, v[i].want) == 0);
  }
  CHECK(mc_ct_equal("abcd", "abcd", 4));
  CHECK(!mc_ct_equal("abcd", "abce", 4));
}

/* ---- engines ---- */

#define BUFSZ (1u << 20)
#define DST 8192 /* transfers land here; [0, 4096) is their source */

typedef struct {
  mc_engine_t *e;
  uint8_t *buf;
} node_t;

static int mk(node_t *n, const char *secret) {
  mc_engine_opts_t o = {.local_hostname = "127.0.0.1", .metadata_server = "P2PHANDSHAKE",
                        .protocol = "tcp", .auth_secret = secret};
  mc_err_t err = {0};
  n->buf = calloc(1, BUFSZ);
  if (!n->buf || mc_engine_create(&o, &n->e, &err) < 0 ||
      mc_engine_register(n->e, n->buf, BUFSZ, "cpu", &err) < 0) {
    fprintf(stderr, "setup: %s\n", err.msg);
    return -1;
  }
  return 0;
}

static void rm(node_t *n) {
  mc_engine_destroy(n->e);
  free(n->buf);
}

static int write_to(node_t *from, node_t *to, mc_err_t *err) {
  memset(from->buf, 0x5a, 4096);
  mc_request_t r = {.opcode = MC_OP_WRITE, .local = from->buf,
                    .remote = (uint64_t)(uintptr_t)(to->buf + DST), .len = 4096};
  mc_batch_t *b = mc_batch_new(from->e, 1);
  int rc = mc_batch_submit(from->e, b, mc_engine_segment_name(to->e), &r, 1, err);
  if (rc == 0)
    rc = mc_batch_wait(from->e, b, 10000, err);
  if (rc == 0) {
    mc_task_status_t st;
    mc_batch_status(b, 0, &st);
    if (st.state != MC_TASK_COMPLETED)
      rc = mc_err_set(err, st.code ? st.code : MC_EPROTO, "%s", st.msg);
  }
  mc_batch_free(from->e, b);
  return rc;
}

static void test_same_secret(void) {
  node_t a, b;
  CHECK(mk(&a, "s3cret-one") == 0 && mk(&b, "s3cret-one") == 0);
  mc_err_t err = {0};
  CHECK_EQ_INT(write_to(&a, &b, &err), 0);
  CHECK(b.buf[DST] == 0x5a && b.buf[DST + 4095] == 0x5a);
  CHECK_EQ_INT(write_to(&b, &a, &err), 0);
  CHECK_EQ_INT(mc_engine_notify(a.e, mc_engine_segment_name(b.e), "hi", 2, 2000, &err), 0);
  char *reply = NULL;
  CHECK_EQ_INT(mc_engine_rpc(a.e, mc_engine_segment_name(b.e), "mc.describe", 11, 2000, &reply,
                             &err),
               0);
  CHECK(reply && strstr(reply, "\"buffers\""));
  free(reply);
  rm(&a);
  rm(&b);
}

static void test_wrong_or_missing_secret(void) {
  node_t a, wrong, none;
  CHECK(mk(&a, "s3cret-one") == 0 && mk(&wrong, "s3cret-two") == 0 && mk(&none, "") == 0);
  mc_err_t err = {0};
  /* A different secret: refused both ways, nothing written. */
  CHECK_EQ_INT(write_to(&wrong, &a, &err), MC_EAUTH);
  CHECK_CONTAINS(err.msg, "failed authentication");
  CHECK_CONTAINS(err.msg, "MC_AUTH_SECRET");
  CHECK(a.buf[DST] == 0);
  err = (mc_err_t){0};
  CHECK_EQ_INT(write_to(&a, &wrong, &err), MC_EAUTH);
  CHECK_CONTAINS(err.msg, "failed authentication");
  CHECK(wrong.buf[DST] == 0);
  /* No secret against one: refused, the error names the fix. */
  err = (mc_err_t){0};
  CHECK_EQ_INT(write_to(&none, &a, &err), MC_EAUTH);
  CHECK_CONTAINS(err.msg, "requires peer authentication");
  CHECK(a.buf[DST] == 0);
  err = (mc_err_t){0};
  CHECK_EQ_INT(write_to(&a, &none, &err), MC_EAUTH);
  CHECK_CONTAINS(err.msg, "did not authenticate itself");
  CHECK(none.buf[DST] == 0);
  /* Notifications (and so KV control messages and RPCs) ride the same
   * handshake. */
  err = (mc_err_t){0};
  CHECK(mc_engine_notify(none.e, mc_engine_segment_name(a.e), "x", 1, 2000, &err) == MC_EAUTH);
  /* RPCs (RDMA connection setup, mc.describe) too: refused before served. */
  char *reply = NULL;
  err = (mc_err_t){0};
  CHECK_EQ_INT(mc_engine_rpc(wrong.e, mc_engine_segment_name(a.e), "mc.describe", 11, 2000,
                             &reply, &err),
               MC_EAUTH);
  CHECK(reply == NULL);
  rm(&a);
  rm(&wrong);
  rm(&none);
}

/* A raw peer that skips authentication and sends a WRITE after a plain
 * HELLO: the target answers the HELLO with an error and writes nothing. */
static void test_raw_peer_cannot_write(void) {
  node_t a;
  CHECK(mk(&a, "s3cret-one") == 0);
  const char *name = mc_engine_segment_name(a.e);
  int port = atoi(strrchr(name, ':') + 1);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                           .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  CHECK(connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0);
  uint8_t msg[4096];
  char hello[256];
  int hl = snprintf(hello, sizeof hello, "{\"version\":1,\"segment\":\"%s\",\"from\":\"x\"}", name);
  mc_wire_hdr_t h = {.type = MC_WIRE_HELLO, .req_id = 1, .length = (uint64_t)hl};
  mc_wire_encode(&h, msg);
  memcpy(msg + 32, hello, (size_t)hl);
  size_t n = 32 + (size_t)hl;
  mc_wire_hdr_t w = {.type = MC_WIRE_WRITE, .count = 1, .req_id = 2, .length = 16 + 8};
  mc_wire_encode(&w, msg + n);
  mc_put_u64(msg + n + 32, (uint64_t)(uintptr_t)(a.buf + DST));
  mc_put_u64(msg + n + 40, 8);
  memset(msg + n + 48, 0x77, 8);
  n += 56;
  CHECK(write(fd, msg, n) == (ssize_t)n);
  uint8_t ack[1024];
  ssize_t got = 0, r;
  struct timeval tv = {.tv_sec = 5};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  while ((r = read(fd, ack + got, sizeof ack - 1 - (size_t)got)) > 0)
    got += r; /* until the target drops the connection */
  close(fd);
  CHECK(got > 32);
  mc_wire_hdr_t ah;
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_wire_decode(ack, 1, &ah, &err), 0);
  CHECK_EQ_INT(ah.type, MC_WIRE_HELLO_ACK);
  CHECK_EQ_INT(ah.status, MC_EAUTH);
  ack[got] = 0;
  CHECK_CONTAINS((char *)ack + 32, "requires peer authentication");
  CHECK(a.buf[DST] == 0);
  rm(&a);
}

static void test_secret_too_long(void) {
  char *big = malloc(MC_AUTH_SECRET_MAX + 2);
  memset(big, 'k', MC_AUTH_SECRET_MAX + 1);
  big[MC_AUTH_SECRET_MAX + 1] = 0;
  mc_engine_opts_t o = {.local_hostname = "127.0.0.1", .metadata_server = "P2PHANDSHAKE",
                        .protocol = "tcp", .auth_secret = big};
  mc_engine_t *e = NULL;
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_engine_create(&o, &e, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "at most 1024");
  free(big);
}

int main(void) {
  RUN(test_sha256_vectors);
  RUN(test_hmac_rfc4231);
  RUN(test_same_secret);
  RUN(test_wrong_or_missing_secret);
  RUN(test_raw_peer_cannot_write);
  RUN(test_secret_too_long);
  TEST_MAIN_END();
}
