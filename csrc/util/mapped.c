#include "util/mapped.h"
#include "util/bsearch.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct {
  uint64_t lo, hi;
  int rw; /* readable and writable */
} map_t;

struct mc_maps {
  map_t *v;
  size_t n;
};

static char *read_all(const char *path, size_t *len) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return NULL;
  size_t cap = 1 << 16, n = 0;
  char *buf = malloc(cap + 1);
  while (buf) {
    if (n == cap) {
      char *nb = realloc(buf, 2 * cap + 1);
      if (!nb) {
        free(buf);
        buf = NULL;
        break;
      }
      buf = nb;
      cap *= 2;
    }
    ssize_t r = read(fd, buf + n, cap - n);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      break;
    n += (size_t)r;
  }
  close(fd);
  if (buf)
    buf[n] = '\0';
  *len = n;
  return buf;
}

mc_maps_t *mc_maps_load(mc_err_t *err) {
  size_t len = 0;
  char *text = read_all("/proc/self/maps", &len);
  mc_maps_t *m = calloc(1, sizeof *m);
  size_t lines = 0;
  for (size_t i = 0; text && i < len; i++)
    lines += text[i] == '\n';
  if (!text || !m || !(m->v = calloc(lines + 1, sizeof *m->v))) {
    free(text);
    free(m);
    mc_err_set(err, MC_ESYS, "cannot read /proc/self/maps to check a registration");
    return NULL;
  }
  for (char *p = text; p && *p;) {
    char *nl = strchr(p, '\n');
    unsigned long long lo, hi;
    char perms[8];
    if (sscanf(p, "%llx-%llx %7s", &lo, &hi, perms) == 3 && hi > lo)
      m->v[m->n++] = (map_t){lo, hi, perms[0] == 'r' && perms[1] == 'w'};
    p = nl ? nl + 1 : NULL;
  }
  free(text);
  return m;
}

void mc_maps_free(mc_maps_t *m) {
  if (m) {
    free(m->v);
    free(m);
  }
}

int mc_maps_check(const mc_maps_t *m, uint64_t addr, uint64_t len, mc_err_t *err) {
  uint64_t end = addr + len, at = addr;
  /* Binary search for the last mapping starting at or below addr (the file
   * lists mappings in address order). */
#define MAP_LO(i) m->v[i].lo
  size_t lo = MC_COUNT_LE(m->n, MAP_LO, addr);
#undef MAP_LO
  for (size_t i = lo ? lo - 1 : 0; i < m->n && at < end; i++) {
    if (m->v[i].hi <= at)
      continue;
    if (m->v[i].lo > at)
      break; /* a hole at `at` */
    if (!m->v[i].rw)
      return mc_err_set(err, MC_EINVAL,
                        "memory [0x%llx, +%llu) is not writable at 0x%llx (mapped without "
                        "read-write access); peers WRITE into registered memory, so register "
                        "only writable memory",
                        (unsigned long long)addr, (unsigned long long)len,
                        (unsigned long long)at);
    at = m->v[i].hi;
  }
  if (at < end)
    return mc_err_set(err, MC_EINVAL,
                      "memory [0x%llx, +%llu) is not mapped at 0x%llx; register memory this "
                      "process allocated (a wrong address or length?)",
                      (unsigned long long)addr, (unsigned long long)len, (unsigned long long)at);
  return 0;
}
