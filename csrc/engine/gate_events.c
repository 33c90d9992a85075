/* The gate's CUDA events, made and recorded by the engine: a ring of
 * blocking-sync events (the gate thread sleeps in the driver on them), one
 * recorded per layer on the caller's stream (vLLM's forward thread, after
 * the layer's KV kernels) by mc_engine_gate_record, so the forward thread's
 * per-layer save makes no framework event and no Python call for it.  An
 * event is recorded again only MC_GATE_EVENTS records later: the gate holds
 * at most MC_GATE_MAX batches, each waiting for one of the layers' events
 * before it, so a normal run never records an event the gate still waits
 * for (and were it, on the same stream, the gate would wait for a later
 * point of it: later, never early).  Destroyed with the engine, after the
 * gate's threads stopped. */
#include <stdlib.h>

#include "engine/engine_internal.h"
#include "gpu/cuda_driver.h"

#define MC_CU_EVENT_BLOCKING_SYNC 0x1u
#define MC_CU_EVENT_DISABLE_TIMING 0x2u

int mc_engine_gate_record(mc_engine_t *e, int dev, uint64_t stream, uint64_t *event,
                          mc_err_t *err) {
  const mc_cuda_api_t *api = mc_cuda_api(err);
  if (!api)
    return err->code;
  pthread_mutex_lock(&e->gate_mu);
  int rc = 0;
  if (e->gev && e->gev_dev != dev) {
    rc = mc_err_set(err, MC_EINVAL, "gate events are on cuda:%d, not cuda:%d (one device "
                    "per engine)", e->gev_dev, dev);
    goto out;
  }
  if (!e->gev) {
    e->gev = calloc(MC_GATE_EVENTS, sizeof *e->gev);
    if (!e->gev) {
      rc = mc_err_set(err, MC_ENOMEM, "out of memory");
      goto out;
    }
    e->gev_dev = dev;
  }
  uint64_t *slot = &e->gev[e->gev_next];
  mc_cu_result r = 0;
  if (!*slot) { /* made in the device's primary context (torch's) */
    rc = mc_cuda_use_device(dev, err);
    if (rc < 0)
      goto out;
    mc_cu_event ev = NULL;
    r = api->cuEventCreate(&ev, MC_CU_EVENT_BLOCKING_SYNC | MC_CU_EVENT_DISABLE_TIMING);
    if (r != 0) {
      char buf[160];
      rc = mc_err_set(err, MC_ESYS, "cuEventCreate failed: %s",
                      mc_cuda_strerror(api, r, buf, sizeof buf));
      goto out;
    }
    *slot = (uint64_t)(uintptr_t)ev;
    e->gev_made++;
  }
  r = api->cuEventRecord((mc_cu_event)(uintptr_t)*slot, (mc_cu_stream)(uintptr_t)stream);
  if (r != 0) {
    char buf[160];
    rc = mc_err_set(err, MC_ESYS, "cuEventRecord failed: %s",
                    mc_cuda_strerror(api, r, buf, sizeof buf));
    goto out;
  }
  *event = *slot;
  e->gev_next = (e->gev_next + 1) % MC_GATE_EVENTS;
out:
  pthread_mutex_unlock(&e->gate_mu);
  return rc;
}

void mc_gate_events_destroy(mc_engine_t *e) {
  if (!e->gev)
    return;
  mc_err_t err = {0};
  const mc_cuda_api_t *api = mc_cuda_api(&err);
  for (size_t i = 0; api && i < MC_GATE_EVENTS; i++)
    if (e->gev[i])
      api->cuEventDestroy((mc_cu_event)(uintptr_t)e->gev[i]);
  free(e->gev);
  e->gev = NULL;
}
