/* The same-host CPU path's connection binding (see cma_bind.h). */
#include "transport/cma/cma_bind.h"

#include <dirent.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

/* An address in a comparable form: family, 16 address bytes (IPv4 as
 * v4-mapped IPv6), port. */
typedef struct baddr {
  unsigned char a[16];
  unsigned port;
} baddr_t;

static int norm(const struct sockaddr_storage *ss, baddr_t *out) {
  memset(out, 0, sizeof *out);
  if (ss->ss_family == AF_INET) {
    const struct sockaddr_in *s4 = (const void *)ss;
    out->a[10] = out->a[11] = 0xff;
    memcpy(out->a + 12, &s4->sin_addr, 4);
    out->port = ntohs(s4->sin_port);
    return 0;
  }
  if (ss->ss_family == AF_INET6) {
    const struct sockaddr_in6 *s6 = (const void *)ss;
    memcpy(out->a, &s6->sin6_addr, 16);
    out->port = ntohs(s6->sin6_port);
    return 0;
  }
  return -1;
}

static int same(const baddr_t *x, const baddr_t *y) {
  return x->port == y->port && !memcmp(x->a, y->a, 16);
}

static int ends(int fd, baddr_t *local, baddr_t *remote) {
  struct sockaddr_storage l, r;
  socklen_t ll = sizeof l, rl = sizeof r;
  if (getsockname(fd, (struct sockaddr *)&l, &ll) < 0 ||
      getpeername(fd, (struct sockaddr *)&r, &rl) < 0)
    return -1;
  return norm(&l, local) == 0 && norm(&r, remote) == 0 ? 0 : -1;
}

/* Does this process hold a socket whose ends are (local, remote)? */
static int ours(const baddr_t *local, const baddr_t *remote) {
  DIR *d = opendir("/proc/self/fd");
  if (!d)
    return 0;
  int found = 0;
  struct dirent *de;
  while (!found && (de = readdir(d))) {
    char *end;
    long fd = strtol(de->d_name, &end, 10);
    if (*end || end == de->d_name || fd == dirfd(d))
      continue;
    struct stat st;
    baddr_t l, r;
    if (fstat((int)fd, &st) == 0 && S_ISSOCK(st.st_mode) && ends((int)fd, &l, &r) == 0)
      found = same(&l, local) && same(&r, remote);
  }
  closedir(d);
  return found;
}

/* Is `a` the address of host:port (host resolved as the TCP transport does)? */
static int dialled(const baddr_t *a, const char *host, int port) {
  if ((int)a->port != port)
    return 0;
  struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *res = NULL;
  if (getaddrinfo(host, NULL, &hints, &res) != 0)
    return 0;
  int ok = 0;
  for (struct addrinfo *ai = res; ai && !ok; ai = ai->ai_next) {
    struct sockaddr_storage ss;
    baddr_t b;
    if (ai->ai_addrlen > sizeof ss)
      continue;
    memset(&ss, 0, sizeof ss);
    memcpy(&ss, ai->ai_addr, ai->ai_addrlen);
    if (norm(&ss, &b) == 0) {
      b.port = (unsigned)port;
      ok = same(&b, a);
    }
  }
  freeaddrinfo(res);
  return ok;
}

int mc_cma_bind_check(int pidfd, int pid, int sock, const char *host, int port,
                      uint64_t self_netns, char *why, size_t why_len) {
  char path[64];
  struct stat st;
  snprintf(path, sizeof path, "/proc/%d/ns/net", pid);
  if (stat(path, &st) != 0 || (uint64_t)st.st_ino != self_netns) {
    snprintf(why, why_len, "process %d named by the peer's same-host hello is not in this "
             "network namespace", pid);
    return -1;
  }
#ifdef SYS_pidfd_getfd
  int fd = pidfd < 0 || sock < 0 ? -1 : (int)syscall(SYS_pidfd_getfd, pidfd, sock, 0);
#else
  int fd = -1;
  errno = ENOSYS;
#endif
  if (fd < 0) {
    snprintf(why, why_len, "cannot check that process %d is the peer on the connection "
             "(pidfd_getfd of its fd %d: %s)", pid, sock, strerror(errno));
    return -1;
  }
  baddr_t l, r;
  int ok = fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode) && ends(fd, &l, &r) == 0;
  close(fd);
  if (!ok || !dialled(&l, host, port) || !ours(&r, &l)) {
    snprintf(why, why_len, "the peer's same-host hello names process %d, which does not hold "
             "the other end of this engine's connection to %s:%d (a relayed hello?)",
             pid, host, port);
    return -1;
  }
  return 0;
}
