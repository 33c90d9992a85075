/* The lookup buffer: KV extents keyed by chains of token-block hashes.
 *
 * An entry is inserted as (token ids, per-block extents).  Its full blocks
 * become nodes of a trie: node i is keyed by the chain hash H_i (token_hash.h)
 * and remembers its parent and its own block of token ids.  Entries that
 * share a block-aligned prefix share those nodes (refcounted: refs = number
 * of entries whose path includes the node).  A hash table keyed by the
 * 128-bit H_i finds node i directly, so a lookup costs O(blocks of the
 * query): hash the query's blocks, then for i = 0.. find a node with key H_i
 * whose parent is the node matched for block i-1 and whose token ids equal
 * the query's.  The first block with no such node ends the match.  Because
 * every matched node is verified (parent identity + token ids), a hash
 * collision can shorten a match but never return another prompt's KV.
 *
 * Values: each block carries `extents_per_block` KV extents (address,
 * length, owner tag) and one optional hidden-states extent (length 0 = none).
 * Extents either point into memory the owner registered (zero copy: the
 * buffer never touches the bytes) or, with MC_LOOKUP_COPY, are copied into a
 * staging allocation the buffer owns and frees with the block.
 *
 * Capacity: the sum of the lengths of the extents of live blocks (including
 * blocks unlinked but still pinned by a match) is kept <= capacity_bytes,
 * and so is their index memory (node, token ids, extents, hash slots: a
 * fixed cost per block, stats index_bytes): whatever the shape of the
 * input, the buffer holds at most twice capacity_bytes.  An insert whose
 * new blocks' index alone exceeds it is refused (MC_ETOOBIG) before
 * anything is built.
 * When an insert does not fit, policy EVICT drops least-recently-used
 * entries (entries still pinned by a match free their bytes only when
 * released); policy BACKPRESSURE waits up to the insert's timeout for room,
 * then fails with MC_EBUSY (no wait) or MC_ETIMEDOUT.  Entries older than
 * ttl_ns since insertion are dropped (checked on every call).
 *
 * Modes: KEEP (a lookup leaves entries in place: prefix reuse) and CONSUME
 * (a lookup that matches >= 1 block removes one entry through the last
 * matched block: the exact entry if one ends there, else one that extends
 * it; its blocks not shared with other entries are unlinked).  Lookups never
 * block.
 *
 * A successful lookup pins the matched blocks: their extents (and staging
 * copies) stay valid until mc_lookup_release(), even if the entry is
 * consumed, evicted or expires meanwhile.
 *
 * Threads: every call is thread-safe; one mutex guards the whole buffer and
 * is never held while hashing or while waiting for room (condvar wait).
 * Freed blocks' extents may be queued (opts.track_freed) for the owner to
 * collect with mc_lookup_take_freed(), so zero-copy owners learn when a
 * KV-cache block is no longer referenced.  Never aborts.
 */
#ifndef MC_LOOKUP_LOOKUP_BUFFER_H
#define MC_LOOKUP_LOOKUP_BUFFER_H

#include <stddef.h>
#include <stdint.h>

#include "lookup/token_hash.h"
#include "util/errors.h"

typedef struct mc_lookup_extent {
  uint64_t addr;
  uint64_t len;
  uint64_t tag; /* owner's handle (e.g. a KV-cache block id); opaque here */
} mc_lookup_extent_t;

enum { MC_LOOKUP_KEEP = 0, MC_LOOKUP_CONSUME = 1 };
enum { MC_LOOKUP_EVICT = 0, MC_LOOKUP_BACKPRESSURE = 1 };
enum { MC_LOOKUP_COPY = 1 }; /* insert flag: copy extents into staging */

typedef uint64_t (*mc_lookup_clock_fn)(void *ctx); /* monotonic ns */

typedef struct mc_lookup_opts {
  uint64_t capacity_bytes;    /* > 0 */
  uint32_t block_size;        /* 0 = MC_LOOKUP_DEFAULT_BLOCK */
  uint64_t seed;
  uint32_t extents_per_block; /* 0 = 1 */
  int mode;                   /* MC_LOOKUP_KEEP / MC_LOOKUP_CONSUME */
  int policy;                 /* MC_LOOKUP_EVICT / MC_LOOKUP_BACKPRESSURE */
  uint64_t ttl_ns;            /* 0 = entries never expire */
  int track_freed;            /* queue tags of freed blocks for take_freed */
  mc_lookup_clock_fn clock;   /* NULL = CLOCK_MONOTONIC (tests inject one) */
  void *clock_ctx;
  uint32_t test_weak_hash_bits; /* test only: see token_hash.h weak_bits */
} mc_lookup_opts_t;

typedef struct mc_lookup mc_lookup_t;

typedef struct mc_lookup_stats {
  uint64_t capacity_bytes, used_bytes, pinned_bytes;
  uint64_t index_bytes; /* index memory of live blocks (also <= capacity_bytes) */
  uint64_t entries, blocks, pinned_blocks;
  uint64_t inserts, insert_reused_blocks, lookups, hits, misses, matched_blocks;
  uint64_t consumed, evicted, expired, removed, busy, collisions, probes;
} mc_lookup_stats_t;

/* A pinned match: blocks[0..nblocks) of the query.  Read with the accessors
 * below; give back with mc_lookup_release(). */
typedef struct mc_lookup_match mc_lookup_match_t;

int mc_lookup_create(const mc_lookup_opts_t *opts, mc_lookup_t **out, mc_err_t *err);
/* Frees everything.  Outstanding matches must have been released. */
void mc_lookup_destroy(mc_lookup_t *lb);

const mc_token_hasher_t *mc_lookup_hasher(const mc_lookup_t *lb);
/* An extent check every insert applies to its extents (non-empty ones)
 * before storing anything: returns 0, or a negative code with err set.  The
 * KV layer installs one that demands memory registered with its engine. */
typedef int (*mc_lookup_check_fn)(void *arg, uint64_t addr, uint64_t len, mc_err_t *err);
void mc_lookup_set_extent_check(mc_lookup_t *lb, mc_lookup_check_fn fn, void *arg);
uint32_t mc_lookup_extents_per_block(const mc_lookup_t *lb);

/* Inserts the ntok/block_size full blocks of `tokens` (width 4 or 8 bytes).
 * kv: nblocks * extents_per_block extents, block-major; hidden: NULL or
 * nblocks extents.  Blocks already present (same prefix) are shared and
 * their given extents ignored; *reused (optional) gets their count.
 * Re-inserting an existing entry in KEEP mode refreshes it; in CONSUME mode
 * it adds another entry (consumed separately).  timeout_ms: how long
 * BACKPRESSURE may wait for room (0 = fail at once, < 0 = 60 s cap).
 * Returns the number of blocks inserted (>= 1), or MC_EINVAL (no full block,
 * bad token id, bad extent), MC_ETOOBIG (larger than capacity), MC_EBUSY /
 * MC_ETIMEDOUT (no room), MC_ENOMEM. */
long mc_lookup_insert(mc_lookup_t *lb, const void *tokens, size_t ntok, int width,
                      const mc_lookup_extent_t *kv, const mc_lookup_extent_t *hidden, int flags,
                      int timeout_ms, size_t *reused, mc_err_t *err);

/* Longest block-aligned prefix match.  Returns the number of matched tokens
 * (a multiple of block_size; 0 on a miss, *out = NULL) or a negative code.
 * On a hit *out holds the pinned match. */
long mc_lookup_find(mc_lookup_t *lb, const void *tokens, size_t ntok, int width,
                    mc_lookup_match_t **out, mc_err_t *err);

/* How many tokens of the longest block-aligned prefix match are present,
 * without pinning, consuming or touching LRU order (a probe: the answer may
 * be stale by the time the caller acts on it).  Returns matched tokens or a
 * negative code. */
long mc_lookup_count(mc_lookup_t *lb, const void *tokens, size_t ntok, int width,
                     mc_err_t *err);

size_t mc_lookup_match_blocks(const mc_lookup_match_t *m);
/* The extents_per_block KV extents of matched block i. */
const mc_lookup_extent_t *mc_lookup_match_kv(const mc_lookup_match_t *m, size_t i);
/* The hidden-states extent of matched block i (len 0 = none). */
const mc_lookup_extent_t *mc_lookup_match_hidden(const mc_lookup_match_t *m, size_t i);
/* Unpins and frees the match (NULL is fine). */
void mc_lookup_release(mc_lookup_t *lb, mc_lookup_match_t *m);

/* Removes every entry whose full blocks are exactly those of `tokens`.
 * Returns the number removed (0 if none) or a negative code. */
long mc_lookup_remove(mc_lookup_t *lb, const void *tokens, size_t ntok, int width,
                      mc_err_t *err);
/* The same, at most `max` entries (0 = every one): entries of one prompt
 * are interchangeable, so this gives back `max` pulls' worth of them.  Never
 * an entry of a longer prompt through these blocks. */
long mc_lookup_remove_n(mc_lookup_t *lb, const void *tokens, size_t ntok, int width,
                        size_t max, mc_err_t *err);

/* Drops expired entries now (also done by every call); returns how many. */
size_t mc_lookup_expire(mc_lookup_t *lb);

void mc_lookup_get_stats(mc_lookup_t *lb, mc_lookup_stats_t *st);

/* Moves up to `max` freed extents (KV and hidden, of blocks no longer
 * referenced or pinned) into out; returns the count.  Only with track_freed.
 * Every zero-copy extent given to a successful insert is reported exactly
 * once: those of blocks that were already present (ignored by the insert)
 * right away, the others when their block is freed. */
size_t mc_lookup_take_freed(mc_lookup_t *lb, mc_lookup_extent_t *out, size_t max);

/* Blocks until take_freed has something to give or timeout_ms passed (an
 * entry's expiry is noticed then, too).  Returns 1 if freed extents are
 * queued, else 0.  Lets an otherwise idle owner wait for its consumers'
 * releases instead of polling. */
int mc_lookup_wait_freed(mc_lookup_t *lb, int64_t timeout_ms);

#endif
