/* send_kv / recv_kv: KV cache moved by token prefix between engines.
 *
 * A producer keeps KV extents in a lookup buffer (lookup/lookup_buffer.h),
 * keyed by token-block hashes.  A consumer asks a producer for the longest
 * prefix of its tokens that the producer holds, naming where each block must
 * land in the consumer's registered memory; the producer WRITEs the matching
 * blocks straight there (push) and then answers with the number of matched
 * tokens.  Requests and answers travel as engine notifications; the data
 * goes through the engine's transports like any other transfer.
 *
 * Threads: the engine's I/O threads only queue incoming requests and hand
 * answers to waiters; `workers` producer threads do the lookups and writes.
 * Every call is thread-safe; recv_kv blocks (the bindings release the GIL).
 */
#ifndef MC_KV_KV_TRANSFER_H
#define MC_KV_KV_TRANSFER_H

#include <stddef.h>
#include <stdint.h>

#include "engine/engine.h"
#include "lookup/lookup_buffer.h"
#include "util/errors.h"

typedef struct mc_kv mc_kv_t;

/* Binds to an engine (becomes its notification handler; other messages are
 * still queued for mc_engine_drain_notifies).  `lb` may be NULL for a pure
 * consumer; with it, this engine also serves recv_kv requests from peers.
 * workers: producer threads (0 = MC_KV_WORKERS or 2). */
int mc_kv_create(mc_engine_t *e, mc_lookup_t *lb, int workers, mc_kv_t **out, mc_err_t *err);
/* Stops the workers, fails waiting recv_kv calls, unbinds from the engine;
 * a call made afterwards fails (MC_ECLOSED).  kv stays valid: callers still
 * inside a call may finish it.  Once per kv (mc_kv_destroy calls it if it
 * has not run), never concurrently with mc_kv_destroy. */
void mc_kv_stop(mc_kv_t *kv);
/* Stops (if not yet) and frees kv: no call on it may be in flight. */
void mc_kv_destroy(mc_kv_t *kv);

/* Asks `producer` for the longest block-aligned prefix of tokens[0..ntok)
 * (width 4 or 8 bytes per id).  dest holds, block-major, `epb` extents for
 * each full block of the query (epb = the producer's extents_per_block);
 * they must lie in memory this engine registered, and each must be exactly
 * as long as the producer's block extent.  Returns the number of matched
 * tokens (0 on a miss) once the bytes have landed, or a negative code:
 * MC_ETIMEDOUT (no answer within timeout_ms), MC_ECONNECT/MC_EPEERCLOSED
 * (producer unreachable), MC_EINVAL (bad arguments or extents), ... */
long mc_kv_recv(mc_kv_t *kv, const char *producer, const void *tokens, size_t ntok, int width,
                const mc_lookup_extent_t *dest, size_t ndest, uint32_t epb, int timeout_ms,
                mc_err_t *err);

/* Same, also pulling hidden states: hidden[b] receives the hidden-state
 * extent stored with matched block b (blocks stored without one are
 * skipped; lengths must match). */
long mc_kv_recv_ex(mc_kv_t *kv, const char *producer, const void *tokens, size_t ntok,
                   int width, const mc_lookup_extent_t *dest, size_t ndest, uint32_t epb,
                   const mc_lookup_extent_t *hidden, size_t nhidden, int timeout_ms,
                   mc_err_t *err);

/* Pull: the consumer READs the blocks itself.  Asks `producer` to lease the
 * longest block-aligned prefix of tokens it holds (the producer pins those
 * blocks and, in consume mode, takes the entry out of its buffer), READs the
 * leased extents into dest (same layout rules as mc_kv_recv), then releases
 * the lease.  Every byte that lands in dest is moved by this engine's own
 * batch, so when the call returns -- hit, miss, error or timeout -- nothing
 * more can be written into dest on behalf of this call (the fence a caller
 * needs before it reuses dest).  The producer keeps the lease for timeout_ms
 * plus a margin, so its blocks cannot be reused while the READ may still
 * run.  Returns matched tokens (0 on a miss) or a negative code. */
/* A pull dest extent whose tag has this bit set reads only part of the
 * producer's extent: `len` bytes from byte (tag & ~MC_KV_DEST_SLICE) of it
 * (a consumer with more tensor-parallel ranks than the producer takes its
 * share of the KV heads); length 0 skips the extent (a sliding-window
 * block outside the window).  Without the bit, dest and producer extents
 * must be the same length. */
#define MC_KV_DEST_SLICE (1ull << 63)
long mc_kv_pull(mc_kv_t *kv, const char *producer, const void *tokens, size_t ntok, int width,
                const mc_lookup_extent_t *dest, size_t ndest, uint32_t epb, int timeout_ms,
                mc_err_t *err);
/* Same; the first `skip` blocks are the consumer's already (matching still
 * starts at block 0 and the result counts them), dest holds extents for the
 * blocks from `skip` on. */
long mc_kv_pull_ex(mc_kv_t *kv, const char *producer, const void *tokens, size_t ntok,
                   int width, uint32_t skip, const mc_lookup_extent_t *dest, size_t ndest,
                   uint32_t epb, int timeout_ms, mc_err_t *err);

/* Asynchronous mc_kv_pull_ex: copies the arguments, runs the pull on one of
 * the engine's pull threads (a pool of up to `workers`, separate from the
 * threads serving peers) and returns at once with an id.  mc_kv_pull_poll
 * returns 0 while it runs; once done it returns 1 with *result (matched
 * tokens or a negative code, err set) and *seconds, and forgets the id.
 * Pulls start oldest first; timeout_ms counts from this call, time queued
 * behind busy pull threads included (one that never got a thread in time
 * fails with MC_ETIMEDOUT saying so). */
int mc_kv_pull_start(mc_kv_t *kv, const char *producer, const void *tokens, size_t ntok,
                     int width, uint32_t skip, const mc_lookup_extent_t *dest, size_t ndest,
                     uint32_t epb, int timeout_ms, uint64_t *id, mc_err_t *err);
int mc_kv_pull_poll(mc_kv_t *kv, uint64_t id, long *result, double *seconds, mc_err_t *err);
/* Blocks until every pull in ids[0..n) is done (mc_kv_pull_poll would
 * report it) or timeout_ms passes.  Returns 1 if all are done, 0 on timeout,
 * a negative code for an unknown id. */
int mc_kv_pull_wait(mc_kv_t *kv, const uint64_t *ids, size_t n, int timeout_ms, mc_err_t *err);

/* Probe: how many tokens of the longest block-aligned prefix of tokens does
 * `producer` hold right now?  Nothing is leased, pinned or consumed, so the
 * answer may be stale when the caller acts on it (a later pull decides).
 * epb 0 skips the extents-per-block check.  Returns matched tokens (0 on a
 * miss) or a negative code (MC_ETIMEDOUT, MC_ECONNECT, ...). */
long mc_kv_probe(mc_kv_t *kv, const char *producer, const void *tokens, size_t ntok, int width,
                 uint32_t epb, int timeout_ms, mc_err_t *err);

typedef struct mc_kv_stats {
  uint64_t requests_served, tokens_served, bytes_served, serve_errors;
  uint64_t recvs, recv_hits, recv_tokens, recv_errors;
  uint64_t leases_granted, leases_released, leases_expired;
  uint64_t pulls, pull_hits, pull_tokens, pull_bytes, pull_errors;
  uint64_t probes, probes_served;
  /* budget: queued requests (filled in by mc_kv_get_stats) */
  uint64_t queue_bytes, queue_limit, queue_jobs, queue_refused;
  /* asynchronous pulls started and not yet taken by mc_kv_pull_poll */
  uint64_t pulls_open;
} mc_kv_stats_t;
void mc_kv_get_stats(mc_kv_t *kv, mc_kv_stats_t *out);

#endif
