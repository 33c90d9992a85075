/* C-level two-process benchmark of the engine (no Python in the loop).
 *
 *   mc_bench target [--host H] [--size BYTES]
 *       prints "SEGMENT <name> ADDR <addr>" and serves until stdin closes.
 *   mc_bench initiator --segment NAME --addr ADDR [--op write|read]
 *       [--block BYTES] [--total BYTES] [--batch N] [--lat-size BYTES] [--lat-iters N]
 *       [--ws BYTES]   (working set: block addresses wrap inside the first BYTES of
 *                       both buffers, as iperf3 reuses one buffer; 0 = all distinct)
 *       prints JSON lines: bandwidth (GB/s, 1e9) and 1-request latency (us).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/engine.h"
#include "util/clock.h"

static const char *arg(int argc, char **argv, const char *name, const char *dflt) {
  for (int i = 1; i + 1 < argc; i++)
    if (!strcmp(argv[i], name))
      return argv[i + 1];
  return dflt;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static mc_engine_t *start(const char *host) {
  mc_engine_opts_t o = {.local_hostname = host, .metadata_server = "P2PHANDSHAKE",
                        .protocol = "tcp"};
  mc_err_t err = {0};
  mc_engine_t *e = NULL;
  if (mc_engine_create(&o, &e, &err) < 0) {
    fprintf(stderr, "engine: %s\n", err.msg);
    exit(1);
  }
  return e;
}

static int run_target(int argc, char **argv) {
  uint64_t size = strtoull(arg(argc, argv, "--size", "1073741824"), NULL, 0);
  mc_engine_t *e = start(arg(argc, argv, "--host", "127.0.0.1"));
  char *buf = malloc(size);
  memset(buf, 1, size);
  mc_err_t err = {0};
  if (mc_engine_register(e, buf, size, "cpu", &err) < 0) {
    fprintf(stderr, "register: %s\n", err.msg);
    return 1;
  }
  printf("SEGMENT %s ADDR %llu\n", mc_engine_segment_name(e),
         (unsigned long long)(uintptr_t)buf);
  fflush(stdout);
  char c;
  while (read(0, &c, 1) > 0) {
  }
  mc_engine_destroy(e);
  free(buf);
  return 0;
}

static int run_initiator(int argc, char **argv) {
  const char *seg = arg(argc, argv, "--segment", NULL);
  uint64_t raddr = strtoull(arg(argc, argv, "--addr", "0"), NULL, 0);
  if (!seg || !raddr) {
    fprintf(stderr, "initiator needs --segment and --addr\n");
    return 2;
  }
  int op = !strcmp(arg(argc, argv, "--op", "write"), "read") ? MC_OP_READ : MC_OP_WRITE;
  uint64_t block = strtoull(arg(argc, argv, "--block", "65536"), NULL, 0);
  uint64_t total = strtoull(arg(argc, argv, "--total", "1073741824"), NULL, 0);
  size_t batch = strtoull(arg(argc, argv, "--batch", "0"), NULL, 0);
  uint64_t lsize = strtoull(arg(argc, argv, "--lat-size", "4096"), NULL, 0);
  int liters = atoi(arg(argc, argv, "--lat-iters", "0"));
  int reps = atoi(arg(argc, argv, "--reps", "3"));
  uint64_t ws = strtoull(arg(argc, argv, "--ws", "0"), NULL, 0);
  mc_engine_t *e = start(arg(argc, argv, "--host", "127.0.0.1"));
  char *buf = malloc(total);
  memset(buf, 2, total);
  mc_err_t err = {0};
  /* A transfer's local buffers must lie in memory registered with the engine. */
  if (!buf || mc_engine_register(e, buf, total, "cpu", &err) < 0) {
    fprintf(stderr, "register: %s\n", buf ? err.msg : "out of memory");
    return 1;
  }
  size_t nblk = block ? total / block : 0;
  if (!batch)
    batch = nblk ? nblk : 1;
  mc_request_t *r = calloc(batch, sizeof *r);
  double best = 0;
  for (int rep = 0; rep < reps && block; rep++) {
    uint64_t t0 = mc_now_ns();
    for (size_t start = 0; start < nblk; start += batch) {
      size_t n = nblk - start < batch ? nblk - start : batch;
      for (size_t i = 0; i < n; i++) {
        uint64_t off = (start + i) * block;
        if (ws >= block)
          off %= ws - ws % block;
        r[i] = (mc_request_t){.opcode = op, .local = buf + off, .remote = raddr + off,
                              .len = block};
      }
      mc_batch_t *b = mc_batch_new(e, n);
      if (mc_batch_submit(e, b, seg, r, n, &err) < 0 || mc_batch_wait(e, b, -1, &err) < 0) {
        fprintf(stderr, "transfer: %s\n", err.msg);
        return 1;
      }
      mc_batch_free(e, b);
    }
    double gbps = (double)(nblk * block) / (double)(mc_now_ns() - t0);
    if (gbps > best)
      best = gbps;
  }
  if (block)
    printf("{\"op\":\"%s\",\"block\":%llu,\"batch\":%zu,\"bytes\":%llu,\"working_set\":%llu,"
           "\"GBps\":%.3f}\n",
           op == MC_OP_WRITE ? "write" : "read", (unsigned long long)block, batch,
           (unsigned long long)(nblk * block), (unsigned long long)(ws ? ws : nblk * block),
           best);
  if (liters > 0) {
    uint64_t *lat = calloc((size_t)liters, sizeof *lat);
    for (int i = -100; i < liters; i++) {
      mc_request_t q = {.opcode = op, .local = buf, .remote = raddr, .len = lsize};
      uint64_t t0 = mc_now_ns();
      mc_batch_t *b = mc_batch_new(e, 1);
      if (mc_batch_submit_sync(e, b, seg, &q, 1, &err) < 0 || mc_batch_wait(e, b, -1, &err) < 0) {
        fprintf(stderr, "transfer: %s\n", err.msg);
        return 1;
      }
      mc_batch_free(e, b);
      if (i >= 0)
        lat[i] = mc_now_ns() - t0;
    }
    qsort(lat, (size_t)liters, sizeof *lat, cmp_u64);
    printf("{\"op\":\"%s\",\"lat_size\":%llu,\"iters\":%d,\"p50_us\":%.2f,\"p99_us\":%.2f}\n",
           op == MC_OP_WRITE ? "write" : "read", (unsigned long long)lsize, liters,
           lat[liters / 2] / 1e3, lat[(size_t)(liters * 0.99)] / 1e3);
    free(lat);
  }
  mc_engine_destroy(e);
  free(r);
  free(buf);
  return 0;
}

int main(int argc, char **argv) {
  if (argc >= 2 && !strcmp(argv[1], "target"))
    return run_target(argc, argv);
  if (argc >= 2 && !strcmp(argv[1], "initiator"))
    return run_initiator(argc, argv);
  fprintf(stderr, "usage: mc_bench target|initiator [options] (see the file header)\n");
  return 2;
}
