/* Segment descriptors fetched from a metadata server or a peer: both
 * decoders over arbitrary bytes. */
#include "fuzz_common.h"

#include "meta/segment_desc.h"

FUZZ_INIT_QUIET()

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  mc_segment_desc_t d;
  mc_err_t err = {0};
  if (mc_segment_desc_decode((const char *)data, size, "seg", &d, &err) < 0 && !err.msg[0])
    abort();
  mc_remote_desc_t r;
  memset(&r, 0, sizeof r);
  err.msg[0] = '\0';
  if (mc_segment_desc_decode_regions((const char *)data, size, &r, &err) < 0) {
    if (!err.msg[0])
      abort();
  } else {
    for (size_t i = 1; i < r.n; i++) /* documented: sorted by address */
      if (r.regions[i - 1].addr > r.regions[i].addr)
        abort();
    mc_remote_desc_free(&r);
  }
  return 0;
}
