#include "util/log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

static atomic_int g_level = -1;

static int level_from_env(void) {
  const char *s = getenv("MC_LOG_LEVEL");
  if (!s || !*s)
    return MC_LOG_WARN;
  if (!strcasecmp(s, "error"))
    return MC_LOG_ERROR;
  if (!strcasecmp(s, "warn") || !strcasecmp(s, "warning"))
    return MC_LOG_WARN;
  if (!strcasecmp(s, "info"))
    return MC_LOG_INFO;
  if (!strcasecmp(s, "debug"))
    return MC_LOG_DEBUG;
  return MC_LOG_WARN;
}

int mc_log_level(void) {
  int l = atomic_load_explicit(&g_level, memory_order_relaxed);
  if (l < 0) {
    l = level_from_env();
    atomic_store(&g_level, l);
  }
  return l;
}

void mc_log_set_level(int level) { atomic_store(&g_level, level); }

void mc_log_write(int level, const char *fmt, ...) {
  static const char *names[] = {"ERROR", "WARN", "INFO", "DEBUG"};
  char line[1024];
  struct timespec ts;
  struct tm tm;
  clock_gettime(CLOCK_REALTIME, &ts);
  localtime_r(&ts.tv_sec, &tm);
  int n = snprintf(line, sizeof line, "%02d:%02d:%02d.%03ld mooncake-connector[%d] %s ",
                   tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000L,
                   (int)getpid(), names[level < 0 ? 0 : level > 3 ? 3 : level]);
  va_list ap;
  va_start(ap, fmt);
  if (n > 0 && (size_t)n < sizeof line)
    vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
  va_end(ap);
  fprintf(stderr, "%s\n", line);
}
