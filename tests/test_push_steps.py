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


def test_a_target_after_its_consumers_cancel_is_not_kept():
    """A consumer's cancel that reaches the producer before the prompt is
    computed, then a copy of its target (a duplicate, or one that took
    another path than the cancel): not kept as an early target, so the
    prompt's job, when it begins, writes nothing there (the decode's blocks
    may be another request's by then); answered "cancelled".  Another
    consumer's target for the same transfer id is still kept."""
    from array import array
    p = _producer()
    sent = []
    p.w.push_outbox = SimpleNamespace(send=lambda to, msg, **kw: sent.append(
        (to, push.decode(msg)[0])))
    body = array("Q", [4096, 8192, 64]).tobytes()
    head = {"t": "target", "tid": "x1", "rank": 0, "lease_until": time.time() + 30,
            "ntok": 16, "h": "0", "skip": 0, "nblocks": 1, "epb": 1, "n": 1}
    p.on_message("D1:1", {"t": "cancel", "tid": "x1"}, b"")
    assert sent[-1] == ("D1:1", {"t": "cancelled", "tid": "x1",
                                 "why": "canceled before any write"})
    p.on_message("D1:1", head, body)
    assert "x1" not in p.early, p.early
    assert sent[-1][0] == "D1:1" and sent[-1][1]["t"] == "cancelled"
    p.on_message("D2:1", head, body)  # another decode rank's target: kept
    assert set(p.early.get("x1", {})) == {"D2:1"}
