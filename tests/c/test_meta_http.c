/* Tests for the metadata client (meta.c + meta_http.c).  Most tests run a
 * tiny raw-socket HTTP responder on 127.0.0.1 in a thread, so every odd
 * server behaviour (errors, garbage, huge bodies, silence) is reproducible
 * without a real server.  Set MC_TEST_METADATA_URL to also round-trip
 * against a real metadata server (e.g. `mooncake-metadata-server`). */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/socket.h>
#include <unistd.h>

#include "meta/meta.h"
#include "testlib.h"
#include "util/clock.h"

/* ---- raw-socket responder ---- */

enum {
  R_CANNED, /* answer every request with `head` */
  R_HANG,   /* read the request, never answer */
  R_STREAM, /* send `head`, then `stream_bytes` of body (or until the peer
               goes away) */
};

typedef struct responder {
  int mode;
  const char *head;
  size_t stream_bytes;
  int lfd;
  int port;
  int stop[2]; /* written by responder_stop to wake the thread */
  pthread_t th;
  int nconn;         /* connections served (read after join) */
  char req[8192];    /* first request, NUL-terminated, possibly truncated */
  size_t req_len;
} responder_t;

static int stop_requested(responder_t *r, int fd, short events, int ms) {
  struct pollfd p[2] = {{r->stop[0], POLLIN, 0}, {fd, events, 0}};
  int n = poll(p, fd >= 0 ? 2 : 1, ms);
  if (n < 0)
    return errno == EINTR ? 0 : 1;
  return p[0].revents != 0;
}

static int send_all(responder_t *r, int fd, const char *p, size_t n) {
  while (n > 0) {
    if (stop_requested(r, fd, POLLOUT, -1))
      return -1;
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      return -1; /* the client gave up: EPIPE / ECONNRESET */
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

/* Reads one request (headers + Content-Length body); returns -1 on EOF. */
static int read_request(responder_t *r, int fd, char *buf, size_t cap,
                        size_t *len_out) {
  size_t len = 0, need = SIZE_MAX;
  while (len < need) {
    if (stop_requested(r, fd, POLLIN, -1))
      return -1;
    char tmp[4096];
    ssize_t n = recv(fd, tmp, sizeof tmp, 0);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return -1;
    size_t keep = (size_t)n < cap - 1 - len ? (size_t)n : cap - 1 - len;
    memcpy(buf + len, tmp, keep);
    len += keep;
    buf[len] = '\0';
    char *end = strstr(buf, "\r\n\r\n");
    if (end && need == SIZE_MAX) {
      size_t hlen = (size_t)(end + 4 - buf), clen = 0;
      char *cl = strcasestr(buf, "\r\ncontent-length:");
      if (cl && cl < end)
        clen = strtoul(cl + 17, NULL, 10);
      need = hlen + clen;
      if (need > cap - 1)
        need = cap - 1;
    }
    if (keep < (size_t)n)
      break; /* buffer full: good enough for the checks */
  }
  *len_out = len;
  return 0;
}

static void serve(responder_t *r, int fd) {
  char buf[sizeof r->req];
  size_t len;
  if (read_request(r, fd, buf, sizeof buf, &len) < 0)
    return;
  if (r->nconn++ == 0) {
    memcpy(r->req, buf, len + 1);
    r->req_len = len;
  }
  switch (r->mode) {
  case R_CANNED:
    send_all(r, fd, r->head, strlen(r->head));
    break;
  case R_HANG: {
    /* Wait until the client hangs up (its timeout) or we are stopped. */
    char tmp[256];
    while (!stop_requested(r, fd, POLLIN, -1)) {
      ssize_t n = recv(fd, tmp, sizeof tmp, 0);
      if (n == 0 || (n < 0 && errno != EINTR))
        break;
    }
    break;
  }
  case R_STREAM: {
    if (send_all(r, fd, r->head, strlen(r->head)) < 0)
      break;
    static const char chunk[65536];
    size_t left = r->stream_bytes;
    while (left > 0) {
      size_t n = left < sizeof chunk ? left : sizeof chunk;
      if (send_all(r, fd, chunk, n) < 0)
        break;
      left -= n;
    }
    break;
  }
  }
}

static void *responder_main(void *arg) {
  responder_t *r = arg;
  while (!stop_requested(r, r->lfd, POLLIN, -1)) {
    int fd = accept(r->lfd, NULL, NULL);
    if (fd < 0)
      continue;
    serve(r, fd);
    close(fd);
  }
  return NULL;
}

/* Binds 127.0.0.1:0; returns the listening fd and its port. */
static int listen_any(int *port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return -1;
  struct sockaddr_in a = {.sin_family = AF_INET,
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t al = sizeof a;
  if (bind(fd, (struct sockaddr *)&a, sizeof a) < 0 || listen(fd, 64) < 0 ||
      getsockname(fd, (struct sockaddr *)&a, &al) < 0) {
    close(fd);
    return -1;
  }
  *port = ntohs(a.sin_port);
  return fd;
}

static int responder_start(responder_t *r, int mode, const char *head,
                           size_t stream_bytes) {
  memset(r, 0, sizeof *r);
  r->mode = mode;
  r->head = head;
  r->stream_bytes = stream_bytes;
  r->lfd = listen_any(&r->port);
  if (r->lfd < 0)
    return -1;
  if (pipe(r->stop) < 0) {
    close(r->lfd);
    return -1;
  }
  if (pthread_create(&r->th, NULL, responder_main, r) != 0) {
    close(r->lfd);
    close(r->stop[0]);
    close(r->stop[1]);
    return -1;
  }
  return 0;
}

static void responder_stop(responder_t *r) {
  if (write(r->stop[1], "x", 1) < 0)
    perror("responder_stop");
  pthread_join(r->th, NULL);
  close(r->lfd);
  close(r->stop[0]);
  close(r->stop[1]);
}

static void responder_url(const responder_t *r, char *buf, size_t len) {
  snprintf(buf, len, "http://127.0.0.1:%d/metadata", r->port);
}

/* Opens a client on the responder; returns 0 or the open error. */
static int open_on(const responder_t *r, mc_meta_t **m, mc_err_t *err) {
  char url[128];
  responder_url(r, url, sizeof url);
  return mc_meta_open(url, m, err);
}

static double secs_since(uint64_t t0) { return (mc_now_ns() - t0) / 1e9; }

/* One call on a client opened on a fresh responder (mode, head,
 * stream_bytes): op 'g' GETs key, 'p' PUTs value under it, 'd' DELETEs it.
 * What came back: the open's error, else the call's; the value (GET; free
 * it) and its length, both set to junk first so a call must write them; the
 * seconds open and call took; the URL; the first request the responder read. */
typedef struct call {
  int rc;
  char *val;
  size_t len;
  mc_err_t err;
  double secs;
  char url[128];
  char req[sizeof ((responder_t *)0)->req];
} call_t;

static void call_once(call_t *c, int mode, const char *head, size_t stream_bytes, char op,
                      const char *key, const char *value) {
  responder_t r;
  memset(c, 0, sizeof *c);
  c->rc = -1;
  CHECK(responder_start(&r, mode, head, stream_bytes) == 0);
  responder_url(&r, c->url, sizeof c->url);
  mc_meta_t *m = NULL;
  uint64_t t0 = mc_now_ns();
  c->rc = open_on(&r, &m, &c->err);
  if (!c->rc && op == 'g') {
    c->val = (char *)1;
    c->len = 99;
    c->rc = mc_meta_get(m, key, &c->val, &c->len, &c->err);
  } else if (!c->rc && op == 'p') {
    c->rc = mc_meta_put(m, key, value, strlen(value), &c->err);
  } else if (!c->rc) {
    c->rc = mc_meta_del(m, key, &c->err);
  }
  c->secs = secs_since(t0);
  mc_meta_close(m);
  responder_stop(&r);
  memcpy(c->req, r.req, sizeof c->req);
}

/* ---- tests against the responder ---- */

static void test_get_200_with_body(void) {
  call_t c;
  call_once(&c, R_CANNED,
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            "Content-Length: 14\r\nConnection: close\r\n\r\n"
            "{\"rpc_port\":1}",
            0, 'g', "mooncake/ram/x", NULL);
  CHECK_EQ_INT(c.rc, 0);
  CHECK_EQ_INT(c.len, 14);
  CHECK(strcmp(c.val, "{\"rpc_port\":1}") == 0);
  CHECK_CONTAINS(c.req, "GET /metadata?key=mooncake%2Fram%2Fx HTTP/1.1\r\n");
  free(c.val);
}

static void test_get_200_empty_body(void) {
  call_t c;
  call_once(&c, R_CANNED,
            "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n"
            "Connection: close\r\n\r\n",
            0, 'g', "k", NULL);
  CHECK_EQ_INT(c.rc, 0);
  CHECK(c.val != NULL);
  CHECK_EQ_INT(c.len, 0);
  CHECK(c.val[0] == '\0');
  free(c.val);
}

static void test_get_404_not_found(void) {
  call_t c;
  call_once(&c, R_CANNED,
            "HTTP/1.1 404 Not Found\r\nContent-Length: 22\r\n"
            "Connection: close\r\n\r\nmetadata not found....",
            0, 'g', "mooncake/ram/gone", NULL);
  CHECK_EQ_INT(c.rc, MC_ENOTFOUND);
  CHECK(c.val == NULL);
  CHECK_EQ_INT(c.len, 0);
  CHECK_CONTAINS(c.err.msg, "mooncake/ram/gone");
  CHECK_CONTAINS(c.err.msg, "/metadata");
}

static void test_get_500_names_status(void) {
  call_t c;
  call_once(&c, R_CANNED,
            "HTTP/1.1 500 Internal Server Error\r\n"
            "Content-Length: 12\r\nConnection: close\r\n\r\n"
            "boom\x01\nstack\n",
            0, 'g', "mooncake/ram/x", NULL);
  CHECK_EQ_INT(c.rc, MC_EMETADATA);
  CHECK(c.val == NULL);
  CHECK_CONTAINS(c.err.msg, "HTTP 500");
  CHECK_CONTAINS(c.err.msg, c.url);
  CHECK_CONTAINS(c.err.msg, "\"mooncake/ram/x\"");
  CHECK_CONTAINS(c.err.msg, "boom  stack"); /* control bytes made printable */
  CHECK(!strchr(c.err.msg, '\n'));
}

static void test_put_sends_json_body(void) {
  const char *v = "{\"ip_or_host_name\":\"10.0.0.1\",\"rpc_port\":16012}";
  call_t c;
  call_once(&c, R_CANNED,
            "HTTP/1.1 200 OK\r\nContent-Length: 16\r\n"
            "Connection: close\r\n\r\nmetadata updated",
            0, 'p', "mooncake/rpc_meta/10.0.0.1:15123", v);
  CHECK_EQ_INT(c.rc, 0);
  CHECK_CONTAINS(c.req,
                 "PUT /metadata?key=mooncake%2Frpc_meta%2F10.0.0.1%3A15123 ");
  CHECK(strcasestr(c.req, "\r\ncontent-type: application/json\r\n") != NULL);
  CHECK(strstr(c.req, "\r\n\r\n") != NULL);
  CHECK(strcmp(strstr(c.req, "\r\n\r\n") + 4, v) == 0);
  CHECK(!strcasestr(c.req, "expect:"));
}

static void test_put_non_200_is_error(void) {
  call_t c;
  call_once(&c, R_CANNED,
            "HTTP/1.1 400 Bad Request\r\nContent-Length: 23\r\n"
            "Connection: close\r\n\r\nduplicate rpc_meta key!",
            0, 'p', "mooncake/rpc_meta/a", "{}");
  CHECK_EQ_INT(c.rc, MC_EMETADATA);
  CHECK_CONTAINS(c.err.msg, "HTTP 400 to PUT");
  CHECK_CONTAINS(c.err.msg, "duplicate rpc_meta key!");
}

/* Mooncake's own metadata server refuses a second PUT of a rpc_meta key
 * (400 "Duplicate rpc_meta key not allowed"): a keep-alive takes that as
 * "still there"; after it, keep-alives of rpc_meta keys check with a GET. */
static void test_refresh_tolerates_mooncakes_duplicate_refusal(void) {
  responder_t r;
  CHECK(responder_start(&r, R_CANNED,
                        "HTTP/1.1 400 Bad Request\r\nContent-Length: 34\r\n"
                        "Connection: close\r\n\r\nDuplicate rpc_meta key not allowed",
                        0) == 0);
  mc_meta_t *m = NULL;
  mc_err_t err = {0};
  int rc = open_on(&r, &m, &err), rc2 = -1, rc3 = -1;
  if (!rc) {
    rc = mc_meta_refresh(m, "mooncake/rpc_meta/a", "{}", 2, 5, &err);
    /* Now a GET, which this canned server answers 400 as well. */
    rc2 = mc_meta_refresh(m, "mooncake/rpc_meta/a", "{}", 2, 5, &err);
    mc_err_t e3 = {0};
    /* Other keys: a refused PUT stays an error. */
    rc3 = mc_meta_refresh(m, "mooncake/ram/a", "{}", 2, 5, &e3);
  }
  mc_meta_close(m);
  responder_stop(&r);
  CHECK_EQ_INT(rc, 0);
  CHECK_EQ_INT(rc2, MC_EMETADATA);
  CHECK_CONTAINS(err.msg, "HTTP 400 to GET");
  CHECK_EQ_INT(rc3, MC_EMETADATA);
}

static void test_delete_200_404_ok_500_error(void) {
  static const char *heads[3] = {
      "HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
      "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
      "HTTP/1.1 503 Busy\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
  };
  static const int want[3] = {0, 0, MC_EMETADATA};
  for (int i = 0; i < 3; i++) {
    call_t c;
    call_once(&c, R_CANNED, heads[i], 0, 'd', "mooncake/ram/d", NULL);
    CHECK_EQ_INT(c.rc, want[i]);
    CHECK_CONTAINS(c.req, "DELETE /metadata?key=mooncake%2Fram%2Fd ");
    if (c.rc)
      CHECK_CONTAINS(c.err.msg, "HTTP 503 to DELETE");
  }
}

static void test_garbage_is_error(void) {
  static const char *heads[3] = {
      "\x01\x02\x03 this is not HTTP at all \xff\xfe\r\n\r\n",
      "HTTP/1.1 abc\r\n\r\n",
      "", /* accept, read, close without a byte */
  };
  for (int i = 0; i < 3; i++) {
    call_t c;
    call_once(&c, R_CANNED, heads[i], 0, 'g', "k", NULL);
    CHECK_EQ_INT(c.rc, MC_EMETADATA);
    CHECK(c.val == NULL);
    CHECK_CONTAINS(c.err.msg, "metadata server http://127.0.0.1:");
    CHECK_CONTAINS(c.err.msg, "\"k\"");
  }
}

/* 32 MiB announced with Content-Length: refused once the headers arrive. */
static void test_oversized_with_length(void) {
  call_t c;
  call_once(&c, R_STREAM,
            "HTTP/1.1 200 OK\r\nContent-Length: 33554432\r\n"
            "Connection: close\r\n\r\n",
            (size_t)32 << 20, 'g', "big", NULL);
  CHECK_EQ_INT(c.rc, MC_ETOOBIG);
  CHECK(c.val == NULL);
  CHECK_CONTAINS(c.err.msg, "larger than 16 MiB");
  CHECK_CONTAINS(c.err.msg, "\"big\"");
  CHECK(c.secs < 2.0);
}

/* No Content-Length: the body streams until close; cut off at the cap. */
static void test_oversized_streamed(void) {
  call_t c;
  call_once(&c, R_STREAM, "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n",
            (size_t)64 << 20, 'g', "big", NULL);
  CHECK_EQ_INT(c.rc, MC_ETOOBIG);
  CHECK(c.val == NULL);
  CHECK_CONTAINS(c.err.msg, "larger than 16 MiB");
  CHECK(c.secs < 2.0);
}

static void test_silent_server_times_out(void) {
  call_t c;
  call_once(&c, R_HANG, NULL, 0, 'g', "mooncake/ram/slow", NULL);
  CHECK_EQ_INT(c.rc, MC_EMETADATA);
  CHECK_CONTAINS(c.err.msg, "did not answer GET key \"mooncake/ram/slow\"");
  CHECK_CONTAINS(c.err.msg, "within 500 ms");
  CHECK(c.secs >= 0.4);
  CHECK(c.secs < 3.5);
}

static void test_connection_refused(void) {
  int port;
  int fd = listen_any(&port); /* reserve a port, then free it */
  CHECK(fd >= 0);
  close(fd);
  char url[128];
  snprintf(url, sizeof url, "http://127.0.0.1:%d/metadata", port);
  mc_meta_t *m = NULL;
  mc_err_t err = {0};
  char *val = NULL;
  size_t len;
  uint64_t t0 = mc_now_ns();
  int rc = mc_meta_open(url, &m, &err);
  CHECK_EQ_INT(rc, 0);
  rc = mc_meta_get(m, "mooncake/ram/x", &val, &len, &err);
  int prc = mc_meta_put(m, "mooncake/ram/x", "{}", 2, &err);
  double dt = secs_since(t0);
  mc_meta_close(m);
  CHECK_EQ_INT(rc, MC_EMETADATA);
  CHECK_EQ_INT(prc, MC_EMETADATA);
  char want[256];
  snprintf(want, sizeof want,
           "metadata server %s unreachable while PUT key \"mooncake/ram/x\": ",
           url);
  CHECK_CONTAINS(err.msg, want);
  CHECK_CONTAINS(err.msg, "Couldn't connect to server");
  CHECK(dt < 2.0);
}

static void test_key_is_escaped(void) {
  call_t c;
  call_once(&c, R_CANNED,
            "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n"
            "Connection: close\r\n\r\n{}",
            0, 'g', "mooncake/ram/a b/c&d=e?f%", NULL);
  CHECK_EQ_INT(c.rc, 0);
  free(c.val);
  CHECK_CONTAINS(c.req,
                 "GET /metadata?key=mooncake%2Fram%2Fa%20b%2Fc%26d%3De%3Ff%25 "
                 "HTTP/1.1\r\n");
}

/* A URL that already has a query string gets "&key=". */
static void test_url_with_query(void) {
  responder_t r;
  CHECK(responder_start(&r, R_CANNED,
                        "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n"
                        "Connection: close\r\n\r\n{}",
                        0) == 0);
  char url[128];
  snprintf(url, sizeof url, "http://127.0.0.1:%d/md?ns=1", r.port);
  mc_meta_t *m = NULL;
  mc_err_t err = {0};
  int rc = mc_meta_open(url, &m, &err);
  if (!rc)
    rc = mc_meta_put(m, "x", "{}", 2, &err);
  mc_meta_close(m);
  responder_stop(&r);
  CHECK_EQ_INT(rc, 0);
  CHECK_CONTAINS(r.req, "PUT /md?ns=1&key=x HTTP/1.1\r\n");
}

typedef struct {
  mc_meta_t *m;
  int fails;
} worker_t;

static void *worker_main(void *arg) {
  worker_t *w = arg;
  for (int i = 0; i < 10; i++) {
    mc_err_t err = {0};
    char *val = NULL;
    size_t len;
    if (mc_meta_get(w->m, "mooncake/ram/shared", &val, &len, &err) != 0 ||
        len != 2)
      w->fails++;
    free(val);
  }
  return NULL;
}

/* One client used by several threads at once (the handle pool). */
static void test_concurrent_use(void) {
  responder_t r;
  CHECK(responder_start(&r, R_CANNED,
                        "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n"
                        "Connection: close\r\n\r\n{}",
                        0) == 0);
  mc_meta_t *m = NULL;
  mc_err_t err = {0};
  int rc = open_on(&r, &m, &err);
  worker_t w[8] = {{0}};
  pthread_t th[8];
  int started = 0;
  for (int i = 0; !rc && i < 8; i++, started++) {
    w[i].m = m;
    if (pthread_create(&th[i], NULL, worker_main, &w[i]) != 0)
      break;
  }
  int fails = 0;
  for (int i = 0; i < started; i++) {
    pthread_join(th[i], NULL);
    fails += w[i].fails;
  }
  mc_meta_close(m);
  responder_stop(&r);
  CHECK_EQ_INT(rc, 0);
  CHECK_EQ_INT(started, 8);
  CHECK_EQ_INT(fails, 0);
  CHECK_EQ_INT(r.nconn, 80);
}

/* ---- argument validation and open() ---- */

static void test_bad_args(void) {
  responder_t r;
  CHECK(responder_start(&r, R_CANNED, "", 0) == 0);
  mc_meta_t *m = NULL;
  mc_err_t err = {0};
  char *val = (char *)1;
  size_t len;
  int orc = open_on(&r, &m, &err);
  int r1 = mc_meta_get(m, NULL, &val, &len, &err);
  char *v1 = val;
  int r2 = mc_meta_get(m, "", &val, &len, &err);
  int r3 = mc_meta_put(m, "", "{}", 2, &err);
  int r4 = mc_meta_del(m, NULL, &err);
  int r5 = mc_meta_put(m, "k", NULL, 3, &err);
  int r6 = mc_meta_get(NULL, "k", &val, &len, &err);
  int r7 = mc_meta_get(m, "k", NULL, &len, &err);
  mc_meta_close(m);
  mc_meta_close(NULL);
  responder_stop(&r);
  CHECK_EQ_INT(orc, 0);
  CHECK_EQ_INT(r1, MC_EINVAL);
  CHECK(v1 == NULL);
  CHECK_EQ_INT(r2, MC_EINVAL);
  CHECK_EQ_INT(r3, MC_EINVAL);
  CHECK_EQ_INT(r4, MC_EINVAL);
  CHECK_EQ_INT(r5, MC_EINVAL);
  CHECK_EQ_INT(r6, MC_EINVAL);
  CHECK_EQ_INT(r7, MC_EINVAL);
  CHECK_EQ_INT(r.nconn, 0); /* nothing reached the wire */
}

static void test_open_schemes(void) {
  mc_meta_t *m = (mc_meta_t *)1;
  mc_err_t err = {0};

  /* etcd and Redis open without network (tests/c/test_meta_backends.c runs
   * them against real servers). */
  CHECK_EQ_INT(mc_meta_open("etcd://10.0.0.1:2379", &m, &err), 0);
  CHECK(strcmp(m->ops->name, "etcd") == 0);
  mc_meta_close(m);
  CHECK_EQ_INT(mc_meta_open("10.0.0.1:2379,10.0.0.2:2379", &m, &err), 0);
  CHECK(strcmp(m->ops->name, "etcd") == 0);
  mc_meta_close(m);
  CHECK_EQ_INT(mc_meta_open("redis://:pw@h:6379/2", &m, &err), 0);
  CHECK(strcmp(m->ops->name, "redis") == 0);
  CHECK(strstr(m->url, "pw") == NULL); /* masked in messages */
  mc_meta_close(m);

  CHECK_EQ_INT(mc_meta_open("P2PHANDSHAKE", &m, &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "P2P mode");

  CHECK_EQ_INT(mc_meta_open("ftp://h/x", &m, &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "unknown scheme \"ftp\"");

  CHECK_EQ_INT(mc_meta_open("", &m, &err), MC_EINVAL);
  CHECK_EQ_INT(mc_meta_open(NULL, &m, &err), MC_EINVAL);
  CHECK_EQ_INT(mc_meta_open("http://h/x", NULL, &err), MC_EINVAL);

  CHECK_EQ_INT(mc_meta_open("http://", &m, &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "is not valid");

  char longurl[1100];
  memset(longurl, 'a', sizeof longurl - 1);
  memcpy(longurl, "http://", 7);
  longurl[sizeof longurl - 1] = '\0';
  CHECK_EQ_INT(mc_meta_open(longurl, &m, &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "longer than");

  /* http/https open lazily: no connection is made here. */
  CHECK_EQ_INT(mc_meta_open("HTTPS://meta.example:443/metadata", &m, &err), 0);
  CHECK(m != NULL);
  CHECK(strcmp(m->ops->name, "http") == 0);
  CHECK(strcmp(m->url, "HTTPS://meta.example:443/metadata") == 0);
  mc_meta_close(m);
}

static void test_timeout_env(void) {
  mc_meta_t *m = NULL;
  mc_err_t err = {0};
  setenv("MC_METADATA_TIMEOUT_MS", "abc", 1);
  int r1 = mc_meta_open("http://127.0.0.1:1/metadata", &m, &err);
  setenv("MC_METADATA_TIMEOUT_MS", "0", 1);
  int r2 = mc_meta_open("http://127.0.0.1:1/metadata", &m, &err);
  setenv("MC_METADATA_TIMEOUT_MS", "500", 1);
  CHECK_EQ_INT(r1, MC_ECONFIG);
  CHECK_EQ_INT(r2, MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "MC_METADATA_TIMEOUT_MS=\"0\"");
}

/* ---- key layout ---- */

static void test_key_layout(void) {
  char buf[128];
  unsetenv("MC_METADATA_CLUSTER_ID");
  CHECK_EQ_INT(mc_meta_key_segment("10.0.0.1:15123", buf, sizeof buf), 0);
  CHECK(strcmp(buf, "mooncake/ram/10.0.0.1:15123") == 0);
  CHECK_EQ_INT(mc_meta_key_rpc("10.0.0.1:15123", buf, sizeof buf), 0);
  CHECK(strcmp(buf, "mooncake/rpc_meta/10.0.0.1:15123") == 0);
  /* Names with a namespace keep it instead of "ram/" (Mooncake's rule). */
  CHECK_EQ_INT(mc_meta_key_segment("nvmeof/n1", buf, sizeof buf), 0);
  CHECK(strcmp(buf, "mooncake/nvmeof/n1") == 0);

  setenv("MC_METADATA_CLUSTER_ID", "prod-1", 1);
  CHECK_EQ_INT(mc_meta_key_segment("s", buf, sizeof buf), 0);
  CHECK(strcmp(buf, "mooncake/prod-1/ram/s") == 0);
  CHECK_EQ_INT(mc_meta_key_rpc("s", buf, sizeof buf), 0);
  CHECK(strcmp(buf, "mooncake/prod-1/rpc_meta/s") == 0);
  setenv("MC_METADATA_CLUSTER_ID", "prod-2/", 1);
  CHECK_EQ_INT(mc_meta_key_rpc("s", buf, sizeof buf), 0);
  CHECK(strcmp(buf, "mooncake/prod-2/rpc_meta/s") == 0);
  setenv("MC_METADATA_CLUSTER_ID", "", 1);
  CHECK_EQ_INT(mc_meta_key_rpc("s", buf, sizeof buf), 0);
  CHECK(strcmp(buf, "mooncake/rpc_meta/s") == 0);
  unsetenv("MC_METADATA_CLUSTER_ID");

  /* Exactly fitting vs one byte short. */
  const char *want = "mooncake/ram/abc"; /* 16 chars + NUL */
  CHECK_EQ_INT(mc_meta_key_segment("abc", buf, 17), 0);
  CHECK(strcmp(buf, want) == 0);
  CHECK_EQ_INT(mc_meta_key_segment("abc", buf, 16), MC_ETOOBIG);
  CHECK(buf[0] == '\0');
  CHECK_EQ_INT(mc_meta_key_rpc("abc", buf, 0), MC_EINVAL);
  CHECK_EQ_INT(mc_meta_key_rpc("", buf, sizeof buf), MC_EINVAL);
  CHECK_EQ_INT(mc_meta_key_rpc(NULL, buf, sizeof buf), MC_EINVAL);
  CHECK_EQ_INT(mc_meta_key_segment("x", NULL, 10), MC_EINVAL);
}

/* ---- optional: a real server ---- */

static void test_real_server_round_trip(void) {
  const char *url = getenv("MC_TEST_METADATA_URL");
  if (!url || !*url) {
    fprintf(stderr, "  note: MC_TEST_METADATA_URL not set; skipping the "
                    "round trip against a real metadata server\n");
    return;
  }
  mc_meta_t *m = NULL;
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_meta_open(url, &m, &err), 0);
  char key[128];
  snprintf(key, sizeof key, "mooncake/ram/c-test %d/x:y", (int)getpid());
  const char *v = "{\"name\":\"c-test\",\"buffers\":[]}";
  int rp = mc_meta_put(m, key, v, strlen(v), &err);
  char *got = NULL;
  size_t len = 0;
  int rg = rp ? rp : mc_meta_get(m, key, &got, &len, &err);
  int same = got && len == strlen(v) && memcmp(got, v, len) == 0;
  free(got);
  got = NULL;

  /* A 1 MiB value (keep-alive connection reuse, larger bodies). */
  size_t big_len = (size_t)1 << 20;
  char *big = malloc(big_len);
  int rb = MC_ENOMEM, rbg = MC_ENOMEM, big_same = 0;
  if (big) {
    memset(big, 'x', big_len);
    big[0] = '"';
    big[big_len - 1] = '"';
    rb = mc_meta_put(m, key, big, big_len, &err);
    rbg = rb ? rb : mc_meta_get(m, key, &got, &len, &err);
    big_same = got && len == big_len && memcmp(got, big, len) == 0;
    free(got);
    got = NULL;
    free(big);
  }
  int rd = mc_meta_del(m, key, &err);
  int rd2 = mc_meta_del(m, key, &err); /* already gone: still fine */
  int rg2 = mc_meta_get(m, key, &got, &len, &err);
  mc_meta_close(m);
  CHECK_EQ_INT(rp, 0);
  CHECK_EQ_INT(rg, 0);
  CHECK(same);
  CHECK_EQ_INT(rb, 0);
  CHECK_EQ_INT(rbg, 0);
  CHECK(big_same);
  CHECK_EQ_INT(rd, 0);
  CHECK_EQ_INT(rd2, 0);
  CHECK_EQ_INT(rg2, MC_ENOTFOUND);
  CHECK(got == NULL);
}

int main(void) {
  /* Keep the silent-server test short; read at every open. */
  setenv("MC_METADATA_TIMEOUT_MS", "500", 1);
  /* A proxy from the environment would swallow 127.0.0.1 requests. */
  setenv("no_proxy", "127.0.0.1,localhost", 1);
  RUN(test_get_200_with_body);
  RUN(test_get_200_empty_body);
  RUN(test_get_404_not_found);
  RUN(test_get_500_names_status);
  RUN(test_put_sends_json_body);
  RUN(test_put_non_200_is_error);
  RUN(test_refresh_tolerates_mooncakes_duplicate_refusal);
  RUN(test_delete_200_404_ok_500_error);
  RUN(test_garbage_is_error);
  RUN(test_oversized_with_length);
  RUN(test_oversized_streamed);
  RUN(test_silent_server_times_out);
  RUN(test_connection_refused);
  RUN(test_key_is_escaped);
  RUN(test_url_with_query);
  RUN(test_concurrent_use);
  RUN(test_bad_args);
  RUN(test_open_schemes);
  RUN(test_timeout_env);
  RUN(test_key_layout);
  RUN(test_real_server_round_trip);
  TEST_MAIN_END();
}
