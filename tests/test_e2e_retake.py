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
the decode (computed there), one retake counted per request, and the decode
counted each as a recompute of reason "retake" (the retake's
kv_transfer_params {"mc_retake": true}: computed, neither loaded again nor
probed at the configured producer); with
--decode-retake off the client gets vLLM's error, as before the retake
existed (the same test against the proxy without it fails the first part).

The first token from the prefill (the proxy's default for streamed requests,
proxy_first_token.stream(), flows a and b; flow push's first token always
comes from the decode, the _relay path above): a real prefill server answers
and the client gets its first token from that answer; then the decode leg
that continues from it fails its KV load, the decode ends it with an error,
and the proxy takes it once more.  Deterministic: the prefill registers with
a metadata server of its own, not the decode's (one deployment's two sides
pointed at two metadata servers, or a metadata server restarted and emptied
under them), so the flow-b pull of the prompt it names cannot find its peer
("key ... not found on metadata server" in the decode's log) and fails at
once, while the prefill computes and answers normally; no timing (a lease
racing the prefill, a SIGSTOP after its answer) decides it.  The retake
({"mc_retake": true}) is computed at the decode.  Checked through a flow-b
proxy: HTTP 200, no error event, token ids identical to the same greedy
prompt computed by the decode alone, first_token_from_prefill and
decode_retakes each up by one; with --decode-retake off the client gets the
first token, then an error event (code 500, proxy_retake.failure_message),
never a stream that ends with no error.  Flow a (the decode probes its
configured producer; a miss there is computed, not failed) fails a load only
when a probe's hit is followed by a failed pull, a race: not exercised here;
its retake is the same {"mc_retake": true} request (tests/test_proxy_retake.py).
"""
import json
import os
import tempfile
import time
import urllib.request

import pytest

from mooncake_connector import proxy_retake, serving
from mooncake_connector.deployment import kv_transfer_configs, proxy_stats, scrape_metrics

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
    pre_cfg, dec_cfg, env = kv_transfer_configs("mooncake", workdir, meta.url)
    dec_cfg = dict(dec_cfg, kv_connector_extra_config={
        "load_failure_policy": "fail", "load_timeout_s": LEASE_S,
        "push_layer_timeout_s": LEASE_S})
    decode = serving.vllm_server("decode", tiny_model_dir, serving.free_port(),
                                 os.path.join(logs, "decode.log"), kv_transfer_config=dec_cfg,
                                 env=env)
    # The first token from the prefill: a real prefill (our producer) on a
    # metadata server of its own, so the decode's pull of its prompt fails.
    pre_meta = serving.metadata_server(serving.free_port(),
                                       os.path.join(logs, "metadata-prefill.log"))
    with open(env["MOONCAKE_CONFIG_PATH"]) as f:
        dec_json = json.load(f)
    pre_port = serving.free_port(4, away=[dec_json["prefill_url"], dec_json["decode_url"]])
    pre_json = dict(dec_json, prefill_url=f"127.0.0.1:{pre_port}",
                    metadata_server=pre_meta.url)
    prefill_engine = pre_json["prefill_url"]  # its transfer engine's name
    pre_path = os.path.join(workdir, "mooncake-prefill.json")
    with open(pre_path, "w") as f:
        json.dump(pre_json, f, indent=1)
    prefill = serving.vllm_server(
        "prefill", tiny_model_dir, serving.free_port(), os.path.join(logs, "prefill.log"),
        kv_transfer_config=pre_cfg,
        env={"MOONCAKE_CONFIG_PATH": pre_path,
             "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(serving.free_port())})
    prefill.engine = prefill_engine
    ft_proxies = {on: serving.proxy([prefill.url], [decode.url], serving.free_port(),
                                    os.path.join(logs, f"proxy-b-{on}.log"), flow="b",
                                    name=f"proxy (flow b, --decode-retake {on})",
                                    extra_args=("--decode-retake", on))
                  for on in ("on", "off")}
    gone = f"http://127.0.0.1:{serving.free_port()}"  # no prefill there
    proxies = {on: serving.proxy([gone], [decode.url], serving.free_port(),
                                 os.path.join(logs, f"proxy-{on}.log"), flow="push",
                                 name=f"proxy (push, --decode-retake {on})",
                                 extra_args=("--decode-retake", on))
               for on in ("on", "off")}
    for p in proxies.values():  # its /health says degraded: the prefill is gone
        p.health_url = p.url + "/stats"
    procs = [meta, pre_meta, decode, prefill, *proxies.values(), *ft_proxies.values()]
    serving.start_all(procs, 600)
    try:
        yield decode, proxies, prefill, ft_proxies
    finally:
        serving.stop_all(procs)


def _held(server):
    """The prefill's (lookup entries, held bytes)."""
    m = scrape_metrics(server.url) or {}
    return (m.get("vllm:mooncake_lookup_entries", 0), m.get("vllm:mooncake_held_bytes", 0))


def _released(prefill, base, within_s=10.0):
    """Whether the prefill's holds are back at base within within_s: the
    proxy told it to release the prompt whose pull failed (its
    hold_timeout_s is 120 s)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if _held(prefill) <= base:
            return True
        time.sleep(0.2)
    return False


def _load_failures(decode, why="due to KV load failure"):
    with open(decode.log_path, encoding="utf-8", errors="replace") as f:
        return f.read().count(why)


def _recomputes(decode, reason):
    """The decode's vllm:mooncake_recomputes_total for one reason."""
    return (scrape_metrics(decode.url) or {}).get(f"vllm:mooncake_recomputes_total{{{reason}}}",
                                                  0)


def test_a_failed_push_load_is_taken_again_and_answered(servers):
    decode, proxies = servers[:2]
    retakes0 = _recomputes(decode, "retake")
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
    assert _load_failures(decode) >= 2, "the decode's vLLM did not fail the loads: the test tests nothing"
    # each retake was computed as one ({"mc_retake": true}), not probed at the
    # decode's configured producer (nothing listens there: that would count
    # producer_unreachable) nor loaded again
    deadline = time.monotonic() + 15
    while _recomputes(decode, "retake") < retakes0 + 2 and time.monotonic() < deadline:
        time.sleep(0.5)  # the counters come with the decode's next stats
    assert _recomputes(decode, "retake") == retakes0 + 2, scrape_metrics(decode.url)


def test_with_decode_retake_off_the_client_gets_vllms_error(servers):
    decode, proxies = servers[:2]
    st, toks, errs = _answer(proxies["off"].url, PROMPTS[0], True)
    assert st == 200 and not toks and errs and errs[0].get("code") == 500, (st, toks, errs)
    st, toks, errs = _answer(proxies["off"].url, PROMPTS[1], False)
    assert st == 500 and toks is None, (st, errs)
    assert proxy_stats(proxies["off"].url)["decode_retakes"] == 0


FT_PROMPTS = ["the prefill answers first and then the decode cannot load it " * 5,
              "with the retake off the client gets the first token and an error " * 5]


def test_first_token_from_prefill_then_a_failed_load_is_taken_again(servers):
    """The prefill answered (its token is the client's first), the decode's
    load of that prompt failed, the proxy took the decode leg once more."""
    decode, _, prefill, ft_proxies = servers
    url = ft_proxies["on"].url
    st, ref, errs = _answer(decode.url, FT_PROMPTS[0], True)  # computed at the decode
    assert st == 200 and len(ref) == 8 and not errs, (st, errs)
    # the pull of the prefill's prompt, not found on the decode's metadata server
    unregistered = f"segment {prefill.engine} is not registered"
    before, failed = proxy_stats(url), _load_failures(decode, unregistered)
    base = _held(prefill)
    st, got, errs = _answer(url, FT_PROMPTS[0], True)
    after = proxy_stats(url)
    assert st == 200 and not errs, (st, errs)
    assert got == ref, (got, ref)
    assert after["first_token_from_prefill"] == before["first_token_from_prefill"] + 1, after
    assert after["decode_retakes"] == before["decode_retakes"] + 1, after
    assert _load_failures(decode, unregistered) > failed, \
        "the decode's pull did not fail as meant: the test tests nothing"
    # the pull the prefill held the prompt for will not come: released once
    # the retake ended, not held to its hold_timeout_s
    assert _released(prefill, base), (_held(prefill), base)
    assert proxy_stats(url)["prefill_releases_sent"] == before["prefill_releases_sent"] + 1


def test_first_token_from_prefill_retake_off_ends_with_an_error_event(servers):
    decode, _, prefill, ft_proxies = servers
    url = ft_proxies["off"].url
    st, ref, errs = _answer(decode.url, FT_PROMPTS[1], True)
    assert st == 200 and len(ref) == 8 and not errs, (st, errs)
    before, base = proxy_stats(url), _held(prefill)
    st, got, errs = _answer(url, FT_PROMPTS[1], True)
    after = proxy_stats(url)
    # the prefill's token, then the decode's failure as an error event
    assert st == 200 and got == ref[:1], (st, got, ref)
    assert len(errs) == 1 and errs[0].get("code") == 500, errs
    assert errs[0]["message"] == proxy_retake.failure_message(
        f"decode instance {decode.url}", False), errs
    assert after["first_token_from_prefill"] == before["first_token_from_prefill"] + 1, after
    assert after["decode_retakes"] == before["decode_retakes"] == 0, after
    assert _released(prefill, base), (_held(prefill), base)
