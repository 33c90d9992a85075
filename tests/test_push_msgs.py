"""The push flow's notification format (connector/push.py): what a peer may
send is checked before anything is kept or written."""
import time
from array import array

import pytest

from mooncake_connector.connector import push


def _target(n=4, nblocks=2, epb=2, body=None, **over):
    head = {"t": "target", "tid": "T", "rank": 0, "lease_until": 1e12, "ntok": 32, "h": "x",
            "skip": 0, "nblocks": nblocks, "epb": epb, "n": n, **over}
    if body is None:
        body = array("Q", [0] * (3 * n)).tobytes()
    return head, body


def test_round_trip():
    msg = push.encode({"t": "done", "tid": "abc", "ntok": 64})
    head, body = push.decode(msg)
    assert head == {"t": "done", "tid": "abc", "ntok": 64} and body == b""
    msg = push.encode({"t": "target", "tid": "x"}, b"\x01\x02")
    assert push.decode(msg)[1] == b"\x01\x02"


@pytest.mark.parametrize("msg, why", [
    (b"hello", "not a push message"),
    (push.MAGIC + b'{"t":"done"', "without a header line"),
    (push.MAGIC + b"{nope\n", "not JSON"),
    (push.MAGIC + b'{"t":"done"}\n', "lacks t / tid"),
    (push.MAGIC + b'{"t":"done","tid":""}\n', "lacks t / tid"),
    (push.MAGIC + b'{"t":"done","tid":"' + b"x" * 300 + b'"}\n', "lacks t / tid"),
    (push.MAGIC + b"[1,2]\n", "lacks t / tid"),
    # a peer's header nested deeper than Python's stack (was a RecursionError
    # out of drain_notifies, on vLLM's forward thread)
    (push.MAGIC + b"[" * 100000 + b"\n", "nested too deep"),
])
def test_bad_messages_are_refused_naming_why(msg, why):
    with pytest.raises(push.PushError, match=why):
        push.decode(msg)


@pytest.mark.parametrize("over, why", [
    ({"n": 5}, "bytes of extents for n=5"),
    ({"nblocks": 3}, "4 extents for 3 blocks x 2"),
    ({"skip": -1}, "'skip' must be an integer"),
    ({"epb": 0}, "'epb' must be an integer"),
    ({"nblocks": "2"}, "'nblocks' must be an integer"),
    ({"n": True}, "'n' must be an integer"),
])
def test_bad_targets_are_refused(over, why):
    n = over.get("n", 4)
    head, body = _target(**{k: v for k, v in over.items() if k != "n"})
    head.update(over)
    if isinstance(n, int) and not isinstance(n, bool) and n != 4:
        body = array("Q", [0] * 12).tobytes()  # 4 extents' worth, whatever n claims
    with pytest.raises(push.PushError, match=why):
        push.Target("peer:1", head, body, 0.0)


BAD_SECONDS = ["x", "1e3", None, [1], {"a": 1}, True, float("nan"), float("inf"), 10 ** 400]


@pytest.mark.parametrize("key", ["lease_until", "lease_s"])
@pytest.mark.parametrize("bad", BAD_SECONDS + ["missing"], ids=repr)
def test_a_targets_times_must_be_finite_numbers(key, bad):
    """A peer's target whose lease_until (any target) or lease_s (a layer
    read's) is no finite number is a PushError (answered nokv, the worker
    goes on).  A str, list, dict, null or missing lease_until, or an integer
    past the double range, raised ValueError / TypeError / KeyError /
    OverflowError out of Target(), through the worker's notification drain
    into vLLM's worker (the engine died); a NaN lease_s gave a read target
    keep_until NaN (its blocks lent for ever).  lease_s null or absent is
    0 as before."""
    head, body = _target(lnotify=True, rd=True, lease_s=3.0)
    if bad == "missing":
        del head[key]
    else:
        head[key] = bad
    if key == "lease_s" and bad in (None, "missing"):
        assert push.Target("peer:1", head, body, 100.0).keep_until == 100.0
        return
    with pytest.raises(push.PushError, match=f"'{key}' must be a finite number"):
        push.Target("peer:1", head, body, 100.0)


def test_good_target_parses():
    head, body = _target()
    tg = push.Target("peer:1", head, body, 0.0)
    assert tg.nblocks == 2 and len(tg.dest) == 12 and tg.state == "pending"


def test_a_resent_target_is_the_same_only_when_identical():
    """The producer takes a re-sent copy as a no-op only when nothing in it
    differs (transfer id, lease, prompt, blocks, layer notify, extents)."""
    head, body = _target()
    tg = push.Target("peer:1", head, body, 0.0)
    assert tg.same(push.Target("peer:1", dict(head), body, 5.0))
    other = array("Q", [0] * 11 + [1]).tobytes()
    for h, b in [({**head, "lease_until": 2e12}, body), ({**head, "h": "y"}, body),
                 ({**head, "lnotify": True}, body), ({**head, "tid": "U"}, body),
                 (head, other)]:
        assert not tg.same(push.Target("peer:1", h, b, 0.0)), (h, b)
    assert not tg.same(push._Served())


def test_is_push_shapes():
    assert push.is_push({"push": True, "transfer_id": "t"})
    assert push.is_push({"do_remote_prefill": True, "transfer_id": "t"})  # in-tree decode leg
    assert not push.is_push({"do_remote_prefill": True, "transfer_id": "t", "num_tokens": 3})
    assert not push.is_push({"push": False, "transfer_id": "t"})
    assert not push.is_push(None)
    assert push.transfer_id({"transfer_id": "x" * 257}) is None
    assert push.token_hash([1, 2, 3]) != push.token_hash([1, 2, 4])


def test_outbox_to_a_peer_that_never_answers_is_bounded():
    """A stopped decode engine never acknowledges: messages for it queue up
    to MAX_QUEUED, then are refused with a result naming the peer (memory
    stays bounded however long it stays stopped)."""
    import threading
    from mooncake_connector.connector.push import Outbox
    gate = threading.Event()

    class StoppedPeerEngine:  # send_notify blocks like a SIGSTOPped peer's
        def send_notify(self, target, msg, timeout):
            gate.wait(30)

    ob = Outbox(StoppedPeerEngine())
    ob.MAX_QUEUED = 8
    try:
        for i in range(8 + 1 + 5):  # 1 taken by the thread, 8 queued, 5 over
            ob.send("127.0.0.1:9", b"x", key=i)
        over = [ob.take(i) for i in range(9, 14)]
        assert all(r != "pending" and r[0] is False and "outbox to 127.0.0.1:9 full" in r[1]
                   for r in over), over
    finally:
        gate.set()


def test_outbox_threads_of_peers_gone_quiet_end():
    """Decode servers rescheduled on new addresses: each new address gets a
    sending thread; one with nothing to send for IDLE_S ends and its entry
    goes, so churn leaves no threads behind; a peer heard from again gets a
    new thread, and the delivered-to memory keeps the latest peers."""
    import threading
    from mooncake_connector.connector.push import Outbox

    sent = []

    class Engine:
        def send_notify(self, target, msg, timeout):
            sent.append((target, msg))

    def threads():
        return [t for t in threading.enumerate() if t.name.startswith("mc-push-10.9.")]

    ob = Outbox(Engine())
    ob.IDLE_S = 0.2
    ob.MAX_PEERS = 4
    try:
        for i in range(6):
            ob.send(f"10.9.0.{i}:7000", b"m", key=i)
        deadline = time.monotonic() + 10
        while (threads() or ob._peers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not threads() and not ob._peers, (threads(), ob._peers)
        assert [ob.take(i) for i in range(6)] == [None] * 6
        assert len(ob._ok) == 4  # the 4 latest delivered to (MAX_PEERS)
        ob.send("10.9.0.0:7000", b"again", key="x")  # a new thread for it
        deadline = time.monotonic() + 10
        while ob.take("x") == "pending" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ("10.9.0.0:7000", b"again") in sent and ob.delivered_to("10.9.0.0:7000")
    finally:
        ob.close()


def test_a_peer_record_nested_too_deep_is_no_record():
    """A metadata server's value for a peer's record (outside bytes) that is
    not a record, nested deeper than Python's stack included, reads as no
    record (was a RecursionError out of the route lookup)."""
    from types import SimpleNamespace
    from mooncake_connector.connector import peer_record
    for raw in (b"[" * 100000, b"{nope", b"\xff"):
        assert peer_record.fetch(SimpleNamespace(get=lambda k, raw=raw: raw), "e:1") is None
    good = SimpleNamespace(get=lambda k: b'{"tp_size": 1}')
    assert peer_record.fetch(good, "e:1") == {"tp_size": 1}
