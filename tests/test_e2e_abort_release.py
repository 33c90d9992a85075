"""Clients that leave (or whose first token ends the request) in flows a and
b leave the prefill holding nothing (pytest -m e2e, the session's real vLLM
CPU servers and proxies).

In flows a and b the prefill publishes a prompt's KV and holds it (vLLM's
blocks under it) until a decode pulls it or hold_timeout_s (120 s) ends.  A
request that never reaches its pull left it held for those 120 s: the short
soak's drain wait was ~118 s, every client gone in flows a / b pinned the
prefill's blocks for 2 min.  Now:

* a decode request that ends before its pull was sent (aborted: the proxy
  closed the decode leg) sends the release itself (SchedulerSide.
  _release_unpulled; harness: tests/test_abort_release.py);
* where no decode leg follows the prefill's answer (the client left between
  the legs, or the first token from the prefill ended the request) the
  proxy tells the prefill (proxy._release_at_prefill: a one-token request
  whose kv_transfer_params carry "mc_release"), which drops that prompt's
  entries (Publishes.drop);
* where the decode leg was sent but its answer ended before any output
  (the client left while it was on its way: the decode's vLLM may drop it
  before its connector sees it) the proxy asks the decode
  (proxy._forget_at_decode, "mc_forget"); its ledger (connector/legs.py)
  answers "unseen" when nothing paid the prompt's hold, and the proxy
  releases it at the prefill.

Each case here failed before (the prefill still held 1-4 prompts 10 s
after the requests ended; before the forget, up to one prompt per client
gone while its decode leg was on its way: 5 held with 3 such clients in
one CI run); a concurrent client of the same prompt still loads it
remotely (no recompute on the decode).
"""
import asyncio
import json
import time

import pytest

from mooncake_connector.deployment import metric_value, proxy_stats, scrape_metrics

from e2e_fixtures import deployment, tiny_model_dir  # noqa: F401

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

FLOWS = ("a", "b")
#: the prefill's holds must end within this (hold_timeout_s is 120 s)
DRAIN_S = 10.0
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey").split()


def _prompt(i, words=90):
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(words)) + f" {i}"


def _held(url):
    m = scrape_metrics(url) or {}
    return (m.get("vllm:mooncake_lookup_entries", 0), m.get("vllm:mooncake_held_bytes", 0))


def _drained(url, limit_s=DRAIN_S, base=(0, 0)):
    """The prefill's (lookup entries, held bytes) once at most base (or
    after limit_s), and the seconds it took."""
    t0 = time.monotonic()
    while True:
        held = _held(url)
        if (held[0] <= base[0] and held[1] <= base[1]) or time.monotonic() - t0 > limit_s:
            return held, time.monotonic() - t0
        time.sleep(0.25)


def _check(dep):
    """The prefill's holds before the test: what an earlier test left held
    (until hold_timeout_s) is the baseline, not waited for (up to 2 minutes
    of CI)."""
    if dep.connector != "mooncake":
        pytest.skip("the prefill's holds (lookup entries, held bytes) are our connector's")
    return _drained(dep.prefill.url, 2.0)[0]


async def _one(url, body, leave):
    """leave: None (read the whole answer), a delay in s (the client closes
    then, wherever the request is), or "first" (after the first chunk)."""
    import aiohttp
    async with aiohttp.ClientSession() as s:
        async def go():
            async with s.post(url + "/v1/completions", json=body) as r:
                if leave == "first":
                    await r.content.readany()
                    return None
                return r.status, await r.read()
        if isinstance(leave, float):
            try:
                return await asyncio.wait_for(go(), leave)
            except asyncio.TimeoutError:
                return None
        return await go()


@pytest.mark.parametrize("flow", FLOWS)
def test_first_token_ending_the_request_frees_the_prefill(deployment, flow):  # noqa: F811
    """Streamed, max_tokens 1: the proxy's first token from the prefill ends
    it and no decode leg is sent; the prefill must not hold the prompt."""
    dep = deployment
    base = _check(dep)
    url = dep.proxies[flow].url
    before = proxy_stats(url)["finished_at_prefill"]

    async def run():
        return await asyncio.gather(*(
            _one(url, {"model": "tiny", "prompt": _prompt(100 + i), "max_tokens": 1,
                       "temperature": 0, "stream": True}, None) for i in range(4)))
    for st, raw in asyncio.run(run()):
        assert st == 200 and b"[DONE]" in raw, raw[:300]
    assert proxy_stats(url)["finished_at_prefill"] - before == 4
    held, secs = _drained(dep.prefill.url, base=base)
    assert held[0] <= base[0] and held[1] <= base[1], (
        f"the prefill still holds {held} (lookup entries, bytes; {base} before) "
        f"{secs:.1f} s after the requests ended")


@pytest.mark.parametrize("flow", FLOWS)
def test_clients_leaving_free_the_prefill(deployment, flow):  # noqa: F811
    """Clients leaving at different points (during the prefill leg, around
    the prefill's answer, after their first chunk, during the decode), each
    beside a client of the same prompt that stays: the prefill holds
    nothing within seconds, and every staying client's prompt is loaded
    (not recomputed) on the decode."""
    dep = deployment
    base = _check(dep)
    url = dep.proxies[flow].url
    rec0 = metric_value(dep.decode.url, "vllm:mooncake_recomputes_total")
    leaves = (0.02, 0.05, 0.1, 0.2, 0.4, "first", "first", "first")

    async def run():
        jobs = []
        for i, leave in enumerate(leaves):
            body = {"model": "tiny", "prompt": _prompt(200 + i), "max_tokens": 24,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            jobs.append(_one(url, body, leave))
            jobs.append(_one(url, body, None))  # the same prompt, staying
        return await asyncio.gather(*jobs)
    got = asyncio.run(run())
    stayed = got[1::2]
    for st, raw in stayed:
        assert st == 200 and b"[DONE]" in raw, raw[:300]
    held, secs = _drained(dep.prefill.url, base=base)
    stats = proxy_stats(url)
    assert held[0] <= base[0] and held[1] <= base[1], (
        f"the prefill still holds {held} (lookup entries, bytes; {base} before) {secs:.1f} s "
        "after the clients left; proxy: " + json.dumps({k: stats.get(k) for k in (
            "clients_gone_in_prefill", "clients_gone_before_decode",
            "clients_gone_before_decode_answer", "prefill_releases_sent",
            "decode_forgets_sent", "decode_forgets_unseen")}))
    rec = metric_value(dep.decode.url, "vllm:mooncake_recomputes_total") - rec0
    assert rec == 0, f"{rec} staying requests' prompts were recomputed on the decode"


def test_a_client_id_inside_another_s_request_id_releases_nothing_of_it(deployment):  # noqa: F811
    """A client's X-Request-Id "0" is inside every completion's vLLM request
    id ("cmpl-<id>-0-<random>").  Its streamed one-token request ends at the
    prefill's first token, its prompt under a block (nothing published): the
    proxy's release names its leg by "0", and the prefill dropped ANOTHER
    client's held prompt (its decode then recomputed it).  Now only vLLM's
    whole forms of an id name a request: the other prompt stays held and its
    decode leg loads it."""
    from mooncake_connector.openai_client import request
    dep = deployment
    base = _check(dep)
    url = dep.proxies["b"].url
    rec0 = metric_value(dep.decode.url, "vllm:mooncake_recomputes_total")
    # The other client's prefill leg, straight to the prefill (flow b): held.
    body = {"model": "tiny", "prompt": _prompt(300), "max_tokens": 1, "temperature": 0}
    pre = request(dep.prefill.url, "/v1/completions",
                  dict(body, kv_transfer_params={"do_remote_decode": True}), 120,
                  headers={"X-Request-Id": "held-7f3e"})
    assert pre.status == 200 and (pre.kv_transfer_params or {}).get("num_tokens"), pre.error
    held = _held(dep.prefill.url)
    assert held[0] > base[0], (held, base)
    sent0 = proxy_stats(url)["prefill_releases_sent"]
    got = request(url, "/v1/completions", dict(body, prompt="hi", stream=True), 120,
                  headers={"X-Request-Id": "0"})
    assert got.status == 200, got.error
    deadline = time.monotonic() + 10
    while proxy_stats(url)["prefill_releases_sent"] == sent0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proxy_stats(url)["prefill_releases_sent"] > sent0
    time.sleep(2.0)  # the release's request ran and the prefill's next steps did
    assert _held(dep.prefill.url)[0] == held[0], (
        "a release named by X-Request-Id '0' dropped another client's held prompt")
    dec = request(dep.decode.url, "/v1/completions",
                  dict(body, max_tokens=4, kv_transfer_params=pre.kv_transfer_params), 120)
    assert dec.status == 200, dec.error
    assert metric_value(dep.decode.url, "vllm:mooncake_recomputes_total") - rec0 == 0
    held, secs = _drained(dep.prefill.url, base=base)
    assert held[0] <= base[0] and held[1] <= base[1], (held, base, secs)
