"""send_kv / recv_kv between OS processes: the consumer names where each
block must land, the producer pushes the longest matching prefix there."""
import os
import random
import signal
import time

import pytest
from conftest import TRANSPORTS, stop_peer_mid_batch

on_every_transport = pytest.mark.parametrize("transport", TRANSPORTS, indirect=True)
BB = 16 << 10  # bytes per KV block in these tests
BS = 16        # tokens per block


def toks(seed, n):
    r = random.Random(seed)
    return [r.randrange(50000) for _ in range(n)]


def crc(p, slot, n=1):
    return p.call(cmd="crc", off=slot * BB, len=n * BB)["crc"]


@pytest.fixture
def pair(peers):
    prod = peers(size=64 << 20)
    cons = peers(size=64 << 20)
    prod.call(cmd="fill", seed=1)
    cons.call(cmd="zero")
    return prod, cons


def init(prod, cons, **kw):
    prod.call(cmd="kv_init", **kw)
    cons.call(cmd="kv_init", producer=False)


@on_every_transport
@pytest.mark.parametrize("pull", [False, True], ids=["push", "pull"])
def test_full_partial_and_miss(pair, pull):
    prod, cons = pair
    init(prod, cons)
    t = toks(1, 4 * BS + 5)  # 4 full blocks + a partial one (never stored)
    assert prod.call(cmd="send_kv", tokens=t, slots=[3, 1, 4, 0], block_bytes=BB) == {"stored": 64}
    r = cons.call(cmd="recv_kv", producer=prod.segment, tokens=t, slots=[10, 11, 12, 13],
                  block_bytes=BB, pull=pull)
    assert r == {"matched": 64}
    for src, dst in zip([3, 1, 4, 0], [10, 11, 12, 13]):
        assert crc(cons, dst) == crc(prod, src)
    # Same first 3 blocks, different 4th: 48 tokens, the 4th slot untouched.
    t2 = t[:3 * BS] + toks(2, BS)
    r = cons.call(cmd="recv_kv", producer=prod.segment, tokens=t2, slots=[20, 21, 22, 23],
                  block_bytes=BB, pull=pull)
    assert r == {"matched": 48}
    assert crc(cons, 22) == crc(prod, 4) and crc(cons, 23) == crc(cons, 30)  # 30: still zero
    # Room for fewer blocks than match: only those move.
    r = cons.call(cmd="recv_kv", producer=prod.segment, tokens=t, slots=[24, 25],
                  block_bytes=BB, pull=pull)
    assert r == {"matched": 32}
    assert crc(cons, 25) == crc(prod, 1) and crc(cons, 26) == crc(cons, 30)
    # A miss writes nothing.
    assert cons.call(cmd="recv_kv", producer=prod.segment, tokens=toks(3, 64), slots=[40, 41],
                     block_bytes=BB, pull=pull) == {"matched": 0}
    if pull:
        # A pull's release is a notification the producer takes on its own
        # thread after the consumer's recv_kv returned: counted, not raced.
        end = time.time() + 10.0
        st = prod.call(cmd="kv_stats")
        while st["leases_released"] < 3 and time.time() < end:
            time.sleep(0.01)
            st = prod.call(cmd="kv_stats")
        assert st["leases_granted"] == 3 and st["leases_released"] == 3, st
        assert st["leases_expired"] == 0, st
        cst = cons.call(cmd="kv_stats")
        assert cst["pull_hits"] == 3 and cst["pull_bytes"] == (4 + 3 + 2) * BB, cst


def freed_soon(prod, timeout=5.0):
    got, end = [], time.time() + timeout
    while time.time() < end:
        got += prod.call(cmd="take_freed")["tags"]
        if got:
            time.sleep(0.05)  # let the rest of the same release arrive
            return sorted(got + prod.call(cmd="take_freed")["tags"])
        time.sleep(0.01)
    return got


@on_every_transport
def test_pull_consume_frees_blocks_after_the_read(pair):
    """Consume mode + track_freed: a pulled entry's extents come back from
    take_freed (the owner may reuse its blocks); blocks shared with an entry
    inserted earlier are reported at insert time, exactly once."""
    prod, cons = pair
    init(prod, cons, mode="consume", track_freed=True)
    a = toks(5, 3 * BS)
    b = a[:2 * BS] + toks(6, BS)  # shares 2 blocks with a
    assert prod.call(cmd="send_kv", tokens=a, slots=[0, 1, 2], block_bytes=BB) == {"stored": 48}
    assert prod.call(cmd="take_freed") == {"tags": []}
    assert prod.call(cmd="send_kv", tokens=b, slots=[5, 6, 7], block_bytes=BB) == {"stored": 48}
    assert prod.call(cmd="take_freed") == {"tags": [5, 6]}  # a's blocks 0, 1 serve b too
    r = cons.call(cmd="recv_kv", producer=prod.segment, tokens=a, slots=[10, 11, 12],
                  block_bytes=BB, pull=True)
    assert r == {"matched": 48}
    assert [crc(cons, s) for s in (10, 11, 12)] == [crc(prod, s) for s in (0, 1, 2)]
    # a consumed: its own block 2 is free (once the release, sent in the
    # background after the READ, arrives); 0 and 1 still serve b.
    assert freed_soon(prod) == [2]
    r = cons.call(cmd="recv_kv", producer=prod.segment, tokens=b, slots=[20, 21, 22],
                  block_bytes=BB, pull=True)
    assert r == {"matched": 48}
    assert crc(cons, 22) == crc(prod, 7)
    assert freed_soon(prod) == [0, 1, 7]
    assert cons.call(cmd="recv_kv", producer=prod.segment, tokens=a, slots=[30, 31, 32],
                     block_bytes=BB, pull=True) == {"matched": 0}


@on_every_transport
def test_shared_prefix_and_consume_once(pair):
    prod, cons = pair
    init(prod, cons, mode="consume")
    a = toks(5, 4 * BS)
    b = a[:2 * BS] + toks(6, 2 * BS)
    prod.call(cmd="send_kv", tokens=a, slots=[0, 1, 2, 3], block_bytes=BB)
    prod.call(cmd="send_kv", tokens=b, slots=[4, 5, 6, 7], block_bytes=BB)  # shares 2 blocks
    assert cons.call(cmd="recv_kv", producer=prod.segment, tokens=b, slots=[8, 9, 10, 11],
                     block_bytes=BB) == {"matched": 64}
    # The shared prefix comes from a's blocks (stored first), the rest from b's.
    assert [crc(cons, s) for s in (8, 9, 10, 11)] == [crc(prod, s) for s in (0, 1, 6, 7)]
    # Consumed: b is gone (its private blocks freed), a -- sharing b's prefix -- is still there.
    assert cons.call(cmd="recv_kv", producer=prod.segment, tokens=a, slots=[12, 13, 14, 15],
                     block_bytes=BB)["matched"] == 64
    assert cons.call(cmd="recv_kv", producer=prod.segment, tokens=a, slots=[12, 13, 14, 15],
                     block_bytes=BB)["matched"] == 0


def test_eviction_and_expiry(pair):
    prod, cons = pair
    init(prod, cons, capacity=4 * BB, ttl_s=1.0)
    a, b = toks(7, 4 * BS), toks(8, 4 * BS)
    prod.call(cmd="send_kv", tokens=a, slots=[0, 1, 2, 3], block_bytes=BB)
    prod.call(cmd="send_kv", tokens=b, slots=[4, 5, 6, 7], block_bytes=BB)  # evicts a
    assert cons.call(cmd="recv_kv", producer=prod.segment, tokens=a, slots=[8, 9, 10, 11],
                     block_bytes=BB)["matched"] == 0
    assert cons.call(cmd="recv_kv", producer=prod.segment, tokens=b, slots=[8, 9, 10, 11],
                     block_bytes=BB)["matched"] == 64
    time.sleep(1.3)
    assert cons.call(cmd="recv_kv", producer=prod.segment, tokens=b, slots=[8, 9, 10, 11],
                     block_bytes=BB)["matched"] == 0


@on_every_transport
def test_copy_mode_survives_overwrite_of_the_source(pair):
    prod, cons = pair
    init(prod, cons)
    t = toks(9, 2 * BS)
    prod.call(cmd="send_kv", tokens=t, slots=[0, 1], block_bytes=BB, copy=True)
    want = crc(prod, 0, 2)
    prod.call(cmd="zero")  # the staged copy is independent of the source
    assert cons.call(cmd="recv_kv", producer=prod.segment, tokens=t, slots=[5, 6],
                     block_bytes=BB) == {"matched": 32}
    assert crc(cons, 5, 2) == want


def test_pull_from_a_producer_killed_mid_lease_fails_fast(peers):
    prod = peers(size=64 << 20)
    cons = peers(size=64 << 20)
    init(prod, cons)
    t = toks(9, 2 * BS)
    assert prod.call(cmd="send_kv", tokens=t, slots=[0, 1], block_bytes=BB) == {"stored": 32}
    os.kill(prod.proc.pid, signal.SIGKILL)
    prod.proc.wait()
    t0 = time.monotonic()
    r = cons.call(cmd="recv_kv", producer=prod.segment, tokens=t, slots=[2, 3], block_bytes=BB,
                  pull=True, timeout=20.0)
    assert "error" in r and time.monotonic() - t0 < 10, r


@on_every_transport
def test_100_concurrent_recv_kv(pair):
    prod, cons = pair
    init(prod, cons)
    jobs = []
    for i in range(100):
        t = toks(100 + i, 2 * BS)
        prod.call(cmd="send_kv", tokens=t, slots=[2 * i, 2 * i + 1], block_bytes=BB)
        jobs.append({"tokens": t, "slots": [1000 + 2 * i, 1000 + 2 * i + 1]})
    r = cons.call(cmd="recv_many", producer=prod.segment, jobs=jobs, block_bytes=BB)
    assert r["results"] == [32] * 100
    for i in random.Random(0).sample(range(100), 10):
        assert crc(cons, 1000 + 2 * i, 2) == crc(prod, 2 * i, 2)


def test_three_processes_consumer_picks_the_producer(peers):
    p1, p2, cons = peers(size=16 << 20), peers(size=16 << 20), peers(size=16 << 20)
    p1.call(cmd="fill", seed=11)
    p2.call(cmd="fill", seed=12)
    for p in (p1, p2):
        p.call(cmd="kv_init")
    cons.call(cmd="kv_init", producer=False)
    t = toks(13, 2 * BS)
    p1.call(cmd="send_kv", tokens=t, slots=[0, 1], block_bytes=BB)
    p2.call(cmd="send_kv", tokens=t, slots=[0, 1], block_bytes=BB)
    assert cons.call(cmd="recv_kv", producer=p2.segment, tokens=t, slots=[4, 5],
                     block_bytes=BB)["matched"] == 32
    assert crc(cons, 4, 2) == crc(p2, 0, 2) != crc(p1, 0, 2)
    assert cons.call(cmd="recv_kv", producer=p1.segment, tokens=t, slots=[4, 5],
                     block_bytes=BB)["matched"] == 32
    assert crc(cons, 4, 2) == crc(p1, 0, 2)


def test_errors_are_clear(pair, peers):
    prod, cons = pair
    init(prod, cons)
    t = toks(14, 2 * BS)
    prod.call(cmd="send_kv", tokens=t, slots=[0, 1], block_bytes=BB)
    r = cons.call(cmd="recv_kv", producer=prod.segment, tokens=t, slots=[4, 5], block_bytes=BB,
                  dest_len=BB // 2)
    assert r["type"] == "ConfigError" and "bytes but the producer's KV block" in r["error"]
    # A consumer asking a non-producer.
    r = prod.call(cmd="recv_kv", producer=cons.segment, tokens=t, slots=[4, 5], block_bytes=BB)
    assert "not a producer" in r["error"]
    # A producer that is not there.
    r = cons.call(cmd="recv_kv", producer="127.0.0.1:1", tokens=t, slots=[4, 5], block_bytes=BB,
                  timeout=3)
    assert r["type"] == "TransferError" and "127.0.0.1:1" in r["error"]


@on_every_transport
def test_producer_killed_mid_recv(peers):
    prod, cons = peers(size=512 << 20), peers(size=512 << 20)
    bb, n = 256 << 10, 2000
    prod.call(cmd="kv_init")
    cons.call(cmd="kv_init", producer=False)
    first = prod.call(cmd="fill", seed=15, off=0, len=bb)  # slot 0: shows the recv began
    t = toks(15, n * BS)
    prod.call(cmd="send_kv", tokens=t, slots=list(range(n)), block_bytes=bb)
    # The producer is stopped once the recv's first block landed: it cannot
    # end the recv then, only its death can.  (A 50 ms sleep before the kill
    # let the recv finish first in 1 of 6 runs on an idle 2-core host: the
    # test skipped.)  Should the recv still end before the stop, again.
    def start():
        cons.call(cmd="zero")
        cons.call(cmd="recv_kv", bg=True, producer=prod.segment, tokens=t,
                  slots=list(range(n)), block_bytes=bb, timeout=30)
    stop_peer_mid_batch(cons, prod, start, lambda: cons.call(cmd="crc", off=0, len=bb) == first,
                        {"matched": n * BS}, "recv")
    os.kill(prod.pid, signal.SIGKILL)
    t0 = time.time()
    r = cons.call(cmd="bg_result", wait=30)
    # Fails as soon as the connection to the producer drops, not at the 30 s timeout.
    assert r.get("type") == "TransferError" and prod.segment in r["error"], r
    assert time.time() - t0 < 5


@on_every_transport
def test_hidden_states_travel_with_the_blocks(pair):
    prod, cons = pair
    init(prod, cons)
    t = toks(21, 2 * BS)
    hb = 1024
    assert prod.call(cmd="send_kv", tokens=t, slots=[0, 1], hidden_slots=[8, 9], hidden_bytes=hb,
                     block_bytes=BB)["stored"] == 32
    r = cons.call(cmd="recv_kv", producer=prod.segment, tokens=t, slots=[20, 21],
                  hidden_slots=[30, 31], hidden_bytes=hb, block_bytes=BB)
    assert r == {"matched": 32}
    for src, dst in ((8, 30), (9, 31)):
        assert (cons.call(cmd="crc", off=dst * BB, len=hb)["crc"]
                == prod.call(cmd="crc", off=src * BB, len=hb)["crc"])
    assert crc(cons, 20, 2) == crc(prod, 0, 2)


def test_probe_counts_without_taking(pair, peers):
    """probe answers how much of a prompt the producer holds; it pins and
    consumes nothing (a consume-mode entry is still there to pull after it)."""
    prod, cons = pair
    init(prod, cons, mode="consume", track_freed=True)
    t = toks(31, 3 * BS + 7)
    assert prod.call(cmd="send_kv", tokens=t, slots=[0, 1, 2], block_bytes=BB) == {"stored": 48}
    for _ in range(3):
        r = cons.call(cmd="probe", producer=prod.segment, tokens=t)
        assert r["matched"] == 48, r
    # A longer or diverging query counts the common full blocks only.
    r = cons.call(cmd="probe", producer=prod.segment, tokens=t[:2 * BS] + toks(32, 2 * BS))
    assert r["matched"] == 32
    assert cons.call(cmd="probe", producer=prod.segment, tokens=toks(33, 4 * BS))["matched"] == 0
    assert cons.call(cmd="probe", producer=prod.segment, tokens=t[:BS - 1])["matched"] == 0
    st = prod.call(cmd="kv_stats")
    assert st["probes_served"] == 6 and st["leases_granted"] == 0, st
    assert prod.call(cmd="take_freed") == {"tags": []}  # nothing consumed or freed
    # The entry is still whole: a pull takes it, then a probe finds nothing.
    r = cons.call(cmd="pull_wait", producer=prod.segment, tokens=t, slots=[10, 11, 12],
                  block_bytes=BB)
    assert r == {"done": True, "matched": 48, "error": None}
    assert [crc(cons, s) for s in (10, 11, 12)] == [crc(prod, s) for s in (0, 1, 2)]
    assert cons.call(cmd="probe", producer=prod.segment, tokens=t)["matched"] == 0
    # The layout check is optional: a wrong extents-per-block is named.
    cons.call(cmd="probe", producer=prod.segment, tokens=t, epb=0)
    r = cons.call(cmd="probe", producer=prod.segment, tokens=t, epb=3)
    assert "expects 3 extents per block" in r["error"], r
    # A dead producer: a clear error, quickly (not the whole timeout).
    r = cons.call(cmd="probe", producer="127.0.0.1:1", tokens=t, timeout=2.0)
    assert r["type"] == "TransferError" and "127.0.0.1:1" in r["error"], r
    # A non-producer says so.
    r = prod.call(cmd="probe", producer=cons.segment, tokens=t)
    assert "not a producer" in r["error"], r



@on_every_transport
def test_pull_slices_and_merges_for_different_tp(pair):
    """A consumer with more TP ranks reads a part of each producer extent
    (dest tag SLICE | offset, tp_map.Piece); one with fewer ranks puts whole
    producer extents side by side.  Bad slices are refused before any READ."""
    from mooncake_connector.connector.tp_map import SLICE

    prod, cons = pair
    init(prod, cons, mode="keep")
    t = toks(11, 2 * BS)
    assert prod.call(cmd="send_kv", tokens=t, slots=[2, 5], block_bytes=BB) == {"stored": 32}
    half = BB // 2
    # Split: the second half of each producer block into one consumer slot each.
    dest = [[10 * BB, half, SLICE | half], [11 * BB, half, SLICE | half]]
    r = cons.call(cmd="recv_kv", producer=prod.segment, tokens=t, slots=[], dest=dest,
                  block_bytes=BB, pull=True)
    assert r == {"matched": 32}
    for src, dst in [(2, 10), (5, 11)]:
        assert cons.call(cmd="crc", off=dst * BB, len=half)["crc"] == \
            prod.call(cmd="crc", off=src * BB + half, len=half)["crc"]
    assert cons.call(cmd="crc", off=10 * BB + half, len=half)["crc"] == \
        cons.call(cmd="crc", off=30 * BB, len=half)["crc"]  # rest untouched (zero)
    # Merge: whole producer blocks at an offset inside a double-size consumer block.
    dest = [[20 * BB + BB, BB], [22 * BB + BB, BB]]
    r = cons.call(cmd="recv_kv", producer=prod.segment, tokens=t, slots=[], dest=dest,
                  block_bytes=BB, pull=True)
    assert r == {"matched": 32}
    assert crc(cons, 21) == crc(prod, 2) and crc(cons, 23) == crc(prod, 5)
    # A slice of length 0 skips its extent (a sliding-window block outside
    # the window): only the other block moves.
    r = cons.call(cmd="recv_kv", producer=prod.segment, tokens=t, slots=[],
                  dest=[[40 * BB, 0, SLICE], [41 * BB, BB]], block_bytes=BB, pull=True)
    assert r == {"matched": 32}
    assert crc(cons, 40) == crc(cons, 30) and crc(cons, 41) == crc(prod, 5)
    # A slice past the producer's extent and a plain dest of the wrong size
    # are refused, naming the sizes.
    for bad in ([[40 * BB, half, SLICE | (half + 1)]] * 2, [[40 * BB, half]] * 2):
        r = cons.call(cmd="recv_kv", producer=prod.segment, tokens=t, slots=[], dest=bad,
                      block_bytes=BB, pull=True)
        assert "KV block extent is 16384 bytes" in r.get("error", ""), r
    assert crc(cons, 40) == crc(cons, 30)


def test_a_queued_pull_keeps_its_deadline():
    # One pull thread (workers=1), held by a pull to a producer that never
    # answers (a listener that accepts and stays silent) for its 3 s timeout.
    # A second pull, 0.4 s timeout, queued behind it, reports a timeout
    # within its own deadline, saying it never got a thread; before, its
    # 0.4 s only began when the thread came free (3.4 s in all).
    import socket

    import mooncake_connector as mc
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    prod = "127.0.0.1:%d" % silent.getsockname()[1]
    c = mc.TransferEngine()
    c.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    kv = mc.KVTransfer(c, workers=1)
    try:
        dst = c.allocate_managed_buffer(1 << 16)
        a = kv.pull_start(prod, list(range(16)), [(dst, 4096)], timeout=3.0)
        time.sleep(0.1)
        t0 = time.monotonic()
        b = kv.pull_start(prod, list(range(16)), [(dst + 4096, 4096)], timeout=0.4)
        got = None
        while got is None and time.monotonic() - t0 < 5:
            got = kv.pull_poll(b)
            time.sleep(0.01)
        took = time.monotonic() - t0
        assert got is not None and took < 1.2, took
        matched, err, _ = got
        assert matched == 0 or matched < 0 or err
        assert "before it started" in (err or ""), err
        assert kv.pull_wait([a], timeout=6.0)
        assert kv.pull_poll(a)[1]  # the silent producer's pull failed too
    finally:
        kv.close()
        c.close()
        silent.close()


def test_lookup_buffer_is_checked_by_type():
    # KVTransfer takes only a real LookupBuffer (by type, not by its type's
    # name): an object of a class named like it, another of the module's
    # types or an int is a TypeError naming what was given, never used as one.
    import mooncake_connector as mc
    eng = mc.TransferEngine()
    eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    try:
        lookalike = type("mooncake_connector.LookupBuffer", (), {"insert": lambda *a: 0})()
        for bad, named in ((lookalike, "mooncake_connector.LookupBuffer"),
                           (eng, "TransferEngine"), (7, "int")):
            with pytest.raises(TypeError, match=r"expected a mooncake_connector\.LookupBuffer, "
                               rf"not .*{named}"):
                mc.KVTransfer(eng, bad)
        with pytest.raises(TypeError, match=r"expected a mooncake_connector\.TransferEngine, "
                           "not .*LookupBuffer"):
            mc.KVTransfer(mc.LookupBuffer(1 << 20))
        kv = mc.KVTransfer(eng, mc.LookupBuffer(1 << 20, block_size=4))
        kv.close()
    finally:
        eng.close()
