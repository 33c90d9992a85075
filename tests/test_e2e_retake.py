"""A decode server on vLLM's "fail" policy behind the push proxy (pytest -m
e2e, a real vLLM CPU server): the decode leg's KV load fails, the proxy
takes the request again (mooncake_connector.proxy_retake), the client gets
its answer.

The decode runs the connector with load_failure_policy "fail" (what
push_layer_load_async needs under vLLM's asynchronous scheduling on a GPU)
and a 2 s lease; the push proxy's prefill and the decode's configured
producer are ports where nothing listens (a prefill gone), so every push
leg's load fails.  vLLM then ends the request with finish reason "error"
before any token ("Failing 1 request(s) due to KV load failure" in the
decode's log): a 500 for a non-streamed request, an error event for a
streamed one.  Checked: through the proxy (--decode-retake on, its default)
both come back 200 and token-identical to the same prompts sent straight to
the decode (computed there), one retake counted per request; with
--decode-retake off the client gets vLLM's error, as before the retake
existed (the same test against the proxy without it fails the first part).
"""
import json
import os
import tempfile
import time
import urllib.request

import pytest

from mooncake_connector import serving
from mooncake_connector.deployment import kv_transfer_configs, proxy_stats

from e2e_fixtures import tiny_model_dir  # noqa: F401

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

LEASE_S = 2.0
PROMPTS = ["the decode leg fails first then the proxy asks again " * 6,
           "a second prompt for the non streamed request of this test " * 5]


def _post(url, body, timeout=60):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _answer(url, prompt, stream):
    """(status, generated token ids or None, errors seen) of a greedy request."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "stream": stream, "return_token_ids": True}
    status, raw = _post(url, body)
    if not stream:
        out = json.loads(raw)
        if status != 200:
            return status, None, [out.get("error")]
        return status, out["choices"][0]["token_ids"], []
    toks, errors = [], []
    for ev in raw.decode().split("\n\n"):
        if not ev.startswith("data: ") or ev[6:] == "[DONE]":
            continue
        ev = json.loads(ev[6:])
        if "error" in ev:
            errors.append(ev["error"])
        for c in ev.get("choices") or ():
            toks += c.get("token_ids") or []
    return status, toks, errors


@pytest.fixture(scope="module")
def servers(tiny_model_dir):  # noqa: F811
    workdir = tempfile.mkdtemp(prefix="mc-retake-")
    logs = os.path.join(workdir, "logs")
    meta = serving.metadata_server(serving.free_port(), os.path.join(logs, "metadata.log"))
    _, dec_cfg, env = kv_transfer_configs("mooncake", workdir, meta.url)
    dec_cfg = dict(dec_cfg, kv_connector_extra_config={
        "load_failure_policy": "fail", "load_timeout_s": LEASE_S,
        "push_layer_timeout_s": LEASE_S})
    decode = serving.vllm_server("decode", tiny_model_dir, serving.free_port(),
                                 os.path.join(logs, "decode.log"), kv_transfer_config=dec_cfg,
                                 env=env)
    gone = f"http://127.0.0.1:{serving.free_port()}"  # no prefill there
    proxies = {on: serving.proxy([gone], [decode.url], serving.free_port(),
                                 os.path.join(logs, f"proxy-{on}.log"), flow="push",
                                 name=f"proxy (push, --decode-retake {on})",
                                 extra_args=("--decode-retake", on))
               for on in ("on", "off")}
    for p in proxies.values():  # its /health says degraded: the prefill is gone
        p.health_url = p.url + "/stats"
    procs = [meta, decode, *proxies.values()]
    serving.start_all(procs, 600)
    try:
        yield decode, proxies
    finally:
        serving.stop_all(procs)


def test_a_failed_push_load_is_taken_again_and_answered(servers):
    decode, proxies = servers
    for prompt, stream in zip(PROMPTS, (True, False)):
        st, ref, errs = _answer(decode.url, prompt, stream)  # computed at the decode
        assert st == 200 and len(ref) == 8 and not errs, (st, errs)
        t0 = time.monotonic()
        st, got, errs = _answer(proxies["on"].url, prompt, stream)
        took = time.monotonic() - t0
        assert st == 200 and not errs, (stream, st, errs)
        assert got == ref, (stream, got, ref)
        # the push leg's load failed first (its lease, at most, plus the
        # producer's grace) and the retake computed the prompt
        assert took < LEASE_S + 15, took
    assert proxy_stats(proxies["on"].url)["decode_retakes"] == 2
    with open(decode.log_path, encoding="utf-8", errors="replace") as f:
        failed = f.read().count("due to KV load failure")
    assert failed >= 2, "the decode's vLLM did not fail the loads: the test tests nothing"


def test_with_decode_retake_off_the_client_gets_vllms_error(servers):
    decode, proxies = servers
    st, toks, errs = _answer(proxies["off"].url, PROMPTS[0], True)
    assert st == 200 and not toks and errs and errs[0].get("code") == 500, (st, toks, errs)
    st, toks, errs = _answer(proxies["off"].url, PROMPTS[1], False)
    assert st == 500 and toks is None, (st, errs)
    assert proxy_stats(proxies["off"].url)["decode_retakes"] == 0
