"""Serving benchmark: every disaggregated path side by side with colocated vLLM.

    .venv/bin/python -P benchmarks/serving_bench.py [--lengths 128,512,1024,1900] [--requests 10]
        [--modes all|LIST] [--kv32k] [--out build/serving_bench.json] [--plot build/serving_bench.png]

One run starts the metadata server, the prefill, decode and colocated vLLM
servers (mooncake_connector.deployment) and, in front of them, one proxy per
path:

* colocated: the colocated server directly, and through our proxy in
  pass-through mode (every real deployment has a proxy hop);
* flow a (the seed's: prefill with max_tokens=1, then decode finds the KV by
  its tokens) and flow b (kv_transfer_params relayed), each with the first
  token taken both ways: from the prefill's answer (our proxy's default) and
  from decode (--first-token decode, the seed's way);
* push (when the proxy has --flow push): both legs at once, the producer
  writes the KV into blocks the decode side allocated (whole prompt, and
  layer by layer when the connector has it; push_layer_load: the decode's
  attention waits per layer; push_layer_read: the same with the decode
  reading each announced layer from the producer's blocks, its TTFT paired
  with push_layer_load's per request in the summary);
* vllm-router (PyPI, --vllm-pd-disaggregation --kv-connector mooncake) in
  front of our servers: vLLM's in-tree contract (bootstrap server, sequential
  legs), when it can be had (tests/vllm_router_pkg.py);
* vLLM's in-tree MooncakeConnector on Mooncake's own engine over its TCP
  transport (--mooncake-site: a dir holding Mooncake's `mooncake` package;
  MC_MOONCAKE_SHIM=0), behind vllm-router (which sends the decode leg after
  the prefill's answer) and behind benchmarks/intree_proxy.py (both legs at
  once, as the connector's own proxy): a second phase of the same run (our
  prefill and decode servers stopped, the in-tree pair started, the
  colocated server kept and measured again as that phase's reference).  On
  vLLM's CPU backend (mooncake-transfer-engine-non-cuda, a pip --target
  dir) its worker needs a benchmark-only workaround (INTREE_CPU_NOTE:
  tests/intree_cpu/sitecustomize.py); with --device cuda (Mooncake's CUDA
  engine, trimmed, with libcudart 12: scripts/vllm-gpu-intree.sh) none, the
  pair with our servers' GPU share and flags (INTREE_CUDA_NOTE).  Where the
  servers fail, the phase records where (on CUDA with the likely cause).
  Checked: token identity with both phases' colocated answers, and the
  decode server's /metrics (every prompt token loaded from the prefill,
  none computed).

For each prompt length it sends the same streamed greedy requests one at a
time through every path (a fresh random order per prompt, a short pause
before each) and measures per request:

* TTFT: time from sending the request to the first generated token arriving;
* ITL: gaps between later tokens (every streamed token), the gap between
  token 1 and token 2 included — with the first token from prefill the decode
  leg's latency moves into that gap — and that gap on its own;
* the decomposition of a disaggregated request: the prefill leg (max_tokens=1
  straight to the prefill server) and the decode leg (straight to the decode
  server, KV loaded remotely), so proxy and connector costs show;
* the KV transfer time of the same bytes in the same block layout with our
  transfer engine (mooncake_connector.transfer_demo, best of --xfer-repeat), the
  "measured KV transfer time" of the bars.

Bars: flow a's TTFT p50 <= colocated TTFT p50 + 1.1 x KV transfer time, per
prompt length, against both colocated references (issue 6); push (issue 31):
the token 1 -> 2 gap p50 <= colocated ITL p50 + 2 ms, and TTFT p50 <=
colocated TTFT p50 + the proxy hop (pass-through minus direct, p50) + 2 ms +
one layer's transfer; the connector's fixed per-request cost (decode-server
TTFT of a ~40-token prompt the prefill server never saw — lookup, miss, local
compute — minus the colocated TTFT of the same prompt, p50) <= 1 ms.  Results
go to --out (JSON) and --plot (PNG).
"""
import argparse
import glob
import json
import os
import random
import re
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
#: --kv32k: the KV-heavy tiny model, 32 KiB of KV per token (8 layers, 8 KV
#: heads of 64, fp32), as issue 31 asks.
KV32K_SPEC = {"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 8, "intermediate": 1024}


def prompt_of(n_words, seed):
    from mooncake_connector.demo import _prompt
    return _prompt(n_words, seed)


def xfer_time(spec, n_tokens, repeat, python, device="cpu", dtype_bytes=4, env=None):
    """Best time (s) our engine takes to move n_tokens' KV between two
    processes in vLLM's layout: per layer one tensor whose block holds K and
    V of all KV heads (block_size x kv_heads x 2 x head_size x dtype_bytes),
    in host memory or (device "cuda") GPU memory, with env on top of ours
    (MC_GPU_IPC=0: TCP with GPU staging, as the servers)."""
    head = spec["hidden"] // spec["heads"]
    block_kib = BLOCK * spec["kv_heads"] * 2 * head * dtype_bytes // 1024
    n_blocks = max(1, n_tokens // BLOCK)
    # transfer_demo has a K and a V tensor per "layer": layers/2 of them make
    # one tensor per model layer.
    layers = max(1, spec["layers"] // 2)
    out = subprocess.run(
        [python, "-P", "-m", "mooncake_connector.transfer_demo", "--layers", str(layers),
         "--blocks", str(n_blocks + 8), "--block-kib", str(block_kib), "--prompt-blocks",
         str(n_blocks), "--repeat", str(repeat), "--json", "--device", device],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, **(env or {})))
    if out.returncode != 0:
        raise RuntimeError(f"transfer_demo failed: {out.stderr[-2000:]}")
    s = json.loads(out.stdout.strip().splitlines()[-1])
    return s["best_seconds"], s["bytes"]


#: Every path the benchmark knows: (key, label).  A run measures those it
#: can start (--modes); "disaggregated" is flow a with the first token from
#: prefill (the key older result files use).
MODES = (("colocated", "colocated, direct"),
         ("colocated_cached", "colocated, prefix cache hit (2nd send)"),
         ("colocated_proxy", "colocated via pass-through proxy"),
         ("disaggregated", "flow a, 1st token from prefill"),
         ("disaggregated_decode_first", "flow a, 1st token from decode"),
         ("flow_b", "flow b, 1st token from prefill"),
         ("flow_b_decode_first", "flow b, 1st token from decode"),
         ("push", "push, whole prompt"),
         ("push_layerwise", "push, layer by layer"),
         ("push_layer_load", "push, layer by layer, decode waits per layer"),
         ("push_layer_read", "push, layer by layer, decode reads each layer"),
         ("router", "vllm-router (mooncake mode) -> ours"),
         ("intree", "vLLM in-tree MooncakeConnector (Mooncake engine)"),
         ("intree_at_once", "in-tree, both legs at once (intree_proxy.py)"),
         ("colocated_phase2", "colocated, direct (in-tree phase)"))
LABEL = dict(MODES)
#: The reference each mode's paired difference is taken against.
INTREE_MODES = ("intree", "intree_at_once")
REFERENCE = dict.fromkeys(INTREE_MODES, "colocated_phase2")
PUSH_MODES = ("push", "push_layerwise", "push_layer_load", "push_layer_read")
#: The modes whose decode waits per layer (a CUDA decode needs
#: --no-async-scheduling for them).
LAYER_LOAD_MODES = ("push_layer_load", "push_layer_read")
#: Opt-in modes, not in --modes all: colocated_cached needs a fourth server.
OPT_IN_MODES = ("colocated_cached",)


def proxy_flows():
    """The flows our proxy offers (its --flow choices)."""
    out = subprocess.run([sys.executable, "-P", "-m", "mooncake_connector.proxy", "--help"],
                         capture_output=True, text=True, timeout=60)
    m = re.search(r"--flow \{([^}]*)\}", out.stdout)
    return set(m.group(1).split(",")) if m else {"a", "b"}


#: The push proxy's own timings per request (proxy.py, flow push), kept per
#: length: client in -> the prefill leg's answer, -> the decode's first chunk,
#: and the first chunk minus the prefill answer.
PUSH_LEGS = ("push_to_prefill_answer_ms", "push_to_first_chunk_ms",
             "push_first_chunk_after_prefill_answer_ms")


def _proxy_timings(url):
    """{timing: (total ever noted, values kept)} of our proxy at url."""
    from mooncake_connector.deployment import proxy_stats
    lat = proxy_stats(url, raw=True).get("latency_ms", {})
    return {k: (v.get("total", 0), v.get("values", [])) for k, v in lat.items()}


#: Our proxy's first-token fast path (flows a / b, the first token from the
#: prefill): a decode instance's first partial first token (one ending inside
#: a UTF-8 character) waits for the decode's text; once one settled, later
#: ones are released at once (docs/connector.md).  A server's lifetime pays
#: that once; the warm-up pays it here, so the timed requests see what a
#: running deployment sees.
FIRST_TOKEN_FAST_MODES = ("disaggregated", "flow_b")


def _settle_partial(url, send, mode, tries=60):
    """Short warm-up requests through the proxy at url until it has settled
    a partial first token on a decode instance (its /stats), at most tries."""
    from mooncake_connector.deployment import proxy_stats
    for i in range(tries):
        if proxy_stats(url).get("partial_settled_decodes", 0) > 0:
            print(f"  {mode}: a partial first token settled after {i} short warm-up requests",
                  flush=True)
            return
        send(i)
    print(f"  {mode}: no partial first token settled in {tries} short warm-up requests (its "
          "partial first tokens wait for the decode's text)", flush=True)


def _new_timings(before, after):
    """The values noted between two _proxy_timings snapshots."""
    out = {}
    for k, (total, values) in after.items():
        n = total - before.get(k, (0, []))[0]
        out[k] = values[len(values) - n:] if n > 0 else []
    return out


def measure(urls, lengths, n_requests, max_tokens, log, legs=None, extra_body=None,
            results=None):
    """Sends each prompt through every mode in urls ({mode: base url}), in a
    fresh random order per prompt; legs: (prefill url, decode url) to time
    the two legs of a disaggregated request on their own.  extra_body:
    {mode: dict merged into that mode's request body}.  results: rows of an
    earlier phase to add these modes to (same lengths).  The push modes'
    proxy timings (PUSH_LEGS) are kept per length as row["proxy_<mode>"]."""
    from mooncake_connector.openai_client import request
    t_start = time.monotonic()

    body = {"model": "tiny", "temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True,
            "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True}}
    extra_body = extra_body or {}

    def one(url, prompt, mode=None, **kw):
        b = dict(body, prompt=prompt, **kw)
        b.update(extra_body.get(mode, {}))
        if not b["stream"]:
            del b["stream_options"]
        r = request(url, "/v1/completions", b, timeout=600)
        if r.status != 200 or r.error:
            raise RuntimeError(f"{mode or url}: {r.status} {r.error}")
        return r

    for mode, url in urls.items():  # warm-up
        for i in range(3):
            one(url, prompt_of(max(lengths), 10_000 + i), mode)
        if mode in FIRST_TOKEN_FAST_MODES:
            _settle_partial(url, lambda i, url=url, mode=mode: one(url, prompt_of(8, 20_000 + i),
                                                                   mode, max_tokens=2), mode)
    if legs:
        for url in legs:
            one(url, prompt_of(max(lengths), 10_003))
    rows = results if results is not None else []
    order = random.Random(7 if results is None else 8)
    ref_key = "colocated" if "colocated" in urls else "colocated_phase2"
    for li, n in enumerate(lengths):
        if results is None:
            row = {"prompt_words": n, "prefill_leg": [], "decode_leg": [], "identical": 0,
                   "loaded_tokens": [], "identical_by_mode": {}, "ref_tokens": [],
                   "all_same": []}
            rows.append(row)
        else:
            row = results[li]
        for k in urls:
            row[k], row[f"itl_{k}"], row[f"gap12_{k}"] = [], [], []
            row["identical_by_mode"].setdefault(k, 0)
        snap = {k: _proxy_timings(urls[k]) for k in urls if k in PUSH_MODES}
        for i in range(n_requests):
            p = prompt_of(n, 1000 * n + i)
            # A fresh random order of the modes per request (a rotation would
            # keep each mode right behind the same other one), and a short
            # pause before each: every request meets idle servers, not the
            # tail of the previous one (a producer steps every ms until its
            # KV is pulled and released).
            keys = list(urls)
            order.shuffle(keys)
            got = {}
            for k in keys:
                if k == "colocated_cached":  # its cache filled by a first, unmeasured send
                    one(urls[k], p, k)
                time.sleep(SETTLE_S)
                got[k] = one(urls[k], p, k)
            for k, r in got.items():
                row[k].append(r.ttft_s)
                row[f"itl_{k}"] += r.itl_s
                row[f"gap12_{k}"] += r.itl_s[:1]
            ref = got[ref_key].token_ids
            cached = got.get("colocated_cached")
            for k, r in got.items():
                row["identical_by_mode"][k] += r.token_ids == ref
                if cached is not None:
                    # The same tail computed over the same cached KV (bf16:
                    # where a decode over loaded KV may part from colocated).
                    row.setdefault("identical_to_cached_by_mode", {}).setdefault(k, 0)
                    row["identical_to_cached_by_mode"][k] += r.token_ids == cached.token_ids
                # Prompt tokens the server did not compute (decode: loaded
                # from the producer; 0 for a colocated server without a
                # prefix cache).
                row.setdefault("loaded_by_mode", {}).setdefault(k, []).append(
                    r.cached_tokens)
            if results is None:
                # Kept per request: a later phase (the in-tree one) is checked
                # against this phase's colocated tokens too.
                row["ref_tokens"].append(ref)
                row["all_same"].append(all(r.token_ids == ref for r in got.values()))
                row["identical"] += row["all_same"][-1]
                if "disaggregated" in got:
                    row["loaded_tokens"].append(got["disaggregated"].cached_tokens)
                row["prompt_tokens"] = got[ref_key].usage["prompt_tokens"]
            if legs and results is None:
                # The two legs on their own, with a fresh prompt (nothing cached).
                q = prompt_of(n, 7 * n + i + 500_000)
                time.sleep(SETTLE_S)
                pre = one(legs[0], q, max_tokens=1, stream=False)
                time.sleep(SETTLE_S)
                dec = one(legs[1], q)
                row["prefill_leg"].append(pre.total_s)
                row["decode_leg"].append(dec.ttft_s)
        for k, before in snap.items():
            row[f"proxy_{k}"] = _new_timings(before, _proxy_timings(urls[k]))
        # Everything measured goes into this line too (a run that dies
        # later, or a device call that runs out, keeps it in its printout).
        log(f"  {row.get('prompt_tokens', n):5d} tokens ({time.monotonic() - t_start:.0f} s): "
            "TTFT p50 " + ", ".join(f"{k} {pct(row[k], 50) * 1e3:.1f}" for k in urls)
            + " ms; gap 1->2 p50 " + ", ".join(f"{k} {pct(row[f'gap12_{k}'], 50) * 1e3:.1f}"
                                               for k in urls if row[f"gap12_{k}"])
            + " ms; ITL p50/p99 " + ", ".join(
                f"{k} {pct(row[f'itl_{k}'], 50) * 1e3:.1f}/{pct(row[f'itl_{k}'], 99) * 1e3:.1f}"
                for k in urls if row[f"itl_{k}"])
            + " ms; push proxy p50 (to prefill answer, to 1st chunk, 1st chunk - prefill "
              "answer) " + ", ".join(
                f"{k} " + "/".join(f"{statistics.median(row[f'proxy_{k}'][t]):.1f}"
                                   if row[f"proxy_{k}"].get(t) else "-" for t in PUSH_LEGS)
                for k in snap)
            + f" ms; identical {row['identical_by_mode']}")
    return rows


def one_token_ttft(url, p):
    """TTFT (s) of one streamed greedy one-token completion of prompt p."""
    from mooncake_connector.openai_client import request
    r = request(url, "/v1/completions", {
        "model": "tiny", "prompt": p, "temperature": 0.0, "max_tokens": 1,
        "ignore_eos": True, "return_token_ids": True, "stream": True,
        "stream_options": {"include_usage": True}}, timeout=600)
    if r.status != 200 or r.error:
        raise RuntimeError(f"{url}: {r.status} {r.error}")
    return r.ttft_s


def measure_fixed(colocated_url, decode_url, n_requests):
    """Fixed per-request cost of the connector: a prompt of about one block
    that the prefill server never saw, sent straight to the decode server
    (its connector looks the prompt up at the producer, misses, and the
    prompt is computed locally) vs the colocated server computing the same."""
    ttft = one_token_ttft
    fixed = {"colocated": [], "decode": []}
    for i in range(max(20, n_requests)):
        p = prompt_of(40, 900_000 + i)
        time.sleep(SETTLE_S)
        fixed["colocated"].append(ttft(colocated_url, p))
        time.sleep(SETTLE_S)
        fixed["decode"].append(ttft(decode_url, p))
    return fixed


def _modes_in(row):
    return [k for k, _ in MODES if row.get(k)]


def summarize(results, fixed, xfer, bars_factor=1.1, layers=1):
    rows = []
    for r in results:
        # A raw transfer that could not be measured counts as 0 in the bars
        # (stricter) and is named: "kv_transfer_failed".
        t = xfer[r["prompt_words"]]
        modes = _modes_in(r)
        s = {"prompt_tokens": r["prompt_tokens"], "modes": modes,
             "kv_bytes": t["bytes"], "kv_transfer_ms": t["seconds"] * 1e3,
             "kv_transfer_one_layer_ms": t["seconds"] * 1e3 / max(1, layers),
             "kv_transfer_failed": t.get("failed"),
             "identical": r["identical"], "requests": len(r["colocated"]),
             "identical_by_mode": r.get("identical_by_mode", {}),
             "identical_to_cached_by_mode": r.get("identical_to_cached_by_mode", {}),
             "loaded_tokens_p50": pct(r["loaded_tokens"], 50) if r["loaded_tokens"] else None,
             "loaded_tokens_p50_by_mode": {k: pct([x or 0 for x in v], 50) for k, v in
                                           r.get("loaded_by_mode", {}).items() if v}}
        for k in modes + [k for k in ("prefill_leg", "decode_leg") if r.get(k)]:
            s[f"ttft_{k}_ms_p50"] = pct(r[k], 50) * 1e3
            s[f"ttft_{k}_ms_p99"] = pct(r[k], 99) * 1e3
        for k in modes:
            for what in ("itl", "gap12"):
                xs = r.get(f"{what}_{k}") or []
                s[f"{what}_{k}_ms_p50"] = pct(xs, 50) * 1e3 if xs else None
                s[f"{what}_{k}_ms_p99"] = pct(xs, 99) * 1e3 if xs else None
        # Paired: the same prompt through each mode back to back (random
        # order), so per-request differences cancel what drifts between
        # requests; the median difference is the path's own cost.
        for k in modes:
            ref = REFERENCE.get(k, "colocated")
            if k == ref or k.startswith("colocated") or not r.get(ref):
                continue
            d = [(x - y) * 1e3 for x, y in zip(r[k], r[ref])]
            s[f"ttft_{k}_paired_diff_ms_p50"] = statistics.median(d)
        if "disaggregated" in modes:
            for ref in ("colocated", "colocated_proxy"):
                d = [(x - y) * 1e3 for x, y in zip(r["disaggregated"], r[ref])]
                s[f"ttft_paired_diff_vs_{ref}_ms_p50"] = statistics.median(d)
                s[f"ttft_paired_bar_vs_{ref}_ok"] = (statistics.median(d)
                                                     <= bars_factor * s["kv_transfer_ms"])
            for ref in ("colocated", "colocated_proxy"):
                bar = s[f"ttft_{ref}_ms_p50"] + bars_factor * s["kv_transfer_ms"]
                s[f"ttft_bar_vs_{ref}_ms"] = bar
                s[f"ttft_bar_vs_{ref}_ok"] = s["ttft_disaggregated_ms_p50"] <= bar
                if "disaggregated_decode_first" in modes:
                    s[f"ttft_bar_vs_{ref}_decode_first_ok"] = (
                        s["ttft_disaggregated_decode_first_ms_p50"] <= bar)
            s["ttft_bar_ms"], s["ttft_bar_ok"] = s["ttft_bar_vs_colocated_ms"], \
                s["ttft_bar_vs_colocated_ok"]
            if "disaggregated_decode_first" in modes and r.get("prefill_leg"):
                s["proxy_and_hop_ms_p50"] = (s["ttft_disaggregated_decode_first_ms_p50"]
                                             - s["ttft_prefill_leg_ms_p50"]
                                             - s["ttft_decode_leg_ms_p50"])
            if r.get("prefill_leg"):
                s["first_token_path_over_prefill_leg_ms_p50"] = (
                    s["ttft_disaggregated_ms_p50"] - s["ttft_prefill_leg_ms_p50"])
        # Issue 31's bars for push: the gap between token 1 and 2 within
        # 2 ms of colocated ITL, and TTFT within the proxy hop + 2 ms + one
        # layer's transfer of colocated TTFT.
        hop = max(0.0, s.get("ttft_colocated_proxy_ms_p50", s["ttft_colocated_ms_p50"])
                  - s["ttft_colocated_ms_p50"])
        s["proxy_hop_ms_p50"] = hop
        for k in PUSH_MODES:
            if k not in modes:
                continue
            gap_bar = s["itl_colocated_ms_p50"] + 2.0
            ttft_bar = s["ttft_colocated_ms_p50"] + hop + 2.0 + s["kv_transfer_one_layer_ms"]
            s[f"{k}_gap12_bar_ms"], s[f"{k}_ttft_bar_ms"] = gap_bar, ttft_bar
            s[f"{k}_gap12_bar_ok"] = s[f"gap12_{k}_ms_p50"] <= gap_bar
            s[f"{k}_ttft_bar_ok"] = s[f"ttft_{k}_ms_p50"] <= ttft_bar
        # Push against vLLM's in-tree connector (all take the first token
        # from decode): each is measured in its own phase, so each is taken
        # as a ratio to that phase's colocated server (the host's load differs
        # between phases): TTFT p50 over colocated TTFT p50, gap 1->2 p50 over
        # colocated ITL p50; ahead or equal: push's ratio <= the in-tree
        # one's x 1.05.
        for it in (k for k in INTREE_MODES if k in modes):
            ri = (s[f"ttft_{it}_ms_p50"] / s["ttft_colocated_phase2_ms_p50"],
                  s[f"gap12_{it}_ms_p50"] / s["itl_colocated_phase2_ms_p50"])
            for k in PUSH_MODES:
                if k in modes:
                    pu = (s[f"ttft_{k}_ms_p50"] / s["ttft_colocated_ms_p50"],
                          s[f"gap12_{k}_ms_p50"] / s["itl_colocated_ms_p50"])
                    s[f"{k}_vs_{it}"] = {
                        "ttft_ratio": pu[0], "ttft_ratio_intree": ri[0],
                        "gap12_ratio": pu[1], "gap12_ratio_intree": ri[1],
                        "ttft_ahead_or_equal": pu[0] <= 1.05 * ri[0],
                        "gap12_ahead_or_equal": pu[1] <= 1.05 * ri[1]}
        for k in PUSH_MODES:
            for leg in PUSH_LEGS:
                xs = (r.get(f"proxy_{k}") or {}).get(leg)
                if xs:
                    s[f"{k}_{leg}_p50"] = statistics.median(xs)
        # Layer read against the write-based layer load (same bytes, same
        # servers, the same prompt through both in the same random order):
        # the median of the per-request ratios, and the ratio of the p50s.
        if "push_layer_read" in modes and "push_layer_load" in modes:
            s["read_vs_load_ttft_ratio_paired_p50"] = statistics.median(
                x / y for x, y in zip(r["push_layer_read"], r["push_layer_load"]))
            s["read_vs_load_ttft_ratio_of_p50"] = (s["ttft_push_layer_read_ms_p50"]
                                                   / s["ttft_push_layer_load_ms_p50"])
            s["read_vs_load_ttft_paired_diff_ms_p50"] = statistics.median(
                (x - y) * 1e3 for x, y in zip(r["push_layer_read"], r["push_layer_load"]))
        s["ttft_ms_per_request"] = {k: [round(x * 1e3, 3) for x in r[k]] for k in modes}
        rows.append(s)
    out = {"rows": rows}
    if fixed:
        fixed_ms = (statistics.median(fixed["decode"])
                    - statistics.median(fixed["colocated"])) * 1e3
        # Paired: each prompt went to both servers back to back.
        fixed_paired = statistics.median(
            (d - c) * 1e3 for d, c in zip(fixed["decode"], fixed["colocated"]))
        out.update({"fixed_overhead_ms_p50": fixed_ms, "fixed_overhead_ok": fixed_ms <= 1.0,
                    "fixed_overhead_paired_ms_p50": fixed_paired,
                    "fixed_overhead_paired_ok": fixed_paired <= 1.0,
                    "fixed_ms_per_request": {k: [round(x * 1e3, 3) for x in v]
                                             for k, v in fixed.items()}})
    return out


COLORS = {"colocated": "tab:blue", "colocated_proxy": "tab:cyan",
          "disaggregated": "tab:orange", "disaggregated_decode_first": "tab:red",
          "flow_b": "tab:olive", "flow_b_decode_first": "tab:brown", "push": "tab:green",
          "push_layerwise": "lime", "push_layer_load": "darkgreen",
          "push_layer_read": "teal", "router": "tab:purple",
          "intree": "black", "intree_at_once": "tab:pink",
          "colocated_phase2": "tab:gray", "colocated_cached": "slategray"}


def plot(summary, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    x = [r["prompt_tokens"] for r in rows]
    modes = [k for k, _ in MODES if any(k in r["modes"] for r in rows)]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    panels = ((axes[0][0], "ttft", 50, "TTFT p50 (ms)"),
              (axes[0][1], "gap12", 50, "token 1 -> 2 gap p50 (ms)"),
              (axes[1][0], "itl", 50, "ITL p50, all gaps (ms)"),
              (axes[1][1], "itl", 99, "ITL p99, all gaps (ms)"))
    for ax, what, q, ylabel in panels:
        for k in modes:
            ys = [r.get(f"{what}_{k}_ms_p{q}") for r in rows]
            if all(y is None for y in ys):
                continue
            style = "o--" if k.endswith("decode_first") else "o-"
            ax.plot(x, ys, style, color=COLORS.get(k), label=LABEL[k])
        if what == "gap12":
            ax.plot(x, [r["itl_colocated_ms_p50"] + 2.0 for r in rows], "k:",
                    label="bar: colocated ITL p50 + 2 ms")
        ax.set(xlabel="prompt tokens", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


def report(summary):
    def ms(s, key):
        a, b = s.get(key + "_ms_p50"), s.get(key + "_ms_p99")
        return "        -      " if a is None else f"{a:7.1f}/{b:7.1f}"

    def ok(b):
        return "ok" if b else "FAIL"
    for s in summary["rows"]:
        print(f"\n{s['prompt_tokens']} prompt tokens, {s['kv_bytes']:,d} B of KV, raw transfer "
              f"{s['kv_transfer_ms']:.2f} ms ({s['kv_transfer_one_layer_ms']:.2f} per layer), "
              f"proxy hop p50 {s['proxy_hop_ms_p50']:.2f} ms")
        print(f"  {'mode':<50} {'TTFT p50/p99 ms':>17} {'gap 1->2 p50/p99':>17} "
              f"{'ITL p50/p99':>17} {'paired - ref':>12} {'same':>6}")
        for k in s["modes"]:
            pd = s.get(f"ttft_{k}_paired_diff_ms_p50")
            print(f"  {LABEL[k]:<50} {ms(s, 'ttft_' + k)} {ms(s, 'gap12_' + k)} "
                  f"{ms(s, 'itl_' + k)} {'' if pd is None else f'{pd:+.2f}':>12} "
                  f"{s['identical_by_mode'].get(k, '-')}/{s['requests']}")
        if "ttft_bar_vs_colocated_ok" in s:
            print(f"  flow a bar (TTFT <= colocated + 1.1 x xfer): vs direct "
                  f"{ok(s['ttft_bar_vs_colocated_ok'])} ({s['ttft_bar_vs_colocated_ms']:.1f}), "
                  f"via proxy {ok(s['ttft_bar_vs_colocated_proxy_ok'])} "
                  f"({s['ttft_bar_vs_colocated_proxy_ms']:.1f}); paired "
                  f"{s['ttft_paired_diff_vs_colocated_ms_p50']:+.2f} / "
                  f"{s['ttft_paired_diff_vs_colocated_proxy_ms_p50']:+.2f} ms")
        if "proxy_and_hop_ms_p50" in s:
            print(f"  flow a, 1st token from decode = prefill leg "
                  f"{s['ttft_prefill_leg_ms_p50']:.1f} + decode leg "
                  f"{s['ttft_decode_leg_ms_p50']:.1f} + proxy/hop "
                  f"{s['proxy_and_hop_ms_p50']:.1f} ms (p50)")
        for k, it in ((k, it) for k in PUSH_MODES for it in INTREE_MODES):
            v = s.get(f"{k}_vs_{it}")
            if v:
                def verdict(w):
                    return "ahead or equal" if v[f"{w}_ahead_or_equal"] else "BEHIND"
                print(f"  {LABEL[k]} vs {LABEL[it]}, each over its phase's colocated: TTFT "
                      f"{v['ttft_ratio']:.2f}x vs {v['ttft_ratio_intree']:.2f}x "
                      f"({verdict('ttft')}); gap 1->2 / ITL {v['gap12_ratio']:.2f}x vs "
                      f"{v['gap12_ratio_intree']:.2f}x ({verdict('gap12')})")
        for k in PUSH_MODES:
            if f"{k}_{PUSH_LEGS[1]}_p50" in s:
                print(f"  {LABEL[k]}, the push proxy's timings p50: prefill leg answered "
                      + "; ".join(f"{w} {s[f'{k}_{leg}_p50']:.1f} ms" if f"{k}_{leg}_p50" in s
                                  else f"{w} -" for w, leg in zip(
                                      ("at", "decode's 1st chunk at", "1st chunk - prefill "
                                       "answer"), PUSH_LEGS)))
        if "read_vs_load_ttft_ratio_paired_p50" in s:
            print(f"  layer read vs layer load TTFT (paired, same requests): ratio p50 "
                  f"{s['read_vs_load_ttft_ratio_paired_p50']:.3f}x (p50 over p50 "
                  f"{s['read_vs_load_ttft_ratio_of_p50']:.3f}x), difference p50 "
                  f"{s['read_vs_load_ttft_paired_diff_ms_p50']:+.2f} ms")
        if s.get("identical_to_cached_by_mode"):
            print("  token-identical to the prefix-cached colocated answer (the same tail "
                  "over the same cached KV): " + ", ".join(
                      f"{k} {v}/{s['requests']}" for k, v in
                      s["identical_to_cached_by_mode"].items()))
        if s.get("loaded_tokens_p50_by_mode"):
            print("  prompt tokens not computed by the answering server (p50; decode: loaded "
                  "remotely): " + ", ".join(f"{k} {v:.0f}" for k, v in
                                            s["loaded_tokens_p50_by_mode"].items()))
        if s.get("kv_transfer_failed"):
            print(f"  raw transfer NOT measured (counted 0 in the bars): "
                  f"{s['kv_transfer_failed']}")
        for k in PUSH_MODES:
            if k in s["modes"]:
                print(f"  {LABEL[k]} bars (issue 31): gap 1->2 p50 "
                      f"{s[f'gap12_{k}_ms_p50']:.1f} <= {s[f'{k}_gap12_bar_ms']:.1f} "
                      f"{ok(s[f'{k}_gap12_bar_ok'])}; TTFT p50 {s[f'ttft_{k}_ms_p50']:.1f} <= "
                      f"{s[f'{k}_ttft_bar_ms']:.1f} {ok(s[f'{k}_ttft_bar_ok'])}")


def _failure_of(proc):
    """Where a server died: the root exception vLLM logged (the engine core's
    traceback), its last frames and message; else the log's last lines."""
    try:
        with open(proc.log_path, encoding="utf-8", errors="replace") as f:
            lines = [re.sub(r"^\(\w+ pid=\d+\) ERROR \S+ \S+ \[[^]]*\] ?", "", ln.rstrip())
                     for ln in f]
    except OSError as e:
        return f"(no log: {e})"
    for i, ln in enumerate(lines):
        if re.match(r"^\w*(Error|Exception): ", ln) and "initialization failed" not in ln:
            frames = [x for x in lines[max(0, i - 12):i] if x.strip() and
                      not set(x.strip()) <= set("^~ ")]
            return "\n".join(frames[-6:] + [ln])
    return "\n".join(lines[-12:])


#: tests/intree_cpu/sitecustomize.py, put on the in-tree servers' PYTHONPATH
#: (not copied): without it vLLM's in-tree connector cannot start on the CPU
#: backend at all.
INTREE_CPU_SITE = os.path.join(os.path.dirname(HERE), "tests", "intree_cpu")
INTREE_CPU_NOTE = (
    "benchmark-only workaround for vLLM's CPU backend: tests/intree_cpu/sitecustomize.py "
    "(MC_INTREE_CPU_ACCEL_INDEX=1) makes torch.accelerator.current_device_index() answer 0 "
    "without an accelerator; vLLM's MooncakeConnectorWorker.__init__ calls it "
    "(vllm 0.32.0 mooncake/mooncake_connector.py:1186) and only hands the index to "
    "current_platform.set_device(), a no-op on CPU")


def intree_xfer_stats(log_path):
    """Totals of the in-tree connector's "KV Transfer metrics: Num successful
    transfers=4, Avg xfer time (ms)=48.567, Avg MB per transfer=47.75, ..."
    lines (vLLM's stat logger, every 10 s; the producer's log)."""
    n = failed = 0
    ms = mb = 0.0
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            lines = [ln.split("KV Transfer metrics:", 1)[1] for ln in f
                     if "KV Transfer metrics:" in ln]
    except OSError:
        return {}
    for ln in lines:
        v = {k.strip(): float(x) for k, x in re.findall(r"([A-Za-z][^=,]*)=([0-9.]+)", ln)}
        k = int(v.get("Num successful transfers", 0))
        n += k
        ms += k * v.get("Avg xfer time (ms)", 0.0)
        mb += k * v.get("Avg MB per transfer", 0.0)
        failed += int(v.get("Num failed transfers", 0) + v.get("Num failed recvs", 0)
                      + v.get("Num KV expired reqs", 0))
    return {"transfers": n, "failed_or_expired": failed, "MB": round(mb, 1),
            "avg_xfer_ms": round(ms / n, 2) if n else None}


#: On vLLM's CUDA backend the in-tree connector starts as it is: what its
#: servers get there instead of the CPU workaround (intree_settings).
INTREE_CUDA_NOTE = (
    "CUDA: no workaround; Mooncake's CUDA engine (libcudart 12 beside it) over its TCP "
    "transport (mooncake_protocol tcp: GPU memory staged through host buffers), the same "
    "share of GPU 0 and vLLM flags as our servers, vLLM's default asynchronous scheduling "
    "on both in-tree servers, the KV cache in the HND layout the connector asks for")


def intree_settings(device, dev_env, site, bootstrap_port, pythonpath=""):
    """(environment, note) of the in-tree MooncakeConnector's two servers on
    `device`: Mooncake's package from `site` first on PYTHONPATH (its
    mooncake.engine, not our shim: MC_MOONCAKE_SHIM=0), our connector's
    plugin off, vLLM's bootstrap server on bootstrap_port, dev_env (the
    servers' device environment) underneath.  On "cpu" the benchmark-only
    workaround comes too (INTREE_CPU_SITE on PYTHONPATH,
    MC_INTREE_CPU_ACCEL_INDEX=1; note INTREE_CPU_NOTE); on "cuda" it does
    not (note INTREE_CUDA_NOTE)."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', not {device!r}")
    cpu = device == "cpu"
    pypath = os.pathsep.join([site] + [INTREE_CPU_SITE] * cpu + [
        p for p in (pythonpath or "").split(os.pathsep) if p])
    env = {**dev_env, "PYTHONPATH": pypath, "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap_port),
           "MOONCAKE_CONNECTOR_DISABLE_PLUGIN": "1", "MC_MOONCAKE_SHIM": "0"}
    if cpu:
        env["MC_INTREE_CPU_ACCEL_INDEX"] = "1"
    return env, INTREE_CPU_NOTE if cpu else INTREE_CUDA_NOTE


def intree_site_problem(device, site):
    """Why `site` (--mooncake-site) cannot serve the in-tree phase on
    `device`, or None: it must hold Mooncake's `mooncake` package; on cuda
    its CUDA build (the non-CUDA wheel's engine cannot move GPU memory)."""
    if not site or not os.path.isdir(os.path.join(site, "mooncake")):
        fix = ("scripts/vllm-gpu-intree.sh stage: Mooncake's CUDA engine, trimmed, unpacked"
               if device == "cuda" else
               "pip install --target DIR mooncake-transfer-engine-non-cuda")
        return f"no Mooncake package at --mooncake-site {site!r} ({fix})"
    if device == "cuda":
        if glob.glob(os.path.join(site, "mooncake_transfer_engine_non_cuda-*.dist-info")):
            return (f"--mooncake-site {site} holds mooncake-transfer-engine-non-cuda, whose "
                    "engine cannot register GPU memory; on --device cuda give the CUDA build "
                    "(scripts/vllm-gpu-intree.sh stage)")
        if not glob.glob(os.path.join(site, "mooncake", "engine*.so")):
            return f"--mooncake-site {site} has no mooncake/engine*.so (Mooncake's engine)"
    return None


#: What an in-tree server's failure on CUDA most likely means (a pattern of
#: its log -> the hint), checked in order (intree_failure_hint).
INTREE_CUDA_HINTS = (
    (r"libcudart\.so\.12|No module named 'mooncake|Mooncake is not available",
     "mooncake.engine did not import: --mooncake-site must hold the trimmed CUDA engine with "
     "libcudart.so.12 in mooncake_transfer_engine.libs/ (the machine has CUDA 13 only)"),
    (r"Transfer Engine initialization failed",
     "Mooncake's TransferEngine.initialize(127.0.0.1, P2PHANDSHAKE, tcp) failed (its log "
     "lines above say why)"),
    (r"batch memory registration failed",
     "Mooncake's engine refused to register the GPU KV cache (batch_register_memory): the "
     "engine's CUDA build is needed for GPU memory"),
    (r"[Ff]ree memory on device|GPU memory utilization|CUDA out of memory|OutOfMemoryError",
     "GPU memory: the in-tree pair takes the share each of our servers had (their "
     "--gpu-memory-utilization) beside the colocated server; was our pair's memory freed?"),
    (r"HND|get_kv_cache_stride_order|Unknown cache layout",
     "the connector asks vLLM for the HND KV layout; the attention backend "
     "(--attention-backend) must support it (TRITON_ATTN does in vLLM 0.26)"),
    (r"async.?scheduling",
     "vLLM's asynchronous scheduling (on by default on CUDA) and the in-tree connector"),
)


def intree_failure_hint(device, text):
    """A hint for where an in-tree server's failure text (its log's root
    exception) points on `device`, or "" (cpu: none; the CPU backend's
    known failure is the workaround's)."""
    if device != "cuda":
        return ""
    for pattern, hint in INTREE_CUDA_HINTS:
        if re.search(pattern, text):
            return f"likely cause: {hint}"
    return ""


def intree_engine_import_problem(env, python=None):
    """Why `import mooncake.engine` fails in the in-tree servers' environment
    (env on top of ours), or None: vLLM's connector only logs "Please install
    mooncake" and drops the ImportError's reason (a missing libcudart.so.12,
    a Python version the engine was not built for)."""
    out = subprocess.run([python or sys.executable, "-P", "-c", "import mooncake.engine"],
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, **env))
    if out.returncode == 0:
        return None
    last = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
    return f"mooncake.engine does not import from --mooncake-site: {last}"


def intree_phase(args, model, workdir, lengths, colocated, router_site, log):
    """vLLM's in-tree MooncakeConnector on Mooncake's engine, behind
    vllm-router, with the colocated server as the reference.  Returns
    (rows of the in-tree phase or None, status text, info).  On --device
    cuda its servers get the same GPU settings and share as ours
    (args.dev_env, args.dev_args: 0.75 / servers of GPU 0 each; the pair
    starts after our prefill and decode stopped, beside the colocated one)
    and no CPU workaround (intree_settings)."""
    from mooncake_connector import serving
    from mooncake_connector.deployment import prompt_tokens_by_source

    device = getattr(args, "device", "cpu")
    if not router_site:
        return None, "not run: vllm-router (its proxy) unavailable", {}
    site = args.mooncake_site
    problem = intree_site_problem(device, site)
    if problem:
        return None, f"not run: {problem}", {}
    logs = os.path.join(workdir, "logs")
    bport = serving.free_port()
    env, note = intree_settings(device, getattr(args, "dev_env", {}), site, bport,
                                os.environ.get("PYTHONPATH", ""))
    log(f"in-tree phase: {note}")
    if device == "cuda":  # the engine's own reason, which vLLM would not show
        problem = intree_engine_import_problem(env)
        if problem:
            return None, f"not run: {problem}", {}
    extra = {"mooncake_protocol": "tcp"}
    servers = []
    for role, name in (("kv_producer", "intree-prefill"), ("kv_consumer", "intree-decode")):
        servers.append(serving.vllm_server(
            name, model, serving.free_port(), os.path.join(logs, f"{name}.log"),
            kv_transfer_config={"kv_connector": "MooncakeConnector", "kv_role": role,
                                "kv_connector_extra_config": extra},
            env=env, kv_cache_bytes=args.kv_cache_mib << 20,
            extra_args=getattr(args, "dev_args", ())))
    try:
        serving.start_all(servers, args.start_timeout)
    except serving.StartError as e:
        first = str(e).splitlines()[0]
        died = next((p for p in servers if not p.alive), servers[0])
        failure = _failure_of(died)
        hint = intree_failure_hint(device, failure)
        who = ("vLLM's CPU backend cannot run it" if device == "cpu" else
               "vLLM's in-tree MooncakeConnector did not start on CUDA")
        return None, (f"{who}: {first}\n{died.name} ({died.log_path}):\n{failure}"
                      + (f"\n{hint}" if hint else "")), {}
    import vllm_router_pkg
    rport = serving.free_port()
    argv, renv = vllm_router_pkg.router_cmd(router_site, [(servers[0].url, bport)],
                                            [servers[1].url], rport)
    router = serving.Process("vllm-router (in-tree)", argv,
                             os.path.join(logs, "vllm-router-intree.log"), env=renv,
                             health_url=f"http://127.0.0.1:{rport}/health")
    router.url = f"http://127.0.0.1:{rport}"
    # vllm-router 0.1.17 sends the decode leg after the prefill's answer;
    # the in-tree connector's own proxy sends both at once: measure both.
    xport = serving.free_port()
    at_once = serving.Process(
        "in-tree proxy (both legs at once)",
        [sys.executable, "-P", os.path.join(HERE, "intree_proxy.py"), "--port", str(xport),
         "--prefill", servers[0].url, "--decode", servers[1].url,
         "--bootstrap", f"http://127.0.0.1:{bport}"],
        os.path.join(logs, "intree-proxy.log"), health_url=f"http://127.0.0.1:{xport}/health")
    try:
        serving.start_all([router, at_once], 300)
        before = prompt_tokens_by_source(servers[1].url)
        rows = measure({"colocated_phase2": colocated.url, "intree": router.url,
                        "intree_at_once": f"http://127.0.0.1:{xport}"}, lengths,
                       args.requests, args.max_tokens, log)
        after = prompt_tokens_by_source(servers[1].url)
        time.sleep(11)  # vLLM logs the connector's stats every 10 s
    except Exception as e:  # noqa: BLE001 - record why, keep phase 1's results
        why = f"started, but failed while measuring: {e!r}"
        died = next((p for p in servers if not p.alive), None)
        if died is not None:  # where a server died (a transfer's fault, say)
            failure = _failure_of(died)
            hint = intree_failure_hint(device, failure)
            why += f"\n{died.name} died ({died.log_path}):\n{failure}" + (
                f"\n{hint}" if hint else "")
        return None, why, {}
    finally:
        serving.stop_all([router, at_once, *servers])
    # Every request the decode server saw came through the router with
    # do_remote_prefill: its prompt must have been loaded from the prefill
    # (vLLM's external_kv_transfer), not computed (local_compute).
    src = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    ext, local = src.get("external_kv_transfer", 0), src.get("local_compute", 0)
    status = (f"measured; decode /metrics prompt tokens during the phase: {ext} loaded from "
              f"the prefill (external_kv_transfer), {local} computed (local_compute)")
    if not ext or local > ext // 100:
        status += " -- NOT LOADED REMOTELY: the in-tree numbers are not a disaggregated path"
    xfer = intree_xfer_stats(servers[0].log_path)
    if xfer.get("failed_or_expired"):
        status += (f"; the prefill's Mooncake engine counted {xfer['failed_or_expired']} "
                   "failed or expired transfers (its log)")
    return rows, status, {"decode_prompt_tokens_by_source": src,
                          "prefill_transfer_stats": xfer,
                          "setting": note,
                          "cpu_workaround": INTREE_CPU_NOTE if device == "cpu" else None}


def parse_args(argv=None):
    """(args, prompt lengths, modes wanted, model spec overrides), every flag
    checked before anything starts (a bad one exits 2 naming it)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="128,512,1024,1900",
                    help="prompt lengths in words (about one token each)")
    ap.add_argument("--requests", type=int, default=12, help="per length and mode")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--modes", default="all",
                    help="comma-separated subset of: " + ", ".join(
                        k for k, _ in MODES if k not in ("colocated_phase2", "intree_at_once"))
                    + " (colocated is always measured; colocated_cached: a fourth server with "
                      "vLLM's prefix cache, each prompt sent twice, the second measured, not in "
                      "all; push_layer_read: layer loads the decode reads, paired with "
                      "push_layer_load in the summary; intree measures vLLM's in-tree "
                      "connector behind vllm-router and behind intree_proxy.py; all = every "
                      "one that can start)")
    ap.add_argument("--push", action="store_true",
                    help="(kept for older command lines: the push modes are measured whenever "
                         "the proxy has --flow push; select with --modes)")
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
    ap.add_argument("--kv32k", action="store_true",
                    help=f"the KV-heavy model: {KV32K_SPEC} (32 KiB of KV per token); "
                         "also raises --kv-cache-mib to 256 unless given")
    ap.add_argument("--decode-async-scheduling", action="store_true",
                    help="--device cuda: the decode keeps vLLM's asynchronous scheduling (its "
                         "default) and takes layer loads in the step anyway "
                         "(push_layer_load_async with load_failure_policy 'fail'; the proxies "
                         "take a failed load's request again) instead of starting with "
                         "--no-async-scheduling for the layer-load modes")
    ap.add_argument("--kv-cache-mib", type=int, default=None,
                    help="each vLLM server's KV cache (default 64, 256 with --kv32k)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the vLLM servers run: cpu (vLLM's CPU backend) or cuda (all on "
                         "GPU 0, a share of its memory each: mooncake_connector.vllm_gpu; "
                         "docs/vllm-gpu.md)")
    ap.add_argument("--gpu-path", choices=["on", "off"], default="on",
                    help="--device cuda: the engine's same-host GPU path (CUDA IPC) between "
                         "prefill and decode, or off (MC_GPU_IPC=0: TCP with GPU staging)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="--device cuda: the servers run vLLM's CUDA graphs as production does "
                         "(--no-enforce-eager; docs/connector.md \"CUDA graphs\")")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the servers' dtype (bfloat16 halves the KV per token; --device cuda "
                         "only: vLLM's CPU backend runs this model in float32)")
    ap.add_argument("--attention-backend", default="TRITON_ATTN",
                    help="--device cuda: vLLM's --attention-backend for every server "
                         "(TRITON_ATTN: fp32 and exact comparisons; auto: vLLM's own choice, "
                         "FlashAttention on Hopper, as users run it)")
    ap.add_argument("--mooncake-site", default=os.environ.get("MC_MOONCAKE_SITE"),
                    help="for the in-tree MooncakeConnector phase: a pip --target dir holding "
                         "mooncake-transfer-engine-non-cuda (--device cpu), or the unpacked "
                         "trimmed CUDA engine of scripts/vllm-gpu-intree.sh (--device cuda) "
                         "($MC_MOONCAKE_SITE); vllm-router: $MC_VLLM_ROUTER_SITE "
                         "(tests/vllm_router_pkg.py)")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    if max(lengths) > 2000:
        ap.error("prompt lengths must stay below --max-model-len 2048")
    known = [k for k, _ in MODES if k not in ("colocated_phase2", "intree_at_once")]
    want = (set(known) - set(OPT_IN_MODES) if args.modes == "all"
            else set(filter(None, args.modes.split(","))))
    bad = want - set(known)
    if bad:
        ap.error(f"--modes: unknown {sorted(bad)}; known: {', '.join(known)}")
    want.add("colocated")
    if args.kv_cache_mib is None:
        args.kv_cache_mib = 256 if args.kv32k else 64
    if args.cuda_graphs and args.device != "cuda":
        ap.error("--cuda-graphs needs --device cuda")
    if args.decode_async_scheduling and args.device != "cuda":
        ap.error("--decode-async-scheduling needs --device cuda (vLLM's CPU backend turns "
                 "asynchronous scheduling off)")
    if args.device == "cpu" and (args.gpu_path != "on" or args.dtype != "float32"
                                 or args.attention_backend != "TRITON_ATTN"):
        ap.error("--gpu-path, --dtype bfloat16 and --attention-backend need --device cuda")
    from mooncake_connector import tiny_model
    overrides = dict(KV32K_SPEC if args.kv32k else BENCH_SPEC)
    for kv in filter(None, args.spec.split(",")):
        k, _, v = kv.partition("=")
        if not v.isdigit():
            ap.error(f"--spec: {kv!r} is not key=integer")
        overrides[k.strip()] = int(v)
    try:
        tiny_model.spec_with(**overrides)
    except ValueError as e:
        ap.error(f"--spec: {e}")
    return args, lengths, want, overrides


def _mode_proxies(want, flows):
    """The first-token proxies the modes in want need beyond flow a's (name:
    Deployment's extra_proxies entry), and the modes that cannot be measured
    (mode: why)."""
    skipped = {}
    extra_proxies = {}
    if want & {"disaggregated_decode_first"}:
        extra_proxies["a-decode-first"] = {"flow": "a", "first_token": "decode"}
    if want & {"flow_b", "flow_b_decode_first"}:
        extra_proxies["b-decode-first"] = {"flow": "b", "first_token": "decode"}
    if want & set(PUSH_MODES):
        if "push" in flows:
            # Whole prompt and layer by layer on the same servers: the proxy
            # asks for either per request (--push-layerwise off|on).
            if "push" in want:
                extra_proxies["push"] = {"flow": "push", "extra_args": ("--push-layerwise", "off")}
            if "push_layerwise" in want:
                extra_proxies["push-layerwise"] = {"flow": "push",
                                                   "extra_args": ("--push-layerwise", "on")}
            if "push_layer_load" in want:  # the decode's attention waits per layer
                extra_proxies["push-layer-load"] = {
                    "flow": "push", "extra_args": ("--push-layerwise", "on",
                                                   "--push-layer-load", "on")}
            if "push_layer_read" in want:  # the same, the decode reading each layer
                extra_proxies["push-layer-read"] = {
                    "flow": "push", "extra_args": ("--push-layerwise", "on",
                                                   "--push-layer-load", "on",
                                                   "--push-layer-read", "on")}
        else:
            for k in PUSH_MODES:
                if k in want:
                    skipped[k] = "our proxy has no --flow push (wip/push not merged)"
    return extra_proxies, skipped


def _find_router(want, skipped):
    """vllm-router's site for the router and intree modes (None: not asked
    for, or unavailable, those modes then in skipped with the reason)."""
    if not want & {"router", "intree"}:
        return None
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    import vllm_router_pkg
    router_site, why = vllm_router_pkg.find_router()
    if router_site is None:
        for k in ("router", "intree"):
            if k in want:
                skipped[k] = f"vllm-router unavailable: {why}"
    return router_site


def _router_process(dep, router_site):
    """The router mode's vllm-router in front of dep's prefill and decode (not
    started)."""
    from mooncake_connector import serving
    import vllm_router_pkg  # on sys.path since _find_router
    rport = serving.free_port()
    argv_r, renv = vllm_router_pkg.router_cmd(
        router_site, [(dep.prefill.url, dep.bootstrap_port)], [dep.decode.url], rport)
    router = serving.Process("vllm-router", argv_r,
                             os.path.join(dep.logs, "vllm-router.log"), env=renv,
                             health_url=f"http://127.0.0.1:{rport}/health")
    router.url = f"http://127.0.0.1:{rport}"
    return router


def _mode_urls(dep, want, skipped):
    """Where each measured mode sends its requests (mode: URL), the router's
    added once it is up."""
    urls = {"colocated": dep.colocated.url, "colocated_proxy": dep.colocated_proxy.url,
            "disaggregated": dep.proxies["a"].url}
    if dep.colocated_cached is not None:
        urls["colocated_cached"] = dep.colocated_cached.url
    for k, name in (("disaggregated_decode_first", "a-decode-first"), ("flow_b", "b"),
                    ("flow_b_decode_first", "b-decode-first"), ("push", "push"),
                    ("push_layerwise", "push-layerwise"),
                    ("push_layer_load", "push-layer-load"),
                    ("push_layer_read", "push-layer-read")):
        if k in want and k not in skipped and name in dep.proxies:
            urls[k] = dep.proxies[name].url
    return urls


def _merge_intree(results, intree_rows):
    """The in-tree phase's rows (intree_rows, one per length) into results."""
    for r, q in zip(results, intree_rows):
        for k in ("colocated_phase2", *INTREE_MODES):
            r[k], r[f"itl_{k}"], r[f"gap12_{k}"] = q[k], q[f"itl_{k}"], q[f"gap12_{k}"]
        r["identical_by_mode"].update(q["identical_by_mode"])
        # The in-tree answers against this run's first-phase colocated ones
        # as well (same prompts, same server): a request counts as
        # identical only if every mode of both phases gave the same tokens.
        r["identical"] = sum(a and b and t2 == t1 for a, b, t2, t1 in zip(
            r["all_same"], q["all_same"], q["ref_tokens"], r["ref_tokens"]))


def _raw_transfers(results, spec, args, dtype_bytes, dev_env):
    """The raw transfer of each length's KV (prompt words: seconds and
    bytes; a failed measurement counted 0 and named)."""
    xfer = {}
    for r in results:
        try:
            secs, nbytes = xfer_time(spec, r["prompt_tokens"] - 1, args.xfer_repeat,
                                     sys.executable, args.device, dtype_bytes,
                                     {k: v for k, v in dev_env.items() if k.startswith("MC_")})
            xfer[r["prompt_words"]] = {"seconds": secs, "bytes": nbytes}
        except (RuntimeError, subprocess.TimeoutExpired, ValueError, KeyError) as e:
            # The serving numbers stand without it: summarized with the
            # transfer counted 0 (stricter bars) and the failure named.
            print(f"raw transfer at {r['prompt_tokens']} tokens not measured: {e}", flush=True)
            xfer[r["prompt_words"]] = {"seconds": 0.0, "bytes": 0, "failed": str(e)[-500:]}
    return xfer


def _print_verdict(summary, skipped, intree_status, intree_info, conn_stats, proxy_lat):
    """The lines after the table: the fixed cost against its bar, what was
    not measured, the in-tree phase, token identity, the connector's and the
    proxy's own numbers."""
    print(f"\nconnector fixed per-request cost (decode vs colocated TTFT, ~40-token prompt "
          f"missing at the producer, p50): {summary['fixed_overhead_ms_p50']:.2f} ms "
          f"({'ok' if summary['fixed_overhead_ok'] else 'FAIL'}, bar 1 ms); paired median "
          f"{summary['fixed_overhead_paired_ms_p50']:.2f} ms "
          f"({'ok' if summary['fixed_overhead_paired_ok'] else 'FAIL'})")
    for k, why in skipped.items():
        print(f"not measured: {LABEL[k]}: {why}")
    print(f"vLLM in-tree MooncakeConnector: {intree_status}")
    if intree_info:
        print(f"  ({intree_info['setting']}; 1st token from decode only: vllm-router "
              f"and intree_proxy.py relay the decode leg's answer; Mooncake's engine on the "
              f"prefill (its KV Transfer metrics): {intree_info['prefill_transfer_stats']})")
    print(f"token-identical to colocated, every mode of the run: "
          f"{sum(s['identical'] for s in summary['rows'])}/"
          f"{sum(s['requests'] for s in summary['rows'])} requests")
    if conn_stats:
        print(f"connector's own stats on decode during the run: {conn_stats}")
    if proxy_lat:
        print(f"the first-token proxy's own timings (all lengths, ms): {proxy_lat}")


def main(argv=None):
    args, lengths, want, overrides = parse_args(argv)
    from mooncake_connector import serving, tiny_model
    from mooncake_connector.deployment import (Deployment, connector_log_stats, log_size,
                                               proxy_stats)
    from mooncake_connector.vllm_gpu import bench_settings

    # The servers' device: the GPU servers' environment and flags (three
    # servers share GPU 0), the engine's route between GPU KV caches, dtype.
    dev_env, dev_args = bench_settings(args.device, args.gpu_path, args.dtype,
                                      servers=3 + ("colocated_cached" in want),
                                      cuda_graphs=args.cuda_graphs,
                                      attention_backend=args.attention_backend)
    dtype_bytes = 2 if args.dtype == "bfloat16" else 4
    args.dev_env, args.dev_args = dev_env, dev_args  # the in-tree phase's servers too
    spec = tiny_model.spec_with(**overrides)
    model = tiny_model.build(**overrides)
    workdir = args.workdir or tempfile.mkdtemp(prefix="mc-serving-bench-")

    # A CUDA decode takes layer loads only without vLLM's asynchronous
    # scheduling (docs/connector.md, "Asynchronous scheduling"): with
    # push_layer_load or push_layer_read asked for, the decode starts with
    # --no-async-scheduling, as a user who wants layer loads runs it (the
    # colocated server keeps vLLM's default).
    layer_loads = args.device == "cuda" and bool(want & set(LAYER_LOAD_MODES))
    decode_args = ({"decode": ["--no-async-scheduling"]}
                   if layer_loads and not args.decode_async_scheduling else None)
    # --decode-async-scheduling: vLLM's defaults on the decode too, layer
    # loads in the step anyway (docs/connector.md, push_layer_load_async).
    decode_extra = ({"push_layer_load_async": True, "load_failure_policy": "fail"}
                    if args.decode_async_scheduling else None)
    extra_proxies, skipped = _mode_proxies(want, proxy_flows())
    extra_body = {}
    router_site = _find_router(want, skipped)
    dep = Deployment(workdir, model, connector=args.connector,
                     flows=tuple(f for f, k in (("a", "disaggregated"), ("b", "flow_b"))
                                 if k in want or f == "a"),
                     extra_proxies=extra_proxies, colocated_proxy=True,
                     kv_cache_bytes=args.kv_cache_mib << 20, env=dev_env,
                     extra_vllm_args=dev_args, colocated_cached="colocated_cached" in want,
                     side_args=decode_args, decode_extra_config=decode_extra)
    router = None
    if "router" in want and router_site and dep.bootstrap_port:
        router = _router_process(dep, router_site)
    kv_per_token = tiny_model.kv_bytes_per_token(spec, dtype_bytes)
    where = "vLLM CPU backend" if args.device == "cpu" else (
        f"GPU 0, {args.dtype}, attention {args.attention_backend}, engine route: "
        + ("same-host GPU path" if args.gpu_path == "on" else "TCP with GPU staging"))
    if decode_args:
        where += "; decode --no-async-scheduling (layer loads)"
    if decode_extra:
        where += ("; decode on vLLM's asynchronous scheduling, push_layer_load_async, "
                  "load_failure_policy 'fail'")
    print(f"model {model} ({kv_per_token} B of KV per token); {where}; "
          f"connector {dep.connector}; logs {dep.logs}", flush=True)
    for k, why in skipped.items():
        print(f"mode {k} not measured: {why}", flush=True)
    t0 = time.monotonic()
    urls = _mode_urls(dep, want, skipped)
    intree_rows, intree_status, intree_info = None, skipped.get("intree", "not asked for"), {}
    try:
        dep.start(timeout=args.start_timeout)
        if router is not None:
            serving.start_all([router], 300)
            urls["router"] = router.url
        print(f"servers up in {time.monotonic() - t0:.0f} s; measuring {list(urls)}", flush=True)
        mark = log_size(dep.decode.log_path)
        results = measure(urls, lengths, args.requests, args.max_tokens,
                          lambda s: print(s, flush=True),
                          legs=(dep.prefill.url, dep.decode.url), extra_body=extra_body)
        fixed = measure_fixed(dep.colocated.url, dep.decode.url, args.requests)
        time.sleep(11)  # vLLM logs the connector's stats every 10 s
        conn_stats = connector_log_stats(dep.decode.log_path, mark)
        proxy_lat = proxy_stats(dep.proxies["a"].url).get("latency_ms", {})
        for k in PUSH_MODES:
            if k in urls:
                proxy_lat[k] = proxy_stats(urls[k]).get("latency_ms", {})
        if "intree" in want and "intree" not in skipped:
            # One vLLM server set at a time: ours stop, the in-tree pair starts;
            # the colocated server stays as this phase's reference.
            serving.stop_all([p for p in dep.processes
                              if p not in (dep.colocated, dep.metadata)] + [router] * bool(router))
            print("in-tree phase: starting vLLM's MooncakeConnector pair", flush=True)
            intree_rows, intree_status, intree_info = intree_phase(
                args, model, workdir, lengths, dep.colocated, router_site,
                lambda s: print(s, flush=True))
            print(f"in-tree phase: {intree_status}", flush=True)
    finally:
        if router is not None:
            serving.stop_all([router])
        dep.stop()
    if intree_rows:
        _merge_intree(results, intree_rows)
    # The measured rows first: a failing transfer measurement below must not
    # lose them (the summary replaces this file).
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"partial": "the raw transfer measurement did not finish",
                   "results": results, "fixed": fixed}, f)
    xfer = _raw_transfers(results, spec, args, dtype_bytes, dev_env)
    summary = summarize(results, fixed, xfer, layers=spec["layers"])
    summary.update({"connector": dep.connector, "model_spec": spec,
                    "connector_stats_decode": conn_stats, "proxy_latency_ms": proxy_lat,
                    "kv_bytes_per_token": kv_per_token, "device": args.device,
                    "gpu_path": args.gpu_path if args.device == "cuda" else None,
                    "dtype": args.dtype, "cuda_graphs": args.cuda_graphs, "where": where,
                    "requests_per_length": args.requests, "max_tokens": args.max_tokens,
                    "modes_not_measured": skipped, "intree_status": intree_status,
                    "intree": intree_info,
                    "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                    "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
                    "command": " ".join(sys.argv)})
    report(summary)
    _print_verdict(summary, skipped, intree_status, intree_info, conn_stats, proxy_lat)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    plot(summary, args.plot, f"{dep.connector} connector, {where}, {spec['layers']} layers, "
         f"{summary['kv_bytes_per_token']} B KV/token, {os.cpu_count()} CPUs, "
         f"{args.requests} req/length, {summary['date']}")
    print(f"wrote {args.out} and {args.plot}")
    ok = all(s.get("ttft_bar_vs_colocated_ok", True) for s in summary["rows"]) and summary[
        "fixed_overhead_ok"]
    if args.enforce_bars and not ok:
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
