#include "engine/segment_desc.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

char *mc_segment_desc_encode(const char *name, const char *protocol, const char *host,
                             int port, const mc_region_t *regions, size_t nregions) {
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
  for (size_t i = 0; i < nregions; i++) {
    cJSON *b = cJSON_CreateObject();
    if (!b)
      goto done;
    cJSON_AddStringToObject(b, "name", regions[i].location);
    cJSON_AddNumberToObject(b, "addr", (double)regions[i].addr);
    cJSON_AddNumberToObject(b, "length", (double)regions[i].len);
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
  }
  cJSON_Delete(j);
  return rc;
}
