#include "meta/segment_desc.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "gpu/gpu_ipc.h"
#include "util/json_num.h"
#include <string.h>
#include <time.h>

static char *encode(const char *name, const char *protocol, const char *host, int port,
                    const mc_region_t *regions, size_t nregions, mc_regions_t *table,
                    uint64_t ver) {
  cJSON *j = cJSON_CreateObject();
  cJSON *bufs = cJSON_CreateArray();
  char *out = NULL;
  if (!j || !bufs)
    goto done;
  cJSON_AddStringToObject(j, "name", name);
  cJSON_AddStringToObject(j, "protocol", protocol);
  cJSON_AddStringToObject(j, "ip_or_host_name", host);
  cJSON_AddNumberToObject(j, "rpc_port", port);
  cJSON_AddNumberToObject(j, "tcp_data_port", port);
  cJSON_AddStringToObject(j, "wire", "mooncake-connector/1");
  cJSON_AddNumberToObject(j, "timestamp", (double)time(NULL));
  cJSON_AddStringToObject(j, "host_id", mc_host_identity());
  cJSON_AddNumberToObject(j, "pid", (double)getpid());
  int fd = -1;
  uint64_t token = 0;
  if (table && mc_regions_pub_info(table, &fd, &token) && ver < (1ull << 53)) {
    cJSON *g = cJSON_AddObjectToObject(j, "gen");
    char tok[24];
    snprintf(tok, sizeof tok, "%016llx", (unsigned long long)token);
    if (!g || !cJSON_AddNumberToObject(g, "v", (double)ver) ||
        !cJSON_AddNumberToObject(g, "fd", fd) || !cJSON_AddStringToObject(g, "token", tok))
      goto done;
  }
  for (size_t i = 0; i < nregions; i++) {
    cJSON *b = cJSON_CreateObject();
    if (!b)
      goto done;
    cJSON_AddStringToObject(b, "name", regions[i].location);
    cJSON_AddNumberToObject(b, "addr", (double)regions[i].addr);
    cJSON_AddNumberToObject(b, "length", (double)regions[i].len);
    if (regions[i].ipc[0]) {
      cJSON_AddStringToObject(b, "cuda_ipc", regions[i].ipc);
      cJSON_AddNumberToObject(b, "cuda_ipc_base", (double)regions[i].ipc_base);
    }
    cJSON_AddItemToArray(bufs, b);
  }
  cJSON_AddItemToObject(j, "buffers", bufs);
  bufs = NULL;
  out = cJSON_PrintUnformatted(j);
done:
  cJSON_Delete(bufs);
  cJSON_Delete(j);
  return out;
}

char *mc_segment_desc_encode(const char *name, const char *protocol, const char *host,
                             int port, const mc_region_t *regions, size_t nregions) {
  return encode(name, protocol, host, port, regions, nregions, NULL, 0);
}

char *mc_segment_desc_encode_live(const char *name, const char *protocol, const char *host,
                                  int port, const mc_region_t *regions, size_t nregions,
                                  mc_regions_t *table, uint64_t ver) {
  return encode(name, protocol, host, port, regions, nregions, table, ver);
}

/* The descriptor's "gen" object, if any: 0, or MC_EPROTO naming the bad
 * field. */
static int decode_gen(const cJSON *g, mc_remote_desc_t *out, mc_err_t *err) {
  if (!g)
    return 0;
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(g, "v");
  const cJSON *fd = cJSON_GetObjectItemCaseSensitive(g, "fd");
  const cJSON *tok = cJSON_GetObjectItemCaseSensitive(g, "token");
  uint64_t fv = 0;
  int ok = cJSON_IsObject(g) && mc_json_u64(v, 0, 1ull << 53, &out->gen) == 0 &&
           mc_json_u64(fd, 0, INT32_MAX, &fv) == 0 && cJSON_IsString(tok) &&
           strlen(tok->valuestring) == 16 &&
           strspn(tok->valuestring, "0123456789abcdef") == 16;
  if (ok)
    out->gen_token = strtoull(tok->valuestring, NULL, 16);
  if (!ok)
    return mc_err_set(err, MC_EPROTO, "segment descriptor \"gen\" is not an object "
                      "{\"v\": integer 0..2^53, \"fd\": integer 0..2^31-1, \"token\": 16 "
                      "lowercase hex digits}");
  out->gen_fd = (int)fv;
  out->has_gen = 1;
  return 0;
}

int mc_segment_desc_decode(const char *json, size_t len, const char *name,
                           mc_segment_desc_t *out, mc_err_t *err) {
  cJSON *j = cJSON_ParseWithLength(json, len);
  if (!j || !cJSON_IsObject(j)) {
    cJSON_Delete(j);
    return mc_err_set(err, MC_EMETADATA,
                      "descriptor of segment %s on the metadata server is not a JSON object",
                      name);
  }
  const cJSON *host = cJSON_GetObjectItemCaseSensitive(j, "ip_or_host_name");
  const cJSON *port = cJSON_GetObjectItemCaseSensitive(j, "tcp_data_port");
  const cJSON *proto = cJSON_GetObjectItemCaseSensitive(j, "protocol");
  const cJSON *hid = cJSON_GetObjectItemCaseSensitive(j, "host_id");
  if (!cJSON_IsNumber(port))
    port = cJSON_GetObjectItemCaseSensitive(j, "rpc_port");
  int rc = 0;
  if (!cJSON_IsString(host) || !host->valuestring[0] ||
      strlen(host->valuestring) >= sizeof out->host) {
    rc = mc_err_set(err, MC_EMETADATA,
                    "descriptor of segment %s has no valid \"ip_or_host_name\"", name);
  } else if (!cJSON_IsNumber(port) || port->valuedouble < 1 || port->valuedouble > 65535 ||
             port->valuedouble != (int)port->valuedouble) {
    rc = mc_err_set(err, MC_EMETADATA,
                    "descriptor of segment %s has no valid \"tcp_data_port\" (1..65535)", name);
  } else {
    snprintf(out->name, sizeof out->name, "%s", name);
    snprintf(out->host, sizeof out->host, "%s", host->valuestring);
    out->port = (int)port->valuedouble;
    snprintf(out->protocol, sizeof out->protocol, "%s",
             cJSON_IsString(proto) ? proto->valuestring : "tcp");
    snprintf(out->host_id, sizeof out->host_id, "%s",
             cJSON_IsString(hid) ? hid->valuestring : "");
  }
  cJSON_Delete(j);
  return rc;
}

static int cmp_region(const void *a, const void *b) {
  const mc_remote_region_t *x = a, *y = b;
  return x->addr < y->addr ? -1 : x->addr > y->addr;
}

int mc_segment_desc_decode_regions(const char *json, size_t len, mc_remote_desc_t *out,
                                   mc_err_t *err) {
  memset(out, 0, sizeof *out);
  cJSON *j = cJSON_ParseWithLength(json, len);
  const cJSON *bufs = j ? cJSON_GetObjectItemCaseSensitive(j, "buffers") : NULL;
  if (!cJSON_IsArray(bufs)) {
    cJSON_Delete(j);
    return mc_err_set(err, MC_EPROTO, "segment descriptor has no \"buffers\" array");
  }
  const cJSON *hid = cJSON_GetObjectItemCaseSensitive(j, "host_id");
  const cJSON *pid = cJSON_GetObjectItemCaseSensitive(j, "pid");
  if (cJSON_IsString(hid))
    snprintf(out->host_id, sizeof out->host_id, "%s", hid->valuestring);
  uint64_t v;
  out->pid = mc_json_u64(pid, 0, INT32_MAX, &v) == 0 ? (long)v : -1;
  int grc = decode_gen(cJSON_GetObjectItemCaseSensitive(j, "gen"), out, err);
  if (grc < 0) {
    cJSON_Delete(j);
    return grc;
  }
  size_t n = (size_t)cJSON_GetArraySize(bufs);
  out->regions = calloc(n ? n : 1, sizeof *out->regions);
  if (!out->regions) {
    cJSON_Delete(j);
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  }
  const cJSON *b;
  size_t idx = 0;
  cJSON_ArrayForEach(b, bufs) {
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(b, "name");
    const cJSON *addr = cJSON_GetObjectItemCaseSensitive(b, "addr");
    const cJSON *length = cJSON_GetObjectItemCaseSensitive(b, "length");
    const cJSON *ipc = cJSON_GetObjectItemCaseSensitive(b, "cuda_ipc");
    const cJSON *ipcb = cJSON_GetObjectItemCaseSensitive(b, "cuda_ipc_base");
    idx++;
    if (!cJSON_IsNumber(addr) || !cJSON_IsNumber(length))
      continue;
    mc_remote_region_t *r = &out->regions[out->n];
    if (mc_json_u64(addr, 0, UINT64_MAX, &r->addr) < 0 ||
        mc_json_u64(length, 0, UINT64_MAX - r->addr, &r->len) < 0) {
      cJSON_Delete(j);
      mc_remote_desc_free(out);
      return mc_err_set(err, MC_EPROTO, "segment descriptor buffer %zu: \"addr\"/\"length\" "
                        "are not integers of a range within 0..2^64-1", idx);
    }
    out->n++;
    r->cuda_dev = -1;
    if (cJSON_IsString(name) && !strncmp(name->valuestring, "cuda:", 5)) {
      char *end;
      long dev = strtol(name->valuestring + 5, &end, 10);
      if (end != name->valuestring + 5 && !*end && dev >= 0 && dev < 1024)
        r->cuda_dev = (int)dev;
    }
    if (cJSON_IsString(ipc) && cJSON_IsNumber(ipcb)) {
      snprintf(r->ipc, sizeof r->ipc, "%s", ipc->valuestring);
      if (mc_json_u64(ipcb, 0, UINT64_MAX, &r->ipc_base) < 0)
        r->ipc[0] = '\0'; /* no usable export */
    }
  }
  qsort(out->regions, out->n, sizeof *out->regions, cmp_region);
  cJSON_Delete(j);
  return 0;
}

void mc_remote_desc_free(mc_remote_desc_t *d) {
  free(d->regions);
  d->regions = NULL;
  d->n = 0;
}
