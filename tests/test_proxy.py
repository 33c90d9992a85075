"""The proxy against upstream OpenAI-style servers that record what they get.

These upstreams stand in for vLLM instances only to check the proxy's own
behaviour (routing, rewriting, streaming, errors); real vLLM servers behind
the proxy are the end-to-end issue's tests."""
import asyncio
import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from aiohttp import web


class Upstream:
    def __init__(self, name, status=200, kv_params=True):
        self.name, self.status, self.kv_params = name, status, kv_params
        self.seen = []
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        async def complete(request):
            body = await request.json()
            self.seen.append({"path": request.path, "body": body,
                              "auth": request.headers.get("Authorization"),
                              "rid": request.headers.get("X-Request-Id")})
            if self.status != 200:
                return web.json_response({"error": {"message": f"{self.name} says no"}},
                                         status=self.status)
            if body.get("stream"):
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                for i in range(3):
                    await resp.write(f"data: {json.dumps({'n': i, 'by': self.name})}\n\n".encode())
                    await asyncio.sleep(0.01)
                await resp.write(b"data: [DONE]\n\n")
                return resp
            out = {"by": self.name, "choices": [{"text": f"from {self.name}"}]}
            if self.kv_params and body.get("kv_transfer_params", {}).get("do_remote_decode"):
                out["kv_transfer_params"] = {"remote_block_ids": [1, 2], "remote_host": "p"}
            return web.json_response(out)

        async def health(request):
            return web.Response(text="ok")

        def run():
            asyncio.set_event_loop(self.loop)
            app = web.Application()
            app.router.add_post("/v1/completions", complete)
            app.router.add_post("/v1/chat/completions", complete)
            app.router.add_get("/health", health)
            async def models(request):
                return web.json_response({"data": [self.name]})

            app.router.add_get("/v1/models", models)
            self.runner = web.AppRunner(app)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            self.loop.run_until_complete(site.start())
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        started.wait(10)

    def close(self):
        async def stop():
            await self.runner.cleanup()
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def upstreams():
    made = []

    def make(*a, **kw):
        u = Upstream(*a, **kw)
        made.append(u)
        return u

    yield make
    for u in made:
        u.close()


@pytest.fixture
def proxy():
    procs = []

    def start(prefill, decode, flow="a", env=None):
        cmd = [sys.executable, "-m", "mooncake_connector.proxy", "--host", "127.0.0.1",
               "--port", "0", "--flow", flow, "--prefill", *prefill, "--decode", *decode]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env)
        procs.append(p)
        line = p.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert m, line + p.stderr.read()
        return f"http://127.0.0.1:{m.group(1)}"

    yield start
    for p in procs:
        p.terminate()
        p.wait(10)


def post(url, body, headers=None, raw=False):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            data = r.read()
            return r.status, data if raw else json.loads(data)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_flow_a_prefill_then_decode(upstreams, proxy):
    p, d = upstreams("prefill"), upstreams("decode")
    url = proxy([p.url], [d.url])
    body = {"model": "m", "prompt": "San Francisco is a", "max_tokens": 50, "stream": False}
    status, out = post(url + "/v1/completions", body, {"Authorization": "Bearer k1"})
    assert status == 200 and out["by"] == "decode"
    assert p.seen[0]["body"]["max_tokens"] == 1 and p.seen[0]["body"]["stream"] is False
    assert d.seen[0]["body"] == body  # the original request, untouched
    assert p.seen[0]["auth"] == d.seen[0]["auth"] == "Bearer k1"
    assert p.seen[0]["rid"] and p.seen[0]["rid"] == d.seen[0]["rid"]


def test_flow_b_relays_kv_transfer_params_and_chat(upstreams, proxy):
    p, d = upstreams("prefill"), upstreams("decode")
    url = proxy([p.url], [d.url], flow="b")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 20}
    status, out = post(url + "/v1/chat/completions", body)
    assert status == 200
    assert p.seen[0]["body"]["kv_transfer_params"]["do_remote_decode"] is True
    assert p.seen[0]["body"]["max_completion_tokens"] == 1
    assert d.seen[0]["body"]["kv_transfer_params"] == {"remote_block_ids": [1, 2],
                                                       "remote_host": "p"}


def test_streaming_passes_through(upstreams, proxy):
    p, d = upstreams("prefill"), upstreams("decode")
    url = proxy([p.url], [d.url])
    status, data = post(url + "/v1/completions", {"prompt": "x", "stream": True}, raw=True)
    assert status == 200
    events = [e for e in data.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and len(events) == 4
    assert p.seen[0]["body"]["stream"] is False


def test_round_robin_over_instances(upstreams, proxy):
    ps = [upstreams(f"p{i}") for i in range(2)]
    ds = [upstreams(f"d{i}") for i in range(3)]
    url = proxy([u.url for u in ps], [u.url for u in ds])
    for _ in range(6):
        assert post(url + "/v1/completions", {"prompt": "x"})[0] == 200
    assert [len(u.seen) for u in ps] == [3, 3]
    assert [len(u.seen) for u in ds] == [2, 2, 2]


def test_upstream_errors_reach_the_client(upstreams, proxy):
    p_bad, d = upstreams("prefill", status=400), upstreams("decode")
    url = proxy([p_bad.url], [d.url])
    status, out = post(url + "/v1/completions", {"prompt": "x"})
    assert status == 400 and out["error"]["message"] == "prefill says no"
    assert d.seen == []  # decode never asked
    p, d_bad = upstreams("prefill2"), upstreams("decode2", status=503)
    url = proxy([p.url], [d_bad.url])
    status, out = post(url + "/v1/completions", {"prompt": "x"})
    assert status == 503 and out["error"]["message"] == "decode2 says no"


def test_dead_instance_gives_502_naming_it(upstreams, proxy):
    d = upstreams("decode")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()
    url = proxy([dead], [d.url])
    t = time.time()
    status, out = post(url + "/v1/completions", {"prompt": "x"})
    assert status == 502 and dead in out["error"]["message"]
    assert time.time() - t < 5
    req = urllib.request.Request(url + "/health")
    try:
        urllib.request.urlopen(req, timeout=10)
        assert False, "health should report the dead prefill"
    except urllib.error.HTTPError as e:
        h = json.loads(e.read())
        assert e.code == 503 and h["instances"][dead] is False and h["instances"][d.url]


def test_bad_request_body(upstreams, proxy):
    p, d = upstreams("prefill"), upstreams("decode")
    url = proxy([p.url], [d.url])
    req = urllib.request.Request(url + "/v1/completions", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(req, timeout=10)
    assert ei.value.code == 400 and "not valid JSON" in json.loads(ei.value.read())["error"]["message"]
    assert p.seen == [] and d.seen == []


def test_bad_arguments_are_refused():
    r = subprocess.run([sys.executable, "-m", "mooncake_connector.proxy", "--prefill", "p:1",
                        "--decode", "http://d:2"], capture_output=True, text=True)
    assert r.returncode == 2 and "is not a URL" in r.stderr
