/* libcurl plumbing shared by the HTTP and etcd metadata backends: one-time
 * global init, a small pool of reusable easy handles (keeps connections
 * alive), a capped response body, and printable excerpts for messages. */
#ifndef MC_META_CURL_UTIL_H
#define MC_META_CURL_UTIL_H

#include <curl/curl.h>
#include <pthread.h>
#include <stddef.h>

#define MC_CURL_POOL_MAX 4

/* curl_global_init, once per process (thread-safe). */
void mc_curl_global_init(void);

typedef struct mc_curl_pool {
  pthread_mutex_t *mu; /* the owner's lock, held only around idle[] */
  CURL *idle[MC_CURL_POOL_MAX];
  int n_idle;
} mc_curl_pool_t;

/* An idle handle (reset: options dropped, connections kept) or a new one;
 * NULL if curl cannot make one. */
CURL *mc_curl_pool_take(mc_curl_pool_t *p);
/* Back to the pool, or cleaned up when the pool is full. */
void mc_curl_pool_give(mc_curl_pool_t *p, CURL *c);
/* Cleans up every idle handle (at close; no other thread may use p). */
void mc_curl_pool_drain(mc_curl_pool_t *p);

typedef struct mc_curl_body {
  char *data; /* NUL-terminated when non-NULL; caller frees */
  size_t len, cap;
  size_t max;  /* cap on len; 0 = MC_META_MAX_VALUE */
  int too_big; /* the server sent more than max */
  int oom;
} mc_curl_body_t;

/* CURLOPT_WRITEFUNCTION for an mc_curl_body_t.  Returning less than asked
 * makes curl abort the transfer, which is how an endless or oversized body
 * is cut off early. */
size_t mc_curl_body_write(char *ptr, size_t size, size_t nmemb, void *ud);

/* curl_easy_setopt(c, opt, val) into sc, unless an earlier one failed. */
#define MC_CURL_SET(sc, c, opt, val)                                           \
  do {                                                                         \
    if ((sc) == CURLE_OK)                                                      \
      (sc) = curl_easy_setopt((c), opt, (val));                                \
  } while (0)

/* The options every metadata request sets: url, no signals (no SIGALRM
 * for DNS timeouts: we are a library), the connect and total timeouts in
 * ms, errbuf, the body sink b, max_body (a larger announced Content-Length
 * is refused before it is read) and the headers hdrs.  CURLE_OK, or the
 * first setopt failure. */
CURLcode mc_curl_setup(CURL *c, const char *url, long connect_ms, long total_ms, char *errbuf,
                       mc_curl_body_t *b, curl_off_t max_body, struct curl_slist *hdrs);

/* Up to `max` printable bytes of s[0..n) into out (others become spaces,
 * trailing spaces dropped). */
void mc_curl_snippet(const char *s, size_t n, char *out, size_t outlen, size_t max);

#endif
