#include "lookup/token_hash.h"

#include <string.h>
#include <xxhash.h>

int mc_token_hasher_init(mc_token_hasher_t *h, uint32_t block_size, uint64_t seed,
                         mc_err_t *err) {
  if (block_size == 0 || block_size > MC_LOOKUP_MAX_BLOCK)
    return mc_err_set(err, MC_EINVAL, "block_size %u is out of range; use 1..%d tokens",
                      block_size, MC_LOOKUP_MAX_BLOCK);
  h->block_size = block_size;
  h->seed = seed;
#ifdef MC_LOOKUP_WEAK_HASH
  h->weak_bits = (MC_LOOKUP_WEAK_HASH);
#else
  h->weak_bits = 0;
#endif
  return 0;
}

void mc_block_hash_canonical(mc_block_hash_t h, unsigned char out[16]) {
  XXH128_canonical_t c;
  XXH128_hash_t x = {.low64 = h.lo, .high64 = h.hi};
  XXH128_canonicalFromHash(&c, x);
  memcpy(out, c.digest, 16);
}

/* XXH3's mixing primitive: the 128-bit product of a and b, halves xored. */
static inline uint64_t fold64(uint64_t a, uint64_t b) {
  __uint128_t p = (__uint128_t)a * b;
  return (uint64_t)p ^ (uint64_t)(p >> 64);
}

/* Odd constants for the chain mix (the 64-bit primes of xxHash). */
#define K1 0x9E3779B185EBCA87ull
#define K2 0xC2B2AE3D27D4EB4Full
#define K3 0x165667B19E3779F9ull
#define K4 0x27D4EB2F165667C5ull

static inline void put_le32(unsigned char *p, uint32_t v) {
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  memcpy(p, &v, 4);
#else
  p[0] = (unsigned char)v;
  p[1] = (unsigned char)(v >> 8);
  p[2] = (unsigned char)(v >> 16);
  p[3] = (unsigned char)(v >> 24);
#endif
}

long mc_token_hash_blocks(const mc_token_hasher_t *h, const void *tokens, size_t ntok,
                          int width, mc_block_hash_t *out, size_t max_out, uint32_t *canon,
                          mc_err_t *err) {
  if (width != 4 && width != 8)
    return mc_err_set(err, MC_EINVAL, "token ids must be 4 or 8 bytes wide, not %d", width);
  if (h->block_size == 0 || h->block_size > MC_LOOKUP_MAX_BLOCK)
    return mc_err_set(err, MC_EINVAL, "hasher is not initialized (block_size %u)",
                      h->block_size);
  const size_t bs = h->block_size;
  const size_t n = ntok / bs;
  if (n > max_out)
    return mc_err_set(err, MC_EINVAL, "%zu blocks to hash but room for only %zu", n, max_out);
  if (n && !tokens)
    return mc_err_set(err, MC_EINVAL, "tokens is NULL");
  const uint64_t mask = h->weak_bits && h->weak_bits < 64 ? (1ull << h->weak_bits) - 1 : 0;
  unsigned char buf[16 + 4 * MC_LOOKUP_MAX_BLOCK]; /* le32 ids at buf + 16 */
  uint64_t prev_lo = 0, prev_hi = 0;
  const size_t len = 16 + 4 * bs;
  for (size_t b = 0; b < n; b++) {
    const unsigned char *tp = buf + 16;
    if (width == 4) {
      const int32_t *t = (const int32_t *)tokens + b * bs;
      int32_t any = 0;
      for (size_t i = 0; i < bs; i++)
        any |= t[i];
      if (any < 0) {
        for (size_t i = 0; i < bs; i++)
          if (t[i] < 0)
            return mc_err_set(err, MC_EINVAL, "token id %d at index %zu is negative",
                              (int)t[i], b * bs + i);
      }
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
      tp = (unsigned char *)t; /* already le32 and validated: hash in place */
#else
      for (size_t i = 0; i < bs; i++)
        put_le32(buf + 16 + 4 * i, (uint32_t)t[i]);
#endif
    } else {
      const int64_t *t = (const int64_t *)tokens + b * bs;
      uint64_t any = 0;
      for (size_t i = 0; i < bs; i++)
        any |= (uint64_t)t[i];
      if (any >> 32) {
        for (size_t i = 0; i < bs; i++)
          if (t[i] < 0 || t[i] > (int64_t)UINT32_MAX)
            return mc_err_set(err, MC_EINVAL,
                              "token id %lld at index %zu is outside [0, 2^32)",
                              (long long)t[i], b * bs + i);
      }
      for (size_t i = 0; i < bs; i++)
        put_le32(buf + 16 + 4 * i, (uint32_t)t[i]);
    }
    if (canon)
      memcpy(canon + b * bs, tp, 4 * bs);
    XXH128_hash_t g = XXH3_128bits_withSeed(tp, len - 16, h->seed);
    uint64_t lo = fold64(prev_lo ^ g.high64 ^ K1, prev_hi ^ g.low64 ^ K2);
    uint64_t hi = fold64(prev_hi + g.low64 + K3, prev_lo + g.high64 + K4);
    if (mask) {
      lo &= mask;
      hi = 0;
    }
    out[b].lo = prev_lo = lo;
    out[b].hi = prev_hi = hi;
  }
  return (long)n;
}
