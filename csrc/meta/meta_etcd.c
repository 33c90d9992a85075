/* etcd metadata backend: the v3 API through etcd's JSON gateway (libcurl).
 *
 *   POST <endpoint><api>/kv/put          {"key": b64, "value": b64[, "lease"]}
 *   POST <endpoint><api>/kv/range        {"key": b64}
 *   POST <endpoint><api>/kv/deleterange  {"key": b64}
 *   POST <endpoint><api>/lease/grant     {"TTL": "<s>"}
 *   POST <endpoint><api>/lease/keepalive {"ID": "<id>"}
 *
 * <api> is "/v3" (etcd >= 3.4); when an endpoint answers a plain-text 404 the
 * client switches to "/v3beta" (etcd 3.3) once.  Keys and values travel
 * base64-encoded; 64-bit numbers are JSON strings.  An answer with an
 * "error" member is an error.  The connection string lists endpoints
 * ("h1:p1,h2:p2"); a request that cannot reach one endpoint moves to the
 * next, and the last endpoint that answered is tried first next time.
 *
 * TTL: one lease per TTL value (normally one per client), granted on first
 * use, kept alive by refresh, and granted again when etcd lost it.
 *
 * Thread-safety: curl handles come from a small mutex-protected pool; the
 * endpoint cursor, API prefix and lease table are guarded by the same mutex. */
#include "meta/curl_util.h"
#include "meta/meta.h"

#include <ctype.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <curl/curl.h>

#include "util/hostport.h"
#include "util/log.h"

#define ETCD_EP_MAX 16
#define ETCD_LEASES_MAX 4
#define ETCD_SNIPPET_MAX 120
/* base64 of the largest value plus JSON framing. */
#define ETCD_BODY_MAX (MC_META_MAX_VALUE / 3 * 4 + 65536)

typedef struct lease {
  int ttl;
  char id[32]; /* decimal, as etcd prints it */
} lease_t;

typedef struct etcd_meta {
  mc_meta_t base;
  long timeout_ms, connect_timeout_ms;
  int n_eps;
  char eps[ETCD_EP_MAX][MC_HOST_MAX + 24]; /* "http://host:port" */
  pthread_mutex_t mu;
  int cur;         /* endpoint tried first */
  char api[16];    /* "/v3" or "/v3beta" */
  mc_curl_pool_t pool; /* pool.mu = &mu */
  lease_t leases[ETCD_LEASES_MAX];
  int n_leases;
} etcd_meta_t;

/* ---- base64 (RFC 4648, with padding) ---- */

static const char b64chars[] =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

static char *b64_encode(const char *src, size_t n) {
  const unsigned char *s = (const unsigned char *)src;
  char *out = malloc((n + 2) / 3 * 4 + 1), *o = out;
  if (!out)
    return NULL;
  for (size_t i = 0; i < n; i += 3) {
    uint32_t v = (uint32_t)s[i] << 16;
    if (i + 1 < n)
      v |= (uint32_t)s[i + 1] << 8;
    if (i + 2 < n)
      v |= s[i + 2];
    *o++ = b64chars[(v >> 18) & 63];
    *o++ = b64chars[(v >> 12) & 63];
    *o++ = i + 1 < n ? b64chars[(v >> 6) & 63] : '=';
    *o++ = i + 2 < n ? b64chars[v & 63] : '=';
  }
  *o = '\0';
  return out;
}

static int b64_val(unsigned char c) {
  const char *p = c ? strchr(b64chars, c) : NULL;
  return p ? (int)(p - b64chars) : -1;
}

/* Returns a malloc'ed NUL-terminated buffer, or NULL on bad input / OOM
 * (*bad says which). */
static char *b64_decode(const char *s, size_t *len, int *bad) {
  size_t n = strlen(s);
  *bad = 0;
  while (n > 0 && s[n - 1] == '=')
    n--;
  char *out = malloc(n / 4 * 3 + 4), *o = out;
  if (!out)
    return NULL;
  uint32_t acc = 0;
  int bits = 0;
  for (size_t i = 0; i < n; i++) {
    int v = b64_val((unsigned char)s[i]);
    if (v < 0) {
      free(out);
      *bad = 1;
      return NULL;
    }
    acc = (acc << 6) | (uint32_t)v;
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      *o++ = (char)((acc >> bits) & 0xff);
    }
  }
  *o = '\0';
  *len = (size_t)(o - out);
  return out;
}

/* ---- curl plumbing ---- */

typedef mc_curl_body_t body_t;

static CURLcode post_once(etcd_meta_t *e, CURL *c, const char *url,
                          const char *json, body_t *b, long *status,
                          char *errbuf) {
  struct curl_slist *hdrs = curl_slist_append(NULL, "Content-Type: application/json");
  struct curl_slist *h2 = hdrs ? curl_slist_append(hdrs, "Expect:") : NULL;
  if (!h2) {
    curl_slist_free_all(hdrs);
    return CURLE_OUT_OF_MEMORY;
  }
  hdrs = h2;
  CURLcode sc = mc_curl_setup(c, url, e->connect_timeout_ms, e->timeout_ms, errbuf, b,
                              (curl_off_t)ETCD_BODY_MAX, hdrs);
#define SET(opt, val) MC_CURL_SET(sc, c, opt, val)
  SET(CURLOPT_POST, 1L);
  SET(CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)strlen(json));
  SET(CURLOPT_POSTFIELDS, json);
#undef SET
  if (sc == CURLE_OK)
    sc = curl_easy_perform(c);
  if (sc == CURLE_OK)
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, status);
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, NULL);
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, NULL);
  curl_slist_free_all(hdrs);
  return sc;
}

/* Errors after which the next endpoint may do better. */
static int is_unreachable(CURLcode cc) {
  return cc == CURLE_COULDNT_CONNECT || cc == CURLE_COULDNT_RESOLVE_HOST ||
         cc == CURLE_OPERATION_TIMEDOUT || cc == CURLE_RECV_ERROR ||
         cc == CURLE_SEND_ERROR || cc == CURLE_GOT_NOTHING;
}

/* Posts json to <endpoint><api>/<op>, failing over across endpoints, and
 * parses the answer.  On success *out is the parsed JSON object (caller
 * deletes).  `what` ("PUT", "GET"...) and `key` only feed messages. */
static int call(etcd_meta_t *e, const char *op, const char *json,
                const char *what, const char *key, cJSON **out, mc_err_t *err) {
  *out = NULL;
  CURL *c = mc_curl_pool_take(&e->pool);
  if (!c)
    return mc_err_set(err, MC_ENOMEM,
                      "could not create a libcurl handle for etcd %s", e->base.url);
  pthread_mutex_lock(&e->mu);
  int start = e->cur;
  pthread_mutex_unlock(&e->mu);
  int rc = 0, switched_api = 0;
  char last[MC_ERR_MSG_MAX] = "";
  for (int k = 0; k < e->n_eps; k++) {
    int idx = (start + k) % e->n_eps;
    char api[16], url[MC_HOST_MAX + 96];
    pthread_mutex_lock(&e->mu);
    snprintf(api, sizeof api, "%s", e->api);
    pthread_mutex_unlock(&e->mu);
    snprintf(url, sizeof url, "%s%s/%s", e->eps[idx], api, op);
    body_t b = {.max = ETCD_BODY_MAX};
    long status = 0;
    char errbuf[CURL_ERROR_SIZE] = "";
    if (k > 0)
      curl_easy_reset(c);
    mc_log_debug("etcd %s %s (key \"%s\")", what, url, key);
    CURLcode cc = post_once(e, c, url, json, &b, &status, errbuf);
    if (b.too_big || cc == CURLE_FILESIZE_EXCEEDED) {
      free(b.data);
      rc = mc_err_set(err, MC_ETOOBIG,
                      "etcd %s (endpoint %s) sent more than %d MiB for %s key "
                      "\"%s\"; refused (is it an etcd server?)",
                      e->base.url, e->eps[idx], (int)(ETCD_BODY_MAX >> 20), what, key);
      goto done;
    }
    if (b.oom || cc == CURLE_OUT_OF_MEMORY) {
      free(b.data);
      rc = mc_err_set(err, MC_ENOMEM, "out of memory talking to etcd %s", e->base.url);
      goto done;
    }
    if (cc != CURLE_OK) {
      free(b.data);
      snprintf(last, sizeof last, "%s: %s%s%s", e->eps[idx], curl_easy_strerror(cc),
               errbuf[0] ? " (" : "", errbuf[0] ? errbuf : "");
      if (errbuf[0])
        strncat(last, ")", sizeof last - strlen(last) - 1);
      if (is_unreachable(cc))
        continue; /* fail over */
      rc = mc_err_set(err, MC_EMETADATA, "etcd %s failed %s key \"%s\": %s",
                      e->base.url, what, key, last);
      goto done;
    }
    cJSON *j = b.data ? cJSON_ParseWithLength(b.data, b.len) : NULL;
    if (status == 404 && !cJSON_IsObject(j) && !switched_api && strcmp(api, "/v3") == 0) {
      /* etcd 3.3 serves the gateway at /v3beta only. */
      cJSON_Delete(j);
      free(b.data);
      pthread_mutex_lock(&e->mu);
      snprintf(e->api, sizeof e->api, "/v3beta");
      pthread_mutex_unlock(&e->mu);
      mc_log_info("etcd %s has no /v3 gateway; using /v3beta", e->eps[idx]);
      switched_api = 1;
      k--;
      continue;
    }
    char snip[ETCD_SNIPPET_MAX + 1];
    mc_curl_snippet(b.data, b.len, snip, sizeof snip, ETCD_SNIPPET_MAX);
    free(b.data);
    if (!cJSON_IsObject(j)) {
      cJSON_Delete(j);
      rc = mc_err_set(err, MC_EMETADATA,
                      "etcd %s (endpoint %s) answered %s key \"%s\" with HTTP %ld "
                      "and no JSON object%s%s (is it an etcd v3 gateway?)",
                      e->base.url, e->eps[idx], what, key, status,
                      snip[0] ? ": " : "", snip);
      goto done;
    }
    const cJSON *eo = cJSON_GetObjectItemCaseSensitive(j, "error");
    if (!eo && cJSON_IsObject(cJSON_GetObjectItemCaseSensitive(j, "result")))
      eo = cJSON_GetObjectItemCaseSensitive(
          cJSON_GetObjectItemCaseSensitive(j, "result"), "error");
    if (eo || status != 200) {
      const char *msg = cJSON_IsString(eo) ? eo->valuestring : NULL;
      if (!msg && cJSON_IsObject(eo)) {
        const cJSON *m = cJSON_GetObjectItemCaseSensitive(eo, "message");
        msg = cJSON_IsString(m) ? m->valuestring : NULL;
      }
      const cJSON *code = cJSON_GetObjectItemCaseSensitive(j, "code");
      rc = mc_err_set(err, MC_EMETADATA,
                      "etcd %s (endpoint %s) refused %s key \"%s\": HTTP %ld, "
                      "%s (code %d)",
                      e->base.url, e->eps[idx], what, key, status,
                      msg ? msg : snip, cJSON_IsNumber(code) ? code->valueint : 0);
      cJSON_Delete(j);
      goto done;
    }
    pthread_mutex_lock(&e->mu);
    e->cur = idx;
    pthread_mutex_unlock(&e->mu);
    *out = j;
    goto done;
  }
  rc = mc_err_set(err, MC_EMETADATA,
                  "etcd %s unreachable while %s key \"%s\" (all %d endpoint%s "
                  "failed; last %s)",
                  e->base.url, what, key, e->n_eps, e->n_eps == 1 ? "" : "s", last);
done:
  mc_curl_pool_give(&e->pool, c);
  return rc;
}

/* Builds {"key": b64(key) [, "value": b64(val)] [, "lease": id]
 * [, "prev_kv": true]} as a string. */
static char *kv_json(const char *key, const char *val, size_t len,
                     const char *lease, int prev_kv) {
  char *k64 = b64_encode(key, strlen(key));
  char *v64 = val ? b64_encode(val, len) : NULL;
  char *s = NULL;
  if (k64 && (!val || v64)) {
    size_t n = strlen(k64) + (v64 ? strlen(v64) : 0) + 128;
    s = malloc(n);
    if (s) {
      int w = snprintf(s, n, "{\"key\":\"%s\"", k64);
      if (v64)
        w += snprintf(s + w, n - (size_t)w, ",\"value\":\"%s\"", v64);
      if (lease)
        w += snprintf(s + w, n - (size_t)w, ",\"lease\":\"%s\"", lease);
      if (prev_kv)
        w += snprintf(s + w, n - (size_t)w, ",\"prev_kv\":true");
      snprintf(s + w, n - (size_t)w, "}");
    }
  }
  free(k64);
  free(v64);
  return s;
}

static int oom(etcd_meta_t *e, const char *key, mc_err_t *err) {
  return mc_err_set(err, MC_ENOMEM, "out of memory building a request for etcd %s, key \"%s\"",
                    e->base.url, key);
}

/* kv/put; *had_prev (if non-NULL) says whether the key existed before. */
static int do_put(etcd_meta_t *e, const char *key, const char *val, size_t len,
                  const char *lease, int *had_prev, mc_err_t *err) {
  char *json = kv_json(key, val, len, lease, had_prev != NULL);
  if (!json)
    return oom(e, key, err);
  cJSON *j;
  int rc = call(e, "kv/put", json, "PUT", key, &j, err);
  free(json);
  if (rc < 0)
    return rc;
  if (had_prev)
    *had_prev = cJSON_IsObject(cJSON_GetObjectItemCaseSensitive(j, "prev_kv"));
  cJSON_Delete(j);
  return 0;
}

static int etcd_put(mc_meta_t *m, const char *key, const char *val, size_t len,
                    mc_err_t *err) {
  return do_put((etcd_meta_t *)m, key, val, len, NULL, NULL, err);
}

static int etcd_get(mc_meta_t *m, const char *key, char **val, size_t *len,
                    mc_err_t *err) {
  etcd_meta_t *e = (etcd_meta_t *)m;
  char *json = kv_json(key, NULL, 0, NULL, 0);
  if (!json)
    return oom(e, key, err);
  cJSON *j;
  int rc = call(e, "kv/range", json, "GET", key, &j, err);
  free(json);
  if (rc < 0)
    return rc;
  const cJSON *kvs = cJSON_GetObjectItemCaseSensitive(j, "kvs");
  const cJSON *kv = cJSON_IsArray(kvs) ? cJSON_GetArrayItem(kvs, 0) : NULL;
  if (!kv) {
    cJSON_Delete(j);
    return mc_err_set(err, MC_ENOTFOUND, "key \"%s\" not found on etcd %s", key, e->base.url);
  }
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(kv, "value");
  int bad = 0;
  char *dec = NULL;
  if (!v) /* etcd omits an empty value */
    dec = calloc(1, 1), *len = 0;
  else if (cJSON_IsString(v))
    dec = b64_decode(v->valuestring, len, &bad);
  else
    bad = 1;
  cJSON_Delete(j);
  if (bad)
    return mc_err_set(err, MC_EMETADATA,
                      "etcd %s answered GET key \"%s\" with a value that is not "
                      "base64",
                      e->base.url, key);
  if (!dec)
    return oom(e, key, err);
  if (*len > MC_META_MAX_VALUE) {
    free(dec);
    return mc_err_set(err, MC_ETOOBIG, "etcd %s: value of key \"%s\" is larger than %zu MiB",
                      e->base.url, key, MC_META_MAX_VALUE >> 20);
  }
  *val = dec;
  return 0;
}

static int etcd_del(mc_meta_t *m, const char *key, mc_err_t *err) {
  etcd_meta_t *e = (etcd_meta_t *)m;
  char *json = kv_json(key, NULL, 0, NULL, 0);
  if (!json)
    return oom(e, key, err);
  cJSON *j;
  int rc = call(e, "kv/deleterange", json, "DELETE", key, &j, err);
  free(json);
  cJSON_Delete(j);
  return rc;
}

/* ---- leases ---- */

static lease_t *lease_slot(etcd_meta_t *e, int ttl) {
  for (int i = 0; i < e->n_leases; i++)
    if (e->leases[i].ttl == ttl)
      return &e->leases[i];
  return NULL;
}

/* Grants a fresh lease of ttl seconds and records it; id written to out. */
static int lease_grant(etcd_meta_t *e, int ttl, const char *key, char *out, size_t outlen,
                       mc_err_t *err) {
  char json[64];
  snprintf(json, sizeof json, "{\"TTL\":\"%d\"}", ttl);
  cJSON *j;
  int rc = call(e, "lease/grant", json, "lease grant for", key, &j, err);
  if (rc < 0)
    return rc;
  const cJSON *id = cJSON_GetObjectItemCaseSensitive(j, "ID");
  char idbuf[32] = "";
  if (cJSON_IsString(id) && strlen(id->valuestring) < sizeof idbuf &&
      strspn(id->valuestring, "0123456789") == strlen(id->valuestring))
    snprintf(idbuf, sizeof idbuf, "%s", id->valuestring);
  else if (cJSON_IsNumber(id))
    snprintf(idbuf, sizeof idbuf, "%.0f", id->valuedouble);
  cJSON_Delete(j);
  if (!idbuf[0])
    return mc_err_set(err, MC_EMETADATA,
                      "etcd %s granted a lease for key \"%s\" without a valid ID",
                      e->base.url, key);
  pthread_mutex_lock(&e->mu);
  lease_t *l = lease_slot(e, ttl);
  if (!l && e->n_leases < ETCD_LEASES_MAX)
    l = &e->leases[e->n_leases++];
  if (!l) /* table full: recycle the first slot */
    l = &e->leases[0];
  l->ttl = ttl;
  snprintf(l->id, sizeof l->id, "%s", idbuf);
  pthread_mutex_unlock(&e->mu);
  snprintf(out, outlen, "%s", idbuf);
  return 0;
}

/* Current lease id for ttl into out; 0 if known, 1 if none yet. */
static int lease_lookup(etcd_meta_t *e, int ttl, char *out, size_t outlen) {
  pthread_mutex_lock(&e->mu);
  lease_t *l = lease_slot(e, ttl);
  if (l)
    snprintf(out, outlen, "%s", l->id);
  pthread_mutex_unlock(&e->mu);
  return l ? 0 : 1;
}

/* Keeps the lease alive; 0 alive, 1 etcd no longer knows it. */
static int lease_keepalive(etcd_meta_t *e, const char *id, const char *key, mc_err_t *err) {
  char json[64];
  snprintf(json, sizeof json, "{\"ID\":\"%s\"}", id);
  cJSON *j;
  int rc = call(e, "lease/keepalive", json, "lease keep-alive for", key, &j, err);
  if (rc < 0)
    return rc;
  const cJSON *res = cJSON_GetObjectItemCaseSensitive(j, "result");
  const cJSON *ttl = cJSON_GetObjectItemCaseSensitive(cJSON_IsObject(res) ? res : j, "TTL");
  long left = 0;
  if (cJSON_IsString(ttl))
    left = strtol(ttl->valuestring, NULL, 10);
  else if (cJSON_IsNumber(ttl))
    left = ttl->valuedouble >= 1; /* any number: no (long) of 1e300 */
  cJSON_Delete(j);
  return left > 0 ? 0 : 1; /* a lost lease comes back without TTL */
}

static int is_lease_lost(const mc_err_t *err) {
  return err && strstr(err->msg, "requested lease not found") != NULL;
}

static int etcd_put_ttl_impl(etcd_meta_t *e, const char *key, const char *val, size_t len,
                             int ttl, int *had_prev, mc_err_t *err) {
  char id[32];
  int rc = 0;
  if (lease_lookup(e, ttl, id, sizeof id) != 0)
    rc = lease_grant(e, ttl, key, id, sizeof id, err);
  if (rc < 0)
    return rc;
  mc_err_t tmp = {0};
  rc = do_put(e, key, val, len, id, had_prev, &tmp);
  if (rc < 0 && is_lease_lost(&tmp)) {
    /* The lease expired or etcd restarted: take a new one, once. */
    if ((rc = lease_grant(e, ttl, key, id, sizeof id, err)) < 0)
      return rc;
    if (had_prev)
      *had_prev = 0;
    return do_put(e, key, val, len, id, had_prev, err);
  }
  if (rc < 0 && err)
    *err = tmp;
  return rc;
}

static int etcd_put_ttl(mc_meta_t *m, const char *key, const char *val, size_t len, int ttl,
                        mc_err_t *err) {
  return etcd_put_ttl_impl((etcd_meta_t *)m, key, val, len, ttl, NULL, err);
}

/* Keep-alive of the TTL's lease, then the value is written again with it
 * (cheap, and it repairs a key lost with its lease).  1 when the key was
 * missing before. */
static int etcd_refresh(mc_meta_t *m, const char *key, const char *val, size_t len, int ttl,
                        mc_err_t *err) {
  etcd_meta_t *e = (etcd_meta_t *)m;
  char id[32];
  int rc = 0;
  if (lease_lookup(e, ttl, id, sizeof id) == 0) {
    rc = lease_keepalive(e, id, key, err);
    if (rc < 0)
      return rc;
    if (rc == 1) {
      mc_log_info("etcd %s lost lease %s; granting a new one", e->base.url, id);
      if ((rc = lease_grant(e, ttl, key, id, sizeof id, err)) < 0)
        return rc;
    }
  }
  int had_prev = 0;
  rc = etcd_put_ttl_impl(e, key, val, len, ttl, &had_prev, err);
  if (rc < 0)
    return rc;
  return had_prev ? 0 : 1;
}

static void etcd_close(mc_meta_t *m) {
  etcd_meta_t *e = (etcd_meta_t *)m;
  mc_curl_pool_drain(&e->pool);
  pthread_mutex_destroy(&e->mu);
  free(e);
}

static const mc_meta_ops_t etcd_ops = {
    .name = "etcd",
    .put = etcd_put,
    .get = etcd_get,
    .del = etcd_del,
    .put_ttl = etcd_put_ttl,
    .refresh = etcd_refresh,
    .close = etcd_close,
};

/* ---- open ---- */

int mc_meta_etcd_open(const char *conn, const char *endpoints, mc_meta_t **out,
                      mc_err_t *err) {
  *out = NULL;
  mc_curl_global_init();
  long total, connect;
  int rc = mc_meta_read_timeouts(&total, &connect, err);
  if (rc)
    return rc;
  etcd_meta_t *e = calloc(1, sizeof *e);
  if (!e)
    return mc_err_set(err, MC_ENOMEM, "out of memory opening etcd %s", conn);
  if (!*endpoints) {
    free(e);
    return mc_err_set(err, MC_EINVAL,
                      "etcd metadata server \"%s\" lists no endpoint; expected "
                      "\"etcd://host:port[,host:port...]\"",
                      conn);
  }
  for (const char *s = endpoints;;) {
    const char *comma = strchr(s, ',');
    size_t n = comma ? (size_t)(comma - s) : strlen(s);
    char item[MC_HOST_MAX + 16];
    mc_hostport_t hp;
    mc_err_t he = {0};
    if (n == 0 || n >= sizeof item || e->n_eps == ETCD_EP_MAX) {
      free(e);
      return mc_err_set(err, MC_EINVAL,
                        "etcd metadata server \"%s\": %s; expected "
                        "\"etcd://host:port[,host:port...]\" (at most %d)",
                        conn, n == 0 ? "empty endpoint" : n >= sizeof item ? "endpoint too long"
                                                                          : "too many endpoints",
                        ETCD_EP_MAX);
    }
    memcpy(item, s, n);
    item[n] = '\0';
    if (mc_hostport_parse(item, &hp, &he) < 0 || hp.port < 0) {
      free(e);
      return mc_err_set(err, MC_EINVAL,
                        "etcd metadata server \"%s\": endpoint \"%s\" is not host:port%s%s",
                        conn, item, he.msg[0] ? " (" : "", he.msg[0] ? he.msg : "");
    }
    char hps[MC_HOST_MAX + 16];
    mc_hostport_format(&hp, hps, sizeof hps);
    snprintf(e->eps[e->n_eps++], sizeof e->eps[0], "http://%s", hps);
    if (!comma)
      break;
    s = comma + 1;
  }
  e->pool.mu = &e->mu;
  int pe = pthread_mutex_init(&e->mu, NULL);
  if (pe) {
    free(e);
    return mc_err_sys(err, MC_ESYS, pe, "pthread_mutex_init");
  }
  e->base.ops = &etcd_ops;
  mc_meta_set_url(&e->base, conn);
  e->timeout_ms = total;
  e->connect_timeout_ms = connect;
  snprintf(e->api, sizeof e->api, "/v3");
  *out = &e->base;
  return 0;
}
