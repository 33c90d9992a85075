"""The producer's poll in every step's get_finished (issue 31: vLLM calls it
on its forward thread, between the prefill's forward and its logits): the
transfer ids kept ENDED_KEEP_S to answer late targets are forgotten oldest
first, one look per step while none is due, instead of a scan of them all
(up to 65536, a serving rate x 120 s) per step."""
import time
from types import SimpleNamespace

from mooncake_connector.connector import push
from mooncake_connector.connector.push import PushProducer


def _producer():
    layout = SimpleNamespace(layers=[SimpleNamespace(name="l0", outer=[0])])
    w = SimpleNamespace(layout=layout, s=SimpleNamespace(hold_timeout_s=30.0))
    return PushProducer(w)


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
