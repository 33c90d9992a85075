#include "util/env.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

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

int mc_env_bool(const char *name, int dflt) {
  const char *s = getenv(name);
  if (!s || !*s)
    return dflt;
  static const char *const on[] = {"1", "true", "on", "yes"}, *const off[] = {"0", "false", "off",
                                                                              "no"};
  for (size_t i = 0; i < sizeof on / sizeof on[0]; i++) {
    if (!strcasecmp(s, on[i]))
      return 1;
    if (!strcasecmp(s, off[i]))
      return 0;
  }
  mc_log_warn("ignoring %s=\"%s\": expected 1, true, on or yes (on) or 0, false, off or no "
              "(off); using %s", name, s, dflt ? "on" : "off");
  return dflt;
}

/* Knobs renamed, {name, former name}: the slicing knobs apply to every
 * transport, their first names said TCP. */
static const char *const renamed[][2] = {
    {"MC_SLICE_SIZE", "MC_TCP_SLICE_SIZE"},
    {"MC_OP_ENTRIES", "MC_TCP_OP_ENTRIES"},
};

int mc_env_long_renamed(const char *name, long dflt, long lo, long hi, long *out,
                        mc_err_t *err) {
  const char *old = NULL;
  for (size_t i = 0; i < sizeof renamed / sizeof renamed[0]; i++)
    if (!strcmp(renamed[i][0], name))
      old = renamed[i][1];
  const char *now = getenv(name), *was = old ? getenv(old) : NULL;
  int has_now = now && *now, has_was = was && *was;
  if (has_now && has_was && strcmp(now, was) != 0)
    return mc_err_set(err, MC_ECONFIG, "%s=\"%s\" and %s=\"%s\" are both set and differ: %s is "
                      "the former name of %s; unset %s", name, now, old, was, old, name, old);
  if (!has_now && has_was) {
    mc_log_info("%s is the former name of %s; set %s instead", old, name, name);
    *out = mc_env_long(old, dflt, lo, hi);
    return 0;
  }
  *out = mc_env_long(name, dflt, lo, hi);
  return 0;
}
