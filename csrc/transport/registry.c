/* Every transport, best first within a memory kind (transport.h, "How the
 * engine chooses one").  Adding a transport: its folder and one line here. */
#include "transport/registry.h"

#include "transport/cma/cma.h"
#include "transport/rdma/rdma.h"
#include "transport/same_host_gpu/same_host_gpu.h"
#include "transport/tcp/tcp.h"

const mc_transport_ops_t *const mc_transport_registry[] = {
    &mc_cma_transport_ops,  /* same-host CPU: process_vm_readv/writev */
    &mc_same_host_gpu_ops,  /* same-host GPU: CUDA IPC */
    &mc_rdma_transport_ops, /* RDMA: one-sided over RC QPs */
    &mc_tcp_transport_ops,  /* TCP: also the control channel (NOTIFY, RPC) */
    NULL,
};

_Static_assert(sizeof mc_transport_registry / sizeof mc_transport_registry[0] <=
                   MC_TRANSPORT_MAX + 1,
               "raise MC_TRANSPORT_MAX");
