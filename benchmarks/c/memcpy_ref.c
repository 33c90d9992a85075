/* The reference for benchmarks/same_host_cpu_bench.py: one thread's memcpy
 * of `total` bytes in blocks of `block` bytes between two anonymous
 * mappings made like transfer_bench.py's (pre-faulted; MADV_HUGEPAGE when
 * asked, else the system's transparent huge page default), blocks in order or scattered (each block to and from a random
 * slot, the same slot on both sides, like transfer_bench.py --scatter).
 * Prints the best of 3 runs in GB/s.
 *   memcpy_ref TOTAL_BYTES BLOCK_BYTES HUGEPAGES(0|1) SCATTER(0|1) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void *map(size_t n, int huge) {
  void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    return NULL;
  if (huge) /* else the system's default, as transfer_bench.py leaves it */
    madvise(p, n, MADV_HUGEPAGE);
  return p;
}

int main(int argc, char **argv) {
  if (argc != 5) {
    fprintf(stderr, "usage: %s TOTAL_BYTES BLOCK_BYTES HUGEPAGES(0|1) SCATTER(0|1)\n", argv[0]);
    return 2;
  }
  size_t total = strtoull(argv[1], NULL, 10), block = strtoull(argv[2], NULL, 10);
  int huge = atoi(argv[3]), scatter = atoi(argv[4]);
  if (!block || total < block) {
    fprintf(stderr, "block must be 1..total bytes\n");
    return 2;
  }
  size_t n = total / block;
  char *a = map(n * block, huge), *b = map(n * block, huge);
  size_t *order = malloc(n * sizeof *order);
  if (!a || !b || !order) {
    fprintf(stderr, "out of memory\n");
    return 1;
  }
  memset(a, 1, n * block);
  memset(b, 0, n * block);
  for (size_t i = 0; i < n; i++)
    order[i] = i;
  uint64_t x = 12345;
  for (size_t i = n - 1; scatter && i > 0; i--) { /* Fisher-Yates, xorshift64 */
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    size_t j = (size_t)(x % (i + 1)), t = order[i];
    order[i] = order[j], order[j] = t;
  }
  double best = 0;
  for (int r = 0; r < 3; r++) {
    double t0 = now_s();
    for (size_t i = 0; i < n; i++)
      memcpy(b + order[i] * block, a + order[i] * block, block);
    double gbps = (double)(n * block) / (now_s() - t0) / 1e9;
    if (gbps > best)
      best = gbps;
  }
  printf("%.4f\n", best);
  return 0;
}
