"""Disaggregated serving with real vLLM servers, end to end (pytest -m e2e).

Prefill (kv_producer) and decode (kv_consumer) vLLM servers behind our proxy
must give token-identical greedy output to a colocated server, for
completions and chat, streamed or not, short and long prompts with shared
prefixes, in both proxy flows; the decode server must have loaded the prompt's
KV through the connector rather than recomputed it.  Streamed requests take
the proxy's first-token-from-prefill path (the decode server must see the
prompt plus that token); test_e2e_first_token.py covers that path's own
cases (sampling, failures after the first chunk, fallbacks).  The fault test (last in
this file: it restarts the prefill server) kills the prefill server mid-run.
"""
import concurrent.futures
import threading
import time

import pytest

from conftest import wait_until
from mooncake_connector.demo import _prompt
from mooncake_connector.deployment import metric_value, prompt_tokens_by_source, proxy_stats
from mooncake_connector.openai_client import request
from mooncake_connector.serving import http_get

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

BLOCK = 32          # --block-size of the servers
REQ_TIMEOUT = 120   # s, per request


def _words(seed, n):
    return _prompt(n, seed)  # the demo's deterministic words


SHARED = _words(1, 300)  # a long shared prefix (system-prompt-like)


def _cases():
    """24 requests: (id, path, body without model/sampling)."""
    cases = []
    prompts = [("short", "hello world"), ("short2", "one two three"),
               ("medium", _words(2, 60)), ("long", _words(3, 400)),
               ("verylong", _words(4, 1200)), ("prefix1", SHARED + " and then the fox"),
               ("prefix2", SHARED + " but the dog sleeps well"),
               ("prefix3", SHARED + _words(5, 90))]
    for name, prompt in prompts:
        for stream in (False, True):
            cases.append((f"cmpl-{name}-{'stream' if stream else 'full'}", "/v1/completions",
                          {"prompt": prompt, "stream": stream}))
    chats = [("short", [{"role": "user", "content": "hi there"}]),
             ("long", [{"role": "system", "content": SHARED},
                       {"role": "user", "content": _words(6, 51)}]),
             ("multi", [{"role": "system", "content": SHARED},
                        {"role": "user", "content": _words(7, 40)},
                        {"role": "assistant", "content": _words(8, 30)},
                        {"role": "user", "content": _words(9, 200)}]),
             ("medium", [{"role": "user", "content": _words(10, 150)}])]
    for name, msgs in chats:
        for stream in (False, True):
            cases.append((f"chat-{name}-{'stream' if stream else 'full'}",
                          "/v1/chat/completions", {"messages": msgs, "stream": stream}))
    return cases


CASES = _cases()


def _body(base, max_tokens=12):
    b = dict(base, model="tiny", temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
             return_token_ids=True)
    if b.get("stream"):
        b["stream_options"] = {"include_usage": True}
    return b


def _reference(dep, path, base):
    """The colocated server's greedy tokens (non-streamed)."""
    r = request(dep.colocated.url, path, _body(dict(base, stream=False)), timeout=REQ_TIMEOUT)
    assert r.status == 200, f"colocated server: {r.status} {r.error}"
    assert r.token_ids, f"no token_ids in the colocated answer: {r.body}"
    return r


@pytest.fixture(scope="module")
def references(deployment):
    return {cid: _reference(deployment, path, base) for cid, path, base in CASES}


def _cases_for(dep, references):
    """All cases; for the stand-in ExampleConnector, less those whose prompt
    length is 1 mod the block size: that connector looks a prompt up by its
    first (n-2)//32*32 tokens but loads (n-1)//32*32, so it fails on them
    (FileNotFoundError in start_load_kv, the engine dies)."""
    if dep.connector != "example":
        return CASES
    return [c for c in CASES if references[c[0]].usage["prompt_tokens"] % BLOCK != 1]


def _check_flow(dep, flow, references):
    """Sends every case through the proxy, one at a time; each answer must
    equal the colocated one, and vLLM's counters on the decode server must
    show the prompt's KV came through the connector (per request: the
    external_kv_transfer delta), not from local compute."""
    start = before = prompt_tokens_by_source(dep.decode.url)
    stats0 = proxy_stats(dep.proxies[flow].url)
    mismatches, not_loaded, wrong_path = [], [], []
    loaded = 0
    cases = _cases_for(dep, references)
    assert len(cases) >= 20
    partial = 0  # streamed requests the proxy sent the seed's way for a first
    # token's text (U+FFFD; or a partial character not settled: the decode
    # leg ran, then the original request: proxy_first_token._settle)

    def fallbacks():
        fb = proxy_stats(dep.proxies[flow].url)["first_token_fallbacks"]
        return (fb.get("first token's text has U+FFFD", 0),
                sum(n for k, n in fb.items() if k.startswith("partial first token")))

    for cid, path, base in cases:
        ref = references[cid]
        fb0 = fallbacks()
        r = request(dep.proxies[flow].url, path, _body(base), timeout=REQ_TIMEOUT)
        fell_back, unsettled = (a - b for a, b in zip(fallbacks(), fb0))
        fell_back += unsettled
        partial += fell_back
        assert r.status == 200 and r.error is None, (
            f"{cid} via proxy flow {flow}: {r.status} {r.error}")
        after = prompt_tokens_by_source(dep.decode.url)
        ext = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
        seen = sum(after.values()) - sum(before.values())
        before = after
        if r.token_ids != ref.token_ids:
            mismatches.append(f"{cid}: colocated {ref.token_ids} vs disaggregated {r.token_ids}")
        if r.text != ref.text:
            mismatches.append(f"{cid}: colocated text {ref.text!r} vs disaggregated "
                              f"{r.text!r}")
        n = r.usage["prompt_tokens"]
        assert n == ref.usage["prompt_tokens"], cid
        # First token from prefill: a streamed request's decode leg is the
        # prompt plus the token the client already has (n + 1 prompt tokens
        # on the decode server); a non-streamed one is the original (n).
        # (A first token whose text is U+FFFD takes the seed's path: the
        # decode leg is the original n; one inside a character that could
        # not be settled: n + 1, then the original n.)
        want = n + 1 if base.get("stream") and not fell_back and \
            not flow.startswith("push") else n + unsettled * (n + 1)
        if seen != want:
            wrong_path.append(f"{cid}: decode server saw a {seen}-token prompt, expected "
                              f"{want} ({n} + the prefill's token)" if base.get("stream")
                              else f"{cid}: decode saw {seen} prompt tokens, expected {n}")
        # Every full block before the last prompt token must have come from the
        # connector (decode recomputes at most the rest; a connector may also
        # supply all n, vLLM then recomputes the last token).
        # (A streamed request's decode prompt is n + 1 tokens: the first
        # token's slot may be claimed too and is then computed, docs/connector.md.)
        need = (n - 1) // BLOCK * BLOCK
        if ext < need or ext > (n + 1 if base.get("stream") else n) + unsettled * n:
            not_loaded.append(f"{cid}: {n} prompt tokens, {ext} loaded remotely "
                              f"(expected >= {need})")
        # Flow a: the answer's usage says the same.  (Flow b: vLLM reports
        # cached_tokens 0 for requests with do_remote_prefill params although
        # its counters show the load; docs/vllm-cpu.md.)
        if flow == "a" and r.cached_tokens != min(ext, n):
            not_loaded.append(f"{cid}: usage says {r.cached_tokens} cached, counters {ext}")
        loaded += ext
    end = prompt_tokens_by_source(dep.decode.url)
    stats1 = proxy_stats(dep.proxies[flow].url)
    streamed = sum(1 for c in cases if c[2].get("stream"))
    served = stats1["first_token_from_prefill"] - stats0["first_token_from_prefill"]
    if flow.startswith("push"):  # first token from decode, always
        streamed = partial = 0
    assert served == streamed - partial, (
        f"proxy flow {flow} served {served} of {streamed} streamed requests' first token "
        f"from prefill ({partial} partial UTF-8 first tokens); fallbacks "
        f"{stats1['first_token_fallbacks']}")
    assert not wrong_path, "decode leg not continuing from the first token:\n" + "\n".join(
        wrong_path)
    assert not mismatches, "disaggregated output differs from colocated:\n" + "\n".join(
        mismatches)
    assert not not_loaded, "prompt KV not loaded remotely on decode:\n" + "\n".join(not_loaded)
    local = end.get("local_compute", 0) - start.get("local_compute", 0)
    assert local < loaded / 4, f"decode computed {local} prompt tokens locally vs {loaded} loaded"
    return loaded


def test_many_prompts_through_the_proxy_flow_a(deployment, references):
    """The seed's flow: prefill with max_tokens=1, then decode finds the KV."""
    assert _check_flow(deployment, "a", references) > 5000


def test_many_prompts_through_the_proxy_flow_b(deployment, references):
    """vLLM's flow: the prefill answer's kv_transfer_params go to decode."""
    if deployment.connector == "example":
        pytest.skip("vLLM's ExampleConnector (the stand-in) returns no kv_transfer_params")
    assert _check_flow(deployment, "b", references) > 5000


def test_many_prompts_through_the_proxy_flow_push(deployment, references):
    """Push: both legs at once; the decode admits first and the prefill
    writes the prompt's KV into its blocks (our engine's WRITEs, counted by
    the prefill's vllm:mooncake_push_sends_total)."""
    if deployment.connector == "example":
        pytest.skip("push is this connector's flow")
    sends0 = metric_value(deployment.prefill.url, "vllm:mooncake_push_sends_total")
    assert _check_flow(deployment, "push", references) > 5000
    sends = metric_value(deployment.prefill.url, "vllm:mooncake_push_sends_total") - sends0
    # Every prompt with a full block was pushed (shorter ones have nothing to move).
    want = sum(1 for cid, _, _ in _cases_for(deployment, references)
               if references[cid].usage["prompt_tokens"] >= BLOCK)
    assert want >= 10 and sends >= want, (sends, want)


def test_many_prompts_through_push_layer_load(deployment, references):
    """Push with push_layer_load: the decode schedules each request at once
    and its attention waits per layer for the pushed KV (in-step loads,
    counted by vllm:mooncake_push_layer_loads_total); token-identical."""
    if deployment.connector == "example":
        pytest.skip("push is this connector's flow")
    in_step0 = metric_value(deployment.decode.url, "vllm:mooncake_push_layer_loads_total")
    failed0 = metric_value(deployment.decode.url, "vllm:mooncake_load_failures_total")
    assert _check_flow(deployment, "push-layer-load", references) > 5000
    in_step = metric_value(deployment.decode.url, "vllm:mooncake_push_layer_loads_total") - \
        in_step0
    failed = metric_value(deployment.decode.url, "vllm:mooncake_load_failures_total") - failed0
    # Prompts over one block load in the step (a one-block prompt keeps its
    # block for the decode's own last token: the regular push).
    want = sum(1 for cid, _, _ in _cases_for(deployment, references)
               if references[cid].usage["prompt_tokens"] > BLOCK)
    assert want >= 10 and in_step >= want and failed == 0, (in_step, want, failed)


def test_concurrent_requests_match(deployment, references):
    """Eight requests in flight at once through the proxy still match."""
    picked = [c for c in _cases_for(deployment, references) if "stream" in c[0]][:8]
    with concurrent.futures.ThreadPoolExecutor(len(picked)) as pool:
        futs = {cid: pool.submit(request, deployment.proxies["a"].url, path, _body(base),
                                 REQ_TIMEOUT) for cid, path, base in picked}
        for cid, fut in futs.items():
            r = fut.result(timeout=REQ_TIMEOUT + 10)
            assert r.status == 200, (cid, r.error)
            assert r.token_ids == references[cid].token_ids, cid


SHARED_ID_CASES = ["cmpl-medium-full", "cmpl-long-stream", "cmpl-verylong-full",
                   "cmpl-prefix3-stream", "chat-medium-full", "chat-long-stream"]


def one_id_batch(proxy_url, refs, rid):
    """refs' cases ({case id: reference answer}) sent through the proxy at
    once, all with X-Request-Id rid: each answer must be 200 and equal its
    own reference.  (Not whether the decode loaded their KV: six prefills at
    once may keep the producer from answering flow A's lookup within
    lookup_timeout_s, and the decode then computes the prompt, by design.)"""
    cases = {cid: (path, base) for cid, path, base in CASES}
    with concurrent.futures.ThreadPoolExecutor(len(refs)) as pool:
        futs = {cid: pool.submit(request, proxy_url, cases[cid][0], _body(cases[cid][1]),
                                 REQ_TIMEOUT, {"X-Request-Id": rid}) for cid in refs}
        got = {cid: fut.result(timeout=REQ_TIMEOUT + 10) for cid, fut in futs.items()}
    bad = [f"{cid}: {r.status} {r.error}" for cid, r in got.items()
           if r.status != 200 or r.error is not None]
    assert not bad, bad
    mixed = [f"{cid}: reference {refs[cid].token_ids} vs {r.token_ids}"
             for cid, r in got.items() if r.token_ids != refs[cid].token_ids]
    assert not mixed, "answers differ from their own prompt's:\n" + "\n".join(mixed)


@pytest.mark.parametrize("flow", ["a", "b", "push"])
def test_concurrent_requests_sharing_one_x_request_id(deployment, references, flow):
    """Clients that put one X-Request-Id on requests in flight together (a
    fixed id, a retry sent while the first try still runs): six different
    prompts at once, one id; each answer is its own prompt's, token-identical
    to the colocated server's (tests/test_e2e_request_ids.py: vLLM servers
    that keep ids as given)."""
    if flow != "a" and deployment.connector == "example":
        pytest.skip("flows b and push need this connector")
    picked = [c for c in SHARED_ID_CASES if c in {x[0] for x in _cases_for(deployment,
                                                                            references)}]
    assert len(picked) >= 4
    one_id_batch(deployment.proxies[flow].url,
                 {c: references[c] for c in picked}, f"one-id-for-all-{flow}")


def test_serving_demo_against_the_session_servers(deployment):
    """README command 1's request phase (mooncake_connector.demo.run_requests)."""
    from mooncake_connector.demo import run_requests

    lines = []
    s = run_requests(deployment, n_requests=3, max_tokens=8, out=lines.append)
    assert s["all_identical"] and s["all_loaded"], s
    assert s["kv_bytes_moved"] == s["kv_tokens_moved"] * s["kv_bytes_per_token"] > 0
    assert len(lines) == 3 and all("identical" in line for line in lines)
    assert s["ttft_disaggregated_ms_p50"] > 0 and s["ttft_colocated_ms_p50"] > 0
    if deployment.connector == "mooncake":  # our connector's own counters agree
        c = s["connector_stats"]
        assert c.get("load_bytes") == c.get("load_tokens") * s["kv_bytes_per_token"] > 0, c


def test_prefill_killed_mid_run_then_restarted(deployment, references):
    """Requests keep flowing while the prefill server is SIGKILLed: every one
    ends (an answer or a clear error) without hanging and the proxy stays up.
    A prompt prefilled before the kill, sent to decode afterwards, is either
    recomputed (same tokens) or refused clearly.  After a restart requests
    succeed and match again.  (Last in this module: it restarts a server.)"""
    dep = deployment
    cases = _cases_for(dep, references)
    streamed = [c for c in cases if c[0].endswith("-stream")]
    orphan_id, orphan_path, orphan_base = next(c for c in cases if c[0].startswith("cmpl-long"))
    pre = request(dep.prefill.url, orphan_path, dict(_body(orphan_base), max_tokens=1),
                  timeout=REQ_TIMEOUT)
    assert pre.status == 200, pre.error
    results, stop = [], threading.Event()

    def client():
        i = 0
        while not stop.is_set():
            cid, path, base = streamed[i % len(streamed)]
            t0 = time.monotonic()
            r = request(dep.proxies["a"].url, path, _body(base), timeout=REQ_TIMEOUT)
            results.append((cid, r, time.monotonic() - t0))
            i += 1

    threads = [threading.Thread(target=client, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    # the kill lands while requests flow: once two have been answered
    wait_until(lambda: len(results) >= 2, timeout=REQ_TIMEOUT)
    dep.prefill.kill()
    killed_at = len(results)
    # and they keep flowing until one sent after the kill has failed (at
    # most two were in flight at the kill: three failures)
    wait_until(lambda: sum(r.status != 200 for _, r, _ in results[killed_at:]) >= 3,
               timeout=REQ_TIMEOUT)
    stop.set()
    for t in threads:
        t.join(timeout=REQ_TIMEOUT + 10)
        assert not t.is_alive(), "a client request hung after the prefill server was killed"
    assert killed_at > 0, "no request completed before the kill"
    errors = [(cid, r) for cid, r, _ in results if r.status != 200]
    assert errors, "no request failed although the prefill server was dead"
    for cid, r in errors:
        assert r.status == 502 and "prefill instance" in r.error and "unreachable" in r.error, (
            cid, r.status, r.error)
    for cid, r, took in results:
        assert took < REQ_TIMEOUT, (cid, took)
        if r.status == 200:
            assert r.token_ids == references[cid].token_ids, cid
    status, body = http_get(dep.proxies["a"].url + "/health")
    assert status == 503 and "degraded" in body, (status, body)

    # Decode on its own, for a prompt whose prefill finished before the kill.
    t0 = time.monotonic()
    r = request(dep.decode.url, orphan_path, _body(orphan_base), timeout=REQ_TIMEOUT)
    took = time.monotonic() - t0
    assert took < 90, f"decode took {took:.0f} s with the prefill server gone"
    if r.status == 200:
        assert r.token_ids == references[orphan_id].token_ids
    else:
        assert r.status >= 400 and r.error and "Traceback" not in r.error, r
    assert dep.decode.alive, "the decode server died"

    dep.restart_prefill()
    for cid, path, base in cases[:6]:
        r = request(dep.proxies["a"].url, path, _body(base), timeout=REQ_TIMEOUT)
        assert r.status == 200, (cid, r.error)
        assert r.token_ids == references[cid].token_ids, cid
    status, body = http_get(dep.proxies["a"].url + "/health")
    assert status == 200, (status, body)
