#include "util/hostport.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int valid_host_char(char c, int v6) {
  if (isalnum((unsigned char)c) || c == '-' || c == '.' || c == '_')
    return 1;
  return v6 && (c == ':' || c == '%');
}

int mc_hostport_parse(const char *s, mc_hostport_t *out, mc_err_t *err) {
  if (!s || !*s)
    return mc_err_set(err, MC_EINVAL, "empty address; expected \"host:port\"");
  const char *host = s, *host_end, *colon = NULL;
  int v6 = 0;
  if (*s == '[') {
    v6 = 1;
    host = s + 1;
    host_end = strchr(host, ']');
    if (!host_end)
      return mc_err_set(err, MC_EINVAL,
                        "address \"%s\" has '[' without ']'; expected \"[ipv6]:port\"", s);
    if (host_end[1] == ':')
      colon = host_end + 1;
    else if (host_end[1] != '\0')
      return mc_err_set(err, MC_EINVAL,
                        "unexpected text after ']' in address \"%s\"", s);
  } else {
    colon = strchr(s, ':');
    if (colon && strchr(colon + 1, ':'))
      return mc_err_set(err, MC_EINVAL,
                        "address \"%s\" has several ':'; write IPv6 as \"[addr]:port\"", s);
    host_end = colon ? colon : s + strlen(s);
  }
  size_t hlen = (size_t)(host_end - host);
  if (hlen == 0)
    return mc_err_set(err, MC_EINVAL, "address \"%s\" has an empty host; expected \"host:port\"", s);
  if (hlen >= MC_HOST_MAX)
    return mc_err_set(err, MC_EINVAL, "host in \"%.64s...\" is longer than %d characters", s,
                      MC_HOST_MAX - 1);
  for (size_t i = 0; i < hlen; i++)
    if (!valid_host_char(host[i], v6))
      return mc_err_set(err, MC_EINVAL,
                        "address \"%s\" contains invalid character '%c' in the host", s, host[i]);
  int port = -1;
  if (colon) {
    const char *p = colon + 1;
    if (!*p)
      return mc_err_set(err, MC_EINVAL, "address \"%s\" ends with ':' but has no port", s);
    long v = 0;
    for (; *p; p++) {
      if (!isdigit((unsigned char)*p))
        return mc_err_set(err, MC_EINVAL,
                          "port in \"%s\" is not a number; expected 1..65535", s);
      v = v * 10 + (*p - '0');
      if (v > 65535)
        return mc_err_set(err, MC_EINVAL, "port in \"%s\" is out of range; expected 1..65535", s);
    }
    if (v == 0)
      return mc_err_set(err, MC_EINVAL, "port 0 in \"%s\" is not allowed; expected 1..65535", s);
    port = (int)v;
  }
  memcpy(out->host, host, hlen);
  out->host[hlen] = '\0';
  out->port = port;
  return 0;
}

int mc_hostport_format(const mc_hostport_t *hp, char *buf, size_t len) {
  int v6 = strchr(hp->host, ':') != NULL;
  if (hp->port < 0)
    return snprintf(buf, len, v6 ? "[%s]" : "%s", hp->host);
  return snprintf(buf, len, v6 ? "[%s]:%d" : "%s:%d", hp->host, hp->port);
}
