/* Redis metadata backend (hiredis): redis://[:password@]host:port[/db].
 *
 *   put      SET key value         get  GET key        del  DEL key
 *   put_ttl  SET key value EX ttl  refresh  EXPIRE key ttl (0 -> SET ... EX)
 *
 * Each connection is opened with the connect timeout, gets SO_RCVTIMEO /
 * SO_SNDTIMEO = the request timeout, then AUTH (when a password is given;
 * else MC_REDIS_PASSWORD) and SELECT (when a db is given; else
 * MC_REDIS_DB_INDEX).  Replies are read by our own loop so that a reply
 * larger than the value cap, or a server that talks too long, is cut off.
 *
 * Thread-safety: a redisContext is used by one thread at a time; calls take
 * one from a small mutex-protected pool (or connect a new one) and give it
 * back afterwards.  A context that saw an I/O or protocol error is dropped,
 * and a request that failed on a pooled (possibly stale) context is retried
 * once on a fresh connection. */
#include "meta/meta.h"

#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <hiredis/hiredis.h>

#include "util/hostport.h"
#include "util/log.h"

#define REDIS_POOL_MAX 4
#define REDIS_PASS_MAX 256
#define REDIS_SNIPPET_MAX 120

typedef struct redis_meta {
  mc_meta_t base;
  char host[MC_HOST_MAX];
  int port;
  char password[REDIS_PASS_MAX]; /* "" = no AUTH */
  int db;                        /* -1 = no SELECT */
  long timeout_ms, connect_timeout_ms;
  pthread_mutex_t mu;
  redisContext *idle[REDIS_POOL_MAX];
  int n_idle;
} redis_meta_t;

static struct timeval tv_of(long ms) {
  struct timeval tv = {.tv_sec = ms / 1000, .tv_usec = (ms % 1000) * 1000};
  return tv;
}

static long now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000L + ts.tv_nsec / 1000000L;
}

static void snippet(const char *s, size_t n, char *out, size_t outlen) {
  size_t k = 0;
  for (size_t i = 0; s && i < n && k + 1 < outlen && k < REDIS_SNIPPET_MAX; i++) {
    unsigned char ch = (unsigned char)s[i];
    out[k++] = isprint(ch) ? (char)ch : ' ';
  }
  out[k] = '\0';
}

/* hiredis writes with write(2): writing to a server that closed the
 * connection raises SIGPIPE, which kills a host process that does not
 * ignore it (Python does; a C program need not) - found by fuzz_meta.  The
 * write runs with SIGPIPE blocked in this thread, and a SIGPIPE it caused is
 * consumed; the failed write then reports EPIPE as an I/O error. */
static int buffer_write(redisContext *c, int *done) {
  sigset_t pipe_set, old, pending;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  int was_pending = sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1;
  pthread_sigmask(SIG_BLOCK, &pipe_set, &old);
  int rc = redisBufferWrite(c, done);
  int saved = errno;
  if (!was_pending) {
    struct timespec zero = {0, 0};
    while (sigtimedwait(&pipe_set, NULL, &zero) > 0) {
    }
  }
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  errno = saved;
  return rc;
}

/* Sends argv and reads one reply, bounded by the request timeout and the
 * value cap.  On failure the context is unusable (caller frees it) and err
 * is filled; *io_error says the failure was on the connection (retryable). */
static int roundtrip(redis_meta_t *r, redisContext *c, int argc, const char **argv,
                     const size_t *lens, const char *what, const char *key,
                     redisReply **out, int *io_error, mc_err_t *err) {
  *out = NULL;
  *io_error = 0;
  if (redisAppendCommandArgv(c, argc, argv, lens) != REDIS_OK) {
    *io_error = 1;
    return mc_err_set(err, MC_ENOMEM, "redis %s: could not format %s key \"%s\": %s",
                      r->base.url, what, key, c->errstr);
  }
  int done = 0;
  do {
    if (buffer_write(c, &done) != REDIS_OK)
      goto io;
  } while (!done);
  long deadline = now_ms() + r->timeout_ms;
  void *reply = NULL;
  for (;;) {
    if (redisGetReplyFromReader(c, &reply) != REDIS_OK)
      goto io;
    if (reply)
      break;
    /* A bulk reply is buffered whole before it is parsed: cap it. */
    if (c->reader->len > MC_META_MAX_VALUE + 1024) {
      *io_error = 0;
      return mc_err_set(err, MC_ETOOBIG,
                        "redis %s sent more than %zu MiB for %s key \"%s\"; refused "
                        "(is it a Redis server?)",
                        r->base.url, MC_META_MAX_VALUE >> 20, what, key);
    }
    if (now_ms() > deadline) {
      *io_error = 0;
      return mc_err_set(err, MC_EMETADATA,
                        "redis %s did not finish answering %s key \"%s\" within %ld ms "
                        "(MC_METADATA_TIMEOUT_MS)",
                        r->base.url, what, key, r->timeout_ms);
    }
    if (redisBufferRead(c) != REDIS_OK)
      goto io;
  }
  *out = reply;
  return 0;
io:
  *io_error = 1;
  if (c->err == REDIS_ERR_IO && (errno == EAGAIN || errno == EWOULDBLOCK)) {
    *io_error = 0; /* a timeout is not worth an immediate retry */
    return mc_err_set(err, MC_EMETADATA,
                      "redis %s did not answer %s key \"%s\" within %ld ms "
                      "(MC_METADATA_TIMEOUT_MS)",
                      r->base.url, what, key, r->timeout_ms);
  }
  if (c->err == REDIS_ERR_PROTOCOL)
    *io_error = 0;
  return mc_err_set(err, MC_EMETADATA, "redis %s failed %s key \"%s\": %s%s",
                    r->base.url, what, key,
                    c->err == REDIS_ERR_PROTOCOL ? "the server does not speak the Redis "
                                                   "protocol: "
                                                 : "",
                    c->errstr[0] ? c->errstr : "connection closed");
}

/* Runs a command whose reply must not be an error; used for AUTH/SELECT. */
static int setup_cmd(redis_meta_t *r, redisContext *c, int argc, const char **argv,
                     const size_t *lens, const char *what, mc_err_t *err) {
  redisReply *rep;
  int io;
  int rc = roundtrip(r, c, argc, argv, lens, what, "-", &rep, &io, err);
  if (rc < 0)
    return rc;
  if (rep->type == REDIS_REPLY_ERROR) {
    char snip[REDIS_SNIPPET_MAX + 1];
    snippet(rep->str, rep->len, snip, sizeof snip);
    rc = mc_err_set(err, MC_EMETADATA, "redis %s refused %s: %s", r->base.url, what, snip);
  }
  freeReplyObject(rep);
  return rc;
}

static redisContext *connect_new(redis_meta_t *r, const char *what, const char *key,
                                 mc_err_t *err) {
  redisContext *c = redisConnectWithTimeout(r->host, r->port, tv_of(r->connect_timeout_ms));
  if (!c) {
    mc_err_set(err, MC_ENOMEM, "out of memory connecting to redis %s", r->base.url);
    return NULL;
  }
  if (c->err) {
    mc_err_set(err, MC_EMETADATA, "redis %s unreachable while %s key \"%s\": %s", r->base.url,
               what, key, c->errstr);
    redisFree(c);
    return NULL;
  }
  redisSetTimeout(c, tv_of(r->timeout_ms));
  redisEnableKeepAlive(c);
  if (r->password[0]) {
    const char *argv[] = {"AUTH", r->password};
    size_t lens[] = {4, strlen(r->password)};
    if (setup_cmd(r, c, 2, argv, lens, "AUTH (check the password)", err) < 0) {
      redisFree(c);
      return NULL;
    }
  }
  if (r->db >= 0) {
    char db[16];
    snprintf(db, sizeof db, "%d", r->db);
    const char *argv[] = {"SELECT", db};
    size_t lens[] = {6, strlen(db)};
    if (setup_cmd(r, c, 2, argv, lens, "SELECT", err) < 0) {
      redisFree(c);
      return NULL;
    }
  }
  return c;
}

static redisContext *ctx_take(redis_meta_t *r, int *pooled) {
  redisContext *c = NULL;
  pthread_mutex_lock(&r->mu);
  if (r->n_idle > 0)
    c = r->idle[--r->n_idle];
  pthread_mutex_unlock(&r->mu);
  *pooled = c != NULL;
  return c;
}

static void ctx_give(redis_meta_t *r, redisContext *c) {
  pthread_mutex_lock(&r->mu);
  if (r->n_idle < REDIS_POOL_MAX) {
    r->idle[r->n_idle++] = c;
    c = NULL;
  }
  pthread_mutex_unlock(&r->mu);
  if (c)
    redisFree(c);
}

/* One command with pooling and a single reconnect-and-retry. */
static int command(redis_meta_t *r, int argc, const char **argv, const size_t *lens,
                   const char *what, const char *key, redisReply **out, mc_err_t *err) {
  for (int attempt = 0;; attempt++) {
    int pooled;
    redisContext *c = ctx_take(r, &pooled);
    if (!c && !(c = connect_new(r, what, key, err)))
      return err ? err->code : MC_EMETADATA;
    int io;
    int rc = roundtrip(r, c, argc, argv, lens, what, key, out, &io, err);
    if (rc == 0) {
      ctx_give(r, c);
      return 0;
    }
    redisFree(c);
    if (!(io && pooled && attempt == 0))
      return rc;
    mc_log_debug("redis %s: pooled connection failed (%s); reconnecting", r->base.url,
                 err ? err->msg : "");
  }
}

static int reply_error(redis_meta_t *r, const redisReply *rep, const char *what,
                       const char *key, mc_err_t *err) {
  char snip[REDIS_SNIPPET_MAX + 1];
  if (rep->type == REDIS_REPLY_ERROR) {
    snippet(rep->str, rep->len, snip, sizeof snip);
    return mc_err_set(err, MC_EMETADATA, "redis %s refused %s key \"%s\": %s", r->base.url,
                      what, key, snip);
  }
  return mc_err_set(err, MC_EMETADATA, "redis %s answered %s key \"%s\" with reply type %d",
                    r->base.url, what, key, rep->type);
}

static int do_set(redis_meta_t *r, const char *key, const char *val, size_t len, int ttl,
                  mc_err_t *err) {
  char ttls[16];
  snprintf(ttls, sizeof ttls, "%d", ttl);
  const char *argv[] = {"SET", key, val, "EX", ttls};
  size_t lens[] = {3, strlen(key), len, 2, strlen(ttls)};
  redisReply *rep;
  int rc = command(r, ttl > 0 ? 5 : 3, argv, lens, "PUT", key, &rep, err);
  if (rc < 0)
    return rc;
  if (rep->type != REDIS_REPLY_STATUS)
    rc = reply_error(r, rep, "PUT", key, err);
  freeReplyObject(rep);
  return rc;
}

static int redis_put(mc_meta_t *m, const char *key, const char *val, size_t len,
                     mc_err_t *err) {
  return do_set((redis_meta_t *)m, key, val, len, 0, err);
}

static int redis_put_ttl(mc_meta_t *m, const char *key, const char *val, size_t len, int ttl,
                         mc_err_t *err) {
  return do_set((redis_meta_t *)m, key, val, len, ttl, err);
}

static int redis_get(mc_meta_t *m, const char *key, char **val, size_t *len, mc_err_t *err) {
  redis_meta_t *r = (redis_meta_t *)m;
  const char *argv[] = {"GET", key};
  size_t lens[] = {3, strlen(key)};
  redisReply *rep;
  int rc = command(r, 2, argv, lens, "GET", key, &rep, err);
  if (rc < 0)
    return rc;
  if (rep->type == REDIS_REPLY_NIL) {
    rc = mc_err_set(err, MC_ENOTFOUND, "key \"%s\" not found on redis %s", key, r->base.url);
  } else if (rep->type != REDIS_REPLY_STRING) {
    rc = reply_error(r, rep, "GET", key, err);
  } else if (rep->len > MC_META_MAX_VALUE) {
    rc = mc_err_set(err, MC_ETOOBIG, "redis %s: value of key \"%s\" is larger than %zu MiB",
                    r->base.url, key, MC_META_MAX_VALUE >> 20);
  } else if (!(*val = malloc(rep->len + 1))) {
    rc = mc_err_set(err, MC_ENOMEM, "out of memory reading key \"%s\" from redis %s", key,
                    r->base.url);
  } else {
    memcpy(*val, rep->str, rep->len);
    (*val)[rep->len] = '\0';
    *len = rep->len;
  }
  freeReplyObject(rep);
  return rc;
}

static int redis_del(mc_meta_t *m, const char *key, mc_err_t *err) {
  redis_meta_t *r = (redis_meta_t *)m;
  const char *argv[] = {"DEL", key};
  size_t lens[] = {3, strlen(key)};
  redisReply *rep;
  int rc = command(r, 2, argv, lens, "DELETE", key, &rep, err);
  if (rc < 0)
    return rc;
  if (rep->type != REDIS_REPLY_INTEGER)
    rc = reply_error(r, rep, "DELETE", key, err);
  freeReplyObject(rep);
  return rc;
}

static int redis_refresh(mc_meta_t *m, const char *key, const char *val, size_t len, int ttl,
                         mc_err_t *err) {
  redis_meta_t *r = (redis_meta_t *)m;
  char ttls[16];
  snprintf(ttls, sizeof ttls, "%d", ttl);
  const char *argv[] = {"EXPIRE", key, ttls};
  size_t lens[] = {6, strlen(key), strlen(ttls)};
  redisReply *rep;
  int rc = command(r, 3, argv, lens, "refresh", key, &rep, err);
  if (rc < 0)
    return rc;
  long long kept = rep->type == REDIS_REPLY_INTEGER ? rep->integer : -1;
  if (kept < 0)
    rc = reply_error(r, rep, "refresh", key, err);
  freeReplyObject(rep);
  if (rc < 0)
    return rc;
  if (kept == 1)
    return 0;
  rc = do_set(r, key, val, len, ttl, err); /* the key was gone */
  return rc < 0 ? rc : 1;
}

static void redis_close(mc_meta_t *m) {
  redis_meta_t *r = (redis_meta_t *)m;
  for (int i = 0; i < r->n_idle; i++)
    redisFree(r->idle[i]);
  pthread_mutex_destroy(&r->mu);
  free(r);
}

static const mc_meta_ops_t redis_ops = {
    .name = "redis",
    .put = redis_put,
    .get = redis_get,
    .del = redis_del,
    .put_ttl = redis_put_ttl,
    .refresh = redis_refresh,
    .close = redis_close,
};

/* ---- open ---- */

static int bad_url(const char *conn, const char *why, mc_err_t *err) {
  char shown[sizeof(((mc_meta_t *)0)->url)];
  mc_meta_t tmp;
  mc_meta_set_url(&tmp, conn);
  snprintf(shown, sizeof shown, "%s", tmp.url);
  return mc_err_set(err, MC_EINVAL,
                    "redis metadata server \"%s\": %s; expected "
                    "\"redis://[:password@]host:port[/db]\"",
                    shown, why);
}

static int parse_db(const char *s, int *db) {
  size_t n = strlen(s);
  if (n == 0 || n > 5 || strspn(s, "0123456789") != n)
    return -1;
  *db = atoi(s);
  return 0;
}

int mc_meta_redis_open(const char *conn, const char *rest, mc_meta_t **out, mc_err_t *err) {
  *out = NULL;
  long total, connect;
  int rc = mc_meta_read_timeouts(&total, &connect, err);
  if (rc)
    return rc;
  redis_meta_t *r = calloc(1, sizeof *r);
  if (!r)
    return mc_err_set(err, MC_ENOMEM, "out of memory opening redis metadata client");
  r->db = -1;
  const char *at = strrchr(rest, '@');
  const char *hostpart = at ? at + 1 : rest;
  if (at) {
    const char *pw = rest;
    if (*pw == ':')
      pw++;
    else if (memchr(rest, ':', (size_t)(at - rest)))
      pw = (const char *)memchr(rest, ':', (size_t)(at - rest)) + 1; /* user:pass */
    size_t pl = (size_t)(at - pw);
    if (pl == 0 || pl >= sizeof r->password) {
      free(r);
      return bad_url(conn, pl ? "password too long" : "empty password", err);
    }
    memcpy(r->password, pw, pl);
  } else {
    const char *pw = getenv("MC_REDIS_PASSWORD");
    if (pw && *pw)
      snprintf(r->password, sizeof r->password, "%s", pw);
  }
  char hp_s[MC_HOST_MAX + 16];
  const char *slash = strchr(hostpart, '/');
  size_t hn = slash ? (size_t)(slash - hostpart) : strlen(hostpart);
  if (hn == 0 || hn >= sizeof hp_s) {
    free(r);
    return bad_url(conn, hn ? "host too long" : "no host:port", err);
  }
  memcpy(hp_s, hostpart, hn);
  hp_s[hn] = '\0';
  mc_hostport_t hp;
  if (mc_hostport_parse(hp_s, &hp, NULL) < 0 || hp.port < 0) {
    char why[MC_HOST_MAX + 64];
    snprintf(why, sizeof why, "\"%s\" is not host:port", hp_s);
    free(r);
    return bad_url(conn, why, err);
  }
  if (slash && parse_db(slash + 1, &r->db) < 0) {
    free(r);
    return bad_url(conn, "the database after '/' is not a number 0..99999", err);
  }
  if (!slash) {
    const char *dbe = getenv("MC_REDIS_DB_INDEX");
    if (dbe && *dbe && parse_db(dbe, &r->db) < 0) {
      free(r);
      return mc_err_set(err, MC_ECONFIG, "MC_REDIS_DB_INDEX=\"%s\" is not a number", dbe);
    }
  }
  snprintf(r->host, sizeof r->host, "%s", hp.host);
  r->port = hp.port;
  int pe = pthread_mutex_init(&r->mu, NULL);
  if (pe) {
    free(r);
    return mc_err_sys(err, MC_ESYS, pe, "pthread_mutex_init");
  }
  r->base.ops = &redis_ops;
  mc_meta_set_url(&r->base, conn);
  r->timeout_ms = total;
  r->connect_timeout_ms = connect;
  *out = &r->base;
  return 0;
}
