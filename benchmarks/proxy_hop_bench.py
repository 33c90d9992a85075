"""The proxy's own hop: TTFT through the proxy vs straight to the upstream.

    .venv/bin/python benchmarks/proxy_hop_bench.py [--requests 300] [--tokens 32]
        [--prompt-tokens 130]

The upstream is a stand-in (its own process, aiohttp, vLLM-shaped answers,
no model), so the numbers are the proxies' cost alone: one streamed
completions request at a time, TTFT and ITL p50/p99, direct and through

* `python -m mooncake_connector.proxy --passthrough URL --loop L` (asyncio's
  loop and uvloop);
* the proxy's first-token path (`--prefill URL --decode URL`): a
  non-streamed max_tokens=1 request whose answer carries the prompt's token
  ids (as vLLM's does), the first chunk built from it, then the streamed
  continuation;
* a minimal raw-asyncio pass-through (no aiohttp, no parsing beyond
  Content-Length and chunked framing; uvloop): what any Python proxy pays
  for the extra process and sockets on this host.
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_stats import pct  # noqa: E402

UPSTREAM = r'''
import json, sys
from aiohttp import web
N = int(sys.argv[2])
IDS = list(range(1000, 1000 + N))
async def models(request):
    return web.json_response({"data": [{"id": "m", "max_model_len": 4096}]})
async def health(request):
    return web.Response(text="ok")
async def complete(request):
    body = await request.json()
    if not body.get("stream"):  # the first-token path's prefill request
        return web.json_response({"id": "cmpl-1", "object": "text_completion", "created": 1,
            "model": "m", "choices": [{"index": 0, "text": "t0 ", "logprobs": None,
            "finish_reason": "length", "stop_reason": None, "prompt_token_ids": IDS,
            "token_ids": [7]}], "usage": {"prompt_tokens": N, "completion_tokens": 1,
            "total_tokens": N + 1}})
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

RAW_PROXY = r'''
import asyncio, sys
UP = ("127.0.0.1", int(sys.argv[2]))
def length(head):
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            return int(line[15:])
    return 0
async def handle(cr, cw):
    ur = uw = None
    try:
        while True:
            try:
                head = await cr.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            n = length(head)
            body = await cr.readexactly(n) if n else b""
            if uw is None:
                ur, uw = await asyncio.open_connection(*UP)
            uw.write(head + body)
            rhead = await ur.readuntil(b"\r\n\r\n")
            cw.write(rhead)
            if b"chunked" in rhead.lower():
                while True:
                    line = await ur.readuntil(b"\r\n")
                    k = int(line.split(b";")[0], 16)
                    cw.write(line + await ur.readexactly(k + 2))
                    if k == 0:
                        break
            else:
                cw.write(await ur.readexactly(length(rhead)))
    finally:
        cw.close()
async def main():
    srv = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]))
    async with srv:
        await srv.serve_forever()
try:
    import uvloop
    uvloop.install()
except ImportError:
    pass
asyncio.run(main())
'''




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


def run(url, n, tokens, prompt="x"):
    from mooncake_connector.openai_client import request
    body = {"model": "m", "prompt": prompt, "max_tokens": tokens, "stream": True}
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
    ap.add_argument("--prompt-tokens", type=int, default=130,
                    help="prompt length (the first-token path relays its token ids)")
    ap.add_argument("--out", default=None, help="JSON results")
    args = ap.parse_args(argv)
    from mooncake_connector.serving import free_port

    prompt = " ".join(f"w{i}" for i in range(args.prompt_tokens))
    procs = []

    def start(cmd):
        port = free_port()
        procs.append(subprocess.Popen(cmd(port), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        url = f"http://127.0.0.1:{port}"
        wait_up(url)
        return url

    try:
        upstream = start(lambda port: [sys.executable, "-c", UPSTREAM, str(port),
                                       str(args.prompt_tokens)])
        up_port = upstream.rsplit(":", 1)[1]
        proxy = [sys.executable, "-m", "mooncake_connector.proxy", "--host", "127.0.0.1"]
        urls = {"direct": upstream}
        for loop in ("asyncio", "uvloop"):
            urls[f"pass-through ({loop})"] = start(
                lambda port: proxy + ["--port", str(port), "--loop", loop,
                                      "--passthrough", upstream])
        urls["first-token path"] = start(
            lambda port: proxy + ["--port", str(port), "--prefill", upstream, "--decode",
                                  upstream])
        urls["raw asyncio pass-through"] = start(
            lambda port: [sys.executable, "-c", RAW_PROXY, str(port), up_port])
        res = {name: run(url, args.requests, args.tokens, prompt) for name, url in urls.items()}
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
    d = res["direct"]["ttft_ms_p50"]
    for name, r in res.items():
        hop = "" if name == "direct" else f"  hop p50 {r['ttft_ms_p50'] - d:5.2f} ms"
        print(f"{name:26} TTFT p50/p99 {r['ttft_ms_p50']:6.2f}/{r['ttft_ms_p99']:6.2f} ms  "
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
