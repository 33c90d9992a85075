/* Growable arrays: one way to make room for one more element. */
#ifndef MC_UTIL_ARRAY_H
#define MC_UTIL_ARRAY_H

#include <stdlib.h>

/* The array `items` (n used of *cap elements of `size` bytes) with room for
 * one more: items itself while n < *cap, else the array doubled (`first`
 * elements the first time) and *cap raised.  NULL when out of memory (items
 * and *cap unchanged, still the caller's). */
static inline void *mc_array_room(void *items, size_t n, size_t *cap, size_t size,
                                  size_t first) {
  if (n < *cap)
    return items;
  size_t nc = *cap ? *cap * 2 : first;
  void *v = realloc(items, nc * size);
  if (v)
    *cap = nc;
  return v;
}

#endif
