"""No write into freed memory, whatever the order of calls (issue 28).

- A local buffer that a running transfer writes into cannot be freed under
  it: free_managed_buffer waits for the transfer, then (after
  MC_UNREGISTER_GRACE_MS) cancels it; the late answer is dropped.
- With the metadata server stopped, a failed allocation/registration
  leaves nothing registered, and a free that failed to publish can be
  retried until it succeeds (no leak, no peer access meanwhile).
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import mooncake_connector as mc

from conftest import Peer, local_engines, wait_until  # noqa: E402

MIB = 1 << 20

# The initiator runs in its own process: the bug killed it with SIGSEGV.
INITIATOR = r"""
import json, os, signal, sys, time
import mooncake_connector as mc
seg, addr, pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
n = 64 << 20
e = mc.TransferEngine()
e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
dst = e.allocate_managed_buffer(n)
assert e.transfer_sync_read(seg, dst, addr, 4096) == 0  # connection up
os.kill(pid, signal.SIGSTOP)  # the target answers only after the free
try:
    bid = e.batch_transfer_async_read(seg, [dst], [addr], [n])
    time.sleep(0.2)
    t0 = time.time()
    rc = e.free_managed_buffer(dst, n)
    took = time.time() - t0
finally:
    os.kill(pid, signal.SIGCONT)
time.sleep(1.0)  # the 64 MiB answer arrives now: it must go nowhere
states = [s["state"] for s in e.get_batch_status(bid)]
buf = e.allocate_managed_buffer(1 << 20)
ok = e.transfer_sync_read(seg, buf, addr, 1 << 20)
print(json.dumps({"rc": rc, "took": took, "states": states, "after": ok}), flush=True)
e.close()
"""


def test_free_of_a_local_buffer_under_a_running_read_cancels_it():
    env = {**os.environ, "MC_SAME_HOST_CPU": "0", "MC_UNREGISTER_GRACE_MS": "300"}
    p = Peer(env={"MC_SAME_HOST_CPU": "0"})
    try:
        r = subprocess.run([sys.executable, "-c", INITIATOR, p.segment, str(p.addr),
                            str(p.pid)], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["rc"] == 0
        # waited the grace period, then canceled (not the 10 s bound)
        assert 0.25 <= out["took"] < 3, out
        assert out["states"] in (["canceled"], ["failed"]), out
        assert out["after"] == 0
        assert "canceled 1 batch(es)" in r.stderr
    finally:
        try:
            os.kill(p.pid, signal.SIGCONT)
        except OSError:
            pass
        p.close()


def test_free_waits_for_a_local_transfer_that_finishes(monkeypatch):
    # Within the grace period the transfer just finishes: nothing canceled.
    monkeypatch.setenv("MC_SAME_HOST_CPU", "0")
    with local_engines(2) as (a, b):
        n = 32 * MIB
        src = b.allocate_managed_buffer(n)
        b.write_bytes_to_buffer(src, b"\x5a" * 4096)
        dst = a.allocate_managed_buffer(n)
        seg = b.get_segment_name()
        bid = a.batch_transfer_async_read(seg, [dst], [src], [n])
        assert a.free_managed_buffer(dst, n) == 0
        assert a.get_batch_status(bid)[0]["state"] == "completed"


# ---- metadata server stopped ----

@pytest.fixture(params=["http", "etcd"])
def meta_proc(request, tmp_path):
    """A real metadata server process (SIGSTOP-able) and its URL."""
    from test_metadata_backends import _make
    srv = _make(request.param, tmp_path)
    yield srv.proc, srv.url
    try:
        os.kill(srv.proc.pid, signal.SIGCONT)
    except OSError:
        pass
    srv.stop()


def _published(url, seg):
    with mc.MetadataClient(url) as c:
        v = c.get(f"mooncake/ram/{seg}")
    return json.loads(v) if v else {}


def _addrs(desc):
    return {int(b["addr"]) for b in desc.get("buffers", [])}


def test_metadata_stop_leaves_nothing_registered_and_free_is_retriable(meta_proc, monkeypatch):
    srv, url = meta_proc
    monkeypatch.setenv("MC_SAME_HOST_CPU", "0")
    monkeypatch.setenv("MC_METADATA_TIMEOUT_MS", "800")
    a, b = mc.TransferEngine(), mc.TransferEngine()
    a.initialize("127.0.0.1", url, "tcp", "")
    b.initialize("127.0.0.1", url, "tcp", "")
    import ctypes
    raw = (ctypes.c_ubyte * MIB)()
    raw_addr = ctypes.addressof(raw)
    stopped = False
    try:
        seg = a.get_segment_name()
        kept = a.allocate_managed_buffer(MIB)
        src = b.allocate_managed_buffer(MIB)
        assert b.transfer_sync_write(seg, src, kept, 4096) == 0  # b knows a
        before = _addrs(json.loads(a.get_metadata()))
        os.kill(srv.pid, signal.SIGSTOP)
        stopped = True
        with pytest.raises(mc.MooncakeError):
            a.allocate_managed_buffer(MIB)
        with pytest.raises(mc.MooncakeError) as ei:
            a.register_memory(raw_addr, MIB)
        # nothing of them stays registered: a peer's WRITE there is refused
        assert _addrs(json.loads(a.get_metadata())) == before
        with pytest.raises(mc.TransferError, match="not inside any memory region"):
            b.transfer_sync_write(seg, src, raw_addr, 4096)
        assert "undone (nothing registered)" in str(ei.value)
        # a free that cannot publish: unregistered here at once, retriable
        with pytest.raises(mc.MooncakeError, match="call unregister again"):
            a.free_managed_buffer(kept, MIB)
        with pytest.raises(mc.TransferError, match="not inside any memory region"):
            b.transfer_sync_write(seg, src, kept, 4096)
        os.kill(srv.pid, signal.SIGCONT)
        stopped = False
        assert a.free_managed_buffer(kept, MIB) == 0  # the retry succeeds
        with pytest.raises(ValueError, match="not a buffer"):
            a.free_managed_buffer(kept, MIB)  # and it is gone
        # the published descriptor names neither the failed nor the freed ones
        assert wait_until(lambda: not (_addrs(_published(url, seg)) &
                                       {raw_addr, kept}), timeout=5)
    finally:
        if stopped:
            os.kill(srv.pid, signal.SIGCONT)
        a.close()
        b.close()


# ---- a peer that stalls on a region being unregistered ----

def test_free_revokes_a_peer_that_does_not_read_its_answer(monkeypatch, capfd):
    from test_hostile_peers import connect, hello, pin_with_a_silent_reader
    from wire import READ, expect_msg, hdr
    import struct
    monkeypatch.setenv("MC_UNREGISTER_GRACE_MS", "300")  # MC_UNREGISTER_WAIT_MS: 10 s
    with local_engines(1) as (e,):
        seg, port = e.get_segment_name(), e.get_rpc_port()
        buf = e.allocate_managed_buffer(16 * MIB)
        s = pin_with_a_silent_reader(e, buf)  # the 16 MiB answer stays queued, pinned
        assert wait_until(lambda: e.get_stats()["reply_queue_bytes"] >= 8 * MIB)
        t0 = time.time()
        assert e.free_managed_buffer(buf, 16 * MIB) == 0
        took = time.time() - t0
        assert 0.25 <= took < 3, took
        assert e.get_stats()["reply_queue_bytes"] == 0
        err = capfd.readouterr().err
        assert "revoked peer 127.0.0.1:%d's access to region 0x%x" % (
            s.getsockname()[1], buf) in err, err[-2000:]
        # (its socket still drains what the kernel had buffered, then EOF)
        s.close()
        # its next access fails cleanly: an error answer naming the range
        s2 = connect(port)
        hello(s2, seg, "slow:1")
        s2.sendall(hdr(READ, 16, count=1) + struct.pack("<QQ", buf, 4096))
        _, _, status, _, body = expect_msg(s2)
        assert status != 0 and b"not inside any memory region" in body, (status, body)
        s2.close()


def test_revoke_off_keeps_the_bounded_wait(monkeypatch):
    from test_hostile_peers import freed, pin_with_a_silent_reader
    monkeypatch.setenv("MC_UNREGISTER_GRACE_MS", "100")
    monkeypatch.setenv("MC_UNREGISTER_WAIT_MS", "600")
    monkeypatch.setenv("MC_UNREGISTER_REVOKE", "0")
    with local_engines(1) as (e,):
        buf = e.allocate_managed_buffer(16 * MIB)
        s = pin_with_a_silent_reader(e, buf)
        assert wait_until(lambda: e.get_stats()["reply_queue_bytes"] >= 8 * MIB)
        with pytest.raises(mc.MooncakeError, match="still in use"):
            e.free_managed_buffer(buf, 16 * MIB)
        s.close()
        assert wait_until(lambda: freed(e, buf), timeout=5)


def test_same_host_cpu_free_waits_for_a_copy_in_flight(monkeypatch):
    # The same-host CPU path copies inside the submitting thread: a free from
    # another thread meanwhile waits for the copy (its region is pinned).
    import ctypes
    import threading
    monkeypatch.setenv("MC_SAME_HOST_CPU", "1")
    with local_engines(2) as (a, b):
        n = 128 * MIB
        src = b.allocate_managed_buffer(n)
        seg = b.get_segment_name()
        b.write_bytes_to_buffer(src, b"\x01" * 4096, 4096)  # the copy's first page
        # The free starts once the copy's first page landed (it slept 5 ms
        # and skipped when the copy had ended by then); should the copy end
        # before the free anyway, again with a new buffer (at most 5 times).
        for _ in range(5):
            dst = a.allocate_managed_buffer(n)
            ctypes.memset(dst, 0, 4096)
            assert a.transfer_sync_read(seg, dst, src + 4096, 4096) == 0  # path chosen
            out = {}

            def copy():
                try:
                    out["rc"] = a.transfer_sync_read(seg, dst, src, n)
                except Exception as e:  # noqa: BLE001
                    out["rc"] = repr(e)
                out["end"] = time.monotonic()

            t = threading.Thread(target=copy)
            t.start()
            assert wait_until(lambda: ctypes.string_at(dst, 1) == b"\x01" or "end" in out,
                              timeout=10, step=0.0002)
            t0 = time.monotonic()
            assert a.free_managed_buffer(dst, n) == 0
            t1 = time.monotonic()
            t.join()
            if t0 < out["end"]:
                break
        else:
            pytest.fail("the copy ended before the free started, 5 times")
        # the copy was not cut short (it saw unmapped pages before: EFAULT)
        assert out["rc"] == 0, out
        assert t1 - t0 < 5
        assert a.get_stats()["same_host_cpu_bytes_read"] >= n
