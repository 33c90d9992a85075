/* Metadata store client: one small interface over the backends
 * (embedded/any HTTP server speaking Mooncake's HTTP metadata protocol now;
 * etcd and Redis later).  All calls block (the caller releases the GIL) and
 * are bounded by timeouts (connect 1.5 s, total 3 s by default).
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
  void (*close)(mc_meta_t *m);
} mc_meta_ops_t;

struct mc_meta {
  const mc_meta_ops_t *ops;
  char url[1024]; /* connection string as given, for messages */
};

/* Opens a client for a normalised connection string (see config.h):
 * "http://host:port/path" works now; "etcd://", "redis://" return
 * MC_EUNAVAIL with a message until those backends land; "P2PHANDSHAKE"
 * returns MC_EINVAL (P2P mode has no metadata client). */
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
void mc_meta_close(mc_meta_t *m);

/* Key layout, defined once (see docs/protocol.md). Write into buf.
 * Prefix P = "mooncake/", or "mooncake/<MC_METADATA_CLUSTER_ID>/" when that
 * env var is set and non-empty (a trailing '/' in it is not doubled).
 *   segment: P + "ram/" + name, or P + name when name contains '/'
 *            (Mooncake's rule, e.g. "nvmeof/<name>");
 *   rpc:     P + "rpc_meta/" + name.
 * Return 0, MC_EINVAL for a NULL/empty name or NULL buf, MC_ETOOBIG when the
 * key (with its NUL) does not fit in len bytes. */
int mc_meta_key_segment(const char *segment_name, char *buf, size_t len);
int mc_meta_key_rpc(const char *segment_name, char *buf, size_t len);

/* Largest value a GET accepts (and the Python server's default PUT cap). */
#define MC_META_MAX_VALUE ((size_t)16 << 20)

/* Backend constructors, called by mc_meta_open's dispatch (meta.c).
 * The url is copied; the caller validated the scheme. */
int mc_meta_http_open(const char *url, mc_meta_t **out, mc_err_t *err);

#endif
