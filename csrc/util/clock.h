/* Monotonic time helpers. */
#ifndef MC_UTIL_CLOCK_H
#define MC_UTIL_CLOCK_H

#include <stdint.h>
#include <time.h>

static inline uint64_t mc_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Wall-clock (CLOCK_REALTIME) nanoseconds since the epoch: for deadlines a
 * peer states in wall-clock time (a push target's lease). */
static inline int64_t mc_wall_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000000000ll + (int64_t)ts.tv_nsec;
}

/* One step of a busy wait: a hint to the core (pause / yield), no syscall. */
static inline void mc_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

/* Absolute CLOCK_MONOTONIC timespec `ns` nanoseconds from now, for
 * pthread_cond_timedwait on a condvar created with CLOCK_MONOTONIC. */
static inline struct timespec mc_deadline_ts(uint64_t deadline_ns) {
  struct timespec ts;
  ts.tv_sec = (time_t)(deadline_ns / 1000000000ull);
  ts.tv_nsec = (long)(deadline_ns % 1000000000ull);
  return ts;
}

#endif
