"""Where a pulled request's time goes (flows a / b), from an MC_TRACE file.

    python3 benchmarks/pull_timeline.py TRACE.jsonl [--since-proxy]

Reads the events the proxy, the decode's scheduler and its worker append
(docs/connector.md "Tracing one request"): per pull (keyed by vLLM's request
id, which contains the proxy's X-Request-Id) the milliseconds between
consecutive points, p50 / p90 over the pulls of each prompt size (blocks):

  proxy_post(decode) -> sched_match (the producer's answer known)
  -> sched_alloc (blocks allocated) -> pull_start (the worker queues it)
  -> recv_done (every block in) -> sched_recv_seen (vLLM's scheduler learns
  it) -> sched_compute (the request's first step) -> proxy_chunk_in (the
  decode's first chunk at the proxy).

A point a request lacks (an in-step load has no sched_recv_seen) is left
out of its stretches.
"""
import argparse
import collections
import json
import statistics
import sys

ORDER = ("proxy_post", "probe_wait", "sched_match", "sched_alloc", "pull_start", "recv_done",
         "sched_recv_seen", "sched_compute", "proxy_chunk_in")


def read(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                yield json.loads(line)
            except ValueError:
                continue


def timelines(events):
    """{vLLM request id: {event: first t}} for pulls; proxy events joined by
    the proxy's request id contained in vLLM's."""
    pulls, proxy = collections.defaultdict(dict), collections.defaultdict(list)
    for e in events:
        ev, k = e.get("ev"), e.get("k")
        if not isinstance(k, str):
            continue
        if ev in ("proxy_post", "proxy_chunk_in"):
            if ev == "proxy_post" and e.get("role") != "decode":
                continue
            if ev == "proxy_chunk_in" and e.get("role") != "decode":
                continue
            proxy[k].append(e)
        elif ev in ORDER or ev == "pull_start":
            if ev in ("sched_match", "sched_alloc") and e.get("flow") not in ("A", "B"):
                continue
            pulls[k].setdefault(ev, e["t"])
            if ev == "pull_start":
                pulls[k]["_blocks"] = e.get("blocks")
    out = {}
    for rid, pts in pulls.items():
        if "pull_start" not in pts:
            continue
        for prid, evs in proxy.items():
            if prid and prid in rid:
                for e in evs:
                    pts.setdefault(e["ev"], e["t"])
                break
        out[rid] = pts
    return out


def table(tls):
    """Per prompt size: each stretch between consecutive points a pull has."""
    by_size = collections.defaultdict(list)
    for pts in tls.values():
        by_size[pts.get("_blocks")].append(pts)
    lines = []
    for size in sorted(by_size, key=lambda x: (x is None, x)):
        group = by_size[size]
        lines.append(f"{size} blocks, {len(group)} pulls (ms, p50 / p90)")
        stretches = collections.defaultdict(list)
        for p in group:
            have = [ev for ev in ORDER if ev in p]
            for a, b in zip(have, have[1:]):
                stretches[(a, b)].append((p[b] - p[a]) * 1e3)
        for (a, b), d in sorted(stretches.items(), key=lambda kv: ORDER.index(kv[0][0])):
            d.sort()
            lines.append(f"  {a:>16} -> {b:<16} {statistics.median(d):8.2f} / "
                         f"{d[int(0.9 * (len(d) - 1))]:8.2f}  (n {len(d)})")
        d = sorted((p["proxy_chunk_in"] - p["proxy_post"]) * 1e3 for p in group
                   if "proxy_post" in p and "proxy_chunk_in" in p)
        if d:
            lines.append(f"  decode leg posted -> its first chunk {statistics.median(d):8.2f} ms "
                         f"p50 (n {len(d)})")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    args = ap.parse_args(argv)
    tls = timelines(read(args.trace))
    if not tls:
        print(f"{args.trace}: no pull (flows a / b) with a pull_start event", file=sys.stderr)
        return 1
    print(table(tls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
