#include "util/log.h"

#include <pthread.h>
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
  /* Read once per process (mc_log_level caches it): one line, not silence. */
  fprintf(stderr, "mooncake-connector: ignoring MC_LOG_LEVEL=\"%s\": expected error, warn, "
          "info or debug; using warn\n", s);
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

static void log_line(int level, const char *fmt, va_list ap);

void mc_log_write(int level, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  log_line(level, fmt, ap);
  va_end(ap);
}

static pthread_mutex_t rate_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t suppressed_total;

static long rate_env(const char *name, long dflt, long lo, long hi) {
  const char *s = getenv(name);
  char *end;
  long v = s && *s ? strtol(s, &end, 10) : dflt;
  return s && *s && (*end || v < lo || v > hi) ? dflt : v;
}

void mc_log_rated(mc_log_rate_t *r, int level, const char *fmt, ...) {
  static long burst = -1, interval_s = -1;
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  uint64_t now = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
  uint64_t dropped = 0;
  pthread_mutex_lock(&rate_mu);
  if (burst < 0) {
    burst = rate_env("MC_LOG_BURST", 10, 1, 1000000);
    interval_s = rate_env("MC_LOG_INTERVAL_S", 10, 1, 86400);
  }
  if (r->window_ns == 0 || now - r->window_ns >= (uint64_t)interval_s * 1000000000ull) {
    r->window_ns = now;
    r->lines = 0;
  }
  int emit = r->lines < (uint32_t)burst;
  if (emit) {
    r->lines++;
    dropped = r->suppressed;
    r->suppressed = 0;
  } else {
    r->suppressed++;
    suppressed_total++;
  }
  pthread_mutex_unlock(&rate_mu);
  if (!emit)
    return;
  if (dropped)
    mc_log_write(level, "(%llu similar lines suppressed in the last %lds: MC_LOG_BURST per "
                 "MC_LOG_INTERVAL_S)", (unsigned long long)dropped, interval_s);
  va_list ap;
  va_start(ap, fmt);
  log_line(level, fmt, ap);
  va_end(ap);
}

uint64_t mc_log_suppressed_total(void) {
  pthread_mutex_lock(&rate_mu);
  uint64_t v = suppressed_total;
  pthread_mutex_unlock(&rate_mu);
  return v;
}

static void log_line(int level, const char *fmt, va_list ap) {
  static const char *names[] = {"ERROR", "WARN", "INFO", "DEBUG"};
  char line[1024];
  struct timespec ts;
  struct tm tm;
  clock_gettime(CLOCK_REALTIME, &ts);
  localtime_r(&ts.tv_sec, &tm);
  int n = snprintf(line, sizeof line, "%02d:%02d:%02d.%03ld mooncake-connector[%d] %s ",
                   tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000L,
                   (int)getpid(), names[level < 0 ? 0 : level > 3 ? 3 : level]);
  if (n > 0 && (size_t)n < sizeof line)
    vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
  fprintf(stderr, "%s\n", line);
}
