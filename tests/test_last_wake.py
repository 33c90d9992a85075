"""TransferEngine.last_wake(): after a wait_notifies / transfer_wait, when
the calling thread's wait ended in C and how long it then waited for the
GIL (issue 31: a decode's forward thread woken by a "layer" notice waits
for whichever thread runs Python; benchmarks/push_notice_latency.py reads
it from the trace).  Thread-local: each thread sees its own waits."""
import sys
import threading
import time

from conftest import local_engines


def _spin(seconds):
    """Python bytecode only: the GIL is given up only when another thread
    has asked for it for a whole switch interval."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
    return n


def test_last_wake_is_none_before_a_wait_and_per_thread():
    with local_engines(1) as (a,):
        out = []
        th = threading.Thread(target=lambda: out.append(a.last_wake()))
        th.start()
        th.join()
        assert out == [None]
        t0 = time.monotonic()
        assert a.wait_notifies(0.01) is False
        woke, gil = a.last_wake()
        assert t0 <= woke <= time.monotonic()
        assert 0.0 <= gil < 1.0
        out = []
        th = threading.Thread(target=lambda: out.append(a.last_wake()))
        th.start()
        th.join()
        assert out == [None]  # another thread's own: it never waited


def test_last_wake_measures_the_wait_for_the_gil_after_the_wake():
    """A thread woken by a notification while this one runs Python for a
    second: it holds the GIL again only after asking for a whole switch
    interval (0.2 s here); last_wake says so, and its C wake came before."""
    before = sys.getswitchinterval()
    with local_engines(2) as (a, b):
        got = {}

        def waiter():
            got["have"] = b.wait_notifies(10.0)
            got["back"] = time.monotonic()
            got["wake"] = b.last_wake()

        def sender():
            time.sleep(0.2)
            a.send_notify(b.get_segment_name(), b"layer 0")

        w, s = threading.Thread(target=waiter), threading.Thread(target=sender)
        sys.setswitchinterval(0.2)
        try:
            w.start()
            s.start()
            time.sleep(0.05)  # both are in their waits, GIL released
            _spin(1.5)
        finally:
            sys.setswitchinterval(before)
        w.join(10)
        s.join(10)
        assert got["have"] is True
        woke, gil = got["wake"]
        assert woke + gil <= got["back"] + 1e-3
        assert gil >= 0.05, got  # it waited for this thread's switch interval
    # and with nobody running Python, the GIL comes back at once
    with local_engines(2) as (a, b):
        threading.Timer(0.05, lambda: a.send_notify(b.get_segment_name(), b"x")).start()
        assert b.wait_notifies(10.0) is True
        woke, gil2 = b.last_wake()
        assert gil2 < gil


def test_last_wake_after_transfer_wait():
    with local_engines(2) as (a, b):
        buf = a.allocate_managed_buffer(4096)
        dst = b.allocate_managed_buffer(4096)
        bid = a.batch_transfer_async_write(b.get_segment_name(), [buf], [dst], [4096])
        t0 = time.monotonic()
        assert a.transfer_wait(bid, 10.0) is True
        woke, gil = a.last_wake()
        assert t0 <= woke <= time.monotonic() and gil >= 0.0
        a.transfer_check_status(bid)
