/* Minimal leveled logging to stderr.  Level from MC_LOG_LEVEL
 * (error|warn|info|debug; default warn).  Thread-safe: one fprintf per line.
 */
#ifndef MC_UTIL_LOG_H
#define MC_UTIL_LOG_H

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
#define mc_log_error(...) MC_LOG(MC_LOG_ERROR, __VA_ARGS__)
#define mc_log_warn(...) MC_LOG(MC_LOG_WARN, __VA_ARGS__)
#define mc_log_info(...) MC_LOG(MC_LOG_INFO, __VA_ARGS__)
#define mc_log_debug(...) MC_LOG(MC_LOG_DEBUG, __VA_ARGS__)

#endif
