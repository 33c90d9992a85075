/* Metadata store client: one small interface over the backends
 * (HTTP: the embedded server or any server speaking Mooncake's HTTP metadata
 * protocol; etcd through its v3 JSON gateway; Redis through hiredis).  All
 * calls block (the caller releases the GIL) and are bounded by timeouts
 * (connect 1.5 s, total 3 s by default, MC_METADATA_TIMEOUT_MS).
 *
 * Liveness: put_ttl stores an entry that vanishes ttl_s seconds later unless
 * refresh extends it (etcd: a lease per TTL value with keep-alive; Redis:
 * SET EX / EXPIRE; HTTP: PUT ...&ttl=N, re-sent on every refresh).
 * Entries written through one client with the same TTL may share one
 * lifetime (etcd: one lease per TTL value), so refresh them together.
 *
 * Thread-safety: a mc_meta_t may be used from several threads at once.
 */
#ifndef MC_META_META_H
#define MC_META_META_H

#include <stddef.h>

#include "util/errors.h"

typedef struct mc_meta mc_meta_t;

/* Backend vtable; each backend fills one with designated initializers. */
typedef struct mc_meta_ops {
  const char *name; /* "http", "etcd", "redis" */
  int (*put)(mc_meta_t *m, const char *key, const char *val, size_t len,
             mc_err_t *err);
  /* On success *val is malloc'ed, NUL-terminated, caller frees. */
  int (*get)(mc_meta_t *m, const char *key, char **val, size_t *len,
             mc_err_t *err);
  int (*del)(mc_meta_t *m, const char *key, mc_err_t *err);
  /* PUT that expires after ttl_s (>= 1) seconds unless refreshed. */
  int (*put_ttl)(mc_meta_t *m, const char *key, const char *val, size_t len,
                 int ttl_s, mc_err_t *err);
  /* Extends key's life to ttl_s from now.  When the server lost the key
   * (expired, server restarted with its data gone) it is written again with
   * val.  Returns 0 (kept), 1 (written again) or an MC_E* code. */
  int (*refresh)(mc_meta_t *m, const char *key, const char *val, size_t len,
                 int ttl_s, mc_err_t *err);
  void (*close)(mc_meta_t *m);
} mc_meta_ops_t;

struct mc_meta {
  const mc_meta_ops_t *ops;
  char url[1024]; /* connection string as given, for messages */
};

/* Opens a client for a connection string (see config.h):
 *   "http://host:port/path", "https://..."            HTTP backend
 *   "etcd://h1:p1[,h2:p2...]" or bare "h1:p1[,h2:p2]" etcd (fail-over list)
 *   "redis://[:password@]host:port[/db]"              Redis
 * Opening parses and validates only; no network.  "P2PHANDSHAKE" returns
 * MC_EINVAL (P2P mode has no metadata client); other schemes MC_EINVAL. */
int mc_meta_open(const char *conn, mc_meta_t **out, mc_err_t *err);

/* PUT value under key.  0 or MC_EMETADATA (message names server, key, HTTP
 * status / curl error). */
int mc_meta_put(mc_meta_t *m, const char *key, const char *val, size_t len,
                mc_err_t *err);
/* GET. 0, MC_ENOTFOUND if the key does not exist, MC_EMETADATA otherwise.
 * Bodies larger than 16 MiB are refused (MC_ETOOBIG). */
int mc_meta_get(mc_meta_t *m, const char *key, char **val, size_t *len,
                mc_err_t *err);
/* DELETE. 0 (also when the key did not exist) or MC_EMETADATA. */
int mc_meta_del(mc_meta_t *m, const char *key, mc_err_t *err);
/* PUT with a time to live (ttl_s 1..MC_META_TTL_MAX; 0 = plain PUT). */
int mc_meta_put_ttl(mc_meta_t *m, const char *key, const char *val, size_t len,
                    int ttl_s, mc_err_t *err);
/* Keep-alive of a put_ttl entry (see mc_meta_ops_t.refresh): 0 kept, 1 the
 * server had lost it and it was written again, < 0 error. */
int mc_meta_refresh(mc_meta_t *m, const char *key, const char *val, size_t len,
                    int ttl_s, mc_err_t *err);
void mc_meta_close(mc_meta_t *m);

#define MC_META_TTL_MAX 86400

/* Key layout, defined once (see docs/protocol.md). Write into buf.
 * Prefix P = "mooncake/", or "mooncake/<MC_METADATA_CLUSTER_ID>/" when that
 * env var is set and non-empty (a trailing '/' in it is not doubled).
 *   segment: P + "ram/" + name, or P + name when name contains '/'
 *            (Mooncake's rule, e.g. "nvmeof/<name>");
 *   rpc:     P + "rpc_meta/" + name;
 *   last seen: P + "last_seen/" + name (no TTL; written by the engine's
 *            keep-alive so a lookup can say how long ago a peer expired).
 * Return 0, MC_EINVAL for a NULL/empty name or NULL buf, MC_ETOOBIG when the
 * key (with its NUL) does not fit in len bytes. */
int mc_meta_key_segment(const char *segment_name, char *buf, size_t len);
int mc_meta_key_rpc(const char *segment_name, char *buf, size_t len);
int mc_meta_key_last_seen(const char *segment_name, char *buf, size_t len);

/* Largest value a GET accepts (and the Python server's default PUT cap). */
#define MC_META_MAX_VALUE ((size_t)16 << 20)

/* Backend constructors, called by mc_meta_open's dispatch (meta.c).
 * The url is copied; the caller validated the scheme. */
int mc_meta_http_open(const char *url, mc_meta_t **out, mc_err_t *err);
/* endpoints: "h1:p1[,h2:p2...]" (no scheme). */
int mc_meta_etcd_open(const char *conn, const char *endpoints, mc_meta_t **out,
                      mc_err_t *err);
/* rest: "[:password@]host:port[/db]" (after "redis://"). */
int mc_meta_redis_open(const char *conn, const char *rest, mc_meta_t **out,
                       mc_err_t *err);

/* Shared by the backends: MC_METADATA_TIMEOUT_MS (total per request, default
 * 3000) and the connect timeout derived from it (min(1500, total)). */
int mc_meta_read_timeouts(long *total_ms, long *connect_ms, mc_err_t *err);
/* The error of a segment whose descriptor is not on the server (m), told
 * apart with its last-seen record: expired N s ago (its engine died),
 * recently refreshed (the server lost it; re-registration pending), or no
 * record at all.  Returns MC_ENOTFOUND with err set. */
int mc_meta_not_registered(mc_meta_t *m, const char *segment, mc_err_t *err);
/* Copies a connection string into m->url with any password masked
 * ("redis://:***@h:p"). */
void mc_meta_set_url(mc_meta_t *m, const char *conn);

#endif
