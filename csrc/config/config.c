/* mooncake.json parsing and validation (see config.h for the fields).
 *
 * Every rejection is one line of the form
 *   <origin>: field "<name>": value "<value>" <why>; accepted: <forms>
 * so a user reading a log line can fix the file without the docs.
 *
 * Thread-safety: no mutable globals here.  Syntax errors are located by our
 * own checker, never through cJSON_GetErrorPtr (a process-wide global).
 */
#include "config/config.h"
#include "util/json_check.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

/* Larger files are certainly not a mooncake.json; refusing them bounds the
 * memory a mistaken MOONCAKE_CONFIG_PATH (a model file...) can cost. */
#define CFG_FILE_MAX ((size_t)1 << 20)
#define SHOW_VALUE_MAX 80   /* value excerpt length in messages */
#define SHOW_ORIGIN_MAX 120 /* origin excerpt length in messages */
#define NIC_NAME_MAX 63     /* IBV_SYSFS_NAME_MAX - 1 */

enum { F_PREFILL, F_DECODE, F_META, F_BACKEND, F_PROTO, F_DEVICE, F_AUTH, F_SHC, F_COUNT };

static const char *const k_field[F_COUNT] = {
    "prefill_url", "decode_url",  "metadata_server", "metadata_backend",
    "protocol",    "device_name", "auth_secret",     "same_host_cpu",
};

#define ACC_URL "\"host:port\" with a port in 1..65535, e.g. \"192.168.0.137:13003\""
static const char *const k_accepted[F_COUNT] = {
    ACC_URL,
    ACC_URL,
    "\"P2PHANDSHAKE\", \"etcd://h:p[,h:p...]\", \"redis://[:password@]h:p[/db]\", "
    "\"http(s)://h:p/path\", or bare \"h:p\"",
    "\"etcd\", \"redis\", \"http\" (deprecated: prefer a scheme in metadata_server)",
    "\"tcp\", \"rdma\"",
    "comma-separated RDMA NIC names of [A-Za-z0-9_.-], e.g. \"erdma_0\" or "
    "\"mlx5_0,mlx5_1\"",
    "the peer authentication secret, the same on every engine (docs/security.md); \"\" = off",
    "true (default: peers on this host use the same-host CPU path when the OS allows it) or "
    "false (they use protocol's path); a JSON boolean",
};
#define ACC_FIELDS                                                                                 \
  "prefill_url, decode_url, metadata_server, metadata_backend, protocol, "                         \
  "device_name, auth_secret, same_host_cpu"
#define JSON_HINT                                                                                  \
  "expected a JSON object like {\"prefill_url\": \"host:port\", "                                  \
  "\"decode_url\": \"host:port\", \"metadata_server\": \"...\"}"

/* Keys of vLLM's --kv-transfer-config that users sometimes paste here. */
static const char *const k_vllm_keys[] = {
    "kv_connector", "kv_role", "kv_rank", "kv_parallel_size", "kv_buffer_size", "kv_ip", "kv_port",
};

/* The connector's own settings (mooncake_connector/connector/settings.py
 * KNOBS and mooncake_config_path), which users put here: they belong in
 * kv_connector_extra_config.  tests/test_bad_input.py checks this list
 * against KNOBS. */
static const char *const k_knob_keys[] = {
    "mooncake_config_path", "hold_timeout_s", "load_timeout_s", "flow_a",
    "load_failure_policy", "load_workers", "lookup_timeout_s", "probe_wait_ms",
    "sync_load_max_bytes", "sync_load_timeout_s", "idle_wait_ms", "push_layerwise",
    "push_layerwise_cuda", "push_layer_gate", "push_layer_watch", "push_layer_load",
    "push_layer_read", "push_layer_read_stall_s", "push_layer_load_max_batch", "early_recv",
    "push_layer_load_async", "push_target_direct",
    "push_layer_timeout_s", "kv_cache_access", "bootstrap_port", "bootstrap_host",
    "idle_wait_max_ms", "malloc_trim_idle_s",
};

typedef struct {
  char origin[SHOW_ORIGIN_MAX * 4 + 8]; /* shortened, escaped for messages */
  mc_err_t *err;
  const char *meta_shown; /* metadata_server with any password masked */
} ctx_t;

/* ---- message helpers --------------------------------------------------- */

/* Length (1..4) of the valid UTF-8 sequence at s, or 0 if it is not one
 * (bad lead byte, missing continuation, overlong form, surrogate).  Python
 * decodes error messages as strict UTF-8, so messages must stay valid. */
static size_t utf8_seq(const unsigned char *s) {
  size_t n;
  if (s[0] < 0x80)
    return 1;
  if (s[0] >= 0xc2 && s[0] <= 0xdf)
    n = 2;
  else if (s[0] >= 0xe0 && s[0] <= 0xef)
    n = 3;
  else if (s[0] >= 0xf0 && s[0] <= 0xf4)
    n = 4;
  else
    return 0;
  for (size_t i = 1; i < n; i++)
    if ((s[i] & 0xc0) != 0x80) /* also stops at the terminating NUL */
      return 0;
  if ((s[0] == 0xe0 && s[1] < 0xa0) || (s[0] == 0xed && s[1] >= 0xa0) ||
      (s[0] == 0xf0 && s[1] < 0x90) || (s[0] == 0xf4 && s[1] >= 0x90))
    return 0;
  return n;
}

/* Replaces control bytes and invalid UTF-8 (e.g. a character cut by
 * truncation) with '?', in place. */
static void utf8_clean(char *s) {
  while (*s) {
    unsigned char ch = (unsigned char)*s;
    size_t n = utf8_seq((const unsigned char *)s);
    if (n == 0 || ch < 0x20 || ch == 0x7f) {
      *s++ = '?';
      continue;
    }
    s += n;
  }
}

/* mc_err_set whose message is guaranteed one line of valid UTF-8. */
static int cfg_err(mc_err_t *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int cfg_err(mc_err_t *err, int code, const char *fmt, ...) {
  char msg[MC_ERR_MSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  mc_err_set(err, code, "%s", msg);
  if (err)
    utf8_clean(err->msg);
  return code;
}

/* Same for mc_err_sys (appends the errno text). */
static int cfg_sys(mc_err_t *err, int code, int sys, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int cfg_sys(mc_err_t *err, int code, int sys, const char *fmt, ...) {
  char msg[MC_ERR_MSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  mc_err_sys(err, code, sys, "%s", msg);
  if (err)
    utf8_clean(err->msg);
  return code;
}

/* Copies s into buf as a one-line excerpt of at most `max` characters (then
 * "..."): control bytes and invalid UTF-8 become \xNN, and when `quote`
 * the result is "quoted" with inner quotes/backslashes escaped.  Keeps
 * messages one line and bounded even for hostile values. */
static void show(const char *s, bool quote, char *buf, size_t n, size_t max) {
  size_t o = 0, shown = 0;
  if (n < 8)
    return;
  if (quote)
    buf[o++] = '"';
  while (*s) {
    unsigned char ch = (unsigned char)*s;
    size_t sl = utf8_seq((const unsigned char *)s);
    char tmp[8];
    size_t tl;
    if (quote && (ch == '"' || ch == '\\')) {
      tl = (size_t)snprintf(tmp, sizeof tmp, "\\%c", ch);
      sl = 1;
    } else if (ch < 0x20 || ch == 0x7f || sl == 0) {
      tl = (size_t)snprintf(tmp, sizeof tmp, "\\x%02x", ch);
      sl = 1;
    } else {
      memcpy(tmp, s, sl);
      tl = sl;
    }
    /* Room for this piece plus "...", a closing quote and the NUL. */
    if (shown >= max || o + tl + 5 > n) {
      memcpy(buf + o, "...", 3);
      o += 3;
      break;
    }
    memcpy(buf + o, tmp, tl);
    o += tl;
    s += sl;
    shown++;
  }
  if (quote)
    buf[o++] = '"';
  buf[o] = '\0';
}

/* Long paths keep their tail: the file name is the useful part. */
static void ctx_init(ctx_t *c, const char *origin, mc_err_t *err) {
  size_t len = strlen(origin), o = 0;
  const char *tail = origin;
  if (len > SHOW_ORIGIN_MAX) {
    tail = origin + len - (SHOW_ORIGIN_MAX - 3);
    while ((*tail & 0xc0) == 0x80) /* do not start inside a character */
      tail++;
    memcpy(c->origin, "...", 3);
    o = 3;
  }
  show(tail, false, c->origin + o, sizeof c->origin - o, SHOW_ORIGIN_MAX);
  c->err = err;
  c->meta_shown = NULL;
}

/* `<origin>: field "<f>": [value <v> ]<why>; accepted: <acc>`.  `value` is
 * shown quoted unless `raw` (then it is a JSON rendering, e.g. 5 or true). */
static int vferr(ctx_t *c, int f, const char *value, bool raw, const char *accepted,
                 const char *fmt, va_list ap) {
  char why[320], val[SHOW_VALUE_MAX * 4 + 8] = "";
  vsnprintf(why, sizeof why, fmt, ap);
  if (value)
    show(value, !raw, val, sizeof val, SHOW_VALUE_MAX);
  if (!accepted)
    accepted = k_accepted[f];
  return cfg_err(c->err, MC_ECONFIG, "%s: field \"%s\": %s%s%s%s; accepted: %s", c->origin,
                 k_field[f], value ? "value " : "", val, value ? " " : "", why, accepted);
}

static int ferr(ctx_t *c, int f, const char *value, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int ferr(ctx_t *c, int f, const char *value, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int rc = vferr(c, f, value, false, NULL, fmt, ap);
  va_end(ap);
  return rc;
}

/* Same, with a custom `accepted` text. */
static int ferr_acc(ctx_t *c, int f, const char *value, const char *accepted, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static int ferr_acc(ctx_t *c, int f, const char *value, const char *accepted, const char *fmt,
                    ...) {
  va_list ap;
  va_start(ap, fmt);
  int rc = vferr(c, f, value, false, accepted, fmt, ap);
  va_end(ap);
  return rc;
}

/* Same, with `value` a JSON rendering shown unquoted (e.g. 5, true). */
static int ferr_raw(ctx_t *c, int f, const char *value, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int ferr_raw(ctx_t *c, int f, const char *value, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int rc = vferr(c, f, value, true, NULL, fmt, ap);
  va_end(ap);
  return rc;
}

static void add_note(mc_config_t *cfg, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void add_note(mc_config_t *cfg, const char *fmt, ...) {
  size_t n = strlen(cfg->notes);
  if (n && n + 2 < sizeof cfg->notes) {
    memcpy(cfg->notes + n, "; ", 3);
    n += 2;
  }
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cfg->notes + n, sizeof cfg->notes - n, fmt, ap);
  va_end(ap);
}

/* 1-based line and column (in characters, not UTF-8 bytes) of text[off]. */
static void line_col(const char *text, size_t off, int *line, int *col) {
  int l = 1, c = 1;
  for (size_t i = 0; i < off; i++) {
    unsigned char ch = (unsigned char)text[i];
    if (ch == '\n') {
      l++;
      c = 1;
    } else if ((ch & 0xc0) != 0x80) {
      c++;
    }
  }
  *line = l;
  *col = c;
}

static int json_err(ctx_t *c, const char *text, size_t len, size_t off, const char *what) {
  int line, col;
  if (off > len)
    off = len;
  line_col(text, off, &line, &col);
  char near[24], shown[SHOW_VALUE_MAX];
  size_t k = 0;
  /* Excerpt up to the end of the line, so the message stays one line. */
  while (off + k < len && k < sizeof near - 1 && text[off + k] != '\n' && text[off + k] != '\r' &&
         text[off + k] != '\0') {
    near[k] = text[off + k];
    k++;
  }
  near[k] = '\0';
  if (k)
    show(near, true, shown, sizeof shown, 20);
  return cfg_err(c->err, MC_ECONFIG,
                 "%s: invalid JSON at line %d, column %d%s%s: %s (JSON needs "
                 "double-quoted keys and strings, no trailing commas, no "
                 "comments); %s",
                 c->origin, line, col, k ? " near " : " at end of input", k ? shown : "", what,
                 JSON_HINT);
}

/* 0 if text is one valid JSON value (plus whitespace), else MC_ECONFIG. */
static int json_check(ctx_t *c, const char *text, size_t len) {
  const char *why;
  size_t off = mc_json_check(text, len, &why);
  return off == MC_JSON_OK ? 0 : json_err(c, text, len, off, why);
}

/* cJSON decodes "\u0000" into a NUL that silently ends the C string
 * ("mlx5\u0000_0" would read as "mlx5"), so such a string is refused here,
 * naming the key it belongs to.  text is valid JSON (json_check passed). */
static int nul_escape_check(ctx_t *c, const char *text, size_t len) {
  char key[MC_CFG_STR_MAX] = "", last[MC_CFG_STR_MAX] = "";
  size_t i = 0;
  while (i < len) {
    if (text[i] == ':') {
      snprintf(key, sizeof key, "%s", last);
      i++;
      continue;
    }
    if (text[i] != '"') {
      i++;
      continue;
    }
    size_t start = ++i, k = 0;
    int has_nul = 0;
    while (i < len && text[i] != '"') {
      if (text[i] == '\\' && i + 1 < len) {
        if (text[i + 1] == 'u' && i + 5 < len && !memcmp(text + i + 2, "0000", 4))
          has_nul = 1;
        i += 2;
      } else {
        i++;
      }
    }
    k = i - start < sizeof last - 1 ? i - start : sizeof last - 1;
    memcpy(last, text + start, k);
    last[k] = '\0';
    i++; /* the closing quote */
    size_t j = i;
    while (j < len && (text[j] == ' ' || text[j] == '\t' || text[j] == '\r' || text[j] == '\n'))
      j++;
    int is_key = j < len && text[j] == ':';
    if (has_nul) {
      char shown[SHOW_VALUE_MAX * 4 + 8];
      show(is_key ? last : key, false, shown, sizeof shown, SHOW_VALUE_MAX);
      return cfg_err(c->err, MC_ECONFIG,
                     "%s: field \"%s\": %s contains a NUL character (\\u0000), which would "
                     "cut it short; remove it",
                     c->origin, shown, is_key ? "the key" : "the value");
    }
  }
  return 0;
}

/* ---- small utilities --------------------------------------------------- */

static int edit_distance(const char *a, const char *b) {
  size_t la = strlen(a), lb = strlen(b);
  int row[65];
  if (la > 64 || lb > 64)
    return 99;
  for (size_t j = 0; j <= lb; j++)
    row[j] = (int)j;
  for (size_t i = 1; i <= la; i++) {
    int diag = row[0];
    row[0] = (int)i;
    for (size_t j = 1; j <= lb; j++) {
      int up = row[j];
      int best = diag + (a[i - 1] != b[j - 1]);
      if (up + 1 < best)
        best = up + 1;
      if (row[j - 1] + 1 < best)
        best = row[j - 1] + 1;
      row[j] = best;
      diag = up;
    }
  }
  return row[lb];
}

/* A wrong-typed value as its error shows it: cJSON's text of it, except a
 * number past the double range (1e400), which cJSON prints as null. */
#define OUT_OF_RANGE_NUMBER "<a number out of range>"
static char *value_text(const cJSON *it) {
  if (cJSON_IsNumber(it) && !isfinite(it->valuedouble)) {
    char *t = cJSON_malloc(sizeof OUT_OF_RANGE_NUMBER);
    if (t)
      memcpy(t, OUT_OF_RANGE_NUMBER, sizeof OUT_OF_RANGE_NUMBER);
    return t;
  }
  return cJSON_PrintUnformatted(it);
}

static const char *json_type_name(const cJSON *it) {
  if (cJSON_IsString(it))
    return "a string";
  if (cJSON_IsNumber(it))
    return "a number";
  if (cJSON_IsBool(it))
    return "a boolean";
  if (cJSON_IsNull(it))
    return "null";
  if (cJSON_IsArray(it))
    return "an array";
  if (cJSON_IsObject(it))
    return "an object";
  return "an unknown JSON type";
}

static bool is_blank(const char *s, size_t len) {
  for (size_t i = 0; i < len; i++)
    if (!isspace((unsigned char)s[i]))
      return false;
  return true;
}

/* Copies [s, s+n) into buf (size bufsz); false if it does not fit. */
static bool copy_span(char *buf, size_t bufsz, const char *s, size_t n) {
  if (n >= bufsz)
    return false;
  memcpy(buf, s, n);
  buf[n] = '\0';
  return true;
}

/* "redis://:secret@h:p" -> "redis://:***@h:p", so passwords stay out of
 * error messages and logs. */
static void mask_password(const char *v, char *buf, size_t n) {
  const char *sep = strstr(v, "://");
  const char *start = sep ? sep + 3 : v; /* bare ":pw@h:p" with redis backend */
  const char *at = strrchr(start, '@');
  if (!at) {
    snprintf(buf, n, "%s", v);
    return;
  }
  snprintf(buf, n, "%.*s:***%s", (int)(start - v), v, at);
}

/* ---- field parsers ----------------------------------------------------- */

/* prefill_url / decode_url: "host:port", port required. */
static int parse_url(ctx_t *c, int f, const char *v, mc_hostport_t *hp) {
  mc_err_t he = {0};
  if (!*v)
    return ferr(c, f, v, "is empty");
  if (strstr(v, "://"))
    return ferr(c, f, v, "must not have a scheme (write only host:port)");
  if (mc_hostport_parse(v, hp, &he) < 0)
    return ferr(c, f, v, "is not a valid address (%s)", he.msg);
  if (hp->port < 0)
    return ferr(c, f, v, "has no port");
  return 0;
}

/* Parses one "host:port" item of metadata_server into hp; the item is
 * [s, s+n).  port_required for etcd/redis/bare forms. */
static int parse_meta_hostport(ctx_t *c, const char *s, size_t n, bool port_required,
                               mc_hostport_t *hp) {
  char item[MC_HOST_MAX + 16];
  mc_err_t he = {0};
  if (n == 0)
    return ferr(c, F_META, c->meta_shown, "has an empty host:port item");
  if (!copy_span(item, sizeof item, s, n))
    return ferr(c, F_META, c->meta_shown, "has a host:port item that is too long");
  if (mc_hostport_parse(item, hp, &he) < 0)
    return ferr(c, F_META, c->meta_shown, "has an invalid address (%s)", he.msg);
  if (port_required && hp->port < 0)
    return ferr(c, F_META, c->meta_shown, "has no port in \"%s\"", item);
  return 0;
}

/* Appends formatted text at *pos in buf; false when it would not fit. */
static bool append(char *buf, size_t bufsz, size_t *pos, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static bool append(char *buf, size_t bufsz, size_t *pos, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int w = vsnprintf(buf + *pos, bufsz - *pos, fmt, ap);
  va_end(ap);
  if (w < 0 || (size_t)w >= bufsz - *pos)
    return false;
  *pos += (size_t)w;
  return true;
}

static bool append_hostport(char *buf, size_t bufsz, size_t *pos, const mc_hostport_t *hp) {
  char tmp[MC_HOST_MAX + 16];
  mc_hostport_format(hp, tmp, sizeof tmp);
  return append(buf, bufsz, pos, "%s", tmp);
}

static int too_long(ctx_t *c) {
  return ferr(c, F_META, c->meta_shown, "is too long once normalised (at most %d bytes)",
              MC_CFG_STR_MAX - 1);
}

/* etcd: one or more comma-separated host:port endpoints. */
static int parse_etcd(ctx_t *c, const char *rest, mc_config_t *cfg) {
  size_t pos = 0;
  char *out = cfg->metadata_server;
  if (strchr(rest, '/'))
    return ferr(c, F_META, c->meta_shown, "has a path, but etcd endpoints are host:port only");
  if (!append(out, MC_CFG_STR_MAX, &pos, "etcd://"))
    return too_long(c);
  for (const char *s = rest;;) {
    const char *comma = strchr(s, ',');
    size_t n = comma ? (size_t)(comma - s) : strlen(s);
    mc_hostport_t hp;
    int rc = parse_meta_hostport(c, s, n, true, &hp);
    if (rc < 0)
      return rc;
    if (s != rest && !append(out, MC_CFG_STR_MAX, &pos, ","))
      return too_long(c);
    if (!append_hostport(out, MC_CFG_STR_MAX, &pos, &hp))
      return too_long(c);
    if (!comma)
      break;
    s = comma + 1;
  }
  return 0;
}

/* redis: [:password@]host:port[/db]. */
static int parse_redis(ctx_t *c, const char *rest, mc_config_t *cfg) {
  const char *at = strrchr(rest, '@');
  const char *hostpart = at ? at + 1 : rest;
  size_t pos = 0;
  char *out = cfg->metadata_server;

  if (!append(out, MC_CFG_STR_MAX, &pos, "redis://"))
    return too_long(c);
  if (at) {
    if (rest[0] != ':')
      return ferr(c, F_META, c->meta_shown,
                  "has credentials without a leading ':' (Redis takes only a "
                  "password: write \"redis://:password@host:port\")");
    if (at == rest + 1)
      return ferr(c, F_META, c->meta_shown, "has an empty password");
    for (const char *p = rest; p < at; p++)
      if ((unsigned char)*p < 0x20 || *p == 0x7f)
        return ferr(c, F_META, c->meta_shown, "has a control character in the password");
    if (!append(out, MC_CFG_STR_MAX, &pos, "%.*s", (int)(at + 1 - rest), rest))
      return too_long(c);
  }
  const char *slash = strchr(hostpart, '/');
  size_t hn = slash ? (size_t)(slash - hostpart) : strlen(hostpart);
  mc_hostport_t hp;
  int rc = parse_meta_hostport(c, hostpart, hn, true, &hp);
  if (rc < 0)
    return rc;
  if (!append_hostport(out, MC_CFG_STR_MAX, &pos, &hp))
    return too_long(c);
  if (slash) {
    const char *db = slash + 1;
    size_t dl = strlen(db);
    if (dl == 0 || dl > 9 || strspn(db, "0123456789") != dl)
      return ferr(c, F_META, c->meta_shown,
                  "has database \"%.16s\", which is not a non-negative integer", db);
    if (!append(out, MC_CFG_STR_MAX, &pos, "/%ld", strtol(db, NULL, 10)))
      return too_long(c);
  }
  return 0;
}

static bool valid_path_char(char ch) {
  /* RFC 3986 pchar plus '/'; '?' and '#' are excluded because the client
   * appends its own query string. */
  return isalnum((unsigned char)ch) || strchr("-._~!$&'()*+,;=:@/%", ch);
}

/* http/https: host[:port][/path]; bare forms need a port.  A missing path
 * means Mooncake's HTTP metadata server's default endpoint, /metadata. */
static int parse_http(ctx_t *c, const char *scheme, const char *rest, bool port_required,
                      mc_config_t *cfg) {
  const char *slash = strchr(rest, '/');
  size_t hn = slash ? (size_t)(slash - rest) : strlen(rest);
  mc_hostport_t hp;
  size_t pos = 0;
  int rc = parse_meta_hostport(c, rest, hn, port_required, &hp);
  if (rc < 0)
    return rc;
  const char *path = slash ? slash : "/metadata";
  for (const char *p = path; *p; p++)
    if (!valid_path_char(*p))
      return ferr(c, F_META, c->meta_shown,
                  "has character '%c' in the URL path, which is not allowed "
                  "(no query string or fragment)",
                  isprint((unsigned char)*p) ? *p : '?');
  if (!append(cfg->metadata_server, MC_CFG_STR_MAX, &pos, "%s://", scheme) ||
      !append_hostport(cfg->metadata_server, MC_CFG_STR_MAX, &pos, &hp) ||
      !append(cfg->metadata_server, MC_CFG_STR_MAX, &pos, "%s", path))
    return too_long(c);
  if (!slash)
    add_note(cfg, "metadata_server has no path; using %s", cfg->metadata_server);
  return 0;
}

static int parse_backend(ctx_t *c, const char *v, mc_meta_kind_t *kind) {
  static const struct {
    const char *name;
    mc_meta_kind_t kind;
  } map[] = {{"etcd", MC_META_ETCD}, {"redis", MC_META_REDIS}, {"http", MC_META_HTTP}};
  for (size_t i = 0; i < sizeof map / sizeof map[0]; i++) {
    if (strcmp(v, map[i].name) == 0) {
      *kind = map[i].kind;
      return 0;
    }
    if (strcasecmp(v, map[i].name) == 0)
      return ferr(c, F_BACKEND, v, "is not accepted (backend names are lowercase)");
  }
  return ferr(c, F_BACKEND, v, "is not a known metadata backend");
}

static int parse_meta(ctx_t *c, const char *v, const char *backend, mc_config_t *cfg) {
  mc_meta_kind_t bkind = MC_META_ETCD;
  int rc;
  if (backend && (rc = parse_backend(c, backend, &bkind)) < 0)
    return rc;
  if (!*v)
    return ferr(c, F_META, v, "is empty");

  if (strcasecmp(v, "P2PHANDSHAKE") == 0) {
    cfg->metadata_kind = MC_META_P2P;
    snprintf(cfg->metadata_server, MC_CFG_STR_MAX, "P2PHANDSHAKE");
    if (backend)
      add_note(cfg, "metadata_backend \"%s\" ignored: P2PHANDSHAKE uses no metadata server",
               backend);
    return 0;
  }

  const char *sep = strstr(v, "://");
  if (!sep) {
    /* Bare form: the deprecated metadata_backend picks the scheme. */
    cfg->metadata_kind = bkind;
    switch (bkind) {
    case MC_META_REDIS:
      rc = parse_redis(c, v, cfg);
      break;
    case MC_META_HTTP:
      rc = parse_http(c, "http", v, true, cfg);
      break;
    default:
      rc = parse_etcd(c, v, cfg);
      break;
    }
    if (rc == 0 && backend) {
      char masked[MC_CFG_STR_MAX];
      mask_password(cfg->metadata_server, masked, sizeof masked);
      add_note(cfg, "metadata_backend is deprecated; write \"metadata_server\": \"%s\" instead",
               masked);
    }
    return rc;
  }

  char scheme[16];
  size_t sl = (size_t)(sep - v);
  if (sl == 0 || !copy_span(scheme, sizeof scheme, v, sl))
    return ferr(c, F_META, c->meta_shown, "has no recognisable scheme");
  for (char *p = scheme; *p; p++)
    *p = (char)tolower((unsigned char)*p);
  const char *rest = sep + 3;
  mc_meta_kind_t kind;
  if (strcmp(scheme, "etcd") == 0)
    kind = MC_META_ETCD;
  else if (strcmp(scheme, "redis") == 0)
    kind = MC_META_REDIS;
  else if (strcmp(scheme, "http") == 0 || strcmp(scheme, "https") == 0)
    kind = MC_META_HTTP;
  else
    return ferr(c, F_META, c->meta_shown, "has unknown scheme \"%s\"", scheme);

  if (backend && bkind != kind) {
    char acc[96];
    snprintf(acc, sizeof acc, "drop metadata_backend (deprecated) or set it to \"%s\"",
             mc_meta_kind_name(kind));
    char shown[SHOW_VALUE_MAX * 4 + 8];
    show(c->meta_shown, true, shown, sizeof shown, SHOW_VALUE_MAX);
    return ferr_acc(c, F_BACKEND, backend, acc, "conflicts with metadata_server %s (scheme %s)",
                    shown, scheme);
  }
  cfg->metadata_kind = kind;
  switch (kind) {
  case MC_META_REDIS:
    rc = parse_redis(c, rest, cfg);
    break;
  case MC_META_HTTP:
    rc = parse_http(c, scheme, rest, false, cfg);
    break;
  default:
    rc = parse_etcd(c, rest, cfg);
    break;
  }
  if (rc == 0 && backend)
    add_note(cfg, "metadata_backend is deprecated and redundant with the scheme in "
                  "metadata_server; remove it");
  return rc;
}

static int parse_protocol(ctx_t *c, const char *v, mc_protocol_t *out) {
  if (!v || strcmp(v, "tcp") == 0) {
    *out = MC_PROTO_TCP;
    return 0;
  }
  if (strcmp(v, "rdma") == 0) {
    *out = MC_PROTO_RDMA;
    return 0;
  }
  if (strcasecmp(v, "tcp") == 0 || strcasecmp(v, "rdma") == 0)
    return ferr(c, F_PROTO, v, "is not accepted (protocol names are lowercase)");
  return ferr(c, F_PROTO, v, "is not a supported protocol");
}

static int parse_devices(ctx_t *c, const char *v, mc_config_t *cfg) {
  if (cfg->protocol != MC_PROTO_RDMA) {
    /* TCP picks its interface from the host part of the URLs. */
    if (v && *v)
      add_note(cfg, "device_name ignored: protocol is tcp");
    cfg->device_name[0] = '\0';
    return 0;
  }
  if (!v)
    return ferr(c, F_DEVICE, NULL,
                "is missing; protocol \"rdma\" needs at least one RDMA NIC "
                "(list them with ibv_devices)");
  if (!*v)
    return ferr(c, F_DEVICE, v,
                "is empty; protocol \"rdma\" needs at least one RDMA NIC "
                "(list them with ibv_devices)");
  int idx = 1;
  for (const char *s = v;; idx++) {
    const char *comma = strchr(s, ',');
    size_t n = comma ? (size_t)(comma - s) : strlen(s);
    if (n == 0)
      return ferr(c, F_DEVICE, v, "has an empty NIC name at position %d", idx);
    if (n > NIC_NAME_MAX)
      return ferr(c, F_DEVICE, v, "has NIC name %d longer than %d characters", idx, NIC_NAME_MAX);
    for (size_t i = 0; i < n; i++) {
      unsigned char ch = (unsigned char)s[i];
      if (!isalnum(ch) && ch != '_' && ch != '.' && ch != '-')
        return ferr(c, F_DEVICE, v, "has invalid character '%c' in NIC name %d%s",
                    isprint(ch) ? ch : '?', idx, isspace(ch) ? " (no spaces around commas)" : "");
    }
    if (!comma)
      break;
    s = comma + 1;
  }
  snprintf(cfg->device_name, sizeof cfg->device_name, "%s", v);
  return 0;
}

/* The seed's port rules: identical URLs move decode up by 100; otherwise two
 * ports on one host must be at least 50 apart. */
static int apply_port_rules(ctx_t *c, const char *pv, const char *dv, mc_config_t *cfg) {
  mc_hostport_t *p = &cfg->prefill, *d = &cfg->decode;
  if (strcasecmp(p->host, d->host) != 0)
    return 0;
  int sugg = p->port + 100 <= 65535 ? p->port + 100 : p->port - 100;
  char acc[MC_HOST_MAX + 96];
  mc_hostport_t s = *d;
  s.port = sugg;
  char sbuf[MC_HOST_MAX + 16];
  mc_hostport_format(&s, sbuf, sizeof sbuf);

  if (p->port == d->port) {
    int np = d->port + 100;
    if (np > 65535) {
      snprintf(acc, sizeof acc, "a decode_url port at least 50 away from %d, e.g. \"%s\"", p->port,
               sbuf);
      return ferr_acc(c, F_DECODE, dv, acc,
                      "equals prefill_url, and the +100 rule would give port %d, "
                      "above 65535",
                      np);
    }
    d->port = np;
    cfg->decode_port_adjusted = true;
    add_note(cfg, "decode_url equals prefill_url; using decode port %d (%d+100, seed rule)", np,
             p->port);
    return 0;
  }
  int gap = abs(p->port - d->port);
  if (gap < 50) {
    char pshown[SHOW_VALUE_MAX * 4 + 8];
    show(pv, true, pshown, sizeof pshown, SHOW_VALUE_MAX);
    snprintf(acc, sizeof acc, "a decode_url port at least 50 away from %d, e.g. \"%s\"", p->port,
             sbuf);
    return ferr_acc(c, F_DECODE, dv, acc,
                    "is on the same host as prefill_url %s with ports only %d apart; "
                    "ports on one host must be at least 50 apart",
                    pshown, gap);
  }
  return 0;
}

/* ---- top level ---------------------------------------------------------- */

/* Settings of Mooncake Store's mooncake.json (vLLM's MooncakeStore
 * connector), which users carry over: refused with a pointer, not a typo
 * hint.  The engine address comes from prefill_url / decode_url here. */
static const char *const k_store_keys[] = {
    "local_hostname", "global_segment_size", "local_buffer_size", "master_server_address",
    "replica_num", "transfer_timeout",
};

static int check_object(ctx_t *c, const cJSON *root, const char *val[F_COUNT]) {
  for (const cJSON *it = root->child; it; it = it->next) {
    const char *key = it->string ? it->string : "";
    int f = -1;
    for (int i = 0; i < F_COUNT; i++)
      if (strcmp(key, k_field[i]) == 0)
        f = i;
    if (f < 0) {
      char kshown[SHOW_VALUE_MAX * 4 + 8], hint[160] = "";
      show(key, false, kshown, sizeof kshown, SHOW_VALUE_MAX);
      int best = 3, bi = -1;
      for (int i = 0; i < F_COUNT; i++) {
        int dist = edit_distance(key, k_field[i]);
        if (dist < best) {
          best = dist;
          bi = i;
        }
      }
      if (bi >= 0)
        snprintf(hint, sizeof hint, "; did you mean \"%s\"?", k_field[bi]);
      for (size_t i = 0; i < sizeof k_vllm_keys / sizeof k_vllm_keys[0]; i++)
        if (strcmp(key, k_vllm_keys[i]) == 0)
          snprintf(hint, sizeof hint,
                   " (it belongs in vLLM's --kv-transfer-config, not mooncake.json)");
      for (size_t i = 0; i < sizeof k_knob_keys / sizeof k_knob_keys[0]; i++)
        if (strcmp(key, k_knob_keys[i]) == 0)
          snprintf(hint, sizeof hint,
                   " (a connector setting: it belongs in kv_connector_extra_config of vLLM's "
                   "--kv-transfer-config, not mooncake.json)");
      for (size_t i = 0; i < sizeof k_store_keys / sizeof k_store_keys[0]; i++)
        if (strcmp(key, k_store_keys[i]) == 0)
          snprintf(hint, sizeof hint,
                   " (a Mooncake Store setting; this connector does not use it: remove it)");
      return cfg_err(c->err, MC_ECONFIG, "%s: field \"%s\": unknown field%s; accepted: " ACC_FIELDS,
                     c->origin, kshown, hint);
    }
    if (val[f])
      return ferr_acc(c, f, NULL, "each field once", "appears more than once");
    if (f == F_SHC) { /* the one boolean field */
      if (!cJSON_IsBool(it)) {
        char *txt = value_text(it);
        int rc = ferr_raw(c, f, txt ? txt : "?", "is %s; expected true or false",
                          json_type_name(it));
        cJSON_free(txt);
        return rc;
      }
      val[f] = cJSON_IsTrue(it) ? "true" : "false";
      continue;
    }
    if (!cJSON_IsString(it) || !it->valuestring) {
      /* Show the JSON text unquoted: quoting 5 as "5" would hide the bug
       * (never the secret's). */
      char *txt = f == F_AUTH ? NULL : value_text(it);
      int rc = ferr_raw(c, f, txt ? txt : "?", "is %s; expected a string", json_type_name(it));
      cJSON_free(txt);
      return rc;
    }
    if (strlen(it->valuestring) >= MC_CFG_STR_MAX)
      return ferr(c, f, f == F_AUTH ? NULL : it->valuestring,
                  "is %zu bytes long; at most %d are accepted",
                  strlen(it->valuestring), MC_CFG_STR_MAX - 1);
    val[f] = it->valuestring;
  }
  static const int required[] = {F_PREFILL, F_DECODE, F_META};
  for (size_t i = 0; i < sizeof required / sizeof required[0]; i++)
    if (!val[required[i]])
      return ferr(c, required[i], NULL, "is missing (required)");
  return 0;
}

static int parse_fields(ctx_t *c, const char *val[F_COUNT], mc_config_t *cfg) {
  int rc;
  char masked[MC_CFG_STR_MAX];
  mask_password(val[F_META], masked, sizeof masked);
  c->meta_shown = masked;
  snprintf(cfg->metadata_server_raw, sizeof cfg->metadata_server_raw, "%s", val[F_META]);
  cfg->metadata_backend_given = val[F_BACKEND] != NULL;
  snprintf(cfg->auth_secret, sizeof cfg->auth_secret, "%s", val[F_AUTH] ? val[F_AUTH] : "");
  cfg->same_host_cpu = !(val[F_SHC] && strcmp(val[F_SHC], "false") == 0);

  if ((rc = parse_url(c, F_PREFILL, val[F_PREFILL], &cfg->prefill)) < 0 ||
      (rc = parse_url(c, F_DECODE, val[F_DECODE], &cfg->decode)) < 0 ||
      (rc = apply_port_rules(c, val[F_PREFILL], val[F_DECODE], cfg)) < 0 ||
      (rc = parse_meta(c, val[F_META], val[F_BACKEND], cfg)) < 0 ||
      (rc = parse_protocol(c, val[F_PROTO], &cfg->protocol)) < 0 ||
      (rc = parse_devices(c, val[F_DEVICE], cfg)) < 0) {
    c->meta_shown = NULL;
    return rc;
  }
  c->meta_shown = NULL;
  return 0;
}

int mc_config_parse(const char *json, size_t len, const char *origin, mc_config_t *out,
                    mc_err_t *err) {
  if (!origin)
    origin = "<string>";
  if (!out || (!json && len))
    return cfg_err(err, MC_EINVAL, "mc_config_parse: NULL argument");
  ctx_t c;
  ctx_init(&c, origin, err);
  if (len > CFG_FILE_MAX)
    return cfg_err(err, MC_ECONFIG,
                   "%s: config is %zu bytes; at most %zu are accepted (is this "
                   "really mooncake.json?)",
                   c.origin, len, CFG_FILE_MAX);
  if (len == 0 || is_blank(json, len))
    return cfg_err(err, MC_ECONFIG, "%s: config is empty; %s", c.origin, JSON_HINT);
  const char *nul = memchr(json, '\0', len);
  if (nul)
    return json_err(&c, json, len, (size_t)(nul - json), "NUL byte (binary data?)");
  int rc = json_check(&c, json, len);
  if (rc < 0 || (rc = nul_escape_check(&c, json, len)) < 0)
    return rc;

  /* The text is valid JSON, so a failure here is cJSON running out of
   * memory. */
  cJSON *root = cJSON_ParseWithLength(json, len);
  if (!root)
    return cfg_err(err, MC_ENOMEM, "%s: out of memory parsing config", c.origin);
  if (!cJSON_IsObject(root)) {
    rc = cfg_err(err, MC_ECONFIG, "%s: top-level JSON value is %s; %s", c.origin,
                 json_type_name(root), JSON_HINT);
    goto done;
  }

  /* Build into a scratch copy so *out is untouched on failure. */
  mc_config_t *cfg = calloc(1, sizeof *cfg);
  if (!cfg) {
    rc = cfg_err(err, MC_ENOMEM, "%s: out of memory parsing config", c.origin);
    goto done;
  }
  snprintf(cfg->origin, sizeof cfg->origin, "%s", origin);
  const char *val[F_COUNT] = {0};
  if ((rc = check_object(&c, root, val)) == 0 && (rc = parse_fields(&c, val, cfg)) == 0)
    *out = *cfg;
  free(cfg);
done:
  cJSON_Delete(root);
  return rc;
}

int mc_config_load_file(const char *path, mc_config_t *out, mc_err_t *err) {
  if (!out)
    return cfg_err(err, MC_EINVAL, "mc_config_load_file: NULL argument");
  if (!path || !*path)
    return cfg_err(err, MC_ECONFIG,
                   "config path is empty; set MOONCAKE_CONFIG_PATH to the path of "
                   "your mooncake.json");
  ctx_t c;
  ctx_init(&c, path, err);
  /* O_NONBLOCK: a FIFO nothing writes to would block open() forever; the
   * reads below block again (a pipe with a writer is read to its end, one
   * without is empty). */
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0)
    return cfg_sys(err, MC_ECONFIG, errno,
                   "%s: cannot open config file (MOONCAKE_CONFIG_PATH must name a "
                   "readable mooncake.json)",
                   c.origin);
  int fl = fcntl(fd, F_GETFL);
  if (fl >= 0)
    (void)fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
  struct stat sb;
  if (fstat(fd, &sb) < 0) {
    int e = errno;
    close(fd);
    return cfg_sys(err, MC_ECONFIG, e, "%s: cannot stat config file", c.origin);
  }
  if (S_ISDIR(sb.st_mode)) {
    close(fd);
    return cfg_err(err, MC_ECONFIG,
                   "%s: is a directory; MOONCAKE_CONFIG_PATH must name the "
                   "mooncake.json file itself",
                   c.origin);
  }
  if (S_ISREG(sb.st_mode) && (size_t)sb.st_size > CFG_FILE_MAX) {
    close(fd);
    return cfg_err(err, MC_ECONFIG,
                   "%s: config file is %lld bytes; at most %zu are accepted (is "
                   "this really mooncake.json?)",
                   c.origin, (long long)sb.st_size, CFG_FILE_MAX);
  }
  /* Read to EOF rather than trusting st_size: pipes and /proc files lie. */
  size_t cap = S_ISREG(sb.st_mode) ? (size_t)sb.st_size + 1 : 4096, n = 0;
  char *buf = malloc(cap);
  int rc = 0;
  if (!buf) {
    close(fd);
    return cfg_err(err, MC_ENOMEM, "%s: out of memory reading config", c.origin);
  }
  for (;;) {
    if (n == cap) {
      if (cap > CFG_FILE_MAX) {
        rc = cfg_err(err, MC_ECONFIG,
                     "%s: config file is over %zu bytes; refused (is this really "
                     "mooncake.json?)",
                     c.origin, CFG_FILE_MAX);
        goto out;
      }
      size_t ncap = cap * 2 > CFG_FILE_MAX + 1 ? CFG_FILE_MAX + 1 : cap * 2;
      char *nb = realloc(buf, ncap);
      if (!nb) {
        rc = cfg_err(err, MC_ENOMEM, "%s: out of memory reading config", c.origin);
        goto out;
      }
      buf = nb;
      cap = ncap;
    }
    ssize_t r = read(fd, buf + n, cap - n);
    if (r < 0) {
      if (errno == EINTR)
        continue;
      rc = cfg_sys(err, MC_ECONFIG, errno, "%s: cannot read config file", c.origin);
      goto out;
    }
    if (r == 0)
      break;
    n += (size_t)r;
  }
  rc = mc_config_parse(buf, n, path, out, err);
out:
  free(buf);
  close(fd);
  return rc;
}

const char *mc_meta_kind_name(mc_meta_kind_t k) {
  switch (k) {
  case MC_META_P2P:
    return "p2p";
  case MC_META_ETCD:
    return "etcd";
  case MC_META_REDIS:
    return "redis";
  case MC_META_HTTP:
    return "http";
  }
  return "unknown";
}

const char *mc_protocol_name(mc_protocol_t p) {
  switch (p) {
  case MC_PROTO_TCP:
    return "tcp";
  case MC_PROTO_RDMA:
    return "rdma";
  }
  return "unknown";
}
