/* The table of memory regions registered by the local segment.
 *
 * Every remote access served by a transport is checked here first: a range
 * [addr, addr+len) must lie entirely inside one registered region, and the
 * region stays pinned (refcount) until the access is done, so
 * mc_regions_remove() returning means no transport will touch it again.
 * Thread-safe.
 */
#ifndef MC_MEM_REGIONS_H
#define MC_MEM_REGIONS_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "util/errors.h"

#define MC_LOCATION_MAX 32

typedef struct mc_region {
  uint64_t addr;
  uint64_t len;
  char location[MC_LOCATION_MAX]; /* "cpu" or "cuda:N" */
  int cuda_dev;                   /* N of "cuda:N", -1 for host memory */
  /* cuda regions: CUDA IPC handle of the allocation holding it (base64,
   * "" if it cannot be exported) and where that allocation starts, so a
   * process on the same host can map it (gpu_ipc.h). */
  char ipc[96];
  uint64_t ipc_base;
  int refs;                       /* active accesses, under the table lock */
  int dead;                       /* being removed: refuse new accesses */
  int removing;                   /* a remove is waiting for refs to drop */
  int revoked; /* unregister revokes the peers still holding it: transports drop their
                  accesses (read/written with __atomic builtins) */
  const void *holder_key;         /* who pinned it last (for error messages) */
  char holder[64];
} mc_region_t;

/* Where the table's version is published to same-host peers: a page of
 * shared memory (the same-host GPU transport creates it, see
 * transport/same_host_gpu/): word 0 holds `version`, stored at every bump
 * (under the lock, before the change is acted on: a region being removed
 * bumps it before the remove waits and returns); word 1 a random token.
 * Peers open it as /proc/<pid>/fd/<fd>. */
typedef struct mc_regions_pub {
  uint64_t *page; /* NULL: not published */
  int fd;
  uint64_t token;
} mc_regions_pub_t;

typedef struct mc_regions {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  mc_region_t **v; /* sorted by addr, non-overlapping */
  size_t n, cap;
  uint64_t version; /* bumped on every change */
  mc_regions_pub_t pub;
} mc_regions_t;

int mc_regions_init(mc_regions_t *r);
void mc_regions_destroy(mc_regions_t *r);

/* Adds [addr, addr+len). MC_EINVAL for len 0 / wraparound / bad location,
 * MC_EOVERLAP if it overlaps an existing region. */
int mc_regions_add(mc_regions_t *r, uint64_t addr, uint64_t len,
                   const char *location, mc_err_t *err);
/* Same, with the IPC export of a cuda region (may be NULL/""). */
int mc_regions_add_ex(mc_regions_t *r, uint64_t addr, uint64_t len, const char *location,
                      const char *ipc, uint64_t ipc_base, mc_err_t *err);

/* Removes the region starting at addr; waits (blocking) until accesses in
 * flight finish, at most timeout_ms (< 0: no limit).  MC_ENOTFOUND if no
 * region starts there; MC_EBUSY (naming the peer that pinned it last) if
 * accesses are still in flight at the deadline: the region then stays
 * registered but refuses new accesses, and a later call may finish the job. */
int mc_regions_remove(mc_regions_t *r, uint64_t addr, int64_t timeout_ms, mc_err_t *err);
/* Same; if accesses are still in flight after grace_ms, calls
 * stall(arg, reg) once (without the lock; reg stays valid) so the caller
 * can cut them short (cancel its own transfers, revoke peers), then waits
 * for the rest of timeout_ms. */
typedef void (*mc_regions_stall_fn)(void *arg, mc_region_t *reg);
int mc_regions_remove_cb(mc_regions_t *r, uint64_t addr, int64_t timeout_ms, int64_t grace_ms,
                         mc_regions_stall_fn stall, void *arg, mc_err_t *err);

/* This engine's own transfers pin the regions their local buffers lie in
 * (batch.c), so a region cannot be freed under them: the live region
 * holding [addr, addr+len) gets one more ref (holder "a local transfer"),
 * or NULL if none holds it.  Caller holds the lock (mc_regions_lock). */
mc_region_t *mc_regions_pin_local_locked(mc_regions_t *r, uint64_t addr, uint64_t len);

/* Pins the region containing [addr, addr+len).  MC_ERANGE (message names the
 * range and `who`) if none does. */
int mc_regions_acquire(mc_regions_t *r, uint64_t addr, uint64_t len,
                       const char *who, mc_region_t **out, mc_err_t *err);
void mc_regions_release(mc_regions_t *r, mc_region_t *reg);
/* Same as mc_regions_acquire, remembering `peer` (a stable string whose
 * address identifies it) as the region's last holder. */
int mc_regions_acquire_by(mc_regions_t *r, uint64_t addr, uint64_t len, const char *who,
                          const char *peer, mc_region_t **out, mc_err_t *err);

/* Where [addr, addr+len) lives if a live region holds it: its cuda device,
 * or -1 for host memory (locations are checked at registration), with the
 * region's bounds in *lo, *hi.  -2 if no region holds it. */
int mc_regions_device_of(mc_regions_t *r, uint64_t addr, uint64_t len, uint64_t *lo,
                         uint64_t *hi);

/* For checking many ranges under one lock: the live region holding
 * [addr, addr+len), or NULL (len 0 and wrap-around hold nowhere).  The
 * pointer is valid only while the lock is held. */
void mc_regions_lock(mc_regions_t *r);
void mc_regions_unlock(mc_regions_t *r);
const mc_region_t *mc_regions_find_locked(mc_regions_t *r, uint64_t addr, uint64_t len);
/* 1 if a live region holds [addr, addr+len). */
int mc_regions_contains(mc_regions_t *r, uint64_t addr, uint64_t len);

/* Publishes the version in `pub` from now on (page == NULL: stops; the
 * caller unmaps the old page after this returns). */
void mc_regions_set_pub(mc_regions_t *r, const mc_regions_pub_t *pub);
/* The published page's fd and token; 0 if not published. */
int mc_regions_pub_info(mc_regions_t *r, int *fd, uint64_t *token);

/* Copies up to `max` (addr,len,location) records; returns the count. */
size_t mc_regions_snapshot(mc_regions_t *r, mc_region_t *out, size_t max);
size_t mc_regions_count(mc_regions_t *r);

#endif
