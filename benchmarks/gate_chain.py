"""Where a pushed layer's hand-off goes on the CUDA gate path (issue 31):
from the prefill's forward thread saving a layer (MC_TRACE "layer_saved")
to the decode having its "layer" notification ("c_recv", counted only
when the decode was already waiting for that layer: "layer_wait" before
it), split by the engine's own timeline (MC_GPU_TRACE=1 with
MC_LOG_LEVEL=info in the prefill's log: the gate thread's submit after the
event, and the same-host GPU copy job's queued / picked up / launched /
done seen times).

    python -P benchmarks/gate_chain.py TRACE.jsonl PREFILL.log [PREFILL2.log ...]

Both clocks are CLOCK_MONOTONIC (the engine logs microseconds modulo 100 s:
util/clock.h, mc_trace_us).  Each layer_saved of a prefill process is
matched to the first submit of its log at or after it, and that submit to
the first D2D job queued at or after it; a log is matched to the prefill
process whose saves it explains best.  Prints per prompt length (tokens
scheduled by the prefill, bucketed) and mode the p50 of each hop in ms.
"""
import collections
import json
import re
import statistics
import sys

WRAP_US = 1e8
SUBMIT = re.compile(r"gpu trace: (\d+) requests at ([0-9.]+) us: .*whole call to its "
                    r"transport")
JOB = re.compile(r"gpu trace: D2D job cuda:\d+, (\d+) copies: queued at ([0-9.]+) us, "
                 r"launched \+([0-9.]+) us, done seen \+([0-9.]+) us, picked up \+([0-9.]+) us")
HOPS = ("saved -> gate submit (event, gate wake)", "submit -> copy job queued",
        "queued -> picked up (copy worker)", "picked up -> launched",
        "launched -> done seen (copy + completion)", "done seen -> decode has it",
        "saved -> decode has it (decode waiting)")


def read_log(path):
    """(submits: [us], jobs: [(queued, picked, launched, done) us]) of one
    engine log, in file order."""
    subs, jobs = [], []
    with open(path, errors="replace") as f:
        for ln in f:
            m = SUBMIT.search(ln)
            if m:
                subs.append(float(m.group(2)))
                continue
            m = JOB.search(ln)
            if m:
                q = float(m.group(2))
                jobs.append((q, q + float(m.group(5)), q + float(m.group(3)),
                             q + float(m.group(4))))
    return subs, sorted(jobs)


def _next(xs, t, limit_us):
    """The element of xs (numbers, or tuples led by one) that comes first at
    or after t, within limit_us, on the clock that wraps every 100 s; None."""
    best, bd = None, limit_us
    for x in xs:
        d = ((x[0] if isinstance(x, tuple) else x) - t) % WRAP_US
        if d < bd:
            best, bd = x, d
    return best


def chains(events, logs):
    """{bucket: {hop: [ms, ...]}} from trace events and {log path: read_log()}."""
    byk = collections.defaultdict(list)
    for e in events:
        byk[e["k"]].append(e)
    saves = collections.defaultdict(list)  # prefill pid -> [(t_us, key, layer)]
    for k, v in byk.items():
        for x in v:
            if x["ev"] == "layer_saved":
                saves[x["pid"]].append(((x["t"] * 1e6) % WRAP_US, k, x["li"]))
    # which log is which prefill: the one with the most saves followed by a
    # submit within 5 ms
    owner = {}
    for path, (subs, _) in logs.items():
        best = None
        for pid, ss in saves.items():
            hit = sum(1 for t, _, _ in ss[:200] if _next(subs, t, 5000) is not None)
            if best is None or hit > best[0]:
                best = (hit, pid)
        if best and best[0]:
            owner[best[1]] = path
    out = collections.defaultdict(lambda: collections.defaultdict(list))
    for pid, path in owner.items():
        subs, jobs = logs[path]
        for t, k, li in sorted(saves[pid]):
            v = byk[k]
            n = next((x.get("n_sched") for x in v if x["ev"] == "sched_publish"), None)
            if n is None:
                continue
            # the proxy's transfer id "push-<request id>-<hex>"; ttft_timeline's
            # request ids "tl-<mode>-<words>-<i>-<pid>"
            parts = k.split("-")
            mode = parts[2] if len(parts) > 3 and parts[1] == "tl" else "?"
            b = (mode, min((128, 512, 1024, 1900), key=lambda L: abs(L - n)))
            s = _next(subs, t, 20000)
            if s is None:
                continue
            hop = out[b]
            hop[HOPS[0]].append(((s - t) % WRAP_US) / 1e3)
            done = None
            job = _next(jobs, s, 20000)
            if job is not None:
                q, p, la, done = job
                hop[HOPS[1]].append(((q - s) % WRAP_US) / 1e3)
                hop[HOPS[2]].append((p - q) / 1e3)
                hop[HOPS[3]].append((la - p) / 1e3)
                hop[HOPS[4]].append((done - la) / 1e3)
            wait = next((x["t"] for x in v if x["ev"] == "layer_wait" and x.get("li") == li), None)
            recv = next((x["t"] for x in v if x["ev"] == "c_recv" and li in (x.get("l") or ())),
                        None)
            if wait is not None and recv is not None and wait < recv:
                r_us = (recv * 1e6) % WRAP_US
                hop[HOPS[6]].append(((r_us - t) % WRAP_US) / 1e3)
                if done is not None:
                    hop[HOPS[5]].append(((r_us - done) % WRAP_US) / 1e3)
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print(__doc__)
        return 2
    from mooncake_connector import trace
    events = trace.read(argv[0])
    logs = {p: read_log(p) for p in argv[1:]}
    res = chains(events, logs)
    for b in sorted(res):
        print(f"{b[0]}, ~{b[1]} tokens (p50 ms, n):")
        for h in HOPS:
            xs = res[b].get(h) or []
            print(f"  {h:<46} " + (f"{statistics.median(xs):7.3f} ({len(xs)})" if xs else "-"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
