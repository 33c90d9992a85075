"""The seed's deployment on one GPU, end to end (issue #27, docs/vllm-gpu.md).

    python scripts/vllm_gpu_e2e.py --workdir DIR [--out results.json] [--quick]

Phase 1 (the same-host GPU path on): the embedded metadata server, one
mooncake.json, a prefill (kv_producer) and a decode (kv_consumer) vLLM
api_server and a colocated reference on GPU 0 (the memory split of
vllm_gpu.device_settings), our proxy for flow a and flow b.  Greedy
streamed prompts with shared prefixes, 5 to 1,500 tokens, through both
flows and to the colocated server: tokens must be identical, decode must
have loaded the prompt KV remotely (vLLM's prompt-token counters and the
per-request cached tokens), TTFT and ITL p50/p99 disaggregated vs colocated.
Phase 2: prefill and decode again with the same-host GPU path off
(MC_GPU_IPC=0: TCP with GPU staging), the same prompts, compared with
phase 1's colocated tokens.  Phase 3: the prefill server SIGKILLed while
requests stream through the proxy: each must end (an error or its tokens)
within a bound, and later requests get a clear error, no hang.
Exit status 0 only if every check held.  Needs vLLM importable (on the GPU
machine: scripts/vllm-gpu-install.sh) and mooncake_connector with _core.
"""
import argparse
import concurrent.futures as cf
import json
import os
import sys
import time

from mooncake_connector import serving, tiny_model
from mooncake_connector.deployment import (Deployment, connector_log_stats, log_size,
                                           prompt_tokens_by_source, proxy_stats)
from mooncake_connector.openai_client import request
from mooncake_connector.vllm_gpu import device_settings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench_stats import pct  # noqa: E402

WORDS = ("the quick brown fox jumps over lazy dog hello world prefill decode kv cache one "
         "two three four five six seven eight nine ten tiny model server").split()


def words(n, seed):
    x = seed * 7919 + 17
    out = []
    for _ in range(n):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(WORDS[x % len(WORDS)])
    return out


def prompts(quick=False):
    """Prompts sharing prefixes: three bases, each cut at several lengths
    and given a distinct tail; from a few words to ~1,450."""
    base = {s: words(1450, s) for s in (1, 2, 3)}
    plan = [(1, 2, 0), (1, 10, 1), (1, 60, 2), (1, 200, 3), (1, 200, 4), (2, 400, 5),
            (2, 400, 6), (2, 700, 7), (3, 900, 8), (3, 1100, 9), (3, 1300, 10), (1, 1440, 11),
            (2, 1440, 12), (3, 30, 13)]
    if quick:
        plan = plan[:4] + plan[-3:]
    return [" ".join(base[b][:n] + words(3, 100 + t)) for b, n, t in plan]


def lat(rows, key):
    vals = [v for r in rows for v in (r[key] if isinstance(r[key], list) else [r[key]])]
    return {"p50_ms": pct(vals, 50) * 1e3, "p99_ms": pct(vals, 99) * 1e3, "n": len(vals)}


def body(max_tokens):
    return {"model": "tiny", "temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True,
            "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True}}


def send(url, prompt, max_tokens, timeout=120):
    r = request(url, "/v1/completions", dict(body(max_tokens), prompt=prompt), timeout=timeout)
    if r.status != 200 or r.error:
        raise RuntimeError(f"request to {url} failed: {r.status} {r.error}")
    return r


def gpu_path_lines(log_path, since=0):
    try:
        with open(log_path, "rb") as f:
            f.seek(since)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return sorted({line.split("GPU path to segment", 1)[1].strip()[:200]
                   for line in text.splitlines() if "GPU path to segment" in line})


def run_flows(dep, ps, max_tokens, reference=None, out=print):
    """Every prompt through each flow's proxy (and, without a reference, to
    the colocated server first).  Returns (rows, reference tokens)."""
    ref = dict(reference or {})
    rows = []
    for flow in sorted(dep.proxies):
        before = prompt_tokens_by_source(dep.decode.url)
        mark = log_size(dep.decode.log_path)
        frows = []
        for i, p in enumerate(ps):
            if i not in ref:
                c = send(dep.colocated.url, p, max_tokens)
                ref[i] = c.token_ids
                frows.append({"colocated_ttft": c.ttft_s, "colocated_itl": c.itl_s})
            else:
                frows.append({})
            d = send(dep.proxies[flow].url, p, max_tokens)
            n = d.usage["prompt_tokens"]
            frows[-1].update({"flow": flow, "prompt": i, "prompt_tokens": n,
                              "loaded": d.cached_tokens, "identical": d.token_ids == ref[i],
                              "ttft": d.ttft_s, "itl": d.itl_s})
            out(f"  flow {flow} prompt {i:2d}: {n:5d} tokens, {d.cached_tokens:5d} loaded "
                f"remotely, TTFT {d.ttft_s * 1e3:6.1f} ms, "
                f"{'identical' if d.token_ids == ref[i] else 'DIFFERS'}")
        after = prompt_tokens_by_source(dep.decode.url)
        for r in frows:
            r["flow_external_kv_tokens"] = (after.get("external_kv_transfer", 0)
                                            - before.get("external_kv_transfer", 0))
            r["flow_local_tokens"] = (after.get("local_compute", 0)
                                      - before.get("local_compute", 0))
        deadline = time.monotonic() + 12
        conn = {}
        while time.monotonic() < deadline and not conn.get("load_bytes"):
            time.sleep(1)
            conn = connector_log_stats(dep.decode.log_path, mark)
        out(f"  flow {flow}: decode counters: {after.get('external_kv_transfer', 0) - before.get('external_kv_transfer', 0)} "
            f"prompt tokens external, {frows[0]['flow_local_tokens']} computed; connector: "
            f"{conn.get('loads', 0)} loads, {conn.get('load_bytes', 0):,} bytes")
        for r in frows:
            r["flow_connector"] = conn
        rows += frows
    return rows, ref


def summarize(rows, block=32):
    ok_ident = all(r["identical"] for r in rows)
    ok_loaded = all(r["loaded"] >= (r["prompt_tokens"] - 1) // block * block for r in rows)
    dis = [r for r in rows]
    col = [r for r in rows if "colocated_ttft" in r]
    s = {"requests": len(rows), "all_identical": ok_ident, "all_loaded": ok_loaded,
         "prompt_tokens_min": min(r["prompt_tokens"] for r in rows),
         "prompt_tokens_max": max(r["prompt_tokens"] for r in rows),
         "loaded_tokens": sum(r["loaded"] for r in rows),
         "ttft_disaggregated": lat(dis, "ttft"), "itl_disaggregated": lat(dis, "itl")}
    if col:
        s["ttft_colocated"] = lat(col, "colocated_ttft")
        s["itl_colocated"] = lat(col, "colocated_itl")
    flows = {}
    for r in rows:
        flows[r["flow"]] = {"external_kv_tokens": r["flow_external_kv_tokens"],
                            "decode_local_tokens": r["flow_local_tokens"],
                            "connector": r["flow_connector"]}
    s["flows"] = flows
    return s


def phase_summary(dep, rows, prefill_log=True):
    """summarize(rows) with the GPU-path lines of decode's (and prefill's)
    log, printed."""
    s = summarize(rows)
    s["gpu_path_decode_log"] = gpu_path_lines(dep.decode.log_path)
    if prefill_log:
        s["gpu_path_prefill_log"] = gpu_path_lines(dep.prefill.log_path)
    print(json.dumps({k: v for k, v in s.items() if k != "flows"}, default=str))
    print(json.dumps(s["flows"], default=str), flush=True)
    return s


def phase_failed(res, key, what, e, dep):
    """Records and prints a phase's exception, with each server's log tail."""
    res["phases"][key] = repr(e)
    print(f"{what} failed: {e!r}\n(logs in {dep.logs})", flush=True)
    for p in dep.processes:
        print(f"--- {p.name} log tail:\n{serving.log_tail(p.log_path, 30)}")


def kill_test(dep, ps, max_tokens, out=print):
    """SIGKILL the prefill server while requests stream through the proxy."""
    url = dep.proxies["a"].url
    t0 = time.monotonic()
    results = []

    def one(i):
        t = time.monotonic()
        r = request(url, "/v1/completions", dict(body(max_tokens * 4), prompt=ps[i % len(ps)]),
                    timeout=90)
        return {"i": i, "status": r.status, "error": (str(r.error) if r.error else None),
                "tokens": len(r.token_ids), "s": time.monotonic() - t}

    with cf.ThreadPoolExecutor(8) as ex:
        futs = [ex.submit(one, i) for i in range(16)]
        time.sleep(0.3)
        dep.prefill.kill()
        killed_at = time.monotonic() - t0
        for f in futs:
            try:
                results.append(f.result(timeout=120))
            except Exception as e:  # a hang past the bound is the failure
                results.append({"status": None, "error": f"no answer: {e!r}", "s": None})
    after = []
    for i in range(3):
        t = time.monotonic()
        r = request(url, "/v1/completions", dict(body(max_tokens), prompt=ps[i]), timeout=60)
        after.append({"status": r.status, "error": str(r.error)[:300] if r.error else None,
                      "s": time.monotonic() - t})
    errors = sorted({(r["status"], (r["error"] or "")[:160]) for r in results if r["error"]})
    ended = all(r["s"] is not None and r["s"] < 100 for r in results)
    clear = all(a["status"] and a["status"] >= 400 and a["error"] and "prefill" in a["error"]
                and a["s"] < 30 for a in after)
    out(f"  prefill SIGKILLed {killed_at:.2f} s into 16 streams: "
        f"{sum(1 for r in results if r['status'] == 200 and not r['error'])} completed, "
        f"{sum(1 for r in results if r['error'])} ended with an error, all ended: {ended}; "
        f"later requests: {[(a['status'], round(a['s'], 2)) for a in after]}")
    for st, e in errors[:6]:
        out(f"    error seen: {st} {e}")
    out(f"    after the kill: {after[0]['error']}")
    try:
        pstats = proxy_stats(url)
    except Exception as e:  # noqa: BLE001
        pstats = {"error": repr(e)}
    return {"results": results, "after": after, "all_ended": ended, "clear_errors": clear,
            "decode_alive": dep.decode.alive, "proxy_stats": pstats}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--out", default=None, help="write the JSON summary here")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--quick", action="store_true", help="7 prompts instead of 14")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--phases", default="1,2,3")
    args = ap.parse_args(argv)
    phases = set(args.phases.split(","))
    t_all = time.monotonic()
    model = tiny_model.build(args.model_dir or os.path.join(args.workdir, "model"))
    ps = prompts(args.quick)
    res = {"vllm": None, "prompts": len(ps), "phases": {}}
    import vllm
    res["vllm"] = vllm.__version__
    ok = True

    def dump():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1, default=str)

    env, vargs = device_settings("cuda")
    env = dict(env, MC_LOG_LEVEL="info")
    ref = None
    if "1" in phases:
        print("phase 1: same-host GPU path on; starting metadata, prefill, decode, colocated, "
              "proxies a and b", flush=True)
        dep = Deployment(os.path.join(args.workdir, "p1"), model, connector="mooncake",
                         flows=("a", "b"), env=env, extra_vllm_args=vargs)
        t0 = time.monotonic()
        try:
            dep.start(timeout=args.start_timeout)
            print(dep.describe(), flush=True)
            res["phases"]["1_start_s"] = time.monotonic() - t0
            for u in (dep.colocated.url, dep.proxies["a"].url, dep.proxies["b"].url):
                send(u, ps[0], 4, timeout=300)  # warm-up: one-time costs (Triton JIT, ...)
            rows, ref = run_flows(dep, ps, args.max_tokens)
            s = res["phases"]["1_gpu_path_on"] = phase_summary(dep, rows)
            ok &= s["all_identical"] and s["all_loaded"]
        except Exception as e:
            ok = False
            phase_failed(res, "1_error", "phase 1", e, dep)
        finally:
            dep.stop()
        dump()
    if "2" in phases and ref is not None:
        print("phase 2: same-host GPU path off (MC_GPU_IPC=0: TCP with GPU staging)", flush=True)
        dep = Deployment(os.path.join(args.workdir, "p2"), model, connector="mooncake",
                         flows=("a", "b"), colocated=False, env=dict(env, MC_GPU_IPC="0"),
                         extra_vllm_args=vargs)
        try:
            dep.start(timeout=args.start_timeout)
            for u in (dep.proxies["a"].url, dep.proxies["b"].url):
                send(u, ps[0], 4, timeout=300)
            rows, _ = run_flows(dep, ps, args.max_tokens, reference=ref)
            s = res["phases"]["2_gpu_path_off"] = phase_summary(dep, rows, prefill_log=False)
            ok &= s["all_identical"] and s["all_loaded"]
            dump()
            if "3" in phases:
                print("phase 3: prefill SIGKILLed mid-run", flush=True)
                k = kill_test(dep, ps, args.max_tokens)
                res["phases"]["3_prefill_killed"] = k
                ok &= k["all_ended"] and k["clear_errors"]
        except Exception as e:
            ok = False
            phase_failed(res, "2_error", "phase 2/3", e, dep)
        finally:
            t = time.monotonic()
            dep.stop()
            res["phases"]["2_stop_s"] = time.monotonic() - t
    res["ok"] = ok
    res["total_s"] = time.monotonic() - t_all
    dump()
    print(f"{'OK' if ok else 'FAILED'}: GPU end-to-end in {res['total_s']:.0f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
