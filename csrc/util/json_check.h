/* Strict JSON syntax check with a precise error position and reason. */
#ifndef MC_UTIL_JSON_CHECK_H
#define MC_UTIL_JSON_CHECK_H

#include <stddef.h>

#define MC_JSON_OK ((size_t)-1)

/* Checks that text[0..len) is exactly one JSON value (plus whitespace; a
 * leading UTF-8 BOM is allowed).  Returns MC_JSON_OK, or the byte offset of
 * the first error with *why set to a short static reason such as
 * "trailing comma before '}'".  Nesting deeper than 64 is an error. */
size_t mc_json_check(const char *text, size_t len, const char **why);

#endif
