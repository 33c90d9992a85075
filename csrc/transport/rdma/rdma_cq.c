/* The completion thread: polls every NIC's CQ, spins briefly after
 * activity, then sleeps on the completion channels (epoll) so an idle
 * engine costs no CPU. */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "transport/rdma/rdma_internal.h"
#include "util/clock.h"
#include "util/log.h"

int mc_rdma_cq_poll_all(mc_rdma_t *t) {
  int total = 0;
  struct ibv_wc wc[32];
  for (int i = 0; i < t->nnic; i++) {
    int k;
    do {
      k = ibv_poll_cq(t->nics[i].cq, 32, wc);
      if (k < 0) {
        mc_log_error("rdma: ibv_poll_cq on %s failed (%d)", t->nics[i].name, k);
        break;
      }
      for (int j = 0; j < k; j++)
        mc_rdma_wc(t, &wc[j]);
      total += k;
    } while (k == 32);
  }
  return total;
}

enum { EV_COMP = 1, EV_ASYNC = 2 };

/* Device events: a port going down fails its QPs at once instead of at
 * the transport retry timeout. */
static void async_events(mc_rdma_t *t, mc_rdma_nic_t *nic) {
  struct ibv_async_event ev;
  while (t->v->get_async_event(nic->ctx, &ev) == 0) {
    enum ibv_event_type ty = ev.event_type;
    t->v->ack_async_event(&ev);
    if (ty == IBV_EVENT_PORT_ERR || ty == IBV_EVENT_DEVICE_FATAL) {
      char msg[MC_ERR_MSG_MAX];
      snprintf(msg, sizeof msg, "port %u of %s went down (verbs event \"%s\": link down, "
               "cable or switch port?); RDMA requests on it were flushed", nic->port, nic->name,
               t->v->event_type_str(ty));
      mc_log_warn("rdma: %s", msg);
      atomic_store(&nic->down, 1);
      mc_rdma_nic_down(t, nic, msg);
    } else if (ty == IBV_EVENT_PORT_ACTIVE) {
      mc_log_info("rdma: port %u of %s is active again", nic->port, nic->name);
      atomic_store(&nic->down, 0);
    } else {
      mc_log_info("rdma: %s on %s", t->v->event_type_str(ty), nic->name);
    }
  }
}

/* Handles what epoll reports: wake-ups, async events, CQ events (acked;
 * the CQs themselves are polled by the loop). */
static void handle_events(mc_rdma_t *t, int timeout_ms) {
  struct epoll_event ev[2 * MC_RDMA_MAX_NICS + 1];
  int n = epoll_wait(t->epfd, ev, 2 * MC_RDMA_MAX_NICS + 1, timeout_ms);
  for (int i = 0; i < n; i++) {
    uint64_t tag = ev[i].data.u64;
    if (tag == 0) {
      uint64_t x;
      if (read(t->efd, &x, sizeof x) < 0) { /* drained */
      }
      continue;
    }
    mc_rdma_nic_t *nic = &t->nics[(tag & 0xffff) - 1];
    if (tag >> 16 == EV_ASYNC) {
      async_events(t, nic);
      continue;
    }
    struct ibv_cq *cq;
    void *ctx;
    while (t->v->get_cq_event(nic->ch, &cq, &ctx) == 0)
      t->v->ack_cq_events(cq, 1);
  }
}

static void *cq_main(void *arg) {
  mc_rdma_t *t = arg;
  uint64_t last = mc_now_ns(), last_events = last;
  while (!atomic_load(&t->stop)) {
    uint64_t now = mc_now_ns();
    /* A busy CQ must not starve device events (a port going down). */
    if (now - last_events > 5000000ull) {
      handle_events(t, 0);
      last_events = now;
    }
    if (mc_rdma_cq_poll_all(t) > 0) {
      last = mc_now_ns();
      continue;
    }
    if (mc_now_ns() - last < t->o.poll_spin_ns) {
      __builtin_ia32_pause();
      continue;
    }
    for (int i = 0; i < t->nnic; i++)
      ibv_req_notify_cq(t->nics[i].cq, 0);
    if (mc_rdma_cq_poll_all(t) > 0) { /* raced with the arming */
      last = mc_now_ns();
      continue;
    }
    handle_events(t, 100);
    last = last_events = mc_now_ns();
  }
  return NULL;
}

int mc_rdma_cq_start(mc_rdma_t *t, mc_err_t *err) {
  t->epfd = epoll_create1(EPOLL_CLOEXEC);
  t->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (t->epfd < 0 || t->efd < 0)
    return mc_err_sys(err, MC_ESYS, errno, "cannot create the RDMA completion thread's epoll");
  struct epoll_event ev = {.events = EPOLLIN, .data.u64 = 0};
  epoll_ctl(t->epfd, EPOLL_CTL_ADD, t->efd, &ev);
  for (int i = 0; i < t->nnic; i++) {
    int fds[2] = {t->nics[i].ch->fd, t->nics[i].ctx->async_fd};
    for (int k = 0; k < 2; k++) {
      fcntl(fds[k], F_SETFL, fcntl(fds[k], F_GETFL) | O_NONBLOCK);
      ev.data.u64 = ((uint64_t)(k ? EV_ASYNC : EV_COMP) << 16) | (uint64_t)(i + 1);
      if (epoll_ctl(t->epfd, EPOLL_CTL_ADD, fds[k], &ev) < 0)
        return mc_err_sys(err, MC_ESYS, errno, "epoll_ctl on %s's %s channel", t->nics[i].name,
                          k ? "async event" : "completion");
    }
  }
  int rc = pthread_create(&t->cq_thread, NULL, cq_main, t);
  if (rc)
    return mc_err_sys(err, MC_ESYS, rc, "cannot start the RDMA completion thread");
  t->cq_running = 1;
  return 0;
}

void mc_rdma_cq_stop(mc_rdma_t *t) {
  if (t->cq_running) {
    atomic_store(&t->stop, 1);
    uint64_t one = 1;
    if (write(t->efd, &one, sizeof one) < 0) { /* the thread wakes within 100 ms anyway */
    }
    pthread_join(t->cq_thread, NULL);
    t->cq_running = 0;
  }
  if (t->epfd >= 0)
    close(t->epfd);
  if (t->efd >= 0)
    close(t->efd);
  t->epfd = t->efd = -1;
}
