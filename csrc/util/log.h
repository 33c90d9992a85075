/* Minimal leveled logging to stderr.  Level from MC_LOG_LEVEL
 * (error|warn|info|debug; default warn).  Thread-safe: one fprintf per line.
 */
#ifndef MC_UTIL_LOG_H
#define MC_UTIL_LOG_H

#include <stdint.h>

enum { MC_LOG_ERROR = 0, MC_LOG_WARN = 1, MC_LOG_INFO = 2, MC_LOG_DEBUG = 3 };

int mc_log_level(void);
void mc_log_set_level(int level);
void mc_log_write(int level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#define MC_LOG(level, ...)                                                     \
  do {                                                                         \
    if ((level) <= mc_log_level())                                             \
      mc_log_write((level), __VA_ARGS__);                                      \
  } while (0)
/* Rate-limited logging for events a peer can trigger at will (a failed
 * handshake, a malformed message): each call site (one "kind") logs at most
 * MC_LOG_BURST lines (default 10) per MC_LOG_INTERVAL_S seconds (default
 * 10); the lines past that are counted, and the first line logged after the
 * interval says how many similar lines were suppressed, so a flood costs a
 * bounded number of bytes of log per kind and nothing goes unmentioned. */
typedef struct mc_log_rate {
  uint64_t window_ns; /* start of the current interval */
  uint32_t lines;     /* logged in it */
  uint64_t suppressed;
} mc_log_rate_t;
void mc_log_rated(mc_log_rate_t *r, int level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Lines suppressed by rate limits so far (all kinds). */
uint64_t mc_log_suppressed_total(void);

#define MC_LOG_RATED(level, ...)                                               \
  do {                                                                         \
    static mc_log_rate_t mc_rate_;                                             \
    if ((level) <= mc_log_level())                                             \
      mc_log_rated(&mc_rate_, (level), __VA_ARGS__);                           \
  } while (0)
#define mc_log_warn_rated(...) MC_LOG_RATED(MC_LOG_WARN, __VA_ARGS__)
#define mc_log_info_rated(...) MC_LOG_RATED(MC_LOG_INFO, __VA_ARGS__)

#define mc_log_error(...) MC_LOG(MC_LOG_ERROR, __VA_ARGS__)
#define mc_log_warn(...) MC_LOG(MC_LOG_WARN, __VA_ARGS__)
#define mc_log_info(...) MC_LOG(MC_LOG_INFO, __VA_ARGS__)
#define mc_log_debug(...) MC_LOG(MC_LOG_DEBUG, __VA_ARGS__)

#endif
