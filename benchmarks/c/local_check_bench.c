/* What the local-address check costs (csrc/engine/batch.c, check_locals):
 * the same loop over the engine's region table (mc_regions_lock,
 * mc_regions_find_locked, last-region shortcut) for 16,384 requests of
 * 64 KiB over 32 registered regions of 32 MiB, in region order (a layer's
 * blocks) and shuffled (every request in another region than the last).
 * Best of 50 runs, ns per request; with --gbps G also the check's share of
 * the time one 64 KiB block takes at G GB/s (the bench's measured rate).
 *
 *   make bench && build/bench/local_check_bench [--gbps 3.0]
 *
 * Results: benchmarks/JOURNAL.md ("Local-address check"). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "mem/regions.h"
#include "util/clock.h"

enum { NREG = 32, NREQ = 16384, BLK = 65536 };
static const uint64_t REG = 32ull << 20, BASE = 0x7f0000000000ull;

static int check(mc_regions_t *r, const mc_request_t *reqs, size_t n) {
  uint64_t lo = 1, hi = 0;
  mc_regions_lock(r);
  for (size_t i = 0; i < n; i++) {
    uint64_t a = (uint64_t)(uintptr_t)reqs[i].local, end = a + reqs[i].len;
    if (a >= lo && end <= hi && end > a)
      continue;
    const mc_region_t *reg = mc_regions_find_locked(r, a, reqs[i].len);
    if (!reg) {
      mc_regions_unlock(r);
      return -1;
    }
    lo = reg->addr;
    hi = reg->addr + reg->len;
  }
  mc_regions_unlock(r);
  return 0;
}

static double best_ns(mc_regions_t *r, const mc_request_t *reqs) {
  double best = 1e30;
  for (int k = 0; k < 50; k++) {
    uint64_t t0 = mc_now_ns();
    if (check(r, reqs, NREQ) < 0) {
      fprintf(stderr, "check failed\n");
      exit(1);
    }
    double dt = (double)(mc_now_ns() - t0) / NREQ;
    if (dt < best)
      best = dt;
  }
  return best;
}

int main(int argc, char **argv) {
  double gbps = argc > 2 && !strcmp(argv[1], "--gbps") ? atof(argv[2]) : 0;
  mc_regions_t r;
  mc_err_t err;
  mc_regions_init(&r);
  for (int i = 0; i < NREG; i++)
    if (mc_regions_add(&r, BASE + i * REG, REG, "cpu", &err) < 0)
      return 1;
  mc_request_t *q = calloc(NREQ, sizeof *q);
  size_t per = REG / BLK;
  for (size_t i = 0; i < NREQ; i++)
    q[i] = (mc_request_t){.opcode = MC_OP_WRITE,
                          .local = (void *)(uintptr_t)(BASE + (i / per) * REG + (i % per) * BLK),
                          .remote = 0, .len = BLK};
  double in_order = best_ns(&r, q);
  srand(7);
  for (size_t i = NREQ - 1; i > 0; i--) { /* shuffle */
    size_t j = (size_t)rand() % (i + 1);
    mc_request_t t = q[i];
    q[i] = q[j];
    q[j] = t;
  }
  double shuffled = best_ns(&r, q);
  printf("{\"in_order_ns_per_req\": %.2f, \"shuffled_ns_per_req\": %.2f", in_order, shuffled);
  if (gbps > 0) {
    double block_ns = BLK / gbps; /* bytes / (GB/s) = ns */
    printf(", \"gbps\": %.3f, \"block_64k_ns\": %.0f, \"share_in_order_pct\": %.4f, "
           "\"share_shuffled_pct\": %.4f",
           gbps, block_ns, 100 * in_order / block_ns, 100 * shuffled / block_ns);
  }
  printf("}\n");
  mc_regions_destroy(&r);
  free(q);
  return 0;
}
