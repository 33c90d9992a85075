/* mooncake.json: the file users point MOONCAKE_CONFIG_PATH at.
 *
 * Fields (exactly the seed's, plus the P2P value of metadata_server):
 *   prefill_url      "host:port"   required
 *   decode_url       "host:port"   required
 *   metadata_server  "etcd://h:p" | "redis://[:pw@]h:p[/db]" | "http://h:p/path"
 *                    | bare "h:p" (etcd unless metadata_backend says otherwise)
 *                    | "P2PHANDSHAKE" (no metadata server)          required
 *   metadata_backend "etcd" | "redis" | "http"   optional, deprecated, honoured
 *   protocol         "tcp" | "rdma"              optional, default "tcp"
 *   device_name      "nic0[,nic1...]"            required (non-empty) for rdma
 *
 * Port rules from the seed: if prefill_url == decode_url the decode port is
 * moved up by 100 (noted in `notes`); two ports on the same host closer than
 * 50 are an error.
 */
#ifndef MC_CONFIG_CONFIG_H
#define MC_CONFIG_CONFIG_H

#include <stdbool.h>

#include "util/errors.h"
#include "util/hostport.h"

#define MC_CFG_STR_MAX 1024

typedef enum {
  MC_META_P2P = 0,
  MC_META_ETCD = 1,
  MC_META_REDIS = 2,
  MC_META_HTTP = 3,
} mc_meta_kind_t;

typedef enum { MC_PROTO_TCP = 0, MC_PROTO_RDMA = 1 } mc_protocol_t;

typedef struct mc_config {
  char origin[MC_CFG_STR_MAX]; /* file path, or "<string>" */
  mc_hostport_t prefill;       /* port always >= 1 */
  mc_hostport_t decode;        /* after the +100 rule */
  mc_meta_kind_t metadata_kind;
  /* Normalised connection string for the metadata client:
   * "P2PHANDSHAKE", "etcd://h:p[,h:p...]", "redis://...", "http://h:p/path". */
  char metadata_server[MC_CFG_STR_MAX];
  char metadata_server_raw[MC_CFG_STR_MAX]; /* as written in the file */
  bool metadata_backend_given;             /* deprecated field present */
  mc_protocol_t protocol;
  char device_name[MC_CFG_STR_MAX]; /* "" for tcp */
  bool decode_port_adjusted;        /* the +100 rule applied */
  char notes[MC_CFG_STR_MAX];       /* human-readable notes to log, "" if none */
  char auth_secret[MC_CFG_STR_MAX]; /* peer authentication secret, "" = off */
  bool same_host_cpu;               /* "same_host_cpu" (default true): false keeps
                                       same-host peers off the same-host CPU path */
} mc_config_t;

/* Parses JSON text.  `origin` names the source in error messages (a path or
 * "<string>").  On error returns MC_ECONFIG (or MC_ENOMEM) and err->msg reads
 * like: `<origin>: field "protocol": value "udp" is not accepted; use "tcp"
 * or "rdma"`.  JSON syntax errors give line and column. */
int mc_config_parse(const char *json, size_t len, const char *origin,
                    mc_config_t *out, mc_err_t *err);

/* Reads and parses a file (missing/unreadable file -> MC_ECONFIG naming the
 * path and the errno text; files over 1 MiB are refused). */
int mc_config_load_file(const char *path, mc_config_t *out, mc_err_t *err);

const char *mc_meta_kind_name(mc_meta_kind_t k);  /* "p2p","etcd","redis","http" */
const char *mc_protocol_name(mc_protocol_t p);    /* "tcp","rdma" */

#endif
