"""The proxy's own hop: TTFT through the pass-through proxy vs straight to the
upstream, with asyncio's event loop and with uvloop.

    .venv/bin/python benchmarks/proxy_hop_bench.py [--requests 300] [--tokens 32]

The upstream is a stand-in (its own process, aiohttp,
vLLM-shaped SSE chunks, no model), so the numbers are the proxy's cost alone:
one streamed completions request at a time, TTFT and ITL p50/p99, direct and
through `python -m mooncake_connector.proxy --passthrough URL --loop L`.
"""
import argparse
import json
import os
import subprocess
import sys
import time

UPSTREAM = r'''
import json, sys
from aiohttp import web
async def models(request):
    return web.json_response({"data": [{"id": "m", "max_model_len": 4096}]})
async def health(request):
    return web.Response(text="ok")
async def complete(request):
    body = await request.json()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(body.get("max_tokens", 16)):
        c = {"index": 0, "text": f"t{i} ", "token_ids": [i], "finish_reason": None}
        await resp.write(b"data: " + json.dumps({"id": "x", "object": "text_completion",
                                                  "choices": [c]}).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp
app = web.Application()
app.router.add_post("/v1/completions", complete)
app.router.add_get("/v1/models", models)
app.router.add_get("/health", health)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
'''


def pct(xs, q):
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def wait_up(url, timeout=30):
    from mooncake_connector.serving import http_get
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if http_get(url + "/health", timeout=1)[0] in (200, 503):
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up in {timeout} s")


def run(url, n, tokens):
    from mooncake_connector.openai_client import request
    body = {"model": "m", "prompt": "x", "max_tokens": tokens, "stream": True}
    ttft, itl = [], []
    for i in range(n + 20):
        r = request(url, "/v1/completions", body, timeout=30)
        if r.status != 200 or r.error:
            raise RuntimeError(f"{url}: {r.status} {r.error}")
        if i >= 20:  # warm-up
            ttft.append(r.ttft_s)
            itl += r.itl_s
    return {"ttft_ms_p50": pct(ttft, 50) * 1e3, "ttft_ms_p99": pct(ttft, 99) * 1e3,
            "itl_ms_p50": pct(itl, 50) * 1e3, "itl_ms_p99": pct(itl, 99) * 1e3}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default=None, help="JSON results")
    args = ap.parse_args(argv)
    from mooncake_connector.serving import free_port

    procs = []
    try:
        up_port = free_port()
        procs.append(subprocess.Popen([sys.executable, "-c", UPSTREAM, str(up_port)]))
        upstream = f"http://127.0.0.1:{up_port}"
        wait_up(upstream)
        res = {"direct": run(upstream, args.requests, args.tokens)}
        for loop in ("asyncio", "uvloop"):
            port = free_port()
            p = subprocess.Popen([sys.executable, "-m", "mooncake_connector.proxy", "--host",
                                  "127.0.0.1", "--port", str(port), "--loop", loop,
                                  "--passthrough", upstream], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
            procs.append(p)
            wait_up(f"http://127.0.0.1:{port}")
            res[f"proxy ({loop})"] = run(f"http://127.0.0.1:{port}", args.requests,
                                         args.tokens)
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
    d = res["direct"]["ttft_ms_p50"]
    for name, r in res.items():
        hop = "" if name == "direct" else f"  hop p50 {r['ttft_ms_p50'] - d:5.2f} ms"
        print(f"{name:18} TTFT p50/p99 {r['ttft_ms_p50']:6.2f}/{r['ttft_ms_p99']:6.2f} ms  "
              f"ITL p50/p99 {r['itl_ms_p50']:5.2f}/{r['itl_ms_p99']:5.2f} ms{hop}")
    res["cpus"], res["load_avg"] = os.cpu_count(), os.getloadavg()
    print(f"({args.requests} requests each, {args.tokens} tokens, load average "
          f"{res['load_avg'][0]:.1f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
