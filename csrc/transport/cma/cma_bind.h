/* Binds the same-host CPU path to the peer on the TCP connection.
 *
 * A hello (cma_hello.h) is only text: a peer could relay a third engine's
 * hello, and cross-memory attach would then write into that third process.
 * So the initiator asks the kernel: the hello names the target's fd of the
 * connection it was asked on (sock=); the initiator duplicates that fd out
 * of the process it is about to copy into (pidfd_getfd, the same ptrace
 * permission cross-memory attach needs) and checks that it is a TCP socket
 * whose local end is the address the initiator dialled for that segment
 * and whose remote end is a socket of THIS process connected back to it,
 * in this network namespace (read from /proc/<pid>/ns/net, not from the
 * hello).  TCP 4-tuples are unique in a namespace, so only the process
 * holding the other end of our connection passes. */
#ifndef MC_TRANSPORT_CMA_BIND_H
#define MC_TRANSPORT_CMA_BIND_H

#include <stddef.h>
#include <stdint.h>

/* 0 if the process behind pidfd (pid) holds `sock`, the other end of one of
 * our TCP connections to host:port; else -1 with one sentence in why. */
int mc_cma_bind_check(int pidfd, int pid, int sock, const char *host, int port,
                      uint64_t self_netns, char *why, size_t why_len);

#endif
