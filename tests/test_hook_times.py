"""MC_HOOK_TIMES (mooncake_connector/hook_times.py): every hook vLLM calls on
the connector is timed per kind of step, and the timing wrapper stays out of
the connector's own look at its caller's frame (vLLM 0.26: the scheduler's
KV-cache manager is taken from the frame calling get_num_new_matched_tokens)."""
import json
import sys
from types import SimpleNamespace as NS

from mooncake_connector import hook_times


class Conn:
    def __init__(self):
        self.caller = None

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.caller = hook_times.caller(sys._getframe(1))
        return 0, False

    def build_connector_meta(self, so):
        return so

    def bind_connector_metadata(self, meta):
        self.meta = meta

    def save_kv_layer(self, name):
        return name


def test_hooks_are_timed_per_step_class_and_written(tmp_path, monkeypatch):
    monkeypatch.setattr(hook_times, "PREFIX", str(tmp_path / "h"))
    s, w = Conn(), Conn()
    ts = hook_times.install(s, "scheduler", "kv_producer")
    tw = hook_times.install(w, "worker", "kv_producer")
    push = NS(kv_transfer_params={"push": True, "transfer_id": "x"})
    plain = NS(kv_transfer_params=None)

    class Scheduler:  # the frame the connector looks at (vLLM's scheduler)
        def call(self, conn, req):
            return conn.get_num_new_matched_tokens(req, 0)

    sched = Scheduler()
    assert sched.call(s, push) == (0, False)
    assert s.caller.f_locals.get("self") is sched  # not the wrapper's frame
    sched.call(s, plain)
    s.build_connector_meta(NS(loads=(), publishes=(NS(push_tid="t1"),)))
    s.build_connector_meta(NS(loads=(), publishes=()))
    w.bind_connector_metadata(NS(loads=(NS(push_tid=None),), publishes=()))
    for i in range(3):
        assert w.save_kv_layer(f"l{i}") == f"l{i}"
    w.bind_connector_metadata(NS(loads=(), publishes=()))
    w.save_kv_layer("l0")
    ts.dump()
    tw.dump()
    got = {d["side"]: d for d in (json.load(open(p)) for p in tmp_path.glob("h.*.json"))}
    hs, hw = got["scheduler"]["hooks"], got["worker"]["hooks"]
    assert hs["push/get_num_new_matched_tokens"]["n"] == 1
    assert hs["plain/get_num_new_matched_tokens"]["n"] == 1
    assert hs["push/build_connector_meta"]["n"] == 1 and hs["empty/build_connector_meta"]["n"] == 1
    assert got["scheduler"]["steps"] == {"push": 1, "empty": 1}
    assert hw["work/save_kv_layer"]["n"] == 3 and hw["empty/save_kv_layer"]["n"] == 1
    assert got["worker"]["steps"] == {"work": 1, "empty": 1}
    assert all(v["wall_ms"] >= 0 and v["max_ms"] >= v["p50_ms"] for v in hw.values())


def test_the_step_after_a_push_step_is_its_own_class(tmp_path, monkeypatch):
    """Issue 31's gap 1->2: the decode's token-2 step (the empty step right
    after its push layer-load step) is timed apart from later empty steps."""
    monkeypatch.setattr(hook_times, "PREFIX", str(tmp_path / "h"))
    w = Conn()
    tw = hook_times.install(w, "worker", "kv_consumer")
    push = NS(loads=(NS(push_tid="t1"),), publishes=())
    empty = NS(loads=(), publishes=())
    for meta in (empty, push, empty, empty, push, push, empty):
        w.bind_connector_metadata(meta)
        w.save_kv_layer("l0")
    tw.dump()
    got = json.load(open(next(tmp_path.glob("h.*.json"))))
    assert got["steps"] == {"empty": 2, "push": 3, "after_push": 2}
    assert got["hooks"]["after_push/save_kv_layer"]["n"] == 2
