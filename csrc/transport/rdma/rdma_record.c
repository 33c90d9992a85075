#include "transport/rdma/rdma_record.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

#include "transport/rdma/rdma_gid.h"
#include "util/json_num.h"

static const char *const kinds[] = {"", "connect", "accept", "regions"};

char *mc_rdma_record_encode(const mc_rdma_record_t *r) {
  cJSON *j = cJSON_CreateObject();
  char *out = NULL;
  if (!j || r->kind < 1 || r->kind > 3)
    goto done;
  cJSON_AddStringToObject(j, "rdma", kinds[r->kind]);
  cJSON_AddNumberToObject(j, "version", MC_RDMA_RECORD_VERSION);
  cJSON_AddStringToObject(j, "from", r->from);
  cJSON_AddStringToObject(j, "to", r->to);
  cJSON_AddNumberToObject(j, "epoch", (double)r->epoch);
  cJSON *nics = cJSON_AddArrayToObject(j, "nics");
  for (uint32_t i = 0; nics && i < r->nnics; i++) {
    cJSON *n = cJSON_CreateObject();
    char gid[40];
    mc_gid_format(r->nics[i].gid, gid);
    cJSON_AddStringToObject(n, "name", r->nics[i].name);
    cJSON_AddNumberToObject(n, "lid", r->nics[i].lid);
    cJSON_AddStringToObject(n, "gid", gid);
    cJSON_AddNumberToObject(n, "mtu", r->nics[i].mtu);
    cJSON_AddBoolToObject(n, "roce", r->nics[i].ethernet);
    cJSON_AddItemToArray(nics, n);
  }
  cJSON *qps = cJSON_AddArrayToObject(j, "qps");
  for (uint32_t i = 0; qps && i < r->nqps; i++) {
    cJSON *q = cJSON_CreateObject();
    cJSON_AddNumberToObject(q, "nic", r->qps[i].nic);
    cJSON_AddNumberToObject(q, "qpn", r->qps[i].qpn);
    cJSON_AddNumberToObject(q, "psn", r->qps[i].psn);
    cJSON_AddItemToArray(qps, q);
  }
  cJSON *regs = cJSON_AddArrayToObject(j, "regions");
  for (size_t i = 0; regs && i < r->nregions; i++) {
    cJSON *g = cJSON_CreateObject();
    cJSON_AddNumberToObject(g, "addr", (double)r->regions[i].addr);
    cJSON_AddNumberToObject(g, "len", (double)r->regions[i].len);
    cJSON *rk = cJSON_AddArrayToObject(g, "rkey");
    for (uint32_t k = 0; rk && k < r->nnics; k++)
      cJSON_AddItemToArray(rk, cJSON_CreateNumber(r->regions[i].rkey[k]));
    cJSON_AddItemToArray(regs, g);
  }
  out = cJSON_PrintUnformatted(j);
done:
  cJSON_Delete(j);
  return out;
}

/* An integer field in [lo, hi]. */
static int get_num(const cJSON *o, const char *name, uint64_t lo, uint64_t hi, uint64_t *v) {
  return mc_json_u64(cJSON_GetObjectItemCaseSensitive(o, name), lo, hi, v);
}

static int get_str(const cJSON *o, const char *name, char *out, size_t len) {
  const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, name);
  if (!cJSON_IsString(x) || strlen(x->valuestring) >= len)
    return -1;
  memcpy(out, x->valuestring, strlen(x->valuestring) + 1);
  return 0;
}

#define BAD(...)                                                                        \
  do {                                                                                  \
    rc = mc_err_set(err, MC_EPROTO, "RDMA connection record: " __VA_ARGS__);            \
    goto done;                                                                          \
  } while (0)

int mc_rdma_record_decode(const char *txt, size_t len, mc_rdma_record_t *r, mc_err_t *err) {
  memset(r, 0, sizeof *r);
  int rc = 0;
  uint64_t v;
  cJSON *j = cJSON_ParseWithLength(txt, len);
  if (!cJSON_IsObject(j))
    BAD("not a JSON object");
  char kind[16];
  if (get_str(j, "rdma", kind, sizeof kind) < 0)
    BAD("no \"rdma\" kind");
  for (int k = 1; k <= 3; k++)
    if (!strcmp(kind, kinds[k]))
      r->kind = k;
  if (!r->kind)
    BAD("unknown kind \"%s\" (connect, accept, regions)", kind);
  if (get_num(j, "version", 1, 1000000, &v) < 0)
    BAD("no \"version\"");
  if (v != MC_RDMA_RECORD_VERSION)
    BAD("version %llu, this build speaks %d; run the same mooncake-connector release on both "
        "sides", (unsigned long long)v, MC_RDMA_RECORD_VERSION);
  if (get_str(j, "from", r->from, sizeof r->from) < 0 ||
      get_str(j, "to", r->to, sizeof r->to) < 0)
    BAD("\"from\"/\"to\" missing or too long");
  if (get_num(j, "epoch", 0, 1ull << 53, &v) < 0)
    BAD("no \"epoch\"");
  r->epoch = v;
  const cJSON *nics = cJSON_GetObjectItemCaseSensitive(j, "nics");
  const cJSON *qps = cJSON_GetObjectItemCaseSensitive(j, "qps");
  const cJSON *regs = cJSON_GetObjectItemCaseSensitive(j, "regions");
  if (!cJSON_IsArray(nics) || !cJSON_IsArray(qps) || !cJSON_IsArray(regs))
    BAD("\"nics\", \"qps\" and \"regions\" must be arrays");
  if (cJSON_GetArraySize(nics) > MC_RDMA_MAX_NICS)
    BAD("%d NICs (at most %d)", cJSON_GetArraySize(nics), MC_RDMA_MAX_NICS);
  if (cJSON_GetArraySize(qps) > MC_RDMA_MAX_QPS)
    BAD("%d QPs (at most %d)", cJSON_GetArraySize(qps), MC_RDMA_MAX_QPS);
  const cJSON *x;
  cJSON_ArrayForEach(x, nics) {
    mc_rdma_nic_info_t *n = &r->nics[r->nnics];
    char gid[48];
    if (get_str(x, "name", n->name, sizeof n->name) < 0)
      BAD("NIC %u has no name", r->nnics);
    if (get_str(x, "gid", gid, sizeof gid) < 0 || mc_gid_parse(gid, n->gid) < 0)
      BAD("NIC %s: bad \"gid\"", n->name);
    if (get_num(x, "lid", 0, 65535, &v) < 0)
      BAD("NIC %s: bad \"lid\"", n->name);
    n->lid = (uint16_t)v;
    if (get_num(x, "mtu", 256, 4096, &v) < 0)
      BAD("NIC %s: bad \"mtu\" (256..4096)", n->name);
    n->mtu = (uint32_t)v;
    const cJSON *roce = cJSON_GetObjectItemCaseSensitive(x, "roce");
    n->ethernet = cJSON_IsTrue(roce);
    r->nnics++;
  }
  cJSON_ArrayForEach(x, qps) {
    mc_rdma_qp_info_t *q = &r->qps[r->nqps];
    if (get_num(x, "nic", 0, r->nnics ? r->nnics - 1 : 0, &v) < 0 || !r->nnics)
      BAD("QP %u names no valid NIC", r->nqps);
    q->nic = (uint32_t)v;
    if (get_num(x, "qpn", 1, 0xffffff, &v) < 0)
      BAD("QP %u: bad \"qpn\"", r->nqps);
    q->qpn = (uint32_t)v;
    if (get_num(x, "psn", 0, 0xffffff, &v) < 0)
      BAD("QP %u: bad \"psn\"", r->nqps);
    q->psn = (uint32_t)v;
    r->nqps++;
  }
  size_t ng = (size_t)cJSON_GetArraySize(regs);
  if (ng) {
    r->regions = calloc(ng, sizeof *r->regions);
    if (!r->regions) {
      rc = mc_err_set(err, MC_ENOMEM, "out of memory");
      goto done;
    }
  }
  cJSON_ArrayForEach(x, regs) {
    mc_rdma_region_info_t *g = &r->regions[r->nregions];
    if (get_num(x, "addr", 0, UINT64_MAX, &v) < 0)
      BAD("region %zu: bad \"addr\"", r->nregions);
    g->addr = v;
    if (get_num(x, "len", 1, UINT64_MAX - g->addr, &v) < 0)
      BAD("region %zu: bad \"len\" (1.., within 2^64 from \"addr\")", r->nregions);
    g->len = v;
    const cJSON *rk = cJSON_GetObjectItemCaseSensitive(x, "rkey");
    if (!cJSON_IsArray(rk) || (uint32_t)cJSON_GetArraySize(rk) != r->nnics)
      BAD("region %zu: \"rkey\" needs one key per NIC (%u)", r->nregions, r->nnics);
    uint32_t k = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, rk) {
      if (mc_json_u64(e, 0, UINT32_MAX, &v) < 0)
        BAD("region %zu: bad rkey", r->nregions);
      g->rkey[k++] = (uint32_t)v;
    }
    r->nregions++;
  }
done:
  cJSON_Delete(j);
  if (rc < 0)
    mc_rdma_record_free(r);
  return rc;
}

void mc_rdma_record_free(mc_rdma_record_t *r) {
  free(r->regions);
  r->regions = NULL;
  r->nregions = 0;
}
