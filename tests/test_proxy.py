"""The proxy against upstream OpenAI-style servers that record what they get.

These upstreams stand in for vLLM instances only to check the proxy's own
behaviour (routing, rewriting, streaming, errors); real vLLM servers behind
the proxy are the end-to-end issue's tests."""
import asyncio
import collections
import json
import os
import re
import socket
import subprocess
import sys
import types
import time
import urllib.error
import urllib.request

import pytest
from aiohttp import web

from app_thread import AppThread
from conftest import (closing_maker, drip_header, has_ipv6_loopback, in_threads, outward_addr,
                      recv_head, recv_to_eof, send_head_only, wait_until)

from mooncake_connector.serving import free_port


class Upstream(AppThread):
    def __init__(self, name, status=200, kv_params=True, error_body=None, hold=0.0,
                 unique_ids=False, gather=0):
        self.name, self.status, self.kv_params = name, status, kv_params
        self.error_body = error_body  # bytes: a non-200 answer that is no OpenAI error
        self.seen = []
        # As vLLM with VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1: a request
        # whose X-Request-Id is in flight already fails (there: the engine
        # dies); hold: seconds each request stays in flight.
        self.hold, self.unique_ids = hold, unique_ids
        self.in_flight, self.most_in_flight = collections.Counter(), 0
        # gather: the first requests wait (at most 10 s) until this many are
        # in flight at once, then hold; later ones only hold (an overlap
        # that no scheduling delay on a loaded host can undo)
        self.gather, self.gathered = gather, None
        # GET /health: how many came, the status answered, how long each takes
        self.health_calls, self.health_status, self.health_hold = 0, 200, 0.0

        async def complete(request):
            rid = request.headers.get("X-Request-Id")
            self.in_flight[rid] += 1
            self.most_in_flight = max(self.most_in_flight, sum(self.in_flight.values()))
            try:
                body = await request.json()
                self.seen.append({"path": request.path, "body": body,
                                  "auth": request.headers.get("Authorization"), "rid": rid})
                if self.unique_ids and self.in_flight[rid] > 1:
                    return web.json_response({"error": {"message": "duplicate request id"}},
                                             status=500)
                if self.gather:
                    if self.gathered is None:
                        self.gathered = asyncio.Event()
                    if sum(self.in_flight.values()) >= self.gather:
                        self.gathered.set()
                    try:
                        await asyncio.wait_for(self.gathered.wait(), 10)
                    except asyncio.TimeoutError:
                        pass  # the test's overlap check tells
                await asyncio.sleep(self.hold)
                return await answer(request, body)
            finally:
                self.in_flight[rid] -= 1

        async def answer(request, body):
            if self.status != 200 and self.error_body is not None:
                return web.Response(status=self.status, body=self.error_body,
                                    content_type="text/html")
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
            self.health_calls += 1
            await asyncio.sleep(self.health_hold)
            return web.Response(text="ok", status=self.health_status)

        async def models(request):
            return web.json_response({"data": [self.name]})

        super().__init__([("POST", "/v1/completions", complete),
                          ("POST", "/v1/chat/completions", complete),
                          ("GET", "/health", health), ("GET", "/v1/models", models)])


@pytest.fixture
def upstreams():
    yield from closing_maker(Upstream)


@pytest.fixture
def proxy():
    procs = []

    def start(prefill, decode, flow="a", env=None, extra=(), preexec_fn=None):
        cmd = [sys.executable, "-m", "mooncake_connector.proxy", "--host", "127.0.0.1",
               "--port", "0", *extra]
        if prefill or decode:
            cmd += ["--flow", flow, "--prefill", *prefill, "--decode", *decode]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env, preexec_fn=preexec_fn)
        procs.append(p)
        line = p.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert m, line + p.stderr.read()
        return f"http://127.0.0.1:{m.group(1)}"

    start.procs = procs  # the proxies' processes, in start order
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
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
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
    req = urllib.request.Request(url + "/v1/completions", data=b"{not json", method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(req, timeout=10)
    assert ei.value.code == 400 and "not valid JSON" in json.loads(ei.value.read())["error"]["message"]
    assert p.seen == [] and d.seen == []


def test_a_body_not_declared_json_is_a_415_as_vllm_refuses_it(upstreams, proxy):
    """vLLM's API server takes a completion only as application/json (its
    validate_json_request; 400 "Unsupported Media Type" otherwise, a
    missing header too).  The proxy took any Content-Type (a form-encoded
    or text/plain body that parsed as JSON went upstream as JSON).  Now a
    415 naming the header and the fix, the body unread and nothing sent
    upstream; application/json in any case and with parameters is taken."""
    p, d = upstreams("prefill"), upstreams("decode")
    url = proxy([p.url], [d.url])
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2}).encode()
    for ctype in ("application/x-www-form-urlencoded", "text/plain", "application/jsonx",
                  "multipart/form-data; boundary=x", None):
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        if ctype is not None:
            head += b"Content-Type: %s\r\n" % ctype.encode()
        with socket.create_connection(("127.0.0.1", port), timeout=20) as c:
            c.sendall(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
                      + body)
            data = recv_to_eof(c)
        assert data.startswith(b"HTTP/1.1 415"), (ctype, data[:300])
        msg = json.loads(data.partition(b"\r\n\r\n")[2])["error"]["message"]
        assert "Content-Type" in msg and "'Content-Type: application/json'" in msg, msg
        if ctype is not None:
            assert repr(ctype[:100]) in msg, msg
    assert p.seen == [] and d.seen == []
    for ctype in ("application/json; charset=utf-8", "Application/JSON"):
        req = urllib.request.Request(url + "/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": ctype})
        with urllib.request.urlopen(req, timeout=20) as r:
            assert r.status == 200, ctype
    assert get_stats(url)["bad_requests"] == 5


def test_expect_100_continue_is_not_answered_before_a_refusal(upstreams, proxy):
    """A client that sends "Expect: 100-continue" waits for "100 Continue"
    before sending its body.  aiohttp's default expect handler sent it
    before the proxy's handler ran, so a request the proxy then refused on
    its headers alone (413: Content-Length over its limit; 415: not JSON)
    invited the body first (seen failing: "HTTP/1.1 100 Continue" came
    first).  Now the refusal is the first and only answer; a request whose
    body the proxy reads gets "100 Continue", then its answer; another
    expectation is a 417 naming the header and the fix."""
    from mooncake_connector.proxy import MAX_BODY
    p, d = upstreams("prefill"), upstreams("decode")
    url = proxy([p.url], [d.url])
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2}).encode()

    def ask(ctype, length, expect=b"100-continue"):
        c = socket.create_connection(("127.0.0.1", port), timeout=20)
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: %s\r\n"
                  b"Content-Length: %d\r\nExpect: %s\r\n\r\n" % (ctype, length, expect))
        return c

    for ctype, length, code in ((b"application/json", MAX_BODY + 1, b"413"),
                                (b"text/plain", len(body), b"415")):
        with ask(ctype, length) as c:
            first = recv_head(c)
            assert first.startswith(b"HTTP/1.1 " + code), (ctype, first)
            assert b"100 Continue" not in recv_to_eof(c)  # closed after the answer
    with ask(b"application/json", len(body)) as c:
        first = recv_head(c)
        assert first == b"HTTP/1.1 100 Continue\r\n\r\n", first
        c.sendall(body)
        assert recv_head(c).startswith(b"HTTP/1.1 200")
    with ask(b"application/json", len(body), b"something-else") as c:
        data = recv_head(c)
        assert data.startswith(b"HTTP/1.1 417"), data
    assert len(p.seen) == 1 and len(d.seen) == 1


def test_bad_arguments_are_refused():
    r = subprocess.run([sys.executable, "-m", "mooncake_connector.proxy", "--prefill", "p:1",
                        "--decode", "http://d:2"], capture_output=True, text=True)
    assert r.returncode == 2 and "is not a URL" in r.stderr


# ---- first token from prefill, against vLLM-shaped fakes ----

def _vllm_app(u):
    async def models(request):
        return web.json_response({"data": [{"id": "m", "max_model_len": 100}]})

    async def complete(request):
        body = await request.json()
        u.seen.append({"path": request.path, "body": body,
                       "x_request_id": request.headers.get("X-Request-Id"),
                       "dp_rank": request.headers.get("X-data-parallel-rank")})
        dp = getattr(u, "dp", None)  # vLLM data parallelism: a verdict per engine
        if dp is not None and "mc_forget" in (body.get("kv_transfer_params") or {}):
            r = int(request.headers.get("X-data-parallel-rank") or 0)
            u.forgets_out = getattr(u, "forgets_out", 0) + 1  # forgets answered at once
            u.forgets_most = max(getattr(u, "forgets_most", 0), u.forgets_out)
            try:
                await asyncio.sleep(getattr(u, "forget_delay", 0))
            finally:
                u.forgets_out -= 1
            if r >= len(dp):
                return web.json_response({"error": {"message": f"data_parallel_rank {r} is "
                                                    f"out of range [0, {len(dp)})."}},
                                         status=400)
            return web.json_response({"id": "f", "choices": [{"index": 0, "text": "x"}],
                                      "kv_transfer_params": {"mc_forget": dp[r],
                                                             "mc_dp": True}})
        if u.decode_fail == "engine" and u.engine_fails > 0 and \
                "mc_forget" not in (body.get("kv_transfer_params") or {}):
            # vLLM's answer to a request its engine ended with finish reason
            # "error" before any token (kv_load_failure_policy "fail", a
            # failed KV load): 500, or a stream's error event (a chat stream
            # has its role chunk first)
            u.engine_fails -= 1
            err = {"error": {"message": "Internal server error", "type": "InternalServerError",
                             "param": None, "code": 500}}
            if not body.get("stream"):
                return web.json_response(err, status=500)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            if request.path.endswith("chat/completions"):
                await resp.write(b"data: " + json.dumps({"id": "dec", "choices": [{
                    "index": 0, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}]}).encode() + b"\n\n")
            if u.engine_shape == "0.26":
                # vLLM 0.26 skips the error output as an empty chunk: the
                # stream ends with no choice chunk (a usage-only one if asked)
                if (body.get("stream_options") or {}).get("include_usage"):
                    await resp.write(b'data: {"id": "dec", "choices": [], "usage": '
                                     b'{"prompt_tokens": 3, "completion_tokens": 0}}\n\n')
                await resp.write(b"data: [DONE]\n\n")
                return resp
            await resp.write(b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n")
            return resp
        if "messages" in body:
            prompt = list(range(1, 3 + sum(len(m["content"].split()) for m in body["messages"])))
        elif isinstance(body["prompt"], list):
            prompt = body["prompt"]
        else:
            prompt = list(range(1, 1 + len(body["prompt"].split())))
        mt = body.get("max_tokens", 16)
        start = len(prompt)
        out = [100 + start + i for i in range(mt)]
        chat = request.path.endswith("chat/completions")
        if not body.get("stream"):
            await asyncio.sleep(getattr(u, "slow", 0))
            c = {"index": 0, "finish_reason": u.finish if mt == 1 else "length",
                 "stop_reason": None, "token_ids": out}
            text = "".join(f"t{t} " for t in out)
            if mt == 1 and getattr(u, "first_text", None) is not None:
                text = u.first_text
            if chat:
                c["message"] = {"role": "assistant", "content": text}
            else:
                c["text"] = text
                c["prompt_token_ids"] = prompt
            ans = {"id": "pre-1", "created": 7, "model": "m", "choices": [c],
                   "usage": {"prompt_tokens": len(prompt), "completion_tokens": mt,
                             "total_tokens": len(prompt) + mt}}
            if chat:
                ans["prompt_token_ids"] = prompt
            if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):  # flow b
                ans["kv_transfer_params"] = {"do_remote_prefill": True, "num_tokens": 16,
                                             "remote_request_id": "cmpl-pre-1-0-ab"}
            if "mc_forget" in (body.get("kv_transfer_params") or {}):
                ans["kv_transfer_params"] = {"mc_forget": getattr(u, "forget", "unseen")}
            return web.json_response(ans)
        if u.decode_fail == "status":
            return web.json_response({"error": {"message": "decode overloaded"}}, status=503)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def write(data):
            data = data.replace(b"\n", getattr(u, "eol", b"\n"))
            if not getattr(u, "split", False):
                return await resp.write(data)
            # Each event in three pieces, one of them between its two "\n".
            for piece in (data[:len(data) // 2], data[len(data) // 2:-1], data[-1:]):
                await resp.write(piece)
                await asyncio.sleep(0.02)

        grouped = getattr(u, "partial", None) == "grouped"
        await asyncio.sleep(getattr(u, "first_delay", 0))  # the decode's first step
        for i, t in enumerate(out):
            text, ids = f"t{t} ", [t]
            if grouped and i == 1:
                continue
            if grouped and i == 0:
                # two tokens in one chunk, the second starting another
                # character: the text stops before it
                text, ids = _detok(prompt + [t]), out[:2]
            elif i == 0 and getattr(u, "partial", None) == "whole":
                # vLLM's detokenizer after a prompt that ends inside a UTF-8
                # character: the prompt's whole text, then the token's.
                text = _detok(prompt + [t])
            elif i == 0 and getattr(u, "partial", None) == "other":
                text = "something else"
            if getattr(u, "partial", None) == "never":
                text = ""  # the character never completes before the stream ends
            c = {"index": 0, "text": text, "token_ids": ids, "logprobs": None,
                 "finish_reason": "length" if i == mt - 1 else None, "stop_reason": None,
                 "prompt_token_ids": prompt if i == 0 else None}
            await write(b"data: " + json.dumps({"id": "dec", "object": "text_completion",
                                                 "created": 9, "model": "m",
                                                 "choices": [c]}).encode() + b"\n\n")
            if u.decode_fail == "drop":
                request.transport.close()
                return resp
            if u.decode_fail == "stall":
                await asyncio.sleep(4)
        if (body.get("stream_options") or {}).get("include_usage"):
            await write(b"data: " + json.dumps({"id": "dec", "choices": [], "usage": {
                "prompt_tokens": len(prompt), "completion_tokens": mt,
                "total_tokens": len(prompt) + mt}}).encode() + b"\n\n")
        await write(b"data: [DONE]\n\n")
        return resp

    async def detokenize(request):
        body = await request.json()
        u.seen.append({"path": request.path, "body": body})
        return web.json_response({"prompt": _detok(body["tokens"])})

    return models, complete, detokenize


def _detok(ids):
    """The stubs' tokenizer: tokens 102 and 104 (the first token of "a b",
    and of a chat message "a b") end inside a character."""
    return "".join(f"w{i} " for i in ids) + ("\ufffd" if ids and ids[-1] in (102, 104) else "")


@pytest.fixture
def vllm_like():
    made = []

    def make(name, **kw):
        u = types.SimpleNamespace(name=name, status=200, kv_params=False, seen=[],
                                  finish=kw.get("finish", "length"),
                                  decode_fail=kw.get("decode_fail"),
                                  engine_fails=kw.get("engine_fails", 1),  # "engine": how many
                                  engine_shape=kw.get("engine_shape", "0.32"),  # its stream
                                  slow=kw.get("slow", 0),  # s before a non-streamed answer
                                  first_text=kw.get("first_text"),  # a max_tokens=1 answer's
                                  split=kw.get("split", False),  # stream events in pieces
                                  partial=kw.get("partial"))  # first decode text: see _vllm_app
        models, complete, detokenize = _vllm_app(u)
        routes = [("POST", "/v1/completions", complete),
                  ("POST", "/v1/chat/completions", complete), ("GET", "/v1/models", models)]
        if kw.get("detokenize"):
            routes.append(("POST", "/detokenize", detokenize))
        u.app = AppThread(routes)
        u.url, u.close = u.app.url, u.app.close
        made.append(u)
        return u

    yield make
    for u in made:
        u.close()


def sse_events(data):
    out = []
    for e in data.decode().split("\n\n"):
        if e.startswith("data: "):
            out.append(e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]))
    return out


def get_stats(url):
    with urllib.request.urlopen(url + "/stats", timeout=10) as r:
        return json.loads(r.read())


def test_first_token_from_prefill_completions(vllm_like, proxy):
    p, d = vllm_like("prefill"), vllm_like("decode")
    url = proxy([p.url], [d.url])
    body = {"model": "m", "prompt": "a b c", "max_tokens": 4, "stream": True, "seed": 3,
            "temperature": 0.7, "min_tokens": 2, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    status, data = post(url + "/v1/completions", body, raw=True)
    ev = sse_events(data)
    assert status == 200 and ev[-1] == "[DONE]"
    pre, dec = p.seen[0]["body"], d.seen[0]["body"]
    assert pre["max_tokens"] == 1 and pre["return_token_ids"] and pre["min_tokens"] == 1
    # decode continues from the prefill's token (103) with the same sampling
    assert dec["prompt"] == [1, 2, 3, 103] and dec["max_tokens"] == 3 and dec["stream"]
    assert dec["seed"] == 3 and dec["temperature"] == 0.7 and dec["min_tokens"] == 1
    first = ev[0]["choices"][0]
    assert first["token_ids"] == [103] and first["prompt_token_ids"] == [1, 2, 3]
    ids = [t for e in ev[:-1] for c in e["choices"] for t in c.get("token_ids") or []]
    assert ids == [103, 104, 105, 106]
    assert all(e["id"] == "pre-1" for e in ev[:-1])  # one id for the whole answer
    assert all(c.get("prompt_token_ids") is None for e in ev[1:-1] for c in e["choices"])
    assert ev[-2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    st = get_stats(url)
    assert st["first_token_from_prefill"] == 1
    lat = st["latency_ms"]  # the proxy's own timings of the fast path
    assert lat["to_prefill_answer_ms"]["n"] == 1 and lat["to_prefill_answer_ms"]["p50"] > 0
    step = lat["prefill_answer_to_first_chunk_ms"]
    assert step["n"] == 1 and 0 < step["p50"] < lat["to_prefill_answer_ms"]["p50"] + 1000


def test_decode_events_split_across_reads_are_joined(vllm_like, proxy):
    """The decode leg's events reach the proxy in pieces (one of them
    between an event's two newlines): the client gets the same answer as
    when each event comes whole."""
    p, d = vllm_like("prefill"), vllm_like("decode", split=True)
    url = proxy([p.url], [d.url])
    for chat in (False, True):
        body = {"model": "m", "max_tokens": 5, "stream": True,
                "stream_options": {"include_usage": True}}
        body.update({"messages": [{"role": "user", "content": "a b c"}]} if chat
                    else {"prompt": "a b c"})
        status, data = post(url + ("/v1/chat/completions" if chat else "/v1/completions"), body,
                            raw=True)
        ev = sse_events(data)
        assert status == 200 and ev[-1] == "[DONE]", ev
        assert all("error" not in e for e in ev[:-1]), ev
        key = "delta" if chat else "text"
        text = "".join((c[key].get("content") or "") if chat else c[key]
                       for e in ev[:-1] for c in e["choices"])
        n = 5 if chat else 3  # prompt tokens: chat adds two
        assert text == "".join(f"t{100 + n + i} " for i in range(5)), ev
        assert ev[-2]["usage"]["completion_tokens"] == 5, ev
    assert get_stats(url)["stream_errors_after_first_token"] == 0


def test_first_token_from_prefill_chat_is_rewrapped(vllm_like, proxy):
    p, d = vllm_like("prefill"), vllm_like("decode")
    url = proxy([p.url], [d.url], flow="a")
    body = {"model": "m", "messages": [{"role": "user", "content": "x y"}],
            "max_completion_tokens": 3, "stream": True}
    status, data = post(url + "/v1/chat/completions", body, raw=True)
    ev = sse_events(data)
    assert status == 200 and d.seen[0]["path"] == "/v1/completions"
    assert d.seen[0]["body"]["prompt"] == [1, 2, 3, 4, 104] and d.seen[0]["body"]["max_tokens"] == 2
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["delta"].get("content") or "" for e in ev[:-1] for c in e["choices"])
    assert text == "t104 t105 t106 "
    assert all(e["object"] == "chat.completion.chunk" for e in ev[:-1])
    assert ev[-2]["choices"][0]["finish_reason"] == "length"


def test_prefill_finished_answer_skips_decode(vllm_like, proxy):
    p, d = vllm_like("prefill", finish="stop"), vllm_like("decode")
    url = proxy([p.url], [d.url])
    for body in ({"prompt": "a b", "max_tokens": 5, "stream": True},   # EOS/stop
                 {"prompt": "a b", "max_tokens": 1, "stream": True}):
        status, data = post(url + "/v1/completions", dict(body, model="m"), raw=True)
        ev = sse_events(data)
        assert status == 200 and ev[-1] == "[DONE]"
        assert ev[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert d.seen == [] and get_stats(url)["finished_at_prefill"] == 2
    # No decode leg: the proxy tells the prefill to release each prompt's KV
    # (a one-token request naming the leg: its X-Request-Id, the prompt's ids)
    deadline = time.monotonic() + 10
    while len(p.seen) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    rel = [x["body"] for x in p.seen if "mc_release" in (x["body"].get("kv_transfer_params")
                                                          or {})]
    assert len(rel) == 2, p.seen
    for b in rel:
        r = b["kv_transfer_params"]["mc_release"]
        assert b["max_tokens"] == 1 and len(b["prompt"]) == 1
        assert r["x_request_id"] and r["prompt_token_ids"] == [1, 2], r  # the fake's ids
    assert get_stats(url)["prefill_releases_sent"] == 2


def _forgets(u):
    return [x["body"] for x in u.seen
            if "mc_forget" in (x["body"].get("kv_transfer_params") or {})]


def _releases(u):
    return [x["body"] for x in u.seen
            if "mc_release" in (x["body"].get("kv_transfer_params") or {})]


def stream_to_the_decode_leg(url, legs):
    """A streaming client (raw socket) that reads its first token (from the
    prefill) and waits until legs() (the decode legs its decode got) grew;
    returns its socket, open (test_proxy_forget.py's clients leave later)."""
    host, port = url.rsplit("/", 1)[-1].split(":")
    raw = json.dumps({"model": "m", "prompt": "a b c", "max_tokens": 5,
                      "stream": True}).encode()
    before = legs()
    s = socket.create_connection((host, int(port)), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
              b"application/json\r\nContent-Length: %d\r\n\r\n" % len(raw) + raw)
    got, end = b"", time.monotonic() + 10
    while b"data:" not in got and time.monotonic() < end:
        got += s.recv(65536)
    assert b"data:" in got, got
    assert wait_until(lambda: legs() > before, timeout=10)
    return s


def _leave_after_the_first_token(url, decode):
    """A streaming client that reads its first token (from the prefill) and
    leaves once `decode` got the decode leg, before any of its output."""
    stream_to_the_decode_leg(
        url, lambda: sum(1 for x in decode.seen if x["body"].get("stream"))).close()


@pytest.mark.parametrize("flow", ["a", "b"])
@pytest.mark.parametrize("verdict", ["unseen", "seen"])
def test_a_decode_leg_gone_before_its_output_is_asked_about(vllm_like, proxy, flow, verdict):
    """The client leaves after its first token (from the prefill) while the
    decode leg is on its way: whether the decode's connector saw it is not
    known here, so the proxy asks that decode ("mc_forget", naming the
    leg's X-Request-Id, under an id of its own) and releases the prompt at
    the prefill only on "unseen".  A client that reads its whole answer
    (decode output came) costs no forget."""
    p, d = vllm_like("prefill"), vllm_like("decode")
    d.first_delay, d.forget = 2.0, verdict
    url = proxy([p.url], [d.url], flow=flow)
    _leave_after_the_first_token(url, d)
    assert wait_until(lambda: _forgets(d), timeout=10), d.seen
    f = _forgets(d)
    assert len(f) == 1 and f[0]["max_tokens"] == 1 and len(f[0]["prompt"]) == 1
    leg = next(x for x in d.seen if x["body"].get("stream"))
    xid = f[0]["kv_transfer_params"]["mc_forget"]["x_request_id"]
    asked = next(x for x in d.seen if "mc_forget" in (x["body"].get("kv_transfer_params") or {}))
    assert xid and xid == leg["x_request_id"] and xid not in asked["x_request_id"]
    if verdict == "unseen":
        assert wait_until(lambda: _releases(p), timeout=10), p.seen
        r = _releases(p)[0]["kv_transfer_params"]["mc_release"]
        assert r["x_request_id"] == xid and r["prompt_token_ids"] == [1, 2, 3], r
        if flow == "b":
            assert r["request_id"] == "cmpl-pre-1-0-ab", r
    else:
        time.sleep(1.0)
        assert _releases(p) == [], p.seen
    st = get_stats(url)
    assert st["decode_forgets_sent"] == 1, st
    assert st["decode_forgets_unseen"] == (verdict == "unseen"), st
    d.first_delay = 0
    status, data = post(url + "/v1/completions", {"model": "m", "prompt": "a b c",
                                                  "max_tokens": 5, "stream": True}, raw=True)
    assert status == 200 and sse_events(data)[-1] == "[DONE]"
    time.sleep(0.3)
    assert get_stats(url)["decode_forgets_sent"] == 1 and len(_forgets(d)) == 1


@pytest.mark.parametrize("dp,asked,released", [
    (["unseen", "unseen"], 3, True),   # every engine unseen; rank 2 refused: released
    (["unseen", "seen"], 3, False),    # engine 1 holds the leg: nothing released
    (["seen", "unseen"], 1, False)])
def test_a_data_parallel_decode_is_asked_engine_by_engine(vllm_like, proxy, dp, asked,
                                                          released):
    """A decode with vLLM data parallelism answers a forget for the engine
    it was sent to (X-data-parallel-rank) and says so (mc_dp): the proxy
    asks every rank (rank 0 first, then 1 and 2 at once) until one says
    "seen" or the server refuses the rank, and releases the prompt at the
    prefill only if every engine said "unseen"."""
    p, d = vllm_like("prefill"), vllm_like("decode")
    d.first_delay, d.dp = 2.0, dp
    url = proxy([p.url], [d.url], flow="a")
    _leave_after_the_first_token(url, d)
    assert wait_until(lambda: get_stats(url)["decode_forgets_sent"] >= asked, timeout=10)
    time.sleep(1.0)
    f = [x for x in d.seen if "mc_forget" in (x["body"].get("kv_transfer_params") or {})]
    assert f[0]["dp_rank"] == "0" and f[0]["body"]["kv_transfer_params"]["mc_forget"][
        "dp_rank"] == 0, f
    ranks = [int(x["dp_rank"]) for x in f]
    assert ranks == [x["body"]["kv_transfer_params"]["mc_forget"]["dp_rank"] for x in f]
    # A rank asked beside one answering "seen" may be cancelled before it is sent.
    must = range(asked if released else dp.index("seen") + 1)
    assert set(must) <= set(ranks) <= set(range(asked)) and len(ranks) == len(set(ranks)), f
    if released:  # (the unseen count comes before the release reaches the prefill)
        assert wait_until(lambda: _releases(p), timeout=10), p.seen
    assert bool(_releases(p)) == released, p.seen
    st = get_stats(url)
    assert st["decode_forgets_sent"] == asked and st["decode_forgets_unseen"] == released, st


def test_a_data_parallel_decodes_engines_are_asked_at_once(vllm_like, proxy):
    """The ranks of a data-parallel decode are asked concurrently: rank 0,
    then waves (1-2, 3-6) at once; once the proxy has counted the engines
    (rank 4 refused), the next forget asks ranks 0-4 in one wave.  Every
    engine said "unseen": released, each time."""
    p, d = vllm_like("prefill"), vllm_like("decode")
    d.first_delay, d.dp, d.forget_delay = 2.0, ["unseen"] * 4, 0.5
    url = proxy([p.url], [d.url], flow="a")
    _leave_after_the_first_token(url, d)
    assert wait_until(lambda: get_stats(url)["decode_forgets_unseen"] == 1, timeout=15)
    assert get_stats(url)["decode_forgets_sent"] == 7  # ranks 0, 1-2, 3-6
    assert d.forgets_most == 4, d.forgets_most          # ranks 3-6 at once
    d.forgets_most = 0
    _leave_after_the_first_token(url, d)
    assert wait_until(lambda: get_stats(url)["decode_forgets_unseen"] == 2, timeout=15)
    assert get_stats(url)["decode_forgets_sent"] == 7 + 5
    assert d.forgets_most == 5, d.forgets_most          # ranks 0-4 at once
    # (the unseen count comes before the release reaches the prefill)
    assert wait_until(lambda: len(_releases(p)) == 2, timeout=10), p.seen


def test_a_forgets_answer_is_read_up_to_a_cap(vllm_like, proxy):
    """A decode instance answering the forget with an endless body (not
    vLLM: a misconfigured URL, a hostile server): the proxy reads at most
    CONTROL_ANSWER_MAX of it, then drops the connection, and releases
    nothing at the prefill (no verdict)."""
    from mooncake_connector.proxy import CONTROL_ANSWER_MAX
    p = vllm_like("prefill")
    sent, stop = {"bytes": 0}, []

    async def models(request):
        return web.json_response({"data": [{"id": "m", "max_model_len": 100}]})

    async def complete(request):
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        if "mc_forget" not in (body.get("kv_transfer_params") or {}):
            for _ in range(300):  # the decode leg: no output before the client leaves
                if stop:
                    break
                await asyncio.sleep(0.1)
            return resp
        try:
            while sent["bytes"] < 256 << 20:
                await resp.write(b"x" * (1 << 20))
                sent["bytes"] += 1 << 20
        except (ConnectionError, RuntimeError):
            pass
        return resp

    d = AppThread([("POST", "/v1/completions", complete), ("GET", "/v1/models", models)])
    try:
        url = proxy([p.url], [d.url])
        _send_and_leave(url, {"model": "m", "prompt": "a b c", "max_tokens": 5,
                              "stream": True}, after_s=1.0)
        assert wait_until(lambda: get_stats(url)["decode_forgets_sent"] == 1, timeout=10)
        time.sleep(2.0)
        assert sent["bytes"] < 64 << 20, sent  # stopped near the cap (plus socket buffers)
        assert CONTROL_ANSWER_MAX < 1 << 20
        st = get_stats(url)
        assert st["decode_forgets_unseen"] == 0 and _releases(p) == [], (st, p.seen)
    finally:
        stop.append(1)
        d.close()


def test_unrepresentable_requests_and_opt_out_take_the_seeds_path(vllm_like, proxy):
    p, d = vllm_like("prefill"), vllm_like("decode")
    url = proxy([p.url], [d.url])
    for extra in ({"stop": ["x"]}, {"logprobs": 0}, {"n": 2}, {"echo": True},
                  {"presence_penalty": 0.5}, {"some_new_field": 1}):
        body = dict({"model": "m", "prompt": "a b", "max_tokens": 3, "stream": True}, **extra)
        assert post(url + "/v1/completions", body, raw=True)[0] == 200
        assert d.seen[-1]["body"] == body, extra  # the original request
    st = get_stats(url)
    assert st["first_token_from_prefill"] == 0 and sum(st["first_token_fallbacks"].values()) == 6
    off = proxy([p.url], [d.url], extra=["--first-token", "decode"])
    body = {"model": "m", "prompt": "a b", "max_tokens": 3, "stream": True}
    assert post(off + "/v1/completions", body, raw=True)[0] == 200
    assert d.seen[-1]["body"] == body and get_stats(off)["first_token_from_prefill"] == 0


def test_budgets_vllm_refuses_take_the_seeds_path(vllm_like, proxy):
    """A streamed request whose token budget vLLM refuses (max_tokens or
    max_completion_tokens below 1, min_tokens below 0 or above the budget)
    reaches the decode instance as sent, which answers its own 400.  Before,
    the fast path asked the prefill for one token and answered 200 with it
    (max_tokens 0 or -1), or sent the decode a min_tokens of 0 (min_tokens
    -3): invalid requests silently served."""
    p, d = vllm_like("prefill"), vllm_like("decode")
    url = proxy([p.url], [d.url])
    bad = [("/v1/completions", {"prompt": "a b", "max_tokens": 0}),
           ("/v1/completions", {"prompt": "a b", "max_tokens": -1}),
           ("/v1/completions", {"prompt": "a b", "max_tokens": 4, "min_tokens": -3}),
           ("/v1/completions", {"prompt": "a b", "max_tokens": 4, "min_tokens": 9}),
           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                     "max_completion_tokens": 0})]
    for path, extra in bad:
        body = dict({"model": "m", "stream": True}, **extra)
        n0 = len(d.seen)
        assert post(url + path, body, raw=True)[0] == 200  # the stand-in takes anything
        # the original request first (the stand-in's empty answer to a budget
        # of 0 reads as a failed leg, so a retake may follow it: real vLLM
        # answers these 400, never retaken)
        assert len(d.seen) > n0 and d.seen[n0]["body"] == body, extra
    st = get_stats(url)
    assert st["first_token_from_prefill"] == 0, st
    assert sum(st["first_token_fallbacks"].values()) == len(bad), st


BAD_EVENTS = [b"data: 5\n\n", b"data: [1]\n\n", b"data: null\n\n", b'data: {"choices": 5}\n\n',
              b'data: {"choices": [5]}\n\n', b'data: {"usage": 5}\n\n',
              b'data: {"usage": {"prompt_tokens": "x"}}\n\n']


@pytest.mark.parametrize("event", BAD_EVENTS, ids=[e[6:-2].decode() for e in BAD_EVENTS])
def test_decode_event_that_is_no_completion_chunk_ends_with_an_error_event(vllm_like, proxy,
                                                                           event):
    """A decode leg whose event (after the first token went out) is JSON but
    no completion chunk ends the client's stream with an error event naming
    the decode instance and the event, then [DONE].  Before, the rewrite's
    TypeError / AttributeError escaped the handler: a traceback in the
    proxy's log and the client's stream cut off without an end."""
    p = vllm_like("prefill")

    async def models(request):
        return web.json_response({"data": [{"id": "m", "max_model_len": 100}]})

    async def complete(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(event)
        return resp

    d = AppThread([("POST", "/v1/completions", complete), ("GET", "/v1/models", models)])
    try:
        url = proxy([p.url], [d.url])
        status, data = post(url + "/v1/completions", {"model": "m", "prompt": "a b",
                                                      "max_tokens": 4, "stream": True}, raw=True)
        ev = sse_events(data)
        assert status == 200 and ev[0]["choices"][0]["text"] == "t102 ", ev
        err = ev[-2]["error"]["message"]
        assert f"decode instance {d.url}" in err and "not a completion chunk" in err, err
        assert ev[-1] == "[DONE]", ev
        assert get_stats(url)["stream_errors_after_first_token"] == 1
    finally:
        d.close()


def _cpu_seconds(pid):
    """CPU time (user + system) process pid has used, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_decode_event_without_an_end_is_cut_at_the_cap(vllm_like, proxy):
    """A decode leg that, after the first token went out, sends one event
    that never ends (a data line, then no blank line: 1 MiB pieces until its
    writes fail) ends the client's stream with an error event naming the
    decode instance and the 64 MiB cap, then [DONE], in well under a
    second's work: the proxy stops reading there (closes the connection),
    so the decode side cannot write much past the cap, and the proxy's
    memory stays bounded.  Before, the proxy re-joined and re-scanned its
    whole buffer for each piece it read: seconds of its event loop's CPU to
    reach the cap (quadratic in it), every other client stalled meanwhile."""
    from mooncake_connector.proxy_first_token import MAX_EVENT
    p = vllm_like("prefill")
    piece = b"x" * (1 << 20)
    sent = {"bytes": 0, "closed": False}

    async def models(request):
        return web.json_response({"data": [{"id": "m", "max_model_len": 100}]})

    async def complete(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"index": 0, "text": "')
        try:
            while sent["bytes"] < 16 * MAX_EVENT:  # far past the cap: the proxy must stop it
                await resp.write(piece)
                sent["bytes"] += len(piece)
        except (ConnectionError, RuntimeError):
            sent["closed"] = True
        return resp

    d = AppThread([("POST", "/v1/completions", complete), ("GET", "/v1/models", models)])
    try:
        url = proxy([p.url], [d.url])
        req = urllib.request.Request(
            url + "/v1/completions", method="POST", headers={"Content-Type": "application/json"},
            data=json.dumps({"model": "m", "prompt": "a b", "max_tokens": 4,
                             "stream": True}).encode())
        pid = proxy.procs[-1].pid
        t, cpu = time.monotonic(), _cpu_seconds(pid)
        with urllib.request.urlopen(req, timeout=120) as r:
            status, data = r.status, r.read()
        took, cpu = time.monotonic() - t, _cpu_seconds(pid) - cpu
        ev = sse_events(data)
        assert status == 200 and ev[0]["choices"][0]["text"] == "t102 ", ev
        err = ev[-2]["error"]["message"]
        assert f"decode instance {d.url}" in err, err
        assert f"sent over {MAX_EVENT >> 20} MiB without an event's end" in err, err
        assert ev[-1] == "[DONE]", ev
        print(f"{took:.2f} s, {cpu:.2f} s of the proxy's CPU")
        # Were 12 to 30 s, 4.3 to 4.5 s of CPU (a loaded 2-core host); now
        # 1 to 2 s, 0.15 s of CPU there.
        assert took < 10 and cpu < 1.5, (took, cpu)
        assert wait_until(lambda: sent["closed"], 10), sent
        assert sent["bytes"] < MAX_EVENT + (32 << 20), sent  # the cap and socket buffers
        with open(f"/proc/{pid}/status") as f:
            peak = int(f.read().split("VmHWM:")[1].split()[0]) << 10
        assert peak < 6 * MAX_EVENT, peak  # ~110 MB; 1 GiB came had it read all that was sent
        assert get_stats(url)["stream_errors_after_first_token"] == 1
    finally:
        d.close()


def test_decode_models_failing_is_asked_once_not_per_request(vllm_like, proxy):
    """A decode instance whose /v1/models fails (here: 0.5 s, then a 500) is
    asked once by concurrent requests and not again for MML_RETRY_S: each
    request takes the seed's path (first token from decode) without a
    lookup of its own.  Before, every streamed request asked again, so a
    hanging /v1/models added its 10 s timeout to each of them."""
    p = vllm_like("prefill")
    u = types.SimpleNamespace(name="decode", status=200, kv_params=False, seen=[],
                              finish="length", decode_fail=None, slow=0, first_text=None)
    _, complete, _ = _vllm_app(u)
    asked = []

    async def models(request):
        asked.append(request.path)
        await asyncio.sleep(0.5)
        return web.json_response({"error": "busy"}, status=500)

    d = AppThread([("POST", "/v1/completions", complete), ("GET", "/v1/models", models)])
    try:
        url = proxy([p.url], [d.url])
        out = {}

        def one(i):
            out[i] = post(url + "/v1/completions", {"model": "m", "prompt": f"a b {i}",
                                                    "max_tokens": 3, "stream": True}, raw=True)

        in_threads(one, 4)  # at once: one lookup shared
        one(4)  # after it failed: none
        for i in range(5):
            status, data = out[i]
            assert status == 200 and sse_events(data)[-1] == "[DONE]", (i, data)
        assert len(u.seen) == 5  # every request went to the decode
        assert asked == ["/v1/models"], asked
        fb = get_stats(url)["first_token_fallbacks"]
        assert fb.get("decode instance's max_model_len unknown") == 5, fb
    finally:
        d.close()


def test_prefill_usage_that_is_no_object_takes_the_seeds_path(vllm_like, proxy):
    """A prefill answer whose usage is not an object cannot start the fast
    path (it would be copied into the client's usage chunk): the decode
    answers the original request.  Before, first_chunks' dict(usage) raised
    after the client's 200 went out: a traceback and an empty stream."""
    d = vllm_like("decode")

    async def models(request):
        return web.json_response({"data": [{"id": "m", "max_model_len": 100}]})

    async def complete(request):
        return web.json_response({"id": "x", "created": 1, "model": "m", "usage": 5,
                                  "choices": [{"index": 0, "text": "t ", "token_ids": [5],
                                               "finish_reason": "stop",
                                               "prompt_token_ids": [1, 2]}]})

    p = AppThread([("POST", "/v1/completions", complete), ("GET", "/v1/models", models)])
    try:
        url = proxy([p.url], [d.url])
        body = {"model": "m", "prompt": "a b", "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": True}}
        status, data = post(url + "/v1/completions", body, raw=True)
        assert status == 200 and sse_events(data)[-1] == "[DONE]", data
        assert d.seen[-1]["body"] == body
        assert get_stats(url)["first_token_from_prefill"] == 0
    finally:
        p.close()


@pytest.mark.parametrize("mode", ["status", "drop"])
def test_decode_failure_after_first_chunk_is_an_error_event(vllm_like, proxy, mode):
    p, d = vllm_like("prefill"), vllm_like("decode", decode_fail=mode)
    url = proxy([p.url], [d.url])
    t = time.time()
    status, data = post(url + "/v1/completions", {"model": "m", "prompt": "a b",
                                                  "max_tokens": 4, "stream": True}, raw=True)
    ev = sse_events(data)
    assert status == 200 and time.time() - t < 10
    assert ev[0]["choices"][0]["text"] == "t102 "
    err = ev[-2]["error"]["message"]
    assert f"decode instance {d.url}" in err and ev[-1] == "[DONE]", ev
    assert ("503" in err and "decode overloaded" in err) if mode == "status" else \
        "before [DONE]" in err or "failed" in err, err


def test_passthrough_mode(upstreams, proxy):
    c = upstreams("colocated")
    url = proxy([], [], extra=["--passthrough", c.url])
    status, out = post(url + "/v1/completions", {"prompt": "x", "max_tokens": 5})
    assert status == 200 and out["by"] == "colocated" and c.seen[0]["body"]["max_tokens"] == 5
    status, data = post(url + "/v1/completions", {"prompt": "x", "stream": True}, raw=True)
    assert status == 200 and data.decode().split("\n\n")[-2] == "data: [DONE]"
    r = subprocess.run([sys.executable, "-m", "mooncake_connector.proxy", "--passthrough",
                        c.url, "--prefill", c.url], capture_output=True, text=True)
    assert r.returncode == 2 and "takes no --prefill" in r.stderr


def test_stalled_decode_stream_ends_with_an_error_event(vllm_like, proxy):
    """A decode instance that stops sending mid-stream: after --idle-timeout
    the client gets an error event naming it, not a stream open forever."""
    p, d = vllm_like("prefill"), vllm_like("decode", decode_fail="stall")
    body = {"model": "m", "prompt": "a b", "max_tokens": 4, "stream": True}
    for extra in ([], ["--first-token", "decode"]):  # first token from prefill / relay
        url = proxy([p.url], [d.url], extra=["--idle-timeout", "1", *extra])
        t = time.time()
        status, data = post(url + "/v1/completions", body, raw=True)
        ev = sse_events(data)
        assert status == 200 and time.time() - t < 10, extra
        err = ev[-2]["error"]["message"]
        assert f"decode instance {d.url}" in err and "sent nothing for 1 s" in err, (extra, ev)
        assert ev[-1] == "[DONE]"


def test_idle_timeout_spares_non_streamed_answers(vllm_like, proxy):
    """A non-streamed answer sends nothing until it is complete: only
    --timeout bounds it, not --idle-timeout."""
    p, d = vllm_like("prefill", slow=2), vllm_like("decode", slow=2)
    url = proxy([p.url], [d.url], extra=["--idle-timeout", "1"])
    status, out = post(url + "/v1/completions", {"model": "m", "prompt": "a b",
                                                 "max_tokens": 3})
    assert status == 200 and out["choices"][0]["text"] == "t102 t103 t104 ", out


@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_a_request_past_timeout_names_timeout_not_idle_timeout(upstreams, proxy, where):
    """An upstream answer longer than --timeout (a careless --timeout 2 for
    long generations): the 502 names --timeout and its value.  It said
    "decode instance ... sent nothing for 300 s (the proxy's --idle-timeout)"
    after 2 s, and for the prefill "unreachable: TimeoutError()"."""
    held = Holding()
    try:
        url = proxy([held.url], [upstreams("decode").url], extra=["--timeout", "2"]) \
            if where == "prefill" else \
            proxy([upstreams("prefill").url], [held.url], extra=["--timeout", "2"])
        for stream in (False, True):
            status, ans = post(url + "/v1/completions", {"model": "m", "prompt": "x",
                                                         "max_tokens": 5, "stream": stream})
            msg = ans["error"]["message"]
            assert status == 502 and f"{where} instance {held.url}" in msg, (status, ans)
            assert "within 2 s (the proxy's --timeout" in msg and "idle" not in msg, msg
    finally:
        held.close()


def test_metrics_in_prometheus_text_format(upstreams, proxy):
    from prometheus_client.parser import text_string_to_metric_families

    p, d, d_bad = upstreams("prefill"), upstreams("decode"), upstreams("decode2", status=503)
    url = proxy([p.url], [d.url, d_bad.url])
    assert post(url + "/v1/completions", {"prompt": "x"})[0] == 200
    assert post(url + "/v1/completions", {"prompt": "x"})[0] == 503
    assert post(url + "/v1/chat/completions", {"messages": [], "stream": True}, raw=True)[0] == 200
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}  # parses, or raises
    got = {(s.labels.get("route"), s.labels.get("status")): s.value
           for s in fams["mooncake_proxy_responses"].samples}
    assert got == {("/v1/completions", "200"): 1, ("/v1/completions", "503"): 1,
                   ("/v1/chat/completions", "200"): 1}, got
    assert [s.value for s in fams["mooncake_proxy_requests"].samples
            if s.name.endswith("_total")] == [3]
    assert [s.value for s in fams["mooncake_proxy_decode_errors"].samples
            if s.name.endswith("_total")] == [1]
    counts = {s.labels["route"]: s.value for s in fams["mooncake_proxy_request_seconds"].samples
              if s.name.endswith("_count")}
    assert counts == {"/v1/completions": 2, "/v1/chat/completions": 1}
    assert [s.value for s in fams["mooncake_proxy_requests_in_flight"].samples] == [0]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_first_token_with_u_fffd_takes_the_seeds_path(vllm_like, proxy, chat):
    """Found by the soak: a first token whose text is U+FFFD appended to the
    decode prompt made vLLM's detokenizer stream the whole prompt text
    before the answer.  Such a stream goes the seed's way: decode gets the
    original request.  (A partial character's text "" is settled instead:
    the tests below.)"""
    p, d = vllm_like("prefill", first_text="\ufffd"), vllm_like("decode")
    url = proxy([p.url], [d.url])
    body = {"model": "m", "max_tokens": 4, "stream": True}
    body.update({"messages": [{"role": "user", "content": "a b"}]} if chat else {"prompt": "a b"})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, data = post(url + path, body, raw=True)
    assert status == 200 and sse_events(data)[-1] == "[DONE]"
    assert d.seen[-1]["body"] == body  # the original request, not prompt ids + first token
    st = get_stats(url)
    assert st["first_token_from_prefill"] == 0
    assert st["first_token_fallbacks"] == {"first token's text has U+FFFD": 1}


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_partial_first_token_text_settled_from_the_decode_tokenizer(vllm_like, proxy, chat):
    """The prefill's first token ends inside a UTF-8 character (text ""):
    the decode leg's first text is the prompt's whole text plus the tokens'
    (vLLM's detokenizer primed with a prompt that ends inside a character);
    the client gets only the tokens' text: decode(prompt + tokens) minus
    decode(prompt), from the decode instance's /detokenize."""
    p = vllm_like("prefill", first_text="")
    d = vllm_like("decode", partial="whole", detokenize=True)
    url = proxy([p.url], [d.url])
    body = {"model": "m", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": "a b"}]} if chat else {"prompt": "a b"})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, data = post(url + path, body, raw=True)
    ev = sse_events(data)
    assert status == 200 and ev[-1] == "[DONE]", ev
    prompt = [1, 2, 3, 4] if chat else [1, 2]
    t = 100 + len(prompt)
    dec = [s for s in d.seen if s["path"] == "/v1/completions"]
    assert len(dec) == 1 and dec[0]["body"]["prompt"] == prompt + [t]
    assert dec[0]["body"]["return_token_ids"] is True  # asked for by the proxy
    texts = [(c["delta"].get("content") if chat else c["text"]) for e in ev[:-1]
             for c in e["choices"]]
    want = ["", "", f"w{t} w{t + 1} ", f"t{t + 2} ", f"t{t + 3} "]
    assert texts == (want if chat else want[1:]), texts
    # the client did not ask for token ids: none in the chunks the decode leg gave
    assert all(c.get("token_ids") is None for e in ev[1:-1] for c in e["choices"]), ev
    assert ev[-2]["usage"]["completion_tokens"] == 4
    st = get_stats(url)
    assert st["first_token_from_prefill"] == 1 and st["first_token_partial"] == 1, st
    assert not st["first_token_fallbacks"], st


def test_partial_first_token_settled_in_a_chunk_of_two_tokens(vllm_like, proxy):
    """The decode leg's first text comes in a chunk of two tokens, the second
    starting another character: the text settled stops where the last whole
    character does (decode(prompt + tokens) of all but that token)."""
    p = vllm_like("prefill", first_text="")
    d = vllm_like("decode", partial="grouped", detokenize=True)
    url = proxy([p.url], [d.url])
    body = {"model": "m", "prompt": "a b", "max_tokens": 4, "stream": True,
            "return_token_ids": True}
    status, data = post(url + "/v1/completions", body, raw=True)
    ev = sse_events(data)
    assert status == 200 and ev[-1] == "[DONE]", ev
    got = [(c["text"], c["token_ids"]) for e in ev[:-1] for c in e["choices"]]
    assert got == [("", [102]), ("w102 w103 ", [103, 104]), ("t105 ", [105])], got
    asked = [s["body"]["tokens"] for s in d.seen if s["path"] == "/detokenize"]
    assert [1, 2, 102, 103] in asked and [1, 2, 102, 103, 104] in asked, asked
    st = get_stats(url)
    assert st["first_token_partial"] == 1 and not st["first_token_fallbacks"], st


@pytest.mark.parametrize("fail", ["status", "drop"])
def test_partial_first_token_decode_failing_ends_the_stream_with_an_error(vllm_like, proxy,
                                                                          fail):
    """The decode leg fails while the partial first token's chunk is held:
    the client gets that chunk (text "", as vLLM streams it), then the error
    event naming the decode instance, as after any first chunk."""
    p = vllm_like("prefill", first_text="")
    d = vllm_like("decode", decode_fail=fail, partial="whole", detokenize=True)
    url = proxy([p.url], [d.url])
    body = {"model": "m", "prompt": "a b", "max_tokens": 4, "stream": True}
    status, data = post(url + "/v1/completions", body, raw=True)
    ev = sse_events(data)
    assert status == 200 and ev[-1] == "[DONE]", ev
    assert ev[0]["choices"][0]["text"] == "" and ev[0]["choices"][0]["token_ids"] is None
    assert "error" in ev[-2] and d.url in ev[-2]["error"]["message"], ev
    st = get_stats(url)
    assert st["stream_errors_after_first_token"] == 1 and st["first_token_partial"] == 1, st


def test_empty_first_token_not_inside_a_character_is_relayed_as_it_comes(vllm_like, proxy):
    """A first token vLLM shows as "" that is whole (a special token it
    skips): the decode's stream is not the prompt's text, and is relayed as
    it comes after the held-back first chunk."""
    p = vllm_like("prefill", first_text="")
    d = vllm_like("decode", detokenize=True)
    url = proxy([p.url], [d.url])
    body = {"model": "m", "prompt": "a b c", "max_tokens": 3, "stream": True}
    status, data = post(url + "/v1/completions", body, raw=True)
    ev = sse_events(data)
    assert status == 200 and ev[-1] == "[DONE]", ev
    assert [c["text"] for e in ev[:-1] for c in e["choices"]] == ["", "t104 ", "t105 "]
    st = get_stats(url)
    assert st["first_token_partial"] == 1 and not st["first_token_fallbacks"], st


@pytest.mark.parametrize("partial,detokenize,why", [
    ("other", True, "partial first token: decode text is not prompt text + the tokens' text"),
    ("whole", False, "partial first token: /detokenize answered 404")])
def test_partial_first_token_not_settled_takes_the_seeds_path(vllm_like, proxy, partial,
                                                                detokenize, why):
    """The decode's first text is not prompt text + the tokens' text, or its
    /detokenize is missing: nothing has been sent to the client, so the
    request takes the seed's path (decode gets the original request),
    counted by reason."""
    p = vllm_like("prefill", first_text="")
    d = vllm_like("decode", partial=partial, detokenize=detokenize)
    url = proxy([p.url], [d.url])
    body = {"model": "m", "prompt": "a b", "max_tokens": 4, "stream": True}
    status, data = post(url + "/v1/completions", body, raw=True)
    ev = sse_events(data)
    assert status == 200 and ev[-1] == "[DONE]", ev
    dec = [s for s in d.seen if s["path"] == "/v1/completions"]
    assert len(dec) == 2 and dec[-1]["body"] == body
    assert [c["text"] for e in ev[:-1] for c in e["choices"]][0] == (
        "something else" if partial == "other" else _detok([1, 2, 102]))  # decode's own stream
    assert all(e["id"] == "dec" for e in ev[:-1])
    st = get_stats(url)
    assert st["first_token_from_prefill"] == 0 and st["first_token_partial"] == 0, st
    assert st["first_token_fallbacks"] == {why: 1}, st


def _first_chunk_s(url, body):
    """Seconds to the proxy's first SSE event, and the whole stream's events."""
    import http.client
    import urllib.parse
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    t0 = time.monotonic()
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    first = r.readline()
    took = time.monotonic() - t0
    data = first + r.read()
    conn.close()
    return took, sse_events(data)


def test_partial_first_token_released_early_once_the_decode_settled_one(vllm_like, proxy):
    """A decode instance whose tokenizer settled a partial first token once:
    the next such stream's first chunk (text "", as colocated vLLM streams
    it) goes out before the decode's first text, the text still settled;
    if the decode's text then does not match, the stream ends with an error
    (counted), never wrong text, and the instance goes back to holding (a
    mismatch there takes the seed's path again)."""
    p = vllm_like("prefill", first_text="")
    d = vllm_like("decode", partial="whole", detokenize=True)
    url = proxy([p.url], [d.url])
    body = {"model": "m", "prompt": "a b", "max_tokens": 3, "stream": True}
    d.first_delay = 1.0
    assert get_stats(url)["partial_settled_decodes"] == 0
    held_s, ev1 = _first_chunk_s(url, body)           # first on this instance: held
    assert get_stats(url)["partial_settled_decodes"] == 1   # what serving_bench warms up to
    early_s, ev2 = _first_chunk_s(url, body)          # settled one before: released early
    assert held_s >= 1.0 > 0.8 > early_s, (held_s, early_s)
    want = [c["text"] for e in ev1[:-1] for c in e["choices"]]
    assert [c["text"] for e in ev2[:-1] for c in e["choices"]] == want, (want, ev2)
    assert want[0] == "" and "a b" not in "".join(want), want   # the prompt not repeated
    d.partial, d.first_delay = "other", 0.2
    _, ev3 = _first_chunk_s(url, body)                 # released, then no match: error
    assert ev3[0]["choices"][0]["text"] == "" and "error" in ev3[-2], ev3
    assert "something else" not in json.dumps(ev3)
    st = get_stats(url)
    assert st["first_token_partial_unsettled"] == 1 and st["first_token_partial"] == 3, st
    assert st["partial_settled_decodes"] == 0, st
    _, ev4 = _first_chunk_s(url, body)                 # held again: the seed's path
    assert ev4[-1] == "[DONE]" and all(e["id"] == "dec" for e in ev4[:-1]), ev4
    st = get_stats(url)
    assert st["first_token_fallbacks"] == {
        "partial first token: decode text is not prompt text + the tokens' text": 1}, st


def test_partial_first_token_stream_that_never_completes_the_character(vllm_like, proxy):
    """A stream whose tokens all show "" (the character never completes
    before max_tokens), with usage events: nothing to settle, the stream is
    the decode's as it comes, held (first on the instance) or released early
    (after one settled) alike, no error."""
    p = vllm_like("prefill", first_text="")
    d = vllm_like("decode", partial="whole", detokenize=True)
    url = proxy([p.url], [d.url])
    body = {"model": "m", "prompt": "a b", "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    _first_chunk_s(url, body)                         # settles one: later ones released early
    d.partial = "never"
    for _ in range(2):
        _, ev = _first_chunk_s(url, body)
        assert ev[-1] == "[DONE]" and not any("error" in e for e in ev[:-1]), ev
        assert [c["text"] for e in ev[:-1] for c in e["choices"]] == ["", "", ""], ev
        assert ev[-2]["usage"]["completion_tokens"] == 3, ev
    st = get_stats(url)
    assert st["first_token_partial"] == 3 and not st["first_token_fallbacks"], st
    assert st["first_token_partial_unsettled"] == 0, st


def test_dead_prefill_fails_over_to_a_live_one(upstreams, proxy):
    """A prefill instance that refuses connections: the request goes on to
    the next one (bounded: each tried once), counted as a failover; the dead
    one is tried last for a while; in flow a the decode follows the prefill
    that answered (by index); with every prefill dead, 502 naming them."""
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    p = upstreams("p-live")
    ds = [upstreams("d0"), upstreams("d1")]
    url = proxy([dead, p.url], [d.url for d in ds], extra=("--prefill-down-s", "30"))
    for chat in (False, True):
        for _ in range(2):
            body = ({"messages": [{"role": "user", "content": "x"}]} if chat
                    else {"prompt": "x"})
            path = "/v1/chat/completions" if chat else "/v1/completions"
            status, out = post(url + path, body)
            assert status == 200 and out["by"] == "d1", out
    assert len(p.seen) == 4 and len(ds[0].seen) == 0
    st = get_stats(url)
    # Only the first request paid a connection attempt: then the dead one is tried last.
    assert st["prefill_failovers"] == 1 and st["prefill_errors"] == 1, st
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        assert "mooncake_proxy_prefill_failovers_total 1" in r.read().decode()
    # Flow b: kv_transfer_params from the live prefill reach the decode.
    url_b = proxy([dead, p.url], [ds[0].url], flow="b")
    status, out = post(url_b + "/v1/completions", {"prompt": "x"})
    assert status == 200 and ds[0].seen[-1]["body"]["kv_transfer_params"]["remote_host"] == "p"
    assert get_stats(url_b)["prefill_failovers"] == 1
    # Every prefill dead: a clear 502 naming what was tried, without delay.
    url_c = proxy([dead, dead.replace("127.0.0.1", "127.0.0.2")], [ds[0].url])
    t = time.time()
    status, out = post(url_c + "/v1/completions", {"prompt": "x"})
    assert status == 502 and "tried every prefill instance" in out["error"]["message"], out
    assert dead in out["error"]["message"] and time.time() - t < 5


class ResetOnce:
    """A prefill stand-in on a raw socket: it resets the first request's
    connection (what a kept-alive connection closed by the server meets),
    then answers each request with a small completion; resets=n: the first
    n requests' connections."""

    def __init__(self, resets=1):
        import threading
        self.resets = resets
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        import struct
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = c.recv(65536)
                if not chunk:
                    break
                data += chunk
            self.requests += 1
            if self.requests <= self.resets:
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                c.close()  # RST
                continue
            body = b'{"choices": [{"text": "p"}]}'
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                      + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
            c.close()

    def close(self):
        self.sock.close()


def test_prefill_connection_reset_is_sent_once_more(upstreams, proxy):
    """A reset prefill leg (a kept-alive connection the server dropped: the
    soak's SIGSTOPped prefill resuming closed them all) is sent once more and
    counted, instead of a 502."""
    p, d = ResetOnce(), upstreams("decode")
    try:
        url = proxy([p.url], [d.url])
        status, out = post(url + "/v1/completions", {"prompt": "x"})
        assert status == 200 and out["by"] == "decode", out
        st = get_stats(url)
        assert st["prefill_retries"] == 1 and p.requests == 2, (st, p.requests)
    finally:
        p.close()


def test_prefill_reset_twice_fails_over_to_the_next_instance(upstreams, proxy):
    """A prefill leg reset twice (two stale kept-alive connections to a
    prefill that just died: the soak's SIGKILL met it, 1 of 14,079
    requests) goes to the next prefill instance instead of a 502; the reset
    instance is marked down like an unreachable one."""
    bad, good, d = ResetOnce(resets=10**9), upstreams("prefill"), upstreams("decode")
    try:
        url = proxy([bad.url, good.url], [d.url])
        for _ in range(2):
            status, out = post(url + "/v1/completions", {"prompt": "x"})
            assert status == 200 and out["by"] == "decode", out
        st = get_stats(url)
        assert st["prefill_retries"] == 1 and st["prefill_failovers"] == 1, st
        assert bad.requests == 2, bad.requests  # marked down: the 2nd request went to good
    finally:
        bad.close()


def test_client_leaving_a_relayed_stream_is_not_a_decode_error(upstreams, proxy):
    """A client that disconnects from a stream relayed from decode (the
    seed's path) ends that request quietly: no decode error is counted and
    no error blames the decode instance (the soak's logs had one per
    client disconnect)."""
    import asyncio as aio

    class Slow(AppThread):
        def __init__(self):
            async def complete(request):
                await request.json()
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                for i in range(100):
                    await resp.write(f"data: {json.dumps({'n': i})}\n\n".encode())
                    await aio.sleep(0.02)
                await resp.write(b"data: [DONE]\n\n")
                return resp
            super().__init__([("POST", "/v1/completions", complete)])

    p, d = upstreams("prefill"), Slow()
    try:
        url = proxy([p.url], [d.url], extra=("--first-token", "decode"))
        host, port = url.rsplit("/", 1)[-1].split(":")
        for _ in range(3):
            s = socket.create_connection((host, int(port)))
            body = json.dumps({"prompt": "x", "stream": True}).encode()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: " + str(len(body)).encode()
                      + b"\r\n\r\n" + body)
            assert b"data:" in s.recv(65536) or b"data:" in s.recv(65536)
            s.close()
        time.sleep(3)  # the relay meets the closed client on its next writes
        st = get_stats(url)
        assert st["decode_errors"] == 0, st
    finally:
        d.close()


def test_decode_connection_reset_is_sent_once_more(upstreams, proxy):
    """The decode leg, reset before any answer (a SIGSTOPped decode server
    resuming closes its idle kept-alive connections: 8 502s in the 30-minute
    soak), is sent once more and counted."""
    p, d = upstreams("prefill"), ResetOnce()
    try:
        url = proxy([p.url], [d.url])
        status, out = post(url + "/v1/completions", {"prompt": "x"})
        assert status == 200 and out["choices"][0]["text"] == "p", out
        st = get_stats(url)
        assert st["decode_retries"] == 1 and d.requests == 2, (st, d.requests)
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            assert "mooncake_proxy_decode_retries_total 1" in r.read().decode()
    finally:
        d.close()


@pytest.mark.parametrize("side", ["prefill", "decode"])
@pytest.mark.parametrize("error_body", [b"", b"<html><body>404 Not Found</body></html>"],
                         ids=["empty", "html"])
def test_upstream_error_that_is_no_openai_error_gets_a_clear_message(upstreams, proxy, side,
                                                                     error_body):
    """The chaos soak's link cut sent the proxy's prefill leg to the host's
    default gateway, which answered 404 with an empty body, and the proxy
    passed that on: the client got a 404 with nothing to read.  Now such an
    answer becomes a JSON error naming the upstream, with the same status."""
    bad = upstreams(side, status=404, error_body=error_body)
    good = upstreams("prefill" if side == "decode" else "decode")
    p, d = (bad, good) if side == "prefill" else (good, bad)
    url = proxy([p.url], [d.url])
    for stream in (False, True):
        body = {"model": "m", "prompt": "x", "max_tokens": 4, "stream": stream}
        status, out = post(url + "/v1/completions", body)
        assert status == 404, (status, out)
        msg = out["error"]["message"]
        assert f"{side} {bad.url}" in msg and "answered 404" in msg, msg
        assert ("an empty body" in msg) if not error_body else ("404 Not Found" in msg), msg


def test_upstream_openai_error_passes_through(upstreams, proxy):
    p, d = upstreams("prefill", status=400), upstreams("decode")
    url = proxy([p.url], [d.url])
    status, out = post(url + "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 4})
    assert status == 400 and out == {"error": {"message": "prefill says no"}}


# Hostile and careless bodies: each must get a 400 naming what is wrong, and
# the proxy must keep serving; none reaches an instance.
_DEEP = b"[" * 100_000 + b"]" * 100_000
_NESTED_PROMPT = json.dumps({"model": "m", "prompt": json.loads("[" * 600 + "1" + "]" * 600),
                             "max_tokens": 2}).encode()
BAD_BODIES = [
    ("/v1/completions", b'{"model": "m", "prompt": ' + _DEEP + b'}', "too deep"),
    ("/v1/completions", _DEEP, "too deep"),
    ("/v1/completions", _NESTED_PROMPT, "levels deep"),
    ("/v1/chat/completions", json.dumps({"model": "m", "messages": 5, "stream": True}).encode(),
     "'messages'"),
    ("/v1/chat/completions", json.dumps({"model": "m", "messages": ["hi"]}).encode(),
     "messages[0]"),
    ("/v1/chat/completions", json.dumps({"model": "m", "messages": [{"role": 1}]}).encode(),
     "messages[0].role"),
    ("/v1/chat/completions", json.dumps({"model": "m", "messages": [
        {"role": "user", "content": 7}]}).encode(), "messages[0].content"),
    ("/v1/chat/completions", json.dumps({"model": "m", "messages": [
        {"role": "user", "content": ["x"]}], "stream": True}).encode(), "content[0]"),
    ("/v1/completions", json.dumps({"model": "m"}).encode(), "'prompt' is required"),
    ("/v1/completions", json.dumps({"model": "m", "prompt": {"a": 1}}).encode(), "'prompt'"),
    ("/v1/completions", json.dumps({"model": "m", "prompt": [1, "a"]}).encode(), "'prompt'"),
    ("/v1/completions", json.dumps({"model": "m", "prompt": "x", "max_tokens": "5"}).encode(),
     "'max_tokens'"),
    ("/v1/completions", json.dumps({"model": "m", "prompt": "x", "max_tokens": True}).encode(),
     "'max_tokens'"),
    ("/v1/completions", json.dumps({"model": "m", "prompt": "x", "stream": "yes"}).encode(),
     "'stream'"),
    ("/v1/completions", json.dumps({"model": "m", "prompt": "x", "stream": True,
                                    "stream_options": 3}).encode(), "'stream_options'"),
    ("/v1/completions", json.dumps({"model": "m", "prompt": "x",
                                    "kv_transfer_params": [1]}).encode(), "'kv_transfer_params'"),
    ("/v1/completions", b'"just a string"', "JSON object"),
    ("/v1/completions", b"\xff\xfe{}", "not valid JSON"),
    # Python's parser takes these; no JSON has them (RFC 8259), and relayed
    # they reached vLLM as a temperature or penalty of NaN / Infinity.
    ("/v1/completions", b'{"model": "m", "prompt": "x", "temperature": NaN}',
     "not valid JSON: NaN is not a JSON value"),
    ("/v1/chat/completions", b'{"model": "m", "messages": [], "top_p": -Infinity}', "-Infinity"),
    ("/v1/completions", b'{"model": "m", "prompt": "x", "logit_bias": {"5": Infinity}}',
     "Infinity"),
]


@pytest.mark.parametrize("flow", ["a", "b"])
def test_malformed_requests_get_400_naming_the_field(upstreams, proxy, flow):
    p, d = upstreams("prefill"), upstreams("decode")
    url = proxy([p.url], [d.url], flow=flow)
    for path, raw, expect in BAD_BODIES:
        req = urllib.request.Request(url + path, data=raw, method="POST",
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(req, timeout=20)
        msg = json.loads(ei.value.read())["error"]["message"]
        assert ei.value.code == 400, (path, raw[:80], ei.value.code, msg)
        assert expect in msg, (raw[:80], msg)
    assert p.seen == [] and d.seen == []
    # Still serving, and the refusals are counted.
    status, _ = post(url + "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2})
    assert status == 200
    assert get_stats(url)["bad_requests"] == len(BAD_BODIES)


# ---- hostile clients and bad command lines (the input audit) ----

FORGED = {"do_remote_prefill": True, "remote_engine_id": "203.0.113.9:13003",
          "remote_host": "203.0.113.9", "remote_port": 13003, "remote_block_ids": [0, 1]}


@pytest.mark.parametrize("flow", ["a", "b", "push", "passthrough"])
def test_client_kv_transfer_params_are_refused(upstreams, proxy, flow):
    """A client's own kv_transfer_params would reach the vLLM servers (flow a
    relayed them to the decode leg, whose connector then loaded KV from the
    host they name): refused with a 400 naming the field and the fix, in
    every flow; nothing reaches an upstream.  null and {} carry nothing and
    are not relayed."""
    p, d = upstreams("prefill"), upstreams("decode")
    if flow == "passthrough":
        url = proxy([], [], extra=["--passthrough", d.url])
    else:
        url = proxy([p.url], [d.url], flow=flow)
    for stream in (False, True):
        status, ans = post(url + "/v1/completions", {"model": "m", "prompt": "hi",
                                                     "max_tokens": 3, "stream": stream,
                                                     "kv_transfer_params": FORGED})
        assert status == 400, (status, ans)
        msg = ans["error"]["message"]
        assert "'kv_transfer_params'" in msg and "remove it" in msg and "remote_engine_id" in msg
    assert p.seen == [] and d.seen == []
    for empty in (None, {}):
        status, _ = post(url + "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 3,
                                                   "kv_transfer_params": empty})
        assert status == 200
    legs = p.seen + d.seen
    assert legs
    for leg in legs:
        kv = leg["body"].get("kv_transfer_params")
        assert kv is None or "remote_engine_id" not in kv or kv["remote_engine_id"] is None \
            or flow == "push", leg
        assert kv != {} or flow == "passthrough", leg
    if flow in ("a", "passthrough"):
        assert all("kv_transfer_params" not in leg["body"] for leg in legs)


def _post_raw(port, rid, stream):
    """POST with X-Request-Id given as raw bytes; (status line, headers, body)."""
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 3, "stream": stream}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=20) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: %d\r\nConnection: close\r\nX-Request-Id: %s\r\n\r\n"
                  % (len(body), rid) + body)
        data = recv_to_eof(c)
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    return lines[0], {k.lower(): v for k, _, v in (x.partition(": ") for x in lines[1:])}, rest


BAD_RIDS = [b"a b", b"a\tb", b"x" * 129, b"x" * 8000, "\u00e9t\u00e9".encode(), b"\xff\xfe"]


@pytest.mark.parametrize("flow", ["a", "push"])
def test_unusable_request_ids_are_replaced(upstreams, tmp_path, flow):
    """A client's X-Request-Id becomes the upstream requests' id, flow
    push's transfer id and a log key: one over 128 characters, with a space
    or tab, or not ASCII (bytes that are not UTF-8 arrive as lone
    surrogates) is replaced by a new id, logged with the reason and counted;
    the answer's X-Request-Id header carries the id used.  Before, an 8000
    character id went everywhere (its push transfer id, over 256 characters,
    was ignored by the connectors: the decode computed the prompt)."""
    p, d = upstreams("prefill"), upstreams("decode")
    err = open(tmp_path / "proxy.err", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "mooncake_connector.proxy", "--host",
                             "127.0.0.1", "--port", "0", "--flow", flow, "--prefill", p.url,
                             "--decode", d.url], stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)", proc.stdout.readline()).group(1))
        good = b"req-42_A.b:c/d=+~;e@f" + b"0" * 100  # 121 characters, kept as it is
        for rid in [good] + BAD_RIDS:
            for stream in (False, True):
                p.seen.clear()
                d.seen.clear()
                status, headers, _ = _post_raw(port, rid, stream)
                assert " 200 " in status, (rid[:20], status)
                used = headers.get("x-request-id")
                if rid == good:
                    assert used == good.decode(), (used, stream)
                else:
                    assert re.fullmatch(r"mc-[0-9a-f]{32}", used or ""), (rid[:20], used)
                # Flow push sends both legs at once and answers from decode:
                # the prefill leg may reach its upstream after the answer.
                wait_until(lambda: len(p.seen) + len(d.seen) >= 2, 10)
                legs = p.seen + d.seen
                assert len(legs) == 2 and all(leg["rid"] == used for leg in legs), legs
                if flow == "push":
                    tids = {leg["body"]["kv_transfer_params"]["transfer_id"] for leg in legs}
                    tid, = tids
                    assert tid.startswith(f"push-{used}-") and len(tid) <= 256, tid[:80]
        assert get_stats(f"http://127.0.0.1:{port}")["request_ids_replaced"] == 2 * len(BAD_RIDS)
    finally:
        proc.terminate()
        proc.wait(10)
    err.seek(0)
    log = err.read()
    assert "X-Request-Id 'a b' contains ' '; only printable ASCII" in log, log[-3000:]
    assert "is 8000 characters long; at most 128: this request's id is mc-" in log, log[-3000:]
    assert "x" * 65 not in log  # the rejected id is shown cut short
    assert "\\udcff\\udcfe" in log  # escaped, not written as they are


@pytest.mark.parametrize("flow", ["a", "b", "push"])
def test_a_request_id_in_flight_twice_reaches_vllm_unique(upstreams, proxy, flow):
    """vLLM takes a request's X-Request-Id into its own request id.  With
    VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1 (vLLM 0.32 CPU servers through
    this proxy, flow a), a second request carrying the id of one still
    running killed the prefill's engine (AssertionError: duplicate request
    id); the clients got 500s, later requests hung.  Now a client's id in
    flight already reaches the upstreams as <id>-<8 hex>, on both legs of
    that request, counted; each answer carries the client's own id; once
    the others ended (flow push: their prefill legs too) the id goes as
    it is again."""
    p = upstreams("prefill", hold=0.4, unique_ids=True, gather=4)
    d = upstreams("decode", hold=0.0 if flow == "push" else 0.4, unique_ids=True)
    url = proxy([p.url], [d.url], flow=flow)
    got = {}

    def one(i):
        req = urllib.request.Request(
            url + "/v1/completions", method="POST",
            data=json.dumps({"model": "m", "prompt": f"prompt {i}", "max_tokens": 3}).encode(),
            headers={"Content-Type": "application/json", "X-Request-Id": "one-id"})
        with urllib.request.urlopen(req, timeout=20) as r:
            got[i] = (r.status, r.headers.get("X-Request-Id"), json.loads(r.read()))

    in_threads(one, 4)
    assert p.most_in_flight >= 2, "the requests did not overlap"
    assert [got[i][:2] for i in range(4)] == [(200, "one-id")] * 4, got
    assert all(v[2]["by"] == "decode" for v in got.values()), got
    assert wait_until(lambda: not +p.in_flight and len(p.seen) == 4, 5), p.in_flight
    ids = {leg["body"]["prompt"]: leg["rid"] for leg in p.seen}
    assert {leg["body"]["prompt"]: leg["rid"] for leg in d.seen} == ids  # one id per request
    assert sorted(ids.values())[0] == "one-id" and len(set(ids.values())) == 4, ids
    assert all(re.fullmatch(r"one-id-[0-9a-f]{8}", i) for i in sorted(ids.values())[1:]), ids
    assert get_stats(url)["request_ids_suffixed"] == 3
    # The upstream's count drops before its answer is sent; the proxy holds
    # the id until it read that answer (flow push: the prefill leg ends after
    # the client's answer), so wait for the proxy itself to let it go.
    assert wait_until(lambda: get_stats(url)["request_ids_in_flight"] == 0, 5)
    p.seen.clear()
    one(4)
    assert got[4][:2] == (200, "one-id") and wait_until(lambda: len(p.seen) == 1, 5)
    assert [leg["rid"] for leg in p.seen + d.seen[4:]] == ["one-id", "one-id"]
    assert get_stats(url)["request_ids_suffixed"] == 3
    assert wait_until(lambda: not +p.in_flight, 5)


BAD_CLI = [
    (["--port", "70000"], "--port 70000 is out of range"),
    (["--port", "-1"], "--port -1 is out of range"),
    (["--decode", "http://"], "names no host"),
    (["--decode", "http://127.0.0.1:99999"], "is not a valid URL"),
    (["--decode", "http://[::1:2"], "is not a valid URL"),
    (["--decode", "http://127.0.0.1:0"], "port 0"),
    (["--decode", "http://127.0.0.1:8200/v1"], "ends with /v1"),
    (["--decode", "http://127.0.0.1:8200/?x=1"], "query"),
    # were taken: every request then went to "http://127.0.0.1:8200/%20/v1/..." (a 404)
    (["--decode", "http://127.0.0.1:8200/ "], "has a space or control character"),
    (["--decode", "http://127.0.0.1:8200/\t"], "has a space or control character"),
    (["--decode", "http://localhost:8100/"], "both --prefill and --decode"),
    (["--port", "8200", "--host", "127.0.0.1"], "this proxy's own address"),
    (["--port", "8100"], "this proxy's own address"),
    # was accepted: listened on every address, "proxy listening on http://:PORT"
    (["--host", ""], "--host '' is empty"),
    (["--host", " "], "--host ' ' is empty"),
    (["--timeout", "nan"], "--timeout nan"),
    (["--idle-timeout", "nan"], "--idle-timeout nan"),
    (["--timeout", "inf"], "--timeout inf"),  # was a 500 and an OverflowError per request
    (["--body-timeout", "0"], "--body-timeout must be a number of seconds > 0"),
    (["--body-timeout", "nan"], "--body-timeout must be a number of seconds > 0"),
    # were accepted: every push request's decode then computed its prompt
    (["--flow", "push", "--prefill-engine", "127.0.0.1:99999"], "is not host:port"),
    (["--flow", "push", "--prefill-engine", "127.0.0.1:0"], "is not host:port"),
    (["--flow", "push", "--prefill-engine", "h:\u00b2"], "is not host:port"),
    # was "is not a valid URL (Port could not be cast to integer value as ':1:8200')"
    (["--decode", "http://::1:8200"], "an IPv6 address goes in brackets: http://[::1]:8200"),
    # was accepted: every request then failed, "Cannot connect to host fe80::1%25lo:8200"
    (["--decode", "http://[fe80::1%25lo]:8200"], "bare %: http://[fe80::1%lo]:8200"),
    # was accepted: the decode legs then named an engine "::1:13003", which no engine has
    (["--flow", "push", "--prefill-engine", "::1:13003"], "--prefill-engine [::1]:13003"),
    # was accepted: a client's Authorization header then made every request a 500
    # (aiohttp refuses both), and error messages showed the password to clients
    (["--decode", "http://user:secret@127.0.0.1:8200"], "has credentials"),
]


@pytest.mark.parametrize("extra,expect", BAD_CLI, ids=[" ".join(a) for a, _ in BAD_CLI])
def test_bad_command_lines_name_the_argument(extra, expect):
    """Each is one line naming the argument and the fix, exit 2, no
    traceback; before, --port 70000 silently listened on 4464 (70000 mod
    65536), --port -1 was a socket.gaierror traceback, the bad URLs and a
    proxy pointed at itself (an endless request loop) were accepted."""
    args = {"--prefill": ["http://127.0.0.1:8100"], "--decode": ["http://127.0.0.1:8200"]}
    i = 0
    rest = []
    while i < len(extra):
        if extra[i] in args:
            args[extra[i]] = [extra[i + 1]]
        else:
            rest += extra[i:i + 2]
        i += 2
    cmd = [sys.executable, "-m", "mooncake_connector.proxy", *rest]
    for k, v in args.items():
        cmd += [k, *v]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert expect in r.stderr and "Traceback" not in r.stderr, r.stderr


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args):
    """(exit status or None if it is serving, stderr); a serving proxy is stopped."""
    p = subprocess.Popen([sys.executable, "-m", "mooncake_connector.proxy", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if "proxy listening on" in line:
        p.terminate()
        p.wait(10)
        return None, p.stderr.read()
    p.wait(10)
    return p.returncode, p.stderr.read()


def test_upstream_at_an_address_of_this_host_is_refused():
    """The proxy on a wildcard address and an upstream URL naming one of
    this host's own (non-loopback) addresses at its port: a request loop,
    started before (only loopback names were caught).  An address that is
    not this host's, or a specific --host elsewhere, still starts."""
    addr = outward_addr()
    if not addr:
        pytest.skip("this host has no non-loopback IPv4 address")
    port = _free_port()
    rc, err = _start(["--host", "0.0.0.0", "--port", str(port), "--prefill",
                      f"http://{addr}:{port}", "--decode", "http://127.0.0.1:8200"])
    assert rc == 2 and "Traceback" not in err, (rc, err)
    assert f"'http://{addr}:{port}' is this proxy's own address" in err, err
    assert f"{addr} is an address of this host" in err, err
    rc, err = _start(["--host", addr, "--port", str(port), "--prefill", "http://127.0.0.1:8100",
                      "--decode", f"http://{addr}:{port}/"])
    assert rc == 2 and "is this proxy's own address" in err, (rc, err)
    # Not loops: the proxy on loopback only; an address that is not this host's.
    assert _start(["--host", "127.0.0.1", "--port", str(port), "--prefill",
                   f"http://{addr}:{port}", "--decode", "http://127.0.0.1:8200"])[0] is None
    assert _start(["--host", "0.0.0.0", "--port", str(port), "--prefill",
                   f"http://203.0.113.7:{port}", "--decode", "http://127.0.0.1:8200"])[0] is None


def test_upstream_name_resolving_to_the_proxy_is_refused():
    """This host's name (no loopback spelling; /etc/hosts or DNS gives one
    of its addresses) at the port of a proxy on 0.0.0.0: a request loop."""
    name = socket.gethostname()
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(name, None, socket.AF_INET,
                                                         socket.SOCK_STREAM)}
    except socket.gaierror:
        addrs = set()
    here = set()
    for a in addrs:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.bind((a, 0))
                here.add(a)
            except OSError:
                pass
    if not here:
        pytest.skip(f"this host's name {name!r} resolves to no IPv4 address of this host")
    port = _free_port()
    rc, err = _start(["--host", "0.0.0.0", "--port", str(port), "--prefill",
                      "http://127.0.0.1:8100", "--decode", f"http://{name}:{port}"])
    assert rc == 2 and f"{name} resolves to " in err and "own address" in err, (rc, err, addrs)


@pytest.mark.parametrize("host", ["127.0.0.1", "no-such-host.invalid"])
def test_listen_failure_is_one_line(host):
    """A port in use or a --host that does not resolve: one line naming
    host:port and the fix, exit 1 (was a traceback ending in OSError or
    socket.gaierror, plus an 'Unclosed client session' warning)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "mooncake_connector.proxy", "--host", host,
                            "--port", str(port), "--prefill", "http://127.0.0.1:8100",
                            "--decode", "http://127.0.0.1:8200"],
                           capture_output=True, text=True, timeout=30)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert f"cannot listen on {host}:{port}" in r.stderr and "--port" in r.stderr
    assert "Traceback" not in r.stderr and "Unclosed" not in r.stderr, r.stderr


def test_slow_header_clients_are_closed(vllm_like, proxy):
    """A client that drips a request header (slow-loris) held its
    connection forever (aiohttp's keep-alive timer stops at its first
    byte): closed after --header-timeout, counted; a slow upstream answer
    and a slowly sent body (complete header first) are not cut."""
    p, d = vllm_like("prefill", slow=2.0), vllm_like("decode")
    url = proxy([p.url], [d.url], extra=("--header-timeout", "1"))
    port = int(url.rsplit(":", 1)[1])
    closed = drip_header(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    assert closed is not None and 0.8 <= closed <= 4, closed
    assert get_stats(url)["slow_header_closes"] == 1
    # A non-streamed answer that takes 2 s (the prefill leg): not cut.
    status, ans = post(url + "/v1/completions", {"model": "m", "prompt": "a b c",
                                                 "max_tokens": 2})
    assert status == 200, ans
    # A body sent over 2.5 s after a complete header: not cut.
    body = json.dumps({"model": "m", "prompt": "a b c", "max_tokens": 2}).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
    for i in range(0, len(body), len(body) // 5 + 1):
        time.sleep(0.5)
        s.sendall(body[i:i + len(body) // 5 + 1])
    s.settimeout(20)
    data = recv_to_eof(s)
    s.close()
    assert data.startswith(b"HTTP/1.1 200"), data[:200]
    assert get_stats(url)["slow_header_closes"] == 1


def test_stalled_body_is_answered_408_and_closed(vllm_like, proxy):
    """A client that sends a complete header and then stops sending its
    body (or drips it slower than one piece per --header-timeout) held its
    connection and a handler forever: the header deadline did not cover
    the body.  Now it is answered 408 naming the stall and disconnected,
    counted; the proxy keeps serving."""
    p, d = vllm_like("prefill"), vllm_like("decode")
    url = proxy([p.url], [d.url], extra=("--header-timeout", "1"))
    port = int(url.rsplit(":", 1)[1])
    for head in (b"Content-Length: 100\r\n\r\n{", b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n"):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\n" + head)
        s.settimeout(10)
        t = time.monotonic()
        data = recv_to_eof(s)
        s.close()
        assert data.startswith(b"HTTP/1.1 408"), data[:300]
        assert 0.8 <= time.monotonic() - t <= 6
        msg = json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["message"]
        assert "body stalled" in msg and "--header-timeout" in msg, msg
    assert get_stats(url)["slow_body_closes"] == 2
    assert p.seen == [] and d.seen == []
    status, _ = post(url + "/v1/completions", {"model": "m", "prompt": "a b", "max_tokens": 2})
    assert status == 200


def test_a_stalled_upload_does_not_hold_the_proxys_stop(vllm_like, proxy):
    """SIGTERM while a client has sent a header and part of its body, then
    nothing: the proxy waited for that body until --header-timeout (30 s by
    default; aiohttp's 60 s shutdown bound with a longer one) before it
    exited.  Now that connection is closed at once and the proxy exits
    cleanly; a request being answered is still waited for (the other
    connection's answer is whole)."""
    import signal
    p, d = vllm_like("prefill"), vllm_like("decode", slow=1.5)
    url = proxy([p.url], [d.url], extra=("--header-timeout", "300"))
    port = int(url.rsplit(":", 1)[1])
    stalled = socket.create_connection(("127.0.0.1", port))
    stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
    answered = {}
    threading = __import__("threading")
    th = threading.Thread(target=lambda: answered.update(r=post(
        url + "/v1/completions", {"model": "m", "prompt": "a b", "max_tokens": 2})))
    th.start()
    time.sleep(0.8)  # the second request is with the decode (1.5 s)
    proc = proxy.procs[-1]
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(20)
    finally:
        stalled.close()
    th.join(20)
    assert rc == 0 and time.monotonic() - t < 10, (rc, time.monotonic() - t)
    assert answered.get("r", (None,))[0] == 200, answered


def test_body_over_the_cap_is_answered_413_and_closed_at_once(vllm_like, proxy):
    """A request announcing a body over the proxy's 64 MiB cap
    (Content-Length) was answered 413 at once but then kept open while
    aiohttp read and dropped up to 10 s more of the body; now the
    connection closes with the answer.  Nothing reaches the upstreams and
    the proxy keeps serving."""
    p, d = vllm_like("prefill"), vllm_like("decode")
    url = proxy([p.url], [d.url])
    port = int(url.rsplit(":", 1)[1])
    data, took = send_head_only(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                      b"Content-Type: application/json\r\n"
                                      b"Content-Length: 1000000000\r\n\r\n{\"prompt")
    assert data.startswith(b"HTTP/1.1 413"), data[:300]
    msg = json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["message"]
    assert msg == f"request body is over {64 << 20} bytes, the proxy's limit", msg
    assert took < 3, took  # was 10 s
    assert get_stats(url)["bad_requests"] == 1
    assert p.seen == [] and d.seen == []
    status, _ = post(url + "/v1/completions", {"model": "m", "prompt": "a b", "max_tokens": 2})
    assert status == 200


def test_body_that_does_not_decode_is_a_400(upstreams, proxy):
    """A body that does not match its Content-Encoding (gzip that is not
    gzip) was a 500 "Server got itself in trouble" and a traceback in the
    proxy's log; now a 400 naming the encoding."""
    p, d = upstreams("prefill"), upstreams("decode")
    url = proxy([p.url], [d.url])
    req = urllib.request.Request(url + "/v1/completions", data=b'{"prompt": "x"}',
                                 method="POST", headers={"Content-Type": "application/json",
                                                         "Content-Encoding": "gzip"})
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(req, timeout=20)
    msg = json.loads(ei.value.read())["error"]["message"]
    assert ei.value.code == 400 and "content-encoding: gzip" in msg.lower(), msg
    assert p.seen == [] and d.seen == []
    assert post(url + "/v1/completions", {"model": "m", "prompt": "hi"})[0] == 200


@pytest.mark.parametrize("answer,expect", [
    (b"<html>ok</html>", "answered 200 with a body that is not a JSON object: '<html>ok</html>'"),
    (b"[1, 2]", "answered 200 with a body that is not a JSON object: '[1, 2]'"),
    (b'{"choices": []}', "returned no kv_transfer_params (is it started with"),
])
def test_flow_b_prefill_answer_without_params_names_what_came(upstreams, proxy, answer, expect):
    """Flow b needs the prefill answer's kv_transfer_params: an answer that
    is not a JSON object was reported as "returned no kv_transfer_params (is
    it started with ... kv_producer?)", a wrong lead; now it says what came."""
    async def complete(request):
        return web.Response(body=answer, content_type="application/json")

    p = AppThread([("POST", "/v1/completions", complete)])
    d = upstreams("decode")
    try:
        url = proxy([p.url], [d.url], flow="b")
        status, ans = post(url + "/v1/completions", {"model": "m", "prompt": "hi"})
        assert status == 502 and expect in ans["error"]["message"], ans
        assert p.url in ans["error"]["message"] and d.seen == []
    finally:
        p.close()


def test_unknown_path_or_method_names_what_the_proxy_serves(upstreams, proxy):
    """A wrong path (a doubled /v1, a typo) or method was aiohttp's plain
    text "404: Not Found" / "405: Method Not Allowed", naming nothing; now
    an OpenAI-style JSON error naming the routes or the allowed method."""
    p, d = upstreams("prefill"), upstreams("decode")
    url = proxy([p.url], [d.url])
    for path, method, code, expect in (
            ("/v1/v1/completions", "POST", 404, "POST /v1/completions"),
            ("/v1/complete", "GET", 404, "GET /v1/models"),
            ("/v1/completions", "GET", 405, "GET is not allowed on /v1/completions; use POST"),
            ("/v1/models", "POST", 405, "use GET")):
        req = urllib.request.Request(url + path, method=method,
                                     data=b"{}" if method == "POST" else None)
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(req, timeout=20)
        assert ei.value.code == code
        msg = json.loads(ei.value.read())["error"]["message"]
        assert expect in msg, (path, method, msg)
    assert p.seen == [] and d.seen == []


def test_fallback_counts_stay_bounded_under_random_field_names(vllm_like, proxy):
    """Each streamed request with a field the proxy does not know was
    counted under a reason naming that field: a client sending a new field
    name with every request grew /stats and /metrics (a label per name, each
    up to the body's size) without bound.  Now they share one reason; the
    log still names the field."""
    p, d = vllm_like("prefill"), vllm_like("decode")
    url = proxy([p.url], [d.url])
    for i in range(20):
        body = {"model": "m", "prompt": "a b", "max_tokens": 2, "stream": True,
                f"x{i}" * 50: 1}
        assert post(url + "/v1/completions", body, raw=True)[0] == 200
    fb = get_stats(url)["first_token_fallbacks"]
    assert fb == {"unknown field": 20}, fb
    with urllib.request.urlopen(url + "/metrics", timeout=20) as r:
        text = r.read().decode()
    assert 'reason="unknown field"} 20' in text and "x19" not in text


@pytest.mark.parametrize("extra", [["--flow", "push"], ["--flow", "b"],
                                   ["--first-token", "decode"], ["--push-layerwise", "on"],
                                   ["--push-layer-load", "off"], ["--push-layer-watch", "on"],
                                   ["--push-layer-read", "on"]])
def test_passthrough_refuses_prefill_decode_options(extra):
    """--passthrough has no prefill step: a --flow, --first-token or --push-*
    given with it was ignored without a word (a benchmark "of flow push"
    measured the colocated path)."""
    r = subprocess.run([sys.executable, "-m", "mooncake_connector.proxy", "--passthrough",
                        "http://127.0.0.1:8300", *extra], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2 and extra[0] in r.stderr and "--passthrough" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("extra", [["--push-layerwise", "on"], ["--push-layer-load", "on"],
                                   ["--flow", "b", "--push-layer-watch", "off"],
                                   ["--push-layer-read", "on"]])
def test_push_options_need_flow_push(extra):
    """--push-layerwise / --push-layer-load / --push-layer-watch only shape
    flow push's legs: with flow a or b they were ignored without a word."""
    r = subprocess.run([sys.executable, "-m", "mooncake_connector.proxy", "--prefill",
                        "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200", *extra],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--flow push" in r.stderr, r.stderr
    assert [a for a in extra if a.startswith("--push")][0] in r.stderr, r.stderr


@pytest.mark.parametrize("extra", [["--push-layer-read", "on"], ["--push-layer-watch", "on"],
                                   ["--push-layer-read", "on", "--push-layer-watch", "on"]])
def test_layer_read_or_watch_with_layer_load_off_is_refused(extra):
    """--push-layer-read on / --push-layer-watch on act inside a layer load
    only, which --push-layer-load off turns off for every request: the
    proxy started, and the read or watch never happened (not a word)."""
    r = subprocess.run([sys.executable, "-m", "mooncake_connector.proxy", "--flow", "push",
                        "--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200",
                        "--push-layer-load", "off", *extra],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "with --push-layer-load off" in r.stderr and "Traceback" not in r.stderr, r.stderr
    for flag in extra[::2]:
        assert f"{flag} on" in r.stderr, r.stderr
    # Off, or left to the server: no contradiction.
    for ok in (["--push-layer-read", "off"], ["--push-layer-watch", "server"]):
        rc, err = _start(["--host", "127.0.0.1", "--port", "0", "--flow", "push", "--prefill",
                          "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200",
                          "--push-layer-load", "off", *ok])
        assert rc is None, err


PROXY_FIELDS = [({"mc_release": {"request_id": "cmpl-x-0"}}, "'mc_release' is the proxy's own"),
                ({"mc_forget": {"x_request_id": "x"}}, "'mc_forget' is the proxy's own"),
                ({"mc_release": None}, "'mc_release' is the proxy's own"),
                ({"vllm_xargs": {"kv_transfer_params": "x"}},
                 "'vllm_xargs.kv_transfer_params' is set by the proxy")]


@pytest.mark.parametrize("flow", ["a", "push", "passthrough"])
def test_client_mc_release_mc_forget_and_xargs_params_are_refused(upstreams, proxy, flow):
    """The proxy's own mc_release / mc_forget at a request's top level were
    relayed to vLLM, which ignores fields it does not know (the client was
    told nothing); vllm_xargs {"kv_transfer_params": ...} reached the
    decode leg of flow a (vLLM reads kv_transfer_params from those extra
    args).  Each is a 400 naming the field; nothing reaches an upstream;
    other vllm_xargs still pass."""
    p, d = upstreams("prefill"), upstreams("decode")
    url = proxy([], [], extra=["--passthrough", d.url]) if flow == "passthrough" else \
        proxy([p.url], [d.url], flow=flow)
    for field, expect in PROXY_FIELDS:
        for path, body in (("/v1/completions", {"model": "m", "prompt": "hi"}),
                           ("/v1/chat/completions",
                            {"model": "m", "messages": [{"role": "user", "content": "hi"}]})):
            status, ans = post(url + path, {**body, "max_tokens": 3, **field})
            assert status == 400, (field, status, ans)
            assert expect in ans["error"]["message"] and "remove it" in ans["error"]["message"]
    assert p.seen == [] and d.seen == []
    status, _ = post(url + "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 3,
                                               "vllm_xargs": {"my_knob": 1}})
    assert status == 200
    assert any(leg["body"].get("vllm_xargs") == {"my_knob": 1} for leg in d.seen), d.seen


@pytest.mark.parametrize("key", ["sk-abc\r", "sk-abc\ndef", "sk-\x1b[0m"])
def test_api_key_with_a_control_character_is_refused_at_start(key):
    """$OPENAI_API_KEY with a control character (a key file with Windows
    line ends read by $(cat ...) keeps its \\r) was accepted, and every
    request was then a 500 with a ValueError traceback (aiohttp refuses the
    header); now the proxy does not start and says why."""
    import os
    env = dict(os.environ, OPENAI_API_KEY=key)
    r = subprocess.run([sys.executable, "-m", "mooncake_connector.proxy", "--prefill",
                        "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200"],
                       capture_output=True, text=True, timeout=30, env=env)
    assert r.returncode == 2 and "OPENAI_API_KEY" in r.stderr and "control character" in \
        r.stderr, r.stderr
    assert key not in r.stderr  # the key itself is not shown


class Holding(AppThread):
    """An upstream whose answers take long (a long generation): each request
    is held until its client (the proxy) closes the connection, or 30 s.
    .left: the paths of requests whose client left; .requests: how many came."""

    def __init__(self, hold_s=30.0):
        import asyncio as aio
        self.requests, self.left, self.closing = 0, [], False

        async def complete(request):
            body = await request.json()
            self.requests += 1
            end = time.monotonic() + hold_s
            while time.monotonic() < end and not self.closing:
                if request.transport is None or request.transport.is_closing():
                    self.left.append(request.path)
                    return web.Response(status=499)
                await aio.sleep(0.05)
            out = {"choices": [{"text": "late"}]}
            if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
                out["kv_transfer_params"] = {"remote_block_ids": [1]}
            return web.json_response(out)

        super().__init__([("POST", "/v1/completions", complete),
                          ("POST", "/v1/chat/completions", complete),
                          ("GET", "/v1/models", self._models)])

    async def _models(self, request):
        return web.json_response({"data": [{"max_model_len": 100}]})

    def close(self):
        self.closing = True
        super().close()


def _send_and_leave(url, body, after_s=0.5, path="/v1/completions"):
    """A client that sends body and disconnects after_s seconds later,
    before any answer came."""
    host, port = url.rsplit("/", 1)[-1].split(":")
    raw = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % (path.encode(), len(raw)) + raw)
        time.sleep(after_s)


@pytest.mark.parametrize("where", ["decode", "prefill", "push", "passthrough"])
def test_a_client_that_leaves_ends_its_upstream_requests(upstreams, proxy, where):
    """A client that disconnects before its answer (a client timeout, a
    user's Ctrl-C, a retry) ends the upstream requests it started: the
    proxy closes their connections, which vLLM takes as an abort (its own
    API server does so for a client that leaves).  The proxy used to wait
    for the whole answer of a request nobody would read: a client sending
    long generations and leaving at once kept the servers busy with them.
    Counted as 499 in /metrics; the proxy serves on."""
    held, held2 = Holding(), Holding()
    try:
        if where == "decode":
            url = proxy([upstreams("prefill").url], [held.url])
        elif where == "prefill":
            url = proxy([held.url], [upstreams("decode").url])
        elif where == "push":  # both legs held: both end
            url = proxy([held.url], [held2.url], flow="push")
        else:
            url = proxy([], [], extra=["--passthrough", held.url])
        for stream in (False, True):
            before = len(held.left) + len(held2.left)
            _send_and_leave(url, {"prompt": "x", "max_tokens": 50, "stream": stream})
            want = 2 if where == "push" else 1
            assert wait_until(lambda: len(held.left) + len(held2.left) >= before + want,
                              timeout=10), (where, stream, held.requests, held.left, held2.left)
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'mooncake_proxy_responses_total{route="/v1/completions",status="499"} 2' in text
        assert get_stats(url)["decode_errors"] == 0
    finally:
        held.close()
        held2.close()


MALFORMED_HTTP = [
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-A: a\x01b\r\n\r\n", "Invalid header value"),
    (b"GET /health HTTP/1.1\r\nX-A: " + b"a" * 9000 + b"\r\n\r\n", "8190 bytes"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
     "Content-Length"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", "Transfer-Encoding"),
]


def test_malformed_http_is_one_log_line_not_a_traceback(upstreams, proxy):
    """A request aiohttp's parser refuses (a control character in a header,
    an 8 KiB header line, a bad Content-Length, Content-Length with
    chunked) is answered 400 and closed; the proxy's log got aiohttp's
    ERROR with a 10-line traceback for each (a client sending them at will
    filled the log 10 lines a request).  Now one WARNING line naming what
    was wrong, and the proxy serves on."""
    p, d = upstreams("prefill"), upstreams("decode")
    url = proxy([p.url], [d.url])
    port = int(url.rsplit(":", 1)[1])
    for raw, _ in MALFORMED_HTTP:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(raw)
            assert recv_to_eof(s).startswith(b"HTTP/1.0 400") or True
    assert post(url + "/v1/completions", {"prompt": "x"})[0] == 200
    proc = proxy.procs[-1]
    proc.terminate()
    _, err = proc.communicate(timeout=10)
    assert "Traceback" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if "malformed HTTP request" in ln]
    assert len(lines) == len(MALFORMED_HTTP), err[-3000:]
    for (_, why), line in zip(MALFORMED_HTTP, lines):
        assert why in line and "127.0.0.1" in line, line


def test_request_bodies_in_flight_are_bounded(upstreams, proxy):
    """Each request's body is capped (64 MiB) but not how many are held at
    once, and a parsed request with its legs takes up to ~9x its body (one
    60 MiB prompt of token ids: 550 MiB of the proxy's memory): a few
    clients sending large bodies at once could take all of it.  Bodies
    held by requests in flight are now within --body-budget-mb: one that
    would pass it, announced (Content-Length) or chunked, is answered 503
    naming the option, counted; the budget comes back when the request
    ends."""
    import threading
    p, d = upstreams("prefill", hold=3.0), upstreams("decode")
    url = proxy([p.url], [d.url], extra=("--body-budget-mb", "1"))
    port = int(url.rsplit(":", 1)[1])
    big = {"model": "m", "prompt": "x " * 300000, "max_tokens": 2}  # ~600 KB
    first = []
    t = threading.Thread(target=lambda: first.append(post(url + "/v1/completions", big)))
    t.start()
    try:
        assert wait_until(lambda: sum(p.in_flight.values()) >= 1, timeout=10)
        raw = json.dumps(big).encode()
        # Announced: refused on its Content-Length, before a byte of it is read
        # (a client still sending it may see a reset: only the head is sent).
        data, _ = send_head_only(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                 b"Content-Type: application/json\r\nContent-Length: %d\r\n"
                                 b"\r\n" % len(raw) + raw[:1000])
        assert data.split(b"\r\n", 1)[0].endswith(b" 503 Service Unavailable"), data[:300]
        ans = json.loads(data.partition(b"\r\n\r\n")[2])
        assert "--body-budget-mb" in ans["error"]["message"], ans
        with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
            try:
                for i in range(0, len(raw), 65536):
                    piece = raw[i:i + 65536]
                    s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                s.sendall(b"0\r\n\r\n")
            except OSError:
                pass  # refused and closed mid-body
            data = b""
            try:  # what came before the end or a reset (the rest of the body unread)
                while True:
                    piece = s.recv(65536)
                    if not piece:
                        break
                    data += piece
            except ConnectionResetError:
                pass
        assert data.split(b"\r\n", 1)[0].endswith(b" 503 Service Unavailable"), data[:300]
        assert b"--body-budget-mb" in data
    finally:
        t.join(30)
    assert first and first[0][0] == 200, first
    st = get_stats(url)
    assert st["body_budget_refusals"] == 2 and st["body_bytes_in_flight"] == 0, st
    assert post(url + "/v1/completions", big)[0] == 200  # the budget came back
    assert len(p.seen) == 2


def _trickle(port, head, pieces, every_s, timeout=20.0):
    """Sends head, then each of pieces every every_s seconds, reading the
    while: (the answer's bytes, seconds from the head until the server
    closed), or (bytes so far, None) if it had not closed after timeout."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(head)
        t0 = time.monotonic()
        data, k = b"", 0
        s.settimeout(every_s)
        while time.monotonic() - t0 < timeout:
            try:
                piece = s.recv(65536)
                if not piece:
                    return data, time.monotonic() - t0
                data += piece
            except socket.timeout:
                try:
                    s.sendall(pieces[k % len(pieces)])
                except OSError:
                    pass
                k += 1
            except ConnectionResetError:
                return data, time.monotonic() - t0
    return data, None


def test_trickled_body_is_cut_at_the_body_deadline(vllm_like, proxy):
    """A client sending its body a few bytes at a time, each piece inside
    --header-timeout (chunked, or short of its Content-Length), held its
    connection and its share of --body-budget-mb for as long as it went on:
    the stall deadline restarts with every piece.  Now the whole body must
    arrive within --body-timeout: answered 408 naming the option, closed,
    counted; the proxy keeps serving, and a body sent over less than that
    is not cut."""
    p, d = vllm_like("prefill"), vllm_like("decode")
    url = proxy([p.url], [d.url], extra=("--header-timeout", "1", "--body-timeout", "2.5"))
    port = int(url.rsplit(":", 1)[1])
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\n")
    for rest, pieces in ((b"Transfer-Encoding: chunked\r\n\r\n", [b"1\r\n \r\n"]),
                         (b"Content-Length: 100000\r\n\r\n{", [b" "])):
        data, took = _trickle(port, head + rest, pieces, 0.4)
        assert took is not None, "still connected after 20 s: " + repr(data[:300])
        assert 2.0 <= took <= 7, took
        assert data.startswith(b"HTTP/1.1 408"), data[:300]
        msg = json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["message"]
        assert "within 2.5 s" in msg and "--body-timeout" in msg, msg
    st = get_stats(url)
    assert st["slow_body_closes"] == 2 and st["body_bytes_in_flight"] == 0, st
    assert p.seen == [] and d.seen == []
    # A body sent over ~1.5 s (inside both deadlines): served.
    body = json.dumps({"model": "m", "prompt": "a b c", "max_tokens": 2}).encode()
    n = len(body) // 4 + 1
    data, took = _trickle(port, head + b"Connection: close\r\nContent-Length: %d\r\n\r\n"
                          % len(body), [body[i:i + n] for i in range(0, len(body), n)], 0.4)
    assert data.startswith(b"HTTP/1.1 200"), data[:300]


def test_health_probes_are_shared_and_cached(upstreams, proxy):
    """GET /health probed every upstream's /health on every call: a client
    calling it in a loop (or many at once) passed that load on to the vLLM
    servers.  Now calls at once share one probe, and a probe's result
    answers the calls of the next second (Proxy.HEALTH_CACHE_S); a change
    of state shows after at most that."""
    p, d = upstreams("prefill"), upstreams("decode")
    p.health_hold = d.health_hold = 0.3
    url = proxy([p.url], [d.url])
    codes = []

    def get(_):
        try:
            with urllib.request.urlopen(url + "/health", timeout=20) as r:
                codes.append(r.status)
        except urllib.error.HTTPError as e:
            codes.append(e.code)

    t0 = time.monotonic()
    in_threads(get, 20)
    assert codes == [200] * 20, codes
    # one probe (two if the host was slow enough to spread the calls over
    # more than a second); was 20 each
    assert p.health_calls == d.health_calls <= 2, (p.health_calls, d.health_calls)
    n = p.health_calls
    get(0)
    if time.monotonic() - t0 < 0.9:  # within a second of that probe: its answer
        assert (p.health_calls, d.health_calls) == (n, n)
    time.sleep(1.2)
    d.health_status = 500  # the decode goes down: seen within a second
    t = time.monotonic()
    while True:
        get(0)
        if codes[-1] == 503:
            break
        assert time.monotonic() - t < 2.0, "the decode's failure was hidden for 2 s"
        time.sleep(0.05)
    assert d.health_calls <= n + 2, d.health_calls


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_open_file_limit_is_raised_and_clients_past_it_get_a_clear_503(upstreams, proxy, loop):
    """The proxy ran with the shell's soft open-file limit (often 1024):
    many clients made accept() fail with EMFILE (asyncio: a traceback per
    pending connection every second; uvloop: connections dropped without a
    word) and upstream connects fail as "prefill unreachable".  Now the soft
    limit is raised to the hard one at start (logged once), connections past
    what it leaves room for are answered 503 naming the limit (logged once
    per 10 s, counted), a request whose upstream connect finds no file
    descriptor is a 503 saying so (the prefill is not marked down), and the
    proxy serves again once connections close."""
    import resource
    p, d = upstreams("prefill", hold=1.0), upstreams("decode")

    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (40, 80))

    url = proxy([p.url], [d.url], preexec_fn=low_limit, extra=("--loop", loop))
    port = int(url.rsplit(":", 1)[1])
    held = []
    try:
        refused = []
        # 90 clients one after the other: one past the limit is answered 503
        # at once, the others are accepted and wait for a request (held).
        # Each gets 0.05 s to be answered, then one wait for all the held
        # ones (until none said a word for 0.3 s: a late 503 is a refusal
        # too); was 0.3 s per client, ~12 s of each variant.  Not all at
        # once: 90 accepts in one burst are past the 80 files (EMFILE at
        # accept, asyncio's pause), not the limit this test is about.
        import selectors
        for _ in range(90):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.settimeout(0.05)
            try:
                data = s.recv(65536)
            except socket.timeout:
                held.append(s)
                continue
            s.close()
            refused.append(data)
        with selectors.DefaultSelector() as sel:
            for s in held:
                sel.register(s, selectors.EVENT_READ)
            while True:
                ready = sel.select(timeout=0.3)
                if not ready:
                    break
                for key, _ in ready:
                    s = key.fileobj
                    sel.unregister(s)
                    s.settimeout(5)
                    refused.append(s.recv(65536))
                    held.remove(s)
                    s.close()
        assert refused and len(held) < 80, (len(held), len(refused))
        assert all(r.startswith(b"HTTP/1.1 503") for r in refused), refused[:3]
        msg = json.loads(refused[0].split(b"\r\n\r\n", 1)[1])["error"]["message"]
        assert "open-file limit 80" in msg, msg
        # A held connection still gets an answer.
        s = held.pop()
        s.settimeout(10)
        s.sendall(b"GET /stats HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = recv_to_eof(s)
        assert data.startswith(b"HTTP/1.1 200"), data[:300]
        st = json.loads(data.split(b"\r\n\r\n", 1)[1])
        assert st["fd_limit_refusals"] == len(refused), st
    finally:
        for s in held:
            s.close()
    assert wait_until(lambda: get_stats(url)["connections_open"] == 1, timeout=10)
    # Requests held at the prefill (1 s) each take a client and an upstream
    # connection: the clients past 40 are answered 503, the upstream
    # connections past 8 (80 / 2 - 64, at least 8) wait for one: no EMFILE.
    answers = []

    def one(_):
        try:
            answers.append(post(url + "/v1/completions", {"prompt": "x", "max_tokens": 2}))
        except OSError as e:
            answers.append((repr(e), None))

    in_threads(one, 45)
    statuses = collections.Counter(a[0] for a in answers)
    assert set(statuses) == {200, 503} and statuses[503] <= 5, answers
    for st, ans in answers:
        if st == 503:
            assert "open-file limit 80" in ans["error"]["message"], ans
    # Serving again once connections closed.
    assert wait_until(lambda: post(url + "/v1/completions", {"prompt": "x"})[0] == 200,
                      timeout=10)
    assert get_stats(url)["prefill_failovers"] == 0
    proc = proxy.procs[-1]
    proc.terminate()
    _, err = proc.communicate(timeout=10)
    assert "Traceback" not in err, err[-3000:]
    assert err.count("open-file limit raised from 40 to 80") == 1, err[-3000:]
    assert "EMFILE" not in err and "Too many open files" not in err, err[-3000:]
    assert "connection refused (503)" in err, err[-3000:]


def test_running_out_of_file_descriptors_is_named_not_a_traceback(caplog):
    """The backstops where the limits above are not enough (other files
    open): an upstream connect failing with EMFILE is the proxy's own
    limit, not the instance's failure (was "unreachable", a prefill marked
    down and failed over); asyncio's accept() failing with EMFILE (was a
    traceback per pending connection, every second) is one WARNING line
    per 10 s."""
    import errno
    import aiohttp
    from mooncake_connector import http_guard
    from mooncake_connector.proxy import Proxy
    emfile = OSError(errno.EMFILE, "Too many open files")
    key = types.SimpleNamespace(host="127.0.0.1", port=8100, ssl=False)
    exc = aiohttp.ClientConnectorError(key, emfile)
    assert http_guard.out_of_fds(exc) and http_guard.out_of_fds(emfile)
    assert not http_guard.out_of_fds(ConnectionRefusedError(errno.ECONNREFUSED, "refused"))
    pr = Proxy(["http://127.0.0.1:8100"], ["http://127.0.0.1:8200"])
    pr.nofile = 1024
    msg = pr.upstream_failure("decode instance http://127.0.0.1:8200", exc, "unreachable")
    assert "out of file descriptors" in msg and "open-file limit 1024" in msg, msg
    resp = pr.no_fds("prefill instance http://127.0.0.1:8100", exc, "r1")
    assert resp.status == 503 and pr.counts["fd_limit_errors"] == 1
    loop = asyncio.new_event_loop()
    try:
        http_guard.quiet_fd_errors(loop, "the proxy")
        with caplog.at_level("WARNING"):
            for _ in range(100):
                loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                             "exception": emfile})
        lines = [r for r in caplog.records if "cannot accept connections" in r.getMessage()]
        assert len(lines) == 1 and lines[0].exc_info is None, caplog.text
        assert "Too many open files" in lines[0].getMessage()
    finally:
        loop.close()

def test_flow_a_fast_path_traced(vllm_like, proxy, tmp_path):
    """MC_TRACE on the proxy: a fast-path request's points in order (read,
    prefill POST with the upstream id, answer head and body, plan, first
    bytes out), a partial first token's boundary check before its early
    release, the decode instance settling one; and benchmarks/
    flowa_timeline.py's points() reading them back by the request id."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "benchmarks"))
    try:
        import flowa_timeline
    finally:
        sys.path.pop(0)
    from mooncake_connector import trace
    path = str(tmp_path / "t.jsonl")
    p = vllm_like("prefill")
    url = proxy([p.url], [vllm_like("decode").url], env={**os.environ, "MC_TRACE": path})
    body = {"model": "m", "prompt": "a b c", "max_tokens": 3, "stream": True}
    assert post(url + "/v1/completions", body, headers={"X-Request-Id": "whole-1"},
                raw=True)[0] == 200
    pts = flowa_timeline.points(trace.read(path), "whole-1")
    order = ["proxy_in", "proxy_pre_post", "proxy_pre_head", "proxy_pre_body", "proxy_plan",
             "proxy_first_out"]
    assert all(k in pts for k in order), pts
    assert [pts[k] for k in order] == sorted(pts[k] for k in order), pts
    assert pts["partial"] is False and "proxy_boundary_ask" not in pts
    up = [e for e in trace.read(path) if e["ev"] == "proxy_pre_post"]
    assert up[0]["up"] == "whole-1", up

    # a partial first token: held on the first request, released early on
    # the next, after the boundary check
    p2 = vllm_like("prefill", first_text="")
    d2 = vllm_like("decode", partial="whole", detokenize=True)
    path2 = str(tmp_path / "t2.jsonl")
    url2 = proxy([p2.url], [d2.url], env={**os.environ, "MC_TRACE": path2})
    body2 = {"model": "m", "prompt": "a b", "max_tokens": 3, "stream": True}
    for rid in ("held-1", "early-1"):
        assert post(url2 + "/v1/completions", body2, headers={"X-Request-Id": rid},
                    raw=True)[0] == 200
    ev = trace.read(path2)
    held, early = (flowa_timeline.points(ev, r) for r in ("held-1", "early-1"))
    assert held["partial"] and "proxy_boundary_ask" not in held, held
    assert early["partial"] and early["proxy_plan"] < early["proxy_boundary_ask"] \
        < early["proxy_boundary_ok"] <= early["proxy_first_out"], early
    assert [e["ev"] for e in ev].count("proxy_settled") >= 1


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback (::1) here")
@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_an_ipv6_host_is_listened_on_and_printed_in_brackets(host):
    """--host ::1 (or [::1], as a URL writes it): the proxy prints its URL
    http://[::1]:PORT (was "http://::1:PORT", no URL; and --host [::1] was
    "cannot listen on [::1]:0: Name or service not known"); a port taken
    there is named [::1]:PORT (was "::1:PORT")."""
    p = subprocess.Popen([sys.executable, "-m", "mooncake_connector.proxy", "--host", host,
                          "--port", "0", "--prefill", "http://[::1]:8100", "--decode",
                          "http://[::1]:8200"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        line = p.stdout.readline()
        m = re.match(r"proxy listening on http://\[::1\]:(\d+) ", line)
        assert m, (line, p.stderr.read() if p.poll() is not None else "")
        port = int(m.group(1))
        rc, err = _start(["--host", host, "--port", str(port), "--prefill", "http://[::1]:8100",
                          "--decode", "http://[::1]:8200"])
        assert rc == 1 and f"cannot listen on [::1]:{port}: " in err, (rc, err)
    finally:
        p.terminate()
        p.wait(10)
        p.stdout.close()
        p.stderr.close()
