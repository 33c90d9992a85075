/* The one binary search of the sorted address tables (registered regions,
 * MR caches, a peer's regions, the process's mappings, staged entries):
 * how many elements have a key <= x, i.e. 1 + the index of the last such
 * (0: none).  KEY(i) is the key of element i, ascending in i.  A macro so
 * the key is read inline on the data path. */
#ifndef MC_UTIL_BSEARCH_H
#define MC_UTIL_BSEARCH_H

#include <stddef.h>

#define MC_COUNT_LE(n, KEY, x)                                                                 \
  ({                                                                                           \
    size_t lo_ = 0, hi_ = (n);                                                                 \
    while (lo_ < hi_) {                                                                        \
      size_t i_ = lo_ + (hi_ - lo_) / 2;                                                       \
      if (KEY(i_) <= (x))                                                                      \
        lo_ = i_ + 1;                                                                          \
      else                                                                                     \
        hi_ = i_;                                                                              \
    }                                                                                          \
    lo_;                                                                                       \
  })

#endif
