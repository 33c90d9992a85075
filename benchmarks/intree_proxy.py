"""A proxy of vLLM's in-tree MooncakeConnector contract that sends both legs
at once, for benchmarks/serving_bench.py's in-tree phase.

    .venv/bin/python -P benchmarks/intree_proxy.py --port P --prefill URL --decode URL \
        --bootstrap http://PREFILL_HOST:BOOTSTRAP_PORT

vllm-router 0.1.17 (`--kv-connector mooncake`) sends the decode leg only
after the prefill's answer; vLLM's own proxy for this connector
(tests/v1/kv_connector/mooncake_integration/toy_proxy_server.py; the contract
is written up in docs/compat.md, "The proxy contract") sends both at once,
the connector's design: the decode side allocates its blocks while the
prefill computes.  This is that proxy, one prefill and one decode server:

* at start-up, GET <bootstrap>/query for the prefill's engine id (dp rank 0);
* per request a transfer_id; the prefill leg (max_tokens 1, not streamed,
  do_remote_decode) and the decode leg (do_remote_prefill,
  remote_bootstrap_addr, remote_engine_id) are sent at once; the decode
  leg's answer is relayed to the client as it streams, the prefill's is
  read and dropped (a failed prefill leg is logged to stderr).
"""
import argparse
import asyncio
import json
import sys

import aiohttp
from aiohttp import web

from mooncake_connector.connector.bootstrap import intree_legs


async def _engine_id(session, bootstrap, timeout_s):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            async with session.get(f"{bootstrap}/query") as r:
                if r.status == 200:
                    return (await r.json(content_type=None))["0"]["engine_id"]
                why = f"answered {r.status}"
        except (aiohttp.ClientError, KeyError, ValueError) as e:
            why = repr(e)
        if loop.time() > deadline:
            raise RuntimeError(f"the prefill's bootstrap server {bootstrap}/query: {why}")
        await asyncio.sleep(0.5)


def make_app(prefill, decode, bootstrap, timeout_s=600.0):
    state = {}

    async def on_startup(app):
        state["session"] = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=timeout_s))
        state["engine_id"] = await _engine_id(state["session"], bootstrap, timeout_s)

    async def on_cleanup(app):
        await state["session"].close()

    async def prefill_leg(path, body, rid):
        try:
            async with state["session"].post(prefill + path, json=body, headers={
                    "X-Request-Id": rid, "X-data-parallel-rank": "0"}) as r:
                text = await r.text()
                if r.status != 200:
                    print(f"intree_proxy: prefill leg {rid} answered {r.status}: {text[:300]}",
                          file=sys.stderr, flush=True)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            print(f"intree_proxy: prefill leg {rid} failed: {e!r}", file=sys.stderr, flush=True)

    async def completions(request):
        body = await request.json()
        rid, pre, dec = intree_legs(body, bootstrap, state["engine_id"])
        task = asyncio.ensure_future(prefill_leg(request.path, pre, rid))
        try:
            async with state["session"].post(decode + request.path, json=dec,
                                             headers={"X-Request-Id": rid}) as r:
                resp = web.StreamResponse(status=r.status, headers={
                    "Content-Type": r.headers.get("Content-Type", "application/json")})
                await resp.prepare(request)
                async for chunk in r.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        finally:
            await task

    async def health(request):
        return web.json_response({"engine_id": state.get("engine_id")})

    app = web.Application()
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/health", health)
    return app


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", required=True, help="the prefill server's base URL")
    ap.add_argument("--decode", required=True, help="the decode server's base URL")
    ap.add_argument("--bootstrap", required=True,
                    help="the prefill's bootstrap server, http://HOST:PORT")
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    print(json.dumps(vars(args)), flush=True)
    web.run_app(make_app(args.prefill.rstrip("/"), args.decode.rstrip("/"),
                         args.bootstrap.rstrip("/"), args.timeout),
                host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
