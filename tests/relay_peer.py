"""A hostile peer (issue 28) that relays a real engine's same-host hello:
it listens like an engine, answers the initiator's HELLO as itself, and
answers its "mc.shm.hello" RPC with the hello that engine E (argv[1], a
segment "host:port") gives to a connection of its own.  WRITEs it gets are
acknowledged and dropped.  Prints {"port": P} once listening; runs until
stdin closes."""
import json
import socket
import struct
import sys
import threading

MAGIC = 0x564B434D
HELLO, HELLO_ACK, WRITE, WRITE_ACK, RPC, RPC_REPLY = 1, 2, 3, 4, 9, 10
H = struct.Struct("<IBBHIiQQ")


def hdr(typ, length=0, count=0, req_id=1, status=0):
    return H.pack(MAGIC, 1, typ, 0, count, status, req_id, length)


def read_msg(s):
    h = s.recv(32, socket.MSG_WAITALL)
    if len(h) < 32:
        return None
    _, _, typ, _, count, status, req_id, n = H.unpack(h)
    body = s.recv(n, socket.MSG_WAITALL) if n else b""
    return typ, count, status, req_id, body


def e_hello(e_seg):
    host, port = e_seg.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    body = json.dumps({"version": 1, "segment": e_seg, "from": "relay:1"}).encode()
    s.sendall(hdr(HELLO, len(body)) + body)
    read_msg(s)
    s.sendall(hdr(RPC, 12, req_id=2) + b"mc.shm.hello")
    typ, _, status, _, body = read_msg(s)
    return s, status, body  # keep s open: the hello names E's end of it


def serve(c, me, e_seg, keep):
    while True:
        m = read_msg(c)
        if m is None:
            return
        typ, count, status, rid, body = m
        if typ == HELLO:
            b = json.dumps({"segment": me}).encode()
            c.sendall(hdr(HELLO_ACK, len(b), req_id=rid) + b)
        elif typ == RPC and body == b"mc.shm.hello":
            s, st, reply = e_hello(e_seg)
            keep.append(s)
            c.sendall(hdr(RPC_REPLY, len(reply), req_id=rid, status=st) + reply)
        elif typ == RPC:
            err = b"no such RPC here"
            c.sendall(hdr(RPC_REPLY, len(err), req_id=rid, status=-12) + err)
        elif typ == WRITE:
            c.sendall(hdr(WRITE_ACK, req_id=rid))
        else:
            return


def main():
    e_seg = sys.argv[1]
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(16)
    port = ls.getsockname()[1]
    me = "127.0.0.1:%d" % port
    keep = []

    def accept_loop():
        while True:
            c, _ = ls.accept()
            threading.Thread(target=serve, args=(c, me, e_seg, keep), daemon=True).start()

    threading.Thread(target=accept_loop, daemon=True).start()
    print(json.dumps({"port": port}), flush=True)
    sys.stdin.read()


main()
