#include "util/json_num.h"

int mc_json_u64(const cJSON *item, uint64_t lo, uint64_t hi, uint64_t *out) {
  if (!cJSON_IsNumber(item))
    return -1;
  double d = item->valuedouble;
  /* !(d >= 0) also refuses NaN; 2^64 itself does not fit. */
  if (!(d >= 0) || d >= 18446744073709551616.0)
    return -1;
  uint64_t u = (uint64_t)d;
  if ((double)u != d || u < lo || u > hi)
    return -1;
  *out = u;
  return 0;
}
