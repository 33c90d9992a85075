/* The same-host CPU transport's handshake text (see cma_hello.h). */
#include "transport/cma/cma_hello.h"

#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static uint64_t ns_inode(const char *name) {
  char path[64];
  struct stat st;
  snprintf(path, sizeof path, "/proc/self/ns/%s", name);
  return stat(path, &st) == 0 ? (uint64_t)st.st_ino : 0;
}

void mc_cma_hello_self(mc_cma_hello_t *h) {
  memset(h, 0, sizeof *h);
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  if (f) {
    if (fgets(h->boot, sizeof h->boot, f))
      h->boot[strcspn(h->boot, "\n")] = '\0';
    fclose(f);
  }
  h->pidns = ns_inode("pid");
  h->userns = ns_inode("user");
  h->netns = ns_inode("net");
  h->uid = (uint64_t)geteuid();
  h->pid = (uint64_t)getpid();
}

size_t mc_cma_hello_encode(const mc_cma_hello_t *h, char *buf, size_t cap) {
  int n;
  if (h->off)
    n = snprintf(buf, cap, "off %s", h->why);
  else if (h->has_sock)
    n = snprintf(buf, cap,
                 "cma1 boot=%s pidns=%llu userns=%llu netns=%llu uid=%llu pid=%llu fd=%llu "
                 "addr=%llx token=%llx sock=%llu",
                 h->boot[0] ? h->boot : "-", (unsigned long long)h->pidns,
                 (unsigned long long)h->userns, (unsigned long long)h->netns, (unsigned long long)h->uid,
                 (unsigned long long)h->pid, (unsigned long long)h->fd,
                 (unsigned long long)h->addr, (unsigned long long)h->token,
                 (unsigned long long)h->sock);
  else
    n = snprintf(buf, cap,
                 "cma1 boot=%s pidns=%llu userns=%llu netns=%llu uid=%llu pid=%llu fd=%llu "
                 "addr=%llx token=%llx",
                 h->boot[0] ? h->boot : "-", (unsigned long long)h->pidns,
                 (unsigned long long)h->userns, (unsigned long long)h->netns, (unsigned long long)h->uid,
                 (unsigned long long)h->pid, (unsigned long long)h->fd,
                 (unsigned long long)h->addr, (unsigned long long)h->token);
  return n < 0 ? 0 : (size_t)n >= cap ? cap - 1 : (size_t)n;
}

/* Parses an unsigned number of up to 16 hex or 19 decimal digits. */
static int num(const char *p, size_t n, int hex, uint64_t *out) {
  if (n == 0 || n > (hex ? 16u : 19u))
    return -1;
  uint64_t v = 0;
  for (size_t i = 0; i < n; i++) {
    char c = p[i];
    int d;
    if (c >= '0' && c <= '9')
      d = c - '0';
    else if (hex && c >= 'a' && c <= 'f')
      d = c - 'a' + 10;
    else
      return -1;
    v = v * (hex ? 16u : 10u) + (uint64_t)d;
  }
  *out = v;
  return 0;
}

int mc_cma_hello_parse(const char *s, size_t len, mc_cma_hello_t *out, mc_err_t *err) {
  memset(out, 0, sizeof *out);
  if (len > 1024)
    return mc_err_set(err, MC_EPROTO, "same-host hello: %zu bytes (at most 1024)", len);
  if (len >= 3 && !memcmp(s, "off", 3) && (len == 3 || s[3] == ' ')) {
    out->off = 1;
    size_t n = len > 4 ? len - 4 : 0;
    if (n >= sizeof out->why)
      n = sizeof out->why - 1;
    for (size_t i = 0; i < n; i++) /* printable only: it goes into a log line */
      out->why[i] = s[4 + i] >= 0x20 && s[4 + i] < 0x7f ? s[4 + i] : '?';
    return 0;
  }
  if (len < 5 || memcmp(s, "cma1 ", 5) != 0)
    return mc_err_set(err, MC_EPROTO, "same-host hello: does not start with \"cma1 \"");
  static const char *keys[] = {"boot", "pidns", "userns", "netns", "uid",
                               "pid",  "fd",    "addr",   "token", "sock"};
  uint64_t *dst[] = {NULL,      &out->pidns, &out->userns, &out->netns, &out->uid,
                     &out->pid, &out->fd,    &out->addr,   &out->token, &out->sock};
  const unsigned required = (1u << 9) - 1; /* all but sock (optional) */
  unsigned seen = 0;
  size_t i = 5;
  while (i < len) {
    size_t j = i;
    while (j < len && s[j] != ' ')
      j++;
    const char *eq = memchr(s + i, '=', j - i);
    if (!eq)
      return mc_err_set(err, MC_EPROTO, "same-host hello: field at byte %zu has no '='", i);
    size_t klen = (size_t)(eq - (s + i)), vlen = j - i - klen - 1;
    const char *val = eq + 1;
    size_t k;
    for (k = 0; k < sizeof keys / sizeof *keys; k++)
      if (strlen(keys[k]) == klen && !memcmp(keys[k], s + i, klen))
        break;
    if (k == sizeof keys / sizeof *keys)
      return mc_err_set(err, MC_EPROTO, "same-host hello: unknown field at byte %zu", i);
    if (seen & (1u << k))
      return mc_err_set(err, MC_EPROTO, "same-host hello: field %s given twice", keys[k]);
    seen |= 1u << k;
    if (k == 0) {
      if (vlen == 0 || vlen >= sizeof out->boot)
        return mc_err_set(err, MC_EPROTO, "same-host hello: boot id of %zu bytes", vlen);
      for (size_t q = 0; q < vlen; q++)
        if (val[q] <= 0x20 || val[q] >= 0x7f)
          return mc_err_set(err, MC_EPROTO, "same-host hello: boot id is not printable");
      memcpy(out->boot, val, vlen);
      out->boot[vlen] = '\0';
    } else if (num(val, vlen, k == 7 || k == 8, dst[k]) < 0) {
      return mc_err_set(err, MC_EPROTO, "same-host hello: field %s is not a number", keys[k]);
    }
    i = j + 1;
  }
  if ((seen & required) != required)
    return mc_err_set(err, MC_EPROTO, "same-host hello: fields missing");
  out->has_sock = (seen >> 9) & 1;
  if (out->pid == 0 || out->pid > 0x7fffffff || out->fd > 0x7fffffff || out->sock > 0x7fffffff)
    return mc_err_set(err, MC_EPROTO, "same-host hello: pid or fd out of range");
  return 0;
}
