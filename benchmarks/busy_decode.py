"""What a push_layer_load request costs the OTHER requests a decode is running.

With push_layer_load the decode's whole forward step waits, layer by layer,
for the prefill of the arriving prompt, so every running stream in that
decode batch produces no token meanwhile.  This runs N long streams on the
decode server and, while they run, sends pushed requests through our proxy
(one at a time), in phases on the same servers:

  none             no arrivals (the streams' own ITL)
  push             whole-prompt push (WAITING_FOR_REMOTE_KVS: streams go on)
  push_layer_load  push with push_layer_load (the decode's step waits)

and reports the running streams' ITL p50/p99 per phase, plus the decode's
push_layer_loads / push_layer_load_busy counters.  --max-batch sets the
decode's push_layer_load_max_batch: the default 64 lets layer loads stall
the streams (what the knob protects against); 0 (the connector's default)
turns them into whole-prompt pushes on a busy decode (counted).

  .venv/bin/python -P benchmarks/busy_decode.py \
      [--streams 4] [--arrivals 6] [--prompt-words 700] [--max-batch 64]

(the installed package: `pip install .` first; PYTHONPATH=$PWD would
import the source tree, whose _core is not built there, and the servers
would fail to start).  With MC_TRACE=FILE the servers trace each request
(benchmarks/push_notice_latency.py FILE reads the layer loads).
"""
import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def phase(dep, mode, args, log, seed=0):
    from mooncake_connector.demo import _prompt
    from mooncake_connector.deployment import metric_value
    from mooncake_connector.openai_client import request

    body = {"model": "tiny", "temperature": 0.0, "max_tokens": args.stream_tokens,
            "ignore_eos": True, "stream": True, "prompt": "stream " * 40}
    c0 = {k: metric_value(dep.decode.url, f"vllm:mooncake_{k}_total")
          for k in ("push_layer_loads", "push_layer_load_busy")}
    with concurrent.futures.ThreadPoolExecutor(args.streams + 1) as pool:
        streams = [pool.submit(request, dep.decode.url, "/v1/completions",
                               dict(body, prompt=f"stream {i} " * 40), 600)
                   for i in range(args.streams)]
        time.sleep(args.warmup_s)  # the streams are decoding
        ttfts = []
        if mode != "none":
            for k in range(args.arrivals):
                prompt = _prompt(args.prompt_words, 5000 + k + 100 * seed)
                r = request(dep.proxies[mode].url, "/v1/completions",
                            {"model": "tiny", "temperature": 0.0, "max_tokens": 4,
                             "ignore_eos": True, "stream": True, "prompt": prompt}, 600)
                assert r.status == 200 and r.error is None, (mode, r.status, r.error)
                if r.ttft_s is not None:
                    ttfts.append(r.ttft_s)
        res = [f.result() for f in streams]
    for r in res:
        assert r.status == 200 and r.error is None, (r.status, r.error)
    itl = [x for r in res for x in r.itl_s]
    c = {k: metric_value(dep.decode.url, f"vllm:mooncake_{k}_total") - v for k, v in c0.items()}
    row = {"mode": mode, "itl_p50_ms": pct(itl, 0.5) * 1e3, "itl_p99_ms": pct(itl, 0.99) * 1e3,
           "itl_max_ms": max(itl) * 1e3, "itl_sum_s": sum(itl),
           "itls_over_20ms": sum(1 for x in itl if x > 0.020), "arrival_ttft_p50_ms":
           (statistics.median(ttfts) * 1e3 if ttfts else None), **c}
    print(json.dumps(row), file=log, flush=True)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-tokens", type=int, default=400)
    ap.add_argument("--arrivals", type=int, default=6)
    ap.add_argument("--prompt-words", type=int, default=700)
    ap.add_argument("--warmup-s", type=float, default=0.3)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--out", default="build/busy_decode.json")
    args = ap.parse_args(argv)
    sys.path.insert(0, HERE)
    from serving_bench import BENCH_SPEC
    from mooncake_connector import tiny_model
    from mooncake_connector.deployment import Deployment

    model = tiny_model.build(**BENCH_SPEC)
    work = tempfile.mkdtemp(prefix="mc-busy-decode-")
    lw = ("--push-layerwise", "on")
    dep = Deployment(work, model, flows=(), colocated=False, extra_proxies={
        "push": {"flow": "push", "extra_args": lw + ("--push-layer-load", "off")},
        "push_layer_load": {"flow": "push", "extra_args": lw + ("--push-layer-load", "on")}},
        decode_extra_config={"push_layer_load_max_batch": args.max_batch})
    rows = []
    with dep.start():
        for mode in ("push", "push_layer_load", "none"):  # one unmeasured warm-up pass first
            phase(dep, mode, args, open(os.devnull, "w"), seed=1)
        for mode in ("none", "push", "push_layer_load"):
            rows.append(phase(dep, mode, args, sys.stdout))
    base = rows[0]["itl_p99_ms"]
    for r in rows:
        print(f"{r['mode']:16s} running streams' ITL p50 {r['itl_p50_ms']:7.2f} ms  p99 "
              f"{r['itl_p99_ms']:7.2f} ms ({r['itl_p99_ms'] / base:5.2f}x none)  max "
              f"{r['itl_max_ms']:7.1f} ms  >20 ms: {r['itls_over_20ms']:3d}  layer loads {r['push_layer_loads']:.0f} busy "
              f"fallbacks {r['push_layer_load_busy']:.0f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
