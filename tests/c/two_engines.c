/* The two-engine set-up of the C engine tests (two_engines.h). */
#include "two_engines.h"

#include <stdio.h>
#include <stdlib.h>

mc_engine_t *A, *B;
uint8_t *abuf, *bbuf;

mc_engine_t *mk(void) {
  mc_engine_opts_t o = {.local_hostname = "127.0.0.1", .metadata_server = "P2PHANDSHAKE",
                        .protocol = "tcp"};
  mc_err_t err = {0};
  mc_engine_t *e = NULL;
  if (mc_engine_create(&o, &e, &err) < 0)
    fprintf(stderr, "create failed: %s\n", err.msg);
  return e;
}

int two_engines_up(size_t bufsz) {
  abuf = malloc(bufsz);
  bbuf = malloc(bufsz);
  A = mk();
  B = mk();
  if (!A || !B || !abuf || !bbuf) {
    fprintf(stderr, "two_engines_up: %s\n", !abuf || !bbuf ? "out of memory" : "no engine");
    return -1;
  }
  mc_err_t err = {0};
  if (mc_engine_register(B, bbuf, bufsz, "cpu", &err) < 0 ||
      mc_engine_register(A, abuf, bufsz, "cpu", &err) < 0) {
    fprintf(stderr, "%s\n", err.msg);
    return -1;
  }
  return 0;
}

void two_engines_down(void) {
  mc_engine_destroy(A);
  mc_engine_destroy(B);
  free(abuf);
  free(bbuf);
  A = B = NULL;
  abuf = bbuf = NULL;
}
