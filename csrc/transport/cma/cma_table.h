/* The same-host CPU transport's region table: a small shared-memory table
 * (a memfd) that the TARGET owns and writes, and that initiators on the
 * same host map to check and pin the target's regions before they copy
 * with process_vm_readv/writev (cross-memory attach).
 *
 * The target publishes every host region it registers (a slot: address,
 * length, a generation+state word and a pin count).  An initiator pins a
 * slot (pins += 1, then re-reads the word: still the live slot it looked
 * up?), copies, and unpins.  Removing a region marks its slot dead first,
 * then waits for its pins to drop (bounded), so after
 * mc_cma_table_remove() returns 0 no initiator touches it again; both
 * sides use sequentially consistent atomics, so either the initiator sees
 * the slot dead or the target sees the pin.  The table never holds a
 * pointer, only numbers, and an initiator validates everything it reads
 * from it (an initiator only reads what the target wrote).
 */
#ifndef MC_TRANSPORT_CMA_TABLE_H
#define MC_TRANSPORT_CMA_TABLE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "util/errors.h"

#define MC_CMA_MAGIC 0x3142544d43434d4dull /* "MMCCMTB1" */
#define MC_CMA_SLOTS 4096

enum { MC_CMA_FREE = 0, MC_CMA_LIVE = 1, MC_CMA_DEAD = 2 };

typedef struct mc_cma_slot {
  _Atomic uint64_t word; /* generation << 2 | state */
  _Atomic uint64_t addr, len;
  _Atomic uint32_t pins;   /* initiators copying from/to it now */
  _Atomic uint32_t holder; /* pid of the last initiator that pinned it */
  _Atomic uint32_t cuda;   /* 1: GPU memory (not reachable by this path) */
  uint32_t pad_[7];
} mc_cma_slot_t; /* 64 bytes: one cache line per slot */

typedef struct mc_cma_hdr {
  uint64_t magic;
  uint64_t token;            /* random, also in the hello reply */
  _Atomic uint64_t version;  /* bumped after every slot change */
  _Atomic uint32_t hwm;      /* slots [0, hwm) may be in use */
  _Atomic uint32_t closed;   /* the target engine stopped */
  uint64_t pad_[4];
  mc_cma_slot_t slot[MC_CMA_SLOTS];
} mc_cma_hdr_t;

/* ---- target side ---- */
typedef struct mc_cma_table mc_cma_table_t;
int mc_cma_table_create(mc_cma_table_t **out, mc_err_t *err);
/* Marks the table closed (initiators fail their next copy with a clear
 * error) and frees it. */
void mc_cma_table_destroy(mc_cma_table_t *t);
int mc_cma_table_fd(const mc_cma_table_t *t);
uint64_t mc_cma_table_token(const mc_cma_table_t *t);
const void *mc_cma_table_addr(const mc_cma_table_t *t);
/* Publishes [addr, addr+len); MC_ETOOBIG past MC_CMA_SLOTS regions. */
int mc_cma_table_add(mc_cma_table_t *t, uint64_t addr, uint64_t len, int cuda, mc_err_t *err);
/* Unpublishes the region starting at addr: marks it dead, waits for pins
 * up to timeout_ms (<0: no limit).  MC_ENOTFOUND if none starts there;
 * MC_EBUSY naming the pid of the last pinner at the deadline (the slot
 * stays dead: a later call may finish). */
int mc_cma_table_remove(mc_cma_table_t *t, uint64_t addr, int64_t timeout_ms, mc_err_t *err);

/* ---- initiator side ---- */
typedef struct mc_cma_ent {
  uint64_t addr, len, word;
  uint32_t idx;
  int cuda;
} mc_cma_ent_t;

typedef struct mc_cma_view {
  mc_cma_hdr_t *hdr; /* the target's table, mapped */
  pid_t pid;
  int pidfd;         /* -1 if the kernel has no pidfd_open */
  uint64_t seen_version;
  mc_cma_ent_t *ents; /* live slots, sorted by addr */
  size_t n, cap;
} mc_cma_view_t;

/* Maps the table of process `pid` (its fd `fd`, which must carry `token`)
 * and proves cross-memory attach works with a tiny read of the table at
 * `remote_addr` in the target.  Errors name the cause (permission: ptrace
 * scope / uid; pid gone or reused: token mismatch). */
int mc_cma_view_open(mc_cma_view_t *v, pid_t pid, int fd, uint64_t token, uint64_t remote_addr,
                     mc_err_t *err);
void mc_cma_view_close(mc_cma_view_t *v);
/* Re-reads the live slots if the table changed (or force). */
void mc_cma_view_refresh(mc_cma_view_t *v, int force);
/* The cached live slot holding [addr, addr+len), or NULL. */
const mc_cma_ent_t *mc_cma_view_find(const mc_cma_view_t *v, uint64_t addr, uint64_t len);
/* Pins e's slot: 0, or -1 if the slot changed since it was read. */
int mc_cma_view_pin(mc_cma_view_t *v, const mc_cma_ent_t *e);
void mc_cma_view_unpin(mc_cma_view_t *v, uint32_t idx);
/* 0 if the target still runs and its engine is open; else <0 with why. */
int mc_cma_view_alive(mc_cma_view_t *v, const char *segment, mc_err_t *err);

#endif
