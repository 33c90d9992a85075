"""A decode leg that failed before its first token is taken again
(mooncake_connector.proxy_retake): vLLM's answers to a request its engine
ended with finish reason "error" (kv_load_failure_policy "fail", a failed
KV load) against the proxy, in each way the proxy relays a decode leg.
The stubs answer as vLLM 0.26-0.32's API server does (a 500
InternalServerError, or a stream's error event after a chat stream's role
chunk); tests/test_e2e_retake.py has real vLLM servers."""
import json

import pytest

from test_proxy import get_stats, post, proxy, sse_events, upstreams, vllm_like  # noqa: F401
from test_push_proxy import SlowPrefill

from mooncake_connector import proxy_retake

ERR = {"error": {"message": "Internal server error", "type": "InternalServerError",
                 "param": None, "code": 500}}


def _decode_legs(d):
    return [s["body"] for s in d.seen if s["path"].startswith("/v1/")
            and "mc_forget" not in (s["body"].get("kv_transfer_params") or {})]


def _stream(url, path, body):
    status, data = post(url + path, dict(body, stream=True), raw=True)
    return status, sse_events(data)


def _text(events):
    return "".join(c.get("text") or "" for e in events if isinstance(e, dict)
                   for c in e.get("choices") or ())


def _tokens(events):
    return [t for e in events if isinstance(e, dict)
            for c in e.get("choices") or () for t in c.get("token_ids") or ()]


@pytest.mark.parametrize("shape", ["0.32", "0.26"])
@pytest.mark.parametrize("first_token", ["decode", "prefill"])
def test_a_stream_that_failed_before_its_first_token_is_taken_again(vllm_like, proxy,  # noqa: F811
                                                                    first_token, shape):
    """Flow b, streamed: the decode leg's error event before any token
    (vLLM 0.32), or its end with no choice chunk (vLLM 0.26, a usage chunk
    before it), is not the client's; the leg is sent once more without
    the leg's kv_transfer_params, {"mc_retake": true} in their place (the
    decode computes the prompt), and the client gets the whole answer, no
    error; counted."""
    p = vllm_like("prefill")
    d = vllm_like("decode", decode_fail="engine", detokenize=True, engine_shape=shape)
    url = proxy([p.url], [d.url], flow="b", extra=("--first-token", first_token))
    body = {"model": "m", "prompt": "a b c d e", "max_tokens": 4,
            "stream_options": {"include_usage": True}}
    status, events = _stream(url, "/v1/completions", body)
    assert status == 200
    assert not [e for e in events if isinstance(e, dict) and "error" in e], events
    assert _text(events) == "t105 t106 t107 t108 ", events
    assert events[-1] == "[DONE]"
    legs = _decode_legs(d)
    assert len(legs) == 2, legs
    assert legs[0]["kv_transfer_params"].get("do_remote_prefill") is True
    assert legs[1]["kv_transfer_params"] == {"mc_retake": True}, legs[1]
    assert dict(legs[0], kv_transfer_params=None) == dict(legs[1], kv_transfer_params=None)
    assert get_stats(url)["decode_retakes"] == 1


@pytest.mark.parametrize("shape", ["0.32", "0.26"])
def test_a_chat_stream_role_chunk_then_error_is_taken_again(vllm_like, proxy,  # noqa: F811
                                                            shape):
    """A chat stream's role-only first chunk is held (it carries no token):
    the client sees one role chunk, the retake's, and no error."""
    p = vllm_like("prefill")
    d = vllm_like("decode", decode_fail="engine", engine_shape=shape)
    url = proxy([p.url], [d.url], flow="b", extra=("--first-token", "decode"))
    body = {"model": "m", "messages": [{"role": "user", "content": "a b"}], "max_tokens": 3}
    status, events = _stream(url, "/v1/chat/completions", body)
    assert status == 200
    assert not [e for e in events if isinstance(e, dict) and "error" in e], events
    roles = [e for e in events if isinstance(e, dict)
             for c in e.get("choices") or () if (c.get("delta") or {}).get("role")]
    assert len(roles) == 0 and len(_tokens(events)) == 3, events  # the stub's retake has none
    assert len(_decode_legs(d)) == 2 and get_stats(url)["decode_retakes"] == 1


@pytest.mark.parametrize("flow", ["a", "b"])
def test_a_non_streamed_500_is_taken_again(vllm_like, proxy, flow):  # noqa: F811
    p, d = vllm_like("prefill"), vllm_like("decode", decode_fail="engine")
    url = proxy([p.url], [d.url], flow=flow)
    status, out = post(url + "/v1/completions", {"model": "m", "prompt": "a b c",
                                                 "max_tokens": 2, "stream": False})
    assert status == 200 and out["choices"][0]["token_ids"] == [103, 104], out
    legs = _decode_legs(d)
    assert len(legs) == 2 and legs[1]["kv_transfer_params"] == {"mc_retake": True}, legs
    assert ("kv_transfer_params" in legs[0]) == (flow == "b")
    assert get_stats(url)["decode_retakes"] == 1


@pytest.mark.parametrize("first_token", ["decode", "prefill"])
@pytest.mark.parametrize("stream,shape", [(False, "0.32"), (True, "0.32"), (True, "0.26")])
def test_failed_twice_is_the_clients_answer(vllm_like, proxy, stream, shape,  # noqa: F811
                                            first_token):
    """Once only: a retake that fails too is the client's error (vLLM's 500,
    or an error event in the stream saying so, code 500 whether the first
    token came from the prefill or not: never vLLM 0.26's empty stream),
    counted once."""
    p = vllm_like("prefill")
    d = vllm_like("decode", decode_fail="engine", engine_fails=5, engine_shape=shape,
                  detokenize=True)
    url = proxy([p.url], [d.url], flow="b", extra=("--first-token", first_token))
    body = {"model": "m", "prompt": "a b c d e", "max_tokens": 2, "stream": stream}
    if stream:
        status, events = _stream(url, "/v1/completions", body)
        errs = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
        assert status == 200 and len(errs) == 1 and events[-1] == "[DONE]", events
        assert "before its first token again after it was sent once more" in errs[0]["message"]
        assert errs[0]["code"] == 500, errs
        # from the prefill: its first token, then the error; from the decode: the error alone
        assert _text(events) == ("t105 " if first_token == "prefill" else ""), events
    else:
        status, out = post(url + "/v1/completions", body)
        assert status == 500 and out == ERR
    assert len(_decode_legs(d)) == 2 and get_stats(url)["decode_retakes"] == 1


@pytest.mark.parametrize("shape", ["0.32", "0.26"])
def test_decode_retake_off_passes_the_error_through(vllm_like, proxy, shape):  # noqa: F811
    """--decode-retake off: vLLM's 500 as it is; a stream's failure before its
    first token an error event saying so (vLLM 0.26's empty stream too)."""
    p = vllm_like("prefill")
    d = vllm_like("decode", decode_fail="engine", engine_fails=2, engine_shape=shape)
    url = proxy([p.url], [d.url], flow="b", extra=("--decode-retake", "off",
                                                   "--first-token", "decode"))
    status, out = post(url + "/v1/completions", {"model": "m", "prompt": "a b", "max_tokens": 2,
                                                 "stream": False})
    assert status == 500 and out == ERR
    status, events = _stream(url, "/v1/completions", {"model": "m", "prompt": "a b",
                                                     "max_tokens": 2})
    errs = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    assert status == 200 and len(errs) == 1 and errs[0]["code"] == 500, events
    assert "failed the request before its first token (" in errs[0]["message"]
    assert len(_decode_legs(d)) == 2 and get_stats(url)["decode_retakes"] == 0


def test_other_decode_errors_are_not_taken_again(vllm_like, proxy):  # noqa: F811
    """A 503 (or any answer but vLLM's engine error) is the client's."""
    p, d = vllm_like("prefill"), vllm_like("decode", decode_fail="status")
    url = proxy([p.url], [d.url], flow="b", extra=("--first-token", "decode"))
    status, _ = post(url + "/v1/completions", {"model": "m", "prompt": "a b", "max_tokens": 2,
                                               "stream": True}, raw=True)
    assert status == 503
    assert len(_decode_legs(d)) == 1 and get_stats(url)["decode_retakes"] == 0


def test_push_decode_leg_is_taken_again_without_its_push_params(vllm_like, proxy):  # noqa: F811
    """Flow push: the decode leg (both legs at once) failed before its first
    token: sent once more as the client's request, kv_transfer_params
    {"mc_retake": true} in place of the push's."""
    p, d = SlowPrefill(0.0), vllm_like("decode", decode_fail="engine")
    try:
        url = proxy([p.url], [d.url], flow="push", extra=("--prefill-engine", "127.0.0.1:1"))
        body = {"model": "m", "prompt": "a b c", "max_tokens": 3}
        status, events = _stream(url, "/v1/completions", body)
        assert status == 200 and _tokens(events) == [103, 104, 105], events
        legs = _decode_legs(d)
        assert legs[0]["kv_transfer_params"]["push"] is True
        assert legs[1] == dict(body, stream=True, kv_transfer_params={"mc_retake": True})
        assert get_stats(url)["decode_retakes"] == 1
    finally:
        p.close()


def _feed(head, data, piece):
    verdict = None
    for i in range(0, len(data), piece):
        verdict = head.feed(data[i:i + piece])
        if verdict is not None:
            return verdict
    return verdict


@pytest.mark.parametrize("piece", [1, 7, 1 << 20])
def test_stream_head_verdicts(piece):
    """StreamHead over events cut anywhere: an engine error (after a role
    chunk too) FAILED; a token, a stream end, other errors, non-JSON RELAY;
    held() is every byte fed, in order."""
    role = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
    err = b"data: " + json.dumps(ERR).encode() + b"\n\n"
    tok = b'data: {"choices": [{"index": 0, "text": "x", "token_ids": [5]}]}\n\n'
    cases = [(err, proxy_retake.FAILED), (role + err, proxy_retake.FAILED),
             (b'data: {"choices": [{"text": "", "finish_reason": "error"}]}\n\n',
              proxy_retake.FAILED),
             (tok + err, proxy_retake.RELAY), (role + tok, proxy_retake.RELAY),
             (b"data: [DONE]\n\n", proxy_retake.FAILED),
             (role + b"data: [DONE]\n\n", proxy_retake.FAILED),
             (b'data: {"choices": [], "usage": {}}\n\ndata: [DONE]\n\n', proxy_retake.FAILED),
             (b'data: {"error": {"message": "bad", "code": 400}}\n\n', proxy_retake.RELAY),
             (b"data: not json\n\n", proxy_retake.RELAY),
             (b": a comment\n\n" + err, proxy_retake.FAILED),
             (role, None)]
    for data, want in cases:
        head = proxy_retake.StreamHead()
        assert _feed(head, data, piece) == want, data
        if want == proxy_retake.RELAY:
            assert head.held() == data[:len(head.held())] and len(head.held()) >= 1


def test_stream_head_holds_at_most_hold_max():
    head = proxy_retake.StreamHead()
    role = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n'
    verdict = None
    while verdict is None:
        verdict = head.feed(role)
    assert verdict == proxy_retake.RELAY
    assert proxy_retake.HOLD_MAX < len(head.held()) <= proxy_retake.HOLD_MAX + len(role)


def test_failed_answer_shapes():
    raw = json.dumps(ERR).encode()
    assert proxy_retake.failed_answer(500, raw)
    assert not proxy_retake.failed_answer(503, raw)
    assert not proxy_retake.failed_answer(500, b'{"error": {"message": "x", "code": 400}}')
    assert not proxy_retake.failed_answer(500, b"<html>")
    assert proxy_retake.failed_answer(200, b'{"choices": [{"text": "", "finish_reason": "error"}]}')
    assert not proxy_retake.failed_answer(
        200, b'{"choices": [{"text": "a", "finish_reason": "error"}]}')
    assert not proxy_retake.failed_answer(200, b'{"choices": [{"text": "a"}]}')
