/* Is an address range mapped in this process, and writable?  From one
 * snapshot of /proc/self/maps, so registering many buffers reads it once.
 * Used to refuse registering memory that a peer's WRITE would fault on. */
#ifndef MC_UTIL_MAPPED_H
#define MC_UTIL_MAPPED_H

#include <stddef.h>
#include <stdint.h>

#include "util/errors.h"

typedef struct mc_maps mc_maps_t;

/* Reads /proc/self/maps; NULL (err set) if it cannot. */
mc_maps_t *mc_maps_load(mc_err_t *err);
void mc_maps_free(mc_maps_t *m);
/* 0 if every byte of [addr, addr+len) is mapped readable and writable;
 * else MC_EINVAL naming the first address that is not (and why). */
int mc_maps_check(const mc_maps_t *m, uint64_t addr, uint64_t len, mc_err_t *err);

#endif
