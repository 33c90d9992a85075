/* Tests for the etcd and Redis metadata backends against real servers
 * (Debian etcd-server / redis-server), started here on free loopback ports
 * with temporary data directories.  A backend whose binary is missing is
 * skipped with a printed reason. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "meta/meta.h"
#include "testlib.h"

#define REDIS_PW "c-test-pw"

static char tmpdir[256];

static int free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t al = sizeof a;
  int port = -1;
  if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
      getsockname(fd, (struct sockaddr *)&a, &al) == 0)
    port = ntohs(a.sin_port);
  if (fd >= 0)
    close(fd);
  return port;
}

static int on_path(const char *bin) {
  const char *path = getenv("PATH");
  char buf[1024];
  for (const char *p = path; p && *p;) {
    const char *c = strchr(p, ':');
    size_t n = c ? (size_t)(c - p) : strlen(p);
    snprintf(buf, sizeof buf, "%.*s/%s", (int)n, p, bin);
    if (access(buf, X_OK) == 0)
      return 1;
    if (!c)
      break;
    p = c + 1;
  }
  return 0;
}

static pid_t spawn(char *const argv[], const char *logname) {
  pid_t pid = fork();
  if (pid == 0) {
    char log[512];
    snprintf(log, sizeof log, "%s/%s", tmpdir, logname);
    if (!freopen(log, "w", stdout) || !freopen(log, "w", stderr))
      _exit(126);
    execvp(argv[0], argv);
    _exit(127);
  }
  return pid;
}

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Polls until a GET answers (found or not found), up to 15 s. */
static int wait_ready(mc_meta_t *m) {
  for (int i = 0; i < 300; i++) {
    mc_err_t err = {0};
    char *v = NULL;
    int rc = mc_meta_get(m, "ready-probe", &v, NULL, &err);
    free(v);
    if (rc == 0 || rc == MC_ENOTFOUND)
      return 0;
    sleep_ms(50);
  }
  return -1;
}

typedef struct server {
  const char *kind;
  pid_t pid;
  char url[256];
} server_t;

static int start_etcd(server_t *s) {
  int port = free_port(), peer = free_port();
  char data[300], client[64], peers[64], cluster[96];
  snprintf(data, sizeof data, "%s/etcd-data", tmpdir);
  snprintf(client, sizeof client, "http://127.0.0.1:%d", port);
  snprintf(peers, sizeof peers, "http://127.0.0.1:%d", peer);
  snprintf(cluster, sizeof cluster, "ctest=%s", peers);
  char *argv[] = {"etcd", "--name", "ctest", "--data-dir", data,
                  "--listen-client-urls", client, "--advertise-client-urls", client,
                  "--listen-peer-urls", peers, "--initial-advertise-peer-urls", peers,
                  "--initial-cluster", cluster, NULL};
  s->kind = "etcd";
  s->pid = spawn(argv, "etcd.log");
  snprintf(s->url, sizeof s->url, "etcd://127.0.0.1:%d", port);
  return s->pid > 0 ? 0 : -1;
}

static int start_redis(server_t *s) {
  int port = free_port();
  char ports[16];
  snprintf(ports, sizeof ports, "%d", port);
  char *argv[] = {"redis-server", "--port", ports, "--bind", "127.0.0.1", "--save", "",
                  "--appendonly", "no", "--dir", tmpdir, "--requirepass", REDIS_PW, NULL};
  s->kind = "redis";
  s->pid = spawn(argv, "redis.log");
  snprintf(s->url, sizeof s->url, "redis://:" REDIS_PW "@127.0.0.1:%d/1", port);
  return s->pid > 0 ? 0 : -1;
}

static void stop_server(server_t *s) {
  if (s->pid > 0) {
    kill(s->pid, SIGKILL);
    waitpid(s->pid, NULL, 0);
    s->pid = 0;
  }
}

static server_t *cur; /* the server the current tests run against */

static mc_meta_t *open_cur(void) {
  mc_meta_t *m = NULL;
  mc_err_t err = {0};
  if (mc_meta_open(cur->url, &m, &err) < 0)
    fprintf(stderr, "  open %s: %s\n", cur->url, err.msg);
  return m;
}

/* ---- tests run against each server ---- */

static void test_roundtrip(void) {
  mc_meta_t *m = open_cur();
  CHECK(m);
  mc_err_t err = {0};
  const char *val = "{\"name\":\"x\",\"text\":\"line\\nquote\\\" \\u00e9\"}";
  const char *key = "mooncake/ram/10.0.0.1:1234";
  CHECK_EQ_INT(mc_meta_put(m, key, val, strlen(val), &err), 0);
  char *got = NULL;
  size_t len = 0;
  CHECK_EQ_INT(mc_meta_get(m, key, &got, &len, &err), 0);
  int same = len == strlen(val) && memcmp(got, val, len) == 0;
  free(got);
  CHECK(same);
  CHECK_EQ_INT(mc_meta_del(m, key, &err), 0);
  CHECK_EQ_INT(mc_meta_get(m, key, &got, &len, &err), MC_ENOTFOUND);
  CHECK_CONTAINS(err.msg, key);
  CHECK_EQ_INT(mc_meta_del(m, key, &err), 0); /* deleting a missing key is fine */
  /* An empty value round-trips. */
  CHECK_EQ_INT(mc_meta_put(m, "empty", "", 0, &err), 0);
  CHECK_EQ_INT(mc_meta_get(m, "empty", &got, &len, &err), 0);
  CHECK_EQ_INT(len, 0);
  free(got);
  mc_meta_del(m, "empty", &err);
  mc_meta_close(m);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void test_ttl_expires_and_refresh(void) {
  mc_meta_t *m = open_cur();
  CHECK(m);
  mc_err_t err = {0};
  char *got = NULL;
  const int ttl_a = 2, ttl_b = 6;
  CHECK_EQ_INT(mc_meta_put_ttl(m, "ttl/a", "1", 1, ttl_a, &err), 0);
  /* Entries of one client with the same TTL may share a lifetime (etcd: one
   * lease per TTL), so b uses another TTL. */
  CHECK_EQ_INT(mc_meta_put_ttl(m, "ttl/b", "2", 1, ttl_b, &err), 0);
  CHECK_EQ_INT(mc_meta_get(m, "ttl/a", &got, NULL, &err), 0);
  free(got);
  /* Refresh b every 0.5 s; a is left alone and must expire. Driven by the
   * clock, not by a count of sleeps: a loaded CI host may stall for seconds,
   * and the servers expire entries late by up to their sweep interval. a must
   * be gone within 12 s; b must be there as long as no gap between two
   * refreshes came near its TTL (a longer gap would expire it rightly). */
  double t0 = now_s(), last = t0, max_gap = 0;
  int a_gone = 0;
  while (!a_gone && now_s() - t0 < 12.0) {
    sleep_ms(500);
    double t = now_s();
    if (t - last > max_gap)
      max_gap = t - last;
    last = t;
    CHECK_EQ_INT(mc_meta_refresh(m, "ttl/b", "2", 1, ttl_b, &err), 0);
    if (mc_meta_get(m, "ttl/a", &got, NULL, &err) == MC_ENOTFOUND)
      a_gone = 1;
    else
      free(got);
  }
  CHECK(a_gone);
  /* a must have lived about its TTL, not vanished at once. */
  CHECK(now_s() - t0 >= ttl_a - 1.0);
  if (max_gap < ttl_b - 2.0) {
    CHECK_EQ_INT(mc_meta_get(m, "ttl/b", &got, NULL, &err), 0);
    free(got);
  } else {
    fprintf(stderr, "note: host stalled %.1f s between refreshes; b's presence not checked\n",
            max_gap);
  }
  /* The server lost b: refresh says so and writes it again. */
  CHECK_EQ_INT(mc_meta_del(m, "ttl/b", &err), 0);
  CHECK_EQ_INT(mc_meta_refresh(m, "ttl/b", "2", 1, ttl_b, &err), 1);
  size_t len = 0;
  CHECK_EQ_INT(mc_meta_get(m, "ttl/b", &got, &len, &err), 0);
  int ok = len == 1 && got[0] == '2';
  free(got);
  CHECK(ok);
  CHECK_EQ_INT(mc_meta_put_ttl(m, "ttl/c", "3", 1, -1, &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "TTL");
  mc_meta_del(m, "ttl/b", &err);
  mc_meta_close(m);
}

typedef struct worker {
  mc_meta_t *m;
  int id, failures;
} worker_t;

static void *work(void *arg) {
  worker_t *w = arg;
  for (int i = 0; i < 40; i++) {
    char key[64], val[64];
    snprintf(key, sizeof key, "thr/%d/%d", w->id, i);
    snprintf(val, sizeof val, "\"%d-%d\"", w->id, i);
    mc_err_t err = {0};
    char *got = NULL;
    size_t len = 0;
    if (mc_meta_put(w->m, key, val, strlen(val), &err) < 0 ||
        mc_meta_get(w->m, key, &got, &len, &err) < 0 || len != strlen(val) ||
        memcmp(got, val, len) != 0 || mc_meta_del(w->m, key, &err) < 0)
      w->failures++;
    free(got);
  }
  return NULL;
}

static void test_threads_share_client(void) {
  mc_meta_t *m = open_cur();
  CHECK(m);
  pthread_t th[6];
  worker_t w[6];
  for (int i = 0; i < 6; i++) {
    w[i] = (worker_t){.m = m, .id = i};
    pthread_create(&th[i], NULL, work, &w[i]);
  }
  int fails = 0;
  for (int i = 0; i < 6; i++) {
    pthread_join(th[i], NULL);
    fails += w[i].failures;
  }
  mc_meta_close(m);
  CHECK_EQ_INT(fails, 0);
}

/* ---- backend-specific tests ---- */

static server_t etcd_srv, redis_srv;

static void test_etcd_failover(void) {
  int dead = free_port();
  const char *port = strrchr(etcd_srv.url, ':') + 1;
  char conn[128];
  snprintf(conn, sizeof conn, "127.0.0.1:%d,127.0.0.1:%s", dead, port); /* bare form */
  mc_meta_t *m = NULL;
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_meta_open(conn, &m, &err), 0);
  CHECK_EQ_INT(mc_meta_put(m, "fo", "1", 1, &err), 0);
  char *got = NULL;
  CHECK_EQ_INT(mc_meta_get(m, "fo", &got, NULL, &err), 0);
  free(got);
  mc_meta_close(m);
  snprintf(conn, sizeof conn, "etcd://127.0.0.1:%d,127.0.0.1:%d", dead, free_port());
  CHECK_EQ_INT(mc_meta_open(conn, &m, &err), 0);
  CHECK_EQ_INT(mc_meta_get(m, "fo", &got, NULL, &err), MC_EMETADATA);
  mc_meta_close(m);
  CHECK_CONTAINS(err.msg, "all 2 endpoints failed");
  CHECK_CONTAINS(err.msg, "\"fo\"");
}

static void test_redis_auth(void) {
  const char *hp = strrchr(redis_srv.url, '@') + 1;
  char conn[160];
  mc_meta_t *m = NULL;
  mc_err_t err = {0};
  char *got = NULL;
  snprintf(conn, sizeof conn, "redis://:wrong@%s", hp);
  CHECK_EQ_INT(mc_meta_open(conn, &m, &err), 0);
  CHECK_EQ_INT(mc_meta_get(m, "k", &got, NULL, &err), MC_EMETADATA);
  mc_meta_close(m);
  CHECK_CONTAINS(err.msg, "AUTH");
  CHECK_CONTAINS(err.msg, ":***@");
  CHECK(strstr(err.msg, "wrong") == NULL); /* the password is never shown */
  snprintf(conn, sizeof conn, "redis://%s", hp);
  CHECK_EQ_INT(mc_meta_open(conn, &m, &err), 0);
  CHECK_EQ_INT(mc_meta_get(m, "k", &got, NULL, &err), MC_EMETADATA);
  mc_meta_close(m);
  CHECK_CONTAINS(err.msg, "NOAUTH");
}

/* A stale pooled connection (server killed and restarted) is replaced. */
static void test_redis_reconnect(void) {
  mc_meta_t *m = NULL;
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_meta_open(redis_srv.url, &m, &err), 0);
  CHECK_EQ_INT(mc_meta_put(m, "rc", "1", 1, &err), 0);
  char url[256];
  snprintf(url, sizeof url, "%s", redis_srv.url);
  stop_server(&redis_srv);
  CHECK_EQ_INT(mc_meta_put(m, "rc", "1", 1, &err), MC_EMETADATA);
  CHECK_CONTAINS(err.msg, "\"rc\"");
  /* Restart on the same port. */
  int port = atoi(strrchr(url, ':') + 1);
  char ports[16];
  snprintf(ports, sizeof ports, "%d", port);
  char *argv[] = {"redis-server", "--port", ports, "--bind", "127.0.0.1", "--save", "",
                  "--appendonly", "no", "--dir", tmpdir, "--requirepass", REDIS_PW, NULL};
  redis_srv.pid = spawn(argv, "redis2.log");
  CHECK_EQ_INT(wait_ready(m), 0);
  char *got = NULL;
  CHECK_EQ_INT(mc_meta_get(m, "rc", &got, NULL, &err), MC_ENOTFOUND); /* data lost */
  mc_meta_close(m);
}

static void test_bad_urls(void) {
  static const struct {
    const char *url, *needle;
  } cases[] = {
      {"etcd://", "no endpoint"},
      {"etcd://h", "not host:port"},
      {"etcd://a:1,,b:2", "empty endpoint"},
      {"a:1,b", "not host:port"},
      {"redis://h", "not host:port"},
      {"redis://:@h:1", "empty password"},
      {"redis://h:1/x", "not a number"},
      {"gopher://h:1", "unknown scheme"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    mc_meta_t *m = NULL;
    mc_err_t err = {0};
    CHECK_EQ_INT(mc_meta_open(cases[i].url, &m, &err), MC_EINVAL);
    CHECK(m == NULL);
    CHECK_CONTAINS(err.msg, cases[i].needle);
  }
}

static void run_common(server_t *s) {
  cur = s;
  fprintf(stderr, "-- %s at %s\n", s->kind, s->url);
  RUN(test_roundtrip);
  RUN(test_ttl_expires_and_refresh);
  RUN(test_threads_share_client);
}

int main(void) {
  snprintf(tmpdir, sizeof tmpdir, "/tmp/mc-meta-backends-XXXXXX");
  if (!mkdtemp(tmpdir)) {
    perror("mkdtemp");
    return 1;
  }
  RUN(test_bad_urls);
  if (!on_path("etcd")) {
    fprintf(stderr, "skip etcd tests: no `etcd` on PATH (Debian package etcd-server)\n");
  } else if (start_etcd(&etcd_srv) == 0) {
    mc_meta_t *m = NULL;
    mc_err_t err = {0};
    int ok = mc_meta_open(etcd_srv.url, &m, &err) == 0 && wait_ready(m) == 0;
    mc_meta_close(m);
    if (!ok) {
      fprintf(stderr, "FAIL etcd did not start (see %s/etcd.log)\n", tmpdir);
      tl_failures++;
    } else {
      run_common(&etcd_srv);
      RUN(test_etcd_failover);
    }
    stop_server(&etcd_srv);
  }
  if (!on_path("redis-server")) {
    fprintf(stderr, "skip redis tests: no `redis-server` on PATH (Debian package "
                    "redis-server)\n");
  } else if (start_redis(&redis_srv) == 0) {
    mc_meta_t *m = NULL;
    mc_err_t err = {0};
    int ok = mc_meta_open(redis_srv.url, &m, &err) == 0 && wait_ready(m) == 0;
    mc_meta_close(m);
    if (!ok) {
      fprintf(stderr, "FAIL redis did not start (see %s/redis.log)\n", tmpdir);
      tl_failures++;
    } else {
      run_common(&redis_srv);
      RUN(test_redis_auth);
      RUN(test_redis_reconnect);
    }
    stop_server(&redis_srv);
  }
  if (!tl_failures) {
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (system(cmd) != 0)
      fprintf(stderr, "could not remove %s\n", tmpdir);
  }
  TEST_MAIN_END();
}
