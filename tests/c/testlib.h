/* Tiny test harness for the C unit tests: each test_*.c is one binary,
 * each TEST() a function registered in main via RUN(). */
#ifndef MC_TESTLIB_H
#define MC_TESTLIB_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int tl_failures;
static const char *tl_current;

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "  %s:%d: %s: CHECK(%s) failed\n", __FILE__, __LINE__,   \
              tl_current, #cond);                                              \
      tl_failures++;                                                           \
      return;                                                                  \
    }                                                                          \
  } while (0)

#define CHECK_EQ_INT(a, b)                                                     \
  do {                                                                         \
    long long a_ = (long long)(a), b_ = (long long)(b);                        \
    if (a_ != b_) {                                                            \
      fprintf(stderr, "  %s:%d: %s: %s == %lld, expected %s == %lld\n",        \
              __FILE__, __LINE__, tl_current, #a, a_, #b, b_);                 \
      tl_failures++;                                                           \
      return;                                                                  \
    }                                                                          \
  } while (0)

#define CHECK_CONTAINS(hay, needle)                                            \
  do {                                                                         \
    if (!strstr((hay), (needle))) {                                            \
      fprintf(stderr, "  %s:%d: %s: \"%s\" does not contain \"%s\"\n",         \
              __FILE__, __LINE__, tl_current, (hay), (needle));                \
      tl_failures++;                                                           \
      return;                                                                  \
    }                                                                          \
  } while (0)

#define RUN(fn)                                                                \
  do {                                                                         \
    tl_current = #fn;                                                          \
    int before_ = tl_failures;                                                 \
    fn();                                                                      \
    fprintf(stderr, "%s %s\n", tl_failures == before_ ? "ok  " : "FAIL", #fn); \
  } while (0)

#define TEST_MAIN_END() return tl_failures ? 1 : 0

/* n bytes of a pattern fixed by seed (xorshift32): test data both sides of a
 * transfer can make and compare. */
static inline void fill(uint8_t *p, size_t n, uint32_t seed) {
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; i++) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    p[i] = (uint8_t)x;
  }
}

#endif
