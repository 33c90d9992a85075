/* The MR cache: one memory region per registered region and NIC, looked up
 * by address for local keys (lkey) and exported to peers (rkeys).  GPU
 * memory goes through the registration hook (mc_rdma_set_mem_hook). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "transport/rdma/rdma_internal.h"
#include "util/bsearch.h"
#include "util/log.h"

static pthread_mutex_t hook_mu = PTHREAD_MUTEX_INITIALIZER;
static mc_rdma_mem_hook_t hook;
static int have_hook;

void mc_rdma_set_mem_hook(const mc_rdma_mem_hook_t *h) {
  pthread_mutex_lock(&hook_mu);
  have_hook = h != NULL;
  if (h)
    hook = *h;
  pthread_mutex_unlock(&hook_mu);
}

#define ACCESS (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ)

/* NUMA node of the page at addr (get_mempolicy), or -1. */
static int numa_of(void *addr) {
#ifdef SYS_get_mempolicy
  int node = -1;
  /* MPOL_F_NODE | MPOL_F_ADDR */
  if (syscall(SYS_get_mempolicy, &node, NULL, 0UL, addr, 1UL | 2UL) == 0)
    return node;
#else
  (void)addr;
#endif
  return -1;
}

static void dereg_all(mc_rdma_t *t, mc_rdma_mr_t *m) {
  for (int i = 0; i < t->nnic; i++)
    if (m->mr[i])
      t->v->dereg_mr(m->mr[i]);
}

static int register_one(mc_rdma_t *t, void *addr, uint64_t len, uint64_t region,
                        const char *location, mc_err_t *err);

int mc_rdma_register(mc_rdma_t *t, void *addr, uint64_t len, const char *location,
                     mc_err_t *err) {
  int gpu = location && !strncmp(location, "cuda", 4);
  mc_rdma_mem_hook_t h;
  pthread_mutex_lock(&hook_mu);
  int hooked = have_hook;
  h = hook;
  pthread_mutex_unlock(&hook_mu);
  uint64_t *pairs = NULL;
  long np = gpu && hooked && h.pieces ? h.pieces(h.arg, (uint64_t)(uintptr_t)addr, len, &pairs,
                                                  err)
                                      : 0;
  if (np < 0)
    return (int)np;
  if (np <= 1) {
    free(pairs);
    return register_one(t, addr, len, (uint64_t)(uintptr_t)addr, location, err);
  }
  /* Driver-mapped GPU memory of several physical chunks: an MR per chunk,
   * all under this region (unregistered together). */
  int rc = 0;
  long i = 0;
  for (; i < np && rc == 0; i++)
    rc = register_one(t, (void *)(uintptr_t)pairs[2 * i], pairs[2 * i + 1],
                      (uint64_t)(uintptr_t)addr, location, err);
  free(pairs);
  if (rc < 0)
    mc_rdma_unregister(t, addr);
  return rc;
}

static int register_one(mc_rdma_t *t, void *addr, uint64_t len, uint64_t region,
                        const char *location, mc_err_t *err) {
  mc_rdma_mr_t m = {.addr = (uint64_t)(uintptr_t)addr, .len = len, .pref_nic = -1,
                    .region = region};
  int gpu = location && !strncmp(location, "cuda", 4);
  mc_rdma_mem_hook_t h;
  pthread_mutex_lock(&hook_mu);
  int hooked = have_hook;
  h = hook;
  pthread_mutex_unlock(&hook_mu);
  if (gpu && !hooked)
    return mc_err_set(err, MC_EUNAVAIL,
                      "0x%llx (%s): GPU memory over RDMA needs GPUDirect registration (DMA-BUF "
                      "or nvidia-peermem), which this build does not provide yet; stage it "
                      "through host memory",
                      (unsigned long long)m.addr, location);
  for (int i = 0; i < t->nnic; i++) {
    mc_rdma_nic_t *n = &t->nics[i];
    if (gpu) {
      m.mr[i] = h.reg(h.arg, n->pd, addr, (size_t)len, ACCESS, location, err);
      if (!m.mr[i]) {
        dereg_all(t, &m);
        return mc_err_prefix(err, "registering %s memory 0x%llx+%llu on %s", location,
                             (unsigned long long)m.addr, (unsigned long long)len, n->name);
      }
    } else if (!(m.mr[i] = t->v->reg_mr(n->pd, addr, (size_t)len, ACCESS))) {
      int e = errno;
      dereg_all(t, &m);
      return mc_err_sys(err, e == ENOMEM ? MC_ENOMEM : MC_ESYS, e,
                        "ibv_reg_mr(0x%llx, %llu bytes) on %s failed%s",
                        (unsigned long long)m.addr, (unsigned long long)len, n->name,
                        e == ENOMEM || e == EPERM
                            ? " (locked-memory limit? raise `ulimit -l` / memlock)"
                            : "");
    }
  }
  if (gpu && h.preferred_nic) {
    const char *names[MC_RDMA_MAX_NICS];
    for (int i = 0; i < t->nnic; i++)
      names[i] = t->nics[i].name;
    m.pref_nic = h.preferred_nic(h.arg, location, names, t->nnic);
  } else if (!gpu && t->nnic > 1) {
    int node = numa_of(addr);
    for (int i = 0; i < t->nnic && node >= 0 && m.pref_nic < 0; i++)
      if (t->nics[i].numa_node == node)
        m.pref_nic = i;
  }
  pthread_rwlock_wrlock(&t->mr_lock);
  if (t->nmr == t->cap_mr) {
    size_t nc = t->cap_mr ? 2 * t->cap_mr : 16;
    mc_rdma_mr_t *nv = realloc(t->mrs, nc * sizeof *nv);
    if (!nv) {
      pthread_rwlock_unlock(&t->mr_lock);
      dereg_all(t, &m);
      return mc_err_set(err, MC_ENOMEM, "out of memory");
    }
    t->mrs = nv;
    t->cap_mr = nc;
  }
  size_t pos = 0;
  while (pos < t->nmr && t->mrs[pos].addr < m.addr)
    pos++;
  memmove(t->mrs + pos + 1, t->mrs + pos, (t->nmr - pos) * sizeof *t->mrs);
  t->mrs[pos] = m;
  t->nmr++;
  pthread_rwlock_unlock(&t->mr_lock);
  return 0;
}

void mc_rdma_unregister(mc_rdma_t *t, void *addr) {
  pthread_rwlock_wrlock(&t->mr_lock);
  for (size_t i = 0; i < t->nmr;) { /* every MR of the region (one per GPU chunk) */
    if (t->mrs[i].region == (uint64_t)(uintptr_t)addr) {
      dereg_all(t, &t->mrs[i]);
      memmove(t->mrs + i, t->mrs + i + 1, (t->nmr - i - 1) * sizeof *t->mrs);
      t->nmr--;
    } else {
      i++;
    }
  }
  pthread_rwlock_unlock(&t->mr_lock);
}

const mc_rdma_mr_t *mc_rdma_mr_find(mc_rdma_t *t, uint64_t addr, uint64_t len) {
#define MR_ADDR(i) t->mrs[i].addr
  size_t lo = MC_COUNT_LE(t->nmr, MR_ADDR, addr); /* after the last with start <= addr */
#undef MR_ADDR
  if (lo == 0)
    return NULL;
  const mc_rdma_mr_t *m = &t->mrs[lo - 1];
  return addr - m->addr <= m->len && len <= m->len - (addr - m->addr) ? m : NULL;
}

int mc_rdma_mr_export(mc_rdma_t *t, mc_rdma_region_info_t **out, size_t *n) {
  pthread_rwlock_rdlock(&t->mr_lock);
  *n = t->nmr;
  *out = calloc(t->nmr ? t->nmr : 1, sizeof **out);
  if (!*out) {
    pthread_rwlock_unlock(&t->mr_lock);
    return MC_ENOMEM;
  }
  for (size_t i = 0; i < t->nmr; i++) {
    (*out)[i].addr = t->mrs[i].addr;
    (*out)[i].len = t->mrs[i].len;
    for (int k = 0; k < t->nnic; k++)
      (*out)[i].rkey[k] = t->mrs[i].mr[k]->rkey;
  }
  pthread_rwlock_unlock(&t->mr_lock);
  return 0;
}

void mc_rdma_mr_free_all(mc_rdma_t *t) {
  for (size_t i = 0; i < t->nmr; i++)
    dereg_all(t, &t->mrs[i]);
  free(t->mrs);
  t->mrs = NULL;
  t->nmr = t->cap_mr = 0;
}
