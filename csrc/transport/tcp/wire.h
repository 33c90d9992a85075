/* The TCP wire format (documented in docs/protocol.md).
 *
 * Every message starts with a fixed 32-byte header, little-endian:
 *   0  u32 magic    "MCKV" (0x564B434D)
 *   4  u8  version  MC_WIRE_VERSION
 *   5  u8  type     mc_wire_type
 *   6  u16 flags    0 (reserved; must be 0)
 *   8  u32 count    entries in the table (WRITE, READ), else 0
 *  12  i32 status   0 or a negative MC_E* code (responses only)
 *  16  u64 req_id   echoed by the response
 *  24  u64 length   bytes that follow the header
 *
 * WRITE:      header, count x {u64 addr, u64 len}, then sum(len) payload bytes.
 * WRITE_ACK:  header (status); if status < 0, `length` bytes of error text.
 * READ:       header, count x {u64 addr, u64 len}.
 * READ_DATA:  header; status 0: sum(len) payload bytes; else error text.
 * HELLO:      header, JSON {"version":1,"segment":"<expected target>","from":"<name>"}.
 * HELLO_ACK:  header, status 0: JSON {"segment":"<name>"}; else error text.
 * NOTIFY:     header, bytes of the message.  NOTIFY_ACK: header (status).
 * RPC:        header, a request for a transport's control service (e.g. the
 *             RDMA connection handshake).  RPC_REPLY: status 0: the reply
 *             text; else error text.
 *
 * A connection carries requests in one direction (initiator -> target) and
 * responses in the other, and the target answers in request order.
 */
#ifndef MC_TRANSPORT_TCP_WIRE_H
#define MC_TRANSPORT_TCP_WIRE_H

#include <stdint.h>
#include <string.h>

#include "transport/xfer_op.h"
#include "util/bytes.h"
#include "util/errors.h"

#define MC_WIRE_MAGIC 0x564B434Du
#define MC_WIRE_VERSION 1
#define MC_WIRE_HDR_SIZE 32
#define MC_WIRE_ENT_SIZE 16
#define MC_WIRE_MAX_ENTRIES MC_XFER_MAX_ENTRIES
#define MC_WIRE_MAX_CTRL MC_XFER_MAX_CTRL /* HELLO / NOTIFY / error text */
#define MC_WIRE_MAX_PAYLOAD (1ull << 40) /* sanity cap on one message */

typedef enum {
  MC_WIRE_HELLO = 1,
  MC_WIRE_HELLO_ACK = 2,
  MC_WIRE_WRITE = 3,
  MC_WIRE_WRITE_ACK = 4,
  MC_WIRE_READ = 5,
  MC_WIRE_READ_DATA = 6,
  MC_WIRE_NOTIFY = 7,
  MC_WIRE_NOTIFY_ACK = 8,
  MC_WIRE_RPC = 9,
  MC_WIRE_RPC_REPLY = 10,
} mc_wire_type;

typedef struct mc_wire_hdr {
  uint8_t version;
  uint8_t type;
  uint16_t flags;
  uint32_t count;
  int32_t status;
  uint64_t req_id;
  uint64_t length;
} mc_wire_hdr_t;

void mc_wire_encode(const mc_wire_hdr_t *h, uint8_t out[MC_WIRE_HDR_SIZE]);

/* Decodes and validates a header received from the network: magic, version,
 * known type, flags 0, count/length consistent with the type and within the
 * caps.  `expect_response` says which direction the connection carries.
 * Returns 0 or MC_EPROTO with a message saying which field was wrong. */
int mc_wire_decode(const uint8_t in[MC_WIRE_HDR_SIZE], int expect_response,
                   mc_wire_hdr_t *h, mc_err_t *err);

const char *mc_wire_type_name(int type);

#endif
