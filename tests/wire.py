"""The engine's TCP wire format (csrc/transport/tcp/wire.h, docs/protocol.md)
for the tests' raw-socket peers: message types, the 32-byte header, one
message read back."""
import socket
import struct

MAGIC = 0x564B434D
(HELLO, HELLO_ACK, WRITE, WRITE_ACK, READ, READ_DATA, NOTIFY, NOTIFY_ACK, RPC,
 RPC_REPLY) = range(1, 11)
H = struct.Struct("<IBBHIiQQ")  # magic, version, type, flags, count, status, req_id, length


def hdr(typ, length=0, count=0, req_id=1, status=0):
    return H.pack(MAGIC, 1, typ, 0, count, status, req_id, length)


def read_msg(s):
    """(type, count, status, req_id, body) of the next message on s, or None
    when the other side closed (or stopped) before a whole header."""
    h = s.recv(H.size, socket.MSG_WAITALL)
    if len(h) < H.size:
        return None
    _, _, typ, _, count, status, req_id, n = H.unpack(h)
    body = s.recv(n, socket.MSG_WAITALL) if n else b""
    return typ, count, status, req_id, body


def expect_msg(s):
    """read_msg, failing the test when the engine closed instead of answering."""
    m = read_msg(s)
    assert m is not None, "the engine closed the connection instead of answering"
    return m
