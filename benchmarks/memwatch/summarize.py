"""Summarize a MC_MEMWATCH directory (sitecustomize.py here): per process,
the growth of RSS, of glibc's malloc heaps (held from the system, in use,
free inside), of Python's blocks and of tracemalloc's traced bytes, over
the first and the second half of its samples and per quarter (MiB/min,
least squares); the allocation sites that grew most (tracemalloc); the
malloc_trim results.

    python benchmarks/memwatch/summarize.py /tmp/mw [--min-mib 300] [--json out.json]
"""
import argparse
import glob
import json
import os


def slope(pts):
    """MiB/min of [(t s, bytes)], least squares; None under 3 points."""
    if len(pts) < 3:
        return None
    n = len(pts)
    mt = sum(t for t, _ in pts) / n
    mv = sum(v for _, v in pts) / n
    den = sum((t - mt) ** 2 for t, _ in pts)
    if den == 0:
        return None
    return round(sum((t - mt) * (v - mv) for t, v in pts) / den * 60 / 2**20, 2)


SERIES = {
    "rss": lambda r: r.get("VmRSS", 0) * 1024,
    "anon": lambda r: r.get("RssAnon", 0) * 1024,
    "heap_held": lambda r: r["mall"]["arena"] if "mall" in r else None,
    "heap_used": lambda r: r["mall"]["uordblks"] if "mall" in r else None,
    "heap_free": lambda r: r["mall"]["fordblks"] if "mall" in r else None,
    "mmapped": lambda r: r["mall"]["hblkhd"] if "mall" in r else None,
    "traced": lambda r: r.get("traced"),
    "tm_overhead": lambda r: r.get("tracemalloc_overhead"),
}


def summarize(d, min_mib=300, t_from=None, t_to=None):
    out = {}
    for path in sorted(glob.glob(os.path.join(d, "*.jsonl"))):
        recs = [json.loads(ln) for ln in open(path) if ln.strip()]
        recs = [r for r in recs if (t_from is None or r["t"] >= t_from) and
                (t_to is None or r["t"] <= t_to)]
        if len(recs) < 4 or recs[-1].get("VmRSS", 0) < min_mib * 1024:
            continue
        t0, t1 = recs[0]["t"], recs[-1]["t"]
        q = (t1 - t0) / 4
        row = {"name": recs[-1]["name"], "samples": len(recs), "minutes": round((t1 - t0) / 60, 1),
               "first": {}, "last": {}, "slope_h1": {}, "slope_h2": {}, "quarters": {}}
        for k, f in SERIES.items():
            pts = [(r["t"], f(r)) for r in recs if f(r) is not None]
            if not pts:
                continue
            row["first"][k] = round(pts[0][1] / 2**20, 1)
            row["last"][k] = round(pts[-1][1] / 2**20, 1)
            row["slope_h1"][k] = slope([p for p in pts if p[0] <= t0 + 2 * q])
            row["slope_h2"][k] = slope([p for p in pts if p[0] >= t0 + 2 * q])
            row["quarters"][k] = [slope([p for p in pts if t0 + i * q <= p[0] <= t0 + (i + 1) * q])
                                  for i in range(4)]
        row["threads"] = [recs[0].get("Threads"), recs[-1].get("Threads")]
        row["py_blocks"] = [recs[0].get("py_blocks"), recs[-1].get("py_blocks")]
        grew = [r["grew"] for r in recs if r.get("grew")]
        if grew:
            row["grew_last"] = grew[-1][:10]
        trims = [r["trim"] for r in recs if r.get("trim")]
        if trims:
            row["trim"] = trims[-1]
        out[os.path.basename(path)] = row
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--min-mib", type=float, default=300, help="skip processes smaller at the end")
    ap.add_argument("--from", dest="t_from", type=float, help="unix time: first sample used")
    ap.add_argument("--to", dest="t_to", type=float, help="unix time: last sample used")
    ap.add_argument("--json")
    args = ap.parse_args()
    res = summarize(args.dir, args.min_mib, args.t_from, args.t_to)
    for pid, row in res.items():
        print(f"{pid} {row['name']} ({row['samples']} samples, {row['minutes']} min, threads "
              f"{row['threads']}, py blocks {row['py_blocks']})")
        for k in row["first"]:
            print(f"  {k:12s} {row['first'][k]:9.1f} -> {row['last'][k]:9.1f} MiB   slope h1 "
                  f"{row['slope_h1'][k]} h2 {row['slope_h2'][k]}  quarters {row['quarters'][k]}")
        for g in row.get("grew_last", []):
            print(f"    +{g['kb']} KiB n={g['n']} {' < '.join(reversed(g['at']))}")
        if "trim" in row:
            print(f"  malloc_trim: {row['trim']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
