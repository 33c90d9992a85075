"""Bad input and failures: every one gives a clear error in time, never a
crash or a hang."""
import os
import random
import signal
import socket
import struct
import time

import pytest

import mooncake_connector as mc

from conftest import stop_peer_mid_batch

BLK = 64 << 10


def test_remote_address_out_of_range(peers):
    a = peers()
    b = peers(size=1 << 20)
    r = a.call(cmd="write", target=b.segment, blocks=[[0, b.addr + (1 << 20) - 10, 100]])
    assert r["type"] == "TransferError"
    assert "not inside any memory region registered by segment " + b.segment in r["error"]
    r = a.call(cmd="read", target=b.segment, blocks=[[0, 4096, 100]])
    assert "not inside any memory region" in r["error"]
    # The pair still works afterwards.
    assert a.call(cmd="write", target=b.segment, blocks=[[0, b.addr, 100]]) == {"ok": True}


def test_unknown_peer_fails_fast(engine):
    t = time.time()
    with pytest.raises(mc.TransferError, match=r"127\.0\.0\.1:1.*refused"):
        engine.transfer_sync_write("127.0.0.1:1", engine.allocate_managed_buffer(4096), 4096, 10)
    assert time.time() - t < 3


def test_bad_segment_name(engine):
    with pytest.raises(mc.ConfigError, match="host:port"):
        engine.transfer_sync_write("no-port-here", engine.allocate_managed_buffer(4096), 4096, 10)


def test_unreachable_metadata_server():
    e = mc.TransferEngine()
    t = time.time()
    with pytest.raises(mc.MetadataError, match="127.0.0.1:1"):
        e.initialize("127.0.0.1", "http://127.0.0.1:1/metadata", "tcp", "")
    assert time.time() - t < 5


def test_segment_not_registered_on_metadata_server(metadata_server):
    e = mc.TransferEngine()
    e.initialize("127.0.0.1", metadata_server.url, "tcp", "")
    try:
        with pytest.raises(mc.TransferError, match="not registered"):
            e.transfer_sync_write("10.9.9.9:4242", e.allocate_managed_buffer(4096), 4096, 10)
    finally:
        e.close()
    # Clean shutdown removed our own entry.
    assert not [k for k in metadata_server.store.keys() if "ram/" in k]


def test_api_argument_errors(engine):
    with pytest.raises(ValueError, match="same length"):
        engine.batch_transfer_sync_write("127.0.0.1:1", [1, 2], [3], [4, 5])
    with pytest.raises(TypeError):
        engine.transfer_sync_write("127.0.0.1:1", "x", 1, 1)
    with pytest.raises(ValueError):
        engine.transfer_sync_write("127.0.0.1:1", -1, 1, 1)
    with pytest.raises(mc.ConfigError, match="length is 0"):
        engine.transfer_sync_write("127.0.0.1:1", 4096, 4096, 0)
    with pytest.raises(ValueError, match="unknown batch id"):
        engine.get_batch_transfer_status([12345])
    with pytest.raises(mc.MooncakeError, match="already initialized"):
        engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    buf = engine.allocate_managed_buffer(8192)
    with pytest.raises(mc.ConfigError, match="overlaps"):
        engine.register_memory(buf + 100, 4096)
    with pytest.raises(mc.ConfigError, match="not mapped"):
        engine.register_memory(1 << 40, 4096)


def test_protocol_and_hostname_errors():
    e = mc.TransferEngine()
    with pytest.raises(mc.UnavailableError, match="rdma.*no silent fallback"):
        e.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "mlx5_0")
    with pytest.raises(mc.ConfigError, match="protocol \"udp\""):
        e.initialize("127.0.0.1", "P2PHANDSHAKE", "udp", "")
    with pytest.raises(mc.ConfigError, match="local_hostname"):
        e.initialize("bad host!", "P2PHANDSHAKE", "tcp", "")
    with pytest.raises(mc.MooncakeError, match="not initialized"):
        e.get_rpc_port()


def test_port_in_use_is_explained():
    s = socket.socket()
    s.bind(("0.0.0.0", 0))
    s.listen()
    port = s.getsockname()[1]
    e = mc.TransferEngine()
    with pytest.raises(mc.MooncakeError, match=f"{port}.*in use"):
        e.initialize(f"127.0.0.1:{port}", "P2PHANDSHAKE", "tcp", "")
    s.close()


def test_closed_engine_refuses_calls():
    e = mc.TransferEngine()
    e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    e.close()
    with pytest.raises(mc.MooncakeError, match="closed"):
        e.transfer_sync_write("127.0.0.1:1", 4096, 4096, 1)
    e.close()  # idempotent


def _send_raw(port, data, wait_close=True):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(data)
    if wait_close:
        try:
            got = s.recv(1)
        except ConnectionResetError:
            got = b""
        assert got == b""  # the engine dropped us
    s.close()


def test_garbage_on_data_port_keeps_serving(peers):
    a = peers()
    b = peers(size=4 << 20)
    port = int(b.segment.rsplit(":", 1)[1])
    rng = random.Random(9)
    hdr = struct.Struct("<IBBHIiQQ")
    cases = [
        rng.randbytes(4096),                                        # random bytes
        hdr.pack(0x564B434D, 99, 1, 0, 0, 0, 1, 0),                  # wrong version
        hdr.pack(0x564B434D, 1, 42, 0, 0, 0, 1, 0),                  # unknown type
        hdr.pack(0x564B434D, 1, 3, 0, 1, 0, 1, 16),                  # WRITE before HELLO
        hdr.pack(0x564B434D, 1, 1, 0, 0, 0, 1, 1 << 40),             # HELLO of 1 TiB
        hdr.pack(0x564B434D, 1, 1, 0, 0, 0, 1, 5) + b"{bad}",        # HELLO not JSON
    ]
    for c in cases:
        _send_raw(port, c)
    # Truncated header, then the client disappears.
    _send_raw(port, hdr.pack(0x564B434D, 1, 1, 0, 0, 0, 1, 0)[:10], wait_close=False)
    # A valid HELLO then a WRITE whose entries lie outside the target.
    body = b'{"version":1,"segment":"","from":"evil"}'
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(hdr.pack(0x564B434D, 1, 1, 0, 0, 0, 1, len(body)) + body)
    resp = s.recv(32)
    assert len(resp) == 32 and resp[5] == 2  # HELLO_ACK
    s.recv(4096)
    payload = b"x" * 64
    s.sendall(hdr.pack(0x564B434D, 1, 3, 0, 1, 0, 2, 16 + 64)
              + struct.pack("<QQ", 4096, 64) + payload)
    resp = s.recv(32)
    assert resp[5] == 4 and struct.unpack("<i", resp[12:16])[0] < 0  # WRITE_ACK, refused
    s.close()
    # The engine still serves real peers.
    a.call(cmd="fill", seed=1)
    assert a.call(cmd="write", target=b.segment, blocks=[[0, b.addr, 1 << 20]]) == {"ok": True}
    assert b.call(cmd="crc", off=0, len=1 << 20) == a.call(cmd="crc", off=0, len=1 << 20)
    b.close()
    # ...and said why it dropped each bad connection.
    assert "bad magic" in b.stderr_text
    assert "wire version 99" in b.stderr_text
    assert "not HELLO" in b.stderr_text


@pytest.mark.parametrize("op", ["write", "read"])
def test_peer_killed_mid_batch(peers, op):
    n = 1 << 30
    a = peers(size=n)
    b = peers(size=n)
    blocks = [[i * BLK, b.addr + i * BLK, BLK] for i in range(n // BLK)]
    # The first block, where the data comes from: shows the batch began.
    src, dst = (a, b) if op == "write" else (b, a)
    first = src.call(cmd="fill", seed=5, off=0, len=BLK)
    # b is stopped once the batch's first block landed: the batch cannot end
    # then (b acknowledges nothing), only b's death ends it.  (A 150 ms sleep
    # before the kill let the batch finish first on some runs: the test
    # skipped.)  Should the batch still end before the stop, again.
    # The connection made (handshake done) first, as 150 ms into a batch it
    # was: else b can stop before its HELLO_ACK is read, and the kill ends
    # the batch in a refused redial.
    assert a.call(cmd=op, target=b.segment, blocks=blocks[:16]) == {"ok": True}
    def start():
        dst.call(cmd="zero")
        a.call(cmd=op, bg=True, target=b.segment, blocks=blocks, timeout=30)
    stop_peer_mid_batch(a, b, start, lambda: dst.call(cmd="crc", off=0, len=BLK) == first,
                        {"ok": True}, "batch")
    os.kill(b.pid, signal.SIGKILL)
    t = time.time()
    r = a.call(cmd="bg_result", wait=30)
    dt = time.time() - t
    assert r.get("type") == "TransferError", r
    assert b.segment in r["error"] and ("closed" in r["error"] or "reset" in r["error"])
    assert dt < 10


def test_sigkill_of_initiator_does_not_disturb_target(peers):
    a = peers(size=256 << 20)
    b = peers(size=256 << 20)
    c = peers()
    blocks = [[i * BLK, b.addr + i * BLK, BLK] for i in range((256 << 20) // BLK)]
    a.send(cmd="write", target=b.segment, blocks=blocks)
    time.sleep(0.05)
    os.kill(a.pid, signal.SIGKILL)
    c.call(cmd="fill", seed=3)
    assert c.call(cmd="write", target=b.segment, blocks=[[0, b.addr, 1 << 20]]) == {"ok": True}
