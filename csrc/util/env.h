/* Integer knobs from the environment (MC_*), read once where they apply. */
#ifndef MC_UTIL_ENV_H
#define MC_UTIL_ENV_H

#include "util/errors.h"

/* The value of `name` if it is an integer in lo..hi; dflt if it is unset or
 * empty; otherwise dflt with one warning naming the variable, its value and
 * the accepted range. */
long mc_env_long(const char *name, long dflt, long lo, long hi);

/* mc_env_long for a knob that may have a former name (the table in env.c):
 * `name` if set, else its former name (still accepted, with one INFO line
 * giving the new name).  Both set to different text is an MC_ECONFIG error
 * naming both (which one was meant is not ours to guess); the same text is
 * fine. */
/* A switch: 1 for 1/true/on/yes, 0 for 0/false/off/no (any case), dflt if
 * unset or empty; anything else is dflt with one warning naming the
 * variable, its value and the accepted spellings (never silently on). */
int mc_env_bool(const char *name, int dflt);

int mc_env_long_renamed(const char *name, long dflt, long lo, long hi, long *out,
                        mc_err_t *err);

#endif
