/* Engine lifecycle, the local segment, segment resolution, notifications. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"
#include "transport/tcp/wire.h"
#include "util/dynlib.h"
#include "util/hostport.h"
#include "util/log.h"

static int env_int(const char *name, int dflt, int lo, int hi) {
  const char *s = getenv(name);
  if (!s || !*s)
    return dflt;
  char *end;
  long v = strtol(s, &end, 10);
  if (*end || v < lo || v > hi) {
    mc_log_warn("ignoring %s=\"%s\": expected an integer in %d..%d; using %d", name, s, lo, hi,
                dflt);
    return dflt;
  }
  return (int)v;
}

static void on_notify(void *ctx, const char *from, const void *msg, size_t len) {
  mc_engine_t *e = ctx;
  mc_notify_msg_t *n = calloc(1, sizeof *n);
  if (!n)
    return;
  n->from = strdup(from ? from : "");
  n->msg = malloc(len + 1);
  if (!n->from || !n->msg) {
    free(n->from);
    free(n->msg);
    free(n);
    return;
  }
  memcpy(n->msg, msg, len);
  n->msg[len] = '\0';
  n->len = len;
  pthread_mutex_lock(&e->notify_mu);
  if (e->notify_count >= 65536) { /* bounded: drop the oldest */
    mc_notify_msg_t *old = e->notify_head;
    e->notify_head = old->next;
    if (!e->notify_head)
      e->notify_tail = NULL;
    e->notify_count--;
    free(old->from);
    free(old->msg);
    free(old);
    mc_log_warn("notification queue full; dropped the oldest message");
  }
  if (e->notify_tail)
    e->notify_tail->next = n;
  else
    e->notify_head = n;
  e->notify_tail = n;
  e->notify_count++;
  pthread_mutex_unlock(&e->notify_mu);
}

static int publish(mc_engine_t *e, mc_err_t *err) {
  if (!e->meta)
    return 0;
  size_t n = mc_regions_count(&e->regions);
  mc_region_t *snap = calloc(n ? n : 1, sizeof *snap);
  if (!snap)
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  n = mc_regions_snapshot(&e->regions, snap, n);
  char *desc = mc_segment_desc_encode(e->name, "tcp", e->host, e->port, snap, n);
  free(snap);
  if (!desc)
    return mc_err_set(err, MC_ENOMEM, "out of memory encoding the segment descriptor");
  char key[512];
  mc_meta_key_segment(e->name, key, sizeof key);
  int rc = mc_meta_put(e->meta, key, desc, strlen(desc), err);
  free(desc);
  if (rc < 0)
    return rc;
  char rpc[600];
  snprintf(rpc, sizeof rpc, "{\"ip_or_host_name\":\"%s\",\"rpc_port\":%d}", e->host, e->port);
  mc_meta_key_rpc(e->name, key, sizeof key);
  return mc_meta_put(e->meta, key, rpc, strlen(rpc), err);
}

int mc_engine_create(const mc_engine_opts_t *o, mc_engine_t **out, mc_err_t *err) {
  if (!o || !o->local_hostname || !o->metadata_server)
    return mc_err_set(err, MC_EINVAL, "local_hostname and metadata_server are required");
  const char *proto = o->protocol && *o->protocol ? o->protocol : "tcp";
  if (!strcmp(proto, "rdma")) {
    /* The verbs libraries are loaded only now, when RDMA is asked for. */
    if (!mc_dynlib_open(&mc_dynlib_ibverbs, err) || !mc_dynlib_open(&mc_dynlib_rdmacm, err))
      return err ? err->code : MC_EUNAVAIL;
    return mc_err_set(err, MC_EUNAVAIL,
                      "protocol \"rdma\" is not available in this build yet (device_name "
                      "\"%s\"); use protocol \"tcp\" — there is no silent fallback",
                      o->device_name ? o->device_name : "");
  }
  if (strcmp(proto, "tcp") != 0)
    return mc_err_set(err, MC_EINVAL, "protocol \"%s\" is not accepted; use \"tcp\" or \"rdma\"",
                      proto);
  mc_hostport_t hp;
  int rc = mc_hostport_parse(o->local_hostname, &hp, err);
  if (rc < 0)
    return mc_err_prefix(err, "local_hostname");

  mc_engine_t *e = calloc(1, sizeof *e);
  if (!e)
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  snprintf(e->host, sizeof e->host, "%s", hp.host);
  pthread_mutex_init(&e->seg_mu, NULL);
  pthread_mutex_init(&e->notify_mu, NULL);
  if ((rc = mc_regions_init(&e->regions)) < 0) {
    free(e);
    return mc_err_set(err, rc, "out of memory");
  }
  e->slice_size = (uint64_t)env_int("MC_TCP_SLICE_SIZE", 4 << 20, 4096, 1 << 30);
  e->op_entries = (uint32_t)env_int("MC_TCP_OP_ENTRIES", 256, 1, (int)MC_WIRE_MAX_ENTRIES);
  e->timeout_ms = (uint64_t)env_int("MC_TRANSFER_TIMEOUT", 30, 1, 86400) * 1000ull;
  e->spin_ns = (uint64_t)env_int("MC_WAIT_SPIN_US", 50, 0, 100000) * 1000ull;

  e->p2p = !strcmp(o->metadata_server, "P2PHANDSHAKE");
  if (!e->p2p && (rc = mc_meta_open(o->metadata_server, &e->meta, err)) < 0)
    goto fail;

  mc_tcp_opts_t topts = {
      .bind_host = getenv("MC_TCP_BIND_ADDRESS"),
      .port = hp.port > 0 ? hp.port : 0,
      .io_threads = o->io_threads ? o->io_threads : env_int("MC_TCP_IO_THREADS", 1, 1, 64),
      .conns_per_peer =
          o->conns_per_peer ? o->conns_per_peer : env_int("MC_TCP_CONNS_PER_PEER", 1, 1, 64),
      .connect_timeout_ms = env_int("MC_CONNECT_TIMEOUT_MS", 5000, 1, 600000),
      .busy_poll_us = env_int("MC_TCP_BUSY_POLL_US", 0, 0, 1000000),
  };
  /* The name must exist before the transport starts: HELLO checks it. */
  mc_tcp_hooks_t hooks = {.ctx = e, .local_name = e->name, .regions = &e->regions,
                          .on_notify = on_notify};
  if (hp.port > 0)
    snprintf(e->name, sizeof e->name, strchr(hp.host, ':') ? "[%s]:%d" : "%s:%d", hp.host,
             hp.port);
  if ((rc = mc_tcp_start(&topts, &hooks, &e->tcp, err)) < 0)
    goto fail;
  e->port = mc_tcp_port(e->tcp);
  /* With port 0 the name is only known now; the loops read it on their
   * first HELLO, after this write (posted through their command queues). */
  snprintf(e->name, sizeof e->name, strchr(hp.host, ':') ? "[%s]:%d" : "%s:%d", hp.host,
           e->port);
  if ((rc = publish(e, err)) < 0) {
    mc_err_prefix(err, "cannot publish segment %s", e->name);
    goto fail;
  }
  mc_log_info("engine %s up (protocol tcp, metadata %s)", e->name, o->metadata_server);
  *out = e;
  return 0;
fail:
  if (e->tcp)
    mc_tcp_stop(e->tcp);
  if (e->meta)
    mc_meta_close(e->meta);
  mc_regions_destroy(&e->regions);
  pthread_mutex_destroy(&e->seg_mu);
  pthread_mutex_destroy(&e->notify_mu);
  free(e);
  return rc;
}

void mc_engine_destroy(mc_engine_t *e) {
  if (!e)
    return;
  if (e->meta) {
    char key[512];
    mc_err_t err;
    mc_meta_key_segment(e->name, key, sizeof key);
    if (mc_meta_del(e->meta, key, &err) < 0)
      mc_log_warn("could not remove segment %s from the metadata server: %s", e->name, err.msg);
    mc_meta_key_rpc(e->name, key, sizeof key);
    mc_meta_del(e->meta, key, &err);
  }
  mc_tcp_stop(e->tcp);
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
  free(e);
}

const char *mc_engine_segment_name(const mc_engine_t *e) { return e->name; }
int mc_engine_rpc_port(const mc_engine_t *e) { return e->port; }

char *mc_engine_describe(mc_engine_t *e) {
  size_t n = mc_regions_count(&e->regions);
  mc_region_t *snap = calloc(n ? n : 1, sizeof *snap);
  if (!snap)
    return NULL;
  n = mc_regions_snapshot(&e->regions, snap, n);
  char *d = mc_segment_desc_encode(e->name, "tcp", e->host, e->port, snap, n);
  free(snap);
  return d;
}

static int check_location(const char *location, mc_err_t *err) {
  if (location && !strncmp(location, "cuda", 4) && !mc_dynlib_open(&mc_dynlib_cuda, err))
    return err ? err->code : MC_EUNAVAIL;
  if (location && !strncmp(location, "cuda", 4))
    return mc_err_set(err, MC_EUNAVAIL,
                      "location \"%s\": GPU memory registration is not available in this "
                      "build yet; register host memory (\"cpu\")",
                      location);
  return 0;
}

int mc_engine_register(mc_engine_t *e, void *addr, uint64_t len, const char *location,
                       mc_err_t *err) {
  int rc = check_location(location, err);
  if (rc < 0)
    return rc;
  rc = mc_regions_add(&e->regions, (uint64_t)(uintptr_t)addr, len, location, err);
  if (rc < 0)
    return rc;
  return publish(e, err);
}

int mc_engine_register_batch(mc_engine_t *e, void *const *addrs, const uint64_t *lens,
                             size_t n, const char *location, mc_err_t *err) {
  int rc = check_location(location, err);
  if (rc < 0)
    return rc;
  for (size_t i = 0; i < n; i++) {
    rc = mc_regions_add(&e->regions, (uint64_t)(uintptr_t)addrs[i], lens[i], location, err);
    if (rc < 0) {
      mc_err_prefix(err, "buffer %zu of %zu", i, n);
      for (size_t k = 0; k < i; k++) /* all or nothing */
        mc_regions_remove(&e->regions, (uint64_t)(uintptr_t)addrs[k], NULL);
      return rc;
    }
  }
  return publish(e, err);
}

int mc_engine_unregister(mc_engine_t *e, void *addr, mc_err_t *err) {
  int rc = mc_regions_remove(&e->regions, (uint64_t)(uintptr_t)addr, err);
  if (rc < 0)
    return rc;
  return publish(e, err);
}

/* ---- segment resolution ---- */

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
    snprintf(d.protocol, sizeof d.protocol, "tcp");
  } else {
    char key[512], *val = NULL;
    size_t vlen = 0;
    mc_meta_key_segment(segment, key, sizeof key);
    int rc = mc_meta_get(e->meta, key, &val, &vlen, err);
    if (rc == MC_ENOTFOUND)
      return mc_err_set(err, MC_ENOTFOUND,
                        "segment %s is not registered on metadata server %s (is its engine "
                        "running and using the same metadata_server?)",
                        segment, e->meta->url);
    if (rc < 0)
      return rc;
    rc = mc_segment_desc_decode(val, vlen, segment, &d, err);
    free(val);
    if (rc < 0)
      return rc;
    if (strcmp(d.protocol, "tcp") != 0)
      return mc_err_set(err, MC_EUNAVAIL, "segment %s speaks protocol \"%s\"; this engine "
                        "speaks \"tcp\"", segment, d.protocol);
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
