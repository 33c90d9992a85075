/* The same-host CPU transport (see cma.h): the ops table, first contact,
 * and the copies. */
#include "transport/cma/cma.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "transport/cma/cma_bind.h"
#include "transport/cma/cma_copy.h"
#include "transport/cma/cma_hello.h"
#include "transport/cma/cma_table.h"
#include "util/env.h"
#include "util/log.h"
#include "util/rpc_conn.h"

#define CMA_IOV 1024 /* iovecs per process_vm_* call (UIO_MAXIOV) */

/* A peer's entry: the table's reference plus one per call using it
 * (peer_get / peer_put); it leaves the table when the peer is lost, and is
 * freed (its view closed) by the last reference. */
typedef struct cma_peer {
  char segment[320];
  pthread_mutex_t mu; /* the view: lookups, refresh, reopen */
  mc_cma_view_t v;
  int open;
  atomic_int refs;
} cma_peer_t;

typedef struct cma {
  mc_transport_env_t env;
  mc_cma_table_t *table; /* NULL when switched off */
  mc_cma_copier_t *copier; /* NULL: copies on the submitting thread only */
  mc_cma_hello_t self;
  int off_by_config;  /* mooncake.json "same_host_cpu": false */
  uint64_t merge_max; /* adjacent entries merge into pairs up to this many bytes */
  pthread_mutex_t mu; /* peers[] */
  cma_peer_t **peers;
  size_t npeers;
  _Atomic uint64_t wbytes, rbytes, nops, npeers_ok, nunbound;
} cma_t;

int mc_cma_enabled(void) { return mc_env_bool("MC_SAME_HOST_CPU", 1); }

/* Adjacent entries (consecutive blocks on both sides) merge into one pair of
 * up to MC_CMA_MERGE_KB (default 64; 0: never): one thread then walks the
 * kernel's page tables once per pair instead of once per block (4 KiB
 * blocks x128: +30% on one thread), while pairs stay small enough for the
 * copy threads to share (merging without a bound halved 64 KiB blocks on 8
 * threads: benchmarks/README.md, same-host CPU path). */
#define MERGE_KB 64

static uint64_t merge_from_env(void) {
  return (uint64_t)mc_env_long("MC_CMA_MERGE_KB", MERGE_KB, 0, 1 << 20) << 10;
}

static int cma_start(const mc_transport_env_t *env, void **impl, mc_err_t *err) {
  cma_t *c = calloc(1, sizeof *c);
  if (!c)
    return mc_err_set(err, MC_ENOMEM, "same-host CPU path: out of memory");
  c->env = *env;
  pthread_mutex_init(&c->mu, NULL);
  mc_cma_hello_self(&c->self);
  c->off_by_config = env->off || (env->conf && env->conf->same_host_cpu_off);
  c->merge_max = merge_from_env();
  if (mc_cma_enabled() && !c->off_by_config) {
    mc_err_t e2;
    if (mc_cma_table_create(&c->table, &e2) < 0) /* not fatal: peers use TCP */
      mc_log_warn("same-host CPU path unavailable: %s", e2.msg);
    else
      c->copier = mc_cma_copier_new();
  }
  *impl = c;
  return 0;
}

static void peer_free(cma_peer_t *p) {
  if (p->open)
    mc_cma_view_close(&p->v);
  pthread_mutex_destroy(&p->mu);
  free(p);
}

/* Gives back a reference from peer_get (or the table's, unlinked). */
static void peer_put(cma_peer_t *p) {
  if (p && atomic_fetch_sub(&p->refs, 1) == 1)
    peer_free(p);
}

/* After the engine stopped submitting: only the table's references left. */
static void cma_stop(void *impl) {
  cma_t *c = impl;
  if (!c)
    return;
  for (size_t i = 0; i < c->npeers; i++)
    peer_free(c->peers[i]);
  free(c->peers);
  mc_cma_copier_free(c->copier);
  mc_cma_table_destroy(c->table);
  pthread_mutex_destroy(&c->mu);
  free(c);
}

/* The entry of `segment` with a reference for the caller (peer_put), made
 * when `create`; NULL if none. */
static cma_peer_t *peer_get(cma_t *c, const char *segment, int create) {
  pthread_mutex_lock(&c->mu);
  cma_peer_t *p = NULL;
  for (size_t i = 0; i < c->npeers && !p; i++)
    if (!strcmp(c->peers[i]->segment, segment))
      p = c->peers[i];
  if (!p && create) {
    cma_peer_t **np = realloc(c->peers, (c->npeers + 1) * sizeof *np);
    if (np) {
      c->peers = np;
      p = calloc(1, sizeof *p);
      if (p) {
        snprintf(p->segment, sizeof p->segment, "%s", segment);
        pthread_mutex_init(&p->mu, NULL);
        p->v.pidfd = -1;
        atomic_init(&p->refs, 1); /* the table's */
        c->peers[c->npeers++] = p;
      }
    }
  }
  if (p)
    atomic_fetch_add(&p->refs, 1);
  pthread_mutex_unlock(&c->mu);
  return p;
}

/* Takes `segment`'s entry out of the table: the table's reference is the
 * caller's now (NULL: none). */
static cma_peer_t *peer_unlink(cma_t *c, const char *segment) {
  pthread_mutex_lock(&c->mu);
  cma_peer_t *p = NULL;
  for (size_t i = 0; i < c->npeers && !p; i++)
    if (!strcmp(c->peers[i]->segment, segment)) {
      p = c->peers[i];
      c->peers[i] = c->peers[--c->npeers];
    }
  pthread_mutex_unlock(&c->mu);
  return p;
}

static int cma_reaches(void *impl, const mc_peer_t *peer, mc_mem_kind_t kind, char *why,
                       size_t why_len) {
  cma_t *c = impl;
  if (kind != MC_MEM_HOST) {
    snprintf(why, why_len, "the same-host CPU path moves host memory only");
    return 0;
  }
  if (!c->table) {
    snprintf(why, why_len, "%s",
             c->off_by_config ? "the same-host CPU path is switched off here (mooncake.json "
                                "\"same_host_cpu\": false)"
             : mc_cma_enabled() ? "the same-host CPU path could not start here (see the WARN above)"
                                : "the same-host CPU path is switched off here (MC_SAME_HOST_CPU=0)");
    return 0;
  }
  if (peer->same_host < 0) { /* unknown (0) is settled by the hello's boot id */
    snprintf(why, why_len, "the peer runs on another host");
    return 0;
  }
  char *reply = NULL;
  mc_err_t err;
  if (c->env.rpc(c->env.ctx, peer->segment, MC_CMA_RPC_HELLO, strlen(MC_CMA_RPC_HELLO), 3000,
                 &reply, &err) < 0) {
    snprintf(why, why_len, "the peer did not answer the same-host hello (%s; older version?)",
             err.msg);
    return 0;
  }
  mc_cma_hello_t h;
  int rc = mc_cma_hello_parse(reply, strlen(reply), &h, &err);
  free(reply);
  if (rc < 0) {
    snprintf(why, why_len, "%s", err.msg);
    return 0;
  }
  if (h.off) {
    snprintf(why, why_len, "the peer switched the same-host CPU path off (%s)", h.why);
    return 0;
  }
  if (strcmp(h.boot, c->self.boot) != 0) {
    snprintf(why, why_len, "the peer runs on another host or VM (boot id differs)");
    return 0;
  }
  if (h.pidns != c->self.pidns || (peer->pid > 0 && (uint64_t)peer->pid != h.pid)) {
    snprintf(why, why_len,
             "the peer runs in another pid namespace (a container?): its pid means nothing here");
    return 0;
  }
  if (h.userns != c->self.userns) {
    snprintf(why, why_len, "the peer runs in another user namespace (a container?)");
    return 0;
  }
  if (h.netns != c->self.netns) {
    snprintf(why, why_len, "the peer runs in another network namespace (isolated on purpose: "
             "its traffic stays on the network path)");
    return 0;
  }
  if (h.uid != c->self.uid && geteuid() != 0) {
    snprintf(why, why_len, "the peer runs as uid %llu, we as uid %llu (cross-memory attach "
             "needs the same user or CAP_SYS_PTRACE)", (unsigned long long)h.uid,
             (unsigned long long)c->self.uid);
    return 0;
  }
  if (!h.has_sock) {
    atomic_fetch_add(&c->nunbound, 1);
    snprintf(why, why_len, "the peer's same-host hello does not name its end of the connection "
             "(an older version?): the path is used only where the kernel confirms the process "
             "on the connection");
    return 0;
  }
  cma_peer_t *p = peer_get(c, peer->segment, 1);
  if (!p) {
    snprintf(why, why_len, "out of memory");
    return 0;
  }
  pthread_mutex_lock(&p->mu);
  if (p->open)
    mc_cma_view_close(&p->v);
  p->open = 0;
  rc = mc_cma_view_open(&p->v, (pid_t)h.pid, (int)h.fd, h.token, h.addr, &err);
  int bound = 1;
  if (rc == 0 && mc_cma_bind_check(p->v.pidfd, (int)h.pid, (int)h.sock, peer->host, peer->port,
                                   c->self.netns, why, why_len) < 0) {
    mc_cma_view_close(&p->v); /* nothing was copied: only the table was read */
    bound = 0;
  } else if (rc == 0) {
    p->open = 1;
  }
  pthread_mutex_unlock(&p->mu);
  peer_put(p);
  if (!bound) {
    atomic_fetch_add(&c->nunbound, 1);
    mc_log_warn_rated("same-host CPU path to segment %s refused, its transfers go over TCP: %s",
                peer->segment, why);
    return 0;
  }
  if (rc < 0) {
    snprintf(why, why_len, "%s", err.msg);
    return 0;
  }
  atomic_fetch_add(&c->npeers_ok, 1);
  mc_log_info("same-host CPU path to segment %s: cross-memory attach (process %llu)",
              peer->segment, (unsigned long long)h.pid);
  return 1;
}

/* One op: entries grouped per pinned target region, up to CMA_IOV a call. */
typedef struct cma_run {
  struct iovec l[CMA_IOV], r[CMA_IOV];
  int n;
  uint64_t bytes;
} cma_run_t;

static int flush(mc_cma_copier_t *cp, cma_peer_t *p, int write, cma_run_t *run,
                 mc_err_t *err) {
  int e = run->n ? mc_cma_copy(cp, p->v.pid, write, run->l, run->r, run->n, run->bytes) : 0;
  uint64_t bytes = run->bytes;
  run->n = 0;
  run->bytes = 0;
  if (e == 0)
    return 0;
  if (e == ESRCH)
    return mc_err_set(err, MC_EPEERCLOSED,
                      "process %d serving segment %s exited (same-host CPU path)",
                      (int)p->v.pid, p->segment);
  return mc_err_set(err, MC_ESYS, "%s of %llu bytes from/to segment %s (process %d): %s",
                    write ? "process_vm_writev" : "process_vm_readv",
                    (unsigned long long)bytes, p->segment, (int)p->v.pid,
                    e == EFAULT ? "a local or remote page is not mapped" : strerror(e));
}

static void refuse(mc_xfer_op_t *op, uint32_t k, int code, const char *msg, int *op_code,
                   char *op_msg, size_t op_msg_len) {
  if (op->entry_failed) {
    op->entry_failed(op, k, code, msg); /* done(0) then counts the other entries */
  } else if (*op_code == 0) {
    *op_code = code;
    snprintf(op_msg, op_msg_len, "%s", msg);
  }
}

static void run_op(cma_t *c, cma_peer_t *p, mc_xfer_op_t *op, cma_run_t *run) {
  int write = op->type != MC_XFER_READ;
  mc_err_t err;
  int code = 0;
  char msg[MC_ERR_MSG_MAX] = "";
  uint64_t moved = 0;
  pthread_mutex_lock(&p->mu);
  if (!p->open) {
    code = mc_err_set(&err, MC_EPEERCLOSED, "same-host CPU path to segment %s was lost",
                      p->segment);
  } else if (mc_cma_view_alive(&p->v, p->segment, &err) < 0) {
    code = err.code;
  }
  if (code) {
    pthread_mutex_unlock(&p->mu);
    op->done(op, code, err.msg);
    mc_xfer_op_free(op);
    return;
  }
  mc_cma_view_refresh(&p->v, 0);
  long pinned = -1;
  run->n = 0;
  run->bytes = 0;
  for (uint32_t k = 0; k < op->nent && code == 0; k++) {
    mc_xfer_ent_t *en = &op->ent[k];
    if (op->cancel && atomic_load(op->cancel)) {
      code = mc_err_set(&err, MC_ECANCELED, "canceled");
      snprintf(msg, sizeof msg, "%s", err.msg);
      break;
    }
    const mc_cma_ent_t *ce = mc_cma_view_find(&p->v, en->remote, en->len);
    for (int attempt = 0; attempt < 2 && !(ce && (long)ce->idx == pinned); attempt++) {
      if (!ce) {
        mc_cma_view_refresh(&p->v, 1);
        ce = mc_cma_view_find(&p->v, en->remote, en->len);
        if (!ce)
          break;
      }
      if (pinned >= 0) {
        if (flush(c->copier, p, write, run, &err) < 0) {
          code = err.code;
          snprintf(msg, sizeof msg, "%s", err.msg);
        }
        mc_cma_view_unpin(&p->v, (uint32_t)pinned);
        pinned = -1;
        if (code)
          break;
      }
      if (!ce->cuda && mc_cma_view_pin(&p->v, ce) == 0) {
        pinned = ce->idx;
        break;
      }
      if (ce->cuda)
        break;
      ce = NULL; /* changed under us: re-read the table once */
    }
    if (code)
      break;
    if (!ce || (long)ce->idx != pinned) {
      char m[MC_ERR_MSG_MAX];
      if (ce && ce->cuda)
        snprintf(m, sizeof m,
                 "range [0x%llx, +%llu) of segment %s is GPU memory: the same-host CPU path "
                 "moves host memory only (it became GPU memory after the request was routed; "
                 "retry: the engine sends requests to GPU regions over TCP)",
                 (unsigned long long)en->remote, (unsigned long long)en->len, p->segment);
      else
        snprintf(m, sizeof m,
                 "range [0x%llx, +%llu) is not inside any memory region registered by "
                 "segment %s",
                 (unsigned long long)en->remote, (unsigned long long)en->len, p->segment);
      refuse(op, k, MC_ERANGE, m, &code, msg, sizeof msg);
      if (!op->entry_failed)
        break;
      continue;
    }
    moved += en->len;
    run->bytes += en->len;
    if (run->n > 0 && run->l[run->n - 1].iov_len + en->len <= c->merge_max &&
        (char *)run->l[run->n - 1].iov_base + run->l[run->n - 1].iov_len ==
                          (char *)en->local &&
        (char *)run->r[run->n - 1].iov_base + run->r[run->n - 1].iov_len ==
            (char *)(uintptr_t)en->remote) {
      /* Adjacent on both sides (consecutive blocks): one pair, which the
       * kernel pins and copies in runs of pages instead of page by page. */
      run->l[run->n - 1].iov_len += en->len;
      run->r[run->n - 1].iov_len += en->len;
      continue;
    }
    run->l[run->n] = (struct iovec){en->local, en->len};
    run->r[run->n] = (struct iovec){(void *)(uintptr_t)en->remote, en->len};
    run->n++;
    if (run->n == CMA_IOV && flush(c->copier, p, write, run, &err) < 0) {
      code = err.code;
      snprintf(msg, sizeof msg, "%s", err.msg);
    }
  }
  if (code == 0 && run->n > 0 && flush(c->copier, p, write, run, &err) < 0) {
    code = err.code;
    snprintf(msg, sizeof msg, "%s", err.msg);
  }
  if (pinned >= 0)
    mc_cma_view_unpin(&p->v, (uint32_t)pinned);
  if (code == MC_ESYS && mc_cma_view_alive(&p->v, p->segment, &err) < 0) {
    code = err.code; /* the target died mid-copy: say so */
    snprintf(msg, sizeof msg, "%s", err.msg);
  }
  pthread_mutex_unlock(&p->mu);
  if (code == 0) {
    atomic_fetch_add(write ? &c->wbytes : &c->rbytes, moved);
    atomic_fetch_add(&c->nops, 1);
  }
  op->done(op, code, code ? msg : NULL);
  mc_xfer_op_free(op);
}

static void cma_submit(void *impl, const mc_peer_t *peer, mc_xfer_op_t **ops, size_t nops) {
  cma_t *c = impl;
  cma_peer_t *p = peer_get(c, peer->segment, 0);
  cma_run_t *run = malloc(sizeof *run);
  for (size_t i = 0; i < nops; i++) {
    if (!p || !run) {
      ops[i]->done(ops[i], p ? MC_ENOMEM : MC_EPEERCLOSED,
                   p ? "out of memory" : "same-host CPU path: peer not set up");
      mc_xfer_op_free(ops[i]);
      continue;
    }
    run_op(c, p, ops[i], run);
  }
  free(run);
  peer_put(p);
}

static void cma_cancel_sweep(void *impl) { (void)impl; /* copies finish inside submit() */ }

/* The peer's control connection broke: its view is closed (a copy in
 * progress finishes first: it holds p->mu) and its entry leaves the table
 * (freed by the last call still using it), so a peer lost for good --
 * restarted under a new name -- leaves nothing behind. */
static void cma_peer_lost(void *impl, const char *segment) {
  cma_t *c = impl;
  cma_peer_t *p = peer_unlink(c, segment);
  if (!p)
    return;
  pthread_mutex_lock(&p->mu);
  if (p->open)
    mc_cma_view_close(&p->v);
  p->open = 0;
  pthread_mutex_unlock(&p->mu);
  peer_put(p);
}

static int cma_serve_rpc(void *impl, const char *from, const char *req, size_t len,
                         char **reply, mc_err_t *err) {
  cma_t *c = impl;
  (void)from;
  if (len != strlen(MC_CMA_RPC_HELLO) || memcmp(req, MC_CMA_RPC_HELLO, len) != 0)
    return mc_err_set(err, MC_EPROTO, "unknown same-host RPC");
  mc_cma_hello_t h = c->self;
  if (!c->table) {
    h.off = 1;
    snprintf(h.why, sizeof h.why, "%s",
             c->off_by_config      ? "same_host_cpu false in its mooncake.json"
             : mc_cma_enabled() ? "could not start"
                                : "MC_SAME_HOST_CPU=0");
  } else {
    h.fd = (uint64_t)mc_cma_table_fd(c->table);
    h.addr = (uint64_t)(uintptr_t)mc_cma_table_addr(c->table);
    h.token = mc_cma_table_token(c->table);
    int sock = mc_rpc_conn_fd(); /* the connection that asked: cma_bind.h */
    h.has_sock = sock >= 0;
    h.sock = sock >= 0 ? (uint64_t)sock : 0;
  }
  char buf[512];
  mc_cma_hello_encode(&h, buf, sizeof buf);
  *reply = strdup(buf);
  return *reply ? 0 : mc_err_set(err, MC_ENOMEM, "out of memory");
}

static int cma_mem_register(void *impl, void *addr, uint64_t len, const char *location,
                            mc_err_t *err) {
  cma_t *c = impl;
  if (!c->table)
    return 0;
  return mc_cma_table_add(c->table, (uint64_t)(uintptr_t)addr, len,
                          strncmp(location, "cpu", 3) != 0, err);
}

static int cma_mem_unregister(void *impl, void *addr, int64_t timeout_ms, mc_err_t *err) {
  cma_t *c = impl;
  mc_err_t e2;
  if (!c->table)
    return 0;
  int rc = mc_cma_table_remove(c->table, (uint64_t)(uintptr_t)addr, timeout_ms, &e2);
  if (rc == MC_ENOTFOUND)
    return 0; /* not one of ours: the engine's table names a bad address */
  if (rc < 0)
    return mc_err_set(err, rc, "%s", e2.msg);
  return 0;
}

/* Declines a request to a peer's GPU region: the engine hands it to the
 * next transport (TCP stages it).  Anything else is ours (a range in no
 * region is refused by run_op with the region check's words). */
static int cma_takes(void *impl, const mc_peer_t *peer, uint64_t remote, uint64_t len,
                     uint64_t *lo, uint64_t *hi) {
  cma_t *c = impl;
  cma_peer_t *p = peer_get(c, peer->segment, 0);
  if (!p)
    return 1;
  pthread_mutex_lock(&p->mu);
  int cuda = 0;
  if (p->open) {
    mc_cma_view_refresh(&p->v, 0);
    const mc_cma_ent_t *ce = mc_cma_view_find(&p->v, remote, len);
    if (!ce) {
      mc_cma_view_refresh(&p->v, 1);
      ce = mc_cma_view_find(&p->v, remote, len);
    }
    if (ce) { /* the same answer for the whole region */
      *lo = ce->addr;
      *hi = ce->addr + ce->len;
    }
    cuda = ce && ce->cuda;
  }
  pthread_mutex_unlock(&p->mu);
  peer_put(p);
  return !cuda;
}

void mc_cma_get_stats(void *impl, mc_cma_stats_t *out) {
  memset(out, 0, sizeof *out);
  cma_t *c = impl;
  if (!c)
    return;
  out->bytes_written = atomic_load(&c->wbytes);
  out->bytes_read = atomic_load(&c->rbytes);
  out->ops = atomic_load(&c->nops);
  out->peers = atomic_load(&c->npeers_ok);
  out->refused_unbound = atomic_load(&c->nunbound);
  pthread_mutex_lock(&c->mu);
  out->entries = c->npeers;
  pthread_mutex_unlock(&c->mu);
}

static void cma_stats(void *impl, mc_transport_stats_t *out) {
  mc_cma_stats_t cs;
  mc_cma_get_stats(impl, &cs);
  out->same_host_cpu_bytes_written = cs.bytes_written;
  out->same_host_cpu_bytes_read = cs.bytes_read;
  out->same_host_cpu_ops = cs.ops;
  out->same_host_cpu_peers = cs.peers;
  out->same_host_cpu_refused_unbound = cs.refused_unbound;
  out->same_host_cpu_peer_entries = cs.entries;
}

const mc_transport_ops_t mc_cma_transport_ops = {
    .name = "same-host-cpu",
    .caps = MC_TCAP_HOST_MEM | MC_TCAP_SAME_HOST,
    .start = cma_start,
    .stop = cma_stop,
    .stats = cma_stats,
    .reaches = cma_reaches,
    .submit = cma_submit,
    .cancel_sweep = cma_cancel_sweep,
    .peer_lost = cma_peer_lost,
    .rpc_prefix = "mc.shm.",
    .serve_rpc = cma_serve_rpc,
    .mem_register = cma_mem_register,
    .mem_unregister = cma_mem_unregister,
    .takes = cma_takes,
};
