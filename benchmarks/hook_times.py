"""Print the connector's hook times (MC_HOOK_TIMES, mooncake_connector/hook_times.py)
side by side: one block per server side, one row per step class and hook.

    python3 benchmarks/hook_times.py PREFIX_OR_FILES... [--json OUT]

Columns: calls, calls per step of that class, wall and CPU ms per step of
that class (sums / steps), p50 / p90 / max ms per call.  "per step" puts
every hook of a class on one axis: the last row of each class is the sum,
what the connector costs a step of that kind on the thread that calls it.
"""
import argparse
import glob
import json
import os


def load(args):
    files = []
    for a in args:
        files += sorted(glob.glob(a + ".*.json")) if not a.endswith(".json") else [a]
    out = []
    for f in files:
        try:
            with open(f, encoding="utf-8") as fh:
                d = json.load(fh)
        except (OSError, ValueError):
            continue
        d["file"] = os.path.basename(f)
        out.append(d)
    return out


def table(d):
    lines = [f"== {d['tree']}  {d['role']} {d['side']}  pid {d['pid']}  steps {d['steps']}",
             f"{'class/hook':44s} {'calls':>7s} {'/step':>6s} {'wall/step':>9s} {'cpu/step':>9s} "
             f"{'p50':>7s} {'p90':>7s} {'max':>8s}"]
    by_cls = {}
    for k, v in d["hooks"].items():
        by_cls.setdefault(k.split("/", 1)[0], []).append((k, v))
    for cls, rows in sorted(by_cls.items()):
        steps = d["steps"].get(cls) or 0
        tw = tc = 0.0
        for k, v in sorted(rows, key=lambda kv: -kv[1]["wall_ms"]):
            per = (lambda x: x / steps) if steps else (lambda x: float("nan"))
            tw += v["wall_ms"]
            tc += v["cpu_ms"]
            lines.append(f"{k:44s} {v['n']:7d} {per(v['n']):6.2f} {per(v['wall_ms']):9.4f} "
                         f"{per(v['cpu_ms']):9.4f} {v['p50_ms']:7.4f} {v['p90_ms']:7.4f} "
                         f"{v['max_ms']:8.3f}")
        if steps:
            lines.append(f"{cls + '/ALL':44s} {'':7s} {'':6s} {tw / steps:9.4f} {tc / steps:9.4f}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    ds = load(a.paths)
    ds.sort(key=lambda d: (d["tree"], d["role"], d["side"]))
    for d in ds:
        print(table(d))
        print()
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(ds, f, indent=1)


if __name__ == "__main__":
    main()
