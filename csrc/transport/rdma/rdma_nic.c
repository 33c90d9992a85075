/* Transport lifecycle: opening the NICs named by device_name (port, GID,
 * MTU, NUMA node from sysfs), PD, CQ and completion channel per NIC. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "transport/rdma/rdma_devices.h"
#include "transport/rdma/rdma_gid.h"
#include "transport/rdma/rdma_internal.h"
#include "util/log.h"

#define CQ_DEPTH 4096

static int read_sysfs(const char *path, char *buf, size_t len) {
  FILE *f = fopen(path, "r");
  if (!f)
    return -1;
  size_t n = fread(buf, 1, len - 1, f);
  fclose(f);
  buf[n] = '\0';
  while (n && (buf[n - 1] == '\n' || buf[n - 1] == ' '))
    buf[--n] = '\0';
  return 0;
}

static uint32_t mtu_bytes(enum ibv_mtu m) {
  return m >= IBV_MTU_256 && m <= IBV_MTU_4096 ? 128u << m : 1024;
}

/* GID table of a port with RoCE v2 flags from sysfs. */
static int choose_gid(mc_rdma_t *t, mc_rdma_nic_t *n, int tbl_len, mc_err_t *err) {
  if (tbl_len > 256)
    tbl_len = 256;
  mc_gid_entry_t *tab = calloc((size_t)(tbl_len ? tbl_len : 1), sizeof *tab);
  if (!tab)
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  for (int i = 0; i < tbl_len; i++) {
    union ibv_gid g;
    if (t->v->query_gid(n->ctx, n->port, i, &g) == 0)
      memcpy(tab[i].raw, g.raw, 16);
    char path[256], type[32] = "";
    snprintf(path, sizeof path, "/sys/class/infiniband/%s/ports/%u/gid_attrs/types/%d", n->name,
             n->port, i);
    if (read_sysfs(path, type, sizeof type) == 0)
      tab[i].roce_v2 = strstr(type, "v2") != NULL;
  }
  int idx = mc_gid_choose(n->name, tab, tbl_len, t->o.gid_index, n->gid_why, sizeof n->gid_why,
                          err);
  if (idx >= 0)
    memcpy(n->info.gid, tab[idx].raw, 16);
  free(tab);
  return idx;
}

static int open_nic(mc_rdma_t *t, struct ibv_device *dev, mc_rdma_nic_t *n, mc_err_t *err) {
  const mc_verbs_t *v = t->v;
  n->ctx = v->open_device(dev);
  if (!n->ctx)
    return mc_err_sys(err, MC_EUNAVAIL, errno, "cannot open RDMA device %s (permissions on "
                      "/dev/infiniband/uverbs*?)", n->name);
  struct ibv_device_attr da;
  if (v->query_device(n->ctx, &da) != 0)
    return mc_err_sys(err, MC_EUNAVAIL, errno, "ibv_query_device(%s) failed", n->name);
  n->max_rd_atomic = da.max_qp_rd_atom < 16 ? da.max_qp_rd_atom : 16;
  if (n->max_rd_atomic < 1)
    n->max_rd_atomic = 1;
  /* The first active port. */
  struct ibv_port_attr pa;
  int found = 0;
  for (int p = 1; p <= da.phys_port_cnt && !found; p++) {
    memset(&pa, 0, sizeof pa);
    if (v->query_port(n->ctx, (uint8_t)p, &pa) == 0 && pa.state == IBV_PORT_ACTIVE) {
      n->port = (uint8_t)p;
      found = 1;
    }
  }
  if (!found)
    return mc_err_set(err, MC_EUNAVAIL,
                      "RDMA device %s has no active port (%d ports; check `ibv_devinfo -d %s`, "
                      "the cable/link and the subnet manager)",
                      n->name, da.phys_port_cnt, n->name);
  n->info.ethernet = pa.link_layer == IBV_LINK_LAYER_ETHERNET;
  n->info.lid = pa.lid;
  n->info.mtu = mtu_bytes(pa.active_mtu);
  memcpy(n->info.name, n->name, sizeof n->info.name);
  if (n->info.ethernet) {
    if ((n->gid_index = choose_gid(t, n, pa.gid_tbl_len, err)) < 0)
      return n->gid_index;
  } else {
    /* InfiniBand: LID routing; GID 0 kept for the record. */
    if (pa.lid == 0)
      return mc_err_set(err, MC_EUNAVAIL, "InfiniBand device %s port %u has LID 0: no subnet "
                        "manager has configured it (run opensm)", n->name, n->port);
    union ibv_gid g;
    if (v->query_gid(n->ctx, n->port, 0, &g) == 0)
      memcpy(n->info.gid, g.raw, 16);
    n->gid_index = 0;
    snprintf(n->gid_why, sizeof n->gid_why, "InfiniBand, LID %u", pa.lid);
  }
  char path[256], buf[32];
  snprintf(path, sizeof path, "/sys/class/infiniband/%s/device/numa_node", n->name);
  n->numa_node = read_sysfs(path, buf, sizeof buf) == 0 ? atoi(buf) : -1;
  if (!(n->pd = v->alloc_pd(n->ctx)))
    return mc_err_sys(err, MC_EUNAVAIL, errno, "ibv_alloc_pd(%s) failed", n->name);
  if (!(n->ch = v->create_comp_channel(n->ctx)))
    return mc_err_sys(err, MC_EUNAVAIL, errno, "ibv_create_comp_channel(%s) failed", n->name);
  int cqe = CQ_DEPTH < da.max_cqe ? CQ_DEPTH : da.max_cqe;
  if (!(n->cq = v->create_cq(n->ctx, cqe, n, n->ch, 0)))
    return mc_err_sys(err, MC_EUNAVAIL, errno, "ibv_create_cq(%s, %d entries) failed", n->name,
                      cqe);
  return 0;
}

static void close_nic(mc_rdma_t *t, mc_rdma_nic_t *n) {
  if (n->cq)
    t->v->destroy_cq(n->cq);
  if (n->ch)
    t->v->destroy_comp_channel(n->ch);
  if (n->pd)
    t->v->dealloc_pd(n->pd);
  if (n->ctx)
    t->v->close_device(n->ctx);
}

int mc_rdma_start(const mc_rdma_opts_t *o, const mc_rdma_hooks_t *h, mc_rdma_t **out,
                  mc_err_t *err) {
  int rc = mc_rdma_check_devices(o->device_name, err);
  if (rc < 0)
    return rc;
  const mc_verbs_t *v = mc_verbs_load(err);
  if (!v)
    return err ? err->code : MC_EUNAVAIL;
  mc_rdma_t *t = calloc(1, sizeof *t);
  if (!t)
    return mc_err_set(err, MC_ENOMEM, "out of memory");
  t->v = v;
  t->o = *o;
  t->hooks = *h;
  t->epfd = t->efd = -1;
  /* Endpoint generations grow across restarts of a process that keeps its
   * segment name, so a peer can tell a new connection from a stale one. */
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  t->next_epoch = (uint64_t)now.tv_sec * 1000000ull + (uint64_t)now.tv_nsec / 1000;
  pthread_mutex_init(&t->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&t->cv, &ca);
  pthread_condattr_destroy(&ca);
  pthread_rwlock_init(&t->mr_lock, NULL);
  int ndev = 0;
  struct ibv_device **list = v->get_device_list(&ndev);
  const char *p = o->device_name;
  while (rc == 0 && *p) {
    const char *end = strchr(p, ',');
    size_t l = end ? (size_t)(end - p) : strlen(p);
    if (l && t->nnic == MC_RDMA_MAX_NICS) {
      rc = mc_err_set(err, MC_EINVAL, "device_name lists more than %d NICs", MC_RDMA_MAX_NICS);
      break;
    }
    for (int i = 0; l && list && i < ndev; i++) {
      const char *nm = v->get_device_name(list[i]);
      if (strlen(nm) == l && !strncmp(nm, p, l)) {
        mc_rdma_nic_t *n = &t->nics[t->nnic];
        n->idx = t->nnic++;
        snprintf(n->name, sizeof n->name, "%s", nm);
        rc = open_nic(t, list[i], n, err);
        break;
      }
    }
    p = end ? end + 1 : p + l;
  }
  if (list)
    v->free_device_list(list);
  if (rc == 0 && t->nnic == 0)
    rc = mc_err_set(err, MC_EINVAL, "device_name \"%s\" names no RDMA device", o->device_name);
  if (rc == 0)
    rc = mc_rdma_cq_start(t, err);
  if (rc < 0) {
    mc_rdma_stop(t);
    return rc;
  }
  char d[1024];
  mc_rdma_describe(t, d, sizeof d);
  mc_log_info("rdma: %s; %d QPs per NIC per peer, %u-byte slices, send queue %d, %llu KiB in "
              "flight per QP, timeout exponent %d, retry %d",
              d, t->o.qps_per_nic, t->o.slice_size, t->o.max_wr,
              (unsigned long long)(t->o.qp_inflight_bytes >> 10), t->o.timeout, t->o.retry_cnt);
  *out = t;
  return 0;
}

void mc_rdma_describe(mc_rdma_t *t, char *buf, size_t len) {
  size_t pos = 0;
  buf[0] = '\0';
  for (int i = 0; i < t->nnic && pos < len; i++) {
    mc_rdma_nic_t *n = &t->nics[i];
    char gid[40];
    mc_gid_format(n->info.gid, gid);
    int w = snprintf(buf + pos, len - pos, "%s%s (port %u, %s, GID %d %s [%s], MTU %u, NUMA %d)",
                     i ? ", " : "", n->name, n->port, n->info.ethernet ? "RoCE" : "InfiniBand",
                     n->gid_index, gid, n->gid_why, n->info.mtu, n->numa_node);
    if (w > 0)
      pos += (size_t)w;
  }
}

void mc_rdma_stop(mc_rdma_t *t) {
  if (!t)
    return;
  mc_rdma_cq_stop(t);
  mc_rdma_ep_free_all(t);
  mc_rdma_mr_free_all(t);
  for (int i = 0; i < t->nnic; i++)
    close_nic(t, &t->nics[i]);
  pthread_mutex_destroy(&t->mu);
  pthread_cond_destroy(&t->cv);
  pthread_rwlock_destroy(&t->mr_lock);
  free(t);
}
