/* Engine lifecycle, the local segment, segment resolution, notifications. */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/socket.h>

#include <cjson/cJSON.h>

#include "engine/engine_internal.h"
#include "gpu/cuda_driver.h"
#include "gpu/gpu_ipc.h"
#include "util/dynlib.h"
#include "util/hostport.h"
#include "util/env.h"
#include "util/log.h"
#include "util/mapped.h"

static int env_int(const char *name, int dflt, int lo, int hi) {
  return (int)mc_env_long(name, dflt, lo, hi);
}

void mc_engine_set_peer_lost_handler(mc_engine_t *e, mc_peer_lost_cb cb, void *arg) {
  pthread_rwlock_wrlock(&e->handler_lock);
  e->peer_lost_cb = cb;
  e->peer_lost_arg = arg;
  pthread_rwlock_unlock(&e->handler_lock);
}

void mc_engine_set_notify_handler(mc_engine_t *e, mc_notify_handler_fn cb, void *arg) {
  /* The write lock waits for a handler call in flight to return, so the
   * old handler's state may be freed once this returns. */
  pthread_rwlock_wrlock(&e->handler_lock);
  e->notify_cb = cb;
  e->notify_arg = arg;
  pthread_rwlock_unlock(&e->handler_lock);
}

int mc_engine_on_notify(void *ctx, const char *from, const void *msg, size_t len,
                        mc_err_t *err) {
  mc_engine_t *e = ctx;
  pthread_rwlock_rdlock(&e->handler_lock);
  if (e->notify_cb) {
    int rc = e->notify_cb(e->notify_arg, from ? from : "", msg, len, err);
    pthread_rwlock_unlock(&e->handler_lock);
    return rc;
  }
  pthread_rwlock_unlock(&e->handler_lock);
  return mc_engine_queue_notify(e, from, msg, len, err);
}

#define NOTIFY_MAX_MSGS 65536

/* What one queued message costs (its copy, the sender's name, the node). */
static uint64_t notify_cost(const char *from, size_t len) {
  return (uint64_t)len + 1 + strlen(from) + 1 + sizeof(mc_notify_msg_t);
}

int mc_engine_queue_notify(mc_engine_t *e, const char *from, const void *msg, size_t len,
                           mc_err_t *err) {
  from = from ? from : "";
  uint64_t cost = notify_cost(from, len);
  /* Refuse before copying: the budget bounds what unread messages hold. */
  pthread_mutex_lock(&e->notify_mu);
  if (e->notify_count >= NOTIFY_MAX_MSGS || e->notify_bytes + cost > e->notify_limit) {
    uint64_t used = e->notify_bytes;
    size_t cnt = e->notify_count;
    e->notify_refused++;
    pthread_mutex_unlock(&e->notify_mu);
    return mc_err_set(err, MC_EBUSY,
                      "segment %s has %zu unread notifications (%llu bytes; budget %llu "
                      "bytes, MC_NOTIFY_QUEUE_MB, and %d messages): refused a %zu-byte "
                      "notification; the receiver must call get_notifies()",
                      e->name, cnt, (unsigned long long)used,
                      (unsigned long long)e->notify_limit, NOTIFY_MAX_MSGS, len);
  }
  e->notify_bytes += cost; /* reserved; given back below on failure */
  e->notify_count++;
  pthread_mutex_unlock(&e->notify_mu);
  mc_notify_msg_t *n = calloc(1, sizeof *n);
  if (n) {
    n->from = strdup(from);
    n->msg = malloc(len + 1);
  }
  if (!n || !n->from || !n->msg) {
    if (n) {
      free(n->from);
      free(n->msg);
      free(n);
    }
    pthread_mutex_lock(&e->notify_mu);
    e->notify_bytes -= cost;
    e->notify_count--;
    pthread_mutex_unlock(&e->notify_mu);
    return mc_err_set(err, MC_ENOMEM, "out of memory queueing a notification");
  }
  memcpy(n->msg, msg, len);
  n->msg[len] = '\0';
  n->len = len;
  pthread_mutex_lock(&e->notify_mu);
  if (e->notify_tail)
    e->notify_tail->next = n;
  else
    e->notify_head = n;
  e->notify_tail = n;
  pthread_mutex_unlock(&e->notify_mu);
  return 0;
}

/* ---- metadata entries and their liveness ---- */

/* Writes our segment descriptor, rpc entry and last-seen record (pub_mu
 * held).  refresh=0: PUT with the TTL; refresh=1: keep-alive (re-writes what
 * the server lost).  The rpc entry is PUT once per engine lifetime and
 * afterwards only kept alive (from_publish: not touched at all).  Returns
 * how many entries had to be re-created, or < 0. */
static int write_entries(mc_engine_t *e, int refresh, int from_publish, mc_err_t *err) {
  char key[512];
  const char *vals[2] = {e->pub_desc, e->pub_rpc};
  int (*keyfn[2])(const char *, char *, size_t) = {mc_meta_key_segment, mc_meta_key_rpc};
  int recreated = 0;
  /* The last-seen record goes first, so it never postdates the refresh of
   * the entries: "expired N s ago" is then never early. */
  if (e->meta_ttl_s > 0 && mc_meta_key_last_seen(e->name, key, sizeof key) == 0) {
    char ls[512];
    snprintf(ls, sizeof ls, "{\"name\":\"%s\",\"last_seen\":%lld,\"ttl\":%d}", e->name,
             (long long)time(NULL), e->meta_ttl_s);
    int rc = mc_meta_put(e->meta, key, ls, strlen(ls), err);
    if (rc < 0)
      return rc;
  }
  for (int i = 0; i < 2; i++) {
    /* The rpc entry (host and port) never changes while the engine lives:
     * PUT once, then only keep-alives.  Mooncake's own HTTP metadata
     * server refuses a second PUT of a rpc_meta key (HTTP 400). */
    int rpc = keyfn[i] == mc_meta_key_rpc;
    if (rpc && from_publish && e->rpc_written)
      continue;
    int ka = refresh || (rpc && e->rpc_written);
    if (keyfn[i](e->name, key, sizeof key) < 0)
      return mc_err_set(err, MC_EINVAL, "segment name %s makes a metadata key too long",
                        e->name);
    int rc = ka ? mc_meta_refresh(e->meta, key, vals[i], strlen(vals[i]), e->meta_ttl_s,
                                  err)
                : mc_meta_put_ttl(e->meta, key, vals[i], strlen(vals[i]), e->meta_ttl_s,
                                  err);
    if (rc < 0)
      return rc;
    if (rpc)
      e->rpc_written = 1;
    recreated += rc;
  }
  return recreated;
}

static int publish(mc_engine_t *e, mc_err_t *err) {
  if (!e->meta)
    return 0;
  size_t n = mc_regions_count(&e->regions);
  mc_region_t *snap = calloc(n ? n : 1, sizeof *snap);
  if (!snap)
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  n = mc_regions_snapshot(&e->regions, snap, n);
  char *desc = mc_segment_desc_encode(e->name, e->protocol, e->host, e->port, snap, n);
  free(snap);
  char *rpc = malloc(600);
  if (!desc || !rpc) {
    free(desc);
    free(rpc);
    return mc_err_set(err, MC_ENOMEM, "out of memory encoding the segment descriptor");
  }
  snprintf(rpc, 600, "{\"ip_or_host_name\":\"%s\",\"rpc_port\":%d}", e->host, e->port);
  pthread_mutex_lock(&e->pub_mu);
  /* Kept even if the PUT fails: the keep-alive then publishes this version. */
  free(e->pub_desc);
  free(e->pub_rpc);
  e->pub_desc = desc;
  e->pub_rpc = rpc;
  int rc = write_entries(e, 0, 1, err);
  e->pub_dirty = rc < 0;
  pthread_mutex_unlock(&e->pub_mu);
  return rc < 0 ? rc : 0;
}

/* The regions unregistered here whose descriptor update is pending (pub_mu). */
static int unpub_find(mc_engine_t *e, uint64_t addr) {
  for (size_t i = 0; i < e->nunpub; i++)
    if (e->unpub[i] == addr)
      return (int)i;
  return -1;
}

static void unpub_drop(mc_engine_t *e, uint64_t addr) {
  pthread_mutex_lock(&e->pub_mu);
  int i = unpub_find(e, addr);
  if (i >= 0)
    e->unpub[i] = e->unpub[--e->nunpub];
  pthread_mutex_unlock(&e->pub_mu);
}

static void unpub_add(mc_engine_t *e, uint64_t addr) {
  pthread_mutex_lock(&e->pub_mu);
  if (unpub_find(e, addr) < 0) {
    if (e->nunpub == e->cap_unpub) {
      size_t nc = e->cap_unpub ? e->cap_unpub * 2 : 8;
      uint64_t *nv = realloc(e->unpub, nc * sizeof *nv);
      if (nv) {
        e->unpub = nv;
        e->cap_unpub = nc;
      }
    }
    if (e->nunpub < e->cap_unpub) /* else: the retry reports "not registered" */
      e->unpub[e->nunpub++] = addr;
  }
  pthread_mutex_unlock(&e->pub_mu);
}

static void *keepalive_main(void *arg) {
  mc_engine_t *e = arg;
  long period_ms = e->meta_ttl_s * 1000L / 3;
  if (period_ms < 100)
    period_ms = 100;
  int failing = 0;
  pthread_mutex_lock(&e->ka_mu);
  while (!e->ka_stop) {
    struct timespec dl;
    clock_gettime(CLOCK_MONOTONIC, &dl);
    dl.tv_sec += period_ms / 1000;
    dl.tv_nsec += (period_ms % 1000) * 1000000L;
    if (dl.tv_nsec >= 1000000000L) {
      dl.tv_sec++;
      dl.tv_nsec -= 1000000000L;
    }
    while (!e->ka_stop && pthread_cond_timedwait(&e->ka_cv, &e->ka_mu, &dl) != ETIMEDOUT)
      ;
    if (e->ka_stop)
      break;
    pthread_mutex_unlock(&e->ka_mu);
    mc_err_t err = {0};
    pthread_mutex_lock(&e->pub_mu);
    /* A failed publish left the server with an older descriptor (maybe
     * still naming a region unregistered since): PUT ours again. */
    int dirty = e->pub_dirty;
    int rc = write_entries(e, !dirty, 0, &err);
    if (dirty && rc >= 0) {
      e->pub_dirty = 0;
      rc = 1;
    }
    pthread_mutex_unlock(&e->pub_mu);
    if (rc < 0 && !failing)
      mc_log_warn("keep-alive of segment %s failed (retrying every %ld ms; transfers to "
                  "peers already resolved keep working): %s",
                  e->name, period_ms, err.msg);
    else if (rc > 0 || (rc == 0 && failing))
      mc_log_info("segment %s is registered again on metadata server %s", e->name,
                  e->meta->url);
    failing = rc < 0;
    pthread_mutex_lock(&e->ka_mu);
  }
  pthread_mutex_unlock(&e->ka_mu);
  return NULL;
}

static int keepalive_start(mc_engine_t *e, mc_err_t *err) {
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&e->ka_cv, &ca);
  pthread_condattr_destroy(&ca);
  pthread_mutex_init(&e->ka_mu, NULL);
  e->ka_stop = 0;
  int rc = pthread_create(&e->ka_thread, NULL, keepalive_main, e);
  if (rc) {
    pthread_cond_destroy(&e->ka_cv);
    pthread_mutex_destroy(&e->ka_mu);
    return mc_err_sys(err, MC_ESYS, rc, "cannot start the metadata keep-alive thread");
  }
  e->ka_running = 1;
  return 0;
}

static void keepalive_stop(mc_engine_t *e) {
  if (!e->ka_running)
    return;
  pthread_mutex_lock(&e->ka_mu);
  e->ka_stop = 1;
  pthread_cond_signal(&e->ka_cv);
  pthread_mutex_unlock(&e->ka_mu);
  pthread_join(e->ka_thread, NULL);
  pthread_cond_destroy(&e->ka_cv);
  pthread_mutex_destroy(&e->ka_mu);
  e->ka_running = 0;
}

/* Removes our entries (clean shutdown: no last-seen record is left). */
static void unpublish(mc_engine_t *e) {
  char key[512];
  mc_err_t err;
  if (mc_meta_key_segment(e->name, key, sizeof key) == 0 &&
      mc_meta_del(e->meta, key, &err) < 0)
    mc_log_warn("could not remove segment %s from the metadata server: %s", e->name, err.msg);
  if (mc_meta_key_rpc(e->name, key, sizeof key) == 0)
    mc_meta_del(e->meta, key, &err);
  if (mc_meta_key_last_seen(e->name, key, sizeof key) == 0)
    mc_meta_del(e->meta, key, &err);
}

/* The "not registered" error of a lookup, told apart with the last-seen
 * record: expired N s ago (its engine died), recently refreshed (the server
 * lost it; re-registration pending), or no record at all. */
static int not_registered(mc_engine_t *e, const char *segment, mc_err_t *err) {
  char key[512], *val = NULL;
  size_t vlen = 0;
  mc_err_t tmp = {0};
  double last = -1, ttl = -1;
  if (mc_meta_key_last_seen(segment, key, sizeof key) == 0 &&
      mc_meta_get(e->meta, key, &val, &vlen, &tmp) == 0) {
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
                      segment, e->meta->url);
  long long now = (long long)time(NULL);
  long long ago = now - (long long)last, expired = now - (long long)(last + ttl);
  if (expired >= 0)
    return mc_err_set(err, MC_ENOTFOUND,
                      "segment %s is not registered (expired %lld s ago: its engine last "
                      "refreshed it %lld s ago with a TTL of %.0f s, so it died or lost the "
                      "metadata server) on metadata server %s",
                      segment, expired, ago, ttl, e->meta->url);
  return mc_err_set(err, MC_ENOTFOUND,
                    "segment %s is not registered (last refreshed %lld s ago, TTL %.0f s: "
                    "the metadata server probably restarted and its engine re-registers "
                    "within %.0f s) on metadata server %s",
                    segment, ago, ttl, ttl / 3 + 1, e->meta->url);
}

/* Our name "host:port" (brackets around an IPv6 host). */
void mc_engine_set_port(mc_engine_t *e, int port) {
  e->port = port;
  /* With port 0 the name is only known now; the loops read it on their
   * first HELLO, after this write (posted through their command queues). */
  snprintf(e->name, sizeof e->name, strchr(e->host, ':') ? "[%s]:%d" : "%s:%d", e->host, port);
}

/* The engine's own knobs (MC_*); the transports read theirs. */
static void read_knobs(mc_engine_t *e) {
  e->gpu_chunk = env_int("MC_GPU_CHUNK", 4096, 1, 1 << 30);
  e->gpu_first_chunk = env_int("MC_GPU_FIRST_CHUNK", 256, 1, 1 << 30);
  e->gpu_trace = env_int("MC_GPU_TRACE", 0, 0, 1);
  /* MC_LOCAL_CHECK=0 exists only to measure what the check costs
   * (benchmarks/run_tcp_bench.py --local-check-off); never turn it off. */
  e->local_check = env_int("MC_LOCAL_CHECK", 1, 0, 1);
  e->notify_limit = (uint64_t)env_int("MC_NOTIFY_QUEUE_MB", 64, 1, 1 << 20) << 20;
  e->unregister_wait_ms = env_int("MC_UNREGISTER_WAIT_MS", 10000, 1, 86400000);
  e->unregister_grace_ms = env_int("MC_UNREGISTER_GRACE_MS", 1000, 0, 86400000);
  e->unregister_revoke = env_int("MC_UNREGISTER_REVOKE", 1, 0, 1);
  e->slice_size = (uint64_t)env_int("MC_TCP_SLICE_SIZE", 4 << 20, 4096, 1 << 30);
  e->op_entries = (uint32_t)env_int("MC_TCP_OP_ENTRIES", 256, 1, (int)MC_XFER_MAX_ENTRIES);
  e->timeout_ms = (uint64_t)env_int("MC_TRANSFER_TIMEOUT", 30, 1, 86400) * 1000ull;
  e->spin_ns = (uint64_t)env_int("MC_WAIT_SPIN_US", 50, 0, 100000) * 1000ull;
  e->meta_ttl_s = env_int("MC_METADATA_TTL", 10, 0, MC_META_TTL_MAX);
}

/* The peer authentication secret: opts, else MC_AUTH_SECRET. */
static int take_secret(mc_engine_t *e, const mc_engine_opts_t *o, mc_err_t *err) {
  const char *secret = o->auth_secret ? o->auth_secret : getenv("MC_AUTH_SECRET");
  if (secret && strlen(secret) > MC_AUTH_SECRET_MAX)
    return mc_err_set(err, MC_ECONFIG, "the peer authentication secret (%s) is %zu bytes long; "
                      "at most %d are accepted", o->auth_secret ? "auth_secret" : "MC_AUTH_SECRET",
                      strlen(secret), MC_AUTH_SECRET_MAX);
  snprintf(e->auth_secret, sizeof e->auth_secret, "%s", secret ? secret : "");
  if (e->auth_secret[0] && strlen(e->auth_secret) < 16)
    mc_log_warn("the peer authentication secret is only %zu characters; a host that talks to "
                "this engine can test guesses offline, so use a random one of 32 or more (e.g. "
                "`openssl rand -hex 32`)", strlen(e->auth_secret));
  return 0;
}

/* An engine with its locks and empty tables: what mc_engine_destroy frees. */
static mc_engine_t *engine_alloc(void) {
  mc_engine_t *e = calloc(1, sizeof *e);
  if (!e)
    return NULL;
  if (mc_regions_init(&e->regions) < 0) {
    free(e);
    return NULL;
  }
  e->ctrl = -1;
  pthread_mutex_init(&e->seg_mu, NULL);
  pthread_mutex_init(&e->notify_mu, NULL);
  pthread_mutex_init(&e->det_mu, NULL);
  pthread_rwlock_init(&e->handler_lock, NULL);
  pthread_mutex_init(&e->pub_mu, NULL);
  pthread_mutex_init(&e->gpu_mu, NULL);
  pthread_mutex_init(&e->desc_mu, NULL);
  pthread_mutex_init(&e->route_mu, NULL);
  pthread_mutex_init(&e->pin_mu, NULL);
  return e;
}

int mc_engine_create(const mc_engine_opts_t *o, mc_engine_t **out, mc_err_t *err) {
  if (!o || !o->local_hostname || !o->metadata_server)
    return mc_err_set(err, MC_EINVAL, "local_hostname and metadata_server are required");
  const char *proto = o->protocol && *o->protocol ? o->protocol : mc_protocol_default();
  mc_hostport_t hp;
  int rc = mc_protocol_check(proto, err);
  if (rc < 0)
    return rc;
  if ((rc = mc_hostport_parse(o->local_hostname, &hp, err)) < 0)
    return mc_err_prefix(err, "local_hostname");
  mc_engine_t *e = engine_alloc();
  if (!e)
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  snprintf(e->host, sizeof e->host, "%s", hp.host);
  snprintf(e->protocol, sizeof e->protocol, "%s", proto);
  read_knobs(e);
  /* GPU staging: no CUDA call until GPU memory is used. */
  if ((rc = mc_gpu_stager_create((size_t)env_int("MC_GPU_STAGING_MB", 64, 4, 65536) << 20,
                                 &e->gpu, err)) < 0)
    goto fail;
  e->p2p = !strcmp(o->metadata_server, "P2PHANDSHAKE");
  if (!e->p2p && (rc = mc_meta_open(o->metadata_server, &e->meta, err)) < 0)
    goto fail;
  if ((rc = take_secret(e, o, err)) < 0)
    goto fail;
  e->tconf = (mc_transport_conf_t){.protocol = e->protocol, .host = e->host, .port = hp.port,
                                   .device_name = o->device_name, .io_threads = o->io_threads,
                                   .conns_per_peer = o->conns_per_peer,
                                   .auth_secret = e->auth_secret,
                                   .same_host_cpu_off = o->same_host_cpu_off != 0};
  /* The name must exist before the control transport starts: HELLO checks it. */
  if (hp.port > 0)
    mc_engine_set_port(e, hp.port);
  if ((rc = mc_transports_start(e, err)) < 0)
    goto fail;
  e->tconf.device_name = NULL; /* the caller's string */
  if ((rc = publish(e, err)) < 0) {
    mc_err_prefix(err, "cannot publish segment %s", e->name);
    goto fail;
  }
  e->published = e->meta != NULL;
  if (e->meta && e->meta_ttl_s > 0 && (rc = keepalive_start(e, err)) < 0)
    goto fail;
  mc_log_info("engine %s up (protocol %s, metadata %s)", e->name, e->protocol,
              o->metadata_server);
  *out = e;
  return 0;
fail:
  mc_engine_destroy(e);
  return rc;
}

/* Also the failure path of mc_engine_create: each step undoes only what
 * was done. */
void mc_engine_destroy(mc_engine_t *e) {
  if (!e)
    return;
  keepalive_stop(e);
  if (e->published)
    unpublish(e);
  mc_transports_stop(e); /* control first: no handshake RPC reaches the others after */
  mc_engine_reap_detached(e, 1); /* every op is done now */
  mc_gpu_stager_destroy(e->gpu); /* after the transport: it drained the copies */
  if (e->meta)
    mc_meta_close(e->meta);
  mc_regions_destroy(&e->regions);
  while (e->notify_head) {
    mc_notify_msg_t *n = e->notify_head;
    e->notify_head = n->next;
    free(n->from);
    free(n->msg);
    free(n);
  }
  free(e->segs);
  pthread_mutex_destroy(&e->seg_mu);
  pthread_mutex_destroy(&e->notify_mu);
  pthread_mutex_destroy(&e->det_mu);
  pthread_rwlock_destroy(&e->handler_lock);
  pthread_mutex_destroy(&e->pub_mu);
  pthread_mutex_destroy(&e->gpu_mu);
  pthread_mutex_destroy(&e->route_mu);
  pthread_mutex_destroy(&e->pin_mu);
  pthread_mutex_destroy(&e->desc_mu);
  free(e->desc_cache);
  free(e->pub_desc);
  free(e->pub_rpc);
  free(e->unpub);
  free(e);
}

const char *mc_engine_segment_name(const mc_engine_t *e) { return e->name; }
int mc_engine_rpc_port(const mc_engine_t *e) { return e->port; }

static uint64_t regions_version(mc_regions_t *r) {
  pthread_mutex_lock(&r->mu);
  uint64_t v = r->version;
  pthread_mutex_unlock(&r->mu);
  return v;
}

/* Same-host peers ask for this with every GPU transfer (the check): the
 * text is kept for the regions' version (bumped on every change, a region
 * starting to be removed included) and built again only after a change. */
char *mc_engine_describe(mc_engine_t *e) {
  uint64_t v = regions_version(&e->regions);
  pthread_mutex_lock(&e->desc_mu);
  char *d = e->desc_cache && e->desc_cache_ver == v ? strdup(e->desc_cache) : NULL;
  pthread_mutex_unlock(&e->desc_mu);
  if (d)
    return d;
  size_t n = mc_regions_count(&e->regions);
  mc_region_t *snap = calloc(n ? n : 1, sizeof *snap);
  if (!snap)
    return NULL;
  n = mc_regions_snapshot(&e->regions, snap, n);
  d = mc_segment_desc_encode(e->name, e->protocol, e->host, e->port, snap, n);
  free(snap);
  /* Unchanged around the snapshot: the text belongs to version v. */
  if (d && e->port && regions_version(&e->regions) == v) {
    char *keep = strdup(d);
    pthread_mutex_lock(&e->desc_mu);
    if (keep) {
      free(e->desc_cache);
      e->desc_cache = keep;
      e->desc_cache_ver = v;
    }
    pthread_mutex_unlock(&e->desc_mu);
  }
  return d;
}

int mc_engine_describe_peer(mc_engine_t *e, const char *segment, int64_t timeout_ms,
                            char **out, mc_err_t *err) {
  *out = NULL;
  if (!segment || !*segment)
    return mc_err_set(err, MC_EINVAL, "segment name is empty");
  if (!strcmp(segment, e->name)) {
    *out = mc_engine_describe(e);
    return *out ? 0 : mc_err_set(err, MC_ENOMEM, "out of memory describing segment %s", e->name);
  }
  return mc_engine_rpc(e, segment, MC_RPC_DESCRIBE, strlen(MC_RPC_DESCRIBE), timeout_ms, out,
                       err);
}

/* Checks the claimed location of [addr, addr+len) against where the memory
 * really is, and resolves "*"/"" to it.  GPU memory is detected through the
 * CUDA driver when one is installed; *dev is its device or -1. */
static int resolve_location(uint64_t addr, uint64_t len, const char *claim, char *out,
                            size_t outlen, int *dev, mc_err_t *err) {
  int wildcard = !claim || !*claim || !strcmp(claim, "*");
  int claims_cuda = !wildcard && !strncmp(claim, "cuda", 4);
  *dev = -1;
  if (claims_cuda && !mc_dynlib_open(&mc_dynlib_cuda, err))
    return err ? err->code : MC_EUNAVAIL;
  int rc = mc_cuda_locate(addr, len, dev, err);
  if (rc < 0)
    return rc;
  if (rc == 1) {
    char want[32];
    snprintf(want, sizeof want, "cuda:%d", *dev);
    if (!wildcard && strcmp(claim, want) != 0)
      return mc_err_set(err, MC_EINVAL,
                        "0x%llx is GPU memory on %s, not \"%s\"; register it with location "
                        "\"%s\" (or \"*\" to detect it)",
                        (unsigned long long)addr, want, claim, want);
    snprintf(out, outlen, "%s", want);
    return 0;
  }
  *dev = -1;
  if (claims_cuda)
    return mc_err_set(err, MC_EINVAL,
                      "0x%llx is host memory, not GPU memory on \"%s\"; register it with "
                      "location \"cpu\" (or \"*\" to detect it)",
                      (unsigned long long)addr, claim);
  snprintf(out, outlen, "%s", wildcard ? "cpu" : claim);
  return 0;
}

/* Adds one region; cuda regions get their IPC export (same-host peers) and,
 * the first time, the pinned staging pool (so I/O threads never allocate
 * pinned memory in the common case). */
/* *maps: the process's mappings, read on the first host region of a call
 * (the caller frees them).  GPU regions are checked by the driver instead
 * (resolve_location asks it where the range lives). */
static int add_region(mc_engine_t *e, uint64_t addr, uint64_t len, const char *location,
                      char loc[MC_LOCATION_MAX], mc_maps_t **maps, mc_err_t *err) {
  int dev = -1;
  int rc = resolve_location(addr, len, location, loc, MC_LOCATION_MAX, &dev, err);
  if (rc < 0)
    return rc;
  if (dev < 0 && len > 0 && addr + len > addr) {
    if (!*maps && !(*maps = mc_maps_load(err)))
      return err ? err->code : MC_ESYS;
    if ((rc = mc_maps_check(*maps, addr, len, err)) < 0)
      return rc;
  }
  char ipc[MC_GPU_IPC_B64_MAX] = "";
  uint64_t ipc_base = 0;
  if (dev >= 0) {
    mc_err_t why = {0};
    mc_cuda_use_device(dev, NULL); /* the default for our threads' pointer queries */
    if (mc_gpu_ipc_export_range(addr, len, dev, ipc, &ipc_base, &why) < 0) {
      ipc[0] = '\0';
      mc_log_info("%s", why.msg);
    }
    pthread_mutex_lock(&e->gpu_mu);
    int first = !e->gpu_reserved;
    e->gpu_reserved = 1;
    pthread_mutex_unlock(&e->gpu_mu);
    if (first && mc_gpu_stager_reserve(e->gpu, dev, 32u << 20, &why) < 0)
      mc_log_warn("GPU staging pool not pre-allocated: %s", why.msg);
  }
  return mc_regions_add_ex(&e->regions, addr, len, loc, ipc, ipc_base, err);
}

/* An unregister waited its grace period (MC_UNREGISTER_GRACE_MS): this
 * engine's own transfers that use the region as their local buffer are
 * canceled (they end MC_ECANCELED), so freeing it never waits on them long. */
static void on_unregister_stall(void *arg, mc_region_t *reg) {
  mc_engine_t *e = arg;
  size_t n = mc_engine_cancel_local_users(e, reg);
  if (n)
    mc_log_warn("unregistering region 0x%llx (%llu bytes): canceled %zu batch(es) of this "
                "engine still using it as their local buffer after %d ms",
                (unsigned long long)reg->addr, (unsigned long long)reg->len, n,
                e->unregister_grace_ms);
  /* Peers still holding it (a READ answer they do not read out, a WRITE
   * payload they stopped sending) lose their connection: the TCP loops
   * close it at the sweep (tcp_loop.c), which releases their pins. */
  if (e->unregister_revoke) {
    char holder[sizeof reg->holder];
    mc_regions_lock(&e->regions);
    snprintf(holder, sizeof holder, "%s", reg->holder);
    __atomic_store_n(&reg->revoked, 1, __ATOMIC_RELEASE);
    mc_regions_unlock(&e->regions);
    mc_log_warn("unregistering region 0x%llx (%llu bytes): still in use after %d ms (last "
                "pinned by %s): revoking the peers' accesses to it (MC_UNREGISTER_REVOKE=0 "
                "waits instead)",
                (unsigned long long)reg->addr, (unsigned long long)reg->len,
                e->unregister_grace_ms, holder[0] ? holder : "?");
    mc_transports_cancel_sweep(e);
  }
}

/* Takes the region starting at addr out of the transports and the table,
 * waiting for (then cutting) accesses in flight.  After 0 nothing reaches
 * the memory any more; the metadata is not touched. */
static int unregister_local(mc_engine_t *e, void *addr, mc_err_t *err) {
  int rc = mc_transports_unregister(e, addr, e->unregister_wait_ms, err);
  if (rc == 0)
    rc = mc_regions_remove_cb(&e->regions, (uint64_t)(uintptr_t)addr, e->unregister_wait_ms,
                              e->unregister_grace_ms, on_unregister_stall, e, err);
  return rc;
}

/* A registration whose publish failed is undone: nothing of it stays
 * registered or (once the metadata server answers again) published. */
static int register_undo(mc_engine_t *e, void *addr, mc_err_t *err) {
  mc_err_t why = {0};
  if (unregister_local(e, addr, &why) < 0) {
    mc_log_warn("registration of 0x%llx failed and could not be undone: %s",
                (unsigned long long)(uintptr_t)addr, why.msg);
    return mc_err_prefix(err, "region 0x%llx stays registered (undo failed: %s)",
                         (unsigned long long)(uintptr_t)addr, why.msg);
  }
  /* Our descriptor without it; if this PUT fails too, the keep-alive
   * re-PUTs it (pub_dirty), replacing a descriptor that did reach the server. */
  publish(e, &why);
  return mc_err_prefix(err, "registration of 0x%llx undone (nothing registered)",
                       (unsigned long long)(uintptr_t)addr);
}

int mc_engine_register(mc_engine_t *e, void *addr, uint64_t len, const char *location,
                       mc_err_t *err) {
  char loc[MC_LOCATION_MAX];
  mc_maps_t *maps = NULL;
  int rc = add_region(e, (uint64_t)(uintptr_t)addr, len, location, loc, &maps, err);
  mc_maps_free(maps);
  if (rc < 0)
    return rc;
  if ((rc = mc_transports_register(e, addr, len, loc, err)) < 0) {
    mc_regions_remove(&e->regions, (uint64_t)(uintptr_t)addr, -1, NULL);
    return rc;
  }
  unpub_drop(e, (uint64_t)(uintptr_t)addr);
  if ((rc = publish(e, err)) < 0) {
    int code = rc;
    register_undo(e, addr, err);
    return code;
  }
  return 0;
}

int mc_engine_register_batch(mc_engine_t *e, void *const *addrs, const uint64_t *lens,
                             size_t n, const char *location, mc_err_t *err) {
  int rc = 0;
  mc_maps_t *maps = NULL;
  for (size_t i = 0; i < n; i++) {
    char loc[MC_LOCATION_MAX];
    rc = add_region(e, (uint64_t)(uintptr_t)addrs[i], lens[i], location, loc, &maps, err);
    if (rc == 0 && (rc = mc_transports_register(e, addrs[i], lens[i], loc, err)) < 0)
      mc_regions_remove(&e->regions, (uint64_t)(uintptr_t)addrs[i], -1, NULL);
    if (rc < 0) {
      mc_maps_free(maps);
      mc_err_prefix(err, "buffer %zu of %zu", i, n);
      for (size_t k = 0; k < i; k++) { /* all or nothing */
        mc_transports_unregister(e, addrs[k], e->unregister_wait_ms, NULL);
        mc_regions_remove(&e->regions, (uint64_t)(uintptr_t)addrs[k], -1, NULL);
      }
      return rc;
    }
  }
  mc_maps_free(maps);
  for (size_t i = 0; i < n; i++)
    unpub_drop(e, (uint64_t)(uintptr_t)addrs[i]);
  if ((rc = publish(e, err)) < 0) {
    int code = rc;
    mc_err_t why = {0};
    size_t kept = 0;
    for (size_t k = 0; k < n; k++)
      kept += unregister_local(e, addrs[k], &why) < 0;
    publish(e, &why);
    if (kept)
      mc_err_prefix(err, "registration of %zu buffers undone except %zu still in use", n, kept);
    else
      mc_err_prefix(err, "registration of %zu buffers undone (nothing registered)", n);
    return code;
  }
  return 0;
}

int mc_engine_is_registered(mc_engine_t *e, void *addr) {
  uint64_t a = (uint64_t)(uintptr_t)addr;
  mc_regions_lock(&e->regions);
  int found = 0;
  for (size_t i = 0; i < e->regions.n && !found; i++)
    found = e->regions.v[i]->addr == a;
  mc_regions_unlock(&e->regions);
  return found;
}

int mc_engine_unregister(mc_engine_t *e, void *addr, mc_err_t *err) {
  /* The transports first (same-host copies in flight may refuse it: the
   * region then stays registered), e.g. RDMA MRs deregistered revoke
   * access; then the region table waits for the TCP path's pins, cancels
   * this engine's transfers still using it after the grace period (and
   * names an address that starts no region). */
  uint64_t a = (uint64_t)(uintptr_t)addr;
  mc_err_t nf = {0};
  int rc = unregister_local(e, addr, &nf);
  if (rc == MC_ENOTFOUND) {
    /* Unregistered before, its descriptor update failed: retry that. */
    pthread_mutex_lock(&e->pub_mu);
    int pending = unpub_find(e, a) >= 0;
    pthread_mutex_unlock(&e->pub_mu);
    if (!pending) {
      if (err)
        *err = nf;
      return rc;
    }
  } else if (rc < 0) {
    if (err)
      *err = nf;
    return rc;
  }
  if ((rc = publish(e, err)) < 0) {
    unpub_add(e, a);
    return mc_err_prefix(err, "region 0x%llx is unregistered here (no peer can reach it any "
                         "more) but its removal from the published descriptor failed; call "
                         "unregister again (free_managed_buffer) to retry",
                         (unsigned long long)a);
  }
  unpub_drop(e, a);
  return 0;
}

/* ---- segment resolution ---- */

/* P2P handshake: a peer not yet known must accept a connection on its rpc
 * port before a submit to it is accepted (as Mooncake's P2P mode fails the
 * submit, not the later status, for an unknown peer).  One connect, closed
 * at once; bounded by MC_P2P_HANDSHAKE_TIMEOUT_MS (default 2000). */
static int p2p_handshake(const char *segment, const char *host, int port, mc_err_t *err) {
  int timeout_ms = (int)env_int("MC_P2P_HANDSHAKE_TIMEOUT_MS", 2000, 1, 600000);
  char ports[16];
  snprintf(ports, sizeof ports, "%d", port);
  struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *ai = NULL;
  int gai = getaddrinfo(host, ports, &hints, &ai);
  if (gai)
    return mc_err_set(err, MC_ECONNECT, "P2P handshake with segment %s failed: cannot resolve "
                      "host %s: %s", segment, host, gai_strerror(gai));
  int why = ETIMEDOUT;
  for (struct addrinfo *a = ai; a; a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      why = errno;
      continue;
    }
    int rc = connect(fd, a->ai_addr, a->ai_addrlen);
    if (rc < 0 && errno == EINPROGRESS) {
      struct pollfd p = {.fd = fd, .events = POLLOUT};
      int pr;
      do
        pr = poll(&p, 1, timeout_ms);
      while (pr < 0 && errno == EINTR);
      if (pr == 1) {
        int so = 0;
        socklen_t sl = sizeof so;
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &so, &sl);
        rc = so ? -1 : 0;
        errno = so;
      } else {
        errno = pr == 0 ? ETIMEDOUT : errno;
        rc = -1;
      }
    }
    if (rc < 0)
      why = errno;
    close(fd);
    if (rc == 0) {
      freeaddrinfo(ai);
      return 0;
    }
  }
  freeaddrinfo(ai);
  return mc_err_sys(err, MC_ECONNECT, why, "P2P handshake with segment %s failed: no engine "
                    "accepts connections at %s:%d within %d ms (MC_P2P_HANDSHAKE_TIMEOUT_MS); "
                    "is the peer initialized with that rpc port (get_rpc_port())?",
                    segment, host, port, timeout_ms);
}

int mc_engine_resolve(mc_engine_t *e, const char *segment, mc_segment_desc_t *out,
                      mc_err_t *err) {
  pthread_mutex_lock(&e->seg_mu);
  for (size_t i = 0; i < e->nsegs; i++) {
    if (!strcmp(e->segs[i].name, segment)) {
      *out = e->segs[i];
      pthread_mutex_unlock(&e->seg_mu);
      return 0;
    }
  }
  pthread_mutex_unlock(&e->seg_mu);

  mc_segment_desc_t d = {0};
  if (strlen(segment) >= sizeof d.name)
    return mc_err_set(err, MC_EINVAL, "segment name is too long");
  if (e->p2p) {
    mc_hostport_t hp;
    if (mc_hostport_parse(segment, &hp, err) < 0 || hp.port < 0)
      return mc_err_set(err, MC_EINVAL,
                        "segment \"%s\" is not \"host:port\"; in P2P mode a segment is named by "
                        "its host and rpc port (get_rpc_port())",
                        segment);
    snprintf(d.name, sizeof d.name, "%s", segment);
    snprintf(d.host, sizeof d.host, "%s", hp.host);
    d.port = hp.port;
    snprintf(d.protocol, sizeof d.protocol, "%s", e->protocol);
    int rc = p2p_handshake(segment, d.host, d.port, err);
    if (rc < 0)
      return rc;
  } else {
    char key[512], *val = NULL;
    size_t vlen = 0;
    mc_meta_key_segment(segment, key, sizeof key);
    int rc = mc_meta_get(e->meta, key, &val, &vlen, err);
    if (rc == MC_ENOTFOUND)
      return not_registered(e, segment, err);
    if (rc < 0)
      return rc;
    rc = mc_segment_desc_decode(val, vlen, segment, &d, err);
    free(val);
    if (rc < 0)
      return rc;
    if (strcmp(d.protocol, e->protocol) != 0)
      return mc_err_set(err, MC_EUNAVAIL, "segment %s speaks protocol \"%s\"; this engine "
                        "speaks \"%s\" (use the same protocol on both sides)", segment,
                        d.protocol, e->protocol);
  }
  pthread_mutex_lock(&e->seg_mu);
  if (e->nsegs == e->cap_segs) {
    size_t nc = e->cap_segs ? e->cap_segs * 2 : 8;
    mc_segment_desc_t *nv = realloc(e->segs, nc * sizeof *nv);
    if (nv) {
      e->segs = nv;
      e->cap_segs = nc;
    }
  }
  if (e->nsegs < e->cap_segs)
    e->segs[e->nsegs++] = d;
  pthread_mutex_unlock(&e->seg_mu);
  *out = d;
  return 0;
}

void mc_engine_forget_segment(mc_engine_t *e, const char *segment) {
  pthread_mutex_lock(&e->seg_mu);
  for (size_t i = 0; i < e->nsegs; i++) {
    if (!strcmp(e->segs[i].name, segment)) {
      e->segs[i] = e->segs[--e->nsegs];
      break;
    }
  }
  pthread_mutex_unlock(&e->seg_mu);
}

/* ---- notifications ---- */

void mc_engine_get_stats(mc_engine_t *e, mc_engine_stats_t *out) {
  memset(out, 0, sizeof *out);
  pthread_mutex_lock(&e->notify_mu);
  out->notify_queue_bytes = e->notify_bytes;
  out->notify_queue_limit = e->notify_limit;
  out->notify_queue_msgs = e->notify_count;
  out->notify_refused = e->notify_refused;
  pthread_mutex_unlock(&e->notify_mu);
  mc_engine_reap_detached(e, 0);
  pthread_mutex_lock(&e->det_mu);
  out->detached_msgs = e->ndet;
  out->detached_bytes = e->det_bytes;
  pthread_mutex_unlock(&e->det_mu);
  mc_transports_stats(e, &out->transport);
}

size_t mc_engine_drain_notifies(mc_engine_t *e, size_t max, mc_notify_cb cb, void *arg) {
  size_t k = 0;
  while (k < max) {
    pthread_mutex_lock(&e->notify_mu);
    mc_notify_msg_t *n = e->notify_head;
    if (n) {
      e->notify_head = n->next;
      if (!e->notify_head)
        e->notify_tail = NULL;
      e->notify_count--;
      e->notify_bytes -= notify_cost(n->from, n->len);
    }
    pthread_mutex_unlock(&e->notify_mu);
    if (!n)
      break;
    cb(arg, n->from, n->msg, n->len);
    free(n->from);
    free(n->msg);
    free(n);
    k++;
  }
  return k;
}
