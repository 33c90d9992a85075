#include "util/rpc_conn.h"

static _Thread_local int cur_fd = -1;

void mc_rpc_conn_set(int fd) { cur_fd = fd; }
int mc_rpc_conn_fd(void) { return cur_fd; }
