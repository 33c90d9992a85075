#!/usr/bin/env python3
"""Same-host CPU path (process_vm_readv/writev) vs single-thread memcpy and
vs TCP loopback, same run, two processes (benchmarks/transfer_bench.py).

    .venv/bin/python benchmarks/same_host_cpu_bench.py [--total-bytes 1G] [--batch 128]
        [--hugepages] [--transports same-host-cpu,tcp] [--cold]

For each transport (MC_SAME_HOST_CPU=1, then =0 i.e. TCP) it runs
transfer_bench.py: WRITE and READ of --total-bytes in 64 KiB and 4 KiB
blocks (batches of --batch, one thread), and the 4 KiB sync round trip;
then the same blocks scattered (transfer_bench.py --scatter: a batch's
blocks at random slots, so none can be merged with its neighbour: each is
moved on its own, like KV blocks spread over a paged cache).
Each point is timed after one untimed pass over the same bytes (warm, like
the reference; --cold times the first copies into the target's pages,
which cost the kernel more once per page).
The reference is one thread's memcpy of the same bytes (libc memcpy of
--total-bytes between two buffers made like the transfer's: same page size,
pre-faulted; best of 3), measured in this run.
Prints GB/s and ratios against the bars (64 KiB >= 0.8x memcpy, 4 KiB >=
0.5x memcpy, 4 KiB sync p50 <= 5 us).  The machine is shared: see the load
average printed with the results."""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def memcpy_gbps(n, hugepages):
    """One thread's memcpy (libc, via ctypes.memmove) between two buffers
    made like transfer_bench's (anonymous mmap, both pre-faulted; with
    --hugepages both madvised MADV_HUGEPAGE like the transfer's).  (numpy,
    used before, madvises large arrays itself: its memcpy ran on huge pages
    while the transfers ran on 4 KiB pages.)"""
    import ctypes
    import mmap
    bufs = []
    for _ in range(2):
        m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hugepages:
            m.madvise(mmap.MADV_HUGEPAGE)
        bufs.append((m, ctypes.addressof(ctypes.c_char.from_buffer(m))))
    (ma, a), (mb, b) = bufs
    ctypes.memset(a, 1, n)
    ctypes.memset(b, 0, n)  # fault both in
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        ctypes.memmove(b, a, n)
        best = max(best, n / (time.perf_counter() - t) / 1e9)
    return best


ROOT = os.path.dirname(HERE)
MEMCPY_REF = os.path.join(ROOT, "build", "bench", "memcpy_ref")


def memcpy_blocks_gbps(n, block, hugepages, scatter):
    """One thread's memcpy of n bytes in `block`-byte blocks, in order or
    scattered like --scatter (build/bench/memcpy_ref, benchmarks/c, built
    by main); None if it is not there."""
    if not os.access(MEMCPY_REF, os.X_OK):
        return None
    out = subprocess.run([MEMCPY_REF, str(n), str(block), "1" if hugepages else "0",
                          "1" if scatter else "0"], capture_output=True, text=True, timeout=600)
    return float(out.stdout) if out.returncode == 0 else None


def run(transport, args, scatter):
    env = {**os.environ, "MC_SAME_HOST_CPU": "1" if transport == "same-host-cpu" else "0",
           "MC_BENCH_HUGEPAGES": "1" if args.hugepages else "0"}
    cmd = [sys.executable, os.path.join(HERE, "transfer_bench.py"), "--engine", "ours",
           "--mode", "bandwidth" if scatter else "all", "--ops", "write,read",
           "--block-sizes", "64K,4K", "--batch-sizes", str(args.batch), "--threads", "1",
           "--total-bytes", args.total_bytes, "--buffer-size", args.total_bytes,
           "--latency-iters", "3000", "--max-seconds", "60"] + (["--scatter"] if scatter else []) \
        + ([] if args.cold else ["--warmup", str(args.warmup_passes)])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0:
        print(out.stdout[-2000:], out.stderr[-2000:], file=sys.stderr)
    return rows, out.returncode


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--total-bytes", default="1G")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--hugepages", action="store_true",
                    help="madvise(MADV_HUGEPAGE) every buffer (transfers and memcpy alike): "
                         "process_vm_* pins the target's pages, cheaper on huge pages")
    ap.add_argument("--transports", default="same-host-cpu,tcp")
    ap.add_argument("--warmup-passes", type=int, default=1,
                    help="untimed passes before each point (default 1, as the recorded runs; "
                         "the second pass was still slower than later ones on the "
                         "development VM: benchmarks/JOURNAL.md)")
    ap.add_argument("--cold", action="store_true",
                    help="time the first copy into each page (no untimed pass before the "
                         "clock); by default each point is timed after one untimed pass, "
                         "warm like the memcpy reference (best of 3 on pre-faulted buffers)")
    args = ap.parse_args()
    from transfer_bench import parse_size  # noqa: E402
    n = parse_size(args.total_bytes)
    print("# load average before: %s" % open("/proc/loadavg").read().strip())
    print("# transfers timed %s" % ("cold: the first copy into each page" if args.cold else
                                    "warm: after %d untimed pass(es) over the same bytes"
                                    % args.warmup_passes))
    ref = memcpy_gbps(n, args.hugepages)
    thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip() \
        if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled") else "?"
    print("# memcpy (one thread, %d MiB, %s; THP %s): %.2f GB/s" % (
        n >> 20, "MADV_HUGEPAGE" if args.hugepages else "default pages", thp, ref))
    # The same blocks copied one by one (in order / scattered like
    # --scatter): what a local copy of that layout costs, a second ratio.
    bref = {}
    r = subprocess.run(["make", "-s", "-C", ROOT, "build/bench/memcpy_ref"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        print("# cannot build memcpy_ref (no second reference): %s" % r.stderr[-500:],
              file=sys.stderr)
    for bs in (65536, 4096):
        for sc in (False, True):
            bref[(bs, sc)] = memcpy_blocks_gbps(n, bs, args.hugepages, sc)
            if bref[(bs, sc)]:
                print("# memcpy of %dK blocks %s (one thread): %.2f GB/s" % (
                    bs >> 10, "scattered" if sc else "in order", bref[(bs, sc)]))
    status = 0
    for tr, scatter in [(t, sc) for t in args.transports.split(",") for sc in (False, True)]:
        rows, rc = run(tr, args, scatter)
        status |= rc
        for r in rows:
            if r.get("kind") == "latency":
                bar = "  (bar <= 5 us)" if tr == "same-host-cpu" else ""
                print("%-14s %-5s 4 KiB sync round trip p50 %7.2f us  p99 %7.2f us%s" % (
                    tr, r["op"], r["p50_us"], r["p99_us"], bar))
            elif r.get("gbps"):
                bs = r.get("block")
                bar = {65536: 0.8, 4096: 0.5}.get(bs)
                b = bref.get((bs, bool(r.get("scatter"))))
                print("%-14s %-5s %6s blocks x%-4d %-9s %7.2f GB/s  %.2fx memcpy%s%s" % (
                    tr, r["op"], "%dK" % (bs >> 10), r.get("batch", 0),
                    "scattered" if r.get("scatter") else "adjacent", r["gbps"],
                    r["gbps"] / ref, "  (bar >= %.1fx)" % bar if bar and tr != "tcp" else "",
                    "  %.2fx block memcpy" % (r["gbps"] / b) if b else ""))
    print("# load average after: %s" % open("/proc/loadavg").read().strip())
    return 1 if status else 0


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.exit(main())
