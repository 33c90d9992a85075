/* Metadata answers: what an HTTP metadata server, an etcd v3 JSON gateway or
 * a Redis server sends back, read by the real clients (csrc/meta/ over
 * libcurl / hiredis) for each operation.
 *
 * A fake server thread on 127.0.0.1 answers every connection with the
 * input's bytes and closes it.  Input: byte 0 = flags (bits 0-1: backend
 * 0/3 http, 1 etcd, 2 redis; bits 2-4: operation get, put, del, put_ttl,
 * refresh), then the raw response (HTTP status line + headers + body, or
 * RESP).  Client timeouts are short (MC_METADATA_TIMEOUT_MS=300) so a
 * truncated answer costs little.
 *
 * Known dependency bug, filtered out here: Debian 12's libcurl 7.88.1 reads
 * freed memory (in its header store, headers.c) on some folded response
 * header lines (a header line starting with a space or tab); this harness
 * found it (docs/fuzzing.md).  curl >= 8.x reworked unfolding.  Our code
 * cannot avoid it, so HTTP inputs have such lines removed from the header
 * section before they are served, and fuzzing goes on to our own parsers. */
#include "fuzz_common.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include "meta/meta.h"

static int lfd;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static uint8_t *resp;
static size_t resp_len;
static mc_meta_t *clients[3];

static void serve_one(int fd) {
  char req[65536];
  struct pollfd p = {.fd = fd, .events = POLLIN};
  if (poll(&p, 1, 200) > 0 && read(fd, req, sizeof req) < 0) {
    close(fd);
    return;
  }
  pthread_mutex_lock(&mu);
  size_t off = 0;
  while (off < resp_len) {
    ssize_t n = send(fd, resp + off, resp_len - off, MSG_NOSIGNAL);
    if (n <= 0)
      break;
    off += (size_t)n;
  }
  pthread_mutex_unlock(&mu);
  shutdown(fd, SHUT_WR);
  while (poll(&p, 1, 50) > 0 && read(fd, req, sizeof req) > 0) {
  }
  close(fd);
}

static void *server_main(void *arg) {
  (void)arg;
  for (;;) {
    int fd = accept(lfd, NULL, NULL);
    if (fd >= 0)
      serve_one(fd);
  }
  return NULL;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  fuzz_quiet();
  setenv("MC_METADATA_TIMEOUT_MS", "300", 1);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t al = sizeof a;
  lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (lfd < 0 || bind(lfd, (struct sockaddr *)&a, sizeof a) < 0 || listen(lfd, 64) < 0 ||
      getsockname(lfd, (struct sockaddr *)&a, &al) < 0) {
    perror("fuzz_meta: listener");
    exit(2);
  }
  int port = ntohs(a.sin_port);
  char url[128];
  const char *fmt[3] = {"http://127.0.0.1:%d/metadata", "etcd://127.0.0.1:%d",
                        "redis://127.0.0.1:%d"};
  for (int i = 0; i < 3; i++) {
    mc_err_t err = {0};
    snprintf(url, sizeof url, fmt[i], port);
    if (mc_meta_open(url, &clients[i], &err) < 0) {
      fprintf(stderr, "fuzz_meta: %s: %s\n", url, err.msg);
      exit(2);
    }
  }
  pthread_t th;
  pthread_create(&th, NULL, server_main, NULL);
  pthread_detach(th);
  return 0;
}

/* Drops folded header lines (see above) from the header section. */
static size_t unfold_headers(uint8_t *p, size_t n) {
  size_t r = 0, w = 0;
  int line_start = 0; /* the status line never counts as folded */
  while (r < n) {
    if (line_start && (p[r] == '\r' || p[r] == '\n')) /* end of headers */
      break;
    if (line_start && (p[r] == ' ' || p[r] == '\t')) {
      while (r < n && p[r] != '\n')
        r++;
      r += r < n;
      continue;
    }
    line_start = p[r] == '\n';
    p[w++] = p[r++];
  }
  while (r < n)
    p[w++] = p[r++];
  return w;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1)
    return 0;
  int backend = data[0] & 3, op = (data[0] >> 2) & 7;
  mc_meta_t *m = clients[backend == 3 ? 0 : backend];
  pthread_mutex_lock(&mu);
  free(resp);
  resp_len = size - 1;
  resp = malloc(resp_len ? resp_len : 1);
  if (!resp)
    abort();
  memcpy(resp, data + 1, resp_len);
  if (backend != 2)
    resp_len = unfold_headers(resp, resp_len);
  pthread_mutex_unlock(&mu);
  static const char key[] = "mooncake/ram/fuzz-seg";
  static const char val[] = "{\"name\":\"fuzz-seg\"}";
  mc_err_t err = {0};
  int rc;
  char *got = NULL;
  size_t got_len = 0;
  switch (op % 5) {
  case 0:
    rc = mc_meta_get(m, key, &got, &got_len, &err);
    if (rc == 0 && (!got || got[got_len] != '\0'))
      abort(); /* documented: NUL-terminated */
    free(got);
    break;
  case 1: rc = mc_meta_put(m, key, val, sizeof val - 1, &err); break;
  case 2: rc = mc_meta_del(m, key, &err); break;
  case 3: rc = mc_meta_put_ttl(m, key, val, sizeof val - 1, 5, &err); break;
  default: rc = mc_meta_refresh(m, key, val, sizeof val - 1, 5, &err); break;
  }
  if (rc < 0 && !err.msg[0])
    abort(); /* every failure says why */
  return 0;
}
