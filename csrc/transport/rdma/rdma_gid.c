#include "transport/rdma/rdma_gid.h"

#include <stdio.h>
#include <string.h>

int mc_gid_is_zero(const uint8_t raw[16]) {
  for (int i = 0; i < 16; i++)
    if (raw[i])
      return 0;
  return 1;
}

int mc_gid_is_ipv4(const uint8_t raw[16]) {
  static const uint8_t pfx[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return memcmp(raw, pfx, 12) == 0;
}

void mc_gid_format(const uint8_t raw[16], char out[40]) {
  for (int i = 0; i < 8; i++)
    snprintf(out + 5 * i, 6, "%02x%02x%s", raw[2 * i], raw[2 * i + 1], i < 7 ? ":" : "");
}

int mc_gid_parse(const char *s, uint8_t raw[16]) {
  if (!s || strlen(s) != 39)
    return -1;
  for (int i = 0; i < 8; i++) {
    const char *g = s + 5 * i;
    if (i < 7 && g[4] != ':')
      return -1;
    unsigned v = 0;
    for (int k = 0; k < 4; k++) {
      char c = g[k];
      int d = c >= '0' && c <= '9'   ? c - '0'
              : c >= 'a' && c <= 'f' ? c - 'a' + 10
              : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                     : -1;
      if (d < 0)
        return -1;
      v = v * 16 + (unsigned)d;
    }
    raw[2 * i] = (uint8_t)(v >> 8);
    raw[2 * i + 1] = (uint8_t)v;
  }
  return 0;
}

int mc_gid_choose(const char *dev, const mc_gid_entry_t *t, int n, int override, char *why,
                  size_t whylen, mc_err_t *err) {
  if (override >= 0) {
    if (override >= n || mc_gid_is_zero(t[override].raw))
      return mc_err_set(err, MC_EINVAL,
                        "MC_GID_INDEX=%d: %s has no usable GID at that index (its table has %d "
                        "entries%s); unset MC_GID_INDEX to choose automatically or see "
                        "`show_gids` / /sys/class/infiniband/%s/ports/1/gids",
                        override, dev, n, override < n ? ", that one is all zero" : "", dev);
    snprintf(why, whylen, "MC_GID_INDEX=%d", override);
    return override;
  }
  int best = -1, best_rank = 0;
  for (int i = 0; i < n; i++) {
    if (mc_gid_is_zero(t[i].raw))
      continue;
    int v4 = mc_gid_is_ipv4(t[i].raw);
    int rank = t[i].roce_v2 && v4 ? 4 : t[i].roce_v2 ? 3 : v4 ? 2 : 1;
    if (rank > best_rank) {
      best = i;
      best_rank = rank;
    }
  }
  if (best < 0)
    return mc_err_set(err, MC_ENOTFOUND,
                      "%s has no usable GID (all %d entries are zero): give its network "
                      "interface an IP address and bring it up, or set MC_GID_INDEX",
                      dev, n);
  static const char *const reason[] = {"", "first non-zero GID", "IPv4-mapped GID (RoCE v1)",
                                       "RoCE v2 GID (IPv6)", "RoCE v2 IPv4 GID"};
  snprintf(why, whylen, "%s", reason[best_rank]);
  return best;
}
