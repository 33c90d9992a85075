/* HTTP metadata backend (Mooncake's HTTP metadata protocol) over libcurl:
 *   GET|PUT|DELETE <url>?key=<escaped key>, PUT body = the JSON value,
 *   only HTTP 200 is success (404 = missing key for GET, ignored by DELETE).
 * TTL extension: PUT <url>?key=<k>&ttl=<seconds>; the embedded server drops
 * the entry after ttl seconds and answers "metadata created" when the key
 * did not exist before (so a refresh can tell that it re-created it).  A
 * server that ignores the parameter keeps the entry until it is deleted.
 *
 * Authentication: with MC_METADATA_TOKEN set (non-empty) every request
 * carries "Authorization: Bearer <token>" (docs/security.md); a 401 answer
 * says to set it.
 *
 * Thread-safety: a CURL easy handle is used by one thread at a time.  Each
 * call takes a handle from a small mutex-protected pool (or makes a new one)
 * and gives it back afterwards, so concurrent callers never share a handle
 * while sequential calls reuse the kept-alive connection. */
#include "meta/curl_util.h"
#include "meta/meta.h"

#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <curl/curl.h>

#include "util/log.h"

#define HTTP_SNIPPET_MAX 120 /* bytes of an error body quoted in messages */

typedef struct http_meta {
  mc_meta_t base; /* first: mc_meta_t * <-> http_meta_t * */
  long timeout_ms;
  long connect_timeout_ms;
  pthread_mutex_t mu; /* guards idle[] and n_idle */
  mc_curl_pool_t pool; /* pool.mu = &mu */
  char *auth_header;   /* "Authorization: Bearer <token>" or NULL */
  int refuses_dup;     /* the server refused a second PUT of a rpc_meta key (atomic) */
} http_meta_t;

#define HTTP_TOKEN_MAX 4096

/* curl_global_init is not guaranteed thread-safe on every libcurl build;
 * run it exactly once.  If it fails, curl_easy_init fails later and the
 * caller gets a message from there. */
typedef mc_curl_body_t body_t;

static void body_snippet(const body_t *b, char *out, size_t outlen) {
  mc_curl_snippet(b->data, b->len, out, outlen, HTTP_SNIPPET_MAX);
}

/* ---- one request ---- */

typedef struct req {
  const char *method; /* "GET", "PUT", "DELETE" */
  const char *key;
  const char *val; /* PUT only */
  size_t len;
  int ttl; /* PUT only: > 0 adds "&ttl=<ttl>" */
} req_t;

/* Builds "<base>?key=<escaped>[&ttl=N]" (or "&key=" when base already has a
 * query). */
static char *build_url(CURL *c, const char *base, const char *key, int ttl) {
  char *esc = curl_easy_escape(c, key, 0);
  if (!esc)
    return NULL;
  const char *sep = strchr(base, '?') ? "&key=" : "?key=";
  char ttlq[32] = "";
  if (ttl > 0)
    snprintf(ttlq, sizeof ttlq, "&ttl=%d", ttl);
  size_t n = strlen(base) + strlen(sep) + strlen(esc) + strlen(ttlq) + 1;
  char *url = malloc(n);
  if (url)
    snprintf(url, n, "%s%s%s%s", base, sep, esc, ttlq);
  curl_free(esc);
  return url;
}

/* Maps a failed curl transfer to an error that names server, key and cause. */
static int transfer_error(const http_meta_t *h, const req_t *r, CURLcode rc,
                          const char *errbuf, const body_t *b,
                          mc_err_t *err) {
  const char *url = h->base.url;
  if (b->oom)
    return mc_err_set(err, MC_ENOMEM,
                      "out of memory reading the answer of metadata server %s "
                      "to %s key \"%s\"",
                      url, r->method, r->key);
  if (b->too_big || rc == CURLE_FILESIZE_EXCEEDED)
    return mc_err_set(err, MC_ETOOBIG,
                      "metadata server %s sent a value larger than %zu MiB for "
                      "%s key \"%s\"; refused (is the URL pointing at a "
                      "metadata server?)",
                      url, MC_META_MAX_VALUE >> 20, r->method, r->key);
  char detail[CURL_ERROR_SIZE + 64];
  const char *what = curl_easy_strerror(rc);
  if (errbuf[0] && strcmp(errbuf, what) != 0)
    snprintf(detail, sizeof detail, "%s (%s)", what, errbuf);
  else
    snprintf(detail, sizeof detail, "%s", what);
  switch (rc) {
  case CURLE_OPERATION_TIMEDOUT:
    return mc_err_set(err, MC_EMETADATA,
                      "metadata server %s did not answer %s key \"%s\" within "
                      "%ld ms (MC_METADATA_TIMEOUT_MS): %s",
                      url, r->method, r->key, h->timeout_ms, detail);
  case CURLE_COULDNT_CONNECT:
  case CURLE_COULDNT_RESOLVE_HOST:
  case CURLE_COULDNT_RESOLVE_PROXY:
    return mc_err_set(err, MC_EMETADATA,
                      "metadata server %s unreachable while %s key \"%s\": %s",
                      url, r->method, r->key, detail);
  default:
    return mc_err_set(err, MC_EMETADATA,
                      "metadata server %s failed %s key \"%s\": %s", url,
                      r->method, r->key, detail);
  }
}

/* Sets every option of one request; returns the first setopt failure. */
static CURLcode setup(CURL *c, const http_meta_t *h, const req_t *r,
                      const char *url, struct curl_slist *hdrs, body_t *b,
                      char *errbuf) {
  CURLcode sc = mc_curl_setup(c, url, h->connect_timeout_ms, h->timeout_ms, errbuf, b,
                              (curl_off_t)MC_META_MAX_VALUE, hdrs);
#define SET(opt, val) MC_CURL_SET(sc, c, opt, val)
  if (strcmp(r->method, "GET") == 0) {
    SET(CURLOPT_HTTPGET, 1L);
  } else if (strcmp(r->method, "PUT") == 0) {
    SET(CURLOPT_CUSTOMREQUEST, "PUT");
    SET(CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)r->len);
    SET(CURLOPT_POSTFIELDS, r->val); /* not copied; lives during perform */
  } else {
    SET(CURLOPT_CUSTOMREQUEST, r->method);
  }
#undef SET
  return sc;
}

/* Runs one request.  On transfer success returns 0 with *status set and the
 * body in *b (caller frees b->data); otherwise an MC_E* code. */
static int perform(http_meta_t *h, const req_t *r, body_t *b, long *status,
                   mc_err_t *err) {
  char errbuf[CURL_ERROR_SIZE];
  errbuf[0] = '\0';
  memset(b, 0, sizeof *b);
  *status = 0;

  CURL *c = mc_curl_pool_take(&h->pool);
  if (!c)
    return mc_err_set(err, MC_ENOMEM,
                      "could not create a libcurl handle for metadata server "
                      "%s (out of memory or curl_global_init failed)",
                      h->base.url);
  int rc = 0;
  CURLcode cc;
  char *url = NULL;
  struct curl_slist *hdrs = NULL, *tmp;
  /* "Expect:" stops curl from waiting for 100-continue on large PUTs. */
  hdrs = curl_slist_append(NULL, "Expect:");
  if (hdrs && h->auth_header) {
    tmp = curl_slist_append(hdrs, h->auth_header);
    if (!tmp)
      curl_slist_free_all(hdrs);
    hdrs = tmp;
  }
  if (hdrs && strcmp(r->method, "PUT") == 0) {
    tmp = curl_slist_append(hdrs, "Content-Type: application/json");
    if (!tmp) {
      curl_slist_free_all(hdrs);
      hdrs = NULL;
    } else {
      hdrs = tmp;
    }
  }
  url = hdrs ? build_url(c, h->base.url, r->key, r->ttl) : NULL;
  if (!url) {
    rc = mc_err_set(err, MC_ENOMEM,
                    "out of memory building the request for metadata server "
                    "%s, key \"%s\"",
                    h->base.url, r->key);
    goto out;
  }
  cc = setup(c, h, r, url, hdrs, b, errbuf);
  if (cc != CURLE_OK) {
    rc = mc_err_set(err, cc == CURLE_OUT_OF_MEMORY ? MC_ENOMEM : MC_EMETADATA,
                    "could not set up %s key \"%s\" on metadata server %s: %s",
                    r->method, r->key, h->base.url, curl_easy_strerror(cc));
    goto out;
  }
  mc_log_debug("metadata %s %s", r->method, url);
  cc = curl_easy_perform(c);
  if (cc != CURLE_OK || b->too_big || b->oom) {
    rc = transfer_error(h, r, cc, errbuf, b, err);
    goto out;
  }
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, status);
out:
  if (rc < 0) {
    free(b->data);
    memset(b, 0, sizeof *b);
  }
  free(url);
  /* Clear pointers into this frame before the handle goes back to the pool. */
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, NULL);
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, NULL);
  curl_slist_free_all(hdrs);
  mc_curl_pool_give(&h->pool, c);
  return rc;
}

static int status_error(const http_meta_t *h, const req_t *r, long status,
                        const body_t *b, mc_err_t *err) {
  char snip[HTTP_SNIPPET_MAX + 1];
  body_snippet(b, snip, sizeof snip);
  if (status == 401)
    return mc_err_set(err, MC_EMETADATA,
                      "metadata server %s refused %s key \"%s\" (HTTP 401): %s; set "
                      "MC_METADATA_TOKEN to the server's token (docs/security.md)",
                      h->base.url, r->method, r->key,
                      h->auth_header ? "wrong bearer token" : "it requires a bearer token");
  return mc_err_set(err, MC_EMETADATA,
                    "metadata server %s answered HTTP %ld to %s key \"%s\"%s%s",
                    h->base.url, status, r->method, r->key, snip[0] ? ": " : "",
                    snip);
}

/* ---- backend ops ---- */

static int http_put(mc_meta_t *m, const char *key, const char *val,
                    size_t len, mc_err_t *err) {
  http_meta_t *h = (http_meta_t *)m;
  req_t r = {.method = "PUT", .key = key, .val = val, .len = len};
  body_t b;
  long status;
  int rc = perform(h, &r, &b, &status, err);
  if (rc == 0 && status != 200)
    rc = status_error(h, &r, status, &b, err);
  free(b.data);
  return rc;
}

/* Mooncake's HTTP metadata server answers a second PUT of a rpc_meta key
 * with HTTP 400 "Duplicate rpc_meta key not allowed". */
static int is_duplicate(long status, const body_t *b) {
  static const char tag[] = "Duplicate rpc_meta key";
  if (status != 400 || !b->data || b->len < sizeof tag - 1)
    return 0;
  for (size_t i = 0; i + sizeof tag - 1 <= b->len && i < HTTP_SNIPPET_MAX; i++)
    if (memcmp(b->data + i, tag, sizeof tag - 1) == 0)
      return 1;
  return 0;
}

/* PUT with TTL; *dup (when not NULL) is set when the server refused the PUT
 * as a duplicate key (then the error is set as well). */
static int http_put_ttl_dup(mc_meta_t *m, const char *key, const char *val,
                            size_t len, int ttl_s, int *dup, mc_err_t *err) {
  http_meta_t *h = (http_meta_t *)m;
  req_t r = {.method = "PUT", .key = key, .val = val, .len = len, .ttl = ttl_s};
  body_t b;
  long status;
  int rc = perform(h, &r, &b, &status, err);
  if (rc == 0 && status != 200) {
    if (strstr(key, "rpc_meta") && is_duplicate(status, &b)) {
      __atomic_store_n(&h->refuses_dup, 1, __ATOMIC_RELAXED);
      if (dup)
        *dup = 1;
    }
    rc = status_error(h, &r, status, &b, err);
  }
  /* The embedded server says whether the key existed before. */
  if (rc == 0 && b.data && strncmp(b.data, "metadata created", 16) == 0)
    rc = 1;
  free(b.data);
  return rc;
}

static int http_put_ttl(mc_meta_t *m, const char *key, const char *val,
                        size_t len, int ttl_s, mc_err_t *err) {
  return http_put_ttl_dup(m, key, val, len, ttl_s, NULL, err);
}

static int http_del(mc_meta_t *m, const char *key, mc_err_t *err);
static int http_get(mc_meta_t *m, const char *key, char **val, size_t *len,
                    mc_err_t *err);

/* HTTP has no "extend": the refresh re-sends the value with its TTL.
 * Mooncake's server keeps entries forever and refuses a second PUT of a
 * rpc_meta key: that refusal means the entry is still there (kept). */
static int http_refresh(mc_meta_t *m, const char *key, const char *val,
                        size_t len, int ttl_s, mc_err_t *err) {
  http_meta_t *h = (http_meta_t *)m;
  if (__atomic_load_n(&h->refuses_dup, __ATOMIC_RELAXED) && strstr(key, "rpc_meta")) {
    /* That server has no TTL either: a GET tells whether the entry is
     * still there, without a refused PUT on every keep-alive. */
    char *cur = NULL;
    size_t n = 0;
    int rc = http_get(m, key, &cur, &n, err);
    free(cur);
    if (rc != MC_ENOTFOUND)
      return rc;
    rc = http_put_ttl(m, key, val, len, ttl_s, err);
    return rc < 0 ? rc : 1;
  }
  int dup = 0;
  int rc = http_put_ttl_dup(m, key, val, len, ttl_s, &dup, err);
  return dup ? 0 : rc;
}

/* A first PUT refused as a duplicate (Mooncake's server, a stale entry of an
 * earlier engine of the same name): DELETE it and PUT ours. */
static int http_put_ttl0(mc_meta_t *m, const char *key, const char *val,
                         size_t len, int ttl_s, mc_err_t *err) {
  int dup = 0;
  int rc = http_put_ttl_dup(m, key, val, len, ttl_s, &dup, err);
  if (dup) {
    mc_log_info("metadata server %s already had key \"%s\" and refuses to overwrite it; "
                "replacing it (DELETE, then PUT)", m->url, key);
    if ((rc = http_del(m, key, err)) == 0)
      rc = http_put_ttl(m, key, val, len, ttl_s, err);
  }
  return rc > 0 ? 0 : rc;
}

static int http_get(mc_meta_t *m, const char *key, char **val, size_t *len,
                    mc_err_t *err) {
  http_meta_t *h = (http_meta_t *)m;
  req_t r = {.method = "GET", .key = key};
  body_t b;
  long status;
  int rc = perform(h, &r, &b, &status, err);
  if (rc < 0)
    return rc;
  if (status == 200) {
    if (!b.data && !(b.data = calloc(1, 1)))
      return mc_err_set(err, MC_ENOMEM, "out of memory");
    *val = b.data;
    *len = b.len;
    return 0;
  }
  if (status == 404)
    rc = mc_err_set(err, MC_ENOTFOUND,
                    "key \"%s\" not found on metadata server %s", key,
                    h->base.url);
  else
    rc = status_error(h, &r, status, &b, err);
  free(b.data);
  return rc;
}

static int http_del(mc_meta_t *m, const char *key, mc_err_t *err) {
  http_meta_t *h = (http_meta_t *)m;
  req_t r = {.method = "DELETE", .key = key};
  body_t b;
  long status;
  int rc = perform(h, &r, &b, &status, err);
  /* Deleting a key that is already gone is what the caller wanted. */
  if (rc == 0 && status != 200 && status != 404)
    rc = status_error(h, &r, status, &b, err);
  free(b.data);
  return rc;
}

static void http_close(mc_meta_t *m) {
  http_meta_t *h = (http_meta_t *)m;
  mc_curl_pool_drain(&h->pool);
  pthread_mutex_destroy(&h->mu);
  free(h->auth_header);
  free(h);
}

static const mc_meta_ops_t http_ops = {
    .name = "http",
    .put = http_put,
    .get = http_get,
    .del = http_del,
    .put_ttl = http_put_ttl0,
    .refresh = http_refresh,
    .close = http_close,
};

/* ---- open ---- */

/* Catches typos ("http:/host", "http://") at open time, not at first use. */
static int check_url(const char *url, mc_err_t *err) {
  CURLU *u = curl_url();
  if (!u)
    return mc_err_set(err, MC_ENOMEM, "out of memory parsing \"%s\"", url);
  char *host = NULL;
  CURLUcode uc = curl_url_set(u, CURLUPART_URL, url, 0);
  if (uc == CURLUE_OK)
    uc = curl_url_get(u, CURLUPART_HOST, &host, 0);
  int rc = 0;
  if (uc == CURLUE_OUT_OF_MEMORY)
    rc = mc_err_set(err, MC_ENOMEM, "out of memory parsing \"%s\"", url);
  else if (uc != CURLUE_OK || !host || !*host)
    rc = mc_err_set(err, MC_EINVAL,
                    "metadata server URL \"%s\" is not valid (%s); expected "
                    "\"http://host:port/metadata\"",
                    url, uc != CURLUE_OK ? curl_url_strerror(uc) : "no host");
  curl_free(host);
  curl_url_cleanup(u);
  return rc;
}

/* MC_METADATA_TOKEN -> the Authorization header (NULL when unset). */
static int read_token(char **out, mc_err_t *err) {
  const char *t = getenv("MC_METADATA_TOKEN");
  *out = NULL;
  if (!t || !*t)
    return 0;
  size_t n = strlen(t);
  if (n > HTTP_TOKEN_MAX)
    return mc_err_set(err, MC_ECONFIG, "MC_METADATA_TOKEN is %zu bytes long; at most %d are "
                      "accepted", n, HTTP_TOKEN_MAX);
  for (size_t i = 0; i < n; i++)
    if ((unsigned char)t[i] < 0x21 || (unsigned char)t[i] > 0x7e)
      return mc_err_set(err, MC_ECONFIG, "MC_METADATA_TOKEN has a space or control character "
                        "at offset %zu; a bearer token is printable ASCII without spaces", i);
  static const char pre[] = "Authorization: Bearer ";
  *out = malloc(sizeof pre + n);
  if (!*out)
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  memcpy(*out, pre, sizeof pre - 1);
  memcpy(*out + sizeof pre - 1, t, n + 1);
  return 0;
}

int mc_meta_http_open(const char *url, mc_meta_t **out, mc_err_t *err) {
  *out = NULL;
  size_t n = strlen(url);
  if (n >= sizeof(((mc_meta_t *)0)->url))
    return mc_err_set(err, MC_EINVAL,
                      "metadata server URL \"%.64s...\" is longer than %zu "
                      "characters",
                      url, sizeof(((mc_meta_t *)0)->url) - 1);
  mc_curl_global_init();
  long timeout_ms, connect_ms;
  int rc = mc_meta_read_timeouts(&timeout_ms, &connect_ms, err);
  if (rc)
    return rc;
  rc = check_url(url, err);
  if (rc)
    return rc;
  char *auth;
  if ((rc = read_token(&auth, err)) < 0)
    return rc;
  http_meta_t *h = calloc(1, sizeof *h);
  if (!h) {
    free(auth);
    return mc_err_set(err, MC_ENOMEM, "out of memory opening %s", url);
  }
  h->auth_header = auth;
  h->pool.mu = &h->mu;
  int e = pthread_mutex_init(&h->mu, NULL);
  if (e) {
    free(h->auth_header);
    free(h);
    return mc_err_sys(err, MC_ESYS, e, "pthread_mutex_init");
  }
  h->base.ops = &http_ops;
  memcpy(h->base.url, url, n + 1);
  h->timeout_ms = timeout_ms;
  h->connect_timeout_ms = connect_ms;
  *out = &h->base;
  return 0;
}
