"""Serving benchmark: disaggregated (prefill + decode behind the proxy) vs colocated.

    .venv/bin/python benchmarks/serving_bench.py [--lengths 128,512,1024,1900] [--requests 10]
        [--connector mooncake|example] [--out build/serving_bench.json] [--plot build/serving_bench.png]

One run starts the metadata server, the prefill, decode and colocated vLLM
servers and three proxies (mooncake_connector.deployment): flow a with the
first token from prefill (the default), flow a with the first token from
decode (--first-token decode, the seed's way), and a pass-through proxy in
front of the colocated server.  For each prompt length it sends the same
streamed greedy requests one at a time to the colocated server directly,
through the pass-through proxy, and through both disaggregated proxies, and
measures per request:

* TTFT: time from sending the request to the first generated token arriving;
* ITL: gaps between later tokens (every streamed token), the gap between
  token 1 and token 2 included — with the first token from prefill the decode
  leg's latency moves into that gap — and that gap on its own;
* the decomposition of a disaggregated request: the prefill leg (max_tokens=1
  straight to the prefill server) and the decode leg (straight to the decode
  server, KV loaded remotely), so proxy and connector costs show;
* the KV transfer time of the same bytes in the same block layout with our
  transfer engine (mooncake_connector.transfer_demo, best of --xfer-repeat), the
  "measured KV transfer time" of the bar.

Bars: disaggregated TTFT p50 <= colocated TTFT p50 + 1.1 x KV transfer time,
per prompt length, against both colocated references (direct, and through the
pass-through proxy: a real deployment has a proxy hop either way); and the connector's fixed per-request cost (decode-server TTFT of
a ~40-token prompt the prefill server never saw — lookup, miss, local compute
— minus the colocated TTFT of the same prompt, p50) <= 1 ms.  Results go to --out (JSON) and --plot (PNG).
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_stats import pct  # noqa: E402
BLOCK = 32

#: Larger than the tests' model so that KV sizes matter: 4 layers, head size
#: 64, 4 KV heads -> 8 KiB of KV per token (fp32).
SETTLE_S = 0.05  # pause before each measured request
BENCH_SPEC = {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 4, "intermediate": 512}




def prompt_of(n_words, seed):
    from mooncake_connector.demo import _prompt
    return _prompt(n_words, seed)


def xfer_time(spec, n_tokens, repeat, python):
    """Best time (s) our engine takes to move n_tokens' KV between two
    processes in vLLM's CPU layout: per layer one tensor whose block holds K and
    V of all KV heads (block_size x kv_heads x 2 x head_size x 4 B)."""
    head = spec["hidden"] // spec["heads"]
    block_kib = BLOCK * spec["kv_heads"] * 2 * head * 4 // 1024
    n_blocks = max(1, n_tokens // BLOCK)
    # transfer_demo has a K and a V tensor per "layer": layers/2 of them make
    # one tensor per model layer.
    layers = max(1, spec["layers"] // 2)
    out = subprocess.run(
        [python, "-P", "-m", "mooncake_connector.transfer_demo", "--layers", str(layers),
         "--blocks", str(n_blocks + 8), "--block-kib", str(block_kib), "--prompt-blocks",
         str(n_blocks), "--repeat", str(repeat), "--json"],
        capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"transfer_demo failed: {out.stderr[-2000:]}")
    s = json.loads(out.stdout.strip().splitlines()[-1])
    return s["best_seconds"], s["bytes"]


#: The modes measured per request: (key, label).
MODES = (("colocated", "colocated, direct"),
         ("colocated_proxy", "colocated via pass-through proxy"),
         ("disaggregated", "disaggregated, first token from prefill"),
         ("disaggregated_decode_first", "disaggregated, first token from decode"))


#: With --push: flow b and the push flow, whole prompt and layer by layer,
#: measured in the same run (same servers; the layer-wise choice travels per
#: request in the prefill leg's kv_transfer_params).  First token from decode
#: for push (the decode side computes the prompt's last token).
PUSH_MODES = (("disaggregated_b", "disaggregated flow b, first token from prefill"),
              ("push", "push, whole prompt (first token from decode)"),
              ("push_layerwise", "push, layer by layer (first token from decode)"))
PUSH_PROXIES = {"disaggregated_b": "b", "push": "push", "push_layerwise": "push-layerwise"}


def measure(dep, lengths, n_requests, max_tokens, log):
    from mooncake_connector.openai_client import request

    body = {"model": "tiny", "temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True,
            "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True}}
    urls = {"colocated": dep.colocated.url, "colocated_proxy": dep.colocated_proxy.url,
            "disaggregated": dep.proxies["a"].url,
            "disaggregated_decode_first": dep.proxies["a-decode-first"].url}
    for k, name in PUSH_PROXIES.items():
        if name in dep.proxies and k in dict(MODES):
            urls[k] = dep.proxies[name].url

    def one(url, prompt, **kw):
        b = dict(body, prompt=prompt, **kw)
        if not b["stream"]:
            del b["stream_options"]
        r = request(url, "/v1/completions", b, timeout=600)
        if r.status != 200 or r.error:
            raise RuntimeError(f"{url}: {r.status} {r.error}")
        return r

    for url in (*urls.values(), dep.prefill.url, dep.decode.url):  # warm-up
        for i in range(3):
            one(url, prompt_of(max(lengths), 10_000 + i))
    results = []
    order = random.Random(7)
    for n in lengths:
        row = {"prompt_words": n, "prefill_leg": [], "decode_leg": [], "identical": 0,
               "loaded_tokens": []}
        for k, _ in MODES:
            row[k], row[f"itl_{k}"], row[f"gap12_{k}"] = [], [], []
        for i in range(n_requests):
            p = prompt_of(n, 1000 * n + i)
            # A fresh random order of the modes per request (a rotation would
            # keep each mode right behind the same other one), and a short
            # pause before each: every request meets idle servers, not the
            # tail of the previous one (a producer steps every ms until its
            # KV is pulled and released).
            keys = [k for k, _ in MODES]
            order.shuffle(keys)
            got = {}
            for k in keys:
                time.sleep(SETTLE_S)
                got[k] = one(urls[k], p)
            for k, r in got.items():
                row[k].append(r.ttft_s)
                row[f"itl_{k}"] += r.itl_s
                row[f"gap12_{k}"] += r.itl_s[:1]
            ref = got["colocated"].token_ids
            row["identical"] += all(r.token_ids == ref for r in got.values())
            row["loaded_tokens"].append(got["disaggregated"].cached_tokens)
            row["prompt_tokens"] = got["disaggregated"].usage["prompt_tokens"]
            # The two legs on their own, with a fresh prompt (nothing cached).
            q = prompt_of(n, 7 * n + i + 500_000)
            time.sleep(SETTLE_S)
            pre = one(dep.prefill.url, q, max_tokens=1, stream=False)
            time.sleep(SETTLE_S)
            dec = one(dep.decode.url, q)
            row["prefill_leg"].append(pre.total_s)
            row["decode_leg"].append(dec.ttft_s)
        log(f"  {row['prompt_tokens']:5d} tokens: TTFT p50 colocated "
            f"{pct(row['colocated'], 50) * 1e3:.1f} ms (via proxy "
            f"{pct(row['colocated_proxy'], 50) * 1e3:.1f}), disaggregated "
            f"{pct(row['disaggregated'], 50) * 1e3:.1f} ms (first token from decode "
            f"{pct(row['disaggregated_decode_first'], 50) * 1e3:.1f} = prefill leg "
            f"{pct(row['prefill_leg'], 50) * 1e3:.1f} + decode leg "
            f"{pct(row['decode_leg'], 50) * 1e3:.1f} + hop); identical "
            f"{row['identical']}/{n_requests}")
        results.append(row)
    # Fixed per-request cost of the connector: a prompt of about one block
    # that the prefill server never saw, sent straight to the decode server
    # (its connector looks the prompt up at the producer, misses, and the
    # prompt is computed locally) vs the colocated server computing the same.
    fixed = {"colocated": [], "decode": []}
    for i in range(max(20, n_requests)):
        p = prompt_of(40, 900_000 + i)
        time.sleep(SETTLE_S)
        fixed["colocated"].append(one(dep.colocated.url, p, max_tokens=1).ttft_s)
        time.sleep(SETTLE_S)
        fixed["decode"].append(one(dep.decode.url, p, max_tokens=1).ttft_s)
    return results, fixed


def summarize(results, fixed, xfer, bars_factor=1.1):
    rows = []
    for r in results:
        t = xfer[r["prompt_words"]]
        s = {"prompt_tokens": r["prompt_tokens"],
             "kv_bytes": t["bytes"], "kv_transfer_ms": t["seconds"] * 1e3,
             "identical": r["identical"], "requests": len(r["colocated"]),
             "loaded_tokens_p50": pct(r["loaded_tokens"], 50)}
        for k in [m for m, _ in MODES] + ["prefill_leg", "decode_leg"]:
            s[f"ttft_{k}_ms_p50"] = pct(r[k], 50) * 1e3
            s[f"ttft_{k}_ms_p99"] = pct(r[k], 99) * 1e3
        for k, _ in MODES:
            for what in ("itl", "gap12"):
                xs = r[f"{what}_{k}"]
                s[f"{what}_{k}_ms_p50"] = pct(xs, 50) * 1e3 if xs else None
                s[f"{what}_{k}_ms_p99"] = pct(xs, 99) * 1e3 if xs else None
        # Paired: the same prompt through each mode back to back (random
        # order), so per-request differences cancel what drifts between
        # requests; the median difference is the connector path's own cost.
        for ref in ("colocated", "colocated_proxy"):
            d = [(x - y) * 1e3 for x, y in zip(r["disaggregated"], r[ref])]
            s[f"ttft_paired_diff_vs_{ref}_ms_p50"] = statistics.median(d)
            s[f"ttft_paired_bar_vs_{ref}_ok"] = (statistics.median(d)
                                                 <= bars_factor * s["kv_transfer_ms"])
        s["ttft_ms_per_request"] = {k: [round(x * 1e3, 3) for x in r[k]] for k, _ in MODES}
        for ref in ("colocated", "colocated_proxy"):
            bar = s[f"ttft_{ref}_ms_p50"] + bars_factor * s["kv_transfer_ms"]
            s[f"ttft_bar_vs_{ref}_ms"] = bar
            s[f"ttft_bar_vs_{ref}_ok"] = s["ttft_disaggregated_ms_p50"] <= bar
            s[f"ttft_bar_vs_{ref}_decode_first_ok"] = (
                s["ttft_disaggregated_decode_first_ms_p50"] <= bar)
        s["ttft_bar_ms"], s["ttft_bar_ok"] = s["ttft_bar_vs_colocated_ms"], \
            s["ttft_bar_vs_colocated_ok"]
        s["proxy_and_hop_ms_p50"] = (s["ttft_disaggregated_decode_first_ms_p50"]
                                     - s["ttft_prefill_leg_ms_p50"]
                                     - s["ttft_decode_leg_ms_p50"])
        s["first_token_path_over_prefill_leg_ms_p50"] = (s["ttft_disaggregated_ms_p50"]
                                                         - s["ttft_prefill_leg_ms_p50"])
        rows.append(s)
    fixed_ms = (statistics.median(fixed["decode"]) - statistics.median(fixed["colocated"])) * 1e3
    # Paired: each prompt went to both servers back to back.
    fixed_paired = statistics.median(
        (d - c) * 1e3 for d, c in zip(fixed["decode"], fixed["colocated"]))
    return {"rows": rows, "fixed_overhead_ms_p50": fixed_ms, "fixed_overhead_ok": fixed_ms <= 1.0,
            "fixed_overhead_paired_ms_p50": fixed_paired,
            "fixed_overhead_paired_ok": fixed_paired <= 1.0,
            "fixed_ms_per_request": {k: [round(x * 1e3, 3) for x in v] for k, v in fixed.items()}}


def plot(summary, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    x = [r["prompt_tokens"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = dict(zip([k for k, _ in MODES], ("tab:blue", "tab:cyan", "tab:orange", "tab:red",
                                              "tab:purple", "tab:green", "tab:olive")))
    for key, label in MODES:
        color = colors[key]
        for ax, what in ((a, "ttft"), (b, "itl")):
            ax.plot(x, [r[f"{what}_{key}_ms_p50"] for r in rows], "o-", color=color,
                    label=f"{label} p50")
            ax.plot(x, [r[f"{what}_{key}_ms_p99"] for r in rows], "o:", color=color,
                    alpha=0.6, label=f"{label} p99")
    a.plot(x, [r["ttft_bar_vs_colocated_ms"] for r in rows], "k--",
           label="bar: colocated + 1.1 x KV xfer")
    a.plot(x, [r["ttft_bar_vs_colocated_proxy_ms"] for r in rows], "k:",
           label="bar: colocated via proxy + 1.1 x KV xfer")
    a.set(xlabel="prompt tokens", ylabel="TTFT (ms)", title="time to first token")
    b.set(xlabel="prompt tokens", ylabel="ITL (ms)",
          title="inter-token latency (token 1->2 gap included)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


def report(summary):
    def ms(s, key):
        return f"{s[key + '_ms_p50']:6.1f}/{s[key + '_ms_p99']:6.1f}"

    def ok(b):
        return "ok" if b else "FAIL"
    print(f"\n{'tokens':>6} {'KV bytes':>10} {'xfer ms':>7} | TTFT p50/p99 ms: "
          f"{'colocated':>13} {'col. via proxy':>14} {'dis. 1st@prefill':>16} "
          f"{'dis. 1st@decode':>15} | bar vs col / via proxy | same")
    for s in summary["rows"]:
        print(f"{s['prompt_tokens']:6d} {s['kv_bytes']:10,d} {s['kv_transfer_ms']:7.2f} | "
              f"{'':16}{ms(s, 'ttft_colocated')}  {ms(s, 'ttft_colocated_proxy')}    "
              f"{ms(s, 'ttft_disaggregated')}   {ms(s, 'ttft_disaggregated_decode_first')} | "
              f"{ok(s['ttft_bar_vs_colocated_ok']):>4} ({s['ttft_bar_vs_colocated_ms']:.1f}) / "
              f"{ok(s['ttft_bar_vs_colocated_proxy_ok'])} "
              f"({s['ttft_bar_vs_colocated_proxy_ms']:.1f}) | "
              f"{s['identical']}/{s['requests']}")
        print(f"{'':6} ITL p50/p99 ms (all gaps, token 1->2 included): "
              + ", ".join(f"{k} {ms(s, 'itl_' + k)}" for k, _ in MODES))
        print(f"{'':6} token 1->2 gap p50/p99 ms: "
              + ", ".join(f"{k} {ms(s, 'gap12_' + k)}" for k, _ in MODES))
        if len(MODES) > 4:
            print(f"{'':6} TTFT p50/p99 ms: "
                  + ", ".join(f"{k} {ms(s, 'ttft_' + k)}" for k, _ in MODES[4:]))
        print(f"{'':6} paired (same prompt, back to back): disaggregated - colocated TTFT "
              f"median {s['ttft_paired_diff_vs_colocated_ms_p50']:+.2f} ms (direct), "
              f"{s['ttft_paired_diff_vs_colocated_proxy_ms_p50']:+.2f} ms (via proxy); "
              f"limit 1.1 x xfer = {1.1 * s['kv_transfer_ms']:.2f} ms: "
              f"{ok(s['ttft_paired_bar_vs_colocated_ok'])} / "
              f"{ok(s['ttft_paired_bar_vs_colocated_proxy_ok'])}")
        print(f"{'':6} first token from decode = prefill leg {s['ttft_prefill_leg_ms_p50']:.1f}"
              f" + decode leg {s['ttft_decode_leg_ms_p50']:.1f} + proxy/hop "
              f"{s['proxy_and_hop_ms_p50']:.1f} ms; from prefill = prefill leg + "
              f"{s['first_token_path_over_prefill_leg_ms_p50']:.1f} ms (p50)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="128,512,1024,1900",
                    help="prompt lengths in words (about one token each)")
    ap.add_argument("--requests", type=int, default=12,
                    help="per length and mode (a multiple of 4 balances the order of modes)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--connector", default=None, help="mooncake or example")
    ap.add_argument("--xfer-repeat", type=int, default=5)
    ap.add_argument("--out", default="build/serving_bench.json")
    ap.add_argument("--plot", default="build/serving_bench.png")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--enforce-bars", action="store_true", help="exit 3 if a bar fails")
    ap.add_argument("--spec", default="",
                    help="model overrides, e.g. layers=8,hidden=512,heads=8,kv_heads=8 "
                         f"(default {BENCH_SPEC}); more KV per token makes the transfer "
                         "weigh more against compute")
    ap.add_argument("--kv-cache-mib", type=int, default=64,
                    help="each vLLM server's KV cache (raise it with --spec)")
    ap.add_argument("--push", action="store_true",
                    help="also flow b and the push flow (whole prompt and layer by layer), "
                         "same servers, same run")
    args = ap.parse_args(argv)
    global MODES
    if args.push:
        MODES = MODES + PUSH_MODES
    lengths = [int(x) for x in args.lengths.split(",")]
    if max(lengths) > 2000:
        ap.error("prompt lengths must stay below --max-model-len 2048")

    from mooncake_connector import tiny_model
    from mooncake_connector.deployment import (Deployment, connector_log_stats, log_size,
                                               proxy_stats)

    overrides = dict(BENCH_SPEC)
    for kv in filter(None, args.spec.split(",")):
        k, _, v = kv.partition("=")
        if not v.isdigit():
            ap.error(f"--spec: {kv!r} is not key=integer")
        overrides[k.strip()] = int(v)
    try:
        spec = tiny_model.spec_with(**overrides)
    except ValueError as e:
        ap.error(f"--spec: {e}")
    model = tiny_model.build(**overrides)
    workdir = args.workdir or tempfile.mkdtemp(prefix="mc-serving-bench-")
    extra = {"a-decode-first": {"flow": "a", "first_token": "decode"}}
    if args.push:
        extra.update({"b": {"flow": "b"},
                      "push": {"flow": "push", "extra_args": ("--push-layerwise", "off")},
                      "push-layerwise": {"flow": "push",
                                         "extra_args": ("--push-layerwise", "on")}})
    dep = Deployment(workdir, model, connector=args.connector, flows=("a",),
                     extra_proxies=extra,
                     colocated_proxy=True, kv_cache_bytes=args.kv_cache_mib << 20)
    print(f"model {model} ({tiny_model.kv_bytes_per_token(spec)} B of KV per token); "
          f"connector {dep.connector}; logs {dep.logs}", flush=True)
    t0 = time.monotonic()
    try:
        dep.start(timeout=args.start_timeout)
        print(f"servers up in {time.monotonic() - t0:.0f} s; measuring", flush=True)
        mark = log_size(dep.decode.log_path)
        results, fixed = measure(dep, lengths, args.requests, args.max_tokens,
                                 lambda s: print(s, flush=True))
        time.sleep(11)  # vLLM logs the connector's stats every 10 s
        conn_stats = connector_log_stats(dep.decode.log_path, mark)
        proxy_lat = proxy_stats(dep.proxies["a"].url).get("latency_ms", {})
    finally:
        dep.stop()
    xfer = {}
    for r in results:
        secs, nbytes = xfer_time(spec, r["prompt_tokens"] - 1, args.xfer_repeat, sys.executable)
        xfer[r["prompt_words"]] = {"seconds": secs, "bytes": nbytes}
    summary = summarize(results, fixed, xfer)
    summary.update({"connector": dep.connector, "model_spec": spec,
                    "connector_stats_decode": conn_stats, "proxy_latency_ms": proxy_lat,
                    "kv_bytes_per_token": tiny_model.kv_bytes_per_token(spec),
                    "requests_per_length": args.requests, "max_tokens": args.max_tokens,
                    "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                    "cpus": os.cpu_count(), "load_avg": os.getloadavg()})
    report(summary)
    print(f"connector fixed per-request cost (decode vs colocated TTFT, ~40-token prompt "
          f"missing at the producer, p50): {summary['fixed_overhead_ms_p50']:.2f} ms "
          f"({'ok' if summary['fixed_overhead_ok'] else 'FAIL'}, bar 1 ms); paired median "
          f"{summary['fixed_overhead_paired_ms_p50']:.2f} ms "
          f"({'ok' if summary['fixed_overhead_paired_ok'] else 'FAIL'})")
    if conn_stats:
        print(f"connector's own stats on decode during the run: {conn_stats}")
    if proxy_lat:
        print(f"the first-token proxy's own timings (all lengths, ms): {proxy_lat}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    plot(summary, args.plot, f"{dep.connector} connector, {spec['layers']} layers, "
         f"{summary['kv_bytes_per_token']} B KV/token, {os.cpu_count()} CPUs, "
         f"{args.requests} req/length, {summary['date']}")
    print(f"wrote {args.out} and {args.plot}")
    ok = all(s["ttft_bar_vs_colocated_ok"] for s in summary["rows"]) and summary[
        "fixed_overhead_ok"]
    if args.enforce_bars and not ok:
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
