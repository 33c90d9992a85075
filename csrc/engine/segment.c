/* The local segment: registering and unregistering memory regions (where
 * the memory lives, mapped or GPU, the transports' registration, then the
 * descriptor published), and the check that a range is ours. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"
#include "gpu/cuda_driver.h"
#include "gpu/gpu_ipc.h"
#include "util/dynlib.h"
#include "util/log.h"
#include "util/mapped.h"


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
   * payload they stopped sending) lose their connection: the transports
   * close it at their cancel sweep, which releases their pins. */
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
  mc_engine_publish(e, &why);
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
  mc_unpub_drop(e, (uint64_t)(uintptr_t)addr);
  if ((rc = mc_engine_publish(e, err)) < 0) {
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
    mc_unpub_drop(e, (uint64_t)(uintptr_t)addrs[i]);
  if ((rc = mc_engine_publish(e, err)) < 0) {
    int code = rc;
    mc_err_t why = {0};
    size_t kept = 0;
    for (size_t k = 0; k < n; k++)
      kept += unregister_local(e, addrs[k], &why) < 0;
    mc_engine_publish(e, &why);
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
   * region then stays registered), e.g. deregistered NIC registrations
   * revoke access; then the region table waits for the pins of accesses in
   * flight, cancels
   * this engine's transfers still using it after the grace period (and
   * names an address that starts no region). */
  uint64_t a = (uint64_t)(uintptr_t)addr;
  mc_err_t nf = {0};
  int rc = unregister_local(e, addr, &nf);
  if (rc == MC_ENOTFOUND) {
    /* Unregistered before, its descriptor update failed: retry that. */
    pthread_mutex_lock(&e->pub_mu);
    int pending = mc_unpub_find(e, a) >= 0;
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
  if ((rc = mc_engine_publish(e, err)) < 0) {
    mc_unpub_add(e, a);
    return mc_err_prefix(err, "region 0x%llx is unregistered here (no peer can reach it any "
                         "more) but its removal from the published descriptor failed; call "
                         "unregister again (free_managed_buffer) to retry",
                         (unsigned long long)a);
  }
  mc_unpub_drop(e, a);
  return 0;
}
