"""Transfers between two network namespaces joined by a veth pair: the data
really crosses a (virtual) network link, with its own addresses."""
import subprocess

import pytest

from netns_util import sh, veth_pair

pytestmark = pytest.mark.netns

BLK = 64 << 10


@pytest.fixture(scope="module")
def netns_pair():
    with veth_pair("mc", "10.213.0") as pair:
        yield pair


def test_transfer_across_veth(peers, netns_pair):
    ns_a, ip_a = netns_pair["a"]
    ns_b, ip_b = netns_pair["b"]
    a = peers(hostname=ip_a, netns=ns_a, size=256 << 20)
    b = peers(hostname=ip_b, netns=ns_b, size=256 << 20)
    assert b.segment.startswith(ip_b + ":")
    a.call(cmd="fill", seed=21)
    n = 256 << 20
    blocks = [[i * BLK, b.addr + i * BLK, BLK] for i in range(n // BLK)]
    assert a.call(cmd="write", target=b.segment, blocks=blocks) == {"ok": True}
    want = a.call(cmd="crc", off=0, len=n)
    assert b.call(cmd="crc", off=0, len=n) == want
    a.call(cmd="zero")
    assert a.call(cmd="read", target=b.segment, blocks=[[0, b.addr, n]]) == {"ok": True}
    assert a.call(cmd="crc", off=0, len=n) == want
    # The bytes went over the veth link.
    out = subprocess.run(["ip", "-n", ns_a, "-s", "link", "show", netns_pair["veth"]],
                         capture_output=True, text=True).stdout
    tx_bytes = int(out.split("TX:")[1].split("\n")[1].split()[0])
    assert tx_bytes > n


def test_peer_in_other_namespace_unreachable_address(peers, netns_pair):
    ns_a, ip_a = netns_pair["a"]
    a = peers(hostname=ip_a, netns=ns_a)
    # Nobody listens on this port in namespace b: refused, quickly.
    r = a.call(cmd="write", target="10.213.0.2:9", blocks=[[0, 4096, 10]], timeout=5)
    assert r["type"] == "TransferError" and "10.213.0.2:9" in r["error"]


def test_link_down_mid_transfer_gives_error_within_timeout(peers, netns_pair):
    ns_a, ip_a = netns_pair["a"]
    ns_b, ip_b = netns_pair["b"]
    a = peers(hostname=ip_a, netns=ns_a, size=1 << 30)
    b = peers(hostname=ip_b, netns=ns_b, size=1 << 30)
    blocks = [[i * BLK, b.addr + i * BLK, BLK] for i in range((1 << 30) // BLK)]
    # Warm the connection, then cut the link in the middle of a big batch.
    assert a.call(cmd="write", target=b.segment, blocks=blocks[:16]) == {"ok": True}
    a.send(cmd="write", target=b.segment, blocks=blocks * 4, timeout=3)
    import time
    time.sleep(0.2)
    sh("ip", "-n", ns_a, "link", "set", netns_pair["veth"], "down")
    try:
        t = time.time()
        r = a.call(cmd="zero")
        if "ok" in r:
            pytest.skip("transfer finished before the link went down")
        assert r["type"] == "TransferTimeout", r
        assert "timed out" in r["error"]
        assert time.time() - t < 10
    finally:
        sh("ip", "-n", ns_a, "link", "set", netns_pair["veth"], "up")
