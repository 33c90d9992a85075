"""The proxy's first-token-from-prefill path with real vLLM servers (pytest -m e2e).

Streamed requests: the client's first chunk is the prefill server's token and
the decode server continues from it (its prompt is the prompt's token ids plus
that token).  Greedy token identity for every case is in test_e2e_serving.py;
here: sampled requests continue from the client's first token, answers the
prefill already finished never reach decode, requests the path cannot
represent take the seed's path, and a decode leg failing after the first
chunk ends the stream with an error event naming the decode instance.
(Runs before test_e2e_serving.py, whose last test restarts the prefill server.)
"""
import json
import time
import urllib.request

import pytest
from aiohttp import web
from app_thread import AppThread

from mooncake_connector import serving
from mooncake_connector.deployment import prompt_tokens_by_source, proxy_stats
from mooncake_connector.openai_client import request

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

REQ_TIMEOUT = 120
PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)
CHAT = [{"role": "system", "content": PROMPT}, {"role": "user", "content": "and then?"}]


def _stream(body):
    return dict(body, model="tiny", stream=True, return_token_ids=True,
                stream_options={"include_usage": True})


def _full(body):
    return dict(body, model="tiny", stream=False, return_token_ids=True)


def _ok(r, what):
    assert r.status == 200 and r.error is None, f"{what}: {r.status} {r.error}"
    return r


def _whole_char(text):
    """The prefill's first token is a whole UTF-8 character (vLLM shows ""
    for a partial one: the proxy then holds its chunk back until the decode
    leg's first text, see proxy_first_token._settle)."""
    return bool(text) and "\ufffd" not in text


def _prompt_with_whole_first_token(dep):
    """PROMPT, or the first variant of it whose greedy first token is a
    whole character (the tiny random model often starts with byte tokens)."""
    for extra in ("", " again", " once more", " and more", " then", " so"):
        prompt = PROMPT + extra
        r = _ok(request(dep.colocated.url, "/v1/completions", _full(
            {"prompt": prompt, "temperature": 0.0, "max_tokens": 1}), timeout=REQ_TIMEOUT),
            "first token")
        if _whole_char(r.text):
            return prompt
    pytest.fail("no prompt variant starts with a whole UTF-8 character on this model")


def _decode_prompt_tokens(dep):
    return sum(prompt_tokens_by_source(dep.decode.url).values())


@pytest.mark.parametrize("flow", ["a", "b"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_sampled_request_continues_from_the_clients_first_token(deployment, flow, path):
    """temperature > 0 with a seed: the first token is what the prefill
    server samples for that seed, and the rest is what a server samples for
    the same seed continuing from prompt + that token.  Dropping the decode
    server's own first token instead would give the colocated seeded answer;
    the test checks at least one seed tells the two apart."""
    dep = deployment
    if flow == "b" and dep.connector == "example":
        pytest.skip("vLLM's ExampleConnector returns no kv_transfer_params")
    key = "messages" if "chat" in path else "prompt"
    told_apart = 0
    fast = 0
    for seed in (11, 22, 33, 44, 55, 66, 77):
        base = {key: CHAT if key == "messages" else PROMPT, "temperature": 0.9, "seed": seed,
                "max_tokens": 8, "ignore_eos": True}
        got = _ok(request(dep.proxies[flow].url, path, _stream(base), timeout=REQ_TIMEOUT),
                  f"proxy {flow} seed {seed}")
        assert len(got.token_ids) == 8, got.token_ids
        first = _ok(request(dep.colocated.url, path, _full(dict(base, max_tokens=1)),
                            timeout=REQ_TIMEOUT), "colocated first token")
        assert got.token_ids[:1] == first.token_ids, (seed, got.token_ids, first.token_ids)
        prompt_ids = got.prompt_token_ids
        assert prompt_ids == first.prompt_token_ids, "prompt ids sent to the client differ"
        whole = _ok(request(dep.colocated.url, path, _full(base), timeout=REQ_TIMEOUT),
                    "colocated seeded")
        if "\ufffd" in first.text:
            # Such a first token takes the seed's path: the decode server
            # answers the whole request, as the colocated one does.
            assert got.token_ids == whole.token_ids, (seed, got.token_ids, whole.token_ids)
            continue
        fast += 1
        cont = _ok(request(dep.colocated.url, "/v1/completions", _full(dict(
            {k: v for k, v in base.items() if k != key}, prompt=prompt_ids + got.token_ids[:1],
            max_tokens=7)), timeout=REQ_TIMEOUT), "colocated continuation")
        assert got.token_ids[1:] == cont.token_ids, (
            f"seed {seed}: the decode leg did not continue from the client's first token: "
            f"got {got.token_ids}, continuation of {got.token_ids[:1]} is {cont.token_ids}")
        told_apart += whole.token_ids != got.token_ids
        assert got.usage["prompt_tokens"] == len(prompt_ids)
        assert got.usage["completion_tokens"] == 8
    assert fast, "no seed's first token was a whole character: the fast path went untested"
    assert told_apart, ("for every seed, continuing from the first token gave the same "
                        "tokens as a fresh seeded request: this test cannot tell the two apart")


def _chunks(res):
    """Each streamed choice as the client got it (ids and times aside)."""
    return [c for e in res.events for c in e.get("choices") or []]


def _partial_bodies(dep, path, greedy=2, seeded=4, tries=40):
    """Requests whose first token ends inside a UTF-8 character (the tiny
    random model's byte-level vocabulary often starts with one; its text is
    ""), found on the colocated server: greedy ones over prompt variants,
    sampled ones over seeds.  Returns (bodies, {kind: [found, tried]})."""
    key = "messages" if "chat" in path else "prompt"

    def variant(i):
        text = f"{PROMPT} {i}{chr(0x4e00 + 97 * i)}{'xyzw'[i % 4] * (i % 3)}"
        if key == "prompt":
            return {"prompt": text}
        # the chat template ends every prompt with "<s>assistant:"; an
        # assistant message continued ends it with the varied text
        return {"messages": CHAT + [{"role": "assistant", "content": text}],
                "add_generation_prompt": False, "continue_final_message": True}

    found, seen = [], {}
    for kind, want, make in (
            ("greedy", greedy, lambda i: dict(variant(i), temperature=0.0)),
            ("seeded", seeded, lambda i: {key: CHAT if key == "messages" else PROMPT,
                                          "temperature": 1.0, "seed": 100 + i})):
        n = 0
        for i in range(tries):
            body = make(i)
            r = _ok(request(dep.colocated.url, path, _full(dict(body, max_tokens=1)),
                            timeout=REQ_TIMEOUT), "first token")
            if not r.text and r.body["choices"][0].get("finish_reason") == "length":
                found.append(body)
                n += 1
                if n == want:
                    break
        seen[kind] = [n, i + 1]
    return found, seen


@pytest.mark.parametrize("flow", ["a", "b"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_partial_utf8_first_token_takes_the_fast_path_byte_exact(deployment, flow, path):
    """A first token that ends inside a UTF-8 character (its text ""): the
    decode leg's prompt ends inside that character, so vLLM's detokenizer
    there emits the prompt's whole text with the character that completes
    it.  The proxy holds the first chunk(s) back and replaces that text by
    the tokens' own (from the decode instance's /detokenize): the client's
    stream is the colocated server's, chunk by chunk, token ids and text.
    Before, such requests took the seed's path (counted as a fallback)."""
    dep = deployment
    if flow == "b" and dep.connector == "example":
        pytest.skip("vLLM's ExampleConnector returns no kv_transfer_params")
    key = "messages" if "chat" in path else "prompt"
    url = dep.proxies[flow].url
    bodies, seen = _partial_bodies(dep, path)
    assert bodies, f"no request's first token is a partial UTF-8 character: {seen}"
    stats0 = proxy_stats(url)
    held_back = []
    for body in bodies:
        for b in (dict(_stream(body), max_tokens=10),
                  # a client that does not ask for token ids gets none
                  dict(_stream(body), max_tokens=6, return_token_ids=False)):
            got = _ok(request(url, path, b, timeout=REQ_TIMEOUT), "proxy")
            col = _ok(request(dep.colocated.url, path, b, timeout=REQ_TIMEOUT), "colocated")
            # the same fields in the first, last and other chunks (vLLM groups
            # tokens into chunks as its output loop keeps up: not compared)
            g, c = _chunks(got), _chunks(col)
            assert [list(g[0]), list(g[-1])] == [list(c[0]), list(c[-1])], (g, c)
            if len(c) > 2:
                assert {tuple(x) for x in g[1:-1]} <= {tuple(x) for x in c[1:-1]}, (g, c)
            assert [c.get("finish_reason") for c in _chunks(got)][-1] == \
                [c.get("finish_reason") for c in _chunks(col)][-1]
            if not b["return_token_ids"]:
                assert all(c.get("token_ids") is None for c in _chunks(got)), _chunks(got)
                got.token_ids = col.token_ids = None
            if body["temperature"] == 0.0:
                assert got.token_ids == col.token_ids, (b, got.token_ids, col.token_ids)
                assert got.text == col.text, (b, got.text, col.text)
                usage = {k: v for k, v in got.usage.items() if k != "prompt_tokens_details"}
                assert usage == {k: v for k, v in col.usage.items()
                                 if k != "prompt_tokens_details"}, (got.usage, col.usage)
            elif got.token_ids is not None:
                # seeded: the tokens after the first are the decode leg's own
                # draw (test_sampled_...); the text must be theirs, as a
                # colocated server streams any tokens: decode(prompt +
                # tokens) minus decode(prompt)
                ids = got.prompt_token_ids

                def detok(tokens):
                    req = urllib.request.Request(
                        dep.colocated.url + "/detokenize", method="POST",
                        data=json.dumps({"model": "tiny", "tokens": tokens}).encode(),
                        headers={"Content-Type": "application/json"})
                    with urllib.request.urlopen(req, timeout=REQ_TIMEOUT) as r:
                        return json.loads(r.read())["prompt"]
                whole, prompt = detok(ids + got.token_ids), detok(ids)
                want = whole[len(prompt):]
                # (a stream never shows the text of a last partial character)
                assert whole.startswith(prompt) and want.startswith(got.text) and set(
                    want[len(got.text):]) <= {"\ufffd"}, (got.text, want)
            if b["return_token_ids"]:  # how many tokens showed "" before the first text
                texts = [c.get("text") if key == "prompt" else c["delta"].get("content")
                         for c in _chunks(got) for _ in c.get("token_ids") or []]
                held_back.append(next((i for i, t in enumerate(texts) if t), len(texts)))
    stats1 = proxy_stats(url)
    n = 2 * len(bodies)
    assert stats1["first_token_fallbacks"] == stats0["first_token_fallbacks"], stats1
    assert stats1["first_token_partial"] - stats0.get("first_token_partial", 0) == n, stats1
    assert stats1["first_token_from_prefill"] - stats0["first_token_from_prefill"] == n
    print(json.dumps({"flow": flow, "path": path, "found/tried": seen,
                      "tokens_before_text": held_back}))


def test_answer_finished_by_prefill_never_reaches_decode(deployment):
    """max_tokens=1, and a stop token as the first token: the prefill's answer
    is the whole answer, identical to colocated, and decode is not asked."""
    dep = deployment
    url = dep.proxies["a"].url
    ref = _ok(request(dep.colocated.url, "/v1/completions", _full(
        {"prompt": PROMPT, "temperature": 0.0, "max_tokens": 4}), timeout=REQ_TIMEOUT), "ref")
    stats0, seen0 = proxy_stats(url), _decode_prompt_tokens(dep)
    for extra in ({"max_tokens": 1}, {"max_tokens": 4, "stop_token_ids": ref.token_ids[:1]}):
        body = dict({"prompt": PROMPT, "temperature": 0.0}, **extra)
        col = _ok(request(dep.colocated.url, "/v1/completions", _stream(body),
                          timeout=REQ_TIMEOUT), f"colocated {extra}")
        got = _ok(request(url, "/v1/completions", _stream(body), timeout=REQ_TIMEOUT),
                  f"proxy {extra}")
        assert got.token_ids == col.token_ids, (extra, got.token_ids, col.token_ids)
        if "stop_token_ids" not in extra:
            assert got.token_ids == ref.token_ids[:1], (extra, got.token_ids)
        fin = [c.get("finish_reason") for e in got.events for c in e.get("choices") or []]
        want = [c.get("finish_reason") for e in col.events for c in e.get("choices") or []]
        assert fin[-1] == want[-1] and fin[-1] in ("length", "stop"), (fin, want)
        assert got.usage["completion_tokens"] == col.usage["completion_tokens"], (got.usage,
                                                                                   col.usage)
    stats1 = proxy_stats(url)
    assert stats1["finished_at_prefill"] - stats0["finished_at_prefill"] == 2, stats1
    assert _decode_prompt_tokens(dep) == seen0, "decode was asked for a finished answer"


def test_requests_the_fast_path_cannot_represent_take_the_seeds_path(deployment):
    """Stop strings (they may span the first token and the next) and logprobs
    go the seed's way: the decode server answers the original request."""
    dep = deployment
    url = dep.proxies["a"].url
    stats0 = proxy_stats(url)
    for extra in ({"stop": ["zzz-never"]}, {"logprobs": 1}):
        body = dict({"prompt": PROMPT, "temperature": 0.0, "max_tokens": 6, "ignore_eos": True},
                    **extra)
        col = _ok(request(dep.colocated.url, "/v1/completions", _stream(body),
                          timeout=REQ_TIMEOUT), "colocated")
        seen0 = _decode_prompt_tokens(dep)
        got = _ok(request(url, "/v1/completions", _stream(body), timeout=REQ_TIMEOUT), "proxy")
        assert got.token_ids == col.token_ids, extra
        assert _decode_prompt_tokens(dep) - seen0 == got.usage["prompt_tokens"], extra
    stats1 = proxy_stats(url)
    assert stats1["first_token_from_prefill"] == stats0["first_token_from_prefill"]
    fb = stats1["first_token_fallbacks"]
    assert any(k.startswith("stop") for k in fb) and any(k.startswith("logprobs") for k in fb), fb


class BrokenDecode(AppThread):
    """A decode instance that knows its max_model_len but fails its request:
    mode "drop" streams one chunk then closes the connection; "status" answers 503.
    calls: the decode legs it got; forgets: the proxy's questions about a leg
    that ended before any output (proxy._forget_at_decode)."""

    def __init__(self, mode):
        self.mode, self.calls, self.forgets = mode, 0, 0

        async def models(request):
            return web.json_response({"data": [{"id": "tiny", "max_model_len": 2048}]})

        async def health(request):
            return web.Response(text="ok")

        async def complete(request):
            body = await request.json()
            if "mc_forget" in (body.get("kv_transfer_params") or {}):
                self.forgets += 1
            else:
                self.calls += 1
            if self.mode == "status":
                return web.json_response({"error": {"message": "decode overloaded"}},
                                         status=503)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"id":"x","object":"text_completion","choices":[{"index":0,'
                             b'"text":"a","token_ids":[5],"finish_reason":null}]}\n\n')
            request.transport.close()  # mid-stream: no [DONE]
            return resp

        super().__init__([("GET", "/v1/models", models), ("GET", "/health", health),
                          ("POST", "/v1/completions", complete)])


@pytest.mark.parametrize("mode", ["drop", "status"])
def test_decode_failing_after_the_first_chunk_ends_the_stream_with_an_error(deployment,
                                                                          tmp_path, mode):
    """Real prefill server, broken decode instance: the client gets the
    prefill's token (status 200 is already sent), then an SSE error event
    naming the decode instance, then the end of the stream — no hang."""
    dep = deployment
    broken = BrokenDecode(mode)
    proxy = serving.proxy([dep.prefill.url], [broken.url], serving.free_port(),
                          str(tmp_path / "proxy.log"))
    try:
        serving.start_all([proxy], 60)
        body = {"prompt": _prompt_with_whole_first_token(dep), "temperature": 0.0,
                "max_tokens": 6, "ignore_eos": True}
        ref = _ok(request(dep.colocated.url, "/v1/completions", _full(body),
                          timeout=REQ_TIMEOUT), "ref")
        t0 = time.monotonic()
        got = request(proxy.url, "/v1/completions", _stream(body), timeout=REQ_TIMEOUT)
        took = time.monotonic() - t0
        assert took < 30, f"stream took {took:.0f} s to end after the decode failure"
        assert got.status == 200, (got.status, got.error)
        assert broken.calls == 1
        # a 503 carries no output: whether the decode's connector saw the leg
        # is asked (its 503 to that too releases nothing: asked again, 0.5 s
        # later, doubling); a dropped stream sent output first
        want = 1 if mode == "status" else 0
        end = time.monotonic() + 10
        while broken.forgets < want and time.monotonic() < end:
            time.sleep(0.05)
        assert broken.forgets >= want if want else broken.forgets == 0, broken.forgets
        assert got.token_ids[:1] == ref.token_ids[:1], "first chunk is not the prefill's token"
        assert got.error and f"decode instance {broken.url}" in got.error, got.error
        assert ("503" in got.error and "decode overloaded" in got.error) if mode == "status" \
            else "before [DONE]" in got.error or "failed" in got.error, got.error
        assert "error" in got.events[-1], got.events[-1]
        stats = proxy_stats(proxy.url)
        assert stats["stream_errors_after_first_token"] == 1, stats
    finally:
        serving.stop_all([proxy])
        broken.close()
    print(json.dumps({"mode": mode, "error": got.error}))
