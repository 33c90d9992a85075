/* "host:port" parsing shared by config, engine and metadata clients. */
#ifndef MC_UTIL_HOSTPORT_H
#define MC_UTIL_HOSTPORT_H

#include "util/errors.h"

#define MC_HOST_MAX 256

typedef struct mc_hostport {
  char host[MC_HOST_MAX]; /* without IPv6 brackets */
  int port;               /* 0..65535, or -1 when the input had no port */
} mc_hostport_t;

/* Parses "host", "host:port", "[v6]" or "[v6]:port".  The host must be
 * non-empty and made of hostname/IP characters; the port, when present,
 * must be a decimal number in 1..65535.  Returns 0 or MC_EINVAL with a
 * message that quotes the input. */
int mc_hostport_parse(const char *s, mc_hostport_t *out, mc_err_t *err);

/* Formats back to "host:port" (brackets for IPv6). Returns snprintf's value. */
int mc_hostport_format(const mc_hostport_t *hp, char *buf, size_t len);
/* The P2P handshake's probe: one connect to host:port, closed at once,
 * bounded by MC_P2P_HANDSHAKE_TIMEOUT_MS (default 2000); 0, or
 * MC_ECONNECT with err naming `segment`, the address and the knob. */
int mc_hostport_probe(const char *segment, const char *host, int port, mc_err_t *err);

#endif
