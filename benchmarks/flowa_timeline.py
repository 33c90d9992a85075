"""Where flow a's first-token fast path spends its time over colocated (run 43).

    PYTHONPATH=. .venv/bin/python -P benchmarks/flowa_timeline.py \\
        [--lengths 128,512,1024,1900] [--requests 8] [--proxy-b PATH --label-b NAME] \\
        [--out build/flowa_timeline.json]

Starts the metadata, prefill, decode and colocated vLLM CPU servers (the
KV-heavy model of serving_bench.py --kv32k: 8 layers, 32 KiB of KV per token),
a flow a proxy (first token from the prefill: the proxy's fast path) and a
pass-through proxy in front of the colocated server, with MC_TRACE
(mooncake_connector/trace.py) set in every process.  Each prompt goes, one
request at a time, in a fresh random order per prompt, through:

* colocated: straight to the colocated server (streamed);
* colocated_proxy: through the pass-through proxy (the hop's floor);
* flowa: through the flow a proxy (the prefill's first token streamed at
  once, then the decode continues);
* flowa_<label>: with --proxy-b, a second flow a proxy in front of the same
  prefill and decode servers whose process imports the proxy from PATH (an
  A/B of proxy code, same servers, same prompts);
* prefill_ns: the body the proxy sends the prefill leg (max_tokens 1, not
  streamed, return_token_ids), straight to the prefill server, with
  kv_transfer_params do_remote_decode false (nothing published or held);
* prefill_s: the same streamed (its first chunk's time).

Per request: the client's send and first-token times (CLOCK_MONOTONIC), the
served vLLM server's own histograms (arrival -> first token in its API server,
queue, scheduled -> first token; scraped around each request), and from the
trace the proxy's points (proxy_in, proxy_pre_post, proxy_pre_head,
proxy_pre_body, proxy_first_out) and the prefill's (sched_publish with vLLM's
arrival time, step_bound, fwd_start, fwd_end, published, sched_finished).
Printed: per length the p50 of each segment from the client's send to its
first token, flow a next to colocated, and the paired (same prompt) TTFT
differences.
"""
import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_stats import pct_known as _pct  # noqa: E402
from serving_bench import KV32K_SPEC, prompt_of  # noqa: E402
from ttft_timeline import scrape  # noqa: E402

SETTLE_S = 0.05
NAMES = ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
         "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds")

#: (label, from point, to point) of a flow a request, per request then p50.
SEGMENTS = (
    ("client send -> proxy has the request", "send", "proxy_in"),
    ("proxy: read, check, prefill body -> POST", "proxy_in", "proxy_pre_post"),
    ("proxy POST -> prefill API server arrival", "proxy_pre_post", "arrival"),
    ("arrival -> scheduled (tokenize, engine queue)", "arrival", "sched_publish"),
    ("scheduled -> step's forward bound", "sched_publish", "step_bound"),
    ("forward (bound -> start_load after it)", "step_bound", "fwd_start"),
    ("connector after forward (publish: ours)", "fwd_start", "published"),
    ("published -> sampled, request_finished", "published", "sched_finished"),
    ("request_finished -> API server has token", "sched_finished", "api_first"),
    ("API server token -> proxy has answer head", "api_first", "proxy_pre_head"),
    ("proxy: answer head -> body read", "proxy_pre_head", "proxy_pre_body"),
    ("proxy: parse answer, plan", "proxy_pre_body", "proxy_plan"),
    ("proxy: plan -> first chunk written", "proxy_plan", "proxy_first_out"),
    ("  (partial: boundary check, 2x /detokenize)", "proxy_boundary_ask", "proxy_boundary_ok"),
    ("proxy first chunk -> client has it", "proxy_first_out", "first"),
)
#: The same stretches of a request straight to a vLLM server (colocated,
#: prefill_*): from vLLM's histograms only.
SERVER_SEGMENTS = (
    ("client send -> arrival, + API token -> client", None, None),
    ("arrival -> API server has token (vLLM TTFT)", None, None),
    ("  of which engine queue", None, None),
    ("  of which scheduled -> first token", None, None),
)


def points(events, rid, arrival_w=None):
    """{point: monotonic time} of one flow a request (rid: the proxy's
    request id, which vLLM's request id contains)."""
    out = {}
    for e in events:
        k = str(e.get("k"))
        ev = e["ev"]
        if k == rid and ev.startswith("proxy_") and ev not in out:
            out[ev] = e["t_in"] if ev == "proxy_in" else e["t"]
            if ev == "proxy_plan":
                out["partial"] = e.get("partial")
        elif ("-" + rid + "-") in k and ev not in out:
            out[ev] = e["t"]
            if ev == "sched_publish" and e.get("arrival_w"):
                # vLLM's arrival time (wall clock, the API server's) on this axis
                out["arrival"] = e["arrival_w"] + e["t"] - e["w"]
    return out


def one(url, body, rid):
    from mooncake_connector.openai_client import request
    t = time.monotonic()
    r = request(url, "/v1/completions", body, timeout=600, headers={"X-Request-Id": rid})
    if r.status != 200 or r.error:
        raise RuntimeError(f"{url}: {r.status} {r.error}")
    return t, r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="128,512,1024,1900")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--proxy-b", metavar="PATH",
                    help="a second flow a proxy importing mooncake_connector from PATH first")
    ap.add_argument("--label-b", default="b")
    ap.add_argument("--warm-flowa", type=int, default=60,
                    help="short warm-up requests per flow a proxy (partial first tokens settle)")
    ap.add_argument("--no-prefill-direct", action="store_true",
                    help="leave out the prefill_ns / prefill_s modes")
    ap.add_argument("--pool", nargs="+", metavar="JSON[:MODE]",
                    help="no run: the tables over the requests of earlier runs' --out "
                         "together; MODE: that run's flow a proxy to count as flowa (e.g. "
                         "run.json:flowa_base), its other flow a proxies left out")
    ap.add_argument("--out", default="build/flowa_timeline.json")
    ap.add_argument("--workdir")
    args = ap.parse_args(argv)
    if args.pool:
        return pool(args.pool, args.out)
    lengths = [int(x) for x in args.lengths.split(",")]
    workdir = args.workdir or tempfile.mkdtemp(prefix="mc-flowa-")
    tpath = os.path.join(workdir, "trace.jsonl")
    os.environ["MC_TRACE"] = tpath
    os.environ.setdefault("MC_TRACE_MAX_MB", "256")
    from mooncake_connector import serving, tiny_model, trace
    from mooncake_connector.deployment import Deployment
    from mooncake_connector.vllm_gpu import bench_settings

    env, vargs = bench_settings("cpu", servers=3)
    dep = Deployment(workdir, tiny_model.build(**KV32K_SPEC), flows=("a",),
                     colocated_proxy=True, kv_cache_bytes=256 << 20, env=env,
                     extra_vllm_args=vargs)
    extra = []
    if args.proxy_b:
        pb = serving.proxy([dep.prefill.url], [dep.decode.url], serving.free_port(),
                           os.path.join(workdir, "logs", "proxy-b.log"), flow="a",
                           name=f"proxy flow a ({args.label_b})")
        pb.env["PYTHONPATH"] = os.path.abspath(args.proxy_b)
        extra.append(pb)
    meta = {"load_before": os.getloadavg(), "command": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    rows = []
    try:
        serving.start_all([dep.metadata], 30)
        serving.start_all([p for p in dep.processes if p is not dep.metadata] + extra, 900)
        urls = {"colocated": dep.colocated.url, "colocated_proxy": dep.colocated_proxy.url,
                "flowa": dep.proxies["a"].url}
        srv = {"colocated": dep.colocated.url, "colocated_proxy": dep.colocated.url,
               "flowa": dep.prefill.url}
        if extra:
            urls[f"flowa_{args.label_b}"] = extra[0].url
            srv[f"flowa_{args.label_b}"] = dep.prefill.url
        if not args.no_prefill_direct:
            for k in ("prefill_ns", "prefill_s"):
                urls[k] = srv[k] = dep.prefill.url
        base = {"model": "tiny", "temperature": 0.0, "max_tokens": args.max_tokens,
                "ignore_eos": True, "return_token_ids": True, "stream": True,
                "stream_options": {"include_usage": True}}
        plain = {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": False}}

        def body_of(mode, prompt):
            b = dict(base, prompt=prompt)
            if mode.startswith("prefill_"):
                b.update(plain)
                if mode == "prefill_ns":
                    b["stream"] = False
                    del b["stream_options"]
            return b

        tag = os.getpid()
        for k, u in urls.items():  # warm-up
            for i in range(3):
                one(u, body_of(k, prompt_of(max(lengths), 10_000 + i)), f"w{tag}-{k}-{i}")
            # flow a: until the proxy has settled a partial first token on the
            # decode instance (before that it holds such streams to the
            # decode's first text: a start-up cost, counted apart below)
            pid = next((p.proc.pid for p in [*dep.proxies.values(), *extra] if p.url == u), None)
            for i in range(args.warm_flowa if k.startswith("flowa") else 0):
                one(u, body_of(k, prompt_of(128, 20_000 + i)), f"w{tag}-{k}-s{i}")
                if any(e["ev"] == "proxy_settled" and e["pid"] == pid
                       for e in trace.read(tpath)):
                    print(f"  {k}: a partial first token settled after {i + 1} warm-up "
                          "requests", flush=True)
                    break
            else:
                if k.startswith("flowa"):
                    print(f"  {k}: no partial first token settled in {args.warm_flowa} "
                          "warm-up requests (its partial streams are held)", flush=True)
        order = random.Random(43)
        for n in lengths:
            t0 = time.monotonic()
            for i in range(args.requests):
                p = prompt_of(n, 1000 * n + i)
                keys = list(urls)
                order.shuffle(keys)
                got = {}
                for k in keys:
                    rid = f"fa{tag}-{k.replace('_', '')}-{n}-{i}"
                    before = scrape(srv[k], NAMES)
                    time.sleep(SETTLE_S)
                    t_send, r = one(urls[k], body_of(k, p), rid)
                    after = scrape(srv[k], NAMES)
                    rec = {"mode": k, "n": n, "i": i, "rid": rid, "send": t_send,
                           "ttft_ms": r.ttft_s * 1e3, "first": t_send + r.ttft_s,
                           "tokens": r.token_ids, "itl_ms": [x * 1e3 for x in r.itl_s],
                           "prompt_tokens": (r.usage or {}).get("prompt_tokens")}
                    for m in NAMES:
                        if m in after:
                            rec[m.split(":")[1]] = (after[m] - before.get(m, 0.0)) * 1e3
                    got[k] = rec
                ref = got["colocated"]["tokens"]
                for rec in got.values():
                    rec["identical"] = bool(rec["tokens"]) and rec["tokens"] == ref[:len(
                        rec["tokens"])]
                    rows.append(rec)
            print(f"  {n} words done ({time.monotonic() - t0:.0f} s)", flush=True)
        from mooncake_connector.deployment import proxy_stats
        meta["proxy_counts"] = {}
        for k, u in urls.items():
            if k.startswith("flowa"):
                try:
                    meta["proxy_counts"][k] = {
                        c: v for c, v in proxy_stats(u).items()
                        if c.startswith(("first_token", "finished_at", "decode_err"))}
                except Exception as e:  # noqa: BLE001 - a report without them
                    meta["proxy_counts"][k] = repr(e)
                print(f"  {k} proxy counts: {meta['proxy_counts'][k]}", flush=True)
    finally:
        meta["load_after"] = os.getloadavg()
        serving.stop_all([p for p in dep.processes if p is not dep.metadata] + extra)
        serving.stop_all([dep.metadata])
    time.sleep(0.5)
    events = trace.read(tpath)
    for rec in rows:
        if rec["mode"].startswith("flowa"):
            pts = points(events, rec["rid"])
            ttft_srv = rec.get("time_to_first_token_seconds")
            if "arrival" in pts and ttft_srv is not None:
                pts["api_first"] = pts["arrival"] + ttft_srv / 1e3
            rec["points"] = pts
    summary = report(rows, list(urls))
    summary.update(meta, trace=tpath, cpus=os.cpu_count())
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"summary": summary, "rows": rows}, f, indent=1)
    print(f"load average before/after: {meta['load_before']} / {meta['load_after']}")
    print(f"wrote {args.out} (trace {tpath})")
    return 0


def pool(specs, out):
    """--pool: several runs' rows as one run's tables (prompts paired within
    their run: "i" made unique per run)."""
    rows, modes, meta = [], [], []
    for j, spec in enumerate(specs):
        path, _, take = spec.partition(":")
        take = take or "flowa"
        with open(path) as f:
            d = json.load(f)
        meta.append({"path": path, "flowa": take, **{k: d["summary"].get(k) for k in (
            "date", "command", "load_before", "load_after")}})
        for r in d["rows"]:
            m = r["mode"]
            if m.startswith("flowa"):
                if m != take:
                    continue
                m = "flowa"
            rows.append(dict(r, mode=m, i=f"{j}x{r['i']}"))
            if m not in modes:
                modes.append(m)
    summary = report(rows, modes)
    summary["pooled_from"] = meta
    with open(out, "w") as f:
        json.dump({"summary": summary}, f, indent=1)
    print(f"wrote {out}")
    return 0


def _seg(rec, a, b):
    p = dict(rec.get("points") or {}, send=rec["send"], first=rec["first"])
    if p.get(a) is None or p.get(b) is None:
        return None
    return (p[b] - p[a]) * 1e3


def report(rows, modes):
    out = {}
    for n in dict.fromkeys(r["n"] for r in rows):
        recs = [r for r in rows if r["n"] == n]
        s = {"prompt_tokens": next((r["prompt_tokens"] for r in recs if r["prompt_tokens"]),
                                   None)}
        by_i = {}
        for r in recs:
            by_i.setdefault(r["i"], {})[r["mode"]] = r
        print(f"\n== {n} words ({s['prompt_tokens']} tokens), {len(by_i)} prompts")
        for k in modes:
            xs = [r for r in recs if r["mode"] == k]
            s[f"ttft_{k}"] = _pct([r["ttft_ms"] for r in xs])
            s[f"identical_{k}"] = f"{sum(r['identical'] for r in xs)}/{len(xs)}"
            d = [v[k]["ttft_ms"] - v["colocated"]["ttft_ms"] for v in by_i.values()
                 if k in v and "colocated" in v]
            s[f"paired_{k}"] = statistics.median(d) if d and k != "colocated" else None
            srv_ttft = [r.get("time_to_first_token_seconds") for r in xs]
            s[f"server_ttft_{k}"] = _pct(srv_ttft)
            s[f"outside_{k}"] = _pct([r["ttft_ms"] - r["time_to_first_token_seconds"]
                                      for r in xs if r.get("time_to_first_token_seconds")
                                      is not None])
            s[f"queue_{k}"] = _pct([r.get("request_queue_time_seconds") for r in xs])
            s[f"sched_first_{k}"] = _pct([r.get("request_prefill_time_seconds") for r in xs])
            print(f"  {k:<16} TTFT p50 {s[f'ttft_{k}']:7.2f}  paired - colocated "
                  f"{'' if s[f'paired_{k}'] is None else format(s[f'paired_{k}'], '+7.2f'):>7}"
                  f"  | vLLM server TTFT {_f(s[f'server_ttft_{k}'])} (queue "
                  f"{_f(s[f'queue_{k}'])}, scheduled->1st {_f(s[f'sched_first_{k}'])}), "
                  f"outside it {_f(s[f'outside_{k}'])}  identical {s[f'identical_{k}']}")
        for a, b in (("flowa", "colocated"), ("flowa", "colocated_proxy"),
                     ("colocated_proxy", "colocated"), ("prefill_s", "colocated"),
                     ("prefill_ns", "prefill_s"), ("flowa", "prefill_ns")):
            for k2 in [m for m in modes if m == a or (a == "flowa" and m.startswith("flowa_"))]:
                d = [v[k2]["ttft_ms"] - v[b]["ttft_ms"] for v in by_i.values()
                     if k2 in v and b in v]
                if not d:
                    continue
                ds = [(v[k2].get("time_to_first_token_seconds") or 0)
                      - (v[b].get("time_to_first_token_seconds") or 0) for v in by_i.values()
                      if k2 in v and b in v]
                s[f"paired_{k2}_minus_{b}"] = statistics.median(d)
                s[f"paired_server_{k2}_minus_{b}"] = statistics.median(ds)
                print(f"  paired {k2} - {b}: TTFT {statistics.median(d):+.2f} ms (vLLM "
                      f"server TTFT {statistics.median(ds):+.2f})")
        for k in [m for m in modes if m.startswith("flowa")]:
            groups = {"all": [r for r in recs if r["mode"] == k]}
            groups["whole"] = [r for r in groups["all"]
                               if (r.get("points") or {}).get("partial") is False]
            groups["partial"] = [r for r in groups["all"]
                                 if (r.get("points") or {}).get("partial")
                                 and "proxy_boundary_ask" in r["points"]]
            # partial, held to the decode's first text (the decode instance
            # has not settled one yet, or its last one failed)
            groups["held"] = [r for r in groups["all"]
                              if (r.get("points") or {}).get("partial")
                              and "proxy_boundary_ask" not in r["points"]]
            print(f"  {k}: segments (per request, p50 ms), all / first token whole / "
                  "partial, released early / partial, held (n "
                  + " / ".join(str(len(v)) for v in groups.values()) + ")")
            tot = dict.fromkeys(groups, 0.0)
            for label, a, b in SEGMENTS:
                vals = {g: _pct([_seg(r, a, b) for r in xs]) for g, xs in groups.items()}
                for g, v in vals.items():
                    s[f"seg_{g}_{k}"] = dict(s.get(f"seg_{g}_{k}") or {}, **{label: v})
                    if not label.startswith("  "):
                        tot[g] += v or 0.0
                print(f"    {label:<48} " + " ".join(_f(v) for v in vals.values()))
            for g, xs in groups.items():
                s[f"ttft_{g}_{k}"] = _pct([r["ttft_ms"] for r in xs])
                d = [r["ttft_ms"] - by_i[r["i"]]["colocated"]["ttft_ms"] for r in xs
                     if "colocated" in by_i[r["i"]]]
                s[f"paired_{g}_{k}"] = statistics.median(d) if d else None
            print(f"    {'(sum of p50s)':<48} " + " ".join(_f(v) for v in tot.values()))
            print(f"    {'(TTFT p50)':<48} " + " ".join(_f(s[f'ttft_{g}_{k}']) for g in groups))
            print(f"    {'(paired TTFT - colocated, median)':<48} "
                  + " ".join(_f(s[f'paired_{g}_{k}']) for g in groups))
            for g, xs in groups.items():
                s[f"gap12_{g}_{k}"] = _pct([r["itl_ms"][0] for r in xs if r.get("itl_ms")])
            print(f"    {'(gap token 1 -> 2 p50)':<48} "
                  + " ".join(_f(s[f'gap12_{g}_{k}']) for g in groups))
        out[n] = s
    return out


def _f(v):
    return "      -" if v is None else f"{v:7.2f}"


if __name__ == "__main__":
    sys.exit(main())
