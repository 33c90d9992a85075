/* The socket an RPC being served arrived on: the TCP transport sets it
 * (thread-local) around its on_rpc hook, so an RPC handler further up can
 * bind its answer to the connection that asked (the same-host CPU path's
 * hello names it: transport/cma/cma_bind.h).  -1 outside an RPC. */
#ifndef MC_UTIL_RPC_CONN_H
#define MC_UTIL_RPC_CONN_H

void mc_rpc_conn_set(int fd);
int mc_rpc_conn_fd(void);

#endif
