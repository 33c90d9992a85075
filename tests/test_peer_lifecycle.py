"""Peers that die, restart or live on IPv6."""
import os
import signal

import pytest

from conftest import has_ipv6_loopback, wait_until

from mooncake_connector.serving import free_port

BLK = 64 << 10


def test_restarted_peer_is_reachable_again(peers):
    port = free_port()
    a = peers()
    b = peers(hostname=f"127.0.0.1:{port}")
    a.call(cmd="fill", seed=5)
    assert a.call(cmd="write", target=b.segment, blocks=[[0, b.addr, BLK]]) == {"ok": True}
    os.kill(b.pid, signal.SIGKILL)
    b.proc.wait()
    r = a.call(cmd="write", target=b.segment, blocks=[[0, b.addr, BLK]], timeout=5)
    assert r["type"] == "TransferError"
    # Same name again (same host:port), new process and new buffer address.
    b2 = peers(hostname=f"127.0.0.1:{port}")
    assert b2.segment == b.segment
    assert a.call(cmd="write", target=b2.segment, blocks=[[0, b2.addr, BLK]]) == {"ok": True}
    assert b2.call(cmd="crc", off=0, len=BLK) == a.call(cmd="crc", off=0, len=BLK)


def test_dead_peer_is_forgotten_and_reported_as_expired(peers, metadata_server):
    env = {"MC_METADATA_TTL": "1"}
    a = peers(metadata=metadata_server.url, env=env)
    b = peers(metadata=metadata_server.url, env=env)
    assert a.call(cmd="write", target=b.segment, blocks=[[0, b.addr, 4096]]) == {"ok": True}
    os.kill(b.pid, signal.SIGKILL)
    b.proc.wait()
    # First try: the cached address refuses; the cache entry is dropped.
    r = a.call(cmd="write", target=b.segment, blocks=[[0, b.addr, 4096]], timeout=5)
    assert r["type"] == "TransferError", r
    # Once the TTL has passed, the lookup says what happened.
    def expired():
        r = a.call(cmd="write", target=b.segment, blocks=[[0, b.addr, 4096]], timeout=5)
        return "not registered" in r.get("error", "") and "expired" in r.get("error", "")
    assert wait_until(expired, timeout=10, step=0.5)


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback (::1) here")
def test_ipv6_segments(peers):
    a = peers(hostname="[::1]")
    b = peers(hostname="[::1]", size=8 << 20)
    assert b.segment.startswith("[::1]:")
    a.call(cmd="fill", seed=9)
    blocks = [[i * BLK, b.addr + i * BLK, BLK] for i in range(100)]
    assert a.call(cmd="write", target=b.segment, blocks=blocks) == {"ok": True}
    assert b.call(cmd="crc", off=0, len=100 * BLK) == a.call(cmd="crc", off=0, len=100 * BLK)
