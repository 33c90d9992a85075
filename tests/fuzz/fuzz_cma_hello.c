/* The same-host CPU transport's hello (a peer's answer to mc.shm.hello):
 * the parser over arbitrary bytes; what it accepts must encode and parse
 * back to the same fields. */
#include "fuzz_common.h"

#include "transport/cma/cma_hello.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  fuzz_quiet();
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  mc_cma_hello_t h, g;
  mc_err_t err = {0};
  if (mc_cma_hello_parse((const char *)data, size, &h, &err) < 0) {
    if (!err.msg[0])
      abort();
    return 0;
  }
  if (h.off)
    return 0;
  char buf[1100];
  size_t n = mc_cma_hello_encode(&h, buf, sizeof buf);
  if (mc_cma_hello_parse(buf, n, &g, &err) < 0 || memcmp(&h, &g, sizeof h) != 0)
    abort();
  return 0;
}
