#include "meta/curl_util.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#include "meta/meta.h"
#include "util/log.h"

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;

static void curl_init_once(void) {
  CURLcode rc = curl_global_init(CURL_GLOBAL_DEFAULT);
  if (rc != CURLE_OK)
    mc_log_error("curl_global_init failed: %s", curl_easy_strerror(rc));
}

void mc_curl_global_init(void) { pthread_once(&curl_once, curl_init_once); }

CURL *mc_curl_pool_take(mc_curl_pool_t *p) {
  CURL *c = NULL;
  pthread_mutex_lock(p->mu);
  if (p->n_idle > 0)
    c = p->idle[--p->n_idle];
  pthread_mutex_unlock(p->mu);
  if (c) {
    curl_easy_reset(c); /* drops options, keeps live connections */
    return c;
  }
  return curl_easy_init();
}

void mc_curl_pool_give(mc_curl_pool_t *p, CURL *c) {
  pthread_mutex_lock(p->mu);
  if (p->n_idle < MC_CURL_POOL_MAX) {
    p->idle[p->n_idle++] = c;
    c = NULL;
  }
  pthread_mutex_unlock(p->mu);
  if (c)
    curl_easy_cleanup(c);
}

void mc_curl_pool_drain(mc_curl_pool_t *p) {
  for (int i = 0; i < p->n_idle; i++)
    curl_easy_cleanup(p->idle[i]);
  p->n_idle = 0;
}

CURLcode mc_curl_setup(CURL *c, const char *url, long connect_ms, long total_ms, char *errbuf,
                       mc_curl_body_t *b, curl_off_t max_body, struct curl_slist *hdrs) {
  CURLcode sc = CURLE_OK;
#define SET(opt, val) MC_CURL_SET(sc, c, opt, val)
  SET(CURLOPT_URL, url);
  SET(CURLOPT_NOSIGNAL, 1L);
  SET(CURLOPT_CONNECTTIMEOUT_MS, connect_ms);
  SET(CURLOPT_TIMEOUT_MS, total_ms);
  SET(CURLOPT_ERRORBUFFER, errbuf);
  SET(CURLOPT_WRITEFUNCTION, mc_curl_body_write);
  SET(CURLOPT_WRITEDATA, b);
  SET(CURLOPT_MAXFILESIZE_LARGE, max_body);
  SET(CURLOPT_HTTPHEADER, hdrs);
#undef SET
  return sc;
}

size_t mc_curl_body_write(char *ptr, size_t size, size_t nmemb, void *ud) {
  mc_curl_body_t *b = ud;
  size_t n = size * nmemb;
  size_t max = b->max ? b->max : MC_META_MAX_VALUE;
  if (n > max - b->len) {
    b->too_big = 1;
    return 0;
  }
  if (b->len + n + 1 > b->cap) {
    size_t nc = b->cap ? b->cap : 4096;
    while (nc < b->len + n + 1)
      nc *= 2;
    if (nc > max + 1)
      nc = max + 1;
    char *p = realloc(b->data, nc);
    if (!p) {
      b->oom = 1;
      return 0;
    }
    b->data = p;
    b->cap = nc;
  }
  memcpy(b->data + b->len, ptr, n);
  b->len += n;
  b->data[b->len] = '\0';
  return n;
}

void mc_curl_snippet(const char *s, size_t n, char *out, size_t outlen, size_t max) {
  size_t k = 0;
  for (size_t i = 0; s && i < n && k + 1 < outlen && k < max; i++) {
    unsigned char ch = (unsigned char)s[i];
    out[k++] = isprint(ch) ? (char)ch : ' ';
  }
  while (k > 0 && out[k - 1] == ' ')
    k--;
  if (outlen)
    out[k] = '\0';
}
