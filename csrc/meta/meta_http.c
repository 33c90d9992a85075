/* HTTP metadata backend (Mooncake's HTTP metadata protocol) over libcurl:
 *   GET|PUT|DELETE <url>?key=<escaped key>, PUT body = the JSON value,
 *   only HTTP 200 is success (404 = missing key for GET, ignored by DELETE).
 * TTL extension: PUT <url>?key=<k>&ttl=<seconds>; the embedded server drops
 * the entry after ttl seconds and answers "metadata created" when the key
 * did not exist before (so a refresh can tell that it re-created it).  A
 * server that ignores the parameter keeps the entry until it is deleted.
 *
 * Thread-safety: a CURL easy handle is used by one thread at a time.  Each
 * call takes a handle from a small mutex-protected pool (or makes a new one)
 * and gives it back afterwards, so concurrent callers never share a handle
 * while sequential calls reuse the kept-alive connection. */
#include "meta/meta.h"

#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <curl/curl.h>

#include "util/log.h"

#define HTTP_POOL_MAX 4
#define HTTP_CONNECT_TIMEOUT_MS 1500L
#define HTTP_TOTAL_TIMEOUT_MS 3000L
#define HTTP_TIMEOUT_MAX_MS 600000L
#define HTTP_SNIPPET_MAX 120 /* bytes of an error body quoted in messages */

typedef struct http_meta {
  mc_meta_t base; /* first: mc_meta_t * <-> http_meta_t * */
  long timeout_ms;
  long connect_timeout_ms;
  pthread_mutex_t mu; /* guards idle[] and n_idle */
  CURL *idle[HTTP_POOL_MAX];
  int n_idle;
} http_meta_t;

/* curl_global_init is not guaranteed thread-safe on every libcurl build;
 * run it exactly once.  If it fails, curl_easy_init fails later and the
 * caller gets a message from there. */
static pthread_once_t curl_once = PTHREAD_ONCE_INIT;

static void curl_init_once(void) {
  CURLcode rc = curl_global_init(CURL_GLOBAL_DEFAULT);
  if (rc != CURLE_OK)
    mc_log_error("curl_global_init failed: %s", curl_easy_strerror(rc));
}

static void curl_init(void) { pthread_once(&curl_once, curl_init_once); }

/* ---- handle pool ---- */

static CURL *handle_take(http_meta_t *h) {
  CURL *c = NULL;
  pthread_mutex_lock(&h->mu);
  if (h->n_idle > 0)
    c = h->idle[--h->n_idle];
  pthread_mutex_unlock(&h->mu);
  if (c) {
    curl_easy_reset(c); /* drops options, keeps live connections */
    return c;
  }
  return curl_easy_init();
}

static void handle_give(http_meta_t *h, CURL *c) {
  pthread_mutex_lock(&h->mu);
  if (h->n_idle < HTTP_POOL_MAX) {
    h->idle[h->n_idle++] = c;
    c = NULL;
  }
  pthread_mutex_unlock(&h->mu);
  if (c)
    curl_easy_cleanup(c);
}

/* ---- response body ---- */

typedef struct body {
  char *data; /* NUL-terminated when non-NULL */
  size_t len;
  size_t cap;
  int too_big; /* the server sent more than MC_META_MAX_VALUE */
  int oom;
} body_t;

static int body_reserve(body_t *b, size_t need) {
  if (need <= b->cap)
    return 0;
  size_t ncap = b->cap ? b->cap : 4096;
  while (ncap < need)
    ncap *= 2;
  if (ncap > MC_META_MAX_VALUE + 1)
    ncap = MC_META_MAX_VALUE + 1;
  char *p = realloc(b->data, ncap);
  if (!p)
    return -1;
  b->data = p;
  b->cap = ncap;
  return 0;
}

/* Returning less than n makes curl abort the transfer (CURLE_WRITE_ERROR);
 * that is how an endless or oversized body is cut off early. */
static size_t on_write(char *ptr, size_t size, size_t nmemb, void *ud) {
  body_t *b = ud;
  size_t n = size * nmemb;
  if (n > MC_META_MAX_VALUE - b->len) {
    b->too_big = 1;
    return 0;
  }
  if (body_reserve(b, b->len + n + 1) < 0) {
    b->oom = 1;
    return 0;
  }
  memcpy(b->data + b->len, ptr, n);
  b->len += n;
  b->data[b->len] = '\0';
  return n;
}

/* A short printable excerpt of an error body, for messages. */
static void body_snippet(const body_t *b, char *out, size_t outlen) {
  size_t n = 0;
  for (size_t i = 0; b->data && i < b->len && n + 1 < outlen &&
                     n < HTTP_SNIPPET_MAX;
       i++) {
    unsigned char ch = (unsigned char)b->data[i];
    out[n++] = isprint(ch) ? (char)ch : ' ';
  }
  while (n > 0 && out[n - 1] == ' ')
    n--;
  out[n] = '\0';
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
  CURLcode sc = CURLE_OK;
#define SET(opt, val)                                                          \
  do {                                                                         \
    if (sc == CURLE_OK)                                                        \
      sc = curl_easy_setopt(c, opt, val);                                      \
  } while (0)
  SET(CURLOPT_URL, url);
  SET(CURLOPT_NOSIGNAL, 1L); /* no SIGALRM for DNS timeouts: we are a lib */
  SET(CURLOPT_CONNECTTIMEOUT_MS, h->connect_timeout_ms);
  SET(CURLOPT_TIMEOUT_MS, h->timeout_ms);
  SET(CURLOPT_ERRORBUFFER, errbuf);
  SET(CURLOPT_WRITEFUNCTION, on_write);
  SET(CURLOPT_WRITEDATA, b);
  /* Refuses a too-large announced Content-Length before reading it. */
  SET(CURLOPT_MAXFILESIZE_LARGE, (curl_off_t)MC_META_MAX_VALUE);
  SET(CURLOPT_HTTPHEADER, hdrs);
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

  CURL *c = handle_take(h);
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
  handle_give(h, c);
  return rc;
}

static int status_error(const http_meta_t *h, const req_t *r, long status,
                        const body_t *b, mc_err_t *err) {
  char snip[HTTP_SNIPPET_MAX + 1];
  body_snippet(b, snip, sizeof snip);
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

static int http_put_ttl(mc_meta_t *m, const char *key, const char *val,
                        size_t len, int ttl_s, mc_err_t *err) {
  http_meta_t *h = (http_meta_t *)m;
  req_t r = {.method = "PUT", .key = key, .val = val, .len = len, .ttl = ttl_s};
  body_t b;
  long status;
  int rc = perform(h, &r, &b, &status, err);
  if (rc == 0 && status != 200)
    rc = status_error(h, &r, status, &b, err);
  /* The embedded server says whether the key existed before. */
  if (rc == 0 && b.data && strncmp(b.data, "metadata created", 16) == 0)
    rc = 1;
  free(b.data);
  return rc;
}

/* HTTP has no "extend": the refresh re-sends the value with its TTL. */
static int http_refresh(mc_meta_t *m, const char *key, const char *val,
                        size_t len, int ttl_s, mc_err_t *err) {
  return http_put_ttl(m, key, val, len, ttl_s, err);
}

static int http_put_ttl0(mc_meta_t *m, const char *key, const char *val,
                         size_t len, int ttl_s, mc_err_t *err) {
  int rc = http_put_ttl(m, key, val, len, ttl_s, err);
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
  for (int i = 0; i < h->n_idle; i++)
    curl_easy_cleanup(h->idle[i]);
  pthread_mutex_destroy(&h->mu);
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

static int read_timeout(long *out, mc_err_t *err) {
  const char *s = getenv("MC_METADATA_TIMEOUT_MS");
  *out = HTTP_TOTAL_TIMEOUT_MS;
  if (!s || !*s)
    return 0;
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || *end || v < 1 || v > HTTP_TIMEOUT_MAX_MS)
    return mc_err_set(err, MC_ECONFIG,
                      "MC_METADATA_TIMEOUT_MS=\"%s\" is not a whole number of "
                      "milliseconds in 1..%ld",
                      s, HTTP_TIMEOUT_MAX_MS);
  *out = v;
  return 0;
}

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

int mc_meta_http_open(const char *url, mc_meta_t **out, mc_err_t *err) {
  *out = NULL;
  size_t n = strlen(url);
  if (n >= sizeof(((mc_meta_t *)0)->url))
    return mc_err_set(err, MC_EINVAL,
                      "metadata server URL \"%.64s...\" is longer than %zu "
                      "characters",
                      url, sizeof(((mc_meta_t *)0)->url) - 1);
  curl_init();
  long timeout_ms;
  int rc = read_timeout(&timeout_ms, err);
  if (rc)
    return rc;
  rc = check_url(url, err);
  if (rc)
    return rc;
  http_meta_t *h = calloc(1, sizeof *h);
  if (!h)
    return mc_err_set(err, MC_ENOMEM, "out of memory opening %s", url);
  int e = pthread_mutex_init(&h->mu, NULL);
  if (e) {
    free(h);
    return mc_err_sys(err, MC_ESYS, e, "pthread_mutex_init");
  }
  h->base.ops = &http_ops;
  memcpy(h->base.url, url, n + 1);
  h->timeout_ms = timeout_ms;
  h->connect_timeout_ms =
      timeout_ms < HTTP_CONNECT_TIMEOUT_MS ? timeout_ms : HTTP_CONNECT_TIMEOUT_MS;
  *out = &h->base;
  return 0;
}
