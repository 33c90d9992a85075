"""The connector's fixed per-request cost (serving_bench.py's last line) with
the decode's probe_wait_ms off and on, deployments alternating in one run.

    PYTHONPATH=. .venv/bin/python -P benchmarks/fixed_cost_ab.py \\
        [--rounds 2] [--requests 40] [--waits 0,5] [--out build/fixed_cost_ab.json]

Each round starts serving_bench.py's servers (the --kv32k model: metadata
server, prefill, decode, colocated vLLM CPU servers; no proxy) once per
value of --waits (the decode's kv_connector_extra_config probe_wait_ms) and
sends serving_bench.measure_fixed's requests to them: a ~40-token prompt the prefill
never saw, to the colocated server then straight to the decode server
(lookup at the producer, miss, computed locally).  Printed per deployment
and pooled per value: decode - colocated TTFT p50, and the paired median
(the same prompt on both, back to back), and each server's vLLM queue time
(arrival to scheduled) p50, with the load average.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from serving_bench import KV32K_SPEC, SETTLE_S, one_token_ttft, prompt_of  # noqa: E402
from ttft_timeline import scrape  # noqa: E402

QUEUE = "vllm:request_queue_time_seconds"


def measure(colocated_url, decode_url, n, seed0=900_000):
    """serving_bench.measure_fixed's requests (same prompts, same order),
    plus each request's time in vLLM's waiting queue (its server's
    request_queue_time histogram sum, scraped around it): arrival to
    scheduled, where a skipped first step shows."""
    out = {k: [] for k in ("colocated", "decode", "queue_colocated", "queue_decode")}
    for i in range(n):
        p = prompt_of(40, seed0 + i)
        for k, url in (("colocated", colocated_url), ("decode", decode_url)):
            time.sleep(SETTLE_S)
            q0 = scrape(url, (QUEUE,)).get(QUEUE)
            out[k].append(one_token_ttft(url, p))
            q1 = scrape(url, (QUEUE,)).get(QUEUE)
            out[f"queue_{k}"].append(None if q0 is None or q1 is None else q1 - q0)
    return out


def one(model, wait_ms, requests, workdir, trace_path=None):
    from mooncake_connector.deployment import Deployment
    dep = Deployment(workdir, model, flows=(), kv_cache_bytes=256 << 20,
                     decode_extra_config={"probe_wait_ms": wait_ms},
                     env={"MC_TRACE": trace_path} if trace_path else None)
    try:
        dep.start(timeout=600)
        measure(dep.colocated.url, dep.decode.url, 4, seed0=800_000)  # warm-up
        return measure(dep.colocated.url, dep.decode.url, requests)
    finally:
        dep.stop()


def _med_ms(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) * 1e3 if xs else None


def stats(fixed):
    c, d = fixed["colocated"], fixed["decode"]
    return {"n": len(d), "colocated_ms_p50": statistics.median(c) * 1e3,
            "decode_ms_p50": statistics.median(d) * 1e3,
            "fixed_ms_p50": (statistics.median(d) - statistics.median(c)) * 1e3,
            "paired_ms_p50": statistics.median(b - a for a, b in zip(c, d)) * 1e3,
            "queue_colocated_ms_p50": _med_ms(fixed["queue_colocated"]),
            "queue_decode_ms_p50": _med_ms(fixed["queue_decode"])}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--waits", default="0,5", help="probe_wait_ms values, comma-separated")
    ap.add_argument("--out", default="build/fixed_cost_ab.json")
    ap.add_argument("--trace", action="store_true",
                    help="MC_TRACE on the servers: the decode scheduler's probe_wait events "
                         "(how long each wait took, whether the answer came)")
    args = ap.parse_args(argv)
    waits = [float(x) for x in args.waits.split(",")]
    from mooncake_connector import tiny_model
    model = tiny_model.build(**KV32K_SPEC)
    root = tempfile.mkdtemp(prefix="mc-fixed-ab-")
    runs, pooled = [], {w: {} for w in waits}
    for r in range(args.rounds):
        for w in waits:
            la0 = os.getloadavg()
            wd = os.path.join(root, f"r{r}-w{w:g}")
            tpath = os.path.join(root, f"r{r}-w{w:g}.trace") if args.trace else None
            fixed = one(model, w, args.requests, wd, tpath)
            s = dict(stats(fixed), round=r, probe_wait_ms=w,
                     load_avg=[la0, os.getloadavg()])
            if tpath and os.path.exists(tpath):
                from mooncake_connector import trace
                ws = [e for e in trace.read(tpath) if e["ev"] == "probe_wait"]
                ms = sorted(e["ms"] for e in ws)
                if ms:
                    s["probe_wait_ms_p50"] = statistics.median(ms)
                    s["probe_wait_ms_max"] = ms[-1]
                    s["probe_waits"], s["probe_waits_answered"] = len(ws), sum(
                        bool(e["got"]) for e in ws)
                    print(f"  decode probe waits: {len(ws)}, answered {s['probe_waits_answered']}"
                          f", p50 {s['probe_wait_ms_p50']:.3f} ms, max {ms[-1]:.3f} ms",
                          flush=True)
            runs.append(s)
            for k in fixed:
                pooled[w].setdefault(k, []).extend(fixed[k])
            print(f"round {r} probe_wait_ms {w:g}: decode - colocated TTFT p50 "
                  f"{s['fixed_ms_p50']:.2f} ms, paired median {s['paired_ms_p50']:.2f} ms "
                  f"(colocated {s['colocated_ms_p50']:.1f}, decode {s['decode_ms_p50']:.1f} ms; "
                  f"queue time p50 colocated {s['queue_colocated_ms_p50']}, decode "
                  f"{s['queue_decode_ms_p50']} ms; "
                  f"n {s['n']}; load {la0[0]:.2f} -> {os.getloadavg()[0]:.2f})", flush=True)
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           "cpus": os.cpu_count(), "command": " ".join(sys.argv), "runs": runs,
           "pooled": {f"{w:g}": stats(pooled[w]) for w in waits}}
    for w in waits:
        s = out["pooled"][f"{w:g}"]
        print(f"pooled probe_wait_ms {w:g}: fixed cost p50 {s['fixed_ms_p50']:.2f} ms, paired "
              f"median {s['paired_ms_p50']:.2f} ms; vLLM queue time p50 colocated "
              f"{s['queue_colocated_ms_p50']}, decode {s['queue_decode_ms_p50']} ms (n {s['n']})")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
