/* Integers read from JSON numbers (cJSON keeps them as doubles) without the
 * undefined behaviour of converting an out-of-range double: peers and
 * metadata servers can send any number, including 1e300 and -1. */
#ifndef MC_UTIL_JSON_NUM_H
#define MC_UTIL_JSON_NUM_H

#include <cjson/cJSON.h>
#include <stdint.h>

/* 0 with *out set when `item` is a number holding an integer in [lo, hi];
 * -1 otherwise (not a number, fractional, negative, >= 2^64, out of range). */
int mc_json_u64(const cJSON *item, uint64_t lo, uint64_t hi, uint64_t *out);

#endif
