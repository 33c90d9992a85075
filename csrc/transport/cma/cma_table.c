/* The target-owned region table of the same-host CPU transport (see
 * cma_table.h for the protocol). */
#include "transport/cma/cma_table.h"
#include "util/bsearch.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

struct mc_cma_table {
  int fd;
  mc_cma_hdr_t *hdr;
  pthread_mutex_t mu; /* writers (register/unregister) */
};

static uint64_t word_of(uint64_t gen, int state) { return gen << 2 | (uint64_t)state; }
static int state_of(uint64_t w) { return (int)(w & 3); }

int mc_cma_table_create(mc_cma_table_t **out, mc_err_t *err) {
  *out = NULL;
  mc_cma_table_t *t = calloc(1, sizeof *t);
  if (!t)
    return mc_err_set(err, MC_ENOMEM, "same-host CPU path: out of memory");
  t->fd = (int)syscall(SYS_memfd_create, "mooncake-cma", (unsigned)MFD_CLOEXEC);
  if (t->fd < 0 || ftruncate(t->fd, (off_t)sizeof(mc_cma_hdr_t)) < 0) {
    int e = errno;
    if (t->fd >= 0)
      close(t->fd);
    free(t);
    return mc_err_set(err, MC_ESYS, "same-host CPU path: memfd for the region table: %s",
                      strerror(e));
  }
  void *p = mmap(NULL, sizeof(mc_cma_hdr_t), PROT_READ | PROT_WRITE, MAP_SHARED, t->fd, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    close(t->fd);
    free(t);
    return mc_err_set(err, MC_ESYS, "same-host CPU path: mapping the region table: %s",
                      strerror(e));
  }
  t->hdr = p;
  uint64_t tok = 0;
  if (getrandom(&tok, sizeof tok, 0) != (ssize_t)sizeof tok)
    tok = (uint64_t)getpid() << 32 ^ (uint64_t)time(NULL) ^ (uint64_t)(uintptr_t)p;
  t->hdr->token = tok | 1;
  t->hdr->magic = MC_CMA_MAGIC;
  pthread_mutex_init(&t->mu, NULL);
  *out = t;
  return 0;
}

void mc_cma_table_destroy(mc_cma_table_t *t) {
  if (!t)
    return;
  atomic_store(&t->hdr->closed, 1);
  atomic_fetch_add(&t->hdr->version, 1);
  munmap(t->hdr, sizeof(mc_cma_hdr_t));
  close(t->fd);
  pthread_mutex_destroy(&t->mu);
  free(t);
}

int mc_cma_table_fd(const mc_cma_table_t *t) { return t->fd; }
uint64_t mc_cma_table_token(const mc_cma_table_t *t) { return t->hdr->token; }
const void *mc_cma_table_addr(const mc_cma_table_t *t) { return t->hdr; }

int mc_cma_table_add(mc_cma_table_t *t, uint64_t addr, uint64_t len, int cuda, mc_err_t *err) {
  pthread_mutex_lock(&t->mu);
  mc_cma_hdr_t *h = t->hdr;
  uint32_t hwm = atomic_load(&h->hwm), i;
  for (i = 0; i < hwm; i++)
    if (state_of(atomic_load(&h->slot[i].word)) == MC_CMA_FREE)
      break;
  if (i == MC_CMA_SLOTS) {
    pthread_mutex_unlock(&t->mu);
    return mc_err_set(err, MC_ETOOBIG,
                      "same-host CPU path: more than %d registered regions; unregister some or "
                      "switch the path off (MC_SAME_HOST_CPU=0)",
                      MC_CMA_SLOTS);
  }
  mc_cma_slot_t *s = &h->slot[i];
  uint64_t gen = (atomic_load(&s->word) >> 2) + 1;
  atomic_store_explicit(&s->addr, addr, memory_order_relaxed);
  atomic_store_explicit(&s->len, len, memory_order_relaxed);
  atomic_store_explicit(&s->cuda, cuda ? 1u : 0u, memory_order_relaxed);
  atomic_store(&s->word, word_of(gen, MC_CMA_LIVE));
  if (i == hwm)
    atomic_store(&h->hwm, hwm + 1);
  atomic_fetch_add(&h->version, 1);
  pthread_mutex_unlock(&t->mu);
  return 0;
}

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int mc_cma_table_remove(mc_cma_table_t *t, uint64_t addr, int64_t timeout_ms, mc_err_t *err) {
  pthread_mutex_lock(&t->mu);
  mc_cma_hdr_t *h = t->hdr;
  uint32_t hwm = atomic_load(&h->hwm);
  mc_cma_slot_t *s = NULL;
  for (uint32_t i = 0; i < hwm && !s; i++) {
    uint64_t w = atomic_load(&h->slot[i].word);
    if (state_of(w) != MC_CMA_FREE && atomic_load(&h->slot[i].addr) == addr)
      s = &h->slot[i];
  }
  if (!s) {
    pthread_mutex_unlock(&t->mu);
    return mc_err_set(err, MC_ENOTFOUND, "same-host CPU path: no region starts at 0x%llx",
                      (unsigned long long)addr);
  }
  uint64_t gen = atomic_load(&s->word) >> 2;
  atomic_store(&s->word, word_of(gen, MC_CMA_DEAD)); /* new pins see it dead */
  atomic_fetch_add(&h->version, 1);
  int64_t deadline = timeout_ms < 0 ? INT64_MAX : now_ms() + timeout_ms;
  while (atomic_load(&s->pins) != 0) {
    if (now_ms() >= deadline) {
      unsigned holder = atomic_load(&s->holder);
      pthread_mutex_unlock(&t->mu);
      return mc_err_set(err, MC_EBUSY,
                        "region 0x%llx is still being copied by process %u on this host "
                        "(same-host CPU path) after %lld ms; retry the unregister later",
                        (unsigned long long)addr, holder, (long long)timeout_ms);
    }
    struct timespec ts = {0, 50000};
    nanosleep(&ts, NULL);
  }
  atomic_store(&s->word, word_of(gen, MC_CMA_FREE));
  atomic_fetch_add(&h->version, 1);
  pthread_mutex_unlock(&t->mu);
  return 0;
}

/* ---- initiator side ---- */

static int pidfd_open_(pid_t pid) {
#ifdef SYS_pidfd_open
  return (int)syscall(SYS_pidfd_open, pid, 0);
#else
  (void)pid;
  errno = ENOSYS;
  return -1;
#endif
}

static const char *ptrace_hint(void) {
  static char hint[160];
  FILE *f = fopen("/proc/sys/kernel/yama/ptrace_scope", "r");
  int scope = -1;
  if (f) {
    if (fscanf(f, "%d", &scope) != 1)
      scope = -1;
    fclose(f);
  }
  if (scope > 0)
    snprintf(hint, sizeof hint,
             "kernel.yama.ptrace_scope is %d (cross-memory attach needs 0, or CAP_SYS_PTRACE)",
             scope);
  else
    snprintf(hint, sizeof hint, "the peer runs as another user or is not dumpable");
  return hint;
}

int mc_cma_view_open(mc_cma_view_t *v, pid_t pid, int fd, uint64_t token, uint64_t remote_addr,
                     mc_err_t *err) {
  memset(v, 0, sizeof *v);
  v->pidfd = -1;
  if (pid <= 0 || fd < 0)
    return mc_err_set(err, MC_EINVAL, "same-host CPU path: bad pid %d / fd %d", (int)pid, fd);
  v->pidfd = pidfd_open_(pid); /* before the checks: then it names the checked process */
  if (v->pidfd < 0 && errno == ESRCH)
    return mc_err_set(err, MC_EPEERCLOSED, "process %d is not running", (int)pid);
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)pid, fd);
  int mfd = open(path, O_RDWR | O_CLOEXEC);
  if (mfd < 0) {
    int e = errno;
    mc_cma_view_close(v);
    if (e == EACCES || e == EPERM)
      return mc_err_set(err, MC_EUNAVAIL, "may not open process %d's region table: %s",
                        (int)pid, ptrace_hint());
    return mc_err_set(err, MC_EUNAVAIL, "cannot open %s: %s (process gone or pid reused?)",
                      path, strerror(e));
  }
  struct stat st;
  void *p = MAP_FAILED;
  if (fstat(mfd, &st) == 0 && st.st_size == (off_t)sizeof(mc_cma_hdr_t))
    p = mmap(NULL, sizeof(mc_cma_hdr_t), PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
  close(mfd);
  if (p == MAP_FAILED) {
    mc_cma_view_close(v);
    return mc_err_set(err, MC_EUNAVAIL,
                      "%s is not a region table (process %d reused by another program?)", path,
                      (int)pid);
  }
  v->hdr = p;
  v->pid = pid;
  if (v->hdr->magic != MC_CMA_MAGIC || v->hdr->token != token) {
    mc_cma_view_close(v);
    return mc_err_set(err, MC_EUNAVAIL,
                      "process %d's fd %d is not the region table its engine described (pid "
                      "reused?)",
                      (int)pid, fd);
  }
  /* The real probe: read the table's first 16 bytes from the target's own
   * memory with cross-memory attach. */
  uint64_t got[2] = {0, 0};
  struct iovec l = {got, sizeof got}, r = {(void *)(uintptr_t)remote_addr, sizeof got};
  ssize_t n = process_vm_readv(pid, &l, 1, &r, 1, 0);
  if (n != (ssize_t)sizeof got) {
    int e = n < 0 ? errno : EIO;
    mc_cma_view_close(v);
    if (e == EPERM || e == EACCES)
      return mc_err_set(err, MC_EUNAVAIL, "process_vm_readv on process %d: %s: %s", (int)pid,
                        strerror(e), ptrace_hint());
    if (e == ENOSYS)
      return mc_err_set(err, MC_EUNAVAIL,
                        "process_vm_readv is not available (kernel without CONFIG_CROSS_MEMORY_"
                        "ATTACH, or blocked by seccomp)");
    return mc_err_set(err, MC_EUNAVAIL, "process_vm_readv on process %d: %s", (int)pid,
                      strerror(e));
  }
  if (got[0] != MC_CMA_MAGIC || got[1] != token) {
    mc_cma_view_close(v);
    return mc_err_set(err, MC_EUNAVAIL,
                      "process %d's memory does not hold the region table its engine described "
                      "(pid reused?)",
                      (int)pid);
  }
  mc_cma_view_refresh(v, 1);
  return 0;
}

void mc_cma_view_close(mc_cma_view_t *v) {
  if (v->hdr)
    munmap(v->hdr, sizeof(mc_cma_hdr_t));
  if (v->pidfd >= 0)
    close(v->pidfd);
  free(v->ents);
  memset(v, 0, sizeof *v);
  v->pidfd = -1;
}

static int cmp_ent(const void *a, const void *b) {
  const mc_cma_ent_t *x = a, *y = b;
  return x->addr < y->addr ? -1 : x->addr > y->addr;
}

void mc_cma_view_refresh(mc_cma_view_t *v, int force) {
  uint64_t ver = atomic_load(&v->hdr->version);
  if (!force && ver == v->seen_version)
    return;
  v->n = 0;
  uint32_t hwm = atomic_load(&v->hdr->hwm);
  if (hwm > MC_CMA_SLOTS) /* the table is the target's; never trust it */
    hwm = MC_CMA_SLOTS;
  if (v->cap < hwm) {
    mc_cma_ent_t *ne = realloc(v->ents, hwm * sizeof *ne);
    if (!ne)
      return; /* finds nothing: "not registered" until memory returns */
    v->ents = ne;
    v->cap = hwm;
  }
  for (uint32_t i = 0; i < hwm; i++) {
    mc_cma_slot_t *s = &v->hdr->slot[i];
    uint64_t w1 = atomic_load(&s->word);
    if (state_of(w1) != MC_CMA_LIVE)
      continue;
    uint64_t a = atomic_load(&s->addr), l = atomic_load(&s->len);
    int cuda = atomic_load(&s->cuda) != 0;
    if (atomic_load(&s->word) != w1 || l == 0 || a + l < a)
      continue;
    v->ents[v->n++] = (mc_cma_ent_t){a, l, w1, i, cuda};
  }
  if (v->n > 1)
    qsort(v->ents, v->n, sizeof *v->ents, cmp_ent);
  v->seen_version = ver;
}

const mc_cma_ent_t *mc_cma_view_find(const mc_cma_view_t *v, uint64_t addr, uint64_t len) {
#define ENT_ADDR(i) v->ents[i].addr
  size_t lo = MC_COUNT_LE(v->n, ENT_ADDR, addr); /* after the last entry with addr <= addr */
#undef ENT_ADDR
  if (lo == 0 || len == 0 || addr + len < addr)
    return NULL;
  const mc_cma_ent_t *e = &v->ents[lo - 1];
  return addr + len <= e->addr + e->len ? e : NULL;
}

int mc_cma_view_pin(mc_cma_view_t *v, const mc_cma_ent_t *e) {
  mc_cma_slot_t *s = &v->hdr->slot[e->idx];
  atomic_fetch_add(&s->pins, 1);
  if (atomic_load(&s->word) != e->word) {
    atomic_fetch_sub(&s->pins, 1);
    return -1;
  }
  atomic_store_explicit(&s->holder, (uint32_t)getpid(), memory_order_relaxed);
  return 0;
}

void mc_cma_view_unpin(mc_cma_view_t *v, uint32_t idx) {
  atomic_fetch_sub(&v->hdr->slot[idx].pins, 1);
}

int mc_cma_view_alive(mc_cma_view_t *v, const char *segment, mc_err_t *err) {
  if (atomic_load(&v->hdr->closed))
    return mc_err_set(err, MC_EPEERCLOSED,
                      "segment %s closed its engine (same-host CPU path, process %d)", segment,
                      (int)v->pid);
  int dead = 0;
  if (v->pidfd >= 0) {
    struct pollfd pf = {v->pidfd, POLLIN, 0};
    dead = poll(&pf, 1, 0) > 0;
  } else {
    dead = kill(v->pid, 0) < 0 && errno == ESRCH;
  }
  if (dead)
    return mc_err_set(err, MC_EPEERCLOSED,
                      "process %d serving segment %s exited (same-host CPU path)", (int)v->pid,
                      segment);
  return 0;
}
