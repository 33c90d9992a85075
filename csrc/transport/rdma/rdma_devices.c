#include "transport/rdma/rdma_devices.h"

#include <infiniband/verbs.h>
#include <stdio.h>
#include <string.h>

#include "util/dynlib.h"

typedef struct ibv_device **(*get_list_fn)(int *num);
typedef void (*free_list_fn)(struct ibv_device **list);
typedef const char *(*get_name_fn)(struct ibv_device *dev);

int mc_rdma_list_devices(char *buf, size_t len, mc_err_t *err) {
  if (len)
    buf[0] = '\0';
  void *h = mc_dynlib_open(&mc_dynlib_ibverbs, err);
  if (!h)
    return err ? err->code : MC_EUNAVAIL;
  get_list_fn get_list = (get_list_fn)mc_dynlib_sym(h, &mc_dynlib_ibverbs,
                                                    "ibv_get_device_list", err);
  free_list_fn free_list = (free_list_fn)mc_dynlib_sym(h, &mc_dynlib_ibverbs,
                                                       "ibv_free_device_list", err);
  get_name_fn get_name = (get_name_fn)mc_dynlib_sym(h, &mc_dynlib_ibverbs,
                                                    "ibv_get_device_name", err);
  if (!get_list || !free_list || !get_name)
    return err ? err->code : MC_EUNAVAIL;
  int n = 0;
  struct ibv_device **list = get_list(&n);
  size_t pos = 0;
  for (int i = 0; list && i < n; i++) {
    int w = snprintf(buf + pos, pos < len ? len - pos : 0, "%s%s", i ? ", " : "",
                     get_name(list[i]));
    if (w > 0)
      pos += (size_t)w;
  }
  if (list)
    free_list(list);
  return list ? n : 0;
}

int mc_rdma_check_devices(const char *device_name, mc_err_t *err) {
  char have[1024];
  int n = mc_rdma_list_devices(have, sizeof have, err);
  if (n < 0)
    return n;
  if (n == 0)
    return mc_err_set(err, MC_EUNAVAIL,
                      "protocol \"rdma\": no RDMA device on this host (libibverbs lists none); "
                      "check `ibv_devices`, the NIC's kernel driver, and that /dev/infiniband is "
                      "visible (containers); or use protocol \"tcp\" — there is no silent "
                      "fallback");
  if (!device_name || !*device_name)
    return mc_err_set(err, MC_EINVAL,
                      "protocol \"rdma\" needs device_name (comma-separated NICs); devices on "
                      "this host: %s", have);
  /* Each comma-separated name must be one of the listed devices. */
  const char *p = device_name;
  while (*p) {
    const char *end = strchr(p, ',');
    size_t l = end ? (size_t)(end - p) : strlen(p);
    int found = 0;
    for (const char *q = have; *q && !found;) {
      const char *qe = strstr(q, ", ");
      size_t ql = qe ? (size_t)(qe - q) : strlen(q);
      found = ql == l && !strncmp(q, p, l);
      q = qe ? qe + 2 : q + ql;
    }
    if (!found)
      return mc_err_set(err, MC_EINVAL,
                        "device_name \"%.*s\" is not an RDMA device on this host; devices here: "
                        "%s", (int)l, p, have);
    p = end ? end + 1 : p + l;
  }
  return 0;
}
