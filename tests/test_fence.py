"""The fence behind the push lease (docs/connector.md, "The lease"): once a
consumer reuses memory it lent a producer, no byte of that producer's old
writes may land in it.  Over a slow link (tbf, 4 mbit/s, the producer's
socket buffer allowed to grow to 4 MiB as tcp_wmem lets it), megabytes of a
WRITE sit in the producer's kernel when it gives up:

- a producer that cancels resets its connection (the kernel drops them);
- a consumer that gives up on a producer that does not answer (here: a
  SIGSTOPped one, whose kernel keeps sending) cuts the producer's incoming
  connections (Engine.cut_peer) before it reuses the memory.

Each test fills the consumer's buffer with a sentinel after the give-up and
checks, seconds later, that it is intact."""
import json
import os
import signal
import time

import pytest

from netns_util import sh, veth_pair

BLK = 64 << 10
SIZE = 16 << 20
WRITE = 8 << 20  # 16 s at 4 mbit/s


def _slow_producer(pair):
    """The producer's socket buffer may hold 4 MiB (the incident's tcp_wmem
    max), all of it queued at once, behind a 4 mbit/s tbf."""
    ns_a, _ = pair["a"]
    sh("ip", "netns", "exec", ns_a, "sysctl", "-qw", "net.ipv4.tcp_wmem=4096 4194304 4194304")
    sh("tc", "-n", ns_a, "qdisc", "add", "dev", pair["veth"], "root", "tbf", "rate", "4mbit",
       "burst", "16kb", "latency", "200ms")


@pytest.fixture
def slow_pair():
    """Two namespaces joined by a veth whose producer side (a) sends at
    4 mbit/s through a tbf that drops what waits longer than 200 ms."""
    with veth_pair("mf", "10.214.0", what="the slow link", setup=_slow_producer) as pair:
        yield pair


def _pair(peers, slow_pair):
    ns_a, ip_a = slow_pair["a"]
    ns_b, ip_b = slow_pair["b"]
    prod = peers(hostname=ip_a, netns=ns_a, size=SIZE)
    cons = peers(hostname=ip_b, netns=ns_b, size=SIZE)
    prod.call(cmd="fill", seed=5)
    blocks = [[i * BLK, cons.addr + i * BLK, BLK] for i in range(WRITE // BLK)]
    # Connected and warm: the first write is small.
    assert prod.call(cmd="write", target=cons.segment, blocks=blocks[:1]) == {"ok": True}
    return prod, cons, blocks


def _sentinel_stays(cons, watch_s=3.0):
    want = cons.call(cmd="fill", seed=99, off=0, len=WRITE)["crc"]
    time.sleep(watch_s)
    return cons.call(cmd="crc", off=0, len=WRITE)["crc"] == want


@pytest.mark.netns
def test_canceled_write_is_dropped_by_the_producer(peers, slow_pair):
    """The producer gives up (its wait times out: the batch is canceled)
    while megabytes of the WRITE sit in its socket: its connection is reset,
    so none of them lands after the cancel returned (a plain close() kept
    sending them for seconds)."""
    prod, cons, blocks = _pair(peers, slow_pair)
    r = prod.call(cmd="write", target=cons.segment, blocks=blocks, timeout=1.5)
    assert r.get("type") == "TransferTimeout", r
    time.sleep(1.0)  # what already left the socket (the tbf queue, 200 ms) lands
    assert _sentinel_stays(cons), "bytes of a canceled WRITE landed after the cancel"


@pytest.mark.netns
def test_cut_peer_fences_a_stopped_producer(peers, slow_pair):
    """A producer stops (SIGSTOP) mid-WRITE: its kernel keeps sending.  The
    consumer gives up, cuts the producer's connections and reuses its
    memory: nothing of the old WRITE lands any more."""
    prod, cons, blocks = _pair(peers, slow_pair)
    prod.send(cmd="write", target=cons.segment, blocks=blocks, timeout=30)
    time.sleep(1.0)
    os.kill(prod.pid, signal.SIGSTOP)
    try:
        r = cons.call(cmd="cut", target=prod.segment)
        assert r == {"cut": 1}, r
        assert _sentinel_stays(cons), "bytes from a cut connection landed after cut_peer"
    finally:
        os.kill(prod.pid, signal.SIGCONT)
    r = json.loads(prod.proc.stdout.readline())  # the stopped write's answer
    assert r.get("type") in ("TransferError", "TransferTimeout"), r
    # The producer's next request opens a fresh connection and works.
    assert prod.call(cmd="write", target=cons.segment, blocks=blocks[:1]) == {"ok": True}


def test_cut_peer_ends_incoming_connections(peers):
    """On loopback: cut_peer resets the named peer's incoming connections
    (how many it cut), leaves our own outgoing ones alone, and its next
    transfer connects afresh; bad names get a clear error."""
    a = peers(size=1 << 20)
    b = peers(size=1 << 20)
    a.call(cmd="fill", seed=3)
    blk = [[0, b.addr, 4096]]
    assert a.call(cmd="write", target=b.segment, blocks=blk) == {"ok": True}
    assert b.call(cmd="cut", target=a.segment) == {"cut": 1}
    assert b.call(cmd="cut", target=a.segment) == {"cut": 0}  # nothing left to cut
    # a's connection went: its next write dials again and lands.
    b.call(cmd="zero")
    for _ in range(3):  # the reset may reach a just after its next submit
        if a.call(cmd="write", target=b.segment, blocks=blk) == {"ok": True}:
            break
    else:
        pytest.fail("no write after the cut went through")
    assert b.call(cmd="crc", off=0, len=4096) == a.call(cmd="crc", off=0, len=4096)
    # b's outgoing connection to a is not an incoming one of b: a cut by b of
    # a leaves b -> a transfers alone.
    assert b.call(cmd="write", target=a.segment, blocks=[[0, a.addr, 4096]]) == {"ok": True}
    assert b.call(cmd="cut", target=a.segment)["cut"] == 1
    assert b.call(cmd="write", target=a.segment, blocks=[[0, a.addr, 4096]]) == {"ok": True}
    r = b.call(cmd="cut", target="")
    assert "empty" in r["error"], r
    r = b.call(cmd="cut", target=b.segment)
    assert "own segment" in r["error"], r
    assert b.call(cmd="cut", target="10.9.9.9:1") == {"cut": 0}
