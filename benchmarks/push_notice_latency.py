"""Push layer load: how late the decode hears of each layer, from an MC_TRACE
file (benchmarks/ttft_timeline.py writes one; docs/connector.md "Tracing one
request").  Issue 31, benchmarks/JOURNAL.md "Run 52".

For every request whose decode waited per layer (layer_wait events):

* layer notice: the prefill's save_kv_layer of layer i (layer_saved, vLLM's
  forward thread, when it launched the layer) -> the decode's forward thread
  took the "layer" notice for it (c_recv);
* target: the decode queued its "target" (where its blocks are) on the push
  outbox (target_queued, forward thread) -> the outbox's thread had the
  prefill engine's receipt (notify_sent);
* target taken: the same start -> the prefill's Python took it (p_recv,
  its first copy: the forward thread's drain in save_kv_layer, or the
  producer's waiter);
* lag: the decode's forward end - the prefill's forward end;
* GIL after the wake: where the decode's forward thread took a "layer"
  notice right after its wait for it ended (a "woke" event, the engine's
  last_wake()), how long it then waited for the GIL (another thread of the
  decode's process running Python keeps it up to the switch interval).

Requests are grouped by the timeline's mode and prompt length where the
proxy's dispatch names them (ttft_timeline.py's request ids
"tl-<mode>-<tokens>-<i>-<pid>": push_ll against push_ll_c, an --env-c or
--extra-c A/B in one trace); others fall under "-".

    python3 benchmarks/push_notice_latency.py TRACE.jsonl[.xz] [...]
"""
import collections
import json
import lzma
import sys


def load(path):
    op = lzma.open if path.endswith(".xz") else open
    with op(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def quantile(xs, f):
    return sorted(xs)[min(len(xs) - 1, int(len(xs) * f))] if xs else float("nan")


def group_of(events):
    """{transfer key: (mode, prompt tokens)} from the proxy's dispatch events
    (rid "tl-<mode>-<tokens>-<i>-<pid>")."""
    out = {}
    for e in events:
        if e.get("ev") == "proxy_dispatch" and str(e.get("rid", "")).startswith("tl-"):
            parts = e["rid"].split("-")
            if len(parts) >= 5:
                out[e["k"]] = ("-".join(parts[1:-3]), parts[-3])
    return out


def measure(events):
    """{(mode, tokens): (notice, target, lag, target taken, GIL after the
    wake)} lists of ms (module doc)."""
    by = collections.defaultdict(list)
    for e in events:
        by[e.get("k")].append(e)
    groups = group_of(events)
    out = collections.defaultdict(lambda: ([], [], [], [], []))
    for k, v in by.items():
        waits = [e for e in v if e["ev"] == "layer_wait"]
        if not waits:
            continue
        notice, target, lag, taken, gil = out[groups.get(k, ("-", "-"))]
        v.sort(key=lambda e: e["t"])
        saved = {e["li"]: e["t"] for e in v if e["ev"] == "layer_saved"}
        recv = {}
        last = {}  # (pid, thread) -> that thread's previous event
        for e in v:
            th = (e.get("pid"), e.get("tid"))
            if e["ev"] == "c_recv" and e.get("what") == "layer":
                for li in e["l"]:
                    recv.setdefault(li, e["t"])
                prev = last.get(th)
                if prev is not None and prev["ev"] == "woke" and "gil_ms" in prev:
                    gil.append(float(prev["gil_ms"]))
            last[th] = e
        notice += [(recv[li] - saved[li]) * 1e3 for li in saved if li in recv]
        q = [e["t"] for e in v if e["ev"] == "target_queued"]
        s = [e["t"] for e in v if e["ev"] == "notify_sent" and e.get("what") == "target"]
        if q and s:
            target.append((s[0] - q[0]) * 1e3)
        pr = [e["t"] for e in v if e["ev"] == "p_recv" and e.get("what") == "target"]
        if q and pr:
            taken.append((pr[0] - q[0]) * 1e3)
        dpid = waits[0]["pid"]
        ppids = [e["pid"] for e in v if e["ev"] == "layer_saved"]
        ends = {e["pid"]: e["t"] for e in v if e["ev"] == "fwd_end"}
        if ppids and dpid in ends and ppids[0] in ends:
            lag.append((ends[dpid] - ends[ppids[0]]) * 1e3)
    return dict(out)


def main(paths):
    if not paths:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    for path in paths:
        groups = measure(load(path))
        print(path)
        modes = sorted({m for m, _ in groups})
        for mode in modes:
            keys = sorted((g for g in groups if g[0] == mode),
                          key=lambda g: int(g[1]) if g[1].isdigit() else -1)
            rows = [(f"{mode} all", [sum((groups[g][i] for g in keys), []) for i in range(5)])]
            if len(keys) > 1:
                rows += [(f"{mode} {g[1]} tokens", groups[g]) for g in keys]
            for label, (notice, target, lag, taken, gil) in rows:
                print(f" {label}:")
                for name, xs in (("layer notice, saved -> decode has it", notice),
                                 ("target, queued -> the producer's receipt", target),
                                 ("target, queued -> the producer's Python took it", taken),
                                 ("decode forward end - prefill forward end", lag),
                                 ("decode's GIL after the notice's wake", gil)):
                    if not xs and name.startswith("decode's GIL"):
                        continue  # a trace from before the "woke" events
                    print(f"  {name}: n={len(xs)} p50 {quantile(xs, .5):.2f} "
                          f"p90 {quantile(xs, .9):.2f} max {max(xs, default=float('nan')):.2f} "
                          f"ms; over 2 ms: {sum(x > 2 for x in xs)}")
        for line in ratios(groups):
            print(line)
    return 0


def ratios(groups):
    """An A/B's two sets in one trace (push_ll and push_ll_c): per prompt
    length, each latency's p50 in set c over set a (below 1: c sooner)."""
    out = []
    for mode in sorted({m for m, _ in groups}):
        other = mode + "_c"
        for (m, n) in sorted(g for g in groups if g[0] == mode):
            if (other, n) not in groups:
                continue
            a, c = groups[(m, n)], groups[(other, n)]
            parts = []
            for name, i in (("layer notice", 0), ("target receipt", 1), ("target taken", 3),
                            ("GIL after the wake", 4)):
                pa, pc = quantile(a[i], .5), quantile(c[i], .5)
                if a[i] and c[i] and pa > 0:
                    parts.append(f"{name} {pc / pa:.2f}x")
            if parts:
                out.append(f" p50 {other} / {mode} at {n} tokens: {', '.join(parts)}")
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
