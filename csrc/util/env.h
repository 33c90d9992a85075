/* Integer knobs from the environment (MC_*), read once where they apply. */
#ifndef MC_UTIL_ENV_H
#define MC_UTIL_ENV_H

/* The value of `name` if it is an integer in lo..hi; dflt if it is unset or
 * empty; otherwise dflt with one warning naming the variable, its value and
 * the accepted range. */
long mc_env_long(const char *name, long dflt, long lo, long hi);

#endif
