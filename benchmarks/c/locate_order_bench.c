/* The engine's GPU locate loop (csrc/engine/gpu_xfer.c, mc_gpu_locate_locals)
 * replicated on the CPU with a stand-in for the driver query: 16,384 requests
 * of 64 KiB over 32 allocations of 32 MiB, in order and shuffled, with the
 * old lookup order (the previous request's allocation first) and the new one
 * (the 2 MiB page hint first).  Best of 20; prints both and their ratio.
 *
 *   gcc -O2 -o build/locate_order_bench benchmarks/c/locate_order_bench.c && build/locate_order_bench
 *
 * Results: benchmarks/JOURNAL.md (GPU section, "the page hint first"). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
typedef struct { void *local; uint64_t remote, len; int op; } req_t;
#define LOCATE_CACHE 64
#define LOCATE_HINTS 4096
static uint64_t BASE = 0x7f0000000000ull;
static int calls;
static int locate_range(uint64_t a, uint64_t *start, uint64_t *size) {
  calls++;
  uint64_t l = (a - BASE) / (32ull << 20);
  *start = BASE + l * (32ull << 20); *size = 32ull << 20; return 1;
}
static int locate_last_first(const req_t *reqs, size_t n, int *ldev) {
  int k = 0;
  struct { uint64_t lo, hi; int dev; } seen[LOCATE_CACHE];
  size_t nseen = 0, last = 0;
  unsigned char hint[LOCATE_HINTS];
  memset(hint, 0, sizeof hint);
  for (size_t i = 0; i < n; i++) {
    uint64_t a = (uint64_t)(uintptr_t)reqs[i].local, end = a + reqs[i].len;
    size_t h = (size_t)(a >> 21) % LOCATE_HINTS;
    int hit = -1;
    if (nseen && a >= seen[last].lo && end <= seen[last].hi) hit = (int)last;
    else if (hint[h] && a >= seen[hint[h] - 1].lo && end <= seen[hint[h] - 1].hi) { hit = hint[h] - 1; last = (size_t)hit; }
    else { for (size_t j = 0; j < nseen; j++) if (a >= seen[j].lo && end <= seen[j].hi) { hit = (int)j; last = j; hint[h] = (unsigned char)(j + 1); break; } }
    if (hit >= 0) { ldev[i] = seen[hit].dev; k++; continue; }
    uint64_t start, size; locate_range(a, &start, &size);
    ldev[i] = 0; k++;
    last = nseen < LOCATE_CACHE ? nseen++ : (last + 1) % LOCATE_CACHE;
    seen[last].lo = start; seen[last].hi = start + size; seen[last].dev = 0; hint[h] = (unsigned char)(last + 1);
  }
  return k;
}
static int locate_hint_first(const req_t *reqs, size_t n, int *ldev) {
  int k = 0;
  struct { uint64_t lo, hi; int dev; } seen[LOCATE_CACHE];
  size_t nseen = 0, last = 0;
  unsigned char hint[LOCATE_HINTS];
  memset(hint, 0, sizeof hint);
  for (size_t i = 0; i < n; i++) {
    uint64_t a = (uint64_t)(uintptr_t)reqs[i].local, end = a + reqs[i].len;
    size_t h = (size_t)(a >> 21) % LOCATE_HINTS;
    int hit = -1;
    int c = hint[h] - 1;
    if (c >= 0 && a >= seen[c].lo && end <= seen[c].hi) hit = c;
    else if (nseen && a >= seen[last].lo && end <= seen[last].hi) { hit = (int)last; hint[h] = (unsigned char)(last + 1); }
    else { for (size_t j = 0; j < nseen; j++) if (a >= seen[j].lo && end <= seen[j].hi) { hit = (int)j; last = j; hint[h] = (unsigned char)(j + 1); break; } }
    if (hit >= 0) { ldev[i] = seen[hit].dev; k++; continue; }
    uint64_t start, size; locate_range(a, &start, &size);
    ldev[i] = 0; k++;
    last = nseen < LOCATE_CACHE ? nseen++ : (last + 1) % LOCATE_CACHE;
    seen[last].lo = start; seen[last].hi = start + size; seen[last].dev = 0; hint[h] = (unsigned char)(last + 1);
  }
  return k;
}
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(void) {
  size_t L = 32, B = 512, n = L * B;
  req_t *r = calloc(n, sizeof *r); int *ld = malloc(n * sizeof *ld);
  size_t *perm = malloc(n * sizeof *perm);
  for (int mode = 0; mode < 2; mode++) {
    for (size_t i = 0; i < n; i++) perm[i] = i;
    if (mode) { srand(1); for (size_t i = n - 1; i > 0; i--) { size_t j = rand() % (i + 1), t = perm[i]; perm[i] = perm[j]; perm[j] = t; } }
    for (size_t i = 0; i < n; i++) { size_t l = perm[i] / B, b = perm[i] % B; r[i].local = (void *)(uintptr_t)(BASE + l * (32ull << 20) + b * 65536); r[i].len = 65536; }
    double b_old = 1, b_new = 1;
    for (int it = 0; it < 20; it++) {
      double t = now(); locate_last_first(r, n, ld); t = now() - t; if (t < b_old) b_old = t;
      t = now(); locate_hint_first(r, n, ld); t = now() - t; if (t < b_new) b_new = t;
    }
    printf("%-8s last-first %6.1f us, hint-first %6.1f us, ratio %.2fx\n",
           mode ? "shuffled" : "in order", b_old * 1e6, b_new * 1e6, b_old / b_new);
  }
}
