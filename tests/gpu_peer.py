"""A transfer-engine peer holding a KV cache on a GPU (or the CPU), in its own
process, driven over stdin/stdout with JSON lines (like tests/peer.py).

    python tests/gpu_peer.py --device cuda:0 --layers 32 --blocks 1000 --block-bytes 65536

The cache is one torch tensor per layer, [blocks, block_bytes] uint8,
registered with the engine.  First line printed: {"segment", "addrs", "pid"}.
Commands (one JSON object per line, one answer each):
    {"cmd": "fill", "seed": S} / {"cmd": "zero"}                    -> {}
    {"cmd": "sums"}       -> {"sums": [[per-block checksum] per layer]}
    {"cmd": "xfer", "op": "write"|"read", "target": SEG, "raddrs": [...],
     "mult": M, "add": A, "shuffle": S, "reps": R}
        local block b of layer l <-> remote block (b*M+A) % blocks of layer l;
        with shuffle S != 0 instead a random permutation per layer (seed S)
        and the requests in random order over all layers (block_pairs())
        -> {"secs": [...], "bytes": N} | {"error": ...}
    {"cmd": "kv_init", "producer": bool}                            -> {}
    {"cmd": "send_kv", "tokens": [...], "blocks": [...]}            -> {"stored": n}
    {"cmd": "recv_kv", "producer": SEG, "tokens": [...], "blocks": [...], "pull": bool}
                                                        -> {"matched": n, "secs": s}
    {"cmd": "exit"}
"""
import argparse
import array
import os
import random
import sys
import time

import torch

import mooncake_connector as mc

# The helper protocol lives beside this script (CI runs with PYTHONSAFEPATH,
# which keeps a script's own directory off sys.path).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from line_peer import answer as out, requests  # noqa: E402


def block_pairs(layers, blocks, mult=1, add=0, shuffle=0):
    """The (layer, local block, remote block) of each request, in request
    order.  shuffle != 0: neither side's consecutive requests are adjacent
    (a paged KV cache's scattered block table), so nothing can be merged."""
    if not shuffle:
        return [(li, b, (b * mult + add) % blocks) for li in range(layers)
                for b in range(blocks)]
    rng = random.Random(shuffle)
    pairs = []
    for li in range(layers):
        perm = list(range(blocks))
        rng.shuffle(perm)
        pairs += [(li, b, perm[b]) for b in range(blocks)]
    rng.shuffle(pairs)
    return pairs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=1000)
    ap.add_argument("--block-bytes", type=int, default=65536)
    ap.add_argument("--hostname", default="127.0.0.1")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    L, B, BB = args.layers, args.blocks, args.block_bytes
    kv = [torch.zeros((B, BB), dtype=torch.uint8, device=dev) for _ in range(L)]
    eng = mc.TransferEngine()
    eng.initialize(args.hostname, "P2PHANDSHAKE", "tcp", "")
    loc = f"cuda:{dev.index or 0}" if dev.type == "cuda" else "cpu"
    eng.batch_register_memory([t.data_ptr() for t in kv], [B * BB] * L, loc)
    kvx = None

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)


    # Per-block checksum: position-weighted sum of 8-byte words (wraps).
    nw = BB // 8
    w = (torch.arange(1, nw + 1, dtype=torch.int64, device=dev) * 2654435761) | 1

    out({"segment": eng.get_segment_name(), "addrs": [t.data_ptr() for t in kv],
         "pid": os.getpid()})
    for req in requests():
        cmd = req["cmd"]
        try:
            if cmd == "fill":
                g = torch.Generator(device=dev)
                g.manual_seed(req["seed"])
                for t in kv:
                    t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=dev,
                                          generator=g))
                sync()
                out({})
            elif cmd == "zero":
                for t in kv:
                    t.zero_()
                sync()
                out({})
            elif cmd == "sums":
                sums = [(t.view(torch.int64).view(B, nw) * w).sum(dim=1).tolist() for t in kv]
                out({"sums": sums})
            elif cmd == "xfer":
                pairs = block_pairs(L, B, req.get("mult", 1), req.get("add", 0),
                                    req.get("shuffle", 0))
                bases, rbases = [t.data_ptr() for t in kv], req["raddrs"]
                loc_a = [bases[li] + b * BB for li, b, _ in pairs]
                rem_a = [rbases[li] + rb * BB for li, _, rb in pairs]
                # Address lists as 8-byte buffers (as a connector holding numpy
                # block tables would pass them): no per-item parsing.
                loc_a, rem_a = array.array("Q", loc_a), array.array("Q", rem_a)
                lens = array.array("Q", [BB] * len(loc_a))
                fn = (eng.batch_transfer_sync_write if req["op"] == "write"
                      else eng.batch_transfer_sync_read)
                secs = []
                for _ in range(req.get("reps", 1)):
                    t0 = time.perf_counter()
                    fn(req["target"], loc_a, rem_a, lens)
                    secs.append(time.perf_counter() - t0)
                if os.environ.get("MC_GPU_TRACE") == "1":
                    sys.stderr.write(f"gpu_peer: xfer {len(lens)} blocks: {secs}\n")
                out({"secs": secs, "bytes": L * B * BB})
            elif cmd == "kv_init":
                lb = None
                if req.get("producer", True):
                    lb = mc.LookupBuffer(8 << 30, block_size=16, extents_per_block=L)
                kvx = mc.KVTransfer(eng, lb)
                out({})
            elif cmd == "send_kv":
                # Extents as CUDA tensors: one [block] row per layer, block-major.
                ext = [kv[li][b] for b in req["blocks"] for li in range(L)]
                out({"stored": kvx.send_kv(req["tokens"], ext)})
            elif cmd == "recv_kv":
                dest = [(kv[li][b].data_ptr(), BB) for b in req["blocks"] for li in range(L)]
                t0 = time.perf_counter()
                n = kvx.recv_kv(req["producer"], req["tokens"], dest, timeout=120.0,
                                extents_per_block=L, pull=req.get("pull", False))
                out({"matched": n, "secs": time.perf_counter() - t0})
            else:
                out({"error": f"unknown command {cmd}"})
        except mc.MooncakeError as e:
            out({"error": str(e), "type": type(e).__name__})
    if kvx is not None:
        kvx.close()
    eng.close()


if __name__ == "__main__":
    main()
