/* Chained 128-bit hashes over fixed-size blocks of token ids.
 *
 * Block i of a token sequence (tokens [i*B, (i+1)*B), B = block_size) hashes
 * in two steps:
 *
 *     G_i = XXH3_128bits_withSeed(le32(t_{iB}) .. le32(t_{iB+B-1}), seed)
 *     H_i = mix(H_{i-1}, G_i),   H_{-1} = (0, 0)
 *
 * with mix(P, G) = (fold(P.lo ^ G.hi ^ K1, P.hi ^ G.lo ^ K2),
 *                   fold(P.hi + G.lo + K3, P.lo + G.hi + K4))
 * where fold(a, b) xors the two halves of the 128-bit product a*b (XXH3's
 * own mixing step) and K1..K4 are fixed odd constants (token_hash.c).  G_i
 * does not depend on the chain, so consecutive blocks hash in parallel in
 * the CPU pipeline; only the cheap mix is sequential.  H_i covers the whole
 * prefix up to the end of block i, and two sides that agree on (block_size,
 * seed) compute the same chain from the same token ids whatever integer
 * width they hold them in.  Token ids must lie in [0, 2^32); a trailing
 * partial block is not hashed.  Matches are always verified against the
 * stored token ids, so a collision can never return another prompt's KV.
 *
 * Test hook: weak_bits (1..63) keeps only that many low bits of every hash
 * (the chain then continues from the weakened value), so tests can force
 * collisions.  Building with -DMC_LOOKUP_WEAK_HASH=N makes N the default.
 * Pure functions, no state: safe from any thread.
 */
#ifndef MC_LOOKUP_TOKEN_HASH_H
#define MC_LOOKUP_TOKEN_HASH_H

#include <stddef.h>
#include <stdint.h>

#include "util/errors.h"

#define MC_LOOKUP_DEFAULT_BLOCK 16
#define MC_LOOKUP_MAX_BLOCK 4096

typedef struct mc_block_hash {
  uint64_t lo, hi; /* XXH128_hash_t's low64/high64 */
} mc_block_hash_t;

typedef struct mc_token_hasher {
  uint32_t block_size; /* tokens per block, 1..MC_LOOKUP_MAX_BLOCK */
  uint64_t seed;       /* agreed by producer and consumer */
  uint32_t weak_bits;  /* 0 = full 128 bits; 1..63 = test-only weakening */
} mc_token_hasher_t;

/* MC_EINVAL (message names the value) for a block size outside
 * 1..MC_LOOKUP_MAX_BLOCK. */
int mc_token_hasher_init(mc_token_hasher_t *h, uint32_t block_size, uint64_t seed,
                         mc_err_t *err);

/* Hashes the full blocks of `ntok` token ids of `width` bytes each (4:
 * int32/uint32, 8: int64/uint64, native byte order) into out[0..n), n =
 * ntok / block_size, which must be <= max_out.  If `canon` is non-NULL it
 * receives the n*block_size token ids as uint32 (for verifying a match).
 * Returns n, or MC_EINVAL naming the first token id outside [0, 2^32). */
long mc_token_hash_blocks(const mc_token_hasher_t *h, const void *tokens, size_t ntok,
                          int width, mc_block_hash_t *out, size_t max_out, uint32_t *canon,
                          mc_err_t *err);

/* 16-byte canonical (big-endian) form of a block hash: the bytes exposed to
 * Python and fed to the next block's hash. */
void mc_block_hash_canonical(mc_block_hash_t h, unsigned char out[16]);

#endif
