"""The disaggregated-serving proxy: prefill first, then decode.

    python -m mooncake_connector.proxy --prefill http://P1:8100 [http://P2:8100 ...] \\
        --decode http://D1:8200 [...] --port 8000 [--flow a|b]

Serves POST /v1/completions and /v1/chat/completions (streaming or not),
GET /v1/models and GET /health.  Each request goes to one prefill instance
and then one decode instance, each picked round-robin.

Flow a (the seed's): the prefill instance gets the request with
max_tokens=1 (not streamed); the decode instance then gets the original
request and finds the prompt's KV by its tokens.
Flow b (vLLM's kv_transfer_params): the prefill request carries
kv_transfer_params {"do_remote_decode": true, ...}; the kv_transfer_params of
its answer are passed to the decode request.

Unlike the seed's proxy, errors reach the client: a prefill or decode answer
other than 200 is returned with its status and body, an unreachable instance
gives 502 naming it, and a client's Authorization header is passed through
(else $OPENAI_API_KEY, if set).
"""
import argparse
import asyncio
import copy
import itertools
import json
import logging
import os
import signal
import sys
import uuid

import aiohttp
from aiohttp import web

logger = logging.getLogger("mooncake_connector.proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")


def _error(status, message, kind="proxy_error"):
    return web.json_response({"error": {"message": message, "type": kind, "code": status}},
                             status=status)


class Proxy:
    def __init__(self, prefill, decode, flow="a", timeout=6 * 3600, api_key=None):
        if not prefill or not decode:
            raise ValueError("need at least one --prefill and one --decode URL")
        self.prefill = [u.rstrip("/") for u in prefill]
        self.decode = [u.rstrip("/") for u in decode]
        self.flow = flow
        self.api_key = api_key
        self._p = itertools.cycle(self.prefill)
        self._d = itertools.cycle(self.decode)
        self._timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=10)
        self.session = None
        self.counts = {"requests": 0, "prefill_errors": 0, "decode_errors": 0}

    async def start(self, app):
        self.session = aiohttp.ClientSession(timeout=self._timeout)

    async def stop(self, app):
        await self.session.close()

    def _headers(self, request, rid):
        h = {"Content-Type": "application/json", "X-Request-Id": rid}
        auth = request.headers.get("Authorization")
        if auth:
            h["Authorization"] = auth
        elif self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def _prefill_body(self, body, chat):
        p = copy.deepcopy(body)
        p["max_tokens"] = 1
        if chat and "max_completion_tokens" in p:
            p["max_completion_tokens"] = 1
        p["stream"] = False
        p.pop("stream_options", None)
        if self.flow == "b":
            p["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                       "remote_engine_id": None, "remote_block_ids": None,
                                       "remote_host": None, "remote_port": None}
        return p

    async def handle(self, request):
        self.counts["requests"] += 1
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _error(400, f"request body is not valid JSON: {e}", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object", "invalid_request_error")
        chat = request.path.endswith("/chat/completions")
        rid = request.headers.get("X-Request-Id") or f"mc-{uuid.uuid4().hex}"
        headers = self._headers(request, rid)
        pre_url, dec_url = next(self._p), next(self._d)

        # 1. prefill
        try:
            async with self.session.post(pre_url + request.path, json=self._prefill_body(
                    body, chat), headers=headers) as r:
                pre_text = await r.read()
                if r.status != 200:
                    self.counts["prefill_errors"] += 1
                    logger.warning("prefill %s answered %d for %s", pre_url, r.status, rid)
                    return web.Response(status=r.status, body=pre_text,
                                        content_type=r.content_type or "application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.counts["prefill_errors"] += 1
            return _error(502, f"prefill instance {pre_url} unreachable: {e!r}", "upstream_error")
        dec_body = body
        if self.flow == "b":
            try:
                params = json.loads(pre_text).get("kv_transfer_params")
            except (ValueError, AttributeError):
                params = None
            if params is None:
                self.counts["prefill_errors"] += 1
                return _error(502, f"prefill instance {pre_url} returned no kv_transfer_params "
                              "(is it started with --kv-transfer-config kv_role kv_producer?)",
                              "upstream_error")
            dec_body = dict(body, kv_transfer_params=params)

        # 2. decode, streamed through as it comes
        try:
            async with self.session.post(dec_url + request.path, json=dec_body,
                                         headers=headers) as r:
                if r.status != 200:
                    self.counts["decode_errors"] += 1
                    logger.warning("decode %s answered %d for %s", dec_url, r.status, rid)
                    return web.Response(status=r.status, body=await r.read(),
                                        content_type=r.content_type or "application/json")
                if not body.get("stream"):
                    return web.Response(status=200, body=await r.read(),
                                        content_type=r.content_type or "application/json")
                resp = web.StreamResponse(status=200, headers={
                    "Content-Type": r.headers.get("Content-Type", "text/event-stream"),
                    "Cache-Control": "no-cache", "X-Request-Id": rid})
                await resp.prepare(request)
                async for chunk in r.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.counts["decode_errors"] += 1
            return _error(502, f"decode instance {dec_url} unreachable: {e!r}", "upstream_error")

    async def models(self, request):
        url = self.decode[0] + "/v1/models"
        try:
            async with self.session.get(url, headers=self._headers(request, "models")) as r:
                return web.Response(status=r.status, body=await r.read(),
                                    content_type=r.content_type or "application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return _error(502, f"decode instance {self.decode[0]} unreachable: {e!r}",
                          "upstream_error")

    async def health(self, request):
        async def probe(url):
            try:
                async with self.session.get(url + "/health",
                                            timeout=aiohttp.ClientTimeout(total=3)) as r:
                    return r.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return False
        urls = self.prefill + self.decode
        ok = await asyncio.gather(*(probe(u) for u in urls))
        state = dict(zip(urls, ok))
        healthy = any(state[u] for u in self.prefill) and any(state[u] for u in self.decode)
        return web.json_response({"status": "ok" if healthy else "degraded",
                                  "instances": state, "counts": self.counts},
                                 status=200 if healthy else 503)

    def app(self):
        app = web.Application(client_max_size=64 << 20)
        for route in ROUTES:
            app.router.add_post(route, self.handle)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m mooncake_connector.proxy",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", nargs="+", required=True, metavar="URL")
    ap.add_argument("--decode", nargs="+", required=True, metavar="URL")
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--flow", choices=["a", "b"], default="a",
                    help="a: max_tokens=1 prefill then decode (the seed's); "
                         "b: kv_transfer_params relayed from prefill to decode")
    ap.add_argument("--timeout", type=float, default=6 * 3600, help="per upstream request, s")
    args = ap.parse_args(argv)
    for u in args.prefill + args.decode:
        if not u.startswith(("http://", "https://")):
            ap.error(f"{u!r} is not a URL; write http://host:port")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    proxy = Proxy(args.prefill, args.decode, args.flow, args.timeout,
                  os.environ.get("OPENAI_API_KEY"))

    async def run():
        runner = web.AppRunner(proxy.app())
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        print(f"proxy listening on http://{args.host}:{port} (flow {args.flow}; prefill "
              f"{' '.join(proxy.prefill)}; decode {' '.join(proxy.decode)})", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
