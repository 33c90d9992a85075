"""A transfer-engine peer in its own OS process, driven over stdin/stdout
with JSON lines.  Used by the tests to put the two ends of a transfer in
different processes (and network namespaces).

    python tests/peer.py --hostname 127.0.0.1 --metadata P2PHANDSHAKE --size N

First line printed: {"segment", "addr", "size", "pid"}.  Commands:
    {"cmd": "fill", "seed": S, "off": O, "len": L}   -> {"crc": ...}
    {"cmd": "crc", "off": O, "len": L}               -> {"crc": ...}
    {"cmd": "zero"}                                  -> {}
    {"cmd": "write"|"read", "target": SEG, "blocks": [[local_off, remote_addr, len], ...],
     "timeout": T}                                   -> {"ok": true} | {"error": ..., "type": ...}
    "bg": true in a write, read or recv_kv: run it on a thread, answer {} at once
    (the peer takes other commands meanwhile; one at a time)
    {"cmd": "bg_result", "wait": T}                  -> its answer, or {"running": true} if it
                                                        has not ended within T s (default 0)
    {"cmd": "notifies"}                              -> {"notifies": [[from, msg], ...]}
    {"cmd": "engine_stats"}                          -> TransferEngine.get_stats()
    {"cmd": "cut", "target": SEG}                    -> {"cut": n} | {"error": ..., "type": ...}
    {"cmd": "exit"}
"""
import argparse
import ctypes
import os
import random
import sys
import threading
import time
import zlib

import mooncake_connector as mc

# The helper protocol lives beside this script (CI runs with PYTHONSAFEPATH,
# which keeps a script's own directory off sys.path).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from line_peer import answer as out, requests  # noqa: E402


class _Peer:
    """The peer's engine, its registered buffer of `size` bytes and, after
    kv_init, its KVTransfer (kv; lb: the producer's LookupBuffer).  One method
    a command, returning its answer."""

    def __init__(self, hostname, metadata, size):
        self.size = size
        self.eng = mc.TransferEngine()
        self.eng.initialize(hostname, metadata, "tcp", "")
        self.buf = (ctypes.c_ubyte * size)()
        self.base = ctypes.addressof(self.buf)
        self.eng.register_memory(self.base, size)
        self.view = memoryview(self.buf).cast("B")
        self.kv = None

    def xfer(self, req):  # write, read
        eng, base, blocks = self.eng, self.base, req["blocks"]
        fn = (eng.batch_transfer_async_write if req["cmd"] == "write"
              else eng.batch_transfer_async_read)
        try:
            bid = fn(req["target"], [base + b[0] for b in blocks],
                     [b[1] for b in blocks], [b[2] for b in blocks])
            eng.get_batch_transfer_status([bid], req.get("timeout", -1))
            return {"ok": True}
        except mc.MooncakeError as e:
            return {"error": str(e), "type": type(e).__name__}

    def recv_kv(self, req):
        base, bb = self.base, req["block_bytes"]
        dest = [(base + s_ * bb, req.get("dest_len", bb)) for s_ in req["slots"]]
        if "dest" in req:  # explicit [offset, length(, tag)] extents
            dest = [(base + x[0], *x[1:]) for x in req["dest"]]
        try:
            hid = req.get("hidden_slots")
            hb = req.get("hidden_bytes", 0)
            return {"matched": self.kv.recv_kv(req["producer"], req["tokens"], dest,
                                               timeout=req.get("timeout", 10.0),
                                               pull=req.get("pull", False),
                                               hidden_dest=None if hid is None else
                                               [(base + s_ * bb, hb) for s_ in hid])}
        except mc.MooncakeError as e:
            return {"error": str(e), "type": type(e).__name__}

    def fill(self, req):
        view = self.view
        off, n = req.get("off", 0), req.get("len", self.size)
        rng = random.Random(req["seed"])
        step = 16 << 20  # randbytes takes at most 2**31 bits at once
        for o in range(off, off + n, step):
            k = min(step, off + n - o)
            view[o:o + k] = rng.randbytes(k)
        return {"crc": zlib.crc32(view[off:off + n])}

    def crc(self, req):
        off, n = req["off"], req["len"]
        return {"crc": zlib.crc32(self.view[off:off + n])}

    def zero(self, req):
        ctypes.memset(self.base, 0, self.size)
        return {}

    def kv_init(self, req):
        self.lb = None
        if req.get("producer", True):
            self.lb = mc.LookupBuffer(req.get("capacity", 1 << 30),
                                      block_size=req.get("block_size", 16),
                                      mode=req.get("mode", "keep"),
                                      policy=req.get("policy", "evict"),
                                      ttl_s=req.get("ttl_s", 0),
                                      track_freed=req.get("track_freed", False))
        self.kv = mc.KVTransfer(self.eng, self.lb)
        return {}

    def send_kv(self, req):
        base, bb = self.base, req["block_bytes"]
        try:
            hid = req.get("hidden_slots")
            hb = req.get("hidden_bytes", 0)
            n = self.kv.send_kv(req["tokens"], [(base + s_ * bb, bb, s_) for s_ in req["slots"]],
                                hidden=None if hid is None else
                                [(base + s_ * bb, hb) for s_ in hid],
                                copy=req.get("copy", False))
            return {"stored": n}
        except mc.MooncakeError as e:
            return {"error": str(e), "type": type(e).__name__}

    def probe(self, req):
        try:
            t0 = time.perf_counter()
            n = self.kv.probe(req["producer"], req["tokens"], timeout=req.get("timeout", 1.0),
                              extents_per_block=req.get("epb", 0))
            return {"matched": n, "secs": time.perf_counter() - t0}
        except mc.MooncakeError as e:
            return {"error": str(e), "type": type(e).__name__}

    def pull_wait(self, req):  # pull_start, then block in pull_wait, then pull_poll
        kv, bb = self.kv, req["block_bytes"]
        dest = [(self.base + s_ * bb, bb) for s_ in req["slots"]]
        try:
            pid = kv.pull_start(req["producer"], req["tokens"], dest,
                                timeout=req.get("timeout", 10.0))
            done = kv.pull_wait([pid], timeout=req.get("wait", 10.0))
            r = kv.pull_poll(pid)
            return {"done": done, "matched": r[0] if r else None,
                    "error": r[1] if r else None}
        except mc.MooncakeError as e:
            return {"error": str(e), "type": type(e).__name__}

    def recv_many(self, req):
        bb = req["block_bytes"]
        results = [None] * len(req["jobs"])

        def one(i, job):
            dest = [(self.base + s_ * bb, bb) for s_ in job["slots"]]
            try:
                results[i] = self.kv.recv_kv(req["producer"], job["tokens"], dest,
                                             timeout=req.get("timeout", 30.0),
                                             pull=req.get("pull", False))
            except mc.MooncakeError as e:
                results[i] = str(e)

        ts = [threading.Thread(target=one, args=(i, j)) for i, j in enumerate(req["jobs"])]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return {"results": results}

    def cut(self, req):  # the consumer's fence: Engine.cut_peer
        try:
            return {"cut": self.eng.cut_peer(req["target"], req.get("timeout", 5.0))}
        except (mc.MooncakeError, ValueError) as e:
            return {"error": str(e), "type": type(e).__name__}

    def engine_stats(self, req):
        return self.eng.get_stats()

    def kv_stats(self, req):
        return self.kv.stats()

    def take_freed(self, req):
        return {"tags": sorted(t for _a, _l, t in self.lb.take_freed())}

    def notifies(self, req):
        return {"notifies": [[f, m.decode()] for f, m in self.eng.get_notifies()]}

    COMMANDS = {"write": xfer, "read": xfer, "recv_kv": recv_kv, "fill": fill, "crc": crc,
                "zero": zero, "kv_init": kv_init, "send_kv": send_kv, "probe": probe,
                "pull_wait": pull_wait, "recv_many": recv_many, "cut": cut,
                "engine_stats": engine_stats, "kv_stats": kv_stats, "take_freed": take_freed,
                "notifies": notifies}
    BACKGROUND = ("write", "read", "recv_kv")  # the commands "bg": true runs on a thread

    def close(self):
        if self.kv is not None:
            self.kv.close()
        self.eng.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hostname", default="127.0.0.1")
    ap.add_argument("--metadata", default="P2PHANDSHAKE")
    ap.add_argument("--size", type=int, default=64 << 20)
    args = ap.parse_args()

    peer = _Peer(args.hostname, args.metadata, args.size)
    out({"segment": peer.eng.get_segment_name(), "addr": peer.base, "size": args.size,
         "pid": os.getpid()})
    bg = None  # [thread, answer] of the command running on a thread ("bg": true)
    for req in requests():
        cmd = req["cmd"]
        if req.get("bg") and cmd in _Peer.BACKGROUND:
            job = [None, None]

            def one(req=req, job=job):
                job[1] = _Peer.COMMANDS[req["cmd"]](peer, req)
            job[0] = threading.Thread(target=one, daemon=True)
            bg = job
            job[0].start()
            out({})
        elif cmd == "bg_result":
            bg[0].join(req.get("wait", 0))
            out({"running": True} if bg[0].is_alive() else bg[1])
        elif cmd in _Peer.COMMANDS:
            out(_Peer.COMMANDS[cmd](peer, req))
        else:
            out({"error": f"unknown command {cmd}"})
    peer.close()


if __name__ == "__main__":
    main()
