#include "transport/tcp/wire.h"

/* Op types travel as the wire's message types. */
_Static_assert((int)MC_XFER_WRITE == (int)MC_WIRE_WRITE &&
                   (int)MC_XFER_READ == (int)MC_WIRE_READ &&
                   (int)MC_XFER_NOTIFY == (int)MC_WIRE_NOTIFY &&
                   (int)MC_XFER_RPC == (int)MC_WIRE_RPC,
               "op types must match the TCP wire types");

void mc_wire_encode(const mc_wire_hdr_t *h, uint8_t out[MC_WIRE_HDR_SIZE]) {
  mc_put_u32(out, MC_WIRE_MAGIC);
  out[4] = MC_WIRE_VERSION;
  out[5] = h->type;
  mc_put_u16(out + 6, h->flags);
  mc_put_u32(out + 8, h->count);
  mc_put_u32(out + 12, (uint32_t)h->status);
  mc_put_u64(out + 16, h->req_id);
  mc_put_u64(out + 24, h->length);
}

const char *mc_wire_type_name(int type) {
  switch (type) {
  case MC_WIRE_HELLO: return "HELLO";
  case MC_WIRE_HELLO_ACK: return "HELLO_ACK";
  case MC_WIRE_WRITE: return "WRITE";
  case MC_WIRE_WRITE_ACK: return "WRITE_ACK";
  case MC_WIRE_READ: return "READ";
  case MC_WIRE_READ_DATA: return "READ_DATA";
  case MC_WIRE_NOTIFY: return "NOTIFY";
  case MC_WIRE_NOTIFY_ACK: return "NOTIFY_ACK";
  case MC_WIRE_RPC: return "RPC";
  case MC_WIRE_RPC_REPLY: return "RPC_REPLY";
  default: return "UNKNOWN";
  }
}

static int is_response(int type) {
  return type == MC_WIRE_HELLO_ACK || type == MC_WIRE_WRITE_ACK ||
         type == MC_WIRE_READ_DATA || type == MC_WIRE_NOTIFY_ACK ||
         type == MC_WIRE_RPC_REPLY;
}

int mc_wire_decode(const uint8_t in[MC_WIRE_HDR_SIZE], int expect_response,
                   mc_wire_hdr_t *h, mc_err_t *err) {
  uint32_t magic = mc_get_u32(in);
  if (magic != MC_WIRE_MAGIC)
    return mc_err_set(err, MC_EPROTO,
                      "bad magic 0x%08x (expected 0x%08x): not a mooncake-connector peer",
                      magic, MC_WIRE_MAGIC);
  h->version = in[4];
  h->type = in[5];
  h->flags = mc_get_u16(in + 6);
  h->count = mc_get_u32(in + 8);
  h->status = (int32_t)mc_get_u32(in + 12);
  h->req_id = mc_get_u64(in + 16);
  h->length = mc_get_u64(in + 24);
  if (h->version != MC_WIRE_VERSION)
    return mc_err_set(err, MC_EPROTO,
                      "peer speaks wire version %u, this build speaks %u; "
                      "upgrade both sides to the same mooncake-connector release",
                      h->version, MC_WIRE_VERSION);
  if (h->type < MC_WIRE_HELLO || h->type > MC_WIRE_RPC_REPLY)
    return mc_err_set(err, MC_EPROTO, "unknown message type %u", h->type);
  if (is_response(h->type) != !!expect_response)
    return mc_err_set(err, MC_EPROTO, "unexpected %s message on a %s connection",
                      mc_wire_type_name(h->type),
                      expect_response ? "initiator" : "target");
  if (h->flags != 0)
    return mc_err_set(err, MC_EPROTO, "reserved flags 0x%x set in %s", h->flags,
                      mc_wire_type_name(h->type));
  if (h->status > 0 || h->status < -1000)
    return mc_err_set(err, MC_EPROTO, "invalid status %d in %s", h->status,
                      mc_wire_type_name(h->type));
  if (!is_response(h->type) && h->status != 0)
    return mc_err_set(err, MC_EPROTO, "request %s carries status %d",
                      mc_wire_type_name(h->type), h->status);
  switch (h->type) {
  case MC_WIRE_WRITE:
  case MC_WIRE_READ:
    if (h->count == 0 || h->count > MC_WIRE_MAX_ENTRIES)
      return mc_err_set(err, MC_EPROTO, "%s with %u entries (allowed 1..%u)",
                        mc_wire_type_name(h->type), h->count, MC_WIRE_MAX_ENTRIES);
    if (h->type == MC_WIRE_READ &&
        h->length != (uint64_t)h->count * MC_WIRE_ENT_SIZE)
      return mc_err_set(err, MC_EPROTO, "READ length %llu does not match %u entries",
                        (unsigned long long)h->length, h->count);
    if (h->type == MC_WIRE_WRITE &&
        (h->length < (uint64_t)h->count * MC_WIRE_ENT_SIZE ||
         h->length > MC_WIRE_MAX_PAYLOAD))
      return mc_err_set(err, MC_EPROTO, "WRITE length %llu is invalid for %u entries",
                        (unsigned long long)h->length, h->count);
    break;
  case MC_WIRE_READ_DATA:
  case MC_WIRE_WRITE_ACK:
    /* An error response may name the refused entry (count = index + 1). */
    if (h->count != 0 && (h->status == 0 || h->count > MC_WIRE_MAX_ENTRIES))
      return mc_err_set(err, MC_EPROTO, "%s with count %u", mc_wire_type_name(h->type),
                        h->count);
    if (h->type == MC_WIRE_WRITE_ACK && h->length > MC_WIRE_MAX_CTRL)
      return mc_err_set(err, MC_EPROTO, "WRITE_ACK body of %llu bytes is too long",
                        (unsigned long long)h->length);
    if (h->status < 0 && h->length > MC_WIRE_MAX_CTRL)
      return mc_err_set(err, MC_EPROTO, "error text of %llu bytes is too long",
                        (unsigned long long)h->length);
    if (h->length > MC_WIRE_MAX_PAYLOAD)
      return mc_err_set(err, MC_EPROTO, "READ_DATA length %llu is too large",
                        (unsigned long long)h->length);
    break;
  default: /* control messages */
    if (h->count != 0)
      return mc_err_set(err, MC_EPROTO, "%s with count %u", mc_wire_type_name(h->type),
                        h->count);
    if (h->length > MC_WIRE_MAX_CTRL)
      return mc_err_set(err, MC_EPROTO, "%s body of %llu bytes exceeds %u",
                        mc_wire_type_name(h->type), (unsigned long long)h->length,
                        MC_WIRE_MAX_CTRL);
    break;
  }
  return 0;
}
