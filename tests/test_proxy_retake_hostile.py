"""The proxy's retake (mooncake_connector.proxy_retake) against hostile and
careless decode answers that look like "failed before the first token"
but are not, and the ones that are (once only, bounded): a scripted decode
stub answers each leg with the bytes a test gives it."""
import asyncio
import gzip
import json
import socket
import urllib.request

import pytest
from aiohttp import web

from app_thread import AppThread
from conftest import closing_maker, in_threads, wait_until
from test_proxy import get_stats, post, proxy, vllm_like  # noqa: F401

ERR = {"error": {"message": "Internal server error", "type": "InternalServerError",
                 "param": None, "code": 500}}
ERR_EVENT = b"data: " + json.dumps(ERR).encode() + b"\n\n"
DONE = b"data: [DONE]\n\n"


def ev(obj):
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def tok(text, i=0, finish=None):
    return ev({"id": "d", "choices": [{"index": i, "text": text, "token_ids": [7],
                                       "finish_reason": finish}]})


def delta(i=0, finish=None, **d):
    return ev({"id": "d", "choices": [{"index": i, "delta": d, "finish_reason": finish}]})


class Scripted(AppThread):
    """A decode whose answers are scripted: each request takes the next
    script (the last one repeats): dict(status=200, ctype, pieces=[bytes],
    gap=seconds between pieces, delay=seconds before the answer, gzip=False,
    stream=True)."""

    def __init__(self, *scripts):
        self.scripts, self.seen = list(scripts), []
        self.open, self.broken = 0, 0  # answers being sent; answers whose client left
        self.forgets = 0  # the proxy's forgets (not in seen)

        async def complete(request):
            body = json.loads(await request.content.read())  # any size
            if "mc_forget" in (body.get("kv_transfer_params") or {}):
                # the proxy's forget after a leg with no output (flow b): as
                # vLLM with our connector that never saw the leg
                self.forgets += 1
                return web.json_response({"choices": [{"index": 0, "text": "x"}],
                                          "kv_transfer_params": {"mc_forget": "unseen"}})
            self.seen.append(body)
            s = self.scripts.pop(0) if len(self.scripts) > 1 else self.scripts[0]
            self.open += 1
            try:
                return await answer(request, s)
            except (ConnectionResetError, OSError):
                self.broken += 1
                raise
            finally:
                self.open -= 1

        async def answer(request, s):
            await asyncio.sleep(s.get("delay", 0))
            status = s.get("status", 200)
            pieces = s.get("pieces", [])
            ctype = s.get("ctype", "text/event-stream")
            if not s.get("stream", True):
                data = b"".join(pieces)
                headers = {}
                if s.get("gzip"):
                    data, headers = gzip.compress(data), {"Content-Encoding": "gzip"}
                return web.Response(status=status, body=data, headers=headers,
                                    content_type=ctype)
            resp = web.StreamResponse(status=status, headers={"Content-Type": ctype})
            await resp.prepare(request)
            for p in pieces:
                await resp.write(p)
                await asyncio.sleep(s.get("gap", 0))
            return resp

        async def models(request):
            return web.json_response({"data": [{"id": "m", "max_model_len": 100}]})

        super().__init__([("POST", "/v1/completions", complete),
                          ("POST", "/v1/chat/completions", complete),
                          ("GET", "/v1/models", models)])


@pytest.fixture
def scripted():
    yield from closing_maker(Scripted)


def _setup(vllm_like, proxy, scripted, *scripts, flow="b", extra=()):  # noqa: F811
    p = vllm_like("prefill")
    d = scripted(*scripts)
    url = proxy([p.url], [d.url], flow=flow, extra=("--first-token", "decode", *extra))
    return url, d


def _stream(url, path, body):
    status, data = post(url + path, dict(body, stream=True), raw=True)
    return status, data


CMPL = {"model": "m", "prompt": "a b c", "max_tokens": 3}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "a b"}], "max_tokens": 3}


ROLE = delta(role="assistant", content="")
RETAKEN = dict(pieces=[tok("RETAKEN", finish="length"), DONE])


def _run_cases(url, d, cases):
    """Each case through one proxy: (path, the decode's first answer, legs
    wanted, bytes the client's answer must hold); returns what each got."""
    out = []
    for path, first, legs, want in cases:
        d.scripts, seen = [first, RETAKEN], len(d.seen)
        body = CHAT if "chat" in path else CMPL
        if first.get("stream", True):
            status, data = _stream(url, path, body)
        else:
            status, data = post(url + path, dict(body, stream=False), raw=True)
            data = data if isinstance(data, bytes) else json.dumps(data).encode()
        assert want in data, (path, first, status, data[:500])
        assert len(d.seen) - seen == legs, (path, first, d.seen[seen:])
        out.append((status, data))
    return out


def test_reasoning_and_tool_call_deltas_are_output_not_held(vllm_like, proxy,  # noqa: F811
                                                            scripted):
    """A chat stream's reasoning deltas (vLLM 0.32's "reasoning", 0.26's
    "reasoning_content") and tool calls carry no "content": they were taken
    for a role-only chunk and held, so a reasoning model's client saw
    nothing until its first content token or 64 KiB (seen failing: the
    reasoning came after the 2 s the stub waited before the content, not
    at once), and a decode error after them was "before the first token"
    (seen failing: the request was sent once more, the reasoning dropped).
    Now they are relayed as they come; an error after them is the
    client's."""
    url, d = _setup(vllm_like, proxy, scripted, RETAKEN)
    _run_cases(url, d, [
        ("/v1/chat/completions", dict(pieces=[ROLE, delta(reasoning="think"), ERR_EVENT, DONE]),
         1, b'"reasoning": "think"'),
        ("/v1/chat/completions", dict(pieces=[ROLE, delta(reasoning_content="think"), ERR_EVENT,
                                              DONE]), 1, b'"reasoning_content": "think"'),
        ("/v1/chat/completions", dict(pieces=[ROLE, delta(tool_calls=[{
            "index": 0, "function": {"name": "f"}}]), ERR_EVENT, DONE]), 1, b'"name": "f"'),
    ])
    assert get_stats(url)["decode_retakes"] == 0
    # the reasoning reaches the client while the decode is still thinking
    d.scripts = [dict(pieces=[ROLE + delta(reasoning="think"),
                              delta(content="x", finish="stop") + DONE], gap=2.0)]
    req = urllib.request.Request(url + "/v1/chat/completions", method="POST",
                                 data=json.dumps(dict(CHAT, stream=True)).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=20) as r:
        got = b""
        while b"think" not in got:
            piece = r.read1(65536)
            assert piece, got
            got += piece
        rest = r.read()
    # it came without the content the stub sends 2 s later (held, both
    # would have come at once)
    assert b'"content": "x"' not in got and b'"content": "x"' in rest, (got, rest)


@pytest.mark.parametrize("eol", [b"\r\n", b"\r"], ids=["crlf", "cr"])
def test_a_stream_whose_lines_end_in_cr_is_relayed(vllm_like, proxy, scripted, eol):  # noqa: F811
    """SSE lets lines end in "\\r\\n" or "\\r": StreamHead looked for "\\n\\n"
    only, so such a stream was one undecided event to its end, taken for a
    failure, sent once more, and the client got an error instead of the
    answer (seen failing: two legs, the error event)."""
    def crlf(b):
        return b.replace(b"\n", eol)
    answer = dict(pieces=[crlf(tok("x")), crlf(tok("y", finish="length")), crlf(DONE)])
    url, d = _setup(vllm_like, proxy, scripted, answer)
    status, data = _stream(url, "/v1/completions", CMPL)
    assert data == b"".join(answer["pieces"]) and len(d.seen) == 1, data
    # and the failures in that form are still failures
    fail = dict(pieces=[crlf(ROLE), crlf(ERR_EVENT), crlf(DONE)])
    _run_cases(url, d, [("/v1/chat/completions", fail, 2, b"RETAKEN")])
    assert get_stats(url)["decode_retakes"] == 1


def test_a_streamed_answer_that_is_no_sse_or_ends_mid_event_is_relayed(
        vllm_like, proxy, scripted):  # noqa: F811
    """A 200 to a streamed request whose body is no SSE (a JSON object, a
    page), or whose last event has no blank line after it, was undecided at
    its end, so taken for a failure and sent once more (seen failing: two
    legs, the retake's answer): it is relayed as sent, as before retakes."""
    url, d = _setup(vllm_like, proxy, scripted, RETAKEN)
    js = json.dumps({"choices": [{"text": "hello"}]}).encode()
    _run_cases(url, d, [
        ("/v1/completions", dict(ctype="application/json", pieces=[js]), 1, js),
        ("/v1/completions", dict(ctype="text/html", pieces=[b"<html>hi</html>\n\n"]), 1,
         b"<html>hi</html>"),
        ("/v1/completions", dict(pieces=[tok("x", finish="stop")[:-1]]), 1, b'"text": "x"'),
        ("/v1/completions", dict(pieces=[b": keepalive\n\n", tok("x", finish="stop")[:-2]]), 1,
         b'"text": "x"'),
    ])
    assert get_stats(url)["decode_retakes"] == 0


def test_answers_that_only_look_failed_are_not_taken_again(vllm_like, proxy,  # noqa: F811
                                                           scripted):
    """Tried and fine (kept so): an empty answer (the first token a stop),
    an error after a token, [DONE] then more, events cut into 1-byte
    pieces, non-streamed 500s that are no engine error, a 200 with no
    choices; and the shapes that are failures are (once): a stream of
    comments alone, a gzipped 500, one of 8 MiB."""
    url, d = _setup(vllm_like, proxy, scripted, RETAKEN)
    c, ch = "/v1/completions", "/v1/chat/completions"
    empty = ev({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]})
    err = json.dumps(ERR).encode()
    _run_cases(url, d, [
        (c, dict(pieces=[empty, DONE]), 1, b'"finish_reason": "stop"'),
        (ch, dict(pieces=[ROLE, delta(content="", finish="stop"), DONE]), 1, b'"stop"'),
        (c, dict(pieces=[tok("x"), ERR_EVENT, DONE]), 1, b"Internal server error"),
        (c, dict(pieces=[tok("x"), DONE, tok("z")]), 1, b'"text": "z"'),
        (c, dict(pieces=[bytes([b]) for b in ROLE + tok("x", finish="length") + DONE]), 1,
         b'"text": "x"'),
        (c, dict(status=500, stream=False, ctype="text/html", pieces=[b"<html>boom</html>"]), 1,
         b"no OpenAI error message"),
        (c, dict(status=500, stream=False, pieces=[b'{"error": "InternalServerError"}']), 1,
         b"no OpenAI error message"),
        (c, dict(status=500, stream=False, pieces=[b'{"error": {"message": "no", "code": 400}}']),
         1, b'"no"'),
        (c, dict(stream=False, pieces=[b'{"choices": []}']), 1, b'{"choices": []}'),
    ])
    assert get_stats(url)["decode_retakes"] == 0
    _run_cases(url, d, [
        (c, dict(pieces=[b": ping\n\n"] * 3), 2, b"RETAKEN"),
        (c, dict(status=500, stream=False, gzip=True, pieces=[err]), 2, b"RETAKEN"),
        (c, dict(status=500, stream=False, pieces=[json.dumps(dict(ERR, pad="x" * (8 << 20)))
                                                   .encode()]), 2, b"RETAKEN"),
    ])
    assert get_stats(url)["decode_retakes"] == 3


def _gauges(url):
    st = get_stats(url)
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    in_flight = [float(ln.split()[1]) for ln in text.splitlines()
                 if ln.startswith("mooncake_proxy_requests_in_flight ")]
    return (st["request_ids_in_flight"], st["body_bytes_in_flight"],
            st["decode_forgets_in_flight"], in_flight)


def test_a_client_that_leaves_during_the_retake_leaves_nothing_behind(
        vllm_like, proxy, scripted):  # noqa: F811
    """Tried and fine: the client leaves while the retake runs (before its
    first token): the retake's request is closed at the decode, and the
    proxy's gauges go back to 0."""
    url, d = _setup(vllm_like, proxy, scripted, dict(pieces=[ERR_EVENT, DONE]),
                    dict(delay=1.0, pieces=[tok("x")] * 40, gap=0.05))
    body = json.dumps(dict(CMPL, stream=True)).encode()
    c = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=20)
    c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    assert wait_until(lambda: len(d.seen) == 2 and d.open == 1, 10), d.seen
    assert _gauges(url)[0] == 1
    c.close()
    assert wait_until(lambda: d.open == 0, 10) and d.broken == 1
    assert wait_until(lambda: _gauges(url) == (0, 0, 0, [0.0]), 10), _gauges(url)
    assert len(d.seen) == 2 and get_stats(url)["decode_retakes"] == 1


def test_many_requests_failing_twice_each_end_once(vllm_like, proxy, scripted):  # noqa: F811
    """Tried and fine: 60 streamed requests at once whose every leg fails:
    each sent once more, no more, each client gets the error event."""
    url, d = _setup(vllm_like, proxy, scripted, dict(pieces=[ERR_EVENT, DONE]))
    got = []
    in_threads(lambda i: got.append(_stream(url, "/v1/completions", CMPL)), 60)
    assert len(got) == 60 and all(
        s == 200 and b"again after it was sent once more" in data for s, data in got)
    st = get_stats(url)
    assert len(d.seen) == 120 and st["decode_retakes"] == 60 and st["decode_errors"] == 60
    assert _gauges(url) == (0, 0, 0, [0.0])


def _feed(head, data, piece):
    for i in range(0, len(data), piece):
        verdict = head.feed(data[i:i + piece])
        if verdict is not None:
            return verdict
    return None


@pytest.mark.parametrize("piece", [1, 2, 5, 1 << 20])
def test_stream_head_line_ends_and_last_events(piece):
    """StreamHead over "\r\n" / "\r" line ends cut anywhere (a "\r\n"
    split between two pieces is one line end), output deltas, and what is
    left at EOF (seen failing: each "\\r" case undecided, a last event
    without its blank line FAILED)."""
    from mooncake_connector.proxy_retake import FAILED, RELAY, StreamHead
    cases = [(ROLE.replace(b"\n", b"\r\n") + ERR_EVENT.replace(b"\n", b"\r\n"), FAILED, None),
             (ROLE.replace(b"\n", b"\r") + tok("x").replace(b"\n", b"\r"), RELAY, None),
             (b"data: x\r\n\r\ndata: [DONE]\r\n", RELAY, None),
             (ROLE.replace(b"\n", b"\r\n") + b"data: [DONE]\r\n\r\n", FAILED, None),
             (ROLE + delta(reasoning="r"), RELAY, None),
             (ROLE + delta(role="assistant", content=None, tool_calls=[]), None, FAILED),
             (ev({"choices": [{"index": 0, "delta": {}, "logprobs": {"content": [1]}}]}), RELAY,
              None),
             (ROLE + tok("x")[:-1], None, RELAY),
             (ROLE + b"data: [DONE]", None, FAILED),
             (ROLE + b": only a comment", None, FAILED),
             (b'{"choices": [{"text": "x"}]}', None, RELAY),
             (b"<html>\n\n</html>", RELAY, None),
             (b"event: x\nid: 1\nretry: 5\n\n" + ERR_EVENT, FAILED, None),
             (b"", None, FAILED)]
    for data, want, at_eof in cases:
        head = StreamHead()
        assert _feed(head, data, piece) == want, data
        if want is None:
            assert head.ended() == at_eof, data
            assert head.held() == data


def test_stream_head_searches_each_byte_once():
    """A decode trickling an event that never ends, a byte per piece, up to
    the 64 KiB held: StreamHead searched the whole event again per piece,
    4 s of the proxy's event loop on the 2-vCPU VM (quadratic); now each
    byte is searched for an event's end about once.  Counted, not timed
    (a timed ratio flaked beside a busy neighbour): the bytes its searches
    covered, against the bytes fed."""
    from mooncake_connector.proxy_retake import HOLD_MAX, RELAY, StreamHead

    class Counting(bytearray):
        covered = 0

        def find(self, sub, start=0, *rest):
            self.covered += max(len(self) - start, 0)
            return super().find(sub, start, *rest)

    head = StreamHead()
    head._text = Counting()
    fed = len(b"data: ")
    head.feed(b"data: ")
    verdict = None
    while verdict is None:
        verdict = head.feed(b"a")
        fed += 1
    assert verdict == RELAY and fed > HOLD_MAX
    # one search per piece from the byte before it: ~2 bytes a piece (the
    # quadratic search covered ~fed**2 / 2, over 2 billion here)
    assert head._text.covered <= 3 * fed, (head._text.covered, fed)


@pytest.mark.parametrize("eol", [b"\r\n", b"\r"], ids=["crlf", "cr"])
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_first_token_from_prefill_reads_cr_line_ends(vllm_like, proxy, eol, split):  # noqa: F811
    """The leg that continues from the prefill's first token
    (proxy_first_token._relay_decode) parses the decode's events itself: it
    looked for "\\n\\n" only, so a decode stream whose lines end in "\\r\\n"
    or "\\r" (SSE allows both) had no event to it, was taken for a failure
    before its first token, sent once more and ended with an error (seen
    failing: two decode legs, an error event).  Events cut into pieces (a
    "\\r\\n" between two of them) too."""
    p = vllm_like("prefill")
    d = vllm_like("decode", detokenize=True, split=split)
    d.eol = eol
    url = proxy([p.url], [d.url], flow="b", extra=("--first-token", "prefill"))
    status, data = _stream(url, "/v1/completions", dict(CMPL, max_tokens=4))
    assert status == 200 and b'"error"' not in data, data
    events = [json.loads(e[6:]) for e in data.decode().split("\n\n")
              if e.startswith("data: {")]
    text = "".join(c.get("text") or "" for e in events for c in e.get("choices") or ())
    assert text == "t103 t104 t105 t106 ", data
    assert data.rstrip().endswith(b"data: [DONE]"), data
    legs = [s for s in d.seen if s["path"] == "/v1/completions"
            and "mc_forget" not in (s["body"].get("kv_transfer_params") or {})]
    assert len(legs) == 1, legs
    st = get_stats(url)
    assert st["decode_retakes"] == 0 and st["first_token_from_prefill"] == 1, st


def test_line_ends_across_pieces():
    """proxy_retake.LineEnds: "\\r\\n" cut between pieces is one line end;
    "\\r" alone is one; a piece of "\\n" alone after a "\\r" is that same end."""
    from mooncake_connector.proxy_retake import LineEnds
    for pieces, want in (([b"a\r", b"\nb\r\n"], b"a\nb\n"),
                         ([b"a\r", b"\n", b"\n"], b"a\n\n"),
                         ([b"a\r\r", b"b"], b"a\n\nb"),
                         ([b"a\r", b"", b"\nb"], b"a\nb"),
                         ([b"a\n", b"\n"], b"a\n\n")):
        e = LineEnds()
        assert b"".join(e.feed(p) for p in pieces) == want, pieces


def test_first_token_from_prefill_takes_a_failed_choice_again(vllm_like, proxy,  # noqa: F811
                                                              scripted):
    """The leg that continues from the prefill's first token judges its
    events as StreamHead does (proxy_retake.event_failed): a first chunk
    whose choice ended with finish reason "error" and nothing else is a
    failure before the first token, taken again (the old code relayed it
    as the answer's end: one decode leg, finish reason "error")."""
    failed = ev({"id": "d", "choices": [{"index": 0, "text": "", "token_ids": [],
                                         "finish_reason": "error"}]})
    p = vllm_like("prefill")
    d = scripted(dict(pieces=[failed, DONE]), RETAKEN)
    url = proxy([p.url], [d.url], flow="b", extra=("--first-token", "prefill"))
    status, data = _stream(url, "/v1/completions", CMPL)
    assert status == 200 and b"RETAKEN" in data and b'"error"' not in data, data
    assert len(d.seen) == 2 and d.seen[1]["kv_transfer_params"] == {"mc_retake": True}, d.seen
    st = get_stats(url)
    assert st["decode_retakes"] == 1 and st["first_token_from_prefill"] == 1, st


def _random_stream(rng):
    """Bytes a decode might send (or a broken one): vLLM's events, comments,
    other SSE fields, JSON that is no chunk, random bytes, each line ended
    in "\\n", "\\r\\n" or "\\r" at random."""
    parts = [tok("x"), tok("y", finish="length"), ROLE, delta(reasoning="r"), ERR_EVENT, DONE,
             ev({"id": "d", "choices": [], "usage": {"prompt_tokens": 3}}),
             ev({"id": "d", "choices": [{"index": 0, "text": "", "finish_reason": "error"}]}),
             ev({"error": "a string"}), ev([1, 2]), b": keep-alive\n\n", b"event: ping\n\n",
             b"data: {not json\n\n", b"<html>oops</html>", b"\n", b"\n\n", b"data:",
             b'{"choices": []}']
    out = []
    for _ in range(rng.randrange(0, 8)):
        if rng.random() < 0.15:
            out.append(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))))
            continue
        p = rng.choice(parts)
        eol = rng.choice([b"\n", b"\n", b"\r\n", b"\r"])
        out.append(p.replace(b"\n", eol))
    return b"".join(out)


def _head_verdict(pieces):
    """(verdict, held bytes, bytes fed until the verdict) of StreamHead over pieces."""
    from mooncake_connector.proxy_retake import StreamHead
    h, fed = StreamHead(), 0
    for p in pieces:
        fed += len(p)
        v = h.feed(p)
        if v is not None:
            return v, h.held(), fed
    return h.ended(), h.held(), fed


def test_stream_head_and_line_ends_on_random_streams():
    """A fuzz run over the proxy's parsers of the decode's bytes
    (proxy_retake.StreamHead, LineEnds; 3,000 seeded random streams, each
    cut into random pieces, "\\r\\n" split anywhere): never an exception,
    the same verdict and the same bytes whatever the cuts, the bytes held
    exactly those fed, and LineEnds' output independent of the cuts."""
    import random
    from mooncake_connector.proxy_retake import LineEnds
    rng = random.Random(31)
    for i in range(3000):
        data = _random_stream(rng)
        whole = _head_verdict([data])
        cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randrange(0, 12)))) \
            if len(data) > 1 else []
        pieces = [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)])]
        pieces = [p for q in pieces for p in (q, b"") if rng.random() < 0.9 or p]  # empty ones
        cut = _head_verdict(pieces)
        assert cut[0] == whole[0], (i, data, pieces, whole, cut)
        assert cut[1] == data[:cut[2]], (i, data, pieces, cut)
        e1, e2 = LineEnds(), LineEnds()
        assert b"".join(e1.feed(p) for p in pieces) == e2.feed(data), (i, data, pieces)
