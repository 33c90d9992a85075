"""Hostile peers (issue 14): raw sockets at an engine's port, floods of
notifications and unread replies.  After each case the target process is
alive, a legitimate 1 MiB transfer is byte-exact, and its RSS grew by no
more than the budgets that case can fill (docs/connector.md, Budgets) plus
a fixed slack for allocator and socket overhead; once the hostile peers
leave, RSS is back within 10% of the baseline."""
import os
import socket
import struct
import time

import pytest

import mooncake_connector as mc
from conftest import http, wait_until
from wire import HELLO, NOTIFY, READ, RPC, WRITE, expect_msg, hdr

MIB = 1 << 20
SLACK = 24 * MIB  # allocator arenas, socket buffers, Python in the target
# Small budgets so the cases run quickly; the docs state the defaults.
BUDGET_ENV = {"MC_LOG_LEVEL": "error", "MC_NOTIFY_QUEUE_MB": "32",
              "MC_TCP_REPLY_QUEUE_MB": "4", "MC_TCP_REPLY_TOTAL_MB": "16",
              "MC_TCP_MAX_PREHANDSHAKE": "16", "MC_TCP_HELLO_TIMEOUT_MS": "1000"}


def rss(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def connect(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a peer that reads nothing
    return s


def hello(s, target_seg, me="hostile:1"):
    body = ('{"version":1,"segment":"%s","from":"%s"}' % (target_seg, me)).encode()
    s.sendall(hdr(HELLO, len(body)) + body)
    expect_msg(s)


def pin_with_a_silent_reader(e, buf):
    """A raw peer of engine e READs the 16 MiB at buf (4 MiB a piece) and
    reads nothing back: the answer stays queued and buf pinned while the
    returned socket is open."""
    s = connect(e.get_rpc_port())
    hello(s, e.get_segment_name(), "slow:1")
    s.sendall(hdr(READ, 4 * 16, count=4) + b"".join(
        struct.pack("<QQ", buf + i * 4 * MIB, 4 * MIB) for i in range(4)))
    return s


def freed(e, buf):
    """Whether the 16 MiB managed buffer at buf can be freed now."""
    try:
        return e.free_managed_buffer(buf, 16 * MIB) == 0
    except mc.MooncakeError:
        return False


@pytest.fixture(scope="module")
def arena():
    """Target T (its own process, 64 MiB registered) and a legitimate
    initiator here with a 1 MiB managed buffer."""
    from conftest import Peer
    t = Peer(size=64 << 20, env=BUDGET_ENV)
    eng = mc.TransferEngine()
    eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    buf = eng.allocate_managed_buffer(1 << 20)
    port = int(t.segment.rsplit(":", 1)[1])
    legit(eng, buf, t)
    base = rss(t.pid)
    yield eng, buf, t, port, base
    eng.close()
    t.close()


def legit(eng, buf, t, seed=[0]):
    seed[0] += 1
    data = os.urandom(1 << 20)
    eng.write_bytes_to_buffer(buf, data)
    eng.transfer_sync_write(t.segment, buf, t.addr, 1 << 20)
    eng.write_bytes_to_buffer(buf, b"\0" * (1 << 20))
    eng.transfer_sync_read(t.segment, buf, t.addr, 1 << 20)
    assert eng.read_bytes_from_buffer(buf, 1 << 20) == data


def check(arena, budget):
    eng, buf, t, port, base = arena
    assert t.proc.poll() is None, "target died"
    legit(eng, buf, t)
    grown = rss(t.pid) - base
    assert grown <= budget + SLACK, f"RSS grew {grown >> 20} MiB, budget {budget >> 20} MiB"
    return grown


def test_unread_replies_are_backpressured(arena):
    eng, buf, t, port, base = arena
    socks = []
    # Four peers each send RPC and READ requests and never read a reply: the
    # target stops reading them once their replies pass 4 MiB each / 16 MiB
    # in all, so their sends stall instead of the target's memory growing.
    rpc = b"mc.describe"
    read = hdr(READ, 16 * 16, count=16) + b"".join(
        struct.pack("<QQ", t.addr + i * 65536, 65536) for i in range(16))
    sent = 0
    for k in range(4):
        s = connect(port)
        hello(s, t.segment, f"hostile:{k}")
        s.setblocking(False)
        socks.append(s)
        msg = (hdr(RPC, len(rpc)) + rpc) * 64 + read * 4
        t0 = time.time()
        while time.time() - t0 < 1.5:
            try:
                sent += s.send(msg)
            except BlockingIOError:
                time.sleep(0.01)
    assert sent > 4 * MIB
    grown = check(arena, 16 * MIB)
    print(f"sent {sent >> 20} MiB of requests; target RSS +{grown >> 20} MiB")
    for s in socks:
        s.close()


def test_notification_flood_is_refused_past_its_budget(arena):
    eng, buf, t, port, base = arena
    big = b"n" * (16 * MIB - 64)
    refused = 0
    for _ in range(8):  # 128 MiB against a 32 MiB budget
        try:
            eng.send_notify(t.segment, big, timeout=20)
        except mc.MooncakeError as e:
            assert "MC_NOTIFY_QUEUE_MB" in str(e)
            refused += 1
    assert refused >= 6
    check(arena, 32 * MIB)
    t.call(cmd="notifies")  # the receiver drains: memory goes back


def test_connections_before_the_handshake_are_bounded(arena):
    eng, buf, t, port, base = arena
    socks = []
    for i in range(100):  # silent, half headers, and oversized HELLOs
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=2)
        except OSError:
            continue
        if i % 3 == 1:
            s.sendall(hdr(HELLO, 16 * MIB)[:20])
        elif i % 3 == 2:
            s.sendall(hdr(HELLO, 16 * MIB) + b"{" * 65536)
        socks.append(s)
    check(arena, 16 * (256 << 10) + 16 * 4096)
    # The oversized HELLOs were dropped; the silent ones time out (1 s here).
    for s in socks:
        s.close()


@pytest.mark.parametrize("claim", [1 << 40, (1 << 40) - 1, 1 << 63])
def test_huge_claimed_lengths(arena, claim):
    eng, buf, t, port, base = arena
    s = connect(port)
    hello(s, t.segment)
    # One entry inside the region claiming `claim` bytes, and an entry table
    # claiming 4096 entries with no bytes following.
    try:
        s.sendall(hdr(WRITE, min(16 + claim, (1 << 64) - 1), count=1) +
                  struct.pack("<QQ", t.addr, claim) + b"x" * 65536)
        s.sendall(hdr(READ, 4096 * 16, count=4096, req_id=2))
    except OSError:
        pass  # dropped at once: fine
    s.close()
    check(arena, 0)


def test_rss_returns_to_baseline_after_the_hostile_peers_leave(arena):
    eng, buf, t, port, base = arena
    t.call(cmd="notifies")
    assert wait_until(lambda: rss(t.pid) <= base * 1.10, timeout=10), \
        f"RSS {rss(t.pid) >> 20} MiB, baseline {base >> 20} MiB"
    check(arena, 0)


def test_free_waits_for_a_silent_reader_only_so_long(monkeypatch):
    # A peer READs 16 MiB of a managed buffer and never reads the answer: the
    # buffer stays pinned, so free_managed_buffer fails after the bounded
    # wait naming that peer (instead of blocking for as long as it trickles),
    # and succeeds once the peer is gone.
    monkeypatch.setenv("MC_UNREGISTER_WAIT_MS", "300")
    e = mc.TransferEngine()
    e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    try:
        buf = e.allocate_managed_buffer(16 * MIB)
        s = pin_with_a_silent_reader(e, buf)
        time.sleep(0.2)
        t0 = time.time()
        with pytest.raises(mc.MooncakeError, match=r"still in use.*127\.0\.0\.1:%d" %
                           s.getsockname()[1]):
            e.free_managed_buffer(buf, 16 * MIB)
        assert time.time() - t0 < 3
        st = e.get_stats()
        assert st["reply_queue_bytes"] >= 16 * MIB  # the READ answer it does not read
        assert st["prehandshake_limit"] == 64 and st["notify_queue_limit"] == 64 * MIB
        s.close()
        assert wait_until(lambda: freed(e, buf), timeout=5)
        assert wait_until(lambda: e.get_stats()["reply_queue_bytes"] == 0, timeout=5)
    finally:
        e.close()


def _garbage_at(port):
    """Raw-socket abuse of an HTTP port: binary junk, an endless header
    line, a body far shorter than its Content-Length, idle connections."""
    socks = []
    for junk in (os.urandom(65536), b"GET /" + b"a" * (1 << 20),
                 b"PUT /metadata?key=x HTTP/1.1\r\nContent-Length: 1000000000\r\n\r\n" +
                 b"x" * 65536, b""):
        for _ in range(8):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            try:
                s.sendall(junk)
            except OSError:
                pass
            socks.append(s)
    return socks


def test_metadata_server_store_is_bounded():
    from mooncake_connector.metadata_server import MetadataServer, MetadataStore
    store = MetadataStore(max_bytes=8 * MIB)
    with MetadataServer(store=store) as srv:
        codes = [http("PUT", f"{srv.url}?key=flood{i}", b"v" * MIB)[0] for i in range(16)]
        assert codes.count(200) == 7 and codes.count(507) == 9, codes
        status, body = http("PUT", f"{srv.url}?key=one-more", b"v" * MIB)
        assert status == 507 and b"MC_METADATA_STORE_MB" in body
        assert store.bytes_used <= store.max_bytes
        socks = _garbage_at(srv.port)
        assert http("GET", f"http://127.0.0.1:{srv.port}/health")[0] == 200
        for s in socks:
            s.close()
        for i in range(16):  # deleting makes room again
            http("DELETE", f"{srv.url}?key=flood{i}")
        assert store.bytes_used == 0
        assert http("PUT", f"{srv.url}?key=after", b"v" * MIB)[0] == 200


def test_proxy_survives_raw_garbage():
    import re
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-P", "-m", "mooncake_connector.proxy", "--host",
                          "127.0.0.1", "--port", "0", "--passthrough", "http://127.0.0.1:1"],
                         stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    try:
        m = re.search(r"http://127\.0\.0\.1:(\d+)", p.stdout.readline())
        assert m
        port = int(m.group(1))
        base = rss(p.pid)
        socks = _garbage_at(port)
        time.sleep(0.5)
        assert p.poll() is None
        assert http("GET", f"http://127.0.0.1:{port}/health")[0] in (200, 502, 503)
        # aiohttp caps a request body at client_max_size (64 MiB) per request.
        assert rss(p.pid) - base <= 64 * MIB + SLACK
        for s in socks:
            s.close()
    finally:
        p.terminate()
        p.wait(10)


def test_silent_consumer_does_not_block_other_consumers():
    # A peer sends recv_kv requests naming a listener that never answers as
    # their sender: the producer's answers to it hang until their timeout.
    # One consumer holds at most one producer worker (and is skipped once
    # found unreachable), so a legitimate consumer is served meanwhile.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    fake = "127.0.0.1:%d" % silent.getsockname()[1]
    p, c = mc.TransferEngine(), mc.TransferEngine()
    p.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    c.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    kvp = mc.KVTransfer(p, mc.LookupBuffer(1 << 20, block_size=16), workers=2)
    kvc = mc.KVTransfer(c)
    s = None
    try:
        dst = c.allocate_managed_buffer(1 << 16)
        s = connect(p.get_rpc_port())
        hello(s, p.get_segment_name(), fake)
        toks = struct.pack("<16I", *range(16))
        for i in range(8):
            body = struct.pack("<IBBHQIIII", 0x5152564B, 1, 4, 1, 100 + i, 0, 0, 16, 1) + \
                toks + struct.pack("<QQ", 4096, 4096)
            s.sendall(hdr(NOTIFY, len(body), req_id=2 + i) + body)
        time.sleep(0.3)
        t0 = time.time()
        assert kvc.recv_kv(p.get_segment_name(), list(range(16)), [(dst, 4096)],
                           timeout=4) == 0
        assert time.time() - t0 < 3
        st = kvp.stats()
        assert st["queue_limit"] == 64 * MIB and st["queue_bytes"] <= st["queue_limit"]
    finally:
        if s:
            s.close()
        kvc.close()
        kvp.close()
        p.close()
        c.close()
        silent.close()


def test_consumers_slow_to_take_lease_answers_do_not_hold_the_producers_workers():
    # Two peers ask for leases naming listeners that never answer as their
    # senders, one per producer worker.  The answers to them go out without
    # the workers waiting for a receipt (they end at their own deadline), so
    # a legitimate probe right after is answered within its 0.5 s timeout;
    # before, both workers sat up to 10 s in those deliveries and the probe
    # timed out (flow a computed such prompts locally).
    silent = [socket.socket() for _ in range(2)]
    for s in silent:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
    p, c = mc.TransferEngine(), mc.TransferEngine()
    p.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    c.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    kvp = mc.KVTransfer(p, mc.LookupBuffer(1 << 20, block_size=16), workers=2)
    kvc = mc.KVTransfer(c)
    socks = []
    try:
        toks = struct.pack("<16I", *range(16))
        for i, ls in enumerate(silent):
            s = connect(p.get_rpc_port())
            socks.append(s)
            hello(s, p.get_segment_name(), "127.0.0.1:%d" % ls.getsockname()[1])
            for k in range(4):  # pull requests (lease 2 s), then probes
                body = struct.pack("<IBBHQIII", 0x5150564B, 1, 4, 1, 10 * i + k,
                                   2000 if k < 2 else 0, 16, 0) + toks
                s.sendall(hdr(NOTIFY, len(body), req_id=2 + k) + body)
        time.sleep(0.3)  # both workers took a job
        t0 = time.time()
        for _ in range(3):
            assert kvc.probe(p.get_segment_name(), list(range(16)), timeout=0.5) == 0
        assert time.time() - t0 < 1.5
        assert kvp.stats()["probes_served"] >= 3
        # The undelivered answers are in flight, bounded, and end at their
        # deadline (the silent peers' handshake timeout or 10 s): none left.
        assert p.get_stats()["detached_msgs"] >= 1
        assert wait_until(lambda: p.get_stats()["detached_msgs"] == 0, timeout=15)
        assert p.get_stats()["detached_bytes"] == 0
    finally:
        for s in socks:
            s.close()
        kvc.close()
        kvp.close()
        p.close()
        c.close()
        for s in silent:
            s.close()
