/* RDMA transport pieces that need no device: GID choice, slicing/striping
 * plans, connection-record encoding, the handshake RPC path over TCP, and
 * the errors of protocol "rdma" on a host without RDMA devices.  The data
 * path itself runs in the SoftRoCE guest (tests/softroce). */
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"
#include "testlib.h"
#include "transport/rdma/rdma_devices.h"
#include "transport/rdma/rdma_gid.h"
#include "transport/rdma/rdma_plan.h"
#include "transport/rdma/rdma_record.h"

static void gid_v4(mc_gid_entry_t *g, int a, int b, int c, int d, int v2) {
  memset(g, 0, sizeof *g);
  g->raw[10] = g->raw[11] = 0xff;
  g->raw[12] = (uint8_t)a;
  g->raw[13] = (uint8_t)b;
  g->raw[14] = (uint8_t)c;
  g->raw[15] = (uint8_t)d;
  g->roce_v2 = v2;
}

static void gid_ll(mc_gid_entry_t *g, int v2) {
  memset(g, 0, sizeof *g);
  g->raw[0] = 0xfe;
  g->raw[1] = 0x80;
  g->raw[15] = 1;
  g->roce_v2 = v2;
}

static void test_gid_prefers_roce_v2_ipv4(void) {
  /* The usual RoCE table: link-local v1, v2, then IPv4 v1, v2. */
  mc_gid_entry_t t[6];
  gid_ll(&t[0], 0);
  gid_ll(&t[1], 1);
  gid_v4(&t[2], 10, 0, 0, 1, 0);
  gid_v4(&t[3], 10, 0, 0, 1, 1);
  memset(&t[4], 0, sizeof t[4]);
  memset(&t[5], 0, sizeof t[5]);
  char why[64];
  mc_err_t err;
  CHECK_EQ_INT(mc_gid_choose("mlx5_0", t, 6, -1, why, sizeof why, &err), 3);
  CHECK_CONTAINS(why, "RoCE v2 IPv4");
  /* Without a v2 IPv4 GID: a v2 one, then IPv4 of any type, then the first. */
  CHECK_EQ_INT(mc_gid_choose("mlx5_0", t, 3, -1, why, sizeof why, &err), 1);
  t[1].roce_v2 = 0;
  CHECK_EQ_INT(mc_gid_choose("mlx5_0", t, 3, -1, why, sizeof why, &err), 2);
  CHECK_EQ_INT(mc_gid_choose("mlx5_0", t, 2, -1, why, sizeof why, &err), 0);
}

static void test_gid_override_and_errors(void) {
  mc_gid_entry_t t[3];
  gid_ll(&t[0], 1);
  gid_v4(&t[1], 10, 0, 0, 1, 1);
  memset(&t[2], 0, sizeof t[2]);
  char why[64];
  mc_err_t err;
  CHECK_EQ_INT(mc_gid_choose("rxe0", t, 3, 0, why, sizeof why, &err), 0);
  CHECK_CONTAINS(why, "MC_GID_INDEX=0");
  CHECK_EQ_INT(mc_gid_choose("rxe0", t, 3, 2, why, sizeof why, &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "MC_GID_INDEX=2");
  CHECK_CONTAINS(err.msg, "all zero");
  CHECK_EQ_INT(mc_gid_choose("rxe0", t, 3, 9, why, sizeof why, &err), MC_EINVAL);
  CHECK_CONTAINS(err.msg, "3 entries");
  CHECK_EQ_INT(mc_gid_choose("rxe0", &t[2], 1, -1, why, sizeof why, &err), MC_ENOTFOUND);
  CHECK_CONTAINS(err.msg, "no usable GID");
}

static void test_gid_format_parse(void) {
  mc_gid_entry_t g;
  gid_v4(&g, 192, 168, 1, 20, 1);
  char s[40];
  mc_gid_format(g.raw, s);
  CHECK(!strcmp(s, "0000:0000:0000:0000:0000:ffff:c0a8:0114"));
  uint8_t back[16];
  CHECK_EQ_INT(mc_gid_parse(s, back), 0);
  CHECK(!memcmp(back, g.raw, 16));
  CHECK_EQ_INT(mc_gid_parse("fe80::1", back), -1);
  CHECK_EQ_INT(mc_gid_parse("0000:0000:0000:0000:0000:ffff:c0a8:01zz", back), -1);
}

static void test_plan_slices_and_stripes(void) {
  uint64_t lens[3] = {1, 65536 * 2 + 5, 65536};
  CHECK_EQ_INT(mc_rdma_plan_count(lens, 3, 65536), 1 + 3 + 1);
  uint32_t qp_nic[4] = {0, 1, 0, 1}; /* 2 NICs x 2 QPs */
  uint32_t rr = 0;
  mc_rdma_slice_t s[5];
  mc_rdma_plan(lens, NULL, 3, 65536, qp_nic, 4, &rr, s);
  /* Every byte exactly once, in order per entry; QPs round-robin. */
  CHECK_EQ_INT(s[0].ent, 0);
  CHECK_EQ_INT(s[0].len, 1);
  CHECK_EQ_INT(s[1].ent, 1);
  CHECK_EQ_INT(s[1].off, 0);
  CHECK_EQ_INT(s[3].off, 131072);
  CHECK_EQ_INT(s[3].len, 5);
  CHECK_EQ_INT(s[4].ent, 2);
  for (int i = 0; i < 5; i++)
    CHECK_EQ_INT(s[i].qp, (uint32_t)i % 4);
  CHECK_EQ_INT(rr % 4, 1); /* carries over to the next op */
  mc_rdma_plan(lens, NULL, 1, 65536, qp_nic, 4, &rr, s);
  CHECK_EQ_INT(s[0].qp, 1);
}

static void test_plan_affinity(void) {
  uint64_t lens[2] = {65536 * 4, 65536 * 2};
  int pref[2] = {1, 7}; /* NIC 1; NIC 7 does not exist: all QPs */
  uint32_t qp_nic[4] = {0, 1, 0, 1};
  uint32_t rr = 0;
  mc_rdma_slice_t s[6];
  mc_rdma_plan(lens, pref, 2, 65536, qp_nic, 4, &rr, s);
  for (int i = 0; i < 4; i++)
    CHECK_EQ_INT(qp_nic[s[i].qp], 1);
  CHECK(s[0].qp != s[1].qp); /* still striped over that NIC's QPs */
  CHECK(s[4].qp != s[5].qp);
}

static void test_record_round_trip(void) {
  mc_rdma_record_t r = {.kind = MC_RDMA_REC_ACCEPT, .epoch = 42, .nnics = 2, .nqps = 3};
  strcpy(r.from, "10.0.0.2:15001");
  strcpy(r.to, "10.0.0.1:15000");
  for (int i = 0; i < 2; i++) {
    snprintf(r.nics[i].name, sizeof r.nics[i].name, "mlx5_%d", i);
    r.nics[i].lid = (uint16_t)(i ? 0 : 7);
    r.nics[i].mtu = 4096;
    r.nics[i].ethernet = i;
    r.nics[i].gid[15] = (uint8_t)(i + 1);
  }
  for (int i = 0; i < 3; i++)
    r.qps[i] = (mc_rdma_qp_info_t){.nic = (uint32_t)i % 2, .qpn = 100u + i, .psn = 0xabcdefu};
  mc_rdma_region_info_t g[2] = {{.addr = 0x7f0000001000ull, .len = 1ull << 30, .rkey = {1, 2}},
                                {.addr = 4096, .len = 1, .rkey = {0xffffffffu, 0}}};
  r.regions = g;
  r.nregions = 2;
  char *txt = mc_rdma_record_encode(&r);
  CHECK(txt != NULL);
  mc_rdma_record_t d;
  mc_err_t err;
  int rc = mc_rdma_record_decode(txt, strlen(txt), &d, &err);
  free(txt);
  CHECK_EQ_INT(rc, 0);
  CHECK_EQ_INT(d.kind, MC_RDMA_REC_ACCEPT);
  CHECK_EQ_INT(d.epoch, 42);
  CHECK(!strcmp(d.from, r.from) && !strcmp(d.to, r.to));
  CHECK_EQ_INT(d.nnics, 2);
  CHECK(!strcmp(d.nics[1].name, "mlx5_1"));
  CHECK_EQ_INT(d.nics[0].lid, 7);
  CHECK_EQ_INT(d.nics[1].ethernet, 1);
  CHECK_EQ_INT(d.nics[1].gid[15], 2);
  CHECK_EQ_INT(d.nqps, 3);
  CHECK_EQ_INT(d.qps[2].qpn, 102);
  CHECK_EQ_INT(d.qps[2].psn, 0xabcdef);
  CHECK_EQ_INT(d.nregions, 2);
  CHECK_EQ_INT(d.regions[0].addr, 0x7f0000001000ull);
  CHECK_EQ_INT(d.regions[0].rkey[1], 2);
  CHECK_EQ_INT(d.regions[1].rkey[0], 0xffffffffu);
  mc_rdma_record_free(&d);
}

static void test_record_rejects_bad_input(void) {
  mc_rdma_record_t d;
  mc_err_t err;
  static const char *const bad[][2] = {
      {"[]", "not a JSON object"},
      {"{\"rdma\":\"hello\",\"version\":1}", "unknown kind"},
      {"{\"rdma\":\"connect\",\"version\":2}", "version 2"},
      {"{\"rdma\":\"connect\",\"version\":1,\"from\":\"a\",\"to\":\"b\",\"epoch\":1,"
       "\"nics\":[],\"qps\":[{\"nic\":0,\"qpn\":1,\"psn\":0}],\"regions\":[]}",
       "QP 0 names no valid NIC"},
      {"{\"rdma\":\"connect\",\"version\":1,\"from\":\"a\",\"to\":\"b\",\"epoch\":1,"
       "\"nics\":[{\"name\":\"x\",\"lid\":0,\"gid\":\"fe80::1\",\"mtu\":1024}],\"qps\":[],"
       "\"regions\":[]}",
       "bad \"gid\""},
      {"{\"rdma\":\"accept\",\"version\":1,\"from\":\"a\",\"to\":\"b\",\"epoch\":1,"
       "\"nics\":[{\"name\":\"x\",\"lid\":0,\"gid\":\"0000:0000:0000:0000:0000:0000:0000:0001\","
       "\"mtu\":1024}],\"qps\":[],\"regions\":[{\"addr\":1,\"len\":2,\"rkey\":[1,2]}]}",
       "one key per NIC"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    CHECK_EQ_INT(mc_rdma_record_decode(bad[i][0], strlen(bad[i][0]), &d, &err), MC_EPROTO);
    CHECK_CONTAINS(err.msg, bad[i][1]);
  }
}

static mc_engine_t *mk(const char *proto, const char *dev, mc_err_t *err) {
  mc_engine_opts_t o = {.local_hostname = "127.0.0.1", .metadata_server = "P2PHANDSHAKE",
                        .protocol = proto, .device_name = dev};
  mc_engine_t *e = NULL;
  return mc_engine_create(&o, &e, err) == 0 ? e : NULL;
}

/* This host has no RDMA device (CI): protocol "rdma" fails at start,
 * naming what is missing; with devices present the error lists them. */
static void test_rdma_without_devices_is_a_clear_error(void) {
  char have[256];
  mc_err_t err = {0};
  int n = mc_rdma_list_devices(have, sizeof have, &err);
  mc_engine_t *e = mk("rdma", "mlx5_0", &err);
  CHECK(e == NULL);
  if (n > 0) {
    CHECK_CONTAINS(err.msg, "devices here");
  } else if (n == 0) {
    CHECK_EQ_INT(err.code, MC_EUNAVAIL);
    CHECK_CONTAINS(err.msg, "no RDMA device on this host");
    CHECK_CONTAINS(err.msg, "no silent fallback");
  } else {
    CHECK_CONTAINS(err.msg, "libibverbs");
  }
}

static void test_fallback_only_when_asked(void) {
  char have[256];
  mc_err_t err = {0};
  if (mc_rdma_list_devices(have, sizeof have, &err) > 0)
    return; /* a host with RDMA: nothing to fall back from */
  /* asked for in any of the boolean spellings the other knobs take */
  static const char *const yes[] = {"1", "true", "yes", "ON"};
  for (size_t i = 0; i < sizeof yes / sizeof yes[0]; i++) {
    setenv("MC_RDMA_FALLBACK_TCP", yes[i], 1);
    mc_engine_t *e = mk("rdma", "mlx5_0", &err);
    unsetenv("MC_RDMA_FALLBACK_TCP");
    CHECK(e != NULL);
    char *d = e ? mc_engine_describe(e) : NULL;
    CHECK(d && strstr(d, "\"protocol\":\"tcp\""));
    free(d);
    if (e)
      mc_engine_destroy(e);
    mc_err_clear(&err);
  }
  /* not asked for: 0 / off, or a value that is no boolean (warned) */
  static const char *const no[] = {"0", "off", "maybe"};
  for (size_t i = 0; i < sizeof no / sizeof no[0]; i++) {
    setenv("MC_RDMA_FALLBACK_TCP", no[i], 1);
    mc_engine_t *e = mk("rdma", "mlx5_0", &err);
    unsetenv("MC_RDMA_FALLBACK_TCP");
    CHECK(e == NULL);
    if (e)
      mc_engine_destroy(e);
    mc_err_clear(&err);
  }
}

/* The handshake travels as an RPC on the TCP control connection; a TCP
 * engine answers it with an error naming the protocol mismatch. */
static void test_rpc_reaches_a_tcp_engine(void) {
  mc_err_t err = {0};
  mc_engine_t *a = mk("tcp", "", &err), *b = mk("tcp", "", &err);
  CHECK(a && b);
  char *reply = NULL;
  int rc = mc_engine_rpc(a, mc_engine_segment_name(b), "{\"rdma\":\"connect\"}", 18, 5000,
                         &reply, &err);
  CHECK_EQ_INT(rc, MC_EUNAVAIL);
  CHECK_CONTAINS(err.msg, "speaks protocol \"tcp\", not \"rdma\"");
  CHECK(reply == NULL);
  /* The connection is still usable afterwards. */
  CHECK_EQ_INT(mc_engine_notify(a, mc_engine_segment_name(b), "x", 1, 5000, &err), 0);
  mc_engine_destroy(a);
  mc_engine_destroy(b);
}

int main(void) {
  RUN(test_gid_prefers_roce_v2_ipv4);
  RUN(test_gid_override_and_errors);
  RUN(test_gid_format_parse);
  RUN(test_plan_slices_and_stripes);
  RUN(test_plan_affinity);
  RUN(test_record_round_trip);
  RUN(test_record_rejects_bad_input);
  RUN(test_rdma_without_devices_is_a_clear_error);
  RUN(test_fallback_only_when_asked);
  RUN(test_rpc_reaches_a_tcp_engine);
  TEST_MAIN_END();
}
