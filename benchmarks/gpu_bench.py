"""GPU benchmarks (issue #7), references measured in the same run:

  * same-host GPU->GPU through the engine (two processes, one per GPU),
    1 GiB as 64 KiB blocks and as 2 MiB blocks, scattered (block i -> block
    (7i+3) mod n) and in order, against torch's peer copy of one contiguous
    1 GiB tensor (y.copy_(x), cuda:0 -> cuda:1);
  * GPU memory over TCP loopback (pinned staging on both ends) against host
    memory over TCP, 1 GiB as 64 KiB blocks.

    python benchmarks/gpu_bench.py [--out results.json] [--reps 5]
"""
import argparse
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "..", "tests", "gpu_peer.py")
GiB = 1 << 30


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


def torch_peer_copy(reps):
    x = torch.randint(0, 255, (GiB,), dtype=torch.uint8, device="cuda:0")
    y = torch.empty(GiB, dtype=torch.uint8, device="cuda:1")
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize("cuda:1")
    best = 1e9
    for _ in range(reps):
        t0 = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
        best = min(best, time.perf_counter() - t0)
    assert torch.equal(x.cpu()[:1 << 20], y.cpu()[:1 << 20])
    del x, y
    torch.cuda.empty_cache()
    return GiB / best / 1e9


def engine_xfer(da, db, bb, reps, mult, add, env=None, op="write", check=True):
    layers = 32
    blocks = GiB // (layers * bb)
    a = Peer(da, layers, blocks, bb, env)
    b = Peer(db, layers, blocks, bb, env)
    try:
        a.call(cmd="fill", seed=3)
        b.call(cmd="zero")
        a.call(cmd="xfer", op=op, target=b.segment, raddrs=b.addrs, mult=mult, add=add, reps=1)
        r = a.call(cmd="xfer", op=op, target=b.segment, raddrs=b.addrs, mult=mult, add=add,
                   reps=reps)
        if check and op == "write":
            sa, sb = a.call(cmd="sums")["sums"], b.call(cmd="sums")["sums"]
            ok = all(sb[li][(i * mult + add) % blocks] == sa[li][i]
                     for li in range(layers) for i in range(blocks))
            assert ok, "bytes differ"
        return r["bytes"] / min(r["secs"]) / 1e9
    finally:
        a.close()
        b.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="fewer variants")
    ap.add_argument("--same-host-only", action="store_true", help="skip the TCP cases")
    args = ap.parse_args()
    ngpu = torch.cuda.device_count()
    res = {"gpu": torch.cuda.get_device_name(0), "gpus": ngpu, "torch": torch.__version__,
           "results": {}}
    R = res["results"]

    def rec(name, v):
        R[name] = round(v, 2)
        print(f"{name:60s} {v:9.2f} GB/s", flush=True)

    db = "cuda:1" if ngpu > 1 else "cuda:0"
    if ngpu > 1:
        rec("torch peer copy 1 GiB cuda:0->cuda:1", torch_peer_copy(args.reps))
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
    for mode in modes:
        env = {"MC_GPU_D2D_COPY": mode}
        for bb, label in ((65536, "64 KiB"), (2 << 20, "2 MiB")):
            rec(f"engine same-host {mode} 1 GiB as {label} blocks, scattered",
                engine_xfer("cuda:0", db, bb, args.reps, 7, 3, env))
            if mode == "kernel":
                rec(f"engine same-host {mode} 1 GiB as {label} blocks, in order",
                    engine_xfer("cuda:0", db, bb, args.reps, 1, 0, env))
                rec(f"engine same-host {mode} 1 GiB as {label} blocks, READ scattered",
                    engine_xfer("cuda:0", db, bb, args.reps, 7, 3, env, op="read",
                                check=False))
    if args.same_host_only:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        return
    tcp = {"MC_GPU_IPC": "0"}
    reps = max(2, args.reps // 2)
    host = engine_xfer("cpu", "cpu", 65536, reps, 7, 3, tcp)
    rec("TCP loopback host->host 1 GiB as 64 KiB blocks", host)
    gpu = engine_xfer("cuda:0", db, 65536, reps, 7, 3, tcp)
    rec("TCP loopback GPU->GPU (staged) 1 GiB as 64 KiB blocks", gpu)
    rec("TCP loopback GPU->GPU READ (staged) 1 GiB as 64 KiB blocks",
        engine_xfer("cuda:0", db, 65536, reps, 7, 3, tcp, op="read", check=False))
    res["tcp_gpu_over_host"] = round(gpu / host, 3)
    print(f"TCP GPU/host ratio: {gpu / host:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
