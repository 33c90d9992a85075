#include "util/env.h"

#include <errno.h>
#include <stdlib.h>

#include "util/log.h"

long mc_env_long(const char *name, long dflt, long lo, long hi) {
  const char *s = getenv(name);
  if (!s || !*s)
    return dflt;
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || *end || v < lo || v > hi) {
    mc_log_warn("ignoring %s=\"%s\": expected an integer in %ld..%ld; using %ld", name, s, lo,
                hi, dflt);
    return dflt;
  }
  return v;
}
