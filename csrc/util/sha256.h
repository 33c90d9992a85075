/* SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), self-contained: used by
 * peer authentication (docs/security.md), small enough not to need a crypto
 * library.  Checked against the FIPS and RFC 4231 test vectors
 * (tests/c/test_auth.c). */
#ifndef MC_UTIL_SHA256_H
#define MC_UTIL_SHA256_H

#include <stddef.h>
#include <stdint.h>

#define MC_SHA256_LEN 32

typedef struct mc_sha256 {
  uint32_t h[8];
  uint64_t total; /* bytes hashed */
  uint8_t buf[64];
  size_t nbuf;
} mc_sha256_t;

void mc_sha256_init(mc_sha256_t *s);
void mc_sha256_update(mc_sha256_t *s, const void *data, size_t len);
void mc_sha256_final(mc_sha256_t *s, uint8_t out[MC_SHA256_LEN]);
void mc_sha256(const void *data, size_t len, uint8_t out[MC_SHA256_LEN]);

void mc_hmac_sha256(const void *key, size_t key_len, const void *msg, size_t msg_len,
                    uint8_t out[MC_SHA256_LEN]);

/* Compares n bytes in time independent of where they differ; 1 if equal. */
int mc_ct_equal(const void *a, const void *b, size_t n);

#endif
