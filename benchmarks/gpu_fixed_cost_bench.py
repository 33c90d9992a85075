"""Issue 30: the same-host GPU path's fixed cost against torch's own on-GPU
copy, in one run (results in benchmarks/gpu_fixed_cost.md).

Ours: build/bench/gpu_fixed_cost (benchmarks/c/gpu_fixed_cost.c): two
processes on cuda:0 through the engine, 4 KiB round trips and 1 GiB of
shuffled 64 KiB / 2 MiB blocks in batches of 128 / 1024, each batch waited
for before the next ("seq") or all batches of the pass in flight ("pipe").
The reference: torch on the same GPU moving the same shuffled blocks
(dst.index_copy_(0, perm, src) over [nblocks, block] views, the
permutation the C tool wrote; as uint8 and as int64 elements, the faster
counts), timed with torch.cuda.synchronize():
  * "one call": the whole 1 GiB in one index_copy_ (the issue's reference);
  * "seq": one index_copy_ per batch of 128 blocks, synchronize after each;
  * "pipe": one index_copy_ per batch, one synchronize at the end;
  * 4 KiB: a 4 KiB copy_ + synchronize, p50.
torch runs before and after ours; each row takes the best pass of either.

    python benchmarks/gpu_fixed_cost_bench.py [--bin build/bench/gpu_fixed_cost]
        [--iters 2000] [--passes 5] [--out results.json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# torch is imported inside the functions that use it: --help does not load it.

GiB = 1 << 30
HERE = os.path.dirname(os.path.abspath(__file__))


def direct_note(r):
    """How many of the row's timed GPU copy jobs the submitting thread launched
    itself (MC_GPU_DIRECT), where the C tool reports it."""
    if "gpu_jobs" not in r:
        return ""
    return f"; {r['gpu_jobs_direct']} of {r['gpu_jobs']} jobs launched directly"


def torch_rows(tmp, passes, iters):
    import torch
    dev = "cuda:0"
    src = torch.randint(0, 255, (GiB,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    out = {}
    # The GPU busy for GFC_WARMUP_MS first (as ours before each row): an
    # idle GPU runs at a low clock for a while.
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < float(os.environ.get("GFC_WARMUP_MS", "200")) / 1e3:
        dst.copy_(src)
        torch.cuda.synchronize()
    # 4 KiB copy + synchronize.
    a, b = src[:4096], dst[8192:8192 + 4096]
    for _ in range(200):
        b.copy_(a)
        torch.cuda.synchronize()
    t = []
    for _ in range(iters):
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        t.append((time.perf_counter() - t0) * 1e6)
    out["4k"] = statistics.median(t)
    for bb in (65536, 2 << 20):
        with open(os.path.join(tmp, f"perm_{bb}.u32"), "rb") as f:
            perm = torch.frombuffer(bytearray(f.read()), dtype=torch.int32).long().to(dev)
        n = GiB // bb

        def once(batch, sync_each):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if batch is None:
                d2.index_copy_(0, perm, s2)
            else:
                for k in range(0, n, batch):
                    d2.index_copy_(0, perm[k:k + batch], s2[k:k + batch])
                    if sync_each:
                        torch.cuda.synchronize()
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        for dt, es in ((torch.uint8, 1), (torch.int64, 8)):
            s2, d2 = src.view(dt).view(n, bb // es), dst.view(dt).view(n, bb // es)
            for name, batch, sync_each in (("one", None, False), ("seq128", 128, True),
                                           ("pipe128", 128, False), ("seq1024", 1024, True),
                                           ("pipe1024", 1024, False)):
                if batch and batch > n:
                    continue
                once(batch, sync_each)
                best = min(once(batch, sync_each) for _ in range(passes))
                k = f"{bb}_{name}"
                out[k] = max(out.get(k, 0), GiB / best / 1e9)
                out[f"{k}_{dt}".replace("torch.", "")] = GiB / best / 1e9
            assert torch.equal(d2[perm[:8]].cpu(), s2[:8].cpu())
    del src, dst
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(HERE, "..", "build", "bench", "gpu_fixed_cost"))
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import torch
    tmp = tempfile.mkdtemp(prefix="gpu_fixed_cost")
    # Ours first writes the permutations the reference uses.
    p = subprocess.run([args.bin, tmp, str(args.iters), str(args.passes)], capture_output=True,
                       text=True, timeout=900)
    sys.stderr.write(p.stderr)
    ours = {}
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            ours[r["row"]] = r
    if "skipped" in ours:
        print(f"gpu_fixed_cost_bench: {ours['skipped']['why']}; nothing measured")
        return
    if p.returncode != 0:
        print(p.stdout)
        sys.exit(p.returncode)
    ref1 = torch_rows(tmp, args.passes, args.iters)
    ref2 = torch_rows(tmp, args.passes, args.iters)
    ref = {k: (min(ref1[k], ref2[k]) if k == "4k" else max(ref1[k], ref2[k])) for k in ref1}
    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "ours": ours,
           "torch_ref": ref, "torch_ref_runs": [ref1, ref2], "env": {
               k: v for k, v in os.environ.items() if k.startswith("MC_")}}
    print(f"GPU: {res['gpu']}, torch {res['torch']}")
    print(f"{'row':58s} {'ours':>14s} {'torch':>14s} {'ratio':>7s}")
    for op in ("write", "read"):
        r = ours[f"4k_{op}"]
        print(f"{'4 KiB ' + op.upper() + ' round trip p50 (p90, p99)':58s} "
              f"{r['p50_us']:8.1f} us    {ref['4k']:8.1f} us   (ours p90 {r['p90_us']:.1f}, "
              f"p99 {r['p99_us']:.1f}; submit returned p50 {r['submit_p50_us']:.1f} us; "
              f"torch: copy_ + synchronize{direct_note(r)})")
    for bb, label in ((65536, "64 KiB"), (2 << 20, "2 MiB")):
        for batch in (128, 1024):
            for mode in ("seq", "pipe"):
                for op in ("write", "read"):
                    k = f"{op}_{bb}_b{batch}_{mode}"
                    if k not in ours:
                        continue
                    r = ours[k]
                    g = r["best_gbps"]
                    one = ref[f"{bb}_one"]
                    same = ref.get(f"{bb}_{mode}{batch}")
                    ok = "" if r["bad_blocks"] == 0 else f"  {r['bad_blocks']} BAD BLOCKS"
                    print(f"{label} shuffled, batches of {batch} ({mode}), {op.upper():5s}      "
                          f"{g:8.1f} GB/s  {one:8.1f} GB/s  {g / one:5.2f}x  "
                          f"(vs torch {mode} per batch {same:.1f} GB/s: {g / same:.2f}x; "
                          f"{r['per_batch_us']:.1f} us per batch, "
                          f"{r.get('submit_per_batch_us', 0):.1f} in submit"
                          f"{direct_note(r)}){ok}")
                printed = any(f"{op}_{bb}_b{batch}_{mode}" in ours for op in ("write", "read"))
                same, one = ref.get(f"{bb}_{mode}{batch}"), ref[f"{bb}_one"]
                if printed and same:
                    # torch itself issuing the same batches: the ceiling of this mode
                    # (seq: a synchronize per batch) as a ratio of its one-call copy.
                    print(f"{label} shuffled, batches of {batch} ({mode}), torch itself"
                          f"{'':7s}{same:8.1f} GB/s  {one:8.1f} GB/s  {same / one:5.2f}x  "
                          f"(torch index_copy_ per batch"
                          f"{', synchronize after each' if mode == 'seq' else ''}: "
                          f"{GiB / same / 1e3 / -(-GiB // bb // batch):.1f} us per batch)")
                    res.setdefault("torch_per_batch_ratio", {})[f"{bb}_{mode}{batch}"] = same / one
    bad = sum(r.get("bad_blocks", 0) for r in ours.values())
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
