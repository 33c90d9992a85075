/* Metadata client front end: picks a backend from the connection string,
 * validates arguments once for every backend, and owns the key layout. */
#include "meta/meta.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include <cjson/cJSON.h>

#define P2P_CONN "P2PHANDSHAKE"

static int has_prefix_ci(const char *s, const char *prefix) {
  return strncasecmp(s, prefix, strlen(prefix)) == 0;
}

int mc_meta_open(const char *conn, mc_meta_t **out, mc_err_t *err) {
  if (!out)
    return mc_err_set(err, MC_EINVAL, "mc_meta_open: out is NULL");
  *out = NULL;
  if (!conn || !*conn)
    return mc_err_set(err, MC_EINVAL,
                      "empty metadata connection string; expected "
                      "\"http://host:port/metadata\", \"etcd://host:port\" or "
                      "\"redis://host:port\"");
  if (strcmp(conn, P2P_CONN) == 0)
    return mc_err_set(err, MC_EINVAL,
                      "metadata server \"P2PHANDSHAKE\" means P2P mode, which "
                      "has no metadata server: peers exchange metadata over "
                      "the handshake socket, so no metadata client is opened");
  if (strlen(conn) >= sizeof(((mc_meta_t *)0)->url))
    return mc_err_set(err, MC_EINVAL,
                      "metadata connection string \"%.64s...\" is longer than "
                      "%zu characters",
                      conn, sizeof(((mc_meta_t *)0)->url) - 1);
  if (has_prefix_ci(conn, "http://") || has_prefix_ci(conn, "https://"))
    return mc_meta_http_open(conn, out, err);
  if (has_prefix_ci(conn, "etcd://"))
    return mc_meta_etcd_open(conn, conn + strlen("etcd://"), out, err);
  if (has_prefix_ci(conn, "redis://"))
    return mc_meta_redis_open(conn, conn + strlen("redis://"), out, err);
  const char *sep = strstr(conn, "://");
  if (sep)
    return mc_err_set(err, MC_EINVAL,
                      "metadata connection string \"%s\" has unknown scheme "
                      "\"%.*s\"; expected http://, https://, etcd://, redis:// "
                      "or P2PHANDSHAKE",
                      conn, (int)(sep - conn), conn);
  /* Mooncake reads a string without a scheme as an etcd endpoint list. */
  return mc_meta_etcd_open(conn, conn, out, err);
}

int mc_meta_read_timeouts(long *total_ms, long *connect_ms, mc_err_t *err) {
  const long dflt = 3000, conn_max = 1500, hi = 600000;
  const char *s = getenv("MC_METADATA_TIMEOUT_MS");
  *total_ms = dflt;
  if (s && *s) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || v < 1 || v > hi)
      return mc_err_set(err, MC_ECONFIG,
                        "MC_METADATA_TIMEOUT_MS=\"%s\" is not a whole number of "
                        "milliseconds in 1..%ld",
                        s, hi);
    *total_ms = v;
  }
  *connect_ms = *total_ms < conn_max ? *total_ms : conn_max;
  return 0;
}

void mc_meta_set_url(mc_meta_t *m, const char *conn) {
  snprintf(m->url, sizeof m->url, "%s", conn);
  /* Mask a password: "scheme://[user]:secret@host" -> ":***@". */
  char *scheme = strstr(m->url, "://");
  if (!scheme)
    return;
  char *auth = scheme + 3;
  char *at = strchr(auth, '@');
  char *colon = strchr(auth, ':');
  if (!at || !colon || colon > at)
    return;
  char tail[sizeof m->url];
  snprintf(tail, sizeof tail, "%s", at);
  snprintf(colon, sizeof m->url - (size_t)(colon - m->url), ":***%s", tail);
}

static int check_key(mc_meta_t *m, const char *key, const char *op,
                     mc_err_t *err) {
  if (!m)
    return mc_err_set(err, MC_EINVAL, "metadata %s: client is NULL", op);
  if (!key || !*key)
    return mc_err_set(err, MC_EINVAL, "metadata %s on %s: key is %s", op,
                      m->url, key ? "empty" : "NULL");
  return 0;
}

int mc_meta_put(mc_meta_t *m, const char *key, const char *val, size_t len,
                mc_err_t *err) {
  int rc = check_key(m, key, "PUT", err);
  if (rc)
    return rc;
  if (!val && len)
    return mc_err_set(err, MC_EINVAL,
                      "metadata PUT key \"%s\": value is NULL but length is %zu",
                      key, len);
  return m->ops->put(m, key, val ? val : "", len, err);
}

int mc_meta_get(mc_meta_t *m, const char *key, char **val, size_t *len,
                mc_err_t *err) {
  if (val)
    *val = NULL;
  if (len)
    *len = 0;
  int rc = check_key(m, key, "GET", err);
  if (rc)
    return rc;
  if (!val)
    return mc_err_set(err, MC_EINVAL, "metadata GET key \"%s\": val is NULL",
                      key);
  size_t dummy;
  return m->ops->get(m, key, val, len ? len : &dummy, err);
}

int mc_meta_del(mc_meta_t *m, const char *key, mc_err_t *err) {
  int rc = check_key(m, key, "DELETE", err);
  if (rc)
    return rc;
  return m->ops->del(m, key, err);
}

int mc_meta_put_ttl(mc_meta_t *m, const char *key, const char *val, size_t len,
                    int ttl_s, mc_err_t *err) {
  if (ttl_s == 0)
    return mc_meta_put(m, key, val, len, err);
  int rc = check_key(m, key, "PUT", err);
  if (rc)
    return rc;
  if (ttl_s < 0 || ttl_s > MC_META_TTL_MAX)
    return mc_err_set(err, MC_EINVAL,
                      "metadata PUT key \"%s\" on %s: TTL %d s is outside "
                      "1..%d",
                      key, m->url, ttl_s, MC_META_TTL_MAX);
  if (!val && len)
    return mc_err_set(err, MC_EINVAL,
                      "metadata PUT key \"%s\": value is NULL but length is %zu",
                      key, len);
  return m->ops->put_ttl(m, key, val ? val : "", len, ttl_s, err);
}

int mc_meta_refresh(mc_meta_t *m, const char *key, const char *val, size_t len,
                    int ttl_s, mc_err_t *err) {
  int rc = check_key(m, key, "refresh", err);
  if (rc)
    return rc;
  if (ttl_s < 1 || ttl_s > MC_META_TTL_MAX)
    return mc_err_set(err, MC_EINVAL,
                      "metadata refresh of key \"%s\" on %s: TTL %d s is "
                      "outside 1..%d",
                      key, m->url, ttl_s, MC_META_TTL_MAX);
  if (!val && len)
    return mc_err_set(err, MC_EINVAL,
                      "metadata refresh key \"%s\": value is NULL but length "
                      "is %zu",
                      key, len);
  return m->ops->refresh(m, key, val ? val : "", len, ttl_s, err);
}

void mc_meta_close(mc_meta_t *m) {
  if (m)
    m->ops->close(m);
}

/* ---- key layout ---- */

/* Writes P + middle + name.  The cluster id is read on every call: keys are
 * built rarely (register/unregister), and tests change the variable. */
static int build_key(const char *middle, const char *name, char *buf,
                     size_t len) {
  if (!name || !*name || !buf || !len)
    return MC_EINVAL;
  const char *cluster = getenv("MC_METADATA_CLUSTER_ID");
  int n;
  if (cluster && *cluster) {
    size_t cl = strlen(cluster);
    const char *slash = cluster[cl - 1] == '/' ? "" : "/";
    n = snprintf(buf, len, "mooncake/%s%s%s%s", cluster, slash, middle, name);
  } else {
    n = snprintf(buf, len, "mooncake/%s%s", middle, name);
  }
  if (n < 0)
    return MC_EINVAL;
  if ((size_t)n >= len) {
    buf[0] = '\0'; /* never hand out a truncated key */
    return MC_ETOOBIG;
  }
  return 0;
}

int mc_meta_key_segment(const char *segment_name, char *buf, size_t len) {
  /* Names that already carry a namespace ("nvmeof/x") skip "ram/". */
  const char *middle = segment_name && strchr(segment_name, '/') ? "" : "ram/";
  return build_key(middle, segment_name, buf, len);
}

int mc_meta_key_rpc(const char *segment_name, char *buf, size_t len) {
  return build_key("rpc_meta/", segment_name, buf, len);
}

int mc_meta_key_last_seen(const char *segment_name, char *buf, size_t len) {
  return build_key("last_seen/", segment_name, buf, len);
}

/* The "not registered" error of a lookup, told apart with the last-seen
 * record: expired N s ago (its engine died), recently refreshed (the server
 * lost it; re-registration pending), or no record at all. */
int mc_meta_not_registered(mc_meta_t *m, const char *segment, mc_err_t *err) {
  char key[512], *val = NULL;
  size_t vlen = 0;
  mc_err_t tmp = {0};
  double last = -1, ttl = -1;
  if (mc_meta_key_last_seen(segment, key, sizeof key) == 0 &&
      mc_meta_get(m, key, &val, &vlen, &tmp) == 0) {
    cJSON *j = cJSON_ParseWithLength(val, vlen);
    const cJSON *l = cJSON_GetObjectItemCaseSensitive(j, "last_seen");
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(j, "ttl");
    if (cJSON_IsNumber(l) && cJSON_IsNumber(t)) {
      last = l->valuedouble;
      ttl = t->valuedouble;
    }
    cJSON_Delete(j);
    free(val);
  }
  if (last < 0)
    return mc_err_set(err, MC_ENOTFOUND,
                      "segment %s is not registered (never registered, or its engine shut "
                      "down cleanly) on metadata server %s; is its engine running and using "
                      "the same metadata_server?",
                      segment, m->url);
  long long now = (long long)time(NULL);
  long long ago = now - (long long)last, expired = now - (long long)(last + ttl);
  if (expired >= 0)
    return mc_err_set(err, MC_ENOTFOUND,
                      "segment %s is not registered (expired %lld s ago: its engine last "
                      "refreshed it %lld s ago with a TTL of %.0f s, so it died or lost the "
                      "metadata server) on metadata server %s",
                      segment, expired, ago, ttl, m->url);
  return mc_err_set(err, MC_ENOTFOUND,
                    "segment %s is not registered (last refreshed %lld s ago, TTL %.0f s: "
                    "the metadata server probably restarted and its engine re-registers "
                    "within %.0f s) on metadata server %s",
                    segment, ago, ttl, ttl / 3 + 1, m->url);
}
