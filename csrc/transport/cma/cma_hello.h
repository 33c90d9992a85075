/* The same-host CPU transport's handshake text (RPC "mc.shm.hello"):
 * what a target tells an initiator so it can map the target's region table
 * and check that both really share a host, a pid namespace and a user.
 *
 *   cma1 boot=<boot id> pidns=<inode> userns=<inode> netns=<inode> uid=<n> pid=<n> fd=<n>
 *        addr=<hex> token=<hex> [sock=<n>]
 *   sock: the target's fd of the TCP connection the hello was asked on; the
 *   initiator checks with the kernel that this process holds the other end
 *   of ITS connection (cma_bind.h), so a peer relaying a third engine's
 *   hello cannot redirect transfers there.  Without it the path is refused.
 *   off <reason>          (the target switched the path off)
 *
 * Parsed from a peer's bytes: strict, bounded, fuzzed (tests/fuzz). */
#ifndef MC_TRANSPORT_CMA_HELLO_H
#define MC_TRANSPORT_CMA_HELLO_H

#include <stddef.h>
#include <stdint.h>

#include "util/errors.h"

#define MC_CMA_RPC_HELLO "mc.shm.hello"

typedef struct mc_cma_hello {
  int off;          /* 1: "off", reason in why */
  char why[128];
  char boot[64];    /* /proc/sys/kernel/random/boot_id */
  uint64_t pidns, userns, netns, uid, pid, fd, addr, token;
  int has_sock;     /* sock given */
  uint64_t sock;
} mc_cma_hello_t;

/* This process's identity (boot id, namespace inodes, uid). */
void mc_cma_hello_self(mc_cma_hello_t *h);
/* Encodes into buf (NUL-terminated); returns the length. */
size_t mc_cma_hello_encode(const mc_cma_hello_t *h, char *buf, size_t cap);
/* MC_EPROTO with a message naming the bad field. */
int mc_cma_hello_parse(const char *s, size_t len, mc_cma_hello_t *out, mc_err_t *err);

#endif
