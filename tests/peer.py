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
import time
import zlib

import mooncake_connector as mc

# The helper protocol lives beside this script (CI runs with PYTHONSAFEPATH,
# which keeps a script's own directory off sys.path).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from line_peer import answer as out, requests  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hostname", default="127.0.0.1")
    ap.add_argument("--metadata", default="P2PHANDSHAKE")
    ap.add_argument("--size", type=int, default=64 << 20)
    args = ap.parse_args()

    eng = mc.TransferEngine()
    eng.initialize(args.hostname, args.metadata, "tcp", "")
    buf = (ctypes.c_ubyte * args.size)()
    base = ctypes.addressof(buf)
    eng.register_memory(base, args.size)
    view = memoryview(buf).cast("B")
    kv = None


    out({"segment": eng.get_segment_name(), "addr": base, "size": args.size,
         "pid": os.getpid()})
    bg = None  # [thread, answer] of the command running on a thread ("bg": true)

    def xfer(req):
        blocks = req["blocks"]
        fn = (eng.batch_transfer_async_write if req["cmd"] == "write"
              else eng.batch_transfer_async_read)
        try:
            bid = fn(req["target"], [base + b[0] for b in blocks],
                     [b[1] for b in blocks], [b[2] for b in blocks])
            eng.get_batch_transfer_status([bid], req.get("timeout", -1))
            return {"ok": True}
        except mc.MooncakeError as e:
            return {"error": str(e), "type": type(e).__name__}

    def recv(req):
        bb = req["block_bytes"]
        dest = [(base + s_ * bb, req.get("dest_len", bb)) for s_ in req["slots"]]
        if "dest" in req:  # explicit [offset, length(, tag)] extents
            dest = [(base + x[0], *x[1:]) for x in req["dest"]]
        try:
            hid = req.get("hidden_slots")
            hb = req.get("hidden_bytes", 0)
            return {"matched": kv.recv_kv(req["producer"], req["tokens"], dest,
                                          timeout=req.get("timeout", 10.0),
                                          pull=req.get("pull", False),
                                          hidden_dest=None if hid is None else
                                          [(base + s_ * bb, hb) for s_ in hid])}
        except mc.MooncakeError as e:
            return {"error": str(e), "type": type(e).__name__}

    handlers = {"write": xfer, "read": xfer, "recv_kv": recv}

    for req in requests():
        cmd = req["cmd"]
        if req.get("bg") and cmd in ("write", "read", "recv_kv"):
            import threading
            job = [None, None]

            def one(req=req, job=job):
                job[1] = handlers[req["cmd"]](req)
            job[0] = threading.Thread(target=one, daemon=True)
            bg = job
            job[0].start()
            out({})
            continue
        if cmd == "bg_result":
            bg[0].join(req.get("wait", 0))
            out({"running": True} if bg[0].is_alive() else bg[1])
            continue
        if cmd == "fill":
            off, n = req.get("off", 0), req.get("len", args.size)
            rng = random.Random(req["seed"])
            step = 16 << 20  # randbytes takes at most 2**31 bits at once
            for o in range(off, off + n, step):
                k = min(step, off + n - o)
                view[o:o + k] = rng.randbytes(k)
            out({"crc": zlib.crc32(view[off:off + n])})
        elif cmd == "crc":
            off, n = req["off"], req["len"]
            out({"crc": zlib.crc32(view[off:off + n])})
        elif cmd == "zero":
            ctypes.memset(base, 0, args.size)
            out({})
        elif cmd in ("write", "read"):
            out(xfer(req))
        elif cmd == "kv_init":
            lb = None
            if req.get("producer", True):
                lb = mc.LookupBuffer(req.get("capacity", 1 << 30),
                                     block_size=req.get("block_size", 16),
                                     mode=req.get("mode", "keep"),
                                     policy=req.get("policy", "evict"),
                                     ttl_s=req.get("ttl_s", 0),
                                     track_freed=req.get("track_freed", False))
            kv = mc.KVTransfer(eng, lb)
            out({})
        elif cmd == "send_kv":
            bb = req["block_bytes"]
            try:
                hid = req.get("hidden_slots")
                hb = req.get("hidden_bytes", 0)
                n = kv.send_kv(req["tokens"], [(base + s_ * bb, bb, s_) for s_ in req["slots"]],
                               hidden=None if hid is None else
                               [(base + s_ * bb, hb) for s_ in hid],
                               copy=req.get("copy", False))
                out({"stored": n})
            except mc.MooncakeError as e:
                out({"error": str(e), "type": type(e).__name__})
        elif cmd == "recv_kv":
            out(recv(req))
        elif cmd == "probe":
            try:
                t0 = time.perf_counter()
                n = kv.probe(req["producer"], req["tokens"], timeout=req.get("timeout", 1.0),
                             extents_per_block=req.get("epb", 0))
                out({"matched": n, "secs": time.perf_counter() - t0})
            except mc.MooncakeError as e:
                out({"error": str(e), "type": type(e).__name__})
        elif cmd == "pull_wait":  # pull_start, then block in pull_wait, then pull_poll
            bb = req["block_bytes"]
            dest = [(base + s_ * bb, bb) for s_ in req["slots"]]
            try:
                pid = kv.pull_start(req["producer"], req["tokens"], dest,
                                    timeout=req.get("timeout", 10.0))
                done = kv.pull_wait([pid], timeout=req.get("wait", 10.0))
                r = kv.pull_poll(pid)
                out({"done": done, "matched": r[0] if r else None,
                     "error": r[1] if r else None})
            except mc.MooncakeError as e:
                out({"error": str(e), "type": type(e).__name__})
        elif cmd == "recv_many":
            import threading
            bb = req["block_bytes"]
            results = [None] * len(req["jobs"])

            def one(i, job):
                dest = [(base + s_ * bb, bb) for s_ in job["slots"]]
                try:
                    results[i] = kv.recv_kv(req["producer"], job["tokens"], dest,
                                            timeout=req.get("timeout", 30.0),
                                            pull=req.get("pull", False))
                except mc.MooncakeError as e:
                    results[i] = str(e)

            ts = [threading.Thread(target=one, args=(i, j)) for i, j in enumerate(req["jobs"])]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            out({"results": results})
        elif cmd == "cut":  # the consumer's fence: Engine.cut_peer
            try:
                out({"cut": eng.cut_peer(req["target"], req.get("timeout", 5.0))})
            except (mc.MooncakeError, ValueError) as e:
                out({"error": str(e), "type": type(e).__name__})
        elif cmd == "engine_stats":
            out(eng.get_stats())
        elif cmd == "kv_stats":
            out(kv.stats())
        elif cmd == "take_freed":
            out({"tags": sorted(t for _a, _l, t in lb.take_freed())})
        elif cmd == "notifies":
            out({"notifies": [[f, m.decode()] for f, m in eng.get_notifies()]})
        else:
            out({"error": f"unknown command {cmd}"})
    if kv is not None:
        kv.close()
    eng.close()


if __name__ == "__main__":
    main()
