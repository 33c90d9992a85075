/* mooncake.json: mc_config_parse over arbitrary text (exactly `size` bytes,
 * no NUL after them, as a file read would give). */
#include "fuzz_common.h"

#include "config/config.h"

FUZZ_INIT_QUIET()

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  mc_config_t cfg;
  mc_err_t err = {0};
  int rc = mc_config_parse((const char *)data, size, "<fuzz>", &cfg, &err);
  if (rc < 0 && !err.msg[0])
    abort(); /* every refusal must say why */
  return 0;
}
