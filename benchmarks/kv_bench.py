#!/usr/bin/env python3
"""send_kv/recv_kv bandwidth vs the raw engine, in one run.

    .venv/bin/python benchmarks/kv_bench.py [--blocks 2048] [--block-kib 256] [--reps 3]

A producer process holds `blocks` KV blocks in its lookup buffer (zero copy,
blocks of registered memory).  The consumer (this process) first pulls the
whole prompt with recv_kv (lookup + push + answer), then moves the very same
blocks with the raw engine (batch_transfer_sync_read from the producer's
memory into the same destination).  Prints GB/s (1e9) of each and the ratio
(bar: >= 0.9).  Data is checked after each recv_kv.
"""
import argparse
import ctypes
import json
import random
import subprocess
import sys
import time
import zlib

import mooncake_connector as mc


def producer(args):
    bb = args.block_kib << 10
    size = args.blocks * bb
    eng = mc.TransferEngine()
    eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    buf = (ctypes.c_ubyte * size)()
    base = ctypes.addressof(buf)
    eng.register_memory(base, size)
    rng = random.Random(1)
    for off in range(0, size, 16 << 20):
        n = min(16 << 20, size - off)
        ctypes.memmove(base + off, rng.randbytes(n), n)
    lb = mc.LookupBuffer(size * 2, block_size=16)
    kv = mc.KVTransfer(eng, lb)
    tokens = list(range(args.blocks * 16))
    kv.send_kv(tokens, [(base + i * bb, bb, i) for i in range(args.blocks)])
    print(json.dumps({"segment": eng.get_segment_name(), "addr": base,
                      "crc": zlib.crc32(memoryview(buf))}), flush=True)
    sys.stdin.readline()
    kv.close()
    eng.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--block-kib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--role", default="consumer", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "producer":
        return producer(args)
    bb = args.block_kib << 10
    size = args.blocks * bb
    p = subprocess.Popen([sys.executable, __file__, "--role", "producer", "--blocks",
                          str(args.blocks), "--block-kib", str(args.block_kib)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    info = json.loads(p.stdout.readline())
    eng = mc.TransferEngine()
    eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    dst = (ctypes.c_ubyte * size)()
    base = ctypes.addressof(dst)
    eng.register_memory(base, size)
    kv = mc.KVTransfer(eng)
    tokens = list(range(args.blocks * 16))
    dest = [(base + i * bb, bb) for i in range(args.blocks)]
    best_kv = best_raw = 0.0
    for _ in range(args.reps):
        ctypes.memset(base, 0, size)
        t0 = time.perf_counter()
        n = kv.recv_kv(info["segment"], tokens, dest, timeout=60)
        dt = time.perf_counter() - t0
        assert n == len(tokens), n
        assert zlib.crc32(memoryview(dst)) == info["crc"], "recv_kv data mismatch"
        best_kv = max(best_kv, size / dt / 1e9)
        t0 = time.perf_counter()
        eng.batch_transfer_sync_read(info["segment"], [d[0] for d in dest],
                                     [info["addr"] + i * bb for i in range(args.blocks)],
                                     [bb] * args.blocks)
        dt = time.perf_counter() - t0
        best_raw = max(best_raw, size / dt / 1e9)
    ratio = best_kv / best_raw
    print(json.dumps({"bytes": size, "blocks": args.blocks, "block_bytes": bb,
                      "recv_kv_GBps": round(best_kv, 3), "raw_read_GBps": round(best_raw, 3),
                      "ratio": round(ratio, 3), "bar": 0.9,
                      "verdict": "PASS" if ratio >= 0.9 else "FAIL-BAR"}))
    kv.close()
    eng.close()
    p.stdin.write("\n")
    p.stdin.flush()
    p.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
