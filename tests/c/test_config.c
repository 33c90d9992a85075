/* Unit tests for csrc/config: mooncake.json parsing, normalisation, the
 * seed's port rules and the wording of every rejection. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "config/config.h"
#include "util/env.h"
#include "testlib.h"

#define ORIGIN "test.json"

/* Parses text with origin "test.json"; err is cleared first. */
static int parse(const char *text, mc_config_t *cfg, mc_err_t *err) {
  memset(cfg, 0, sizeof *cfg);
  mc_err_clear(err);
  return mc_config_parse(text, strlen(text), ORIGIN, cfg, err);
}

/* A config with the given prefill/decode/metadata_server and extra members
 * (", \"protocol\": \"rdma\"" ...) appended. */
static const char *cfgjson(char *buf, size_t n, const char *prefill, const char *decode,
                           const char *meta, const char *extra) {
  snprintf(buf, n,
           "{\"prefill_url\": \"%s\", \"decode_url\": \"%s\", "
           "\"metadata_server\": \"%s\"%s}",
           prefill, decode, meta, extra ? extra : "");
  return buf;
}

/* Parses a config whose only interesting part is metadata_server/backend. */
static int parse_meta(const char *meta, const char *extra, mc_config_t *cfg, mc_err_t *err) {
  char buf[2048];
  return parse(cfgjson(buf, sizeof buf, "10.0.0.1:13003", "10.0.0.2:13003", meta, extra), cfg, err);
}

static int parse_urls(const char *prefill, const char *decode, mc_config_t *cfg, mc_err_t *err) {
  char buf[2048];
  return parse(cfgjson(buf, sizeof buf, prefill, decode, "P2PHANDSHAKE", NULL), cfg, err);
}

static int parse_extra(const char *extra, mc_config_t *cfg, mc_err_t *err) {
  char buf[2048];
  return parse(cfgjson(buf, sizeof buf, "10.0.0.1:13003", "10.0.0.2:13003", "P2PHANDSHAKE", extra),
               cfg, err);
}

/* Writes data to a fresh temp file; returns its malloc'ed path. */
static char *write_temp(const char *data, size_t len) {
  char tmpl[] = "/tmp/mc_test_config_XXXXXX";
  int fd = mkstemp(tmpl);
  if (fd < 0)
    return NULL;
  size_t off = 0;
  while (off < len) {
    ssize_t w = write(fd, data + off, len - off);
    if (w <= 0) {
      close(fd);
      unlink(tmpl);
      return NULL;
    }
    off += (size_t)w;
  }
  close(fd);
  return strdup(tmpl);
}

static const char SEED_RDMA[] = "{\n"
                                "  \"prefill_url\": \"192.168.0.137:13003\",\n"
                                "  \"decode_url\": \"192.168.0.139:13003\",\n"
                                "  \"metadata_server\": \"192.168.0.139:2379\",\n"
                                "  \"metadata_backend\": \"etcd\",\n"
                                "  \"protocol\": \"rdma\",\n"
                                "  \"device_name\": \"erdma_0\"\n"
                                "}\n";

static const char SEED_TCP[] = "{\n"
                               "  \"prefill_url\": \"192.168.0.137:13003\",\n"
                               "  \"decode_url\": \"192.168.0.139:13003\",\n"
                               "  \"metadata_server\": \"192.168.0.139:2379\",\n"
                               "  \"metadata_backend\": \"etcd\",\n"
                               "  \"protocol\": \"tcp\",\n"
                               "  \"device_name\": \"\"\n"
                               "}\n";

/* ---- the seed's examples ------------------------------------------------ */

static void test_seed_rdma(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse(SEED_RDMA, &cfg, &err), 0);
  CHECK(strcmp(cfg.origin, ORIGIN) == 0);
  CHECK(strcmp(cfg.prefill.host, "192.168.0.137") == 0);
  CHECK_EQ_INT(cfg.prefill.port, 13003);
  CHECK(strcmp(cfg.decode.host, "192.168.0.139") == 0);
  CHECK_EQ_INT(cfg.decode.port, 13003);
  CHECK_EQ_INT(cfg.metadata_kind, MC_META_ETCD);
  CHECK(strcmp(cfg.metadata_server, "etcd://192.168.0.139:2379") == 0);
  CHECK(strcmp(cfg.metadata_server_raw, "192.168.0.139:2379") == 0);
  CHECK(cfg.metadata_backend_given);
  CHECK_EQ_INT(cfg.protocol, MC_PROTO_RDMA);
  CHECK(strcmp(cfg.device_name, "erdma_0") == 0);
  CHECK(!cfg.decode_port_adjusted);
  CHECK_CONTAINS(cfg.notes, "metadata_backend is deprecated");
  CHECK_CONTAINS(cfg.notes, "etcd://192.168.0.139:2379");
}

static void test_seed_tcp(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse(SEED_TCP, &cfg, &err), 0);
  CHECK_EQ_INT(cfg.protocol, MC_PROTO_TCP);
  CHECK(strcmp(cfg.device_name, "") == 0);
  CHECK(strcmp(cfg.metadata_server, "etcd://192.168.0.139:2379") == 0);
  CHECK_EQ_INT(cfg.decode.port, 13003);
}

static void test_seed_rdma_from_file(void) {
  char *path = write_temp(SEED_RDMA, strlen(SEED_RDMA));
  CHECK(path);
  mc_config_t cfg;
  mc_err_t err = {0};
  int rc = mc_config_load_file(path, &cfg, &err);
  int same = strcmp(cfg.origin, path) == 0;
  unlink(path);
  free(path);
  CHECK_EQ_INT(rc, 0);
  CHECK(same);
  CHECK(strcmp(cfg.device_name, "erdma_0") == 0);
}

static void test_minimal_defaults(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse("{\"prefill_url\":\"a:1000\",\"decode_url\":\"b:1000\","
                     "\"metadata_server\":\"etcd://m:2379\"}",
                     &cfg, &err),
               0);
  CHECK_EQ_INT(cfg.protocol, MC_PROTO_TCP);
  CHECK(!cfg.metadata_backend_given);
  CHECK(strcmp(cfg.notes, "") == 0);
  CHECK(strcmp(cfg.device_name, "") == 0);
  CHECK(cfg.same_host_cpu); /* on unless the file says false */
}

static void test_same_host_cpu_switch(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse_extra(", \"same_host_cpu\": false", &cfg, &err), 0);
  CHECK(!cfg.same_host_cpu);
  CHECK_EQ_INT(parse_extra(", \"same_host_cpu\": true", &cfg, &err), 0);
  CHECK(cfg.same_host_cpu);
  CHECK_EQ_INT(parse_extra(", \"same_host_cpu\": \"false\"", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, ORIGIN ": field \"same_host_cpu\": value \"false\" is a string; "
                          "expected true or false");
  CHECK_EQ_INT(parse_extra(", \"same_host_cpu\": 0", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "is a number; expected true or false");
  CHECK_EQ_INT(parse_extra(", \"same_host_cpu\": false, \"same_host_cpu\": true", &cfg, &err),
               MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "appears more than once");
  CHECK_EQ_INT(parse_extra(", \"same_host_pcu\": false", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "did you mean \"same_host_cpu\"?");
}

static void test_tcp_device_ignored(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse_extra(", \"protocol\": \"tcp\", \"device_name\": \"erdma_0\"", &cfg, &err), 0);
  CHECK(strcmp(cfg.device_name, "") == 0);
  CHECK_CONTAINS(cfg.notes, "device_name ignored");
}

static void test_names(void) {
  CHECK(strcmp(mc_meta_kind_name(MC_META_P2P), "p2p") == 0);
  CHECK(strcmp(mc_meta_kind_name(MC_META_ETCD), "etcd") == 0);
  CHECK(strcmp(mc_meta_kind_name(MC_META_REDIS), "redis") == 0);
  CHECK(strcmp(mc_meta_kind_name(MC_META_HTTP), "http") == 0);
  CHECK(strcmp(mc_protocol_name(MC_PROTO_TCP), "tcp") == 0);
  CHECK(strcmp(mc_protocol_name(MC_PROTO_RDMA), "rdma") == 0);
}

/* ---- metadata_server forms ---------------------------------------------- */

static void test_meta_p2p(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse_meta("P2PHANDSHAKE", NULL, &cfg, &err), 0);
  CHECK_EQ_INT(cfg.metadata_kind, MC_META_P2P);
  CHECK(strcmp(cfg.metadata_server, "P2PHANDSHAKE") == 0);
  CHECK(strcmp(cfg.notes, "") == 0);

  CHECK_EQ_INT(parse_meta("p2phandshake", ", \"metadata_backend\": \"etcd\"", &cfg, &err), 0);
  CHECK_EQ_INT(cfg.metadata_kind, MC_META_P2P);
  CHECK(strcmp(cfg.metadata_server, "P2PHANDSHAKE") == 0);
  CHECK(strcmp(cfg.metadata_server_raw, "p2phandshake") == 0);
  CHECK_CONTAINS(cfg.notes, "metadata_backend \"etcd\" ignored");
}

static void test_meta_etcd(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse_meta("etcd://10.0.0.9:2379", NULL, &cfg, &err), 0);
  CHECK_EQ_INT(cfg.metadata_kind, MC_META_ETCD);
  CHECK(strcmp(cfg.metadata_server, "etcd://10.0.0.9:2379") == 0);

  /* Scheme is case-insensitive; several endpoints; IPv6. */
  CHECK_EQ_INT(parse_meta("ETCD://a:2379,b:2380,[::1]:2381", NULL, &cfg, &err), 0);
  CHECK(strcmp(cfg.metadata_server, "etcd://a:2379,b:2380,[::1]:2381") == 0);
  CHECK(strcmp(cfg.metadata_server_raw, "ETCD://a:2379,b:2380,[::1]:2381") == 0);

  /* Bare host:port defaults to etcd, with or without metadata_backend. */
  CHECK_EQ_INT(parse_meta("m:2379", NULL, &cfg, &err), 0);
  CHECK_EQ_INT(cfg.metadata_kind, MC_META_ETCD);
  CHECK(strcmp(cfg.metadata_server, "etcd://m:2379") == 0);
  CHECK(strcmp(cfg.notes, "") == 0);
  CHECK_EQ_INT(parse_meta("m:2379,n:2379", ", \"metadata_backend\": \"etcd\"", &cfg, &err), 0);
  CHECK(strcmp(cfg.metadata_server, "etcd://m:2379,n:2379") == 0);

  /* Explicit scheme with a matching backend is fine (but redundant). */
  CHECK_EQ_INT(parse_meta("etcd://m:2379", ", \"metadata_backend\": \"etcd\"", &cfg, &err), 0);
  CHECK_CONTAINS(cfg.notes, "redundant");
}

static void test_meta_redis(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse_meta("redis://10.0.0.9:6379", NULL, &cfg, &err), 0);
  CHECK_EQ_INT(cfg.metadata_kind, MC_META_REDIS);
  CHECK(strcmp(cfg.metadata_server, "redis://10.0.0.9:6379") == 0);

  CHECK_EQ_INT(parse_meta("redis://:s3cr@t@r:6379/2", NULL, &cfg, &err), 0);
  CHECK(strcmp(cfg.metadata_server, "redis://:s3cr@t@r:6379/2") == 0);

  CHECK_EQ_INT(parse_meta("Redis://r:6379/007", NULL, &cfg, &err), 0);
  CHECK(strcmp(cfg.metadata_server, "redis://r:6379/7") == 0);

  /* Deprecated backend picks the scheme of a bare host:port. */
  CHECK_EQ_INT(parse_meta("r:6379", ", \"metadata_backend\": \"redis\"", &cfg, &err), 0);
  CHECK_EQ_INT(cfg.metadata_kind, MC_META_REDIS);
  CHECK(strcmp(cfg.metadata_server, "redis://r:6379") == 0);
  CHECK(cfg.metadata_backend_given);
  CHECK_CONTAINS(cfg.notes, "\"redis://r:6379\"");

  /* The deprecation note must not leak the password. */
  CHECK_EQ_INT(parse_meta(":hunter2@r:6379", ", \"metadata_backend\": \"redis\"", &cfg, &err), 0);
  CHECK(strcmp(cfg.metadata_server, "redis://:hunter2@r:6379") == 0);
  CHECK(strstr(cfg.notes, "hunter2") == NULL);
}

static void test_meta_http(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse_meta("http://10.0.0.9:8080/metadata", NULL, &cfg, &err), 0);
  CHECK_EQ_INT(cfg.metadata_kind, MC_META_HTTP);
  CHECK(strcmp(cfg.metadata_server, "http://10.0.0.9:8080/metadata") == 0);
  CHECK(strcmp(cfg.notes, "") == 0);

  CHECK_EQ_INT(parse_meta("https://meta.example.com/api/v1/md", NULL, &cfg, &err), 0);
  CHECK(strcmp(cfg.metadata_server, "https://meta.example.com/api/v1/md") == 0);

  CHECK_EQ_INT(parse_meta("http://h:8080", NULL, &cfg, &err), 0);
  CHECK(strcmp(cfg.metadata_server, "http://h:8080/metadata") == 0);
  CHECK_CONTAINS(cfg.notes, "no path");

  /* Bare host:port with metadata_backend http -> /metadata. */
  CHECK_EQ_INT(parse_meta("h:8080", ", \"metadata_backend\": \"http\"", &cfg, &err), 0);
  CHECK_EQ_INT(cfg.metadata_kind, MC_META_HTTP);
  CHECK(strcmp(cfg.metadata_server, "http://h:8080/metadata") == 0);
  CHECK(strcmp(cfg.metadata_server_raw, "h:8080") == 0);
  CHECK_CONTAINS(cfg.notes, "deprecated");
}

static void test_meta_backend_conflict(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse_meta("etcd://m:2379", ", \"metadata_backend\": \"redis\"", &cfg, &err),
               MC_ECONFIG);
  CHECK_EQ_INT(err.code, MC_ECONFIG);
  CHECK_CONTAINS(err.msg, ORIGIN ": field \"metadata_backend\": value \"redis\"");
  CHECK_CONTAINS(err.msg, "conflicts with metadata_server \"etcd://m:2379\"");
  CHECK_CONTAINS(err.msg, "accepted:");
  CHECK_CONTAINS(err.msg, "set it to \"etcd\"");

  CHECK_EQ_INT(parse_meta("http://m:80/md", ", \"metadata_backend\": \"etcd\"", &cfg, &err),
               MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "scheme http");
}

static void test_meta_backend_bad(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse_meta("m:2379", ", \"metadata_backend\": \"zookeeper\"", &cfg, &err),
               MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "field \"metadata_backend\": value \"zookeeper\"");
  CHECK_CONTAINS(err.msg, "accepted: \"etcd\", \"redis\", \"http\"");
  CHECK_EQ_INT(parse_meta("m:2379", ", \"metadata_backend\": \"ETCD\"", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "lowercase");
}

static void test_meta_unknown_scheme(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse_meta("zk://h:2181", NULL, &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, ORIGIN ": field \"metadata_server\": value \"zk://h:2181\"");
  CHECK_CONTAINS(err.msg, "unknown scheme \"zk\"");
  CHECK_CONTAINS(err.msg, "accepted: \"P2PHANDSHAKE\", \"etcd://");
  CHECK_CONTAINS(err.msg, "redis://");
  CHECK_CONTAINS(err.msg, "http(s)://");

  CHECK_EQ_INT(parse_meta("://h:1", NULL, &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "no recognisable scheme");
}

static void test_meta_bad_values(void) {
  mc_config_t cfg;
  mc_err_t err;
  static const struct {
    const char *meta, *extra, *want;
  } cases[] = {
      {"", NULL, "is empty"},
      {"m", NULL, "has no port in \"m\""},
      {"etcd://m", NULL, "has no port"},
      {"etcd://", NULL, "empty host:port item"},
      {"etcd://a:1,,b:2", NULL, "empty host:port item"},
      {"etcd://a:1,", NULL, "empty host:port item"},
      {"etcd://a:0", NULL, "port 0"},
      {"etcd://a:70000", NULL, "out of range"},
      {"etcd://a:2379/", NULL, "has a path"},
      {"redis://r", NULL, "has no port"},
      {"redis://r:6379/x", NULL, "database \"x\", which is not a non-negative integer"},
      {"redis://r:6379/-1", NULL, "not a non-negative integer"},
      {"redis://r:6379/", NULL, "not a non-negative integer"},
      {"redis://r:6379/1/2", NULL, "not a non-negative integer"},
      {"redis://user:pw@r:6379", NULL, "without a leading ':'"},
      {"redis://:@r:6379", NULL, "empty password"},
      {"http://h:8080/md?x=1", NULL, "character '?'"},
      {"http://:8080/md", NULL, "empty host"},
      {"h", ", \"metadata_backend\": \"http\"", "has no port"},
      {"r", ", \"metadata_backend\": \"redis\"", "has no port"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    int rc = parse_meta(cases[i].meta, cases[i].extra, &cfg, &err);
    if (rc != MC_ECONFIG)
      fprintf(stderr, "  case %zu: %s\n", i, cases[i].meta);
    CHECK_EQ_INT(rc, MC_ECONFIG);
    CHECK_CONTAINS(err.msg, ORIGIN ": field \"metadata_server\": value \"");
    CHECK_CONTAINS(err.msg, cases[i].want);
    CHECK_CONTAINS(err.msg, "; accepted: \"P2PHANDSHAKE\"");
  }
}

static void test_meta_password_masked_in_errors(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse_meta("redis://:hunter2@r:6379/x", NULL, &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "value \"redis://:***@r:6379/x\"");
  CHECK(strstr(err.msg, "hunter2") == NULL);
}

/* ---- the port rules ------------------------------------------------------ */

static void test_identical_urls_plus_100(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse_urls("192.168.0.137:13003", "192.168.0.137:13003", &cfg, &err), 0);
  CHECK_EQ_INT(cfg.prefill.port, 13003);
  CHECK_EQ_INT(cfg.decode.port, 13103);
  CHECK(strcmp(cfg.decode.host, "192.168.0.137") == 0);
  CHECK(cfg.decode_port_adjusted);
  CHECK_CONTAINS(cfg.notes, "decode_url equals prefill_url; using decode port 13103");
  CHECK_CONTAINS(cfg.notes, "seed rule");
}

static void test_identical_urls_overflow(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse_urls("h:65500", "h:65500", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, ORIGIN ": field \"decode_url\": value \"h:65500\"");
  CHECK_CONTAINS(err.msg, "65600");
  CHECK_CONTAINS(err.msg, "65535");
  CHECK_CONTAINS(err.msg, "accepted:");
  CHECK_CONTAINS(err.msg, "\"h:65400\"");
}

static void test_ports_too_close(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse_urls("192.168.0.137:13003", "192.168.0.137:13010", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, ORIGIN ": field \"decode_url\": value \"192.168.0.137:13010\"");
  CHECK_CONTAINS(err.msg, "prefill_url \"192.168.0.137:13003\"");
  CHECK_CONTAINS(err.msg, "only 7 apart");
  CHECK_CONTAINS(err.msg, "at least 50 apart");
  CHECK_CONTAINS(err.msg, "e.g. \"192.168.0.137:13103\"");

  /* 49 below is as bad as 49 above. */
  CHECK_EQ_INT(parse_urls("h:13003", "h:12954", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "only 49 apart");
  /* Host names compare case-insensitively. */
  CHECK_EQ_INT(parse_urls("Node1:13003", "node1:13004", &cfg, &err), MC_ECONFIG);
}

static void test_ports_50_apart_ok(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse_urls("192.168.0.137:13003", "192.168.0.137:13053", &cfg, &err), 0);
  CHECK_EQ_INT(cfg.decode.port, 13053);
  CHECK(!cfg.decode_port_adjusted);
  CHECK_EQ_INT(parse_urls("h:13053", "h:13003", &cfg, &err), 0);
  CHECK_EQ_INT(parse_urls("h:13003", "h:13103", &cfg, &err), 0);
  CHECK(strcmp(cfg.notes, "") == 0);
}

static void test_different_hosts_same_port_ok(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse_urls("192.168.0.137:13003", "192.168.0.139:13003", &cfg, &err), 0);
  CHECK_EQ_INT(cfg.decode.port, 13003);
  CHECK(!cfg.decode_port_adjusted);
  CHECK_EQ_INT(parse_urls("a:13003", "b:13004", &cfg, &err), 0);
}

static void test_bad_urls(void) {
  mc_config_t cfg;
  mc_err_t err;
  static const struct {
    const char *url, *want;
  } cases[] = {
      {"192.168.0.137", "has no port"},
      {"192.168.0.137:0", "port 0"},
      {"192.168.0.137:70000", "out of range"},
      {":13003", "empty host"},
      {"", "is empty"},
      {"not a url!", "invalid character ' '"},
      {"h:12ab", "not a number"},
      {"h:", "no port"},
      {"http://h:13003", "must not have a scheme"},
      {"a:b:c", "several ':'"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    /* Each bad value once as prefill_url, once as decode_url. */
    CHECK_EQ_INT(parse_urls(cases[i].url, "10.9.9.9:1000", &cfg, &err), MC_ECONFIG);
    CHECK_CONTAINS(err.msg, ORIGIN ": field \"prefill_url\": value \"");
    CHECK_CONTAINS(err.msg, cases[i].url);
    CHECK_CONTAINS(err.msg, cases[i].want);
    CHECK_CONTAINS(err.msg, "; accepted: \"host:port\"");
    CHECK_EQ_INT(parse_urls("10.9.9.9:1000", cases[i].url, &cfg, &err), MC_ECONFIG);
    CHECK_CONTAINS(err.msg, ORIGIN ": field \"decode_url\": value \"");
    CHECK_CONTAINS(err.msg, cases[i].want);
  }
}

/* ---- protocol / device_name --------------------------------------------- */

static void test_unknown_protocol(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse_extra(", \"protocol\": \"udp\"", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, ORIGIN ": field \"protocol\": value \"udp\"");
  CHECK_CONTAINS(err.msg, "accepted: \"tcp\", \"rdma\"");
  CHECK_EQ_INT(parse_extra(", \"protocol\": \"RDMA\", \"device_name\": \"mlx5_0\"", &cfg, &err),
               MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "value \"RDMA\"");
  CHECK_CONTAINS(err.msg, "lowercase");
  CHECK_EQ_INT(parse_extra(", \"protocol\": \"\"", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "value \"\"");
}

static void test_rdma_without_device(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse_extra(", \"protocol\": \"rdma\"", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, ORIGIN ": field \"device_name\": is missing");
  CHECK_CONTAINS(err.msg, "\"rdma\" needs at least one RDMA NIC");
  CHECK_CONTAINS(err.msg, "accepted: comma-separated");
  CHECK_EQ_INT(parse_extra(", \"protocol\": \"rdma\", \"device_name\": \"\"", &cfg, &err),
               MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "field \"device_name\": value \"\" is empty");
}

static void test_device_names(void) {
  mc_config_t cfg;
  mc_err_t err;
  char extra[256];
  CHECK_EQ_INT(parse_extra(", \"protocol\": \"rdma\", \"device_name\": \"mlx5_0,mlx5-1,erdma.2\"",
                           &cfg, &err),
               0);
  CHECK(strcmp(cfg.device_name, "mlx5_0,mlx5-1,erdma.2") == 0);

  static const struct {
    const char *dev, *want;
  } cases[] = {
      {"erdma_0,", "empty NIC name at position 2"},
      {",erdma_0", "empty NIC name at position 1"},
      {"a,,b", "empty NIC name at position 2"},
      {"erdma 0", "invalid character ' ' in NIC name 1"},
      {"mlx5_0, mlx5_1", "no spaces around commas"},
      {"mlx5/0", "invalid character '/'"},
      {"a;b", "invalid character ';'"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    snprintf(extra, sizeof extra, ", \"protocol\": \"rdma\", \"device_name\": \"%s\"",
             cases[i].dev);
    CHECK_EQ_INT(parse_extra(extra, &cfg, &err), MC_ECONFIG);
    CHECK_CONTAINS(err.msg, ORIGIN ": field \"device_name\": value \"");
    CHECK_CONTAINS(err.msg, cases[i].dev);
    CHECK_CONTAINS(err.msg, cases[i].want);
    CHECK_CONTAINS(err.msg, "accepted: comma-separated");
  }
  /* A NIC name longer than the kernel allows. */
  snprintf(extra, sizeof extra, ", \"protocol\": \"rdma\", \"device_name\": \"%070d\"", 0);
  CHECK_EQ_INT(parse_extra(extra, &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "longer than 63");
}

/* ---- JSON shape ---------------------------------------------------------- */

static void test_unknown_field(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse_extra(", \"protcol\": \"rdma\"", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, ORIGIN ": field \"protcol\": unknown field");
  CHECK_CONTAINS(err.msg, "did you mean \"protocol\"?");
  CHECK_CONTAINS(err.msg, "accepted: prefill_url, decode_url, metadata_server");

  CHECK_EQ_INT(parse_extra(", \"device\": \"x\"", &cfg, &err), MC_ECONFIG);
  CHECK(strstr(err.msg, "did you mean") == NULL);

  CHECK_EQ_INT(parse_extra(", \"decode_uri\": \"x\"", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "did you mean \"decode_url\"?");

  CHECK_EQ_INT(parse_extra(", \"kv_role\": \"kv_producer\"", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "--kv-transfer-config");

  /* Mooncake Store's fields, carried over from its mooncake.json */
  CHECK_EQ_INT(parse_extra(", \"local_hostname\": \"10.0.0.1\"", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "Mooncake Store setting");
  CHECK_EQ_INT(parse_extra(", \"global_segment_size\": 3355443200", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "remove it");
}

static void test_wrong_type(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse_extra(", \"protocol\": 5", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, ORIGIN ": field \"protocol\": value 5 is a number; expected a string");
  CHECK_CONTAINS(err.msg, "accepted: \"tcp\", \"rdma\"");

  CHECK_EQ_INT(parse("{\"prefill_url\": [\"a:1\"]}", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "field \"prefill_url\": value [\"a:1\"] is an array");
  CHECK_EQ_INT(parse_extra(", \"device_name\": null", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "value null is null; expected a string");
  CHECK_EQ_INT(parse_extra(", \"metadata_backend\": true", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "is a boolean");
  CHECK_EQ_INT(parse_extra(", \"protocol\": {\"x\": 1}", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "is an object");
}

static void test_missing_required(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse("{\"prefill_url\": \"a:1000\", \"decode_url\": \"b:1000\"}", &cfg, &err),
               MC_ECONFIG);
  CHECK_CONTAINS(err.msg, ORIGIN ": field \"metadata_server\": is missing (required)");
  CHECK_CONTAINS(err.msg, "accepted: \"P2PHANDSHAKE\"");
  CHECK_EQ_INT(parse("{}", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "field \"prefill_url\": is missing");
}

static void test_duplicate_field(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse_extra(", \"protocol\": \"tcp\", \"protocol\": \"rdma\"", &cfg, &err),
               MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "field \"protocol\": appears more than once");
}

static void test_top_level_not_object(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse("[1, 2]", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, ORIGIN ": top-level JSON value is an array");
  CHECK_CONTAINS(err.msg, "expected a JSON object");
  CHECK_EQ_INT(parse("\"P2PHANDSHAKE\"", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "is a string");
}

static void test_bad_json_line_col(void) {
  mc_config_t cfg;
  mc_err_t err;
  /* Trailing comma: the '}' on line 4 is the culprit. */
  CHECK_EQ_INT(parse("{\n"
                     "  \"prefill_url\": \"a:1000\",\n"
                     "  \"decode_url\": \"b:1000\",\n"
                     "}\n",
                     &cfg, &err),
               MC_ECONFIG);
  CHECK_CONTAINS(err.msg, ORIGIN ": invalid JSON at line 4, column 1 near \"}\": "
                                 "trailing comma before '}'");
  CHECK_CONTAINS(err.msg, "no trailing commas");
  CHECK_CONTAINS(err.msg, "expected a JSON object");

  /* Single quotes on line 2, column 18. */
  CHECK_EQ_INT(parse("{\n"
                     "  \"prefill_url\": 'a:1000'\n"
                     "}\n",
                     &cfg, &err),
               MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "invalid JSON at line 2, column 18 near \"'a:1000'\"");
  CHECK_CONTAINS(err.msg, "double quotes");

  /* Missing comma: error at the second key, line 3 column 3. */
  CHECK_EQ_INT(parse("{\n"
                     "  \"prefill_url\": \"a:1000\"\n"
                     "  \"decode_url\": \"b:1000\"\n"
                     "}\n",
                     &cfg, &err),
               MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "invalid JSON at line 3, column 3");
  CHECK_CONTAINS(err.msg, "missing comma?");

  /* Unquoted key. */
  CHECK_EQ_INT(parse("{prefill_url: \"a:1\"}", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "line 1, column 2 near \"prefill_url: ");
  CHECK_CONTAINS(err.msg, "expected a double-quoted key");

  /* Comment; columns count characters, not UTF-8 bytes. */
  CHECK_EQ_INT(parse("{\"x\u00e9\": 1, // \xc3\xa9\n}", &cfg, &err), MC_ECONFIG);
  CHECK_EQ_INT(parse("{\n  \"\xc3\xa9\": 1, // note\n}", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "line 2, column 11");
  CHECK_CONTAINS(err.msg, "comments are not allowed");

  /* Truncated file. */
  CHECK_EQ_INT(parse("{\"prefill_url\": \"a:1000\"", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "invalid JSON at line 1, column 25 at end of input: missing '}'");
  CHECK_EQ_INT(parse("{\"prefill_url\": \"a:1000", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "unterminated string");

  /* Other malformed values. */
  CHECK_EQ_INT(parse("{\"a\": tru}", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "column 7");
  CHECK_EQ_INT(parse("{\"a\": 01}", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "column 8 near \"1}\": numbers must not have leading zeros");
  CHECK_EQ_INT(parse("{\"a\": \"x\\q\"}", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "invalid escape");
  CHECK_EQ_INT(parse("{\"a\": \"x\ny\"}", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "control character inside a string");
  CHECK_EQ_INT(parse("{\"a\": [1,]}", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "column 10 near \"]}\": trailing comma before ']'");
  CHECK_EQ_INT(parse("{\"a\" \"x\"}", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "expected ':'");
  CHECK_EQ_INT(parse("[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["
                     "]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]",
                     &cfg, &err),
               MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "nesting too deep");

  /* Text after the object. */
  CHECK_EQ_INT(parse("{}\n\n  xyz", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "line 3, column 3 near \"xyz\": unexpected text after the JSON value");

  /* Embedded NUL. */
  static const char nul[] = "{\n \0}";
  memset(&cfg, 0, sizeof cfg);
  CHECK_EQ_INT(mc_config_parse(nul, sizeof nul - 1, ORIGIN, &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "NUL byte");
  CHECK_CONTAINS(err.msg, "line 2, column 2");

  /* A UTF-8 byte-order mark is accepted. */
  CHECK_EQ_INT(parse("\xef\xbb\xbf{\"prefill_url\": \"a:1000\", \"decode_url\": \"b:1000\", "
                     "\"metadata_server\": \"P2PHANDSHAKE\"}",
                     &cfg, &err),
               0);
}

static void test_empty(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse("", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, ORIGIN ": config is empty");
  CHECK_EQ_INT(parse(" \n\t\n", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "config is empty");

  char *path = write_temp("", 0);
  CHECK(path);
  int rc = mc_config_load_file(path, &cfg, &err);
  unlink(path);
  CHECK_EQ_INT(rc, MC_ECONFIG);
  CHECK_CONTAINS(err.msg, path);
  free(path);
  CHECK_CONTAINS(err.msg, "config is empty");
}

static void test_long_value(void) {
  mc_config_t cfg;
  mc_err_t err;
  size_t n = MC_CFG_STR_MAX + 100;
  char *v = malloc(n + 1);
  char *text = malloc(n + 64);
  CHECK(v && text);
  memset(v, 'a', n);
  v[n] = '\0';
  snprintf(text, n + 64, "{\"protocol\": \"%s\"}", v);
  int rc = parse(text, &cfg, &err);
  free(v);
  free(text);
  CHECK_EQ_INT(rc, MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "field \"protocol\": value \"aaaa");
  CHECK_CONTAINS(err.msg, "...\"");
  CHECK_CONTAINS(err.msg, "at most 1023");
  CHECK(strlen(err.msg) < MC_ERR_MSG_MAX - 1);
}

static void test_control_chars_escaped(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse_extra(", \"protocol\": \"a\\nb\\\"c\"", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "value \"a\\x0ab\\\"c\"");
  CHECK(strchr(err.msg, '\n') == NULL);
}

/* Strict UTF-8 check (no overlongs/surrogates), as Python's decoder. */
static int valid_utf8(const char *p) {
  const unsigned char *s = (const unsigned char *)p;
  while (*s) {
    int n = *s < 0x80                    ? 1
            : (*s >= 0xc2 && *s <= 0xdf) ? 2
            : (*s >= 0xe0 && *s <= 0xef) ? 3
            : (*s >= 0xf0 && *s <= 0xf4) ? 4
                                         : 0;
    if (!n)
      return 0;
    for (int i = 1; i < n; i++)
      if ((s[i] & 0xc0) != 0x80)
        return 0;
    s += n;
  }
  return 1;
}

static void test_messages_valid_utf8(void) {
  mc_config_t cfg;
  mc_err_t err;
  /* Raw invalid bytes inside a JSON string are shown escaped. */
  CHECK_EQ_INT(parse_extra(", \"protocol\": \"\xff\xfe\"", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "value \"\\xff\\xfe\"");
  CHECK(valid_utf8(err.msg));
  /* Truncating a long multi-byte value never cuts a character. */
  char extra[1200] = ", \"protocol\": \"";
  for (int i = 0; i < 300; i++)
    strcat(extra, "\xc3\xa9");
  strcat(extra, "\"");
  CHECK_EQ_INT(parse_extra(extra, &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "\xc3\xa9...\"");
  CHECK(valid_utf8(err.msg));
  /* Even an origin full of multi-byte characters and junk. */
  char origin[700] = "";
  for (int i = 0; i < 200; i++)
    strcat(origin, "\xe2\x82\xac");
  strcat(origin, "\x01\xff.json");
  CHECK_EQ_INT(mc_config_parse("[]", 2, origin, &cfg, &err), MC_ECONFIG);
  CHECK(valid_utf8(err.msg));
  CHECK_CONTAINS(err.msg, "\\x01\\xff.json: top-level");
}

static void test_out_untouched_on_error(void) {
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(parse(SEED_RDMA, &cfg, &err), 0);
  CHECK_EQ_INT(mc_config_parse("{}", 2, ORIGIN, &cfg, &err), MC_ECONFIG);
  CHECK(strcmp(cfg.device_name, "erdma_0") == 0);
}

/* ---- files ---------------------------------------------------------------- */

static void test_missing_file(void) {
  mc_config_t cfg;
  mc_err_t err = {0};
  const char *path = "/nonexistent-dir/mooncake.json";
  CHECK_EQ_INT(mc_config_load_file(path, &cfg, &err), MC_ECONFIG);
  CHECK_EQ_INT(err.code, MC_ECONFIG);
  CHECK_CONTAINS(err.msg, path);
  CHECK_CONTAINS(err.msg, strerror(ENOENT));
  CHECK_CONTAINS(err.msg, "MOONCAKE_CONFIG_PATH");
  CHECK_EQ_INT(err.sys_errno, ENOENT);

  CHECK_EQ_INT(mc_config_load_file("", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "MOONCAKE_CONFIG_PATH");
}

static void test_directory(void) {
  mc_config_t cfg;
  mc_err_t err = {0};
  CHECK_EQ_INT(mc_config_load_file("/tmp", &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "/tmp: is a directory");
}

static void test_file_errors_name_path(void) {
  static const char text[] = "{\"prefill_url\": \"a:1000\", \"decode_url\": \"a:1001\", "
                             "\"metadata_server\": \"P2PHANDSHAKE\"}";
  char *path = write_temp(text, sizeof text - 1);
  CHECK(path);
  mc_config_t cfg;
  mc_err_t err = {0};
  int rc = mc_config_load_file(path, &cfg, &err);
  unlink(path);
  char want[128];
  snprintf(want, sizeof want, "%s: field \"decode_url\": value \"a:1001\"", path);
  free(path);
  CHECK_EQ_INT(rc, MC_ECONFIG);
  CHECK_CONTAINS(err.msg, want);
}

static void test_oversized_file(void) {
  size_t n = (1u << 20) + 1;
  char *big = malloc(n);
  CHECK(big);
  memset(big, ' ', n);
  big[0] = '{';
  big[n - 1] = '}';
  char *path = write_temp(big, n);
  free(big);
  CHECK(path);
  mc_config_t cfg;
  mc_err_t err = {0};
  int rc = mc_config_load_file(path, &cfg, &err);
  unlink(path);
  free(path);
  CHECK_EQ_INT(rc, MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "1048577 bytes");
  CHECK_CONTAINS(err.msg, "at most 1048576");

  /* Exactly 1 MiB is still read (and then judged on its content). */
  n = 1u << 20;
  big = malloc(n);
  CHECK(big);
  memset(big, ' ', n);
  big[0] = '{';
  big[n - 1] = '}';
  path = write_temp(big, n);
  free(big);
  CHECK(path);
  rc = mc_config_load_file(path, &cfg, &err);
  unlink(path);
  free(path);
  CHECK_EQ_INT(rc, MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "field \"prefill_url\": is missing");
}

static void test_long_origin_keeps_tail(void) {
  char origin[600];
  memset(origin, 'd', sizeof origin);
  memcpy(origin + sizeof origin - 16, "/mooncake.json", 15);
  mc_config_t cfg;
  mc_err_t err;
  CHECK_EQ_INT(mc_config_parse("[]", 2, origin, &cfg, &err), MC_ECONFIG);
  CHECK_CONTAINS(err.msg, "...ddd");
  CHECK_CONTAINS(err.msg, "/mooncake.json: top-level");
}

/* Environment knobs: a value in range is taken, anything else (junk,
 * trailing text, out of range, empty, unset) gives the default. */
static void test_env_knobs(void) {
  unsetenv("MC_TEST_KNOB");
  CHECK_EQ_INT(mc_env_long("MC_TEST_KNOB", 7, 1, 10), 7);
  static const struct { const char *v; long want; } cases[] = {
      {"3", 3}, {"10", 10}, {"1", 1}, {"0", 7}, {"11", 7}, {"-2", 7}, {"3x", 7},
      {"abc", 7}, {"", 7}, {"99999999999999999999", 7}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    setenv("MC_TEST_KNOB", cases[i].v, 1);
    CHECK_EQ_INT(mc_env_long("MC_TEST_KNOB", 7, 1, 10), cases[i].want);
  }
  unsetenv("MC_TEST_KNOB");
}

/* Switches: on and off spellings in any case; unset or empty is the
 * default; anything else is the default (with a warning), never a guess. */
static void test_env_switches(void) {
  unsetenv("MC_TEST_SWITCH");
  CHECK_EQ_INT(mc_env_bool("MC_TEST_SWITCH", 1), 1);
  CHECK_EQ_INT(mc_env_bool("MC_TEST_SWITCH", 0), 0);
  static const struct { const char *v; int dflt, want; } cases[] = {
      {"1", 0, 1}, {"true", 0, 1}, {"ON", 0, 1}, {"Yes", 0, 1}, {"0", 1, 0}, {"false", 1, 0},
      {"off", 1, 0}, {"NO", 1, 0}, {"", 1, 1}, {"", 0, 0}, {"disable", 1, 1}, {"2", 0, 0},
      {"no ", 1, 1}, {"of", 0, 0}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    setenv("MC_TEST_SWITCH", cases[i].v, 1);
    CHECK_EQ_INT(mc_env_bool("MC_TEST_SWITCH", cases[i].dflt), cases[i].want);
  }
  unsetenv("MC_TEST_SWITCH");
}

int main(void) {
  RUN(test_env_knobs);
  RUN(test_env_switches);
  RUN(test_seed_rdma);
  RUN(test_seed_tcp);
  RUN(test_seed_rdma_from_file);
  RUN(test_minimal_defaults);
  RUN(test_same_host_cpu_switch);
  RUN(test_tcp_device_ignored);
  RUN(test_names);
  RUN(test_meta_p2p);
  RUN(test_meta_etcd);
  RUN(test_meta_redis);
  RUN(test_meta_http);
  RUN(test_meta_backend_conflict);
  RUN(test_meta_backend_bad);
  RUN(test_meta_unknown_scheme);
  RUN(test_meta_bad_values);
  RUN(test_meta_password_masked_in_errors);
  RUN(test_identical_urls_plus_100);
  RUN(test_identical_urls_overflow);
  RUN(test_ports_too_close);
  RUN(test_ports_50_apart_ok);
  RUN(test_different_hosts_same_port_ok);
  RUN(test_bad_urls);
  RUN(test_unknown_protocol);
  RUN(test_rdma_without_device);
  RUN(test_device_names);
  RUN(test_unknown_field);
  RUN(test_wrong_type);
  RUN(test_missing_required);
  RUN(test_duplicate_field);
  RUN(test_top_level_not_object);
  RUN(test_bad_json_line_col);
  RUN(test_empty);
  RUN(test_long_value);
  RUN(test_control_chars_escaped);
  RUN(test_messages_valid_utf8);
  RUN(test_out_untouched_on_error);
  RUN(test_missing_file);
  RUN(test_directory);
  RUN(test_file_errors_name_path);
  RUN(test_oversized_file);
  RUN(test_long_origin_keeps_tail);
  TEST_MAIN_END();
}
