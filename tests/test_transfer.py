"""Two OS processes moving data over real TCP on loopback (P2P mode and
through the embedded metadata server), byte-exact."""
import random
import zlib

import pytest
from conftest import TRANSPORTS

BLK = 64 << 10
# The byte-moving cores run on every transport that runs here (conftest.py).
on_every_transport = pytest.mark.parametrize("transport", TRANSPORTS, indirect=True)


def crc_of(peer, off, n):
    return peer.call(cmd="crc", off=off, len=n)["crc"]


@on_every_transport
@pytest.mark.parametrize("size", [1, 7, 4095, 65536, 65537, 1 << 20, (4 << 20) + 5, 48 << 20])
def test_write_then_read_sizes(peers, size):
    a = peers(size=64 << 20)
    b = peers(size=64 << 20)
    a.call(cmd="fill", seed=size, off=0, len=size)
    want = crc_of(a, 0, size)
    b.call(cmd="zero")
    # WRITE a -> b at an odd offset, then READ it back into a zeroed a.
    off_b = 12345
    r = a.call(cmd="write", target=b.segment, blocks=[[0, b.addr + off_b, size]])
    assert r == {"ok": True}
    assert crc_of(b, off_b, size) == want
    assert crc_of(b, 0, off_b) == zlib.crc32(bytes(off_b))  # nothing before it touched
    a.call(cmd="zero")
    r = a.call(cmd="read", target=b.segment, blocks=[[777, b.addr + off_b, size]])
    assert r == {"ok": True}
    assert crc_of(a, 777, size) == want


@on_every_transport
def test_one_gib_as_64k_blocks_write_and_read(peers):
    n = 1 << 30
    a = peers(size=n)
    b = peers(size=n)
    a.call(cmd="fill", seed=1)
    b.call(cmd="zero")
    blocks = [[i * BLK, b.addr + i * BLK, BLK] for i in range(n // BLK)]
    assert a.call(cmd="write", target=b.segment, blocks=blocks) == {"ok": True}
    want = crc_of(a, 0, n)
    assert crc_of(b, 0, n) == want
    a.call(cmd="zero")
    assert a.call(cmd="read", target=b.segment, blocks=[[0, b.addr, n]]) == {"ok": True}
    assert crc_of(a, 0, n) == want


@on_every_transport
@pytest.mark.parametrize("op", ["write", "read"])
def test_batch_of_10000_scattered_blocks(peers, op):
    nblk, bs = 10000, 4096
    a = peers(size=64 << 20)
    b = peers(size=64 << 20)
    src, dst = (a, b) if op == "write" else (b, a)
    src.call(cmd="fill", seed=7, off=0, len=nblk * bs)
    dst.call(cmd="zero")
    perm = list(range(nblk))
    random.Random(3).shuffle(perm)
    # Block i of the source lands in slot perm[i] of the destination.
    if op == "write":
        blocks = [[i * bs, b.addr + perm[i] * bs, bs] for i in range(nblk)]
    else:
        blocks = [[perm[i] * bs, b.addr + i * bs, bs] for i in range(nblk)]
    assert a.call(cmd=op, target=b.segment, blocks=blocks) == {"ok": True}
    for i in random.Random(5).sample(range(nblk), 200):
        assert crc_of(dst, perm[i] * bs, bs) == crc_of(src, i * bs, bs)


@on_every_transport
def test_through_embedded_metadata_server(peers, metadata_server):
    a = peers(metadata=metadata_server.url)
    b = peers(metadata=metadata_server.url)
    assert metadata_server.store  # both segments were published
    a.call(cmd="fill", seed=11)
    blocks = [[i * BLK, b.addr + i * BLK, BLK] for i in range(256)]
    assert a.call(cmd="write", target=b.segment, blocks=blocks) == {"ok": True}
    assert crc_of(b, 0, 256 * BLK) == crc_of(a, 0, 256 * BLK)


def test_notifications_between_processes(peers):
    a = peers()
    b = peers()
    import mooncake_connector as mc

    e = mc.TransferEngine()
    e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    try:
        e.send_notify(b.segment, b"req-1 done")
        e.send_notify(b.segment, "req-2 done")
    finally:
        e.close()
    got = b.call(cmd="notifies")["notifies"]
    assert [m for _, m in got] == ["req-1 done", "req-2 done"]
    assert a  # unused second peer keeps the fixture symmetric


@pytest.mark.parametrize("env", [{"MC_TCP_CONNS_PER_PEER": "4"},
                                 {"MC_TCP_IO_THREADS": "3", "MC_TCP_CONNS_PER_PEER": "3"},
                                 {"MC_SLICE_SIZE": "65536", "MC_OP_ENTRIES": "3"}])
def test_striping_threads_and_slicing(peers, env):
    """Several connections per peer, several I/O threads, tiny ops: same bytes."""
    a = peers(size=128 << 20, env=env)
    b = peers(size=128 << 20, env=env)
    n = 96 << 20
    a.call(cmd="fill", seed=42, off=0, len=n)
    blocks = [[i * BLK, b.addr + i * BLK, BLK] for i in range(n // BLK)]
    blocks.append([n, b.addr + n, 5 << 20])  # one large request sliced across ops
    assert a.call(cmd="write", target=b.segment, blocks=blocks) == {"ok": True}
    assert crc_of(b, 0, n) == crc_of(a, 0, n)
    a.call(cmd="zero")
    assert a.call(cmd="read", target=b.segment, blocks=blocks) == {"ok": True}
    assert crc_of(a, 0, n) == crc_of(b, 0, n)


def test_wait_notifies_wakes_on_a_notification_and_times_out():
    """wait_notifies(timeout): False after the timeout with nothing queued;
    True as soon as a notification is queued (another thread's send), taking
    none of them (get_notifies still returns it); a bad timeout is refused."""
    import threading
    import time

    import mooncake_connector as mc

    a, b = mc.TransferEngine(), mc.TransferEngine()
    a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    try:
        t0 = time.monotonic()
        assert b.wait_notifies(0.05) is False
        assert 0.04 <= time.monotonic() - t0 < 1.0
        th = threading.Timer(0.2, lambda: a.send_notify(b.get_segment_name(), b"layer 3"))
        th.start()
        t0 = time.monotonic()
        assert b.wait_notifies(10.0) is True
        assert time.monotonic() - t0 < 5.0
        th.join()
        assert b.wait_notifies(0.0) is True  # still queued: waiting takes nothing
        assert [m for _, m in b.get_notifies()] == [b"layer 3"]
        assert b.wait_notifies(0.0) is False
        with pytest.raises(ValueError, match="timeout"):
            b.wait_notifies(-1.0)
    finally:
        a.close()
        b.close()
