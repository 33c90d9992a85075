#!/usr/bin/env python3
"""Writes the binary seed inputs of the fuzz harnesses (tests/fuzz/corpus/).

The JSON / text seeds are committed as written by hand; the binary ones (wire
messages, KV control messages) are generated here from the formats in
csrc/transport/tcp/wire.h and docs/protocol.md "KV control messages"
(csrc/kv/kv_msg.h) so that they stay
readable.  Run from the repository root: python3 tests/fuzz/gen_seeds.py
"""
import os
import struct

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
REG = 0x40000000  # fuzz_tcp_recv's registered region


def hdr(typ, count=0, status=0, req_id=1, length=0):
    return struct.pack("<IBBHIiQQ", 0x564B434D, 1, typ, 0, count, status, req_id, length)


def hello(seg="fuzz-target", frm="peer"):
    body = ('{"version":1,"segment":"%s","from":"%s"}' % (seg, frm)).encode()
    return hdr(1, length=len(body), req_id=1) + body


def table(ents):
    return b"".join(struct.pack("<QQ", a, n) for a, n in ents)


def write(ents, req_id, payload=None):
    t = table(ents)
    data = payload if payload is not None else bytes(sum(n for _, n in ents))
    return hdr(3, count=len(ents), req_id=req_id, length=len(t) + len(data)) + t + data


def read(ents, req_id):
    t = table(ents)
    return hdr(5, count=len(ents), req_id=req_id, length=len(t)) + t


def ctrl(typ, body, req_id, status=0):
    return hdr(typ, status=status, req_id=req_id, length=len(body)) + body


def put(target, name, data):
    d = os.path.join(ROOT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def tcp_seeds():
    # Target side: flags 0 (HELLO first) / 2 (HELLO already done).
    put("tcp_recv", "t_hello_write_read", b"\x00" + hello() + write([(REG, 64), (REG + 4096, 16)], 2)
        + read([(REG, 128)], 3))
    put("tcp_recv", "t_notify_rpc", b"\x02" + ctrl(7, b"hello", 2) + ctrl(9, b'{"rdma":"regions"}', 3)
        + ctrl(9, b"Eboom", 4) + ctrl(7, b"", 5))
    put("tcp_recv", "t_out_of_range", b"\x02" + write([(REG + 65530, 64)], 2) + read([(0x1000, 8)], 3))
    put("tcp_recv", "t_wrong_segment", b"\x00" + hello(seg="other"))
    put("tcp_recv", "t_bad_magic", b"\x00" + b"GET / HTTP/1.1\r\n\r\n" + bytes(16))
    # Initiator side: ops 1..6 = HELLO, WRITE(2x4096), READ(2x4096), NOTIFY, RPC, READ.
    ack = b'{"segment":"fuzz-target"}'
    put("tcp_recv", "i_all_ok", b"\x01" + ctrl(2, ack, 1) + hdr(4, req_id=2)
        + hdr(6, req_id=3, length=8192) + bytes(8192) + hdr(8, req_id=4)
        + ctrl(10, b'{"ok":1}', 5) + hdr(6, req_id=6, length=8192) + bytes(8192))
    put("tcp_recv", "i_errors", b"\x03" + ctrl(4, b"refused", 2, status=-5)
        + hdr(6, count=2, status=-5, req_id=3, length=4) + b"nope" + ctrl(8, b"x", 4, status=-3)
        + ctrl(10, b"bad rpc", 5, status=-7))
    # Authentication on (flag 4): challenge answers / proofs (never valid:
    # the nonces are random), and an initiator seeing a target's proof.
    nonce = "00" * 32
    put("tcp_recv", "t_auth_hello", b"\x04" + ctrl(1, ('{"segment":"fuzz-target","from":"p",'
                                                      '"nonce":"%s"}' % nonce).encode(), 1)
        + ctrl(1, ('{"segment":"fuzz-target","proof":"%s"}' % ("ab" * 32)).encode(), 2)
        + write([(REG, 8)], 3))
    put("tcp_recv", "t_auth_missing", b"\x04" + hello() + write([(REG, 8)], 2))
    put("tcp_recv", "i_auth_ack", b"\x05" + ctrl(2, ('{"segment":"fuzz-target","nonce":"%s",'
                                                    '"proof":"%s"}' % (nonce, "cd" * 32)).encode(), 1))
    put("tcp_recv", "i_auth_noproof", b"\x05" + ctrl(2, ack, 1) + hdr(4, req_id=2))
    put("tcp_recv", "i_hello_refused", b"\x01" + ctrl(2, b"go away", 1, status=-10))


KV_C = 0x40000000  # fuzz_kv_ctrl: the consumer's registered 64 KiB


def kv_seeds():
    toks = struct.pack("<16i", *range(1, 17))
    dests = b"".join(struct.pack("<QQ", KV_C + 4096 * i, 4096) for i in range(4))
    req = struct.pack("<IBBHQIIII4x", 0x5152564B, 1, 4, 1, 11, 2000, 0, 16, 4) + toks + dests
    put("kv_ctrl", "p_recv_kv", b"\x00" + req)
    bad = struct.pack("<IBBHQIIII4x", 0x5152564B, 1, 4, 1, 12, 2000, 1, 16, 4) + toks + dests \
        + struct.pack("<QQ", 0x1000, 64)
    put("kv_ctrl", "p_recv_kv_hidden", b"\x00" + bad)
    lease = struct.pack("<IBBHQIII", 0x5150564B, 1, 4, 1, 13, 1000, 16, 1) + toks
    put("kv_ctrl", "p_lease", b"\x00" + lease)
    probe = struct.pack("<IBBHQIII", 0x5150564B, 1, 8, 0, 14, 0, 2, 0) + struct.pack("<2q", 1, 2)
    put("kv_ctrl", "p_probe", b"\x00" + probe)
    put("kv_ctrl", "p_release", b"\x00" + struct.pack("<IB3xQ", 0x5250564B, 1, 1))
    put("kv_ctrl", "p_other", b"\x00" + b"someone else's notification")
    ans = struct.pack("<IB3xQiI", 0x5052564B, 1, 7, 0, 16)
    put("kv_ctrl", "c_answer", b"\x03" + ans)
    put("kv_ctrl", "c_answer_err", b"\x03" + struct.pack("<IB3xQiI", 0x5052564B, 1, 7, -5, 0)
        + b"producer refused")
    pans = struct.pack("<IB3xQiIQII", 0x5050564B, 1, 7, 0, 8, 99, 2, 1) \
        + struct.pack("<QQQQ", 0x50000000, 4096, 0x50001000, 4096)
    put("kv_ctrl", "c_lease_answer", b"\x03" + pans)
    put("kv_ctrl", "c_lease_err", b"\x03" + struct.pack("<IB3xQiIQII", 0x5050564B, 1, 7, -2, 0, 0,
                                                             0, 0) + b"no")


def http(status, body, extra=b""):
    return (b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
            % (status, len(body), extra)) + body


def meta_seeds():
    # flags: backend (0 http, 1 etcd, 2 redis) | op << 2 (get, put, del, put_ttl, refresh)
    desc = b'{"name":"fuzz-seg","ip_or_host_name":"127.0.0.1","tcp_data_port":1234}'
    put("meta", "http_get", bytes([0 | 0 << 2]) + http(200, desc))
    put("meta", "http_get_404", bytes([0 | 0 << 2]) + http(404, b"not found"))
    put("meta", "http_put", bytes([0 | 1 << 2]) + http(200, b"metadata updated"))
    put("meta", "http_refresh_404", bytes([0 | 4 << 2]) + http(404, b""))
    put("meta", "http_chunked", bytes([0 | 0 << 2]) + b"HTTP/1.1 200 OK\r\nTransfer-Encoding: "
        b"chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
    kv = b'{"header":{"revision":"5"},"kvs":[{"key":"bW9vbmNha2U=","value":"eyJhIjoxfQ==",' \
         b'"mod_revision":"5"}],"count":"1"}'
    put("meta", "etcd_get", bytes([1 | 0 << 2]) + http(200, kv))
    put("meta", "etcd_get_none", bytes([1 | 0 << 2]) + http(200, b'{"header":{},"count":"0"}'))
    put("meta", "etcd_put", bytes([1 | 1 << 2]) + http(200, b'{"header":{"revision":"6"}}'))
    put("meta", "etcd_lease", bytes([1 | 3 << 2]) + http(200, b'{"ID":"7587","TTL":"5"}'))
    put("meta", "etcd_keepalive", bytes([1 | 4 << 2]) + http(200, b'{"result":{"ID":"7587",'
                                                                   b'"TTL":"5"}}'))
    put("meta", "etcd_error", bytes([1 | 2 << 2]) + http(400, b'{"error":"bad","code":3}'))
    put("meta", "redis_get", bytes([2 | 0 << 2]) + b"$19\r\n" + desc[:19] + b"\r\n")
    put("meta", "redis_nil", bytes([2 | 0 << 2]) + b"$-1\r\n")
    put("meta", "redis_ok", bytes([2 | 1 << 2]) + b"+OK\r\n")
    put("meta", "redis_err", bytes([2 | 3 << 2]) + b"-ERR wrong\r\n")
    put("meta", "redis_int", bytes([2 | 4 << 2]) + b":1\r\n")
    put("meta", "redis_array", bytes([2 | 2 << 2]) + b"*2\r\n:1\r\n$1\r\nx\r\n")


if __name__ == "__main__":
    tcp_seeds()
    kv_seeds()
    meta_seeds()
