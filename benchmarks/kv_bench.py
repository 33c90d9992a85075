#!/usr/bin/env python3
"""send_kv/recv_kv bandwidth vs the raw engine, in one run.

    .venv/bin/python benchmarks/kv_bench.py [--blocks 2048] [--block-kib 256] [--reps 3]

A producer process holds `blocks` KV blocks in its lookup buffer (zero copy,
blocks of registered memory).  The consumer (this process) first pulls the
whole prompt with recv_kv (lookup + push + answer), then with
recv_kv(pull=True) (lease + READ by the consumer + release: what the vLLM
connector uses), then moves the very same blocks with the raw engine
(batch_transfer_sync_read from the producer's memory into the same
destination).  Prints GB/s (1e9) of each and the ratios (bar: >= 0.9).  Data
is checked after each recv_kv.  Then the fixed cost per request: p50/p99 of a
one-block (--small-kib) recv_kv, push and pull, and of a probe (the
scheduler's "how much do you hold"), against a raw one-block READ: a vLLM
flow-a load costs probe + pull, so the fixed cost is probe + pull - raw READ
(the connector's control messages and lookups, bar: <= 1 ms).
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
    small = args.small_kib << 10
    kv.send_kv(list(range(10**6, 10**6 + 16)), [(base, small, 0)])  # a one-block prompt
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
    ap.add_argument("--small-kib", type=int, default=64)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--role", default="consumer", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "producer":
        return producer(args)
    bb = args.block_kib << 10
    size = args.blocks * bb
    p = subprocess.Popen([sys.executable, __file__, "--role", "producer", "--blocks",
                          str(args.blocks), "--block-kib", str(args.block_kib),
                          "--small-kib", str(args.small_kib)],
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
    best_kv = best_pull = best_raw = 0.0
    for _ in range(args.reps):
        for pull in (False, True):
            ctypes.memset(base, 0, size)
            t0 = time.perf_counter()
            n = kv.recv_kv(info["segment"], tokens, dest, timeout=60, pull=pull)
            dt = time.perf_counter() - t0
            assert n == len(tokens), n
            assert zlib.crc32(memoryview(dst)) == info["crc"], "recv_kv data mismatch"
            if pull:
                best_pull = max(best_pull, size / dt / 1e9)
            else:
                best_kv = max(best_kv, size / dt / 1e9)
        t0 = time.perf_counter()
        eng.batch_transfer_sync_read(info["segment"], [d[0] for d in dest],
                                     [info["addr"] + i * bb for i in range(args.blocks)],
                                     [bb] * args.blocks)
        dt = time.perf_counter() - t0
        best_raw = max(best_raw, size / dt / 1e9)
    ratio = best_kv / best_raw
    pratio = best_pull / best_raw
    small = args.small_kib << 10
    stoks = list(range(10**6, 10**6 + 16))

    def lat(fn):
        out = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e6)
        out.sort()
        return out[len(out) // 2], out[min(len(out) - 1, int(len(out) * 0.99))]

    seg = info["segment"]
    push = lat(lambda: kv.recv_kv(seg, stoks, [(base, small)], timeout=10))
    pull = lat(lambda: kv.recv_kv(seg, stoks, [(base, small)], timeout=10, pull=True))
    raw = lat(lambda: eng.transfer_sync_read(seg, base, info["addr"], small))
    probe = lat(lambda: kv.probe(seg, stoks, timeout=10))
    # A flow-a load in vLLM = the scheduler's probe + the worker's pull.
    over = probe[0] + pull[0] - raw[0]
    print(json.dumps({"bytes": size, "blocks": args.blocks, "block_bytes": bb,
                      "recv_kv_GBps": round(best_kv, 3), "pull_GBps": round(best_pull, 3),
                      "raw_read_GBps": round(best_raw, 3),
                      "ratio": round(ratio, 3), "pull_ratio": round(pratio, 3), "bar": 0.9,
                      "verdict": "PASS" if min(ratio, pratio) >= 0.9 else "FAIL-BAR",
                      "one_block_bytes": small,
                      "push_us_p50_p99": [round(x, 1) for x in push],
                      "pull_us_p50_p99": [round(x, 1) for x in pull],
                      "raw_read_us_p50_p99": [round(x, 1) for x in raw],
                      "probe_us_p50_p99": [round(x, 1) for x in probe],
                      "probe_plus_pull_fixed_cost_us": round(over, 1),
                      "fixed_cost_verdict": "PASS" if over <= 1000 else "FAIL-BAR"}))
    kv.close()
    eng.close()
    p.stdin.write("\n")
    p.stdin.flush()
    p.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
