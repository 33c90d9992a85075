/* The engine's transport choice (engine/peers.c) with fake transports:
 * a request the chosen transport declines (takes() says no, e.g. the
 * same-host CPU path and a peer's GPU region) goes to the next one that
 * reaches the peer, and a transport's refused unregister fails the
 * engine's and stops there. */
#include <pthread.h>
#include <stdint.h>

#include "engine/engine_internal.h"
#include "gpu/gpu_ipc.h"
#include "testlib.h"

/* The fake engine's slots, in preference order (as registry.c orders the real ones). */
enum { SHM = 0, RDMA = 1, TCP = 2 };
static int unregistered[MC_TRANSPORT_MAX];

static void f_submit(void *impl, const mc_peer_t *peer, mc_xfer_op_t **ops, size_t nops) {
  (void)impl, (void)peer, (void)ops, (void)nops;
}
static int f_reaches(void *impl, const mc_peer_t *peer, mc_mem_kind_t kind, char *why,
                     size_t why_len) {
  (void)impl, (void)peer, (void)kind, (void)why, (void)why_len;
  return 1;
}
/* The fake same-host path: remote addresses from 0x10000 on are "GPU";
 * its answer holds for [0, 0x10000) or [0x10000, 0x20000). */
static int takes_calls;
static int f_takes(void *impl, const mc_peer_t *peer, uint64_t remote, uint64_t len,
                   uint64_t *lo, uint64_t *hi) {
  (void)impl, (void)peer, (void)len;
  takes_calls++;
  *lo = remote < 0x10000 ? 0 : 0x10000;
  *hi = remote < 0x10000 ? 0x10000 : 0x20000;
  return remote < 0x10000;
}
static int shm_unreg(void *impl, void *addr, int64_t timeout_ms, mc_err_t *err) {
  (void)impl, (void)timeout_ms;
  unregistered[SHM]++;
  return addr == (void *)0x5000
             ? mc_err_set(err, MC_EBUSY, "region 0x5000 is still being copied by process 7")
             : 0;
}
static int rdma_unreg(void *impl, void *addr, int64_t timeout_ms, mc_err_t *err) {
  (void)impl, (void)addr, (void)timeout_ms, (void)err;
  unregistered[RDMA]++;
  return 0;
}

static const mc_transport_ops_t shm_ops = {
    .name = "fake-shm", .caps = MC_TCAP_HOST_MEM | MC_TCAP_SAME_HOST, .reaches = f_reaches,
    .submit = f_submit, .takes = f_takes, .mem_unregister = shm_unreg};
static const mc_transport_ops_t rdma_ops = {.name = "fake-rdma",
                                            .caps = MC_TCAP_HOST_MEM | MC_TCAP_CUDA_MEM,
                                            .submit = f_submit, .mem_unregister = rdma_unreg};
static const mc_transport_ops_t tcp_ops = {
    .name = "fake-tcp", .caps = MC_TCAP_HOST_MEM | MC_TCAP_CUDA_MEM | MC_TCAP_CTRL,
    .submit = f_submit};

static mc_engine_t *fake_engine(int with_rdma) {
  mc_engine_t *e = calloc(1, sizeof *e);
  if (!e)
    return NULL;
  pthread_mutex_init(&e->peers_mu, NULL);
  e->tr[SHM].ops = &shm_ops;
  if (with_rdma)
    e->tr[RDMA].ops = &rdma_ops;
  e->tr[TCP].ops = &tcp_ops;
  e->ctrl = TCP;
  return e;
}

static void fake_engine_free(mc_engine_t *e) {
  mc_peers_free(e);
  pthread_mutex_destroy(&e->peers_mu);
  free(e);
}

static void declined_request_goes_to_next(void) {
  mc_peer_t peer = {.segment = "p:1", .host = "h", .port = 1};
  for (int with_rdma = 0; with_rdma < 2; with_rdma++) {
    mc_engine_t *e = fake_engine(with_rdma);
    CHECK(e != NULL);
    int via = mc_transport_choose(e, &peer, MC_MEM_HOST, 1);
    CHECK_EQ_INT(via, SHM);
    mc_takes_memo_t memo = {0};
    takes_calls = 0;
    CHECK_EQ_INT(mc_transport_for_request(e, &peer, MC_MEM_HOST, via, 0x1000, 64, &memo),
                 SHM);
    int next = with_rdma ? RDMA : TCP;
    CHECK_EQ_INT(mc_transport_for_request(e, &peer, MC_MEM_HOST, via, 0x18000, 64, &memo),
                 next);
    /* Inside the range just answered: not asked again; outside it: asked. */
    CHECK_EQ_INT(mc_transport_for_request(e, &peer, MC_MEM_HOST, via, 0x1f000, 0x1000, &memo),
                 next);
    CHECK_EQ_INT(takes_calls, 2);
    CHECK_EQ_INT(mc_transport_for_request(e, &peer, MC_MEM_HOST, via, 0x1f000, 0x2000, &memo),
                 next); /* crosses 0x20000: asked (the fake says GPU) */
    CHECK_EQ_INT(takes_calls, 3);
    CHECK_EQ_INT(mc_transport_for_request(e, &peer, MC_MEM_HOST, via, 0x2000, 64, &memo),
                 SHM);
    CHECK_EQ_INT(takes_calls, 4);
    /* A peer known to be elsewhere never gets the same-host path. */
    peer.same_host = -1;
    mc_engine_t *e2 = fake_engine(with_rdma);
    CHECK_EQ_INT(mc_transport_choose(e2, &peer, MC_MEM_HOST, 1), next);
    peer.same_host = 0;
    fake_engine_free(e2);
    fake_engine_free(e);
  }
}

static void refused_unregister_fails_and_stops(void) {
  mc_engine_t *e = fake_engine(1);
  CHECK(e != NULL);
  mc_err_t err = {0};
  memset(unregistered, 0, sizeof unregistered);
  CHECK_EQ_INT(mc_transports_unregister(e, (void *)0x5000, 10, &err), MC_EBUSY);
  CHECK_CONTAINS(err.msg, "still being copied by process 7");
  CHECK_EQ_INT(unregistered[SHM], 1);
  CHECK_EQ_INT(unregistered[RDMA], 0); /* access not revoked: still registered */
  CHECK_EQ_INT(mc_transports_unregister(e, (void *)0x6000, 10, &err), 0);
  CHECK_EQ_INT(unregistered[RDMA], 1);
  fake_engine_free(e);
}

/* The peer's same-host flag comes from its descriptor's host identity:
 * another boot id is another host (the same-host transports are not even
 * asked), the same one this host, none not known. */
static void same_host_from_descriptor(void) {
  mc_segment_desc_t d = {0};
  CHECK_EQ_INT(mc_peer_same_host(&d), 0);
  snprintf(d.host_id, sizeof d.host_id, "%s", mc_host_identity());
  CHECK_EQ_INT(mc_peer_same_host(&d), 1);
  char *slash = strchr(d.host_id, '/');
  CHECK(slash != NULL);
  snprintf(slash, sizeof d.host_id - (size_t)(slash - d.host_id), "/another-hostname");
  CHECK_EQ_INT(mc_peer_same_host(&d), 1); /* same kernel: this host */
  snprintf(d.host_id, sizeof d.host_id, "00000000-0000-0000-0000-000000000000/h");
  CHECK_EQ_INT(mc_peer_same_host(&d), -1);
}

int main(void) {
  RUN(same_host_from_descriptor);
  RUN(declined_request_goes_to_next);
  RUN(refused_unregister_fails_and_stops);
  TEST_MAIN_END();
}
