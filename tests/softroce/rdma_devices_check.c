/* Inside the SoftRoCE guest: protocol "rdma" sees the real devices (rxe0,
 * rxe1), refuses a device_name that does not exist with the list of those
 * that do, never falls back to TCP, and starts on devices that exist.
 * Exit 0 when every check holds. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"

static int expect(const char *dev, int code, const char *needle) {
  mc_engine_opts_t o = {.local_hostname = "127.0.0.1", .metadata_server = "P2PHANDSHAKE",
                        .protocol = "rdma", .device_name = dev};
  mc_engine_t *e = NULL;
  mc_err_t err = {0};
  int rc = mc_engine_create(&o, &e, &err);
  char *desc = e ? mc_engine_describe(e) : NULL;
  int ok = rc == code && (code ? strstr(err.msg, needle) != NULL
                               : desc && strstr(desc, needle) != NULL);
  printf("%s device_name \"%s\": %s\n", ok ? "ok  " : "FAIL", dev, code ? err.msg : desc);
  free(desc);
  if (e)
    mc_engine_destroy(e);
  return ok ? 0 : 1;
}

int main(void) {
  int bad = 0;
  bad |= expect("mlx5_9", MC_EINVAL, "devices here: rxe0, rxe1");
  bad |= expect("rxe0,nope", MC_EINVAL, "\"nope\" is not an RDMA device");
  bad |= expect("", MC_EINVAL, "needs device_name");
  bad |= expect("rxe0,rxe1", 0, "\"protocol\":\"rdma\"");
  return bad;
}
