/* A strict RFC 8259 syntax check that reports the exact offset of the first
 * error and a reason.  cJSON's error offset is sometimes one past the culprit
 * (e.g. a trailing comma before '}') and it says nothing about why; this
 * finds the spot, and cJSON then builds the tree. */
#include "util/json_check.h"

#include <ctype.h>
#include <stdbool.h>
#include <string.h>

typedef struct {
  const char *s;
  size_t len, pos;
  int depth;
  const char *why; /* set at the first error */
} jscan_t;

#define JSON_DEPTH_MAX 64 /* configs are flat; deep nesting is a mistake */

static bool js_fail(jscan_t *j, const char *why) {
  j->why = why;
  return false;
}

static int js_peek(const jscan_t *j) { return j->pos < j->len ? (unsigned char)j->s[j->pos] : -1; }

static void js_ws(jscan_t *j) {
  while (j->pos < j->len && strchr(" \t\r\n", j->s[j->pos]) && j->s[j->pos])
    j->pos++;
}

static bool js_value(jscan_t *j);

static bool is_hex4(const char *p) {
  for (int i = 0; i < 4; i++)
    if (!isxdigit((unsigned char)p[i]))
      return false;
  return true;
}

/* The value of four hex digits (checked by the caller). */
static unsigned hex4(const char *p) {
  unsigned v = 0;
  for (int i = 0; i < 4; i++) {
    unsigned char c = (unsigned char)p[i];
    v = v * 16 + (unsigned)(isdigit(c) ? c - '0' : (tolower(c) - 'a' + 10));
  }
  return v;
}

static bool js_string(jscan_t *j) {
  j->pos++; /* opening quote */
  for (;;) {
    int ch = js_peek(j);
    if (ch < 0)
      return js_fail(j, "unterminated string");
    if (ch == '"') {
      j->pos++;
      return true;
    }
    if (ch < 0x20)
      return js_fail(j, "control character inside a string (write \\n, \\t...)");
    if (ch == '\\') {
      j->pos++;
      ch = js_peek(j);
      if (ch < 0 || !strchr("\"\\/bfnrtu", ch))
        return js_fail(j, "invalid escape sequence in a string");
      if (ch == 'u') {
        for (int i = 1; i <= 4; i++)
          if (j->pos + (size_t)i >= j->len || !isxdigit((unsigned char)j->s[j->pos + (size_t)i])) {
            j->pos += (size_t)i;
            return js_fail(j, "\\u escape needs four hex digits");
          }
        unsigned cp = hex4(j->s + j->pos + 1);
        size_t esc = j->pos - 1; /* the backslash: where an error points */
        j->pos += 4;
        /* Half a UTF-16 surrogate pair is valid JSON syntax, but no
         * character: cJSON refuses it. */
        if (cp >= 0xDC00 && cp <= 0xDFFF) {
          j->pos = esc;
          return js_fail(j, "\\u escape is a lone UTF-16 surrogate (\\uDC00-\\uDFFF only "
                            "right after \\uD800-\\uDBFF)");
        }
        if (cp >= 0xD800 && cp <= 0xDBFF) {
          const char *n = j->s + j->pos + 1;
          if (j->len - (j->pos + 1) < 6 || n[0] != '\\' || n[1] != 'u' || !is_hex4(n + 2) ||
              hex4(n + 2) < 0xDC00 || hex4(n + 2) > 0xDFFF) {
            j->pos = esc;
            return js_fail(j, "\\u escape is a lone UTF-16 surrogate (\\uD800-\\uDBFF must "
                              "be followed by \\uDC00-\\uDFFF)");
          }
          j->pos += 6;
        }
      }
    }
    j->pos++;
  }
}

static bool js_digits(jscan_t *j) {
  if (!isdigit(js_peek(j)))
    return js_fail(j, "malformed number");
  while (isdigit(js_peek(j)))
    j->pos++;
  return true;
}

static bool js_number(jscan_t *j) {
  if (js_peek(j) == '-')
    j->pos++;
  if (js_peek(j) == '0') {
    j->pos++;
    if (isdigit(js_peek(j)))
      return js_fail(j, "numbers must not have leading zeros");
  } else if (!js_digits(j)) {
    return false;
  }
  if (js_peek(j) == '.') {
    j->pos++;
    if (!js_digits(j))
      return false;
  }
  if (js_peek(j) == 'e' || js_peek(j) == 'E') {
    j->pos++;
    if (js_peek(j) == '+' || js_peek(j) == '-')
      j->pos++;
    if (!js_digits(j))
      return false;
  }
  return true;
}

static bool js_literal(jscan_t *j, const char *lit) {
  size_t n = strlen(lit);
  if (j->len - j->pos < n || memcmp(j->s + j->pos, lit, n) != 0)
    return js_fail(j, "unexpected character (strings need double quotes)");
  j->pos += n;
  return true;
}

/* Object or array: members separated by ',' up to `close`. */
static bool js_container(jscan_t *j, char close) {
  bool obj = close == '}';
  if (++j->depth > JSON_DEPTH_MAX)
    return js_fail(j, "nesting too deep");
  j->pos++;
  js_ws(j);
  if (js_peek(j) == close) {
    j->pos++;
    j->depth--;
    return true;
  }
  for (;;) {
    js_ws(j);
    if (obj) {
      if (js_peek(j) == '}')
        return js_fail(j, "trailing comma before '}'");
      if (js_peek(j) == '/')
        return js_fail(j, "comments are not allowed in JSON");
      if (js_peek(j) != '"')
        return js_fail(j, "expected a double-quoted key");
      if (!js_string(j))
        return false;
      js_ws(j);
      if (js_peek(j) != ':')
        return js_fail(j, "expected ':' after the key");
      j->pos++;
      js_ws(j);
    } else if (js_peek(j) == ']') {
      return js_fail(j, "trailing comma before ']'");
    }
    if (!js_value(j))
      return false;
    js_ws(j);
    int ch = js_peek(j);
    if (ch == ',') {
      j->pos++;
      continue;
    }
    if (ch == close) {
      j->pos++;
      j->depth--;
      return true;
    }
    if (ch < 0)
      return js_fail(j, obj ? "missing '}'" : "missing ']'");
    if (ch == '/')
      return js_fail(j, "comments are not allowed in JSON");
    return js_fail(j, obj ? "expected ',' or '}' (missing comma?)"
                          : "expected ',' or ']' (missing comma?)");
  }
}

static bool js_value(jscan_t *j) {
  int ch = js_peek(j);
  switch (ch) {
  case '{':
    return js_container(j, '}');
  case '[':
    return js_container(j, ']');
  case '"':
    return js_string(j);
  case 't':
    return js_literal(j, "true");
  case 'f':
    return js_literal(j, "false");
  case 'n':
    return js_literal(j, "null");
  case -1:
    return js_fail(j, "missing value");
  default:
    if (ch == '-' || isdigit(ch))
      return js_number(j);
    if (ch == '/')
      return js_fail(j, "comments are not allowed in JSON");
    return js_fail(j, "unexpected character (strings need double quotes)");
  }
}

size_t mc_json_check(const char *text, size_t len, const char **why) {
  jscan_t j = {.s = text, .len = len};
  if (len >= 3 && memcmp(text, "\xef\xbb\xbf", 3) == 0)
    j.pos = 3; /* UTF-8 byte-order mark, as editors on Windows write */
  js_ws(&j);
  if (!js_value(&j)) {
    *why = j.why;
    return j.pos;
  }
  js_ws(&j);
  if (j.pos < len) {
    *why = text[j.pos] == '/' ? "comments are not allowed in JSON"
                              : "unexpected text after the JSON value";
    return j.pos;
  }
  *why = NULL;
  return MC_JSON_OK;
}
