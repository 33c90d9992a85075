"""The push producer's landing thread (connector/landing.py) on its own:
a kick is never lost (a write started while the thread was checking, or
between its wake-up and its clear, is checked after the kick), it looks
only while check() reports writes in flight, it blocks on a write in
flight (TransferEngine.transfer_wait, real engines over TCP) instead of
polling, and close() ends it even while writes are in flight."""
import threading
import time

from conftest import local_engines
from mooncake_connector.connector.landing import LandingWatcher


def _no_wait(bid, timeout):
    return True


def test_every_kick_is_followed_by_a_check():
    lock = threading.Lock()
    state = {"kicked": 0, "seen": 0, "calls": 0}

    def check():
        with lock:
            state["seen"] = state["kicked"]
            state["calls"] += 1
        return None  # nothing in flight: the thread goes back to sleep at once

    w = LandingWatcher(check, _no_wait)
    try:
        for i in range(1, 2001):
            with lock:
                state["kicked"] = i
            w.kick()
            if i % 50 == 0:  # now and then: the check after this kick must come
                end = time.monotonic() + 5.0
                while time.monotonic() < end:
                    with lock:
                        if state["seen"] >= i:
                            break
                    time.sleep(0.0005)
                with lock:
                    assert state["seen"] >= i, (i, state)
        end = time.monotonic() + 5.0
        while time.monotonic() < end and state["seen"] < 2000:
            time.sleep(0.001)
        assert state["seen"] == 2000, state
    finally:
        w.close()
    assert not w._t.is_alive()


def test_a_kick_during_a_check_gets_its_own_check():
    """A write that starts while the thread checks (the producer's lock is
    not held by the thread between checks) is checked after it."""
    calls = []
    w = None

    def check():
        calls.append(time.monotonic())
        if len(calls) == 1:
            w.kick()  # the forward thread started a layer's write just now
        return None

    w = LandingWatcher(check, _no_wait)
    try:
        w.kick()
        end = time.monotonic() + 2.0
        while time.monotonic() < end and len(calls) < 2:
            time.sleep(0.001)
        assert len(calls) == 2, calls
    finally:
        w.close()


def test_looks_only_while_busy_and_close_ends_it():
    busy = {"left": 20, "calls": 0, "waits": 0}

    def check():
        busy["calls"] += 1
        busy["left"] -= 1
        return 7 if busy["left"] > 0 else None  # 7: a write in flight

    def wait(bid, timeout):
        assert bid == 7 and 0 < timeout <= LandingWatcher.WAIT_S
        busy["waits"] += 1
        time.sleep(0.0005)

    w = LandingWatcher(check, wait)
    w.kick()
    end = time.monotonic() + 5.0
    while time.monotonic() < end and busy["left"] > 0:
        time.sleep(0.001)
    time.sleep(0.05)
    assert busy["calls"] == 20 and busy["waits"] == 19, busy  # stopped once nothing was in flight
    busy["left"] = 10 ** 9  # always busy: close() must still end it
    w.kick()
    time.sleep(0.01)
    t0 = time.monotonic()
    w.close()
    assert time.monotonic() - t0 < 1.0
    assert not w._t.is_alive()


def test_a_write_in_flight_is_waited_for_not_polled(monkeypatch):
    """Between a write's start and its landing the thread blocks on it
    (GIL released, woken by the engine's I/O thread as it completes): a
    handful of checks for a write in flight for milliseconds.  The old
    thread looked every 0.2 ms (~80 checks for this 64 MiB write over TCP
    loopback, 16 ms on the 2-vCPU VM), each taking the GIL from vLLM's
    forward thread."""
    monkeypatch.setenv("MC_SAME_HOST_CPU", "0")  # TCP: a write really in flight
    n = 64 << 20
    with local_engines(2) as (a, b):
        seg = b.get_segment_name()
        src, dst = a.allocate_managed_buffer(n), b.allocate_managed_buffer(n)
        assert a.transfer_sync_write(seg, src, dst, 4096) == 0  # connected
        state = {"bid": None}
        calls, done = [], threading.Event()

        def check():
            calls.append(time.monotonic())
            bid = state["bid"]
            if bid is None:
                return None
            if a.transfer_check_status(bid) == 0:
                return bid
            state["bid"] = None
            done.set()
            return None

        w = LandingWatcher(check, a.transfer_wait)
        try:
            for _ in range(3):
                calls.clear()
                t0 = time.monotonic()
                state["bid"] = a.batch_transfer_async_write(seg, [src], [dst], [n])
                w.kick()
                assert done.wait(30)
                done.clear()
                took = time.monotonic() - t0
                # one check when woken, one per wake-up of the wait (the
                # write landed, or WAIT_S passed), and a spare
                bound = 3 + took / LandingWatcher.WAIT_S
                assert len(calls) <= bound, (len(calls), took)
        finally:
            w.close()
