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
* lag: the decode's forward end - the prefill's forward end.

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


def measure(events):
    by = collections.defaultdict(list)
    for e in events:
        by[e.get("k")].append(e)
    notice, target, lag = [], [], []
    for v in by.values():
        waits = [e for e in v if e["ev"] == "layer_wait"]
        if not waits:
            continue
        v.sort(key=lambda e: e["t"])
        saved = {e["li"]: e["t"] for e in v if e["ev"] == "layer_saved"}
        recv = {}
        for e in v:
            if e["ev"] == "c_recv" and e.get("what") == "layer":
                for li in e["l"]:
                    recv.setdefault(li, e["t"])
        notice += [(recv[li] - saved[li]) * 1e3 for li in saved if li in recv]
        q = [e["t"] for e in v if e["ev"] == "target_queued"]
        s = [e["t"] for e in v if e["ev"] == "notify_sent" and e.get("what") == "target"]
        if q and s:
            target.append((s[0] - q[0]) * 1e3)
        dpid = waits[0]["pid"]
        ppids = [e["pid"] for e in v if e["ev"] == "layer_saved"]
        ends = {e["pid"]: e["t"] for e in v if e["ev"] == "fwd_end"}
        if ppids and dpid in ends and ppids[0] in ends:
            lag.append((ends[dpid] - ends[ppids[0]]) * 1e3)
    return notice, target, lag


def main(paths):
    if not paths:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    for path in paths:
        notice, target, lag = measure(load(path))
        print(path)
        for name, xs in (("layer notice, saved -> decode has it", notice),
                         ("target, queued -> the producer's receipt", target),
                         ("decode forward end - prefill forward end", lag)):
            print(f"  {name}: n={len(xs)} p50 {quantile(xs, .5):.2f} p90 {quantile(xs, .9):.2f} "
                  f"max {max(xs, default=float('nan')):.2f} ms; over 2 ms: "
                  f"{sum(x > 2 for x in xs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
