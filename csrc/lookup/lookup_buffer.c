#include "lookup/lookup_buffer.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/cuda_driver.h"
#include "util/array.h"
#include "util/clock.h"

#define BACKPRESSURE_CAP_MS 60000
#define WAIT_SLICE_NS 50000000ull /* re-check expiry at least this often */

typedef struct lk_node lk_node_t;
typedef struct lk_entry lk_entry_t;

typedef struct lk_link {
  lk_entry_t *prev, *next;
} lk_link_t;

typedef struct lk_list {
  lk_entry_t *head, *tail;
} lk_list_t;

struct lk_entry {
  lk_node_t *leaf;
  uint32_t nblocks;
  uint64_t born_ns;
  lk_link_t lru; /* in lb->lru: head = least recently used */
  lk_link_t age; /* in lb->age: head = oldest insert */
  lk_entry_t *leaf_next; /* other entries ending at leaf */
};

struct lk_node {
  mc_block_hash_t h;
  lk_node_t *parent; /* NULL for block 0, and once unindexed */
  lk_node_t *child, *sib_prev, *sib_next;
  lk_entry_t *entries; /* entries whose last block this is */
  uint32_t refs;       /* entries whose path includes this block */
  uint32_t pins;       /* matches holding it */
  int indexed;         /* in the table and the parent's child list */
  int copied;          /* extents point into `staging` */
  uint64_t bytes;      /* sum of extent lengths (capacity accounting) */
  void *staging;
  mc_lookup_extent_t hidden;
  mc_lookup_extent_t *kv; /* extents_per_block, trailing storage */
  uint32_t *tokens;       /* block_size ids, trailing storage */
};

typedef struct lk_slot {
  uint64_t lo; /* h.lo of node, checked before touching the node */
  lk_node_t *node;
} lk_slot_t;

struct mc_lookup_match {
  size_t n;
  lk_node_t *nodes[];
};

struct mc_lookup {
  pthread_mutex_t mu;
  pthread_cond_t room; /* broadcast whenever bytes are freed */
  mc_token_hasher_t hasher;
  uint32_t epb;
  int mode, policy, track_freed;
  uint64_t capacity, ttl_ns;
  mc_lookup_clock_fn clock;
  void *clock_ctx;

  lk_slot_t *slots; /* linear probing, power-of-two size */
  size_t nslots, nused;
  lk_node_t *roots; /* children of the virtual root (block 0 nodes) */
  lk_list_t lru, age; /* of lk_entry_t, linked through their lru / age links */

  mc_lookup_extent_t *freed;
  size_t nfreed, freed_cap;

  mc_lookup_stats_t st;
  mc_lookup_check_fn check; /* under mu: extents must pass it to be inserted */
  void *check_arg;
};

void mc_lookup_set_extent_check(mc_lookup_t *lb, mc_lookup_check_fn fn, void *arg) {
  pthread_mutex_lock(&lb->mu);
  lb->check = fn;
  lb->check_arg = arg;
  pthread_mutex_unlock(&lb->mu);
}

/* Every non-empty extent passes lb->check (the engine's regions when a
 * KVTransfer serves this buffer)?  Called before anything is built. */
static int check_extents(mc_lookup_t *lb, const mc_lookup_extent_t *x, size_t n,
                         const char *what, mc_err_t *err) {
  pthread_mutex_lock(&lb->mu);
  mc_lookup_check_fn fn = lb->check;
  void *arg = lb->check_arg;
  pthread_mutex_unlock(&lb->mu);
  for (size_t i = 0; fn && x && i < n; i++)
    if (x[i].len && fn(arg, x[i].addr, x[i].len, err) < 0)
      return mc_err_prefix(err, "%s extent %zu", what, i);
  return 0;
}

static uint64_t now_ns(mc_lookup_t *lb) {
  return lb->clock ? lb->clock(lb->clock_ctx) : mc_now_ns();
}

/* ---- hash table (caller holds mu) ---- */

static int table_grow(mc_lookup_t *lb) {
  size_t n = lb->nslots ? lb->nslots * 2 : 1024;
  lk_slot_t *s = calloc(n, sizeof *s);
  if (!s)
    return MC_ENOMEM;
  for (size_t i = 0; i < lb->nslots; i++) {
    if (!lb->slots[i].node)
      continue;
    size_t j = lb->slots[i].lo & (n - 1);
    while (s[j].node)
      j = (j + 1) & (n - 1);
    s[j] = lb->slots[i];
  }
  free(lb->slots);
  lb->slots = s;
  lb->nslots = n;
  return 0;
}

static void table_put(mc_lookup_t *lb, lk_node_t *nd) {
  size_t m = lb->nslots - 1, j = nd->h.lo & m;
  while (lb->slots[j].node)
    j = (j + 1) & m;
  lb->slots[j] = (lk_slot_t){.lo = nd->h.lo, .node = nd};
  lb->nused++;
}

/* Backward-shift deletion keeps probe chains intact without tombstones. */
static void table_del(mc_lookup_t *lb, lk_node_t *nd) {
  size_t m = lb->nslots - 1, j = nd->h.lo & m;
  while (lb->slots[j].node != nd) {
    if (!lb->slots[j].node)
      return; /* not present: nothing to do */
    j = (j + 1) & m;
  }
  size_t hole = j;
  for (size_t k = (hole + 1) & m; lb->slots[k].node; k = (k + 1) & m) {
    size_t home = lb->slots[k].lo & m;
    /* Move k into the hole unless its home lies cyclically in (hole, k]. */
    int stays = hole <= k ? (home > hole && home <= k) : (home > hole || home <= k);
    if (!stays) {
      lb->slots[hole] = lb->slots[k];
      hole = k;
    }
  }
  lb->slots[hole] = (lk_slot_t){0};
  lb->nused--;
}

/* The indexed node for block hash h whose parent is `parent` and whose
 * token ids are `toks`, or NULL. */
static lk_node_t *table_find(mc_lookup_t *lb, mc_block_hash_t h, const lk_node_t *parent,
                             const uint32_t *toks) {
  if (!lb->nslots)
    return NULL;
  size_t m = lb->nslots - 1, bs = lb->hasher.block_size * sizeof(uint32_t);
  for (size_t j = h.lo & m; lb->slots[j].node; j = (j + 1) & m) {
    if (lb->slots[j].lo != h.lo)
      continue;
    lk_node_t *nd = lb->slots[j].node;
    if (nd->h.hi != h.hi)
      continue;
    if (nd->parent == parent && !memcmp(nd->tokens, toks, bs))
      return nd;
    lb->st.collisions++; /* same 128-bit key, different prefix: skip it */
  }
  return NULL;
}

/* ---- nodes and entries (caller holds mu unless noted) ---- */

/* What one block costs in index memory: its node (with its extents and
 * token ids), malloc's header, and two hash slots (the table stays at most
 * half full).  Charged against capacity_bytes next to the KV bytes. */
static uint64_t block_index_bytes(const mc_lookup_t *lb) {
  return sizeof(lk_node_t) + lb->epb * sizeof(mc_lookup_extent_t) +
         (uint64_t)lb->hasher.block_size * sizeof(uint32_t) + 16 + 2 * sizeof(lk_slot_t);
}

/* MC_ETOOBIG if the index of `nb` new blocks alone exceeds the capacity. */
static int index_too_big(const mc_lookup_t *lb, size_t nb, mc_err_t *err) {
  uint64_t need = (uint64_t)nb * block_index_bytes(lb);
  if (need <= lb->capacity)
    return 0;
  return mc_err_set(err, MC_ETOOBIG,
                    "%zu new blocks need %llu bytes of index (%llu a block: token ids, hash "
                    "chain, extents) but the lookup buffer holds only %llu (kv_buffer_size): "
                    "store fewer tokens per call, or use larger blocks or a larger buffer",
                    nb, (unsigned long long)need, (unsigned long long)block_index_bytes(lb),
                    (unsigned long long)lb->capacity);
}

/* Builds an unlinked node; no lock needed.  Copies bytes when `copy`. */
static lk_node_t *node_build(const mc_lookup_t *lb, mc_block_hash_t h, const uint32_t *toks,
                             const mc_lookup_extent_t *kv, const mc_lookup_extent_t *hidden,
                             int copy) {
  size_t bs = lb->hasher.block_size;
  lk_node_t *nd = calloc(1, sizeof *nd + lb->epb * sizeof(mc_lookup_extent_t) +
                                bs * sizeof(uint32_t));
  if (!nd)
    return NULL;
  nd->kv = (mc_lookup_extent_t *)(nd + 1);
  nd->tokens = (uint32_t *)(nd->kv + lb->epb);
  nd->h = h;
  memcpy(nd->tokens, toks, bs * sizeof(uint32_t));
  memcpy(nd->kv, kv, lb->epb * sizeof *kv);
  if (hidden)
    nd->hidden = *hidden;
  for (uint32_t e = 0; e < lb->epb; e++)
    nd->bytes += kv[e].len;
  nd->bytes += nd->hidden.len;
  if (copy && nd->bytes) {
    unsigned char *p = malloc(nd->bytes);
    if (!p) {
      free(nd);
      return NULL;
    }
    nd->staging = p;
    nd->copied = 1;
    for (uint32_t e = 0; e < lb->epb; e++) {
      if (nd->kv[e].len && /* KV extents may be GPU memory */
          mc_cuda_memcpy_any(p, (const void *)(uintptr_t)nd->kv[e].addr, nd->kv[e].len,
                             NULL) < 0) {
        free(nd->staging);
        free(nd);
        return NULL;
      }
      nd->kv[e].addr = (uint64_t)(uintptr_t)p;
      p += nd->kv[e].len;
    }
    if (nd->hidden.len) {
      if (mc_cuda_memcpy_any(p, (const void *)(uintptr_t)nd->hidden.addr, nd->hidden.len,
                             NULL) < 0) {
        free(nd->staging);
        free(nd);
        return NULL;
      }
      nd->hidden.addr = (uint64_t)(uintptr_t)p;
    }
  }
  return nd;
}

static void node_discard(lk_node_t *nd) {
  if (nd) {
    free(nd->staging);
    free(nd);
  }
}

static void queue_freed(mc_lookup_t *lb, const mc_lookup_extent_t *x) {
  mc_lookup_extent_t *v = mc_array_room(lb->freed, lb->nfreed, &lb->freed_cap, sizeof *v, 64);
  if (!v)
    return; /* the owner misses one notification rather than we abort */
  lb->freed = v;
  lb->freed[lb->nfreed++] = *x;
}

/* Frees a node that is neither referenced nor pinned. */
static void node_free(mc_lookup_t *lb, lk_node_t *nd) {
  lb->st.used_bytes -= nd->bytes;
  lb->st.index_bytes -= block_index_bytes(lb);
  if (lb->track_freed && !nd->copied) {
    for (uint32_t e = 0; e < lb->epb; e++)
      queue_freed(lb, &nd->kv[e]);
    if (nd->hidden.len)
      queue_freed(lb, &nd->hidden);
  }
  node_discard(nd);
}

static void node_link(mc_lookup_t *lb, lk_node_t *nd, lk_node_t *parent) {
  nd->parent = parent;
  lk_node_t **head = parent ? &parent->child : &lb->roots;
  nd->sib_prev = NULL;
  nd->sib_next = *head;
  if (*head)
    (*head)->sib_prev = nd;
  *head = nd;
  table_put(lb, nd);
  nd->indexed = 1;
  lb->st.blocks++;
  lb->st.used_bytes += nd->bytes;
  lb->st.index_bytes += block_index_bytes(lb);
}

static void node_unlink(mc_lookup_t *lb, lk_node_t *nd) {
  table_del(lb, nd);
  if (nd->sib_prev)
    nd->sib_prev->sib_next = nd->sib_next;
  else if (nd->parent)
    nd->parent->child = nd->sib_next;
  else
    lb->roots = nd->sib_next;
  if (nd->sib_next)
    nd->sib_next->sib_prev = nd->sib_prev;
  nd->sib_prev = nd->sib_next = NULL;
  nd->parent = NULL;
  nd->indexed = 0;
  lb->st.blocks--;
}

/* Drops one reference from `nd` and its ancestors; unlinks blocks no entry
 * uses any more and frees those no match pins. */
static void path_unref(mc_lookup_t *lb, lk_node_t *nd) {
  int freed = 0;
  while (nd) {
    lk_node_t *parent = nd->parent;
    if (--nd->refs == 0) {
      node_unlink(lb, nd);
      if (nd->pins == 0) {
        node_free(lb, nd);
        freed = 1;
      }
    }
    nd = parent;
  }
  if (freed)
    pthread_cond_broadcast(&lb->room);
}

/* An entry is on two lists at once (LRU order and insert order): each list
 * links entries through its own link field, found at `off` in the entry. */
#define LK_LINK(e, off) ((lk_link_t *)((char *)(e) + (off)))

static void list_unlink(lk_list_t *l, size_t off, lk_entry_t *e) {
  lk_link_t *k = LK_LINK(e, off);
  if (k->prev)
    LK_LINK(k->prev, off)->next = k->next;
  else
    l->head = k->next;
  if (k->next)
    LK_LINK(k->next, off)->prev = k->prev;
  else
    l->tail = k->prev;
  k->prev = k->next = NULL;
}

static void list_push(lk_list_t *l, size_t off, lk_entry_t *e) {
  lk_link_t *k = LK_LINK(e, off);
  k->prev = l->tail;
  k->next = NULL;
  if (l->tail)
    LK_LINK(l->tail, off)->next = e;
  else
    l->head = e;
  l->tail = e;
}

#define lru_unlink(lb, e) list_unlink(&(lb)->lru, offsetof(lk_entry_t, lru), (e))
#define lru_push(lb, e) list_push(&(lb)->lru, offsetof(lk_entry_t, lru), (e))
#define age_unlink(lb, e) list_unlink(&(lb)->age, offsetof(lk_entry_t, age), (e))
#define age_push(lb, e) list_push(&(lb)->age, offsetof(lk_entry_t, age), (e))

static void entry_remove(mc_lookup_t *lb, lk_entry_t *e) {
  lru_unlink(lb, e);
  age_unlink(lb, e);
  lk_entry_t **pp = &e->leaf->entries;
  while (*pp && *pp != e)
    pp = &(*pp)->leaf_next;
  if (*pp)
    *pp = e->leaf_next;
  lb->st.entries--;
  lk_node_t *leaf = e->leaf;
  free(e);
  path_unref(lb, leaf);
}

static size_t expire_locked(mc_lookup_t *lb) {
  if (!lb->ttl_ns)
    return 0;
  uint64_t now = now_ns(lb);
  size_t n = 0;
  while (lb->age.head && now - lb->age.head->born_ns >= lb->ttl_ns) {
    entry_remove(lb, lb->age.head);
    n++;
  }
  lb->st.expired += n;
  return n;
}

/* Some entry whose path includes `nd` (indexed nodes always have one). */
static lk_entry_t *entry_through(lk_node_t *nd) {
  while (nd && !nd->entries)
    nd = nd->child;
  return nd ? nd->entries : NULL;
}

/* ---- public API ---- */

int mc_lookup_create(const mc_lookup_opts_t *o, mc_lookup_t **out, mc_err_t *err) {
  *out = NULL;
  if (!o || o->capacity_bytes == 0)
    return mc_err_set(err, MC_EINVAL, "lookup buffer capacity must be > 0 bytes");
  if (o->mode != MC_LOOKUP_KEEP && o->mode != MC_LOOKUP_CONSUME)
    return mc_err_set(err, MC_EINVAL, "lookup mode %d is not keep (0) or consume (1)", o->mode);
  if (o->policy != MC_LOOKUP_EVICT && o->policy != MC_LOOKUP_BACKPRESSURE)
    return mc_err_set(err, MC_EINVAL, "lookup policy %d is not evict (0) or backpressure (1)",
                      o->policy);
  if (o->extents_per_block > 1024)
    return mc_err_set(err, MC_EINVAL, "extents_per_block %u is out of range; use 1..1024",
                      o->extents_per_block);
  if (o->test_weak_hash_bits > 63)
    return mc_err_set(err, MC_EINVAL, "test_weak_hash_bits %u is out of range; use 0..63",
                      o->test_weak_hash_bits);
  mc_lookup_t *lb = calloc(1, sizeof *lb);
  if (!lb)
    return mc_err_set(err, MC_ENOMEM, "out of memory creating a lookup buffer");
  int rc = mc_token_hasher_init(&lb->hasher, o->block_size ? o->block_size
                                                           : MC_LOOKUP_DEFAULT_BLOCK,
                                o->seed, err);
  if (rc < 0) {
    free(lb);
    return rc;
  }
  if (o->test_weak_hash_bits)
    lb->hasher.weak_bits = o->test_weak_hash_bits;
  lb->epb = o->extents_per_block ? o->extents_per_block : 1;
  lb->mode = o->mode;
  lb->policy = o->policy;
  lb->track_freed = o->track_freed;
  lb->capacity = o->capacity_bytes;
  lb->ttl_ns = o->ttl_ns;
  lb->clock = o->clock;
  lb->clock_ctx = o->clock_ctx;
  lb->st.capacity_bytes = o->capacity_bytes;
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  int bad = pthread_mutex_init(&lb->mu, NULL);
  if (!bad && pthread_cond_init(&lb->room, &ca)) {
    pthread_mutex_destroy(&lb->mu);
    bad = 1;
  }
  pthread_condattr_destroy(&ca);
  if (bad || table_grow(lb) < 0) {
    if (!bad) {
      pthread_cond_destroy(&lb->room);
      pthread_mutex_destroy(&lb->mu);
    }
    free(lb);
    return mc_err_set(err, MC_ENOMEM, "out of memory creating a lookup buffer");
  }
  *out = lb;
  return 0;
}

void mc_lookup_destroy(mc_lookup_t *lb) {
  if (!lb)
    return;
  while (lb->age.head)
    entry_remove(lb, lb->age.head);
  free(lb->slots);
  free(lb->freed);
  pthread_cond_destroy(&lb->room);
  pthread_mutex_destroy(&lb->mu);
  free(lb);
}

const mc_token_hasher_t *mc_lookup_hasher(const mc_lookup_t *lb) { return &lb->hasher; }
uint32_t mc_lookup_extents_per_block(const mc_lookup_t *lb) { return lb->epb; }

/* Hashes a query outside the lock into one allocation: n hashes, then the
 * n*block_size canonical ids.  Returns n (>= 0) or a negative code. */
static long hash_query(const mc_lookup_t *lb, const void *tokens, size_t ntok, int width,
                       mc_block_hash_t **hashes, uint32_t **canon, mc_err_t *err) {
  *hashes = NULL;
  *canon = NULL;
  size_t bs = lb->hasher.block_size, n = ntok / bs;
  if (n == 0)
    return 0;
  mc_block_hash_t *h = malloc(n * sizeof *h + n * bs * sizeof(uint32_t));
  if (!h)
    return mc_err_set(err, MC_ENOMEM, "out of memory hashing %zu tokens", ntok);
  uint32_t *c = (uint32_t *)(h + n);
  long r = mc_token_hash_blocks(&lb->hasher, tokens, ntok, width, h, n, c, err);
  if (r < 0) {
    free(h);
    return r;
  }
  *hashes = h;
  *canon = c;
  return r;
}

/* Walks the indexed prefix of a hashed query; path[i] = node of block i
 * (path NULL: only count). */
static size_t walk(mc_lookup_t *lb, const mc_block_hash_t *h, const uint32_t *canon, size_t n,
                   lk_node_t **path) {
  size_t bs = lb->hasher.block_size, k = 0;
  lk_node_t *prev = NULL;
  for (; k < n; k++) {
    lk_node_t *nd = table_find(lb, h[k], prev, canon + k * bs);
    if (!nd)
      break;
    prev = nd;
    if (path)
      path[k] = nd;
  }
  return k;
}

/* walk over the live index: the expired entries dropped first (lb->mu held). */
static size_t walk_live(mc_lookup_t *lb, const mc_block_hash_t *h, const uint32_t *canon,
                        size_t n, lk_node_t **path) {
  expire_locked(lb);
  return walk(lb, h, canon, n, path);
}

/* An insert found its entry stored (keep mode): it becomes the newest. */
static void refresh_entry(mc_lookup_t *lb, lk_entry_t *e, size_t n) {
  e->born_ns = now_ns(lb);
  lru_unlink(lb, e);
  lru_push(lb, e);
  age_unlink(lb, e);
  age_push(lb, e);
  lb->st.inserts++;
  lb->st.insert_reused_blocks += n;
}

/* Bytes the blocks [k, n) of an insert hold. */
static uint64_t bytes_needed(const mc_lookup_t *lb, const mc_lookup_extent_t *kv,
                             const mc_lookup_extent_t *hidden, size_t k, size_t n) {
  uint64_t need = 0;
  for (size_t i = k; i < n; i++) {
    for (uint32_t e = 0; e < lb->epb; e++)
      need += kv[i * lb->epb + e].len;
    need += hidden ? hidden[i].len : 0;
  }
  return need;
}

/* No room for `need` bytes: MC_EBUSY (evict policy, or no waiting), else
 * waits one slice for room (lb->mu held, released while waiting) and
 * returns 0 to try again, MC_ETIMEDOUT past the deadline (set on the first
 * wait, capped at BACKPRESSURE_CAP_MS). */
static int wait_for_room(mc_lookup_t *lb, uint64_t need, int timeout_ms, uint64_t *deadline,
                         int *waited, mc_err_t *err) {
  size_t pinned = lb->st.pinned_blocks;
  if (lb->policy == MC_LOOKUP_EVICT || timeout_ms == 0) {
    lb->st.busy++;
    return mc_err_set(err, MC_EBUSY,
                    "lookup buffer full: %llu of %llu bytes used (%zu blocks pinned by "
                    "matches in use), %llu more needed",
                    (unsigned long long)lb->st.used_bytes, (unsigned long long)lb->capacity,
                    pinned, (unsigned long long)need);
  }
  uint64_t now = mc_now_ns();
  if (!*waited) {
    int ms = timeout_ms < 0 || timeout_ms > BACKPRESSURE_CAP_MS ? BACKPRESSURE_CAP_MS
                                                                : timeout_ms;
    *deadline = now + (uint64_t)ms * 1000000ull;
    *waited = 1;
  }
  if (now >= *deadline) {
    lb->st.busy++;
    return mc_err_set(err, MC_ETIMEDOUT,
                    "lookup buffer still full after waiting %d ms: %llu of %llu bytes used, "
                    "%llu more needed",
                    timeout_ms, (unsigned long long)lb->st.used_bytes,
                    (unsigned long long)lb->capacity, (unsigned long long)need);
  }
  uint64_t until = *deadline - now > WAIT_SLICE_NS ? now + WAIT_SLICE_NS : *deadline;
  struct timespec ts = mc_deadline_ts(until);
  pthread_cond_timedwait(&lb->room, &lb->mu, &ts);
  return 0;
}

/* An insert's extents: every KV extent non-empty with block 0's layout,
 * none at address 0, all inside registered memory (check_extents). */
static int check_insert_extents(mc_lookup_t *lb, const mc_lookup_extent_t *kv,
                                const mc_lookup_extent_t *hidden, size_t n, mc_err_t *err) {
  for (size_t i = 0; i < n * lb->epb; i++) {
    if (kv[i].len == 0) {
      return mc_err_set(err, MC_EINVAL,
                        "KV extent %zu (block %zu, extent %zu of the block) has length 0: every "
                        "KV extent must hold the block's bytes",
                        i, i / lb->epb, i % lb->epb);
    }
    if (kv[i].len != kv[i % lb->epb].len) { /* the layout: block 0's extent lengths */
      return mc_err_set(err, MC_EINVAL,
                        "KV extent %zu (block %zu, extent %zu of the block) has length %llu but "
                        "extent %zu of block 0 has %llu: every block must have the same layout",
                        i, i / lb->epb, i % lb->epb, (unsigned long long)kv[i].len, i % lb->epb,
                        (unsigned long long)kv[i % lb->epb].len);
    }
    if (kv[i].len && !kv[i].addr) {
      return mc_err_set(err, MC_EINVAL, "KV extent %zu (block %zu) has length %llu at address 0",
                        i, i / lb->epb, (unsigned long long)kv[i].len);
    }
  }
  for (size_t i = 0; hidden && i < n; i++) {
    if (hidden[i].len && !hidden[i].addr) {
      return mc_err_set(err, MC_EINVAL, "hidden extent %zu has length %llu at address 0", i,
                        (unsigned long long)hidden[i].len);
    }
  }
  int crc = check_extents(lb, kv, n * lb->epb, "KV", err);
  if (crc == 0)
    crc = check_extents(lb, hidden, hidden ? n : 0, "hidden", err);
  return crc;
}

/* Stores the entry for blocks [k, n) after the present prefix path[0, k)
 * (held: one ref on path[k-1], dropped on failure): the prebuilt nodes (or
 * built now), linked under their parents.  Room was made.  lb->mu held.
 * Returns n or < 0. */
static long link_entry(mc_lookup_t *lb, lk_node_t **path, lk_node_t **pre, size_t k, size_t n,
                       const mc_block_hash_t *h, const uint32_t *canon,
                       const mc_lookup_extent_t *kv, const mc_lookup_extent_t *hidden, int copy,
                       mc_err_t *err) {
  size_t bs = lb->hasher.block_size;
  lk_node_t *prev = k ? path[k - 1] : NULL;
  if (lb->nused + (n - k) > lb->nslots / 2) {
    size_t want = lb->nused + (n - k);
    while (lb->nslots / 2 < want && table_grow(lb) == 0)
      ;
    if (lb->nslots / 2 < want) {
      if (k)
        path_unref(lb, path[k - 1]);
      return mc_err_set(err, MC_ENOMEM, "out of memory growing the lookup index");
    }
  }
  lk_entry_t *e = calloc(1, sizeof *e);
  if (!e) {
    if (k)
      path_unref(lb, path[k - 1]);
    return mc_err_set(err, MC_ENOMEM, "out of memory inserting an entry");
  }
  for (size_t i = k; i < n; i++) {
    lk_node_t *nd = pre[i];
    pre[i] = NULL;
    if (!nd)
      nd = node_build(lb, h[i], canon + i * bs, kv + i * lb->epb,
                      hidden ? hidden + i : NULL, copy);
    if (!nd) { /* undo: the new blocks so far belong to no entry yet */
      if (prev)
        path_unref(lb, prev);
      free(e);
      return mc_err_set(err, MC_ENOMEM, "out of memory building block %zu of %zu", i, n);
    }
    nd->refs = 1;
    node_link(lb, nd, prev);
    path[i] = prev = nd;
  }
  e->leaf = path[n - 1];
  e->nblocks = (uint32_t)n;
  e->born_ns = now_ns(lb);
  e->leaf_next = e->leaf->entries;
  e->leaf->entries = e;
  lru_push(lb, e);
  age_push(lb, e);
  lb->st.entries++;
  lb->st.inserts++;
  lb->st.insert_reused_blocks += k;
  return (long)n;
}

long mc_lookup_insert(mc_lookup_t *lb, const void *tokens, size_t ntok, int width,
                      const mc_lookup_extent_t *kv, const mc_lookup_extent_t *hidden, int flags,
                      int timeout_ms, size_t *reused, mc_err_t *err) {
  if (reused)
    *reused = 0;
  size_t bs = lb->hasher.block_size;
  if (ntok < bs)
    return mc_err_set(err, MC_EINVAL,
                      "%zu tokens do not fill one block of %zu; nothing to insert", ntok, bs);
  if (!kv)
    return mc_err_set(err, MC_EINVAL, "no KV extents given");
  mc_block_hash_t *h;
  uint32_t *canon;
  long rn = hash_query(lb, tokens, ntok, width, &h, &canon, err);
  if (rn < 0)
    return rn;
  size_t n = (size_t)rn;
  int crc = check_insert_extents(lb, kv, hidden, n, err);
  if (crc < 0) {
    free(h);
    return crc;
  }
  lk_node_t **path = calloc(2 * n, sizeof *path); /* [0,n): path, [n,2n): prebuilt */
  if (!path) {
    free(h);
    return mc_err_set(err, MC_ENOMEM, "out of memory inserting %zu blocks", n);
  }
  lk_node_t **pre = path + n;
  const int copy = (flags & MC_LOOKUP_COPY) != 0;
  size_t nre = 0; /* blocks already present: their given extents are ignored */
  uint64_t deadline = 0;
  int waited = 0;
  long rc = 0;

  /* Build the nodes not yet present outside the lock (allocation, staging
   * copies); blocks that turn out to be present by then are discarded. */
  pthread_mutex_lock(&lb->mu);
  size_t k0 = walk(lb, h, canon, n, path);
  pthread_mutex_unlock(&lb->mu);
  if ((rc = index_too_big(lb, n - k0, err)) < 0) /* before building anything */
    goto out_nolock;
  for (size_t i = k0; i < n; i++) {
    pre[i] = node_build(lb, h[i], canon + i * bs, kv + i * lb->epb, hidden ? hidden + i : NULL,
                        copy);
    if (!pre[i]) {
      rc = mc_err_set(err, MC_ENOMEM, "out of memory building block %zu of %zu", i, n);
      goto out_nolock;
    }
  }

  pthread_mutex_lock(&lb->mu);
  for (;;) {
    size_t k = walk_live(lb, h, canon, n, path);
    if (k == n && lb->mode == MC_LOOKUP_KEEP && path[n - 1]->entries) {
      refresh_entry(lb, path[n - 1]->entries, n); /* already stored */
      nre = n;
      rc = (long)n;
      break;
    }
    uint64_t need = bytes_needed(lb, kv, hidden, k, n);
    uint64_t need_index = (uint64_t)(n - k) * block_index_bytes(lb);
    if ((rc = index_too_big(lb, n - k, err)) < 0)
      break;
    if (need > lb->capacity) {
      rc = mc_err_set(err, MC_ETOOBIG,
                      "entry needs %llu bytes but the lookup buffer holds only %llu "
                      "(kv_buffer_size)",
                      (unsigned long long)need, (unsigned long long)lb->capacity);
      break;
    }
    /* Hold the shared prefix while making room so eviction cannot unlink it. */
    for (size_t i = 0; i < k; i++)
      path[i]->refs++;
    if (lb->policy == MC_LOOKUP_EVICT) {
      while ((lb->st.used_bytes + need > lb->capacity ||
              lb->st.index_bytes + need_index > lb->capacity) && lb->lru.head) {
        entry_remove(lb, lb->lru.head);
        lb->st.evicted++;
      }
    }
    if (lb->st.used_bytes + need <= lb->capacity &&
        lb->st.index_bytes + need_index <= lb->capacity) {
      rc = link_entry(lb, path, pre, k, n, h, canon, kv, hidden, copy, err);
      nre = rc > 0 ? k : 0;
      break;
    }
    /* No room. */
    if (k)
      path_unref(lb, path[k - 1]);
    if ((rc = wait_for_room(lb, need, timeout_ms, &deadline, &waited, err)) < 0)
      break;
  }
  if (rc > 0 && lb->track_freed && !copy) {
    /* The extents given for blocks already present are not referenced: tell
     * the owner right away, so every zero-copy extent handed to a successful
     * insert is reported by take_freed exactly once. */
    for (size_t i = 0; i < nre; i++) {
      for (uint32_t e = 0; e < lb->epb; e++)
        queue_freed(lb, &kv[i * lb->epb + e]);
      if (hidden && hidden[i].len)
        queue_freed(lb, &hidden[i]);
    }
  }
  pthread_mutex_unlock(&lb->mu);
out_nolock:
  if (reused)
    *reused = nre;
  for (size_t i = 0; i < n; i++)
    node_discard(pre[i]);
  free(path);
  free(h);
  return rc;
}

long mc_lookup_find(mc_lookup_t *lb, const void *tokens, size_t ntok, int width,
                    mc_lookup_match_t **out, mc_err_t *err) {
  *out = NULL;
  mc_block_hash_t *h;
  uint32_t *canon;
  long rn = hash_query(lb, tokens, ntok, width, &h, &canon, err);
  if (rn < 0)
    return rn;
  size_t n = (size_t)rn;
  mc_lookup_match_t *m = malloc(sizeof *m + (n ? n : 1) * sizeof(lk_node_t *));
  if (!m) {
    free(h);
    return mc_err_set(err, MC_ENOMEM, "out of memory looking up %zu tokens", ntok);
  }
  pthread_mutex_lock(&lb->mu);
  size_t k = walk_live(lb, h, canon, n, m->nodes);
  lb->st.lookups++;
  if (k == 0) {
    lb->st.misses++;
  } else {
    lb->st.hits++;
    lb->st.matched_blocks += k;
    for (size_t i = 0; i < k; i++) {
      if (m->nodes[i]->pins++ == 0) {
        lb->st.pinned_blocks++;
        lb->st.pinned_bytes += m->nodes[i]->bytes;
      }
    }
    lk_entry_t *e = entry_through(m->nodes[k - 1]);
    if (e && lb->mode == MC_LOOKUP_CONSUME) {
      entry_remove(lb, e);
      lb->st.consumed++;
    } else if (e) {
      lru_unlink(lb, e);
      lru_push(lb, e);
    }
  }
  pthread_mutex_unlock(&lb->mu);
  free(h);
  if (k == 0) {
    free(m);
    return 0;
  }
  m->n = k;
  *out = m;
  return (long)(k * lb->hasher.block_size);
}

long mc_lookup_count(mc_lookup_t *lb, const void *tokens, size_t ntok, int width,
                     mc_err_t *err) {
  mc_block_hash_t *h;
  uint32_t *canon;
  long rn = hash_query(lb, tokens, ntok, width, &h, &canon, err);
  if (rn <= 0)
    return rn;
  pthread_mutex_lock(&lb->mu);
  size_t k = walk_live(lb, h, canon, (size_t)rn, NULL);
  lb->st.probes++;
  pthread_mutex_unlock(&lb->mu);
  free(h);
  return (long)(k * lb->hasher.block_size);
}

size_t mc_lookup_match_blocks(const mc_lookup_match_t *m) { return m ? m->n : 0; }

const mc_lookup_extent_t *mc_lookup_match_kv(const mc_lookup_match_t *m, size_t i) {
  return m && i < m->n ? m->nodes[i]->kv : NULL;
}

const mc_lookup_extent_t *mc_lookup_match_hidden(const mc_lookup_match_t *m, size_t i) {
  return m && i < m->n ? &m->nodes[i]->hidden : NULL;
}

void mc_lookup_release(mc_lookup_t *lb, mc_lookup_match_t *m) {
  if (!m)
    return;
  pthread_mutex_lock(&lb->mu);
  int freed = 0;
  for (size_t i = 0; i < m->n; i++) {
    lk_node_t *nd = m->nodes[i];
    if (--nd->pins == 0) {
      lb->st.pinned_blocks--;
      lb->st.pinned_bytes -= nd->bytes;
      if (nd->refs == 0) {
        node_free(lb, nd);
        freed = 1;
      }
    }
  }
  if (freed)
    pthread_cond_broadcast(&lb->room);
  pthread_mutex_unlock(&lb->mu);
  free(m);
}

long mc_lookup_remove(mc_lookup_t *lb, const void *tokens, size_t ntok, int width,
                      mc_err_t *err) {
  return mc_lookup_remove_n(lb, tokens, ntok, width, 0, err);
}

long mc_lookup_remove_n(mc_lookup_t *lb, const void *tokens, size_t ntok, int width,
                        size_t max, mc_err_t *err) {
  mc_block_hash_t *h;
  uint32_t *canon;
  long rn = hash_query(lb, tokens, ntok, width, &h, &canon, err);
  if (rn <= 0)
    return rn;
  size_t n = (size_t)rn;
  lk_node_t **path = malloc(n * sizeof *path);
  if (!path) {
    free(h);
    return mc_err_set(err, MC_ENOMEM, "out of memory removing %zu tokens", ntok);
  }
  long removed = 0;
  pthread_mutex_lock(&lb->mu);
  if (walk_live(lb, h, canon, n, path) == n) {
    lk_node_t *leaf = path[n - 1];
    /* Each removal may free the leaf; stop when it has no entries left
     * (an indexed leaf with no entries still has refs from longer ones). */
    while (leaf->indexed && leaf->entries && (!max || (size_t)removed < max)) {
      lk_entry_t *e = leaf->entries;
      int last = leaf->refs == 1;
      entry_remove(lb, e);
      removed++;
      if (last)
        break;
    }
  }
  lb->st.removed += (uint64_t)removed;
  pthread_mutex_unlock(&lb->mu);
  free(path);
  free(h);
  return removed;
}

size_t mc_lookup_expire(mc_lookup_t *lb) {
  pthread_mutex_lock(&lb->mu);
  size_t n = expire_locked(lb);
  pthread_mutex_unlock(&lb->mu);
  return n;
}

void mc_lookup_get_stats(mc_lookup_t *lb, mc_lookup_stats_t *st) {
  pthread_mutex_lock(&lb->mu);
  expire_locked(lb);
  *st = lb->st;
  pthread_mutex_unlock(&lb->mu);
}

int mc_lookup_wait_freed(mc_lookup_t *lb, int64_t timeout_ms) {
  uint64_t deadline = mc_now_ns() + (uint64_t)(timeout_ms > 0 ? timeout_ms : 0) * 1000000ull;
  pthread_mutex_lock(&lb->mu);
  expire_locked(lb);
  while (lb->nfreed == 0 && mc_now_ns() < deadline) {
    struct timespec ts = mc_deadline_ts(deadline);
    pthread_cond_timedwait(&lb->room, &lb->mu, &ts);
  }
  if (lb->nfreed == 0)
    expire_locked(lb);
  int any = lb->nfreed > 0;
  pthread_mutex_unlock(&lb->mu);
  return any;
}

size_t mc_lookup_take_freed(mc_lookup_t *lb, mc_lookup_extent_t *out, size_t max) {
  pthread_mutex_lock(&lb->mu);
  size_t n = lb->nfreed < max ? lb->nfreed : max;
  if (n) {
    memcpy(out, lb->freed, n * sizeof *out);
    memmove(lb->freed, lb->freed + n, (lb->nfreed - n) * sizeof *out);
    lb->nfreed -= n;
  }
  pthread_mutex_unlock(&lb->mu);
  return n;
}
