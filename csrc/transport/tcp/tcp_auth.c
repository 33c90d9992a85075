/* Peer authentication in the TCP HELLO exchange (docs/security.md,
 * docs/protocol.md "Authentication").  Optional: on when the engine has a
 * shared secret.  Challenge-response with HMAC-SHA256 over nonces from both
 * sides; the secret never travels.
 *
 *   initiator -> HELLO     {"segment", "from", "nonce": Ni}
 *   target    -> HELLO_ACK {"segment", "nonce": Nt, "proof": Pt}
 *   initiator -> HELLO     {"segment", "proof": Pi}      (only when verified)
 *   target    -> HELLO_ACK {"segment"}                   (only when verified)
 *
 *   P = HMAC(secret, "mooncake-connector auth v1\n" role "\n" hex(Ni) "\n"
 *            hex(Nt) "\n" target segment "\n" initiator segment)
 *   with role "target" for Pt and "initiator" for Pi.
 *
 * The target serves nothing before Pi checks out (tcp_recv.c refuses any
 * message but HELLO until hello_ok); the initiator holds its requests until
 * Pt checks out, so it never sends data to a target that cannot prove it
 * knows the secret either. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "transport/tcp/tcp_internal.h"
#include "util/log.h"
#include "util/sha256.h"

#define FIX_HINT                                                                             \
  "set the same secret on both engines (environment MC_AUTH_SECRET, or \"auth_secret\" in " \
  "mooncake.json)"

static int auth_on(const mc_conn_t *c) {
  return c->tcp->hooks.auth_secret && c->tcp->hooks.auth_secret[0];
}

static void hex(const uint8_t *p, size_t n, char *out) {
  static const char d[] = "0123456789abcdef";
  for (size_t i = 0; i < n; i++) {
    out[2 * i] = d[p[i] >> 4];
    out[2 * i + 1] = d[p[i] & 15];
  }
  out[2 * n] = '\0';
}

static int unhex(const cJSON *item, uint8_t *out, size_t n) {
  if (!cJSON_IsString(item) || strlen(item->valuestring) != 2 * n)
    return -1;
  for (size_t i = 0; i < 2 * n; i++) {
    char ch = item->valuestring[i];
    int v = ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : -1;
    if (v < 0)
      return -1;
    out[i / 2] = (uint8_t)(i % 2 ? (out[i / 2] << 4) | v : v);
  }
  return 0;
}

static int nonce(uint8_t out[MC_AUTH_NONCE], mc_err_t *err) {
  size_t got = 0;
  while (got < MC_AUTH_NONCE) {
    ssize_t n = getrandom(out + got, MC_AUTH_NONCE - got, 0);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0)
      return mc_err_sys(err, MC_ESYS, errno, "getrandom() failed for an authentication nonce");
    got += (size_t)n;
  }
  return 0;
}

static void proof(const mc_conn_t *c, const char *role, const char *target, const char *initiator,
                  uint8_t out[MC_SHA256_LEN]) {
  char ni[2 * MC_AUTH_NONCE + 1], nt[2 * MC_AUTH_NONCE + 1];
  hex(c->auth_ni, MC_AUTH_NONCE, ni);
  hex(c->auth_nt, MC_AUTH_NONCE, nt);
  char msg[1024];
  int n = snprintf(msg, sizeof msg, "mooncake-connector auth v1\n%s\n%s\n%s\n%s\n%s", role, ni, nt,
                   target, initiator);
  const char *key = c->tcp->hooks.auth_secret;
  mc_hmac_sha256(key, strlen(key), msg, n < (int)sizeof msg ? (size_t)n : sizeof msg - 1, out);
}

static int check_proof(const mc_conn_t *c, const cJSON *j, const char *role, const char *target,
                       const char *initiator) {
  uint8_t got[MC_SHA256_LEN], want[MC_SHA256_LEN];
  if (unhex(cJSON_GetObjectItemCaseSensitive(j, "proof"), got, sizeof got) < 0)
    return -1;
  proof(c, role, target, initiator, want);
  return mc_ct_equal(got, want, sizeof got) ? 0 : -1;
}

/* JSON text of {"segment": seg[, k1: v1[, k2: v2]]} (k1/k2 NULL: absent). */
static char *json3(const char *seg, const char *k1, const char *v1, const char *k2,
                   const char *v2) {
  cJSON *r = cJSON_CreateObject();
  char *txt = NULL;
  if (r && cJSON_AddStringToObject(r, "segment", seg) &&
      (!k1 || cJSON_AddStringToObject(r, k1, v1)) &&
      (!k1 || !k2 || cJSON_AddStringToObject(r, k2, v2)))
    txt = cJSON_PrintUnformatted(r);
  cJSON_Delete(r);
  return txt;
}

static mc_xfer_op_t *hello_op(const char *body, mc_err_t *err) {
  size_t bl = strlen(body);
  mc_xfer_op_t *op = mc_xfer_op_new(MC_WIRE_HELLO, 0, bl);
  if (!op) {
    mc_err_set(err, MC_ENOMEM, "out of memory");
    return NULL;
  }
  memcpy(op->ctrl, body, bl);
  if (mc_xfer_op_seal(op, err) < 0 || mc_tcp_op_encode(op, err) < 0) {
    mc_xfer_op_free(op);
    return NULL;
  }
  return op;
}

mc_xfer_op_t *mc_auth_hello(mc_conn_t *c, mc_err_t *err) {
  char ni[2 * MC_AUTH_NONCE + 1];
  if (auth_on(c)) {
    if (nonce(c->auth_ni, err) < 0)
      return NULL;
    hex(c->auth_ni, MC_AUTH_NONCE, ni);
  }
  char *body = json3(c->segment, "from", c->tcp->hooks.local_name, auth_on(c) ? "nonce" : NULL,
                     ni);
  if (!body) {
    mc_err_set(err, MC_ENOMEM, "out of memory");
    return NULL;
  }
  mc_xfer_op_t *op = hello_op(body, err);
  free(body);
  if (op && auth_on(c)) {
    c->auth_state = 1; /* requests wait for the target's proof */
    c->auth_hold = 1;
  }
  return op;
}

int mc_auth_target_hello(mc_conn_t *c, const cJSON *j, char **reply, mc_err_t *err) {
  const char *local = c->tcp->hooks.local_name;
  *reply = NULL;
  if (c->auth_state == 0) {
    if (unhex(cJSON_GetObjectItemCaseSensitive(j, "nonce"), c->auth_ni, MC_AUTH_NONCE) < 0) {
      c->auth_state = 3;
      return mc_err_set(err, MC_EAUTH,
                        "segment %s requires peer authentication and %s (%s) sent none; " FIX_HINT,
                        local, c->peer, c->segment[0] ? c->segment : "unnamed");
    }
    if (nonce(c->auth_nt, err) < 0)
      return err->code;
    uint8_t p[MC_SHA256_LEN];
    char nt[2 * MC_AUTH_NONCE + 1], ph[2 * MC_SHA256_LEN + 1];
    proof(c, "target", local, c->segment, p);
    hex(c->auth_nt, MC_AUTH_NONCE, nt);
    hex(p, sizeof p, ph);
    c->auth_state = 1;
    *reply = json3(local, "nonce", nt, "proof", ph);
    return *reply ? 0 : mc_err_set(err, MC_ENOMEM, "out of memory");
  }
  if (c->auth_state == 1 && check_proof(c, j, "initiator", local, c->segment) == 0) {
    if (mc_conn_prehandshake_done(c)) /* evicted meanwhile: serve nothing on it */
      return mc_err_set(err, MC_EPEERCLOSED, "the proof from %s arrived after its connection "
                        "was dropped (MC_TCP_MAX_PREHANDSHAKE)", c->peer);
    c->auth_state = 2;
    c->hello_ok = 1;
    *reply = json3(local, NULL, NULL, NULL, NULL);
    return *reply ? 0 : mc_err_set(err, MC_ENOMEM, "out of memory");
  }
  int first_failure = c->auth_state == 1;
  c->auth_state = 3;
  if (first_failure)
    return mc_err_set(err, MC_EAUTH,
                      "peer %s (%s) failed authentication to segment %s: its shared secret "
                      "differs from this engine's; " FIX_HINT,
                      c->peer, c->segment, local);
  return mc_err_set(err, MC_EAUTH, "unexpected HELLO from %s (authentication already %s)",
                    c->peer, c->auth_state == 2 ? "done" : "failed");
}

void mc_auth_target_plain(const mc_conn_t *c, const cJSON *j) {
  if (cJSON_GetObjectItemCaseSensitive(j, "nonce"))
    mc_log_warn_rated("peer %s (%s) authenticates with a shared secret but this engine (segment %s) "
                "has none, so that peer will refuse it; " FIX_HINT,
                c->peer, c->segment, c->tcp->hooks.local_name);
}

int mc_auth_initiator_ack(mc_conn_t *c, const cJSON *j, const char *target, mc_err_t *err) {
  if (!auth_on(c) || c->auth_state == 0)
    return 0;
  if (c->auth_state == 2) { /* the target accepted our proof */
    c->auth_state = 3;
    return 0;
  }
  if (c->auth_state != 1)
    return mc_err_set(err, MC_EPROTO, "unexpected HELLO_ACK from %s", c->peer);
  if (!cJSON_GetObjectItemCaseSensitive(j, "proof"))
    return mc_err_set(err, MC_EAUTH,
                      "target %s (segment %s) did not authenticate itself: it has no shared "
                      "secret configured, and this engine (%s) requires one; " FIX_HINT,
                      c->peer, target, c->tcp->hooks.local_name);
  if (unhex(cJSON_GetObjectItemCaseSensitive(j, "nonce"), c->auth_nt, MC_AUTH_NONCE) < 0)
    return mc_err_set(err, MC_EPROTO, "malformed authentication challenge from %s", c->peer);
  int bad = check_proof(c, j, "target", target, c->tcp->hooks.local_name) < 0;
  uint8_t p[MC_SHA256_LEN];
  char ph[2 * MC_SHA256_LEN + 1];
  proof(c, "initiator", target, c->tcp->hooks.local_name, p);
  hex(p, sizeof p, ph);
  char *body = json3(target, "proof", ph, NULL, NULL);
  mc_xfer_op_t *op = body ? hello_op(body, err) : NULL;
  free(body);
  if (!op)
    return err->code ? err->code : mc_err_set(err, MC_ENOMEM, "out of memory");
  /* Ahead of the held requests: the target checks it before serving them. */
  op->req_id = ++c->next_req_id;
  mc_put_u64(MC_OPW(op)->hdr + 16, op->req_id);
  op->next = c->sendq_head;
  c->sendq_head = op;
  if (!c->sendq_tail)
    c->sendq_tail = op;
  if (bad) {
    /* Our proof goes out anyway (requests stay held), so that the target
     * too logs which peer failed and why; then the caller drops the
     * connection. */
    mc_conn_flush(c);
    return mc_err_set(err, MC_EAUTH,
                      "target %s (segment %s) failed authentication: its shared secret differs "
                      "from this engine's (%s); " FIX_HINT,
                      c->peer, target, c->tcp->hooks.local_name);
  }
  c->auth_state = 2;
  c->auth_hold = 0;
  return 0;
}
