"""A hostile peer (issue 28) that relays a real engine's same-host hello:
it listens like an engine, answers the initiator's HELLO as itself, and
answers its "mc.shm.hello" RPC with the hello that engine E (argv[1], a
segment "host:port") gives to a connection of its own.  WRITEs it gets are
acknowledged and dropped.  Prints {"port": P} once listening; runs until
stdin closes."""
import json
import os
import socket
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/ also under -P
from wire import HELLO, HELLO_ACK, RPC, RPC_REPLY, WRITE, WRITE_ACK, hdr, read_msg  # noqa: E402


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
