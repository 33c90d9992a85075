/* GID choice for RoCE (pure logic; unit-tested on hosts without RDMA).
 *
 * A RoCE port has a GID table; each entry is an IPv6 address (IPv4 ones
 * mapped as ::ffff:a.b.c.d) of RoCE v1 or v2 type.  We prefer a RoCE v2
 * IPv4-mapped GID (routable, what RoCE fabrics are set up for), then any
 * other RoCE v2 GID, then IPv4-mapped of any type, then the first non-zero
 * entry.  An explicit index (MC_GID_INDEX) overrides the choice. */
#ifndef MC_TRANSPORT_RDMA_GID_H
#define MC_TRANSPORT_RDMA_GID_H

#include <stddef.h>
#include <stdint.h>

#include "util/errors.h"

typedef struct mc_gid_entry {
  uint8_t raw[16];
  int roce_v2; /* sysfs gid_attrs/types says "RoCE v2" */
} mc_gid_entry_t;

/* Returns the chosen index, or MC_ENOTFOUND (every entry zero) /
 * MC_EINVAL (override out of range or a zero entry) with err naming the
 * device, the index and what the table holds.  why: the reason chosen. */
int mc_gid_choose(const char *dev, const mc_gid_entry_t *t, int n, int override, char *why,
                  size_t whylen, mc_err_t *err);

int mc_gid_is_zero(const uint8_t raw[16]);
int mc_gid_is_ipv4(const uint8_t raw[16]);
/* "fe80:0000:0000:0000:0000:0000:0000:0001" (39 chars + NUL). */
void mc_gid_format(const uint8_t raw[16], char out[40]);
/* Parses the form above; 0 or -1. */
int mc_gid_parse(const char *s, uint8_t raw[16]);

#endif
