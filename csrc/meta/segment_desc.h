/* Segment descriptors: the JSON value stored under mooncake/ram/<name>. */
#ifndef MC_META_SEGMENT_DESC_H
#define MC_META_SEGMENT_DESC_H

#include <stddef.h>

#include "mem/regions.h"
#include "util/errors.h"

/* The RPC (wire type RPC, docs/protocol.md) that asks a peer for its
 * segment descriptor: regions with location and CUDA IPC handles, host
 * identity, pid.  The reply is the descriptor JSON (the engine answers it;
 * the same-host GPU transport asks it). */
#define MC_RPC_DESCRIBE "mc.describe"

typedef struct mc_segment_desc {
  char name[320];
  char protocol[16];
  char host[256];
  int port; /* tcp data/rpc port */
  char host_id[320]; /* where it runs ("boot id/hostname"), "" if not said */
} mc_segment_desc_t;

/* Encodes (malloc'ed JSON). */
char *mc_segment_desc_encode(const char *name, const char *protocol, const char *host,
                             int port, const mc_region_t *regions, size_t nregions);
/* Same, answering mc.describe: also the regions' version `ver` (read
 * before the snapshot was taken) and, when the table publishes it
 * (mc_regions_set_pub), where same-host peers can watch it change:
 * "gen": {"v": ver, "fd": N, "token": "16 hex digits"}. */
char *mc_segment_desc_encode_live(const char *name, const char *protocol, const char *host,
                                  int port, const mc_region_t *regions, size_t nregions,
                                  mc_regions_t *table, uint64_t ver);
/* The regions of a peer's descriptor and where the peer runs (for the
 * same-host GPU path). */
typedef struct mc_remote_region {
  uint64_t addr, len;
  int cuda_dev; /* -1: host memory */
  char ipc[96]; /* base64 CUDA IPC handle, "" if none */
  uint64_t ipc_base;
} mc_remote_region_t;

typedef struct mc_remote_desc {
  char host_id[320]; /* "" if the peer did not say */
  long pid;
  /* The descriptor's "gen" (mc_segment_desc_encode_live); has_gen 0: none. */
  int has_gen;
  uint64_t gen;
  int gen_fd;
  uint64_t gen_token;
  mc_remote_region_t *regions; /* sorted by addr */
  size_t n;
} mc_remote_desc_t;

int mc_segment_desc_decode_regions(const char *json, size_t len, mc_remote_desc_t *out,
                                   mc_err_t *err);
void mc_remote_desc_free(mc_remote_desc_t *d);

/* Decodes a descriptor fetched from a metadata server; MC_EMETADATA with a
 * message naming the segment and the bad field when it is not valid. */
int mc_segment_desc_decode(const char *json, size_t len, const char *name,
                           mc_segment_desc_t *out, mc_err_t *err);

#endif
