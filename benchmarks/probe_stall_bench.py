"""Does a stopped producer stall the decode server's running requests?

    .venv/bin/python benchmarks/probe_stall_bench.py [--phase-s 20] [--streams 2]
        [--arrival-ms 250] [--python PY] [--out build/probe_stall_bench.json]

Starts the metadata server, a prefill (kv_producer) and a decode
(kv_consumer, flow a) vLLM server (mooncake_connector.deployment).  On the
decode server, --streams long streamed greedy requests decode the whole run
(prompts shorter than a block: they never probe); every --arrival-ms a new
request with a prompt of several blocks arrives there, so its scheduler asks
the producer "how much of this prompt do you hold" (flow a).  Two phases in
the same run, same load: the producer healthy, then the producer's whole
process group stopped (SIGSTOP; the kernel still accepts its connections, it
never answers).  Printed: the inter-token latency (ITL) p50/p99/max of the
running streams in each phase and the ratio stopped/healthy of p99.

Before vLLM's scheduler stopped waiting on the probe, every probe to the
stopped producer held the scheduler lookup_timeout_s (0.25 s), once per
BACKOFF_S (1 s): a 0.25 s ITL spike about once a second.  --python runs the
servers with another interpreter (e.g. a checkout's .venv with the old
package) to measure that reference.
"""
import argparse
import http.client
import json
import os
import signal
import sys
import tempfile
import threading
import time
import urllib.parse

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_stats import pct  # noqa: E402




def run_phase(url, seconds, streams, arrival_s, seed):
    """ITL gaps (s) of the running streams, timestamped, over `seconds`, with
    flow-a arrivals every `arrival_s`."""
    from mooncake_connector.demo import _prompt
    from mooncake_connector.openai_client import request

    stop = threading.Event()
    measuring = threading.Event()
    gaps, errors = [], []
    lock = threading.Lock()

    def stream(i):
        """One long streamed request; every gap between tokens is recorded as
        it arrives, and the stream is closed when the phase ends (vLLM
        aborts the request)."""
        body = {"model": "tiny", "prompt": _prompt(3, seed * 100 + i), "max_tokens": 1900,
                "temperature": 0, "ignore_eos": True, "stream": True}
        u = urllib.parse.urlsplit(url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(body),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"status {resp.status}: {resp.read()[:200]!r}")
            last, n = None, 0
            for raw in resp:
                if stop.is_set():
                    break
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                now = time.perf_counter()
                n += 1
                if last is not None and n > 3 and measuring.is_set():
                    with lock:
                        gaps.append(now - last)
                last = now
        except (OSError, http.client.HTTPException, RuntimeError) as e:
            with lock:
                errors.append(f"stream {i}: {e}")
        finally:
            conn.close()

    def arrivals():
        n = 0
        while not stop.wait(arrival_s):
            body = {"model": "tiny", "prompt": _prompt(120, seed * 1000 + n),
                    "max_tokens": 1, "temperature": 0}
            threading.Thread(target=request, args=(url, "/v1/completions", body),
                             kwargs={"timeout": 120}, daemon=True).start()
            n += 1

    ths = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(streams)]
    ths.append(threading.Thread(target=arrivals, daemon=True))
    for t in ths:
        t.start()
    time.sleep(min(3.0, seconds / 4))  # the streams are running
    measuring.set()
    time.sleep(seconds)
    measuring.clear()
    stop.set()
    for t in ths:
        t.join(60)
    return list(gaps), errors


def summarize(gaps):
    ms = [g * 1e3 for g in gaps]
    return {"n": len(ms), "p50_ms": pct(ms, 50), "p99_ms": pct(ms, 99),
            "max_ms": max(ms) if ms else None,
            "over_100ms": sum(1 for g in ms if g > 100)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--phase-s", type=float, default=20.0)
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--arrival-ms", type=float, default=250.0)
    ap.add_argument("--python", default=None, help="interpreter for the servers")
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from mooncake_connector import tiny_model
    from mooncake_connector.deployment import Deployment

    model = tiny_model.build()
    workdir = tempfile.mkdtemp(prefix="mc-probe-stall-vllm033-")
    dep = Deployment(workdir, model, connector="mooncake", flows=(), colocated=False,
                     python=args.python)
    print(f"servers' python: {args.python or sys.executable}; logs {dep.logs}", flush=True)
    res = {}
    try:
        dep.start(timeout=args.start_timeout)
        print(dep.describe(), flush=True)
        url = dep.decode.url
        run_phase(url, 4.0, args.streams, args.arrival_ms / 1e3, 0)  # warm-up
        gaps, err = run_phase(url, args.phase_s, args.streams, args.arrival_ms / 1e3, 1)
        res["healthy"] = summarize(gaps)
        pgid = dep.prefill.proc.pid
        os.killpg(pgid, signal.SIGSTOP)
        try:
            gaps2, err2 = run_phase(url, args.phase_s, args.streams, args.arrival_ms / 1e3, 2)
        finally:
            os.killpg(pgid, signal.SIGCONT)
        res["producer_stopped"] = summarize(gaps2)
        res["errors"] = [str(e) for e in err + err2]
    finally:
        dep.stop()
    h, s = res["healthy"], res["producer_stopped"]
    res["p99_ratio_stopped_vs_healthy"] = (s["p99_ms"] / h["p99_ms"]
                                           if h["p99_ms"] and s["p99_ms"] else None)
    for name in ("healthy", "producer_stopped"):
        r = res[name]
        print(f"{name:<17} ITL of running streams: n={r['n']} p50 {r['p50_ms']:.1f} ms, "
              f"p99 {r['p99_ms']:.1f} ms, max {r['max_ms']:.1f} ms, "
              f"{r['over_100ms']} gaps > 100 ms")
    print(f"p99 ratio stopped/healthy: {res['p99_ratio_stopped_vs_healthy']:.2f}"
          + (f"; errors: {res['errors'][:3]}" if res["errors"] else ""))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
