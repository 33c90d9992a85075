#include "util/hostport.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <unistd.h>
#include <sys/socket.h>

#include "util/env.h"

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

/* P2P handshake: a peer not yet known must accept a connection on its rpc
 * port before a submit to it is accepted (as Mooncake's P2P mode fails the
 * submit, not the later status, for an unknown peer).  One connect, closed
 * at once; bounded by MC_P2P_HANDSHAKE_TIMEOUT_MS (default 2000). */
int mc_hostport_probe(const char *segment, const char *host, int port, mc_err_t *err) {
  int timeout_ms = (int)mc_env_long("MC_P2P_HANDSHAKE_TIMEOUT_MS", 2000, 1, 600000);
  char ports[16];
  snprintf(ports, sizeof ports, "%d", port);
  struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *ai = NULL;
  int gai = getaddrinfo(host, ports, &hints, &ai);
  if (gai)
    return mc_err_set(err, MC_ECONNECT, "P2P handshake with segment %s failed: cannot resolve "
                      "host %s: %s", segment, host, gai_strerror(gai));
  int why = ETIMEDOUT;
  for (struct addrinfo *a = ai; a; a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      why = errno;
      continue;
    }
    int rc = connect(fd, a->ai_addr, a->ai_addrlen);
    if (rc < 0 && errno == EINPROGRESS) {
      struct pollfd p = {.fd = fd, .events = POLLOUT};
      int pr;
      do
        pr = poll(&p, 1, timeout_ms);
      while (pr < 0 && errno == EINTR);
      if (pr == 1) {
        int so = 0;
        socklen_t sl = sizeof so;
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &so, &sl);
        rc = so ? -1 : 0;
        errno = so;
      } else {
        errno = pr == 0 ? ETIMEDOUT : errno;
        rc = -1;
      }
    }
    if (rc < 0)
      why = errno;
    close(fd);
    if (rc == 0) {
      freeaddrinfo(ai);
      return 0;
    }
  }
  freeaddrinfo(ai);
  return mc_err_sys(err, MC_ECONNECT, why, "P2P handshake with segment %s failed: no engine "
                    "accepts connections at %s:%d within %d ms (MC_P2P_HANDSHAKE_TIMEOUT_MS); "
                    "is the peer initialized with that rpc port (get_rpc_port())?",
                    segment, host, port, timeout_ms);
}
