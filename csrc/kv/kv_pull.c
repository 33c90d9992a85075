/* The pull protocol of send_kv/recv_kv; see mc_kv_pull in kv_transfer.h.
 *
 * Lease request (KVPQ, consumer -> producer): token ids, lease ms, skip.
 *   Matching always starts at block 0; only blocks from `skip` on are leased.
 *   Lease ms 0 asks for a probe: the answer carries the matched tokens, no
 *   lease and no extents, and nothing is pinned or consumed (extents per
 *   block 0 = not checked).
 * Answer (KVPP): matched tokens (from block 0), lease id (0 = none), the
 *   leased blocks' extents (the producer's registered memory), or an error.
 * Release (KVPR): the lease id.  Only the consumer that got the lease can
 *   release it.
 * The wire format is kv_msg.[ch] (docs/protocol.md). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv/kv_internal.h"
#include "util/clock.h"
#include "util/log.h"

#define LEASE_MARGIN_MS 5000u   /* producer keeps a lease this much past the consumer's timeout */
#define LEASE_MAX_MS 600000u    /* and never longer than this */

/* ---- producer ---- */

/* The leased blocks of a match, from block `skip` on (kv_msg_lease_ans_t.block). */
typedef struct leased {
  const mc_lookup_match_t *match;
  size_t skip;
} leased_t;

static const mc_lookup_extent_t *leased_block(const void *ctx, size_t b) {
  const leased_t *l = ctx;
  return mc_lookup_match_kv(l->match, l->skip + b);
}

static void send_lease_answer(mc_kv_t *kv, const char *to, uint64_t id, int status,
                              uint32_t matched, uint64_t lease_id, const mc_lookup_match_t *match,
                              size_t skip, size_t nb, uint32_t epb, const char *text) {
  leased_t l = {.match = match, .skip = skip};
  kv_msg_lease_ans_t a = {.id = id, .lease_id = lease_id, .status = status, .matched = matched,
                          .nb = (uint32_t)nb, .epb = epb, .block = leased_block, .ctx = &l,
                          .text = text, .text_len = text ? strlen(text) : 0};
  size_t len = (size_t)kv_msg_lease_ans_size(&a); /* nb was capped to MC_ENGINE_MAX_MSG */
  uint8_t *buf = malloc(len);
  if (!buf) {
    mc_log_error("out of memory answering a KV lease request from %s", to);
    return;
  }
  /* Detached: the worker does not wait for the receipt (a consumer that is
   * slow to take it would hold the worker, and every probe queued behind it,
   * for up to 10 s); a lease not taken ends at its own deadline. */
  mc_err_t err = {0};
  if (kv_msg_lease_ans_encode(&a, buf, len, &err) < 0 ||
      mc_engine_notify_detached(kv->e, to, buf, len, 10000, "KV lease answer", &err) < 0)
    mc_log_warn_rated("KV lease answer to %s (request %llu) not delivered: %s", to,
                (unsigned long long)id, err.msg);
  free(buf);
}

void kv_pull_serve(mc_kv_t *kv, kv_job_t *j) {
  uint64_t id = kv_msg_peek_id(j->msg, j->len); /* a malformed request is answered too */
  mc_err_t err = {0};
  long rc = 0;
  mc_lookup_match_t *match = NULL;
  uint32_t epb = kv->lb ? mc_lookup_extents_per_block(kv->lb) : 0;
  kv_msg_lease_req_t q;
  rc = kv_msg_lease_req_decode(j->msg, j->len, &q, &err);
  uint32_t lease_ms = q.lease_ms, skip = q.skip, want_epb = q.epb;
  int width = q.width;
  uint64_t ntok = q.ntok;
  if (rc == 0) {
    if (!kv->lb)
      rc = mc_err_set(&err, MC_EINVAL, "segment %s holds no KV (it is not a producer: no "
                      "lookup buffer)", mc_engine_segment_name(kv->e));
    else if (want_epb != epb && (lease_ms || want_epb))
      rc = mc_err_set(&err, MC_EINVAL, "the consumer expects %u extents per block; producer %s "
                      "stores %u (do both sides run the same model and parallel layout?)",
                      want_epb, mc_engine_segment_name(kv->e), epb);
    else if (lease_ms == 0)
      rc = mc_lookup_count(kv->lb, q.tokens, (size_t)ntok, width, &err);
    else
      rc = mc_lookup_find(kv->lb, q.tokens, (size_t)ntok, width, &match, &err);
  }
  if (lease_ms == 0 && q.hdr_ok) {
    pthread_mutex_lock(&kv->mu);
    kv->stats.probes_served++;
    if (rc < 0)
      kv->stats.serve_errors++;
    pthread_mutex_unlock(&kv->mu);
    send_lease_answer(kv, j->from, id, rc < 0 ? (int)rc : 0, rc > 0 ? (uint32_t)rc : 0, 0, NULL,
                      0, 0, epb, err.msg);
    return;
  }
  size_t total = rc > 0 ? mc_lookup_match_blocks(match) : 0;
  size_t nb = total > skip ? total - skip : 0; /* blocks to lease */
  size_t most = kv_msg_lease_ans_max_blocks(epb, MC_ENGINE_MAX_MSG);
  if (nb > most) {
    /* Answer with as many blocks as one message holds; the rest is a miss. */
    nb = most;
    rc = (long)((skip + nb) * mc_lookup_hasher(kv->lb)->block_size);
  }
  uint64_t lease_id = 0;
  if (rc > 0 && nb == 0) { /* nothing past the consumer's own blocks: no lease */
    mc_lookup_release(kv->lb, match);
    match = NULL;
  } else if (rc > 0) {
    kv_lease_t *l = calloc(1, sizeof *l);
    if (!l) {
      mc_lookup_release(kv->lb, match);
      match = NULL;
      rc = mc_err_set(&err, MC_ENOMEM, "out of memory leasing KV blocks");
    } else {
      uint64_t ms = (uint64_t)lease_ms + LEASE_MARGIN_MS;
      if (ms > LEASE_MAX_MS)
        ms = LEASE_MAX_MS;
      snprintf(l->from, sizeof l->from, "%s", j->from);
      l->match = match;
      l->deadline_ns = mc_now_ns() + ms * 1000000ull;
      pthread_mutex_lock(&kv->mu);
      l->id = lease_id = ++kv->next_lease;
      l->next = kv->leases;
      kv->leases = l;
      kv->stats.leases_granted++;
      kv->stats.requests_served++;
      kv->stats.tokens_served += (uint64_t)rc;
      pthread_cond_broadcast(&kv->job_cv); /* a new deadline for the sleeping workers */
      pthread_mutex_unlock(&kv->mu);
    }
  } else if (rc < 0) {
    pthread_mutex_lock(&kv->mu);
    kv->stats.serve_errors++;
    pthread_mutex_unlock(&kv->mu);
  }
  /* The lease holds the pin; the answer only reads the match's extents, which
   * stay valid until the lease ends (release or expiry, both after this). */
  send_lease_answer(kv, j->from, id, rc < 0 ? (int)rc : 0, rc > 0 ? (uint32_t)rc : 0, lease_id,
                    match, skip, nb, epb, err.msg);
}

uint64_t kv_pull_expire_locked(mc_kv_t *kv, uint64_t now_ns, const char *only_from, int all) {
  uint64_t next = 0;
  for (kv_lease_t **pp = &kv->leases; *pp;) {
    kv_lease_t *l = *pp;
    int drop = all || (only_from ? !strcmp(l->from, only_from) : now_ns >= l->deadline_ns);
    if (drop) {
      *pp = l->next;
      if (!all)
        mc_log_warn("KV lease %llu of %s ended without a release (%s); its blocks are free "
                    "again", (unsigned long long)l->id, l->from,
                    only_from ? "the consumer's connection was lost" : "deadline passed");
      kv->stats.leases_expired++;
      mc_lookup_release(kv->lb, l->match);
      free(l);
      continue;
    }
    if (!next || l->deadline_ns < next)
      next = l->deadline_ns;
    pp = &l->next;
  }
  return next;
}

void kv_pull_on_release(mc_kv_t *kv, const char *from, const uint8_t *m, size_t len) {
  uint64_t id;
  mc_err_t err = {0};
  if (kv_msg_release_decode(m, len, &id, &err) < 0) {
    mc_log_warn_rated("%s from %s: dropped", err.msg, from); /* a peer repeats these at will */
    return;
  }
  kv_lease_t *found = NULL;
  pthread_mutex_lock(&kv->mu);
  for (kv_lease_t **pp = &kv->leases; *pp; pp = &(*pp)->next) {
    if ((*pp)->id == id && !strcmp((*pp)->from, from)) {
      found = *pp;
      *pp = found->next;
      kv->stats.leases_released++;
      break;
    }
  }
  pthread_mutex_unlock(&kv->mu);
  if (found) {
    mc_lookup_release(kv->lb, found->match);
    free(found);
  } else {
    mc_log_debug("KV lease release %llu from %s: no such lease (expired?)",
                 (unsigned long long)id, from);
  }
}

/* ---- consumer ---- */

void kv_pull_on_answer(mc_kv_t *kv, const char *from, const uint8_t *m, size_t len) {
  kv_msg_lease_ans_t a;
  mc_err_t err = {0};
  int bad = kv_msg_lease_ans_decode(m, len, &a, &err) < 0;
  if (!a.hdr_ok) { /* no id to answer to */
    mc_log_warn_rated("%s from %s: dropped", err.msg, from); /* a peer repeats these at will */
    return;
  }
  size_t nx = bad ? 0 : (size_t)a.nb * a.epb;
  pthread_mutex_lock(&kv->mu);
  kv_waiter_t *w = kv_waiter_find_locked(kv, a.id, from);
  if (w) {
    w->done = 1;
    w->lease_id = a.lease_id; /* released even when the answer is bad */
    if (bad) {
      w->status = MC_EPROTO;
      snprintf(w->msg, sizeof w->msg, "%s", err.msg);
    } else if (a.status < 0) {
      w->status = a.status;
      kv_waiter_set_text(w, a.text, a.text_len);
    } else {
      w->status = 0;
      w->matched = a.matched;
      w->nblocks = a.nb;
      w->epb = a.epb;
      if (nx && !(w->extents = malloc(nx * KV_EXT_LEN))) {
        w->status = MC_ENOMEM;
        snprintf(w->msg, sizeof w->msg, "out of memory");
      } else if (nx) {
        memcpy(w->extents, a.ext, nx * KV_EXT_LEN); /* kv_msg_extent reads them */
      }
    }
    pthread_cond_broadcast(&kv->wait_cv);
  }
  pthread_mutex_unlock(&kv->mu);
}

void kv_pull_send_release(mc_kv_t *kv, const char *producer, const uint8_t *msg, size_t len) {
  mc_err_t err = {0};
  if (mc_engine_notify_detached(kv->e, producer, msg, len, 5000, "KV lease release", &err) < 0)
    mc_log_warn("KV lease %llu: release to %s not delivered (%s); it ends at its deadline",
                (unsigned long long)kv_msg_peek_id(msg, len), producer, err.msg);
}

/* The READ is done: nothing reads the leased blocks any more.  The release
 * goes out from a KV worker thread, so the caller does not wait for its
 * round trip; if it cannot be queued it is sent right here. */
static void send_release(mc_kv_t *kv, const char *producer, uint64_t lease_id) {
  uint8_t buf[KV_PREL_LEN];
  kv_msg_release_encode(lease_id, buf, sizeof buf, NULL); /* fits: cannot fail */
  if (kv_queue_job(kv, producer, buf, sizeof buf, NULL) < 0) /* full, no memory, closing */
    kv_pull_send_release(kv, producer, buf, sizeof buf);
}

/* Sends the lease request and waits for the answer; fills w. */
static long ask_lease(mc_kv_t *kv, kv_waiter_t *w, const char *producer, const void *tokens,
                      size_t ntok, int width, uint32_t epb, uint32_t skip, uint32_t lease_ms,
                      int timeout_ms, uint64_t deadline, mc_err_t *err) {
  kv_msg_lease_req_t q = {.id = w->id, .width = (uint8_t)width, .epb = (uint16_t)epb,
                          .lease_ms = lease_ms, .ntok = (uint32_t)ntok, .skip = skip,
                          .tokens = tokens};
  uint64_t len = kv_msg_lease_req_size(&q);
  uint8_t *buf = NULL;
  long rc;
  if (len > MC_ENGINE_MAX_MSG)
    rc = mc_err_set(err, MC_ETOOBIG, "recv_kv (pull) request of %zu tokens exceeds %u bytes; "
                    "split the prompt", ntok, MC_ENGINE_MAX_MSG);
  else if (!(buf = malloc((size_t)len)))
    rc = mc_err_set(err, MC_ENOMEM, "out of memory");
  else
    rc = kv_msg_lease_req_encode(&q, buf, (size_t)len, err);
  if (rc < 0) { /* never sent: w leaves the waiter list here (the caller frees it) */
    free(buf);
    pthread_mutex_lock(&kv->mu);
    kv_waiter_unlink_locked(kv, w);
    pthread_cond_broadcast(&kv->wait_cv);
    pthread_mutex_unlock(&kv->mu);
    return rc;
  }
  rc = kv_ask_locked(kv, w, producer, buf, (size_t)len, timeout_ms, deadline,
                     lease_ms ? "recv_kv (pull)" : "KV probe", err);
  free(buf);
  pthread_mutex_unlock(&kv->mu);
  return rc;
}

/* READs the leased extents into dest; returns bytes moved or a negative code. */
static long read_leased(mc_kv_t *kv, const char *producer, const kv_waiter_t *w,
                        const mc_lookup_extent_t *dest, size_t nb, uint32_t epb,
                        uint64_t deadline, mc_err_t *err) {
  size_t n = nb * epb;
  mc_request_t *reqs = calloc(n ? n : 1, sizeof *reqs);
  if (!reqs)
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  uint64_t bytes = 0;
  size_t m = 0; /* requests built: slices of length 0 are skipped */
  for (size_t i = 0; i < n; i++) {
    kv_ext_t s = kv_msg_extent(w->extents, i);
    uint64_t saddr = s.addr, slen = s.len;
    uint64_t off = 0, dlen = dest[i].len;
    int slice = (dest[i].tag & MC_KV_DEST_SLICE) != 0;
    if (slice)
      off = dest[i].tag & ~MC_KV_DEST_SLICE;
    if (slice && dlen == 0)
      continue;
    if (slice ? (off > slen || dlen > slen - off) : slen != dlen) {
      free(reqs);
      return mc_err_set(err, MC_EINVAL, "destination extent %zu is %llu bytes (at offset %llu) "
                        "but producer %s's KV block extent is %llu bytes (same model, dtype, "
                        "block size and tensor-parallel layout on both sides?)", i,
                        (unsigned long long)dlen, (unsigned long long)off, producer,
                        (unsigned long long)slen);
    }
    reqs[m++] = (mc_request_t){.opcode = MC_OP_READ, .local = (void *)(uintptr_t)dest[i].addr,
                               .remote = saddr + off, .len = dlen};
    bytes += dlen;
  }
  if (m == 0) {
    free(reqs);
    return 0;
  }
  mc_batch_t *batch = mc_batch_new(kv->e, m);
  if (!batch) {
    free(reqs);
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  }
  int r = mc_batch_submit(kv->e, batch, producer, reqs, m, err);
  if (r == 0) {
    uint64_t now = mc_now_ns();
    int64_t left = deadline > now ? (int64_t)((deadline - now) / 1000000ull) : 0;
    r = mc_batch_wait(kv->e, batch, left > 0 ? left : 1, err); /* cancels on timeout */
  }
  mc_batch_free(kv->e, batch);
  free(reqs);
  return r < 0 ? r : (long)bytes;
}

long mc_kv_pull(mc_kv_t *kv, const char *producer, const void *tokens, size_t ntok, int width,
                const mc_lookup_extent_t *dest, size_t ndest, uint32_t epb, int timeout_ms,
                mc_err_t *err) {
  return mc_kv_pull_ex(kv, producer, tokens, ntok, width, 0, dest, ndest, epb, timeout_ms, err);
}

long mc_kv_pull_ex(mc_kv_t *kv, const char *producer, const void *tokens, size_t ntok,
                   int width, uint32_t skip, const mc_lookup_extent_t *dest, size_t ndest,
                   uint32_t epb, int timeout_ms, mc_err_t *err) {
  int bad = kv_recv_check_args(producer, width, epb, ntok, ndest, 0, err);
  if (bad < 0)
    return bad;
  if (timeout_ms <= 0)
    timeout_ms = 30000;
  uint64_t deadline = mc_now_ns() + (uint64_t)timeout_ms * 1000000ull;
  kv_waiter_t *w;
  int wr = kv_waiter_add(kv, producer, &kv->stats.pulls, "recv_kv", &w, err);
  if (wr < 0)
    return wr;

  long rc = ask_lease(kv, w, producer, tokens, ntok, width, epb, skip, (uint32_t)timeout_ms,
                      timeout_ms, deadline, err);
  uint64_t bytes = 0;
  if (rc > 0) {
    if (w->epb != epb) {
      rc = mc_err_set(err, MC_EPROTO, "recv_kv (pull) from %s: answer has %u extents per block, "
                      "asked for %u", producer, w->epb, epb);
    } else {
      size_t nb = w->nblocks;
      uint32_t bs = (uint32_t)(w->matched / (skip + (uint64_t)nb ? skip + (uint64_t)nb : 1));
      if (nb * epb > ndest) { /* room for fewer blocks */
        nb = ndest / epb;
        rc = (long)((skip + nb) * bs);
      }
      if (nb) {
        long r = read_leased(kv, producer, w, dest, nb, epb, deadline, err);
        if (r < 0)
          rc = r;
        else
          bytes = (uint64_t)r;
      }
    }
  }
  if (w->lease_id)
    send_release(kv, producer, w->lease_id);
  pthread_mutex_lock(&kv->mu);
  if (rc < 0) {
    kv->stats.pull_errors++;
  } else if (rc > 0) {
    kv->stats.pull_hits++;
    kv->stats.pull_tokens += (uint64_t)rc;
    kv->stats.pull_bytes += bytes;
  }
  pthread_mutex_unlock(&kv->mu);
  free(w->extents);
  free(w);
  return rc;
}

long mc_kv_probe(mc_kv_t *kv, const char *producer, const void *tokens, size_t ntok, int width,
                 uint32_t epb, int timeout_ms, mc_err_t *err) {
  if (!producer || !*producer)
    return mc_err_set(err, MC_EINVAL, "KV probe: the producer segment name is empty");
  if (width != 4 && width != 8)
    return mc_err_set(err, MC_EINVAL, "KV probe: token ids must be 4 or 8 bytes wide");
  if (epb > 0xffff || ntok > 0xffffffffu)
    return mc_err_set(err, MC_EINVAL, "KV probe: too many tokens or extents per block");
  if (timeout_ms <= 0)
    timeout_ms = 1000;
  uint64_t deadline = mc_now_ns() + (uint64_t)timeout_ms * 1000000ull;
  kv_waiter_t *w;
  int wr = kv_waiter_add(kv, producer, &kv->stats.probes, "KV probe", &w, err);
  if (wr < 0)
    return wr;
  long rc = ask_lease(kv, w, producer, tokens, ntok, width, epb, 0, 0, timeout_ms, deadline,
                      err);
  if (w->lease_id) /* a producer that leased anyway: give it back */
    send_release(kv, producer, w->lease_id);
  free(w->extents);
  free(w);
  return rc;
}
