/* The same-host GPU transport (same_host_gpu.h): the peer's descriptor (the
 * mc.describe RPC, cached; kept honest by the peer's regions version page,
 * or else checked by the RPC alongside the copies), CUDA IPC mappings of its
 * regions, and one copy job per local GPU and op on the engine's copy
 * worker.  docs/architecture.md "Same-host path". */
#include "transport/same_host_gpu/same_host_gpu.h"
#include "util/bsearch.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "gpu/cuda_driver.h"
#include "gpu/gpu_ipc.h"
#include "gpu/gpu_staging.h"
#include "mem/regions.h"
#include "meta/segment_desc.h"
#include "util/clock.h"
#include "util/env.h"
#include "util/log.h"

/* A peer's published regions version (mem/regions.h mc_regions_pub_t),
 * mapped read-only here.  Refcounted: the peer's cache entry and each call
 * that relies on it. */
typedef struct gen_map {
  atomic_int refs;
  const uint64_t *page;
  long pid;
  int fd;
  uint64_t token;
  int pidfd; /* the peer process (-1: the kernel has no pidfd_open) */
} gen_map_t;

#define GEN_PAGE 4096
#define GEN_MEMFD_NAME "mc-regions-gen"

/* A peer's descriptor as one mc.describe reply gave it, shared by the
 * peer's cache entry and the calls that use it (refcounted; never changed
 * once made, except the lookup hints, each of which is checked on use). */
#define RUN_HINTS 4096
typedef struct desc {
  atomic_int refs;
  mc_remote_desc_t d;
  char *raw;      /* the reply d was decoded from, or NULL */
  uint32_t *hint; /* RUN_HINTS: 2 MiB page of a remote address -> region + 1 */
  /* Per region and local device below DESC_DEVS: where its CUDA IPC handle
   * was opened here (0: not yet), so the descriptor's calls after the first
   * skip mc_gpu_ipc_open (a hash and compare of the handle under its lock:
   * ~700 instructions a call, ~5 a request of 64 KiB batches of 128).  Each
   * slot set holds one reference to that mapping (gpu_ipc.h), given back
   * when the descriptor's last reference goes: the peer's cache entry
   * replaced or dropped, and every call over it (with its copy jobs)
   * complete.  Set once per slot (compare-and-swap: a racing opener gives
   * its reference back). */
  _Atomic uint64_t *opened;
  atomic_int path_logged; /* a call over it logged its path (log_path_once) */
} desc_t;
#define DESC_DEVS 16

/* Gives back the mappings the descriptor holds (desc_t.opened). */
static void desc_release_mappings(desc_t *dr) {
  for (size_t i = 0; i < dr->d.n; i++)
    for (int dev = 0; dev < DESC_DEVS; dev++) {
      uint64_t base = atomic_load_explicit(&dr->opened[i * DESC_DEVS + dev],
                                           memory_order_acquire);
      if (base > 1)
        mc_gpu_ipc_release(base, dev);
    }
}

/* No transport lock held: the last reference may unmap the peer's memory. */
static void desc_unref(desc_t *dr) {
  if (dr && atomic_fetch_sub(&dr->refs, 1) == 1) {
    desc_release_mappings(dr);
    mc_remote_desc_free(&dr->d);
    free(dr->raw);
    free(dr->hint);
    free(dr->opened);
    free(dr);
  }
}

static desc_t *desc_ref(desc_t *dr) {
  if (dr)
    atomic_fetch_add(&dr->refs, 1);
  return dr;
}

/* Takes over *rd and *raw (both left empty); NULL when out of memory
 * (then they stay the caller's). */
static desc_t *desc_new(mc_remote_desc_t *rd, char **raw) {
  desc_t *dr = calloc(1, sizeof *dr);
  uint32_t *hint = calloc(RUN_HINTS, sizeof *hint);
  _Atomic uint64_t *opened = calloc((rd->n ? rd->n : 1) * DESC_DEVS, sizeof *opened);
  if (!dr || !hint || !opened) {
    free(dr);
    free(hint);
    free(opened);
    return NULL;
  }
  dr->opened = opened;
  atomic_init(&dr->refs, 1);
  dr->d = *rd;
  rd->regions = NULL;
  rd->n = 0;
  dr->raw = raw ? *raw : NULL;
  if (raw)
    *raw = NULL;
  dr->hint = hint;
  return dr;
}

typedef struct peer_entry {
  char name[320];
  int verdict; /* 1 same host, -1 another host, 0 not known */
  int fresh;   /* dr was fetched by reaches() and not used yet */
  desc_t *dr;  /* the peer's last descriptor (a reference), NULL if none */
  gen_map_t *gm; /* the peer's version page, NULL if it cannot be mapped */
  long gm_tried_pid; /* the (pid, fd, token) whose page failed to map */
  int gm_tried_fd;
  uint64_t gm_tried_token;
} peer_entry_t;

typedef struct shg {
  void *ctx;
  int (*rpc)(void *ctx, const char *segment, const char *req, size_t len, int64_t timeout_ms,
             char **reply, mc_err_t *err);
  void (*rpc_async)(void *ctx, const mc_peer_t *peer, mc_xfer_op_t *op);
  char *(*describe)(void *ctx); /* our descriptor, for peers' mc.describe */
  mc_gpu_stager_t *gpu;
  int trace;
  size_t chunk, first_chunk; /* MC_GPU_CHUNK, MC_GPU_FIRST_CHUNK: requests per step */
  int off; /* MC_GPU_IPC=0: moves nothing, still answers mc.describe */
  pthread_mutex_t mu; /* peers, logged */
  peer_entry_t *peers;
  size_t npeers;
  char (*logged)[320];
  size_t nlogged;
  int no_gen; /* MC_GPU_GEN=0: every call checks the descriptor by RPC */
  mc_regions_t *regions; /* ours: their version published in pub_page */
  uint64_t *pub_page;
  int pub_fd;
  /* Blocks the submitting side allocated for a call (its ops, copy jobs,
   * the call) that completed on another thread: freed by the next submit
   * call (or at stop), on the allocating side, instead of the copy worker
   * freeing them into the submitter's malloc arena while it allocates
   * there (the arena's lock, contended on every batch).  A stack pushed
   * lock-free, taken whole. */
  _Atomic(void *) freed;
  atomic_size_t freed_bytes;
  _Atomic uint64_t next_sweep_ns; /* sweep_dead_peers: not before */
  /* What freed_drain took back, kept for the next calls' ops, jobs and
   * calls instead of a malloc and a free each per batch (~2.3 K
   * instructions a batch of 128): at most BLOCK_CACHE blocks of at most
   * BLOCK_CACHE_BYTES each, freed at stop.  Under cache_mu. */
  pthread_mutex_t cache_mu;
  struct {
    void *p;
    size_t bytes;
  } cache[16];
  size_t ncache;
  uint64_t reuses; /* blocks handed out again (stats) */
} shg_t;

#define BLOCK_CACHE (sizeof ((shg_t *)0)->cache / sizeof ((shg_t *)0)->cache[0])
#define BLOCK_CACHE_BYTES (256u << 10) /* an op or a job of 4096 requests fits */

/* More pending than this: the completing thread frees them itself. */
#define FREED_MAX_BYTES (8u << 20)

/* Hands block p (malloc'ed, dead, about `bytes` long, at least two words)
 * to the submitting side to free. */
static void defer_free(shg_t *t, void *p, size_t bytes) {
  if (atomic_fetch_add(&t->freed_bytes, bytes) + bytes > FREED_MAX_BYTES) {
    atomic_fetch_sub(&t->freed_bytes, bytes);
    free(p);
    return;
  }
  ((size_t *)p)[1] = bytes;
  void *head = atomic_load(&t->freed);
  do
    *(void **)p = head;
  while (!atomic_compare_exchange_weak(&t->freed, &head, p));
}

/* Takes back what defer_free handed over: into the cache while it has
 * room, the rest freed. */
static void freed_drain(shg_t *t) {
  if (!atomic_load_explicit(&t->freed, memory_order_relaxed))
    return;
  void *p = atomic_exchange(&t->freed, NULL), *spill = NULL;
  size_t bytes = 0;
  pthread_mutex_lock(&t->cache_mu);
  while (p) {
    void *next = *(void **)p;
    size_t b = ((size_t *)p)[1];
    bytes += b;
    if (t->ncache < BLOCK_CACHE && b <= BLOCK_CACHE_BYTES) {
      t->cache[t->ncache].p = p;
      t->cache[t->ncache++].bytes = b;
    } else {
      *(void **)p = spill;
      spill = p;
    }
    p = next;
  }
  pthread_mutex_unlock(&t->cache_mu);
  while (spill) {
    void *next = *(void **)spill;
    free(spill);
    spill = next;
  }
  atomic_fetch_sub(&t->freed_bytes, bytes);
}

/* At least `need` bytes (malloc'ed: free() frees it), *bytes how many: the
 * smallest cached block that holds them, else a new one.  A miss with the
 * cache full frees its smallest block, so a cache of blocks grown too
 * small for the calls now turns over.  NULL when out of memory. */
static void *block_get(shg_t *t, size_t need, size_t *bytes) {
  void *p = NULL, *drop = NULL;
  pthread_mutex_lock(&t->cache_mu);
  size_t best = BLOCK_CACHE, small = 0;
  for (size_t i = 0; i < t->ncache; i++) {
    size_t b = t->cache[i].bytes;
    if (b >= need && (best == BLOCK_CACHE || b < t->cache[best].bytes))
      best = i;
    if (b < t->cache[small].bytes)
      small = i;
  }
  if (best < BLOCK_CACHE) {
    p = t->cache[best].p;
    *bytes = t->cache[best].bytes;
    t->cache[best] = t->cache[--t->ncache];
    t->reuses++;
  } else if (t->ncache == BLOCK_CACHE) {
    drop = t->cache[small].p;
    t->cache[small] = t->cache[--t->ncache];
  }
  pthread_mutex_unlock(&t->cache_mu);
  free(drop);
  if (!p) {
    p = malloc(need);
    *bytes = need;
  }
  return p;
}

/* ---- the regions version page ----
 *
 * Every submit call that uses a cached descriptor of a peer must learn
 * whether the regions it used were unregistered (or re-registered) before
 * its copies landed.  The peer publishes its regions table's version in a
 * sealed memfd page (word 0; word 1 a random token) and names it in its
 * descriptor ("gen": version, fd, token).  We map that page once per peer
 * (/proc/<pid>/fd/<fd>, checked: a sealed memfd of ours, the token) and
 * read the version: equal to the descriptor's at the start of a call, the
 * cached descriptor is the peer's current one; still equal once the copies
 * are complete, no region was unregistered meanwhile (the peer bumps it
 * before an unregister waits and returns).  Anything else - no page, a
 * different version - takes the mc.describe RPC check as before. */

static void gen_map_unref(gen_map_t *m) {
  if (m && atomic_fetch_sub(&m->refs, 1) == 1) {
    munmap((void *)m->page, GEN_PAGE);
    if (m->pidfd >= 0)
      close(m->pidfd);
    free(m);
  }
}

static uint64_t gen_read(const gen_map_t *m) {
  return __atomic_load_n(&m->page[0], __ATOMIC_SEQ_CST);
}

/* The page outlives its process (our mapping holds it), so an unchanged
 * version alone would let a call into a dead peer's memory succeed: its
 * pidfd says whether the process still runs (one poll, no blocking). */
static int gen_alive(const gen_map_t *m) {
  if (m->pidfd < 0)
    return 1;
  struct pollfd pf = {.fd = m->pidfd, .events = POLLIN};
  return poll(&pf, 1, 0) == 0;
}

/* The version is `v` and its process alive: the descriptor is current. */
static int gen_current(const gen_map_t *m, uint64_t v) {
  return gen_read(m) == v && gen_alive(m);
}

/* Maps peer `pid`'s page `fd` read-only; NULL when it cannot be had (not
 * our memfd, no access, unsealed, the token differs). */
static gen_map_t *gen_map_open(long pid, int fd, uint64_t token) {
  char path[64], link[128];
  /* Opened first: the process found below under /proc (its token checked)
   * is then the one this pidfd watches, never a successor reusing the pid. */
  int pidfd = (int)syscall(SYS_pidfd_open, (pid_t)pid, 0);
  if (pidfd < 0 && errno != ENOSYS)
    return NULL; /* gone already (ESRCH) or not ours to watch */
  snprintf(path, sizeof path, "/proc/%ld/fd/%d", pid, fd);
  ssize_t ln = readlink(path, link, sizeof link - 1);
  int f = -1;
  if (ln > 0) {
    link[ln] = '\0';
    if (strncmp(link, "/memfd:" GEN_MEMFD_NAME, strlen("/memfd:" GEN_MEMFD_NAME)) == 0)
      f = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  }
  if (f < 0) {
    if (pidfd >= 0)
      close(pidfd);
    return NULL;
  }
  struct stat st;
  int seals = fcntl(f, F_GET_SEALS);
  void *p = MAP_FAILED;
  /* Sealed against shrinking: the mapping can never fault (SIGBUS). */
  if (fstat(f, &st) == 0 && S_ISREG(st.st_mode) && st.st_size >= GEN_PAGE && seals >= 0 &&
      (seals & F_SEAL_SHRINK))
    p = mmap(NULL, GEN_PAGE, PROT_READ, MAP_SHARED, f, 0);
  close(f);
  if (p == MAP_FAILED) {
    if (pidfd >= 0)
      close(pidfd);
    return NULL;
  }
  const uint64_t *w = p;
  gen_map_t *m = __atomic_load_n(&w[1], __ATOMIC_SEQ_CST) == token ? calloc(1, sizeof *m)
                                                                   : NULL;
  if (!m) {
    munmap(p, GEN_PAGE);
    if (pidfd >= 0)
      close(pidfd);
    return NULL;
  }
  atomic_init(&m->refs, 1);
  m->pidfd = pidfd;
  m->page = w;
  m->pid = pid;
  m->fd = fd;
  m->token = token;
  return m;
}

/* Under t->mu: the entry's page follows its descriptor's "gen". */
static void peer_gen_update(shg_t *t, peer_entry_t *pe) {
  const mc_remote_desc_t *d = pe->dr ? &pe->dr->d : NULL;
  if (t->no_gen || !d || !d->has_gen || d->pid <= 0) {
    gen_map_unref(pe->gm);
    pe->gm = NULL;
    return;
  }
  if (pe->gm && pe->gm->pid == d->pid && pe->gm->fd == d->gen_fd &&
      pe->gm->token == d->gen_token)
    return;
  gen_map_unref(pe->gm);
  pe->gm = NULL;
  if (pe->gm_tried_pid == d->pid && pe->gm_tried_fd == d->gen_fd &&
      pe->gm_tried_token == d->gen_token)
    return; /* failed before: not again per call */
  pe->gm = gen_map_open(d->pid, d->gen_fd, d->gen_token);
  if (!pe->gm) {
    pe->gm_tried_pid = d->pid;
    pe->gm_tried_fd = d->gen_fd;
    pe->gm_tried_token = d->gen_token;
    mc_log_debug("segment %s: its regions version page cannot be mapped here; every GPU "
                 "transfer checks its descriptor by RPC", pe->name);
  }
}

/* Ours: a sealed memfd page holding the regions' version. */
static int gen_publish(shg_t *t, mc_regions_t *regions) {
  int fd = memfd_create(GEN_MEMFD_NAME, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0)
    return -1;
  void *p = MAP_FAILED;
  uint64_t token = 0;
  if (ftruncate(fd, GEN_PAGE) == 0 &&
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) == 0 &&
      getrandom(&token, sizeof token, 0) == (ssize_t)sizeof token)
    p = mmap(NULL, GEN_PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    close(fd);
    return -1;
  }
  t->pub_page = p;
  t->pub_fd = fd;
  t->regions = regions;
  __atomic_store_n(&t->pub_page[1], token, __ATOMIC_SEQ_CST);
  mc_regions_pub_t pub = {.page = t->pub_page, .fd = fd, .token = token};
  mc_regions_set_pub(regions, &pub);
  return 0;
}

/* One line per peer: which path its GPU memory takes. */
static void log_path_once(shg_t *t, const char *segment, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void log_path_once(shg_t *t, const char *segment, const char *fmt, ...) {
  char key[320];
  snprintf(key, sizeof key, "%s", segment);
  pthread_mutex_lock(&t->mu);
  for (size_t i = 0; i < t->nlogged; i++)
    if (!strcmp(t->logged[i], key)) {
      pthread_mutex_unlock(&t->mu);
      return;
    }
  char(*v)[320] = realloc(t->logged, (t->nlogged + 1) * sizeof *v);
  if (v) {
    t->logged = v;
    memcpy(v[t->nlogged++], key, sizeof key);
  }
  pthread_mutex_unlock(&t->mu);
  char msg[MC_ERR_MSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  mc_log_info("GPU path to segment %s: %s", segment, msg);
}

/* ---- the peer's descriptor ---- */

/* Asks the peer for its descriptor (an RPC on the control connection). */
static int describe_remote(shg_t *t, const char *segment, mc_remote_desc_t *out, char **raw,
                           mc_err_t *err) {
  char *reply = NULL;
  int rc = t->rpc(t->ctx, segment, MC_RPC_DESCRIBE, strlen(MC_RPC_DESCRIBE), 10000, &reply,
                  err);
  if (rc == 0)
    rc = mc_segment_desc_decode_regions(reply ? reply : "", reply ? strlen(reply) : 0, out, err);
  if (rc == 0 && raw) {
    *raw = reply; /* the caller keeps the text: an identical later reply needs no decode */
    reply = NULL;
  }
  free(reply);
  return rc;
}

static const mc_remote_region_t *find_region(const mc_remote_desc_t *rd, uint64_t addr,
                                             uint64_t len) {
#define RD_ADDR(i) rd->regions[i].addr
  size_t lo = MC_COUNT_LE(rd->n, RD_ADDR, addr); /* first region with addr > a */
#undef RD_ADDR
  if (lo == 0)
    return NULL;
  const mc_remote_region_t *r = &rd->regions[lo - 1];
  return addr + len <= r->addr + r->len ? r : NULL;
}

/* Per-peer cache (under t->mu): same host or not, and the last descriptor
 * seen. */
static ssize_t peer_find(shg_t *t, const char *segment, int create) {
  for (size_t i = 0; i < t->npeers; i++)
    if (!strcmp(t->peers[i].name, segment))
      return (ssize_t)i;
  if (!create)
    return -1;
  void *nv = realloc(t->peers, (t->npeers + 1) * sizeof *t->peers);
  if (!nv)
    return -1;
  t->peers = nv;
  memset(&t->peers[t->npeers], 0, sizeof *t->peers);
  snprintf(t->peers[t->npeers].name, sizeof t->peers[0].name, "%s", segment);
  return (ssize_t)t->npeers++;
}

static int desc_copy(mc_remote_desc_t *dst, const mc_remote_desc_t *src) {
  *dst = *src;
  dst->regions = malloc((src->n ? src->n : 1) * sizeof *src->regions);
  if (!dst->regions) {
    dst->n = 0;
    return MC_ENOMEM;
  }
  memcpy(dst->regions, src->regions, src->n * sizeof *src->regions);
  return 0;
}

/* A peer's new descriptor dr takes over the mappings its predecessor old
 * opened for the regions dr still lists with the same export (a reference
 * each): a refetch neither closes nor reopens them, while a region the peer
 * no longer lists is unmapped once old's last user lets go. */
static void desc_inherit(desc_t *dr, const desc_t *old) {
  for (size_t i = 0; old && i < dr->d.n; i++) {
    const mc_remote_region_t *r = &dr->d.regions[i];
    const mc_remote_region_t *o = r->ipc[0] ? find_region(&old->d, r->addr, 1) : NULL;
    if (!o || strcmp(o->ipc, r->ipc) != 0)
      continue;
    size_t oi = (size_t)(o - old->d.regions);
    for (int dev = 0; dev < DESC_DEVS; dev++) {
      uint64_t base = atomic_load_explicit(&old->opened[oi * DESC_DEVS + dev],
                                           memory_order_acquire);
      if (base > 1 && mc_gpu_ipc_retain(base, dev) == 0)
        atomic_store_explicit(&dr->opened[i * DESC_DEVS + dev], base, memory_order_release);
    }
  }
}

/* Stores a fresh descriptor of `segment` (verdict 1 = same host; dr: a
 * reference the entry takes over, NULL: none). */
static void peer_store(shg_t *t, const char *segment, int verdict, desc_t *dr, int fresh) {
  desc_t *old = NULL;
  pthread_mutex_lock(&t->mu);
  ssize_t i = peer_find(t, segment, 1);
  if (i >= 0) {
    peer_entry_t *pe = &t->peers[i];
    pe->verdict = verdict;
    old = pe->dr;
    if (dr && old && dr != old)
      desc_inherit(dr, old);
    pe->dr = dr;
    dr = NULL;
    pe->fresh = fresh && pe->dr;
    peer_gen_update(t, pe);
  }
  pthread_mutex_unlock(&t->mu);
  desc_unref(old); /* outside the lock: it may unmap what the peer dropped */
  desc_unref(dr); /* no entry (out of memory) */
}

/* Under t->mu: removes peer entry i (the last one takes its place) and the
 * segment's logged path, handing its descriptor and version page to the
 * caller (who unrefs *dr and *gm outside the lock): the next call asks the
 * peer afresh (and logs its path again), and a peer lost or dead under one
 * name after another (restarted on a new port each time) leaves nothing
 * behind. */
static void peer_forget(shg_t *t, size_t i, desc_t **dr, gen_map_t **gm) {
  peer_entry_t *pe = &t->peers[i];
  *dr = pe->dr;
  *gm = pe->gm;
  for (size_t k = 0; k < t->nlogged; k++)
    if (!strcmp(t->logged[k], pe->name)) {
      memmove(t->logged[k], t->logged[--t->nlogged], sizeof t->logged[k]);
      break;
    }
  *pe = t->peers[--t->npeers];
}

/* Peers whose process is gone (the version page's pidfd says so) are
 * forgotten, their descriptors given back: the dead peer's GPU memory is
 * unmapped here once no copy uses it.  At most every SWEEP_NS (a poll per
 * peer), from submit calls to any peer and the engine's sweeps. */
#define SWEEP_NS 1000000000ull
static void sweep_dead_peers(shg_t *t) {
  uint64_t now = mc_now_ns(), next = atomic_load_explicit(&t->next_sweep_ns,
                                                          memory_order_relaxed);
  if (now < next || !atomic_compare_exchange_strong(&t->next_sweep_ns, &next, now + SWEEP_NS))
    return;
  for (;;) {
    desc_t *dr = NULL;
    gen_map_t *gm = NULL;
    pthread_mutex_lock(&t->mu);
    for (size_t i = 0; i < t->npeers && !dr; i++) {
      peer_entry_t *pe = &t->peers[i];
      if (pe->dr && pe->gm && !gen_alive(pe->gm)) {
        mc_log_info("segment %s: its process %ld exited: its descriptor is dropped and its "
                    "GPU memory unmapped here once no copy uses it", pe->name, pe->gm->pid);
        peer_forget(t, i, &dr, &gm);
      }
    }
    pthread_mutex_unlock(&t->mu);
    if (!dr)
      return;
    desc_unref(dr);
    gen_map_unref(gm);
  }
}

/* First contact decides: the peer's descriptor names its host.  A peer on
 * another host is remembered; a descriptor that cannot be had now is asked
 * for again by plan() (then logged), as before the interface. */
static int shg_reaches(void *impl, const mc_peer_t *peer, mc_mem_kind_t kind, char *why,
                       size_t why_len) {
  shg_t *t = impl;
  if (t->off) {
    snprintf(why, why_len, "switched off here (MC_GPU_IPC=0)");
    return 0;
  }
  if (kind != MC_MEM_CUDA) {
    snprintf(why, why_len, "it moves GPU memory only");
    return 0;
  }
  pthread_mutex_lock(&t->mu);
  ssize_t pi = peer_find(t, peer->segment, 0);
  int verdict = pi >= 0 ? t->peers[pi].verdict : 0;
  pthread_mutex_unlock(&t->mu);
  if (verdict == 0) {
    mc_remote_desc_t rd = {0};
    mc_err_t err = {0};
    char *raw = NULL;
    if (describe_remote(t, peer->segment, &rd, &raw, &err) < 0)
      return 1; /* plan() asks again and logs why it cannot */
    verdict = rd.host_id[0] && !strcmp(rd.host_id, mc_host_identity()) ? 1 : -1;
    peer_store(t, peer->segment, verdict, verdict > 0 ? desc_new(&rd, &raw) : NULL, 1);
    free(raw);
    mc_remote_desc_free(&rd);
  }
  if (verdict < 0) {
    snprintf(why, why_len, "the peer runs on another host: TCP with pinned staging");
    return 0;
  }
  return 1;
}

/* ---- calls, plans, groups ----
 *
 * A call is what one engine submit call shares across its chunks: the peer
 * descriptor the mappings come from, the IPC mappings of its regions
 * (looked up once per call: opened once per descriptor and device, see
 * desc_t.opened), the regions used so far and, when the descriptor
 * came from the cache, the one mc.describe check that runs alongside all
 * of the call's copies.  Each chunk is a plan; each op the engine hands
 * back for it completes as a group: its copy jobs and the call's check.
 * Refcounted under call->mu. */

typedef struct group group_t;

/* How a call over a cached descriptor learns that it is still good:
 * V_RPC: one mc.describe check sent alongside its copies, every op waits
 * for it; V_GEN: the peer's version page read when each op's copies are
 * complete (unchanged: done; changed: the V_RPC check then). */
enum { V_NONE = 0, V_RPC = 1, V_GEN = 2 };

typedef struct call {
  shg_t *t;
  pthread_mutex_t mu;
  int port;
  desc_t *u;             /* the descriptor the mappings came from (a reference) */
  int same_raw;          /* the check's reply was byte-identical to u->raw */
  char *region_used;     /* per u->d.regions: some request maps into it */
  uint64_t *rmap;        /* per region: mapped base, 1 = cannot be opened (set with rdev) */
  int *rdev;             /* per region: local device + 1 it was opened on, 0: not yet */
  int same_process;
  int logged; /* its path was logged (log_path_once) */
  int validate; /* cached descriptor: V_RPC or V_GEN (see below), else 0 */
  gen_map_t *gm; /* V_GEN: the peer's version page (a reference) */
  int rpc_sent; /* under mu */
  /* Under mu. */
  int checked; /* the check's answer is in */
  int check_code;
  group_t *waiting;       /* groups waiting for the check */
  int refs;
  size_t bytes; /* its block's (block_get) */
  /* From here on: set by call_new field by field, not zeroed whole (a
   * call is made per submit call: ~2 KiB of memset and two snprintf were
   * ~25 instructions a request of 64 KiB batches of 128). */
  mc_remote_desc_t fresh; /* the descriptor the check fetched (zeroed) */
  char segment[320];
  char host[256];
  char check_msg[MC_ERR_MSG_MAX]; /* read only once checked (set then) */
} call_t;

/* Completion of one op: its copy jobs and, with a cached descriptor, the
 * call's check; the last part completes the op (outside call->mu). */
struct group {
  call_t *call;
  mc_xfer_op_t *op;
  mc_gpu_job_t *block; /* the one job whose allocation holds this group, or NULL */
  size_t block_bytes;  /* that allocation's (block_get) */
  group_t *next_waiting;
  int remaining;
  int code;
  char msg[MC_ERR_MSG_MAX];
};

static void call_free(call_t *r) {
  gen_map_unref(r->gm);
  desc_unref(r->u);
  mc_remote_desc_free(&r->fresh);
  pthread_mutex_destroy(&r->mu);
  defer_free(r->t, r, r->bytes);
}

static void call_unref(call_t *r) {
  if (!r)
    return;
  pthread_mutex_lock(&r->mu);
  int last = --r->refs == 0;
  pthread_mutex_unlock(&r->mu);
  if (last)
    call_free(r);
}

/* Caller holds r->mu and the check is in: 0 if every region the call used
 * is still registered with the same IPC export, else the failure. */
static int call_verdict(call_t *r, char *why, size_t cap) {
  if (r->check_code < 0) {
    snprintf(why, cap, "%s", r->check_msg);
    return r->check_code;
  }
  if (r->same_raw)
    return 0; /* the same descriptor, byte for byte: every region is unchanged */
  for (size_t i = 0; i < r->u->d.n; i++) {
    if (!r->region_used[i])
      continue;
    const mc_remote_region_t *u = &r->u->d.regions[i];
    const mc_remote_region_t *f = find_region(&r->fresh, u->addr, u->len);
    if (!f || f->addr != u->addr || f->len != u->len || strcmp(f->ipc, u->ipc) != 0 ||
        f->ipc_base != u->ipc_base) {
      snprintf(why, cap,
               "segment %s unregistered or re-registered its GPU memory [0x%llx, +%llu) "
               "while this transfer used it; the data may not have landed - retry",
               r->segment, (unsigned long long)u->addr, (unsigned long long)u->len);
      return MC_ERANGE;
    }
  }
  return 0;
}

/* Caller holds g->call->mu.  Returns 1 when g is complete: the caller then
 * runs group_finish after unlocking. */
static int group_part_done(group_t *g, int code, const char *msg) {
  if (code < 0 && g->code == 0) {
    g->code = code;
    snprintf(g->msg, sizeof g->msg, "%s", msg ? msg : mc_strerror(code));
  }
  return --g->remaining == 0;
}

/* No lock held: the op's done() runs, the group drops its call. */
static void group_finish(group_t *g) {
  mc_xfer_op_t *op = g->op;
  shg_t *t = g->call->t;
  op->done(op, g->code, g->code ? g->msg : NULL);
  if (!op->ctrl && !op->resp && !op->tp_free) /* an op of map_build: one block */
    defer_free(t, op, MC_XFER_OP_BYTES(op->cap));
  else
    mc_xfer_op_free(op);
  call_unref(g->call);
  mc_gpu_job_t *j = g->block; /* g lives in it */
  if (!j) {
    free(g);
  } else {
    size_t bytes = g->block_bytes;
    if (!j->inline_arrays) { /* moved out by the copy worker (merged copies): its own */
      free(j->dsts);
      free(j->srcs);
      free(j->sizes);
    }
    defer_free(t, j, bytes); /* one block: job, (arrays,) group */
  }
}

static void send_check(shg_t *t, call_t *run, atomic_int *cancel);

static void ipc_job_done(mc_gpu_job_t *j, int code, const char *msg) {
  group_t *g = j->arg;
  call_t *r = g->call;
  if (j != g->block) /* else freed with the group */
    mc_gpu_job_free(j);
  pthread_mutex_lock(&r->mu);
  int fin = group_part_done(g, code, msg), send = 0;
  if (fin && r->validate == V_GEN && !gen_current(r->gm, r->u->d.gen)) {
    /* The peer's regions changed since the descriptor: whether the ones
     * this op used are still there, its current descriptor says. */
    if (!r->checked) {
      g->remaining = 1;
      g->next_waiting = r->waiting;
      r->waiting = g;
      fin = 0;
      if (!r->rpc_sent) {
        send = r->rpc_sent = 1;
        r->refs++; /* the check's */
      }
    } else if (g->code == 0) {
      g->code = call_verdict(r, g->msg, sizeof g->msg);
    }
  }
  pthread_mutex_unlock(&r->mu);
  if (send)
    send_check(r->t, r, g->op->cancel);
  if (fin)
    group_finish(g);
}

/* The peer's current descriptor arrived (I/O thread): every region the
 * call's copies used must still be registered with the same IPC export. */
static void validate_done(mc_xfer_op_t *op, int code, const char *msg) {
  call_t *r = op->arg;
  mc_remote_desc_t fresh = {0};
  char why[MC_ERR_MSG_MAX] = "";
  int same_raw = 0;
  if (code == 0) {
    mc_err_t err = {0};
    const char *json = op->resp ? op->resp : "";
    /* The common case: nothing changed, the reply is the text the call's
     * descriptor came from (the peer caches it): no decode, no compare of
     * regions, the cache stays as it is. */
    same_raw = r->u->raw && !strcmp(json, r->u->raw);
    mc_remote_desc_t keep = {0};
    char *kraw = NULL;
    if (same_raw) {
    } else if (mc_segment_desc_decode_regions(json, strlen(json), &fresh, &err) < 0) {
      code = err.code;
      snprintf(why, sizeof why, "%s", err.msg);
    } else if (desc_copy(&keep, &fresh) == 0 && (kraw = strdup(json))) {
      desc_t *dr = desc_new(&keep, &kraw);
      if (dr)
        peer_store(r->t, r->segment, 1, dr, 0);
    }
    free(kraw);
    mc_remote_desc_free(&keep);
  } else {
    snprintf(why, sizeof why, "%s", msg ? msg : mc_strerror(code));
  }
  group_t *done = NULL;
  pthread_mutex_lock(&r->mu);
  r->fresh = fresh;
  r->same_raw = same_raw;
  r->check_code = code;
  snprintf(r->check_msg, sizeof r->check_msg, "%s", why);
  r->checked = 1;
  code = call_verdict(r, why, sizeof why);
  while (r->waiting) {
    group_t *g = r->waiting;
    r->waiting = g->next_waiting;
    if (group_part_done(g, code, why)) {
      g->next_waiting = done;
      done = g;
    }
  }
  pthread_mutex_unlock(&r->mu);
  while (done) {
    group_t *g = done;
    done = g->next_waiting;
    group_finish(g);
  }
  call_unref(r); /* the check's reference */
}

/* Where region ri of descriptor dr (its CUDA IPC handle ipc) appears on
 * local device dev: opened once per descriptor and device (dr->opened, a
 * reference to the mapping); 1 when it cannot be opened (err says why). */
static uint64_t open_region(desc_t *dr, size_t ri, const char *ipc, int dev, mc_err_t *err) {
  if (dev < 0 || dev >= DESC_DEVS) {
    mc_err_set(err, MC_EUNAVAIL, "the same-host GPU path maps peers' memory for local devices "
               "cuda:0 to cuda:%d only, not cuda:%d", DESC_DEVS - 1, dev);
    return 1;
  }
  _Atomic uint64_t *slot = &dr->opened[ri * DESC_DEVS + dev];
  uint64_t base = atomic_load_explicit(slot, memory_order_acquire), none = 0;
  if (base)
    return base;
  if (mc_gpu_ipc_open(ipc, dev, &base, err) != 0)
    return 1;
  if (!atomic_compare_exchange_strong(slot, &none, base)) {
    mc_gpu_ipc_release(base, dev); /* another call stored it first: the same mapping */
    base = none;
  }
  return base;
}

/* One op of a chunk being built (map_build): its entries so far, their
 * bytes, and its copy job while they are all on one local device. */
typedef struct op_fill {
  mc_xfer_op_t *op;
  mc_gpu_job_t *job;
  uint32_t e;
  uint64_t total;
} op_fill_t;

/* Opens f: an op of `type` with room for `room` entries (the chunk's
 * requests left), c's engine fields set, and its copy job on local device
 * dev with the op's group in the same block (the job NULL when out of
 * memory: start_ops then builds one per device, op_prepare).  Both blocks
 * from block_get.  -1 when out of memory for the op. */
static int fill_open(shg_t *t, const mc_xfer_call_t *c, op_fill_t *f, int type, uint32_t room,
                     int dev) {
  size_t ob, jb;
  void *om = block_get(t, MC_XFER_OP_BYTES(room), &ob);
  if (!om)
    return -1;
  mc_xfer_op_t *op = mc_xfer_op_init(om, type, room);
  op->cap = (uint32_t)((ob - sizeof *op) / sizeof op->ent[0]); /* the block's, for its reuse */
  op->done = c->op_done;
  op->entry_failed = c->op_entry_failed;
  op->arg = c->op_arg;
  op->cancel = c->op_cancel;
  *f = (op_fill_t){.op = op};
  void *jm = block_get(t, mc_gpu_job_inline_bytes(room, sizeof(group_t)), &jb), *gp = NULL;
  if (!jm)
    return 0;
  f->job = mc_gpu_job_init_inline(jm, dev, MC_GPU_D2D, room, sizeof(group_t), &gp);
  group_t *g = gp;
  g->op = op;
  g->block = f->job;
  g->block_bytes = jb;
  f->job->arg = g;
  f->job->complete = ipc_job_done;
  return 0;
}

/* The requests [off, off+n) of call c in one pass: each one's remote range
 * looked up in the peer's regions (per the call's descriptor), mapped here
 * (CUDA IPC, or the address itself in one process) and written as an entry
 * of the chunk's op of its opcode (cookie: its index in the call) and as a
 * copy of that op's job (adjacent copies merge there).  take[i]: request
 * off+i is taken (ldev < 0, host memory, never is).  Returns how many ops,
 * WRITEs first, in ops[] with their jobs in pre[] (NULL: op_prepare's).
 * *miss: some GPU request found no cuda region there; over a cached
 * descriptor (run->validate) that ends the pass with nothing built, as the
 * chunk is planned again with a fresh one.  0 with take cleared when out of
 * memory (the engine's next choice moves them then). */
static size_t map_build(shg_t *t, call_t *run, const mc_xfer_call_t *c, size_t off, size_t n,
                        char *take, mc_xfer_op_t **ops, mc_gpu_job_t **pre, int *miss) {
  const mc_remote_desc_t *rd = &run->u->d;
  uint32_t *hint = run->u->hint; /* shared by the descriptor's calls: each hint is checked */
  /* Read once: the stores below (take, region_used, the entries) may alias
   * anything, so the compiler would reload these per request. */
  const mc_xfer_req_t *reqs = c->reqs + off;
  const int *ldev = c->ldev + off;
  const mc_remote_region_t *regs = rd->regions;
  const size_t nregs = rd->n;
  const int same_process = run->same_process, validate = run->validate;
  uint64_t *rmap = run->rmap;
  int *rdev = run->rdev;
  char *used = run->region_used;
  mc_err_t err = {0};
  int told = 0; /* this call logged its TCP fallback: once a call, not once a request */
  const mc_remote_region_t *r = NULL; /* the region of the previous request */
  op_fill_t f[2] = {{0}, {0}}; /* [1]: the WRITEs' */
  size_t nops = 0;
  *miss = 0;
  for (size_t i = 0; i < n; i++) {
    take[i] = 0;
    int dev = ldev[i];
    if (dev < 0)
      continue;
    uint64_t ra = reqs[i].remote, rl = reqs[i].len;
    /* The region last found in this 2 MiB page first (checking the last
     * region first mispredicts a branch per request over a shuffled block
     * table), then the last region, then a binary search. */
    uint32_t *hp = &hint[(ra >> 21) % RUN_HINTS];
    uint32_t h = __atomic_load_n(hp, __ATOMIC_RELAXED);
    const mc_remote_region_t *cand = h && h <= nregs ? &regs[h - 1] : NULL;
    if (cand && ra >= cand->addr && ra + rl <= cand->addr + cand->len) {
      r = cand;
    } else {
      if (!(r && ra >= r->addr && ra + rl <= r->addr + r->len))
        r = find_region(rd, ra, rl);
      if (r)
        __atomic_store_n(hp, (uint32_t)(r - regs) + 1, __ATOMIC_RELAXED);
    }
    if (!r || r->cuda_dev < 0) {
      *miss = 1; /* host memory there, or not (yet) known: TCP says which */
      r = NULL;
      if (validate)
        goto discard; /* planned again over a fresh descriptor */
      continue;
    }
    size_t ri = (size_t)(r - regs);
    uint64_t m = ra; /* one address space */
    if (!same_process) {
      if (rdev[ri] != dev + 1) { /* the region's first request on this device */
        rmap[ri] = r->ipc[0] ? open_region(run->u, ri, r->ipc, dev, &err) : 1;
        rdev[ri] = dev + 1;
      }
      if (rmap[ri] <= 1) {
        if (!told++) /* log_path_once formats and locks: ~750 instructions a request */
          log_path_once(t, run->segment, "TCP with pinned staging (%s)",
                        !r->ipc[0] ? "the peer exported no CUDA IPC handle"
                        : err.msg[0] ? err.msg
                                     : "a peer's CUDA IPC handle cannot be opened here");
        continue;
      }
      m = rmap[ri] + (ra - r->ipc_base);
    }
    int wr = reqs[i].opcode == MC_XFER_REQ_WRITE;
    op_fill_t *fo = &f[wr];
    if (!fo->op &&
        fill_open(t, c, fo, wr ? MC_XFER_WRITE : MC_XFER_READ, (uint32_t)(n - i), dev) < 0)
      goto oom;
    void *loc = reqs[i].local;
    fo->op->ent[fo->e++] = (mc_xfer_ent_t){.local = loc, .remote = m, .len = rl,
                                           .cookie = (uint32_t)(off + i), .dev = dev};
    fo->total += rl;
    mc_gpu_job_t *j = fo->job;
    if (j && (dev != j->device ||
              (wr ? mc_gpu_job_add(j, m, (mc_cu_ptr)(uintptr_t)loc, rl)
                  : mc_gpu_job_add(j, (mc_cu_ptr)(uintptr_t)loc, m, rl)) < 0)) {
      mc_gpu_job_free(j); /* another device: op_prepare sorts them */
      fo->job = NULL;
    }
    used[ri] = 1;
    take[i] = 1;
  }
  for (int wr = 1; wr >= 0; wr--) {
    mc_xfer_op_t *op = f[wr].op;
    if (!op)
      continue;
    op->nent = f[wr].e; /* 1..n <= MC_XFER_MAX_ENTRIES: what mc_xfer_op_seal checks */
    op->total = f[wr].total;
    pre[nops] = f[wr].job;
    ops[nops++] = op;
  }
  return nops;
oom:
  memset(take, 0, n);
discard:
  for (int wr = 0; wr < 2; wr++) {
    mc_xfer_op_free(f[wr].op);
    mc_gpu_job_free(f[wr].job);
  }
  return 0;
}

/* Copies src into dst[cap], cut at cap - 1 bytes (snprintf's "%s" without
 * the format parsing: call_new runs once per submit call). */
static void copy_cut(char *dst, size_t cap, const char *src) {
  size_t n = strnlen(src, cap - 1);
  memcpy(dst, src, n);
  dst[n] = '\0';
}

/* A call over descriptor dr (its reference taken over); NULL when out of
 * memory.  One allocation: the call and its per-region arrays. */
static call_t *call_new(shg_t *t, const mc_peer_t *peer, desc_t *dr, int validate) {
  size_t nr = dr->d.n ? dr->d.n : 1;
  size_t head = (sizeof(call_t) + 7) & ~(size_t)7, bytes;
  call_t *r = block_get(t, head + nr * (sizeof(uint64_t) + sizeof(int) + 1), &bytes);
  if (!r) {
    desc_unref(dr);
    return NULL;
  }
  memset(r, 0, offsetof(call_t, fresh));
  r->bytes = bytes;
  memset(&r->fresh, 0, sizeof r->fresh);
  pthread_mutex_init(&r->mu, NULL);
  r->rmap = (uint64_t *)((char *)r + head); /* read only where rdev says it was set */
  r->rdev = (int *)(r->rmap + nr);
  r->region_used = (char *)(r->rdev + nr);
  memset(r->rdev, 0, nr * (sizeof(int) + 1)); /* rdev and region_used */
  r->t = t;
  copy_cut(r->segment, sizeof r->segment, peer->segment);
  copy_cut(r->host, sizeof r->host, peer->host ? peer->host : "");
  r->check_msg[0] = '\0';
  r->port = peer->port;
  r->u = dr;
  r->same_process = dr->d.pid == (long)getpid();
  r->validate = validate;
  r->refs = 1; /* the submit call's, until its last chunk was handed out */
  return r;
}

/* Starts a call: the cached descriptor (checked alongside) or, with
 * `refetch`, no cache, or one fetched by reaches() just now, the peer's
 * answer now.  NULL: not same host (or no descriptor), logged. */
static call_t *call_start(shg_t *t, const mc_peer_t *peer, int refetch) {
  desc_t *dr = NULL, *dead = NULL;
  int fresh = 0;
  gen_map_t *gm = NULL, *dead_gm = NULL;
  pthread_mutex_lock(&t->mu);
  ssize_t pi = peer_find(t, peer->segment, 0);
  int verdict = pi >= 0 ? t->peers[pi].verdict : 0;
  if (!refetch && pi >= 0 && verdict > 0 && t->peers[pi].dr) {
    peer_entry_t *pe = &t->peers[pi];
    if (pe->gm && !gen_alive(pe->gm)) {
      /* Its process exited: the descriptor and its mappings go (once no
       * copy uses them); whoever serves the segment now is asked. */
      peer_forget(t, (size_t)pi, &dead, &dead_gm);
      verdict = 0;
    } else {
      dr = desc_ref(pe->dr);
      fresh = pe->fresh;
      pe->fresh = 0;
      /* The peer's regions are as the descriptor says right now: checked
       * again once the copies are complete, no RPC. */
      if (!fresh && pe->gm && gen_read(pe->gm) == dr->d.gen) {
        gm = pe->gm;
        atomic_fetch_add(&gm->refs, 1);
      }
    }
  }
  pthread_mutex_unlock(&t->mu);
  desc_unref(dead);
  gen_map_unref(dead_gm);
  if (verdict < 0)
    return NULL;
  int have = dr != NULL;
  if (!have) { /* first contact (or the cache missed): ask the peer now */
    mc_err_t err = {0};
    mc_remote_desc_t rd = {0};
    char *raw = NULL;
    if (describe_remote(t, peer->segment, &rd, &raw, &err) < 0) {
      log_path_once(t, peer->segment, "TCP with pinned staging (the peer's descriptor is "
                    "not available: %s)", err.msg);
      return NULL;
    }
    int same = rd.host_id[0] && !strcmp(rd.host_id, mc_host_identity());
    dr = same ? desc_new(&rd, &raw) : NULL;
    free(raw);
    mc_remote_desc_free(&rd);
    peer_store(t, peer->segment, same ? 1 : -1, desc_ref(dr), 0);
    if (!same) {
      log_path_once(t, peer->segment, "TCP with pinned staging (the peer runs on another "
                    "host)");
      return NULL;
    }
    if (!dr)
      return NULL; /* out of memory: TCP moves them */
  }
  call_t *r = call_new(t, peer, dr, !have || fresh ? V_NONE : gm ? V_GEN : V_RPC);
  if (r)
    r->gm = gm;
  else
    gen_map_unref(gm);
  return r;
}

/* Plans requests [off, off+n) of call c: take[i] per request and the
 * chunk's ops (map_build), the call started (or refetched) as needed.
 * Returns how many ops. */
static size_t plan_chunk(shg_t *t, const mc_peer_t *peer, const mc_xfer_call_t *c, size_t off,
                         size_t n, call_t **runp, int *gave_up, char *take, mc_xfer_op_t **ops,
                         mc_gpu_job_t **pre) {
  size_t nops = 0;
  uint64_t t0 = t->trace ? mc_now_ns() : 0, t1 = 0;
  for (int attempt = 0; attempt < 2 && !*gave_up; attempt++) {
    if (!*runp && !(*runp = call_start(t, peer, attempt > 0))) {
      *gave_up = 1; /* not this call: TCP moves the rest */
      break;
    }
    if (t->trace)
      t1 = mc_now_ns();
    int miss = 0;
    nops = map_build(t, *runp, c, off, n, take, ops, pre, &miss);
    if (t->trace)
      mc_log_info("gpu trace: plan of %zu requests: run %.1f us, map and ops %.1f us", n,
                  (t1 - t0) / 1e3, (mc_now_ns() - t1) / 1e3);
    if (!(miss && (*runp)->validate))
      break;
    /* A GPU request fell outside the cached regions: this and later
     * chunks go with a fresh descriptor (the old call lives on until its
     * copies are done). */
    call_unref(*runp);
    *runp = NULL;
    nops = 0;
  }
  if (nops && !(*runp)->logged && !atomic_exchange(&(*runp)->u->path_logged, 1)) {
    (*runp)->logged = 1; /* once per descriptor: log_path_once logs a segment once anyway */
    log_path_once(t, peer->segment, "same host: GPU memory moves directly between the GPUs "
                  "(%s; copies by %s)", (*runp)->same_process ? "same process" : "CUDA IPC",
                  mc_gpu_d2d_copy_name());
  }
  return nops;
}

/* Sends the call's check (once, with its first op): it holds a reference
 * to the call until validate_done. */
static void send_check(shg_t *t, call_t *run, atomic_int *cancel) {
  size_t rl = strlen(MC_RPC_DESCRIBE);
  mc_xfer_op_t *op = mc_xfer_op_new(MC_XFER_RPC, 0, rl);
  mc_err_t err = {0};
  if (op)
    memcpy(op->ctrl, MC_RPC_DESCRIBE, rl);
  if (!op || mc_xfer_op_seal(op, &err) < 0) {
    mc_xfer_op_free(op);
    mc_xfer_op_t fake = {0};
    fake.arg = run;
    validate_done(&fake, MC_ENOMEM, "out of memory checking the peer's GPU regions");
    return;
  }
  op->done = validate_done;
  op->arg = run;
  op->cancel = cancel;
  mc_peer_t peer = {.segment = run->segment, .host = run->host, .port = run->port};
  t->rpc_async(t->ctx, &peer, op);
}

/* One op: one copy job per local device; the group completes the op.
 * Returns the group, NULL when it failed at once (the op is done). */
static group_t *op_prepare(call_t *run, mc_xfer_op_t *op, mc_gpu_job_t **jobs, size_t *njobs) {
  group_t *g = calloc(1, sizeof *g);
  int one_dev = 1; /* the common case: no per-entry bookkeeping */
  for (uint32_t i = 1; i < op->nent && one_dev; i++)
    one_dev = op->ent[i].dev == op->ent[0].dev;
  char *seen = one_dev ? NULL : calloc(op->nent ? op->nent : 1, 1);
  size_t nj = 0;
  if (!g || (!one_dev && !seen)) {
    free(g);
    free(seen);
    op->done(op, MC_ENOMEM, "out of memory queuing a GPU copy");
    mc_xfer_op_free(op);
    return NULL;
  }
  g->call = run;
  g->op = op;
  for (uint32_t i = 0; i < op->nent; i++) {
    if (one_dev ? i > 0 : seen[i])
      continue;
    int dev = op->ent[i].dev;
    mc_gpu_job_t *j = nj < 16 ? mc_gpu_job_new(dev, MC_GPU_D2D) : NULL;
    if (j && mc_gpu_job_reserve(j, op->nent - i) < 0) {
      mc_gpu_job_free(j);
      j = NULL;
    }
    for (uint32_t k = i; k < op->nent; k++) {
      if (op->ent[k].dev != dev)
        continue;
      if (seen)
        seen[k] = 1;
      mc_cu_ptr loc = (mc_cu_ptr)(uintptr_t)op->ent[k].local;
      mc_cu_ptr mapped = (mc_cu_ptr)op->ent[k].remote;
      if (j && (op->type == MC_XFER_WRITE ? mc_gpu_job_add(j, mapped, loc, op->ent[k].len)
                                          : mc_gpu_job_add(j, loc, mapped, op->ent[k].len)) < 0) {
        mc_gpu_job_free(j);
        j = NULL;
      }
    }
    if (!j) {
      if (g->code == 0) {
        g->code = MC_ENOMEM;
        snprintf(g->msg, sizeof g->msg, "out of memory queuing GPU copies");
      }
      continue;
    }
    j->arg = g;
    j->complete = ipc_job_done;
    jobs[nj++] = j;
  }
  free(seen);
  *njobs = nj;
  return g;
}

/* Starts the ops of one accepted chunk: one group (one copy job per local
 * device) per op; pre[o], when map_build made it, is op o's one job with
 * its group inside. */
static void start_ops(shg_t *t, call_t *run, mc_xfer_op_t **ops, size_t nops,
                      mc_gpu_job_t **pre) {
  for (size_t o = 0; o < nops; o++) {
    mc_gpu_job_t *jobs[16];
    size_t nj = 0;
    atomic_int *cancel = ops[o]->cancel; /* the op may be done once its jobs are queued */
    group_t *g = pre[o] ? pre[o]->arg : op_prepare(run, ops[o], jobs, &nj);
    if (!g)
      continue;
    if (pre[o]) {
      g->call = run;
      jobs[nj++] = pre[o];
    }
    pthread_mutex_lock(&run->mu);
    run->refs++; /* the group's */
    g->remaining = (int)nj;
    int rpc = run->validate == V_RPC;
    if (rpc && !run->checked && nj > 0) {
      g->remaining++; /* the call's check completes it too */
      g->next_waiting = run->waiting;
      run->waiting = g;
    } else if (rpc && run->checked && g->code == 0) {
      g->code = call_verdict(run, g->msg, sizeof g->msg);
    }
    int send = rpc && !run->rpc_sent && nj > 0;
    if (send) {
      run->rpc_sent = 1;
      run->refs++; /* the check's */
    }
    pthread_mutex_unlock(&run->mu);
    if (nj == 0) { /* nothing could be queued */
      if (g->code == 0)
        g->code = MC_ENOMEM;
      group_finish(g);
      continue;
    }
    for (size_t i = 0; i < nj; i++)
      mc_gpu_stager_submit(t->gpu, jobs[i]);
    if (send)
      send_check(t, run, cancel);
  }
}

/* A whole submit call (transport.h submit_call): chunk by chunk, located,
 * mapped into the peer's regions, handed to the engine (accept) and
 * started.  The first chunk is small so the GPU starts early; chunks then
 * double up to MC_GPU_CHUNK, and shrink again towards the end (at most
 * half of what is left) so little completion work remains after the last
 * copy. */
static int shg_submit_call(void *impl, const mc_peer_t *peer, mc_xfer_call_t *c,
                           mc_err_t *err) {
  shg_t *t = impl;
  freed_drain(t);
  sweep_dead_peers(t);
  size_t n = c->n, chunk = t->chunk, step = t->first_chunk < chunk ? t->first_chunk : chunk;
  size_t most = chunk < n ? chunk : n;
  char take_s[256];
  char *take = most <= 256 ? take_s : malloc(most);
  call_t *run = NULL;
  int rc = 0, gave_up = !take; /* out of memory: the next choice moves them */
  for (size_t off = 0, k; off < n && rc == 0; off += k) {
    size_t left = n - off, half = left / 2 > 256 ? left / 2 : 256;
    k = step < half ? step : half;
    if (k > left)
      k = left;
    step = step * 2 < chunk ? step * 2 : chunk;
    if (off + k > c->located && (rc = c->locate(c, off + k, err)) < 0)
      break;
    mc_xfer_op_t *ops[2];
    mc_gpu_job_t *pre[2] = {NULL, NULL};
    size_t nops = 0;
    uint64_t ts[3] = {0};
    if (t->trace)
      ts[0] = mc_now_ns();
    if (!gave_up)
      nops = plan_chunk(t, peer, c, off, k, &run, &gave_up, take, ops, pre);
    if (t->trace)
      ts[1] = mc_now_ns();
    if ((rc = c->accept(c, off, k, nops ? take : NULL, ops, nops, err)) < 0) {
      for (size_t i = 0; i < nops; i++) {
        mc_xfer_op_free(ops[i]);
        mc_gpu_job_free(pre[i]);
      }
      break;
    }
    if (t->trace)
      ts[2] = mc_now_ns();
    if (nops)
      start_ops(t, run, ops, nops, pre);
    if (t->trace && nops)
      mc_log_info("gpu trace: chunk of %zu requests: plan %.1f us, accept %.1f us, start %.1f us",
                  k, (ts[1] - ts[0]) / 1e3, (ts[2] - ts[1]) / 1e3, (mc_now_ns() - ts[2]) / 1e3);
  }
  call_unref(run);
  if (take != take_s)
    free(take);
  return rc;
}

/* Copy jobs run to completion within milliseconds: nothing to cancel (the
 * check is a TCP op, swept there).  Dead peers' mappings go here too. */
static void shg_cancel_sweep(void *impl) { sweep_dead_peers(impl); }

static void shg_stats(void *impl, mc_transport_stats_t *out) {
  shg_t *t = impl;
  pthread_mutex_lock(&t->mu);
  out->same_host_gpu_peers = t->npeers;
  pthread_mutex_unlock(&t->mu);
  pthread_mutex_lock(&t->cache_mu);
  out->same_host_gpu_cached_blocks = t->ncache;
  out->same_host_gpu_block_reuses = t->reuses;
  pthread_mutex_unlock(&t->cache_mu);
}

/* The control connection to `segment` broke (its process exited, or its
 * engine closed, as vLLM's sleep mode does): its descriptor goes, and with
 * it our mappings of its GPU memory once no copy uses them; the next call
 * asks whoever serves the segment then. */
static void shg_peer_lost(void *impl, const char *segment) {
  shg_t *t = impl;
  desc_t *dr = NULL;
  gen_map_t *gm = NULL;
  pthread_mutex_lock(&t->mu);
  ssize_t i = peer_find(t, segment, 0);
  if (i >= 0)
    peer_forget(t, (size_t)i, &dr, &gm);
  pthread_mutex_unlock(&t->mu);
  if (dr)
    mc_log_info("segment %s: connection lost: its cached descriptor is dropped (our mappings "
                "of its GPU memory go once no copy uses them; the next transfer asks it "
                "afresh)", segment);
  desc_unref(dr);
  gen_map_unref(gm);
}

static int shg_start(const mc_transport_env_t *env, void **impl, mc_err_t *err) {
  if (!env->rpc || !env->rpc_async || !env->gpu)
    return mc_err_set(err, MC_EINVAL, "the same-host GPU transport needs the engine's RPC "
                      "calls and its GPU copy worker");
  shg_t *t = calloc(1, sizeof *t);
  if (!t)
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  t->ctx = env->ctx;
  t->rpc = env->rpc;
  t->rpc_async = env->rpc_async;
  t->describe = env->describe;
  t->gpu = env->gpu;
  t->trace = env->gpu_trace;
  t->off = mc_env_long("MC_GPU_IPC", 1, 0, 1) == 0;
  t->chunk = (size_t)mc_env_long("MC_GPU_CHUNK", MC_XFER_MAX_ENTRIES, 1, MC_XFER_MAX_ENTRIES);
  t->first_chunk = (size_t)mc_env_long("MC_GPU_FIRST_CHUNK", 256, 1, MC_XFER_MAX_ENTRIES);
  pthread_mutex_init(&t->mu, NULL);
  pthread_mutex_init(&t->cache_mu, NULL);
  t->pub_fd = -1;
  const char *g = getenv("MC_GPU_GEN");
  t->no_gen = g && !strcmp(g, "0");
  /* Without the page peers check every call by RPC: slower, not wrong. */
  if (!t->no_gen && env->regions && gen_publish(t, env->regions) < 0)
    mc_log_warn("cannot publish this engine's regions version to same-host peers (%s): "
                "their GPU transfers check the descriptor by RPC", strerror(errno));
  *impl = t;
  return 0;
}

/* mc.describe: a peer's plan() asks for our regions (and their IPC
 * handles); also mc_engine_describe_peer's answer, so it is served even
 * with MC_GPU_IPC=0. */
static int shg_serve_rpc(void *impl, const char *from, const char *req, size_t len,
                         char **reply, mc_err_t *err) {
  shg_t *t = impl;
  (void)from, (void)req, (void)len; /* the engine matched the whole text */
  *reply = t->describe ? t->describe(t->ctx) : NULL;
  return *reply ? 0 : mc_err_set(err, MC_ENOMEM, "out of memory describing our segment");
}

/* After the engine stopped submitting and its batches were freed: calls
 * and groups hold no pointer into t except validate_done's cache update,
 * which TCP (stopped first) has run by now. */
static void shg_stop(void *impl) {
  shg_t *t = impl;
  if (!t)
    return;
  freed_drain(t);
  for (size_t i = 0; i < t->ncache; i++)
    free(t->cache[i].p);
  pthread_mutex_destroy(&t->cache_mu);
  for (size_t i = 0; i < t->npeers; i++) {
    desc_unref(t->peers[i].dr);
    gen_map_unref(t->peers[i].gm);
  }
  if (t->pub_page) {
    mc_regions_set_pub(t->regions, NULL);
    munmap(t->pub_page, GEN_PAGE);
    close(t->pub_fd);
  }
  free(t->peers);
  free(t->logged);
  pthread_mutex_destroy(&t->mu);
  free(t);
}

const mc_transport_ops_t mc_same_host_gpu_ops = {
    .name = "gpu-ipc",
    .caps = MC_TCAP_CUDA_MEM | MC_TCAP_SAME_HOST,
    .start = shg_start,
    .stop = shg_stop,
    .reaches = shg_reaches,
    .submit_call = shg_submit_call,
    .cancel_sweep = shg_cancel_sweep,
    .peer_lost = shg_peer_lost,
    .stats = shg_stats,
    .rpc_prefix = MC_RPC_DESCRIBE, /* no trailing '.': the whole text */
    .serve_rpc = shg_serve_rpc,
};
