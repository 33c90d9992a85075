/* The same-host GPU transport (CUDA IPC between two processes on one
 * host, or one address space): GPU memory moves directly between the GPUs
 * by the engine's copy worker, no socket on the data path.  Behind the
 * transport interface (transport/transport.h) as a transport that takes
 * whole submit calls: submit_call() chunks the call, maps each request
 * into the peer's CUDA regions (from the peer's descriptor, the
 * mc.describe RPC) and takes those that map; the rest go to the engine's
 * next choice (RDMA or TCP with pinned staging).
 * MC_GPU_IPC=0 leaves it unstarted.  docs/architecture.md "Same-host path". */
#ifndef MC_TRANSPORT_SAME_HOST_GPU_H
#define MC_TRANSPORT_SAME_HOST_GPU_H

#include "transport/transport.h"

/* Its ops table: started by the engine through ops->start (env->gpu and
 * env->rpc_async are required). */
extern const mc_transport_ops_t mc_same_host_gpu_ops;

#endif
