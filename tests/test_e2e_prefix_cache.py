"""Disaggregated serving with vLLM's prefix caching ON (pytest -m e2e).

Every other real-server test runs vLLM with --no-enable-prefix-caching
(serving.BASE_VLLM_ARGS: every prompt token is then either computed or
transferred).  Users run the seed's commands, i.e. vLLM's default: prefix
caching on, on the prefill and on the decode.  This module starts one
deployment that way (Deployment(prefix_caching=True): prefill, decode and the
colocated reference all keep vLLM's default) and sends, through the proxy's
flows a, b, push and push with push_layer_load, prompts that exercise the
cache on both sides:

* a new prompt (nothing cached anywhere: loaded remotely),
* the same prompt again (the decode has every full block before the last
  token locally: nothing may be loaded; the prefill recomputes only its tail),
* a strict extension of it (the decode has the first prompt's blocks: only
  the rest is loaded),
* two prompts sharing a long system-prompt-like prefix with different tails
  (the second loads only what follows the shared blocks),
* a block-aligned prompt (token ids), twice, and a prompt of < 1 block, twice,
* a streamed request (first token from the prefill: the decode's prompt is
  one token longer than the prefill's),
* several requests at once sharing a new prefix.

Each answer must be greedy token-identical to the colocated server (prefix
caching on) and to the same server with a fresh cache_salt per request (no
prefix reuse: what --no-enable-prefix-caching computes).  vLLM's per-request
source counters on the decode (local_cache_hit / external_kv_transfer /
local_compute) must show the prompt's full blocks before its last token came
from the local cache or the connector, with no remote load of what the
decode had locally, and no recompute warning; the prefill's own counters
show it took repeated prefixes from its cache; in flows a and b the decode
released (vllm:mooncake_load_releases_total) each prompt it had cached, so
the prefill does not hold it for hold_timeout_s.  At the end the servers'
logs have no error and every server is idle within 30 s: no request running
or waiting, no KV held or listed by the prefill, no load in flight on the
decode.  Before the fix in SchedulerSide._release / get_num_new_matched_tokens
this failed: push loaded a cached block-aligned prompt's last block from the
prefill, and the prefill still held 6 prompts (flows a and b) after 30 s.
Runtime: ~2 min on 2 cores, most of it the servers' start.
"""
import concurrent.futures
import os
import re
import time
import uuid

import pytest

from mooncake_connector.demo import _prompt
from mooncake_connector.deployment import (connector_log_stats, log_size, metric_value,
                                           parse_metrics, prompt_tokens_by_source)
from mooncake_connector.openai_client import request
from mooncake_connector.serving import http_get

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

BLOCK = 32
REQ_TIMEOUT = 120
FLOWS = ("a", "b", "push", "push-layer-load")
# The prefill's held KV and the decode's loads: back to 0 within this once
# the requests are done (a hold that waits for hold_timeout_s, 120 s, fails).
IDLE_WAIT_S = 30


@pytest.fixture(scope="module")
def pc_dep(tiny_model_dir):
    from e2e_fixtures import start_deployment

    # Flows a, b, push and push-layer-load, as tests/e2e_fixtures.py's deployment.
    dep = start_deployment("mc-e2e-pc-", tiny_model_dir, prefix_caching=True)
    for p in (dep.prefill, dep.decode, dep.colocated):
        assert "--no-enable-prefix-caching" not in p.cmd, p.cmd
    dep.log_starts = {p.name: log_size(p.log_path) for p in dep.processes}
    yield dep
    dep.stop()


def _words(seed, n):
    return _prompt(n, seed)


def _ids(seed, n):
    """n token ids of the tiny model's vocabulary (415 ids), deterministic."""
    x = seed * 7919 + 3
    out = []
    for _ in range(n):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(20 + x % 380)
    return out


def _body(prompt, stream=False, **extra):
    b = {"model": "tiny", "prompt": prompt, "temperature": 0.0, "max_tokens": 8,
         "ignore_eos": True, "return_token_ids": True, "stream": stream, **extra}
    if stream:
        b["stream_options"] = {"include_usage": True}
    return b


def _ok(r, who):
    assert r.status == 200 and r.error is None, f"{who}: {r.status} {r.error}"
    assert r.token_ids, f"{who}: no token_ids: {r.body}"
    return r


def _references(dep, prompt):
    """(colocated with its prefix cache, colocated with no prefix reuse)."""
    ref = _ok(request(dep.colocated.url, "/v1/completions", _body(prompt), timeout=REQ_TIMEOUT),
              "colocated")
    fresh = _ok(request(dep.colocated.url, "/v1/completions",
                        _body(prompt, cache_salt=uuid.uuid4().hex), timeout=REQ_TIMEOUT),
                "colocated (fresh cache_salt)")
    assert fresh.cached_tokens == 0, fresh.usage
    return ref, fresh


def _cases(flow):
    """[(id, prompt, stream, expect)] sent one at a time, in order; expect:
    "new" (nothing of it on the decode: every full block before the last
    token loaded), "hit" (the decode has all of those locally: nothing
    loaded), "partial" (some locally, the rest loaded)."""
    s = 100 * (FLOWS.index(flow) + 1)  # prompts of their own per flow
    first = _words(s, 150)
    system = _words(s + 1, 260)
    aligned = _ids(s + 2, 4 * BLOCK)
    short = _ids(s + 3, 20)
    return [
        ("new", first, False, "new"),
        ("same-again", first, False, "hit"),
        ("extension", first + " " + _words(s + 4, 90), False, "partial"),
        ("shared-1", system + " " + _words(s + 5, 40), False, "new"),
        ("shared-2", system + " " + _words(s + 6, 25), False, "partial"),
        ("aligned", aligned, False, "new"),
        ("aligned-again", aligned, False, "hit"),
        ("short", short, False, "new"),
        ("short-again", short, False, "hit"),
        ("shared-stream", system + " " + _words(s + 7, 33), True, "partial"),
        ("same-again-stream", first, True, "hit"),
    ]


def _counts(url):
    c = prompt_tokens_by_source(url)
    return {k: c.get(k, 0) for k in ("local_cache_hit", "external_kv_transfer",
                                     "local_compute")}


@pytest.mark.parametrize("flow", FLOWS)
def test_prefix_cache_flow(pc_dep, flow):
    dep = pc_dep
    url = dep.proxies[flow].url
    problems = []
    before = _counts(dep.decode.url)
    released0 = metric_value(dep.decode.url, "vllm:mooncake_load_releases_total")
    prefill0 = _counts(dep.prefill.url)
    loaded = 0
    for cid, prompt, stream, expect in _cases(flow):
        ref, fresh = _references(dep, prompt)
        r = _ok(request(url, "/v1/completions", _body(prompt, stream), timeout=REQ_TIMEOUT),
                f"{cid} via flow {flow}")
        after = _counts(dep.decode.url)
        d = {k: after[k] - before[k] for k in after}
        before = after
        hit, ext, comp = d["local_cache_hit"], d["external_kv_transfer"], d["local_compute"]
        loaded += ext
        n = r.usage["prompt_tokens"]
        if r.token_ids != ref.token_ids or r.token_ids != fresh.token_ids:
            problems.append(f"{cid}: tokens {r.token_ids}; colocated {ref.token_ids}; "
                            f"colocated, no prefix reuse {fresh.token_ids}")
        # The decode's prompt: n tokens, or n + 1 when the proxy served a
        # streamed request's first token from the prefill (flows a and b).
        m = n + 1 if stream and not flow.startswith("push") else n
        seen = hit + ext + comp
        need = (m - 1) // BLOCK * BLOCK  # full blocks before the last token
        line = (f"{cid} ({expect}, {m} tokens on the decode): local hit {hit}, loaded {ext}, "
                f"computed {comp}")
        print(line)
        if seen != m:
            problems.append(f"{line}: the decode saw {seen} prompt tokens, expected {m}")
        if hit + ext < need:
            problems.append(f"{line}: fewer than the {need} tokens of its full blocks came "
                            "from the cache or the connector")
        if expect == "hit" and (ext or hit < need):
            problems.append(f"{line}: expected every full block from the local cache, "
                            "nothing loaded")
        if expect == "new" and hit:
            problems.append(f"{line}: expected nothing cached locally")
        if expect == "partial" and not (0 < hit < need and ext > 0):
            problems.append(f"{line}: expected part from the local cache, the rest loaded")
    assert not problems, f"flow {flow}:\n" + "\n".join(problems)
    assert loaded > 0
    # Flows a and b: each prompt the decode had cached (same-again,
    # aligned-again, same-again-stream) was released at the prefill, not
    # held for a pull until hold_timeout_s.  (Push: a cancel instead.)
    released = metric_value(dep.decode.url, "vllm:mooncake_load_releases_total") - released0
    # The prefill took the repeated prompts and shared prefixes from its own
    # prefix cache (and published blocks it did not compute for them).
    prefill_hit = _counts(dep.prefill.url)["local_cache_hit"] - prefill0["local_cache_hit"]
    assert prefill_hit >= 3 * 128, prefill_hit
    if not flow.startswith("push"):
        assert released >= 3, released


def _concurrent(dep, flow, seed, n=6):
    system = _words(seed, 200)
    prompts = [system + " " + _words(seed + 1 + i, 10 + 7 * i) for i in range(n)]
    refs = [_references(dep, p) for p in prompts]
    before = _counts(dep.decode.url)
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futs = [pool.submit(request, dep.proxies[flow].url, "/v1/completions", _body(p),
                            REQ_TIMEOUT) for p in prompts]
        got = [f.result(timeout=REQ_TIMEOUT + 10) for f in futs]
    after = _counts(dep.decode.url)
    for i, (r, (ref, fresh)) in enumerate(zip(got, refs)):
        _ok(r, f"concurrent {i} via flow {flow}")
        assert r.token_ids == ref.token_ids == fresh.token_ids, (i, r.token_ids,
                                                                   ref.token_ids, fresh.token_ids)
    d = {k: after[k] - before[k] for k in after}
    n_tok = [r.usage["prompt_tokens"] for r in got]
    need = sum((k - 1) // BLOCK * BLOCK for k in n_tok)
    assert sum(d.values()) == sum(n_tok), (d, n_tok)
    # Every full block came from the local cache or the connector; the
    # shared prefix was loaded at least once.
    assert d["local_cache_hit"] + d["external_kv_transfer"] >= need, (d, need)
    assert d["external_kv_transfer"] >= (n_tok[0] - 1) // BLOCK * BLOCK - BLOCK, d
    return d


@pytest.mark.parametrize("flow", FLOWS)
def test_prefix_cache_concurrent(pc_dep, flow):
    """Several requests at once sharing a new prefix, per flow."""
    d = _concurrent(pc_dep, flow, 1000 + 100 * FLOWS.index(flow))
    print(f"flow {flow}: {d}")


def _gauges(url):
    status, body = http_get(url + "/metrics", timeout=10)
    assert status == 200, body[:300]
    out = {}
    for (name, _), v in parse_metrics(body).items():
        out[name] = out.get(name, 0) + v
    return out


def test_prefix_cache_idle_and_clean_logs(pc_dep):
    """Last: nothing left held, loading, running or waiting, within
    IDLE_WAIT_S (well under hold_timeout_s); no recompute warning, no error
    in any server's log."""
    dep = pc_dep
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting",
             "vllm:mooncake_held_bytes", "vllm:mooncake_lookup_entries",
             "vllm:mooncake_loads_in_flight")
    deadline = time.monotonic() + IDLE_WAIT_S
    while True:
        g = {p.name: _gauges(p.url) for p in (dep.prefill, dep.decode)}
        busy = {s: {k: v for k, v in g[s].items() if k in names and v} for s in g}
        if not any(busy.values()) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not any(busy.values()), f"not idle {IDLE_WAIT_S} s after the last request: {busy}"
    dec = connector_log_stats(dep.decode.log_path, dep.log_starts["decode"])
    recomputes = {k: v for k, v in dec.items() if k.startswith("recompute_") and v}
    assert not recomputes, dec
    bad = re.compile(r"\bERROR\b|Traceback|computed locally, not loaded")
    for p in dep.processes:
        with open(p.log_path, "rb") as f:
            f.seek(dep.log_starts.get(p.name, 0))
            text = f.read().decode("utf-8", "replace")
        hits = [ln for ln in text.splitlines() if bad.search(ln)]
        assert not hits, f"{p.name} ({p.log_path}):\n" + "\n".join(hits[:20])
    assert os.path.exists(dep.decode.log_path)
