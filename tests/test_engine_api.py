"""The Mooncake-compatible Python surface, in one process (two engines)."""
import threading

import pytest

import mooncake_connector as mc


from conftest import TRANSPORTS, wait_until  # noqa: E402


# Engines read MC_SAME_HOST_CPU at start: the pair runs on `transport`.
@pytest.fixture(params=TRANSPORTS)
def pair(request, monkeypatch):
    monkeypatch.setenv("MC_SAME_HOST_CPU", "1" if request.param == "same-host-cpu" else "0")
    a, b = mc.TransferEngine(), mc.TransferEngine()
    a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    yield a, b
    moved = 0
    for e in (a, b):
        try:
            st = e.get_stats()
        except Exception:  # closed by the test
            continue
        moved += st["same_host_cpu_bytes_written"] + st["same_host_cpu_bytes_read"]
    a.close()
    b.close()
    # The parametrization is real: bytes took the path it names.
    # (Counted by the initiator: skip the tests that close it or move nothing.)
    if not request.node.name.startswith(("test_metadata_descriptor", "test_close_while")):
        assert (moved > 0) == (request.param == "same-host-cpu")


def test_managed_buffers_and_bytes_helpers(pair):
    a, b = pair
    src = a.allocate_managed_buffer(1 << 20)
    dst = b.allocate_managed_buffer(1 << 20)
    assert src % 4096 == 0
    assert a.write_bytes_to_buffer(src, b"kv-block" * 100) == 0
    assert a.transfer_sync_write(b.get_segment_name(), src, dst, 800) == 0
    assert b.read_bytes_from_buffer(dst, 800) == b"kv-block" * 100
    with pytest.raises(ValueError, match="not a buffer from allocate_managed_buffer"):
        b.free_managed_buffer(dst + 1, 1 << 20)
    assert b.free_managed_buffer(dst, 1 << 20) == 0
    # Freed means unregistered: the peer can no longer write there.
    with pytest.raises(mc.TransferError, match="not inside any memory region"):
        a.transfer_sync_write(b.get_segment_name(), src, dst, 8)


def test_generic_opcode_calls_and_async(pair):
    a, b = pair
    src = a.allocate_managed_buffer(64 << 10)
    dst = b.allocate_managed_buffer(64 << 10)
    a.write_bytes_to_buffer(src, bytes(range(256)) * 256)
    seg = b.get_segment_name()
    assert a.batch_transfer_sync(seg, [src], [dst], [65536], mc._core.OPCODE_WRITE) == 0
    assert b.read_bytes_from_buffer(dst, 65536) == bytes(range(256)) * 256
    a.write_bytes_to_buffer(src, b"\0" * 65536)
    bid = a.batch_transfer_async(seg, [src], [dst], [65536], opcode=mc._core.OPCODE_READ)
    assert a.get_batch_transfer_status([bid]) == 0
    assert a.read_bytes_from_buffer(src, 16) == bytes(range(16))
    bid = a.transfer_submit_write(seg, src, dst, 100)
    while (r := a.transfer_check_status(bid)) == 0:
        pass
    assert r == 1
    bid = a.batch_transfer_async_write(seg, [src, src], [dst, 8], [10, 10])
    st = None
    while True:
        st = a.get_batch_status(bid)
        if all(s["state"] != "pending" for s in st):
            break
    assert [s["state"] for s in st] == ["completed", "failed"]
    assert st[1]["code_name"] == "MC_ERANGE"
    with pytest.raises(mc.TransferError):
        a.get_batch_transfer_status([bid])
    with pytest.raises(ValueError, match="opcode"):
        a.batch_transfer_sync(seg, [src], [dst], [1], 5)
    # host memory: no GPU copy job (the counters exist for every engine)
    st = a.get_stats()
    assert st["gpu_jobs"] == 0 and st["gpu_jobs_direct"] == 0


def test_many_threads_share_one_engine(pair):
    """Blocking calls release the GIL: 8 threads transfer concurrently."""
    a, b = pair
    n = 8
    src = a.allocate_managed_buffer(n << 20)
    dst = b.allocate_managed_buffer(n << 20)
    for i in range(n):
        a.write_bytes_to_buffer(src + (i << 20), bytes([i]) * (1 << 20))
    errors = []

    def work(i):
        try:
            for _ in range(20):
                a.transfer_sync_write(b.get_segment_name(), src + (i << 20), dst + (i << 20),
                                      1 << 20)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    for i in range(n):
        assert b.read_bytes_from_buffer(dst + (i << 20), 1 << 20) == bytes([i]) * (1 << 20)


def test_close_while_other_thread_transfers(pair):
    a, b = pair
    src = a.allocate_managed_buffer(64 << 20)
    dst = b.allocate_managed_buffer(64 << 20)
    results = []

    def work():
        try:
            for _ in range(50):
                a.transfer_sync_write(b.get_segment_name(), src, dst, 64 << 20)
            results.append("done")
        except mc.MooncakeError as e:
            results.append(type(e).__name__)

    t = threading.Thread(target=work)
    t.start()
    a.close()  # waits for the call in flight, then refuses new ones
    t.join(timeout=30)
    assert not t.is_alive()
    assert results and results[0] in ("done", "MooncakeError")


def test_metadata_descriptor_lists_registered_buffers(pair):
    import json
    a, _ = pair
    addr = a.allocate_managed_buffer(8192)
    d = json.loads(a.get_metadata())
    assert d["name"] == a.get_segment_name()
    assert d["tcp_data_port"] == a.get_rpc_port()
    assert {"name": "cpu", "addr": addr, "length": 8192} in d["buffers"]


@pytest.mark.parametrize("off", ["initiator", "target"])
def test_same_host_cpu_off_by_option(monkeypatch, off):
    """initialize(..., same_host_cpu=False) (mooncake.json "same_host_cpu":
    false) keeps the bytes off the same-host CPU path, on either side, even
    with MC_SAME_HOST_CPU=1; the bytes still arrive (over TCP)."""
    monkeypatch.setenv("MC_SAME_HOST_CPU", "1")
    a, b = mc.TransferEngine(), mc.TransferEngine()
    a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "", same_host_cpu=off != "initiator")
    b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "", same_host_cpu=off != "target")
    try:
        src = a.allocate_managed_buffer(64 << 10)
        dst = b.allocate_managed_buffer(64 << 10)
        a.write_bytes_to_buffer(src, b"off-path" * 8192)
        assert a.transfer_sync_write(b.get_segment_name(), src, dst, 65536) == 0
        assert b.read_bytes_from_buffer(dst, 65536) == b"off-path" * 8192
        assert a.get_stats()["same_host_cpu_bytes_written"] == 0
    finally:
        a.close()
        b.close()


def _settle(engine, key, want):
    """engine.get_stats()[key] once it is `want` (or after 5 s, whatever it is)."""
    wait_until(lambda: engine.get_stats()[key] == want)
    return engine.get_stats()[key]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_peers_gone_leave_no_entries(transport, monkeypatch):
    """A long-lived engine talking to peers that go away (restarted on a new
    port each time, scaled down) keeps an entry per live peer only: the
    control transport's entry goes with the peer's last connection, the
    same-host CPU path's when the peer is lost (before: one entry each per
    peer ever reached, kept for good and scanned on every submit)."""
    monkeypatch.setenv("MC_SAME_HOST_CPU", "1" if transport == "same-host-cpu" else "0")
    a = mc.TransferEngine()
    a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    src = a.allocate_managed_buffer(1 << 16)
    try:
        for k in range(4):
            b = mc.TransferEngine()
            b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
            dst = b.allocate_managed_buffer(1 << 16)
            a.write_bytes_to_buffer(src, bytes([k]) * 4096)
            assert a.transfer_sync_write(b.get_segment_name(), src, dst, 4096) == 0
            assert b.read_bytes_from_buffer(dst, 4096) == bytes([k]) * 4096
            st = a.get_stats()
            assert st["tcp_peers"] == 1
            assert st["same_host_cpu_peer_entries"] == (transport == "same-host-cpu")
            b.close()
            assert _settle(a, "tcp_peers", 0) == 0, f"round {k}"
            assert _settle(a, "same_host_cpu_peer_entries", 0) == 0, f"round {k}"
    finally:
        a.close()
