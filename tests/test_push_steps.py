"""The push flow's per-step hooks in the common case (issue 31: vLLM calls
bind_connector_metadata and get_finished on its forward thread every step,
the prefill's get_finished between its forward and its logits): a step with
nothing to drain makes one engine look, not both drains; the producer's
poll with no job, no waiting target and nothing to forget yet returns at
once without its lock (which the landing thread may hold while it checks
writes); the transfer ids kept to answer late targets are forgotten oldest
first, without a scan of them all per step."""
import threading
import time
from types import SimpleNamespace

from conftest import local_engines

from mooncake_connector.connector import push
from mooncake_connector.connector.push import PushProducer
from mooncake_connector.connector.worker import WorkerSide


class Counting:
    """A real engine whose calls are counted."""

    def __init__(self, eng):
        self._eng, self.calls = eng, []

    def __getattr__(self, name):
        f = getattr(self._eng, name)
        if not callable(f):
            return f

        def g(*a, **k):
            self.calls.append(name)
            return f(*a, **k)
        return g


def test_drain_with_nothing_waiting_is_one_engine_look(monkeypatch):
    monkeypatch.setenv("MC_SAME_HOST_CPU", "0")
    with local_engines(2) as (a, b):
        assert a.has_notifies() is False
        got = []
        eng = Counting(a)
        w = SimpleNamespace(engine=eng, push_outbox=object(), push_c=None,
                            push_p=SimpleNamespace(on_message=lambda *x: got.append(x)))
        for _ in range(3):
            WorkerSide.drain_notifies(w)
        assert eng.calls == ["has_notifies"] * 3, eng.calls
        # a message waiting: the look says so (and takes nothing), the drain routes it
        b.send_notify(a.get_segment_name(), push.encode({"t": "cancel", "tid": "T1"}), 5.0)
        end = time.monotonic() + 5
        while not a.has_notifies():
            assert time.monotonic() < end
            time.sleep(0.005)
        assert a.has_notifies() is True  # looked twice, still there
        eng.calls.clear()
        WorkerSide.drain_notifies(w)
        assert eng.calls == ["has_notifies", "get_notifies", "take_lost_peers"], eng.calls
        assert [(h["t"], h["tid"]) for _, h, _ in got] == [("cancel", "T1")]
        assert a.has_notifies() is False
        # a peer lost: the look says so too, the drain takes it
        b.close()
        end = time.monotonic() + 5
        while not a.has_notifies():
            assert time.monotonic() < end
            time.sleep(0.005)
        lost = []
        w.push_c = SimpleNamespace(peer_lost=lost.append, on_message=lambda *x: None)
        WorkerSide.drain_notifies(w)
        assert lost and a.has_notifies() is False


def _producer():
    layout = SimpleNamespace(layers=[SimpleNamespace(name="l0", outer=[0])])
    w = SimpleNamespace(layout=layout, s=SimpleNamespace(hold_timeout_s=30.0))
    return PushProducer(w)


def test_idle_poll_returns_at_once_without_the_lock():
    p = _producer()
    held, release = threading.Event(), threading.Event()

    def hold():  # another thread of the producer (the landing thread) in its lock
        with p.lock:
            held.set()
            release.wait(10)
    t = threading.Thread(target=hold)
    t.start()
    try:
        assert held.wait(5)
        t0 = time.monotonic()
        assert p.poll() == set()
        assert time.monotonic() - t0 < 0.5  # did not wait for the lock
        p.ended["old"] = time.monotonic()  # something to forget later: not yet due
        assert p.poll() == set() and "old" in p.ended
    finally:
        release.set()
        t.join()


def test_ended_ids_are_forgotten_oldest_first(monkeypatch):
    p = _producer()
    now = time.monotonic()
    for i in range(1000):
        p.ended[f"t{i}"] = now - push.ENDED_KEEP_S - 5 + i * 0.01 + 0.005  # the first 500 due
    p._end_tid("t0", now)  # ended again: it moves to the end
    assert next(iter(p.ended)) == "t1" and list(p.ended)[-1] == "t0"
    monkeypatch.setattr(time, "monotonic", lambda: now)
    p.poll()
    # those more than ENDED_KEEP_S old left; the rest and t0 stay, in order
    left = list(p.ended)
    assert left[0] == "t500" and left[-1] == "t0" and len(left) == 501, (left[:3], len(left))
    assert all(now - p.ended[t] <= push.ENDED_KEEP_S for t in left)
    # bounded: more than 65536 kept are dropped oldest first
    for i in range(66000):
        p.ended[f"u{i}"] = now
    p.poll()
    assert len(p.ended) == 65536 and "u0" not in p.ended and "u65999" in p.ended
