/* Engine lifecycle: one create, one destroy (also create's failure path),
 * the engine's own knobs, statistics. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"
#include "util/hostport.h"
#include "util/log.h"


/* Our name "host:port" (brackets around an IPv6 host). */
void mc_engine_set_port(mc_engine_t *e, int port) {
  e->port = port;
  /* With port 0 the name is only known now; the loops read it on their
   * first HELLO, after this write (posted through their command queues). */
  snprintf(e->name, sizeof e->name, strchr(e->host, ':') ? "[%s]:%d" : "%s:%d", e->host, port);
}

/* The engine's own knobs (MC_*); the transports read theirs.  The slicing
 * knobs apply to every transport; their former names are still accepted
 * (util/env.c). */
static int read_knobs(mc_engine_t *e, mc_err_t *err) {
  long slice_size, op_entries;
  if (mc_env_long_renamed("MC_SLICE_SIZE", 4 << 20, 4096, 1 << 30, &slice_size, err) < 0 ||
      mc_env_long_renamed("MC_OP_ENTRIES", 256, 1, (long)MC_XFER_MAX_ENTRIES, &op_entries,
                          err) < 0)
    return MC_ECONFIG;
  e->slice_size = (uint64_t)slice_size;
  e->op_entries = (uint32_t)op_entries;
  e->gpu_first_chunk = mc_knob("MC_GPU_FIRST_CHUNK", 256, 1, 1 << 30);
  e->gpu_trace = mc_knob("MC_GPU_TRACE", 0, 0, 1);
  /* MC_LOCAL_CHECK=0 exists only to measure what the check costs
   * (a benchmark's --local-check-off); never turn it off. */
  e->local_check = mc_knob("MC_LOCAL_CHECK", 1, 0, 1);
  e->notify_limit = (uint64_t)mc_knob("MC_NOTIFY_QUEUE_MB", 64, 1, 1 << 20) << 20;
  e->unregister_wait_ms = mc_knob("MC_UNREGISTER_WAIT_MS", 10000, 1, 86400000);
  e->unregister_grace_ms = mc_knob("MC_UNREGISTER_GRACE_MS", 1000, 0, 86400000);
  e->unregister_revoke = mc_knob("MC_UNREGISTER_REVOKE", 1, 0, 1);
  e->timeout_ms = (uint64_t)mc_knob("MC_TRANSFER_TIMEOUT", 30, 1, 86400) * 1000ull;
  e->spin_ns = (uint64_t)mc_knob("MC_WAIT_SPIN_US", 50, 0, 100000) * 1000ull;
  e->wake_spin_ns = (uint64_t)mc_knob("MC_WAKE_SPIN_US", 0, 0, 10000) * 1000ull;
  e->meta_ttl_s = mc_knob("MC_METADATA_TTL", 10, 0, MC_META_TTL_MAX);
  return 0;
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
  pthread_mutex_init(&e->peers_mu, NULL);
  pthread_mutex_init(&e->notify_mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&e->notify_cv, &ca);
  pthread_condattr_destroy(&ca);
  pthread_mutex_init(&e->det_mu, NULL);
  pthread_rwlock_init(&e->handler_lock, NULL);
  pthread_mutex_init(&e->pub_mu, NULL);
  pthread_mutex_init(&e->gpu_mu, NULL);
  pthread_mutex_init(&e->desc_mu, NULL);
  pthread_mutex_init(&e->pin_mu, NULL);
  pthread_mutex_init(&e->gate_mu, NULL);
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
  if ((rc = read_knobs(e, err)) < 0)
    goto fail;
  /* GPU staging: no CUDA call until GPU memory is used. */
  if ((rc = mc_gpu_stager_create((size_t)mc_knob("MC_GPU_STAGING_MB", 64, 4, 65536) << 20,
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
  if ((rc = mc_engine_publish(e, err)) < 0) {
    mc_err_prefix(err, "cannot publish segment %s", e->name);
    goto fail;
  }
  e->published = e->meta != NULL;
  if (e->meta && e->meta_ttl_s > 0 && (rc = mc_keepalive_start(e, err)) < 0)
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
  mc_keepalive_stop(e);
  mc_gate_destroy(e); /* before the transports: its notifier sends over them */
  mc_gate_events_destroy(e); /* no gate thread waits for them now */
  if (e->published)
    mc_engine_unpublish(e);
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
  for (size_t i = 0; i < e->nlost; i++)
    free(e->lost_peers[i]);
  mc_peers_free(e);
  pthread_mutex_destroy(&e->peers_mu);
  pthread_mutex_destroy(&e->notify_mu);
  pthread_cond_destroy(&e->notify_cv);
  pthread_mutex_destroy(&e->det_mu);
  pthread_rwlock_destroy(&e->handler_lock);
  pthread_mutex_destroy(&e->pub_mu);
  pthread_mutex_destroy(&e->gpu_mu);
  pthread_mutex_destroy(&e->pin_mu);
  pthread_mutex_destroy(&e->gate_mu);
  pthread_mutex_destroy(&e->desc_mu);
  free(e->desc_cache);
  free(e->pub_desc);
  free(e->pub_rpc);
  free(e->unpub);
  free(e);
}

const char *mc_engine_segment_name(const mc_engine_t *e) { return e->name; }
int mc_engine_rpc_port(const mc_engine_t *e) { return e->port; }


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
  mc_gpu_stager_counts(e->gpu, &out->gpu_jobs, &out->gpu_jobs_direct);
  mc_gate_counts(e, &out->gate_notified, &out->gate_event_failures, &out->gate_host_batches,
                 &out->gate_notes_dropped);
}
