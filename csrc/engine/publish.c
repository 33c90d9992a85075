/* Publishing our segment to the metadata server: the descriptor (also the
 * mc.describe answer), our entries and their liveness (keep-alive), the
 * regions whose removal is still to be published. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/engine_internal.h"
#include "util/array.h"
#include "util/log.h"


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

int mc_engine_publish(mc_engine_t *e, mc_err_t *err) {
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
int mc_unpub_find(mc_engine_t *e, uint64_t addr) {
  for (size_t i = 0; i < e->nunpub; i++)
    if (e->unpub[i] == addr)
      return (int)i;
  return -1;
}

void mc_unpub_drop(mc_engine_t *e, uint64_t addr) {
  pthread_mutex_lock(&e->pub_mu);
  int i = mc_unpub_find(e, addr);
  if (i >= 0)
    e->unpub[i] = e->unpub[--e->nunpub];
  pthread_mutex_unlock(&e->pub_mu);
}

void mc_unpub_add(mc_engine_t *e, uint64_t addr) {
  pthread_mutex_lock(&e->pub_mu);
  if (mc_unpub_find(e, addr) < 0) {
    uint64_t *nv = mc_array_room(e->unpub, e->nunpub, &e->cap_unpub, sizeof *nv, 8);
    if (nv)
      e->unpub = nv;
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

int mc_keepalive_start(mc_engine_t *e, mc_err_t *err) {
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

void mc_keepalive_stop(mc_engine_t *e) {
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
void mc_engine_unpublish(mc_engine_t *e) {
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
  d = mc_segment_desc_encode_live(e->name, e->protocol, e->host, e->port, snap, n, &e->regions,
                                  v);
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
