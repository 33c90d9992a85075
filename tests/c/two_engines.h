/* Two TCP engines in one process over loopback (127.0.0.1, P2P handshake),
 * each with a host buffer registered as "cpu": the set-up test_engine.c and
 * test_gate.c share (compiled into both by the Makefile).  A initiates, B
 * is the target; A's buffer is registered too, as the local side of its
 * transfers. */
#ifndef MC_TESTS_TWO_ENGINES_H
#define MC_TESTS_TWO_ENGINES_H

#include <stddef.h>
#include <stdint.h>

#include "engine/engine.h"

extern mc_engine_t *A, *B;
extern uint8_t *abuf, *bbuf;

/* One more engine like A and B; NULL, with why on stderr, if it fails. */
mc_engine_t *mk(void);

/* A, B and their bufsz-byte buffers: 0, or -1 with why on stderr. */
int two_engines_up(size_t bufsz);

/* Destroys A and B and frees their buffers. */
void two_engines_down(void);

#endif
