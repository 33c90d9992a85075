"""What each push save_kv_layer costs the prefill's forward thread (issue
31), from an MC_TRACE file (save_in / save_out around each save of a traced
push request, with the thread's CPU seconds "ct"): per prefill process, the
p50 wall and CPU of a save, split into the saves in which the decode's
target arrived (a "p_recv" target event of that process inside the save)
and the others, and the sum over a request's saves.

    python -P benchmarks/save_cost.py TRACE.jsonl [PID=LABEL ...]
"""
import collections
import json
import statistics
import sys


def saves(events):
    """{pid: [(wall s, cpu s, target arrived in it, key)]} in trace order."""
    open_, out = {}, collections.defaultdict(list)
    recv = collections.defaultdict(list)
    for x in events:
        if x.get("ev") == "p_recv" and x.get("what") == "target":
            recv[x["pid"]].append(x["t"])
    for x in events:
        ev = x.get("ev")
        if ev == "save_in":
            open_[(x["pid"], x["tid"], x["k"])] = x
        elif ev == "save_out":
            a = open_.pop((x["pid"], x["tid"], x["k"]), None)
            if a is None:
                continue
            arrived = any(a["t"] <= t <= x["t"] for t in recv[x["pid"]])
            out[x["pid"]].append((x["t"] - a["t"], x["ct"] - a["ct"], arrived, x["k"]))
    return out


def p50(xs):
    return statistics.median(xs) * 1e3 if xs else float("nan")


def main(argv):
    if not argv:
        print(__doc__)
        return 2
    labels = dict(a.split("=", 1) for a in argv[1:])
    with open(argv[0]) as f:
        events = [json.loads(ln) for ln in f if ln.strip()]
    events.sort(key=lambda x: x.get("t", 0))
    for pid, rows in sorted(saves(events).items()):
        other = [r for r in rows if not r[2]]
        arr = [r for r in rows if r[2]]
        per_req = collections.defaultdict(float)
        for r in rows:
            per_req[r[3]] += r[1]
        print(f"prefill pid {pid} {labels.get(str(pid), '')}: {len(rows)} saves of "
              f"{len(per_req)} requests; a save p50 wall {p50([r[0] for r in other]):.3f} ms, "
              f"CPU {p50([r[1] for r in other]):.3f} ms; the save the target arrived in "
              f"({len(arr)}) wall {p50([r[0] for r in arr]):.3f}, CPU "
              f"{p50([r[1] for r in arr]):.3f} ms; per request, summed CPU p50 "
              f"{p50(list(per_req.values())):.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
