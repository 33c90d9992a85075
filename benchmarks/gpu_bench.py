"""GPU benchmarks (issue #7), references measured in the same run:

  * same-host GPU->GPU through the engine (two processes, one per GPU),
    1 GiB as 64 KiB blocks and as 2 MiB blocks against torch's peer copy of
    one contiguous 1 GiB tensor (y.copy_(x), cuda:0 -> cuda:1).  "shuffled"
    (the number that counts): each layer's blocks go to a random permutation
    of the peer's, requests in random order over all layers, so no two
    consecutive requests are adjacent on either side; "scattered": block i ->
    block (7i+3) mod n; "in order": block i -> block i (adjacent blocks merge
    into one copy, shown for comparison only);
  * GPU memory over TCP loopback (pinned staging on both ends) against host
    memory over TCP, 1 GiB as 64 KiB blocks, shuffled.

Each same-host transfer is paired with a reference copy right before it:
"paired median" is the median over the pairs of (reference time / transfer
time), so a drift of the machine between measurements (torch's own copy
moves 378-395 GB/s from run to run here) cancels out; the GB/s columns are
the best of each.

    python benchmarks/gpu_bench.py [--out results.json] [--reps 9] [--quick]
        [--same-host-only] [--sizes 64k,2m] [--env K=V ...]
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "..", "tests", "gpu_peer.py")
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
# torch, and tests/gpu_peer.py (which imports it), are imported inside the
# functions that use them: --help does not load torch.

GiB = 1 << 30
REF = "torch peer copy 1 GiB cuda:0->cuda:1"


class Peer:
    def __init__(self, device, layers, blocks, bb, env=None):
        self.p = subprocess.Popen(
            [sys.executable, PEER, "--device", device, "--layers", str(layers), "--blocks",
             str(blocks), "--block-bytes", str(bb)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})})
        info = json.loads(self.p.stdout.readline())
        self.segment, self.addrs = info["segment"], info["addrs"]

    def call(self, **req):
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        r = json.loads(self.p.stdout.readline())
        if "error" in r:
            raise RuntimeError(r["error"])
        return r

    def close(self):
        self.p.stdin.write('{"cmd":"exit"}\n')
        self.p.stdin.flush()
        self.p.wait(timeout=60)


class PeerCopy:
    """The reference: torch's peer copy of one contiguous 1 GiB tensor,
    y.copy_(x) cuda:0 -> cuda:1 plus synchronize of both devices."""

    def __init__(self, src="cuda:0", dst="cuda:1"):
        import torch
        self.x = torch.randint(0, 255, (GiB,), dtype=torch.uint8, device=src)
        self.y = torch.empty(GiB, dtype=torch.uint8, device=dst)
        self.devs = (src, dst)
        for _ in range(3):
            self.once()
        assert torch.equal(self.x[:1 << 20].cpu(), self.y[:1 << 20].cpu())

    def once(self):
        import torch
        t0 = time.perf_counter()
        self.y.copy_(self.x)
        for d in self.devs:
            torch.cuda.synchronize(d)
        return time.perf_counter() - t0

    def best_gbps(self, reps):
        return GiB / min(self.once() for _ in range(reps)) / 1e9

    def close(self):
        import torch
        del self.x, self.y
        torch.cuda.empty_cache()


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def engine_cases(da, db, bb, reps, cases, env=None, ref=None):
    """One pair of peers (one process per GPU), several transfers: each case
    (name, op, mult, add, shuffle) is timed (best of reps after a warm-up)
    and its bytes checked block by block.  Returns {name: GB/s}; with `ref`
    (a PeerCopy) each timed transfer is paired with a reference copy right
    before it and {name: (GB/s, [per-pair ratios])} comes back instead, so
    a drift of the machine between measurements cancels out."""
    from gpu_peer import block_pairs
    layers = 32
    blocks = GiB // (layers * bb)
    a = Peer(da, layers, blocks, bb, env)
    b = Peer(db, layers, blocks, bb, env)
    out = {}
    try:
        for seed, (name, op, mult, add, shuffle) in enumerate(cases, 1):
            src, dst = (a, b) if op == "write" else (b, a)
            src.call(cmd="fill", seed=seed)
            dst.call(cmd="zero")
            kw = dict(cmd="xfer", op=op, target=b.segment, raddrs=b.addrs, mult=mult, add=add,
                      shuffle=shuffle)
            a.call(**kw, reps=1)
            if ref is None:
                r = a.call(**kw, reps=reps)
                secs, ratios = r["secs"], None
            else:
                secs, ratios = [], []
                for _ in range(reps):
                    t_ref = ref.once()
                    r = a.call(**kw, reps=1)
                    secs.append(r["secs"][0])
                    ratios.append(t_ref / r["secs"][0])
            sa, sb = a.call(cmd="sums")["sums"], b.call(cmd="sums")["sums"]
            bad = sum(sa[li][lb] != sb[li][rb]
                      for li, lb, rb in block_pairs(layers, blocks, mult, add, shuffle))
            assert bad == 0, f"{name}: {bad} blocks differ"
            gbps = r["bytes"] / min(secs) / 1e9
            out[name] = gbps if ratios is None else (gbps, ratios)
        return out
    finally:
        a.close()
        b.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--reps", type=int, default=9,
                    help="timed transfers per case, each paired with a reference copy")
    ap.add_argument("--quick", action="store_true", help="fewer variants")
    ap.add_argument("--same-host-only", action="store_true", help="skip the TCP cases")
    ap.add_argument("--sizes", default="64k,2m", help="block sizes of the same-host cases")
    ap.add_argument("--env", action="append", default=[], metavar="K=V",
                    help="environment of the engine processes (repeatable)")
    args = ap.parse_args()
    import torch
    extra = dict(kv.split("=", 1) for kv in args.env)
    ngpu = torch.cuda.device_count()
    res = {"gpu": torch.cuda.get_device_name(0), "gpus": ngpu, "torch": torch.__version__,
           "env": extra, "results": {}}
    R = res["results"]
    P = res["paired"] = {}  # per case: each transfer / the reference copy right before it

    def rec(name, v, ratios=None):
        R[name] = round(v, 2)
        ref = R.get(REF)
        rel = f"  {v / ref:5.3f}x" if ref and name != REF and "TCP" not in name else ""
        if ratios:
            m = median(ratios)
            P[name] = {"median": round(m, 4), "min": round(min(ratios), 4),
                       "max": round(max(ratios), 4), "ratios": [round(x, 4) for x in ratios]}
            rel += f"  paired median {m:5.3f}x ({min(ratios):5.3f}-{max(ratios):5.3f})"
        print(f"{name:66s} {v:9.2f} GB/s{rel}", flush=True)

    db = "cuda:1" if ngpu > 1 else "cuda:0"
    ref = None
    if ngpu > 1:
        ref = PeerCopy("cuda:0", db)
        rec(REF, ref.best_gbps(args.reps))
    else:
        x = torch.empty(GiB, dtype=torch.uint8, device="cuda:0")
        y = torch.empty_like(x)
        y.copy_(x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize()
        rec("torch copy 1 GiB cuda:0->cuda:0", GiB / (time.perf_counter() - t0) / 1e9)
        del x, y
        torch.cuda.empty_cache()
    modes = ["kernel"] if args.quick else ["kernel", "batch", "async"]
    sizes = [(bb, label) for bb, label, key in ((65536, "64 KiB", "64k"), (2 << 20, "2 MiB", "2m"))
             if key in args.sizes.split(",")]
    for mode in modes:
        env = {**extra, "MC_GPU_D2D_COPY": mode}
        for bb, label in sizes:
            pre = f"engine same-host {mode} 1 GiB as {label} blocks,"
            cases = [(f"{pre} shuffled WRITE", "write", 1, 0, 11),
                     (f"{pre} shuffled READ", "read", 1, 0, 12)]
            if mode == "kernel":
                cases += [(f"{pre} scattered (7i+3) WRITE", "write", 7, 3, 0),
                          (f"{pre} in order WRITE (adjacent blocks merge)", "write", 1, 0, 0)]
            got = engine_cases("cuda:0", db, bb, args.reps, cases, env, ref)
            for name, v in got.items():
                rec(name, *v) if ref else rec(name, v)
    if ref:
        ref.close()
    if not args.same_host_only:
        tcp = {**extra, "MC_GPU_IPC": "0"}
        reps = max(2, args.reps // 2)
        shuf = [("w", "write", 1, 0, 11)]
        host = engine_cases("cpu", "cpu", 65536, reps, shuf, tcp)["w"]
        rec("TCP loopback host->host 1 GiB as 64 KiB blocks, shuffled", host)
        g = engine_cases("cuda:0", db, 65536, reps, shuf + [("r", "read", 1, 0, 12)], tcp)
        rec("TCP loopback GPU->GPU (staged) 1 GiB as 64 KiB blocks, shuffled WRITE", g["w"])
        rec("TCP loopback GPU->GPU (staged) 1 GiB as 64 KiB blocks, shuffled READ", g["r"])
        res["tcp_gpu_over_host"] = round(g["w"] / host, 3)
        print(f"TCP GPU/host ratio: {g['w'] / host:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
