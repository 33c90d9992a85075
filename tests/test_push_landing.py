"""The push producer's landing thread (connector/landing.py) on its own:
a kick is never lost (a write started while the thread was checking, or
between its wake-up and its clear, is checked after the kick), it polls
only while check() reports writes in flight, and close() ends it even
while it is polling."""
import threading
import time

from mooncake_connector.connector.landing import LandingWatcher


def test_every_kick_is_followed_by_a_check():
    lock = threading.Lock()
    state = {"kicked": 0, "seen": 0, "calls": 0}

    def check():
        with lock:
            state["seen"] = state["kicked"]
            state["calls"] += 1
        return False  # nothing in flight: the thread goes back to sleep at once

    w = LandingWatcher(check)
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
        return False

    w = LandingWatcher(check)
    try:
        w.kick()
        end = time.monotonic() + 2.0
        while time.monotonic() < end and len(calls) < 2:
            time.sleep(0.001)
        assert len(calls) == 2, calls
    finally:
        w.close()


def test_polls_only_while_busy_and_close_ends_it():
    busy = {"left": 20, "calls": 0}

    def check():
        busy["calls"] += 1
        busy["left"] -= 1
        return busy["left"] > 0

    w = LandingWatcher(check)
    w.kick()
    end = time.monotonic() + 5.0
    while time.monotonic() < end and busy["left"] > 0:
        time.sleep(0.001)
    time.sleep(0.05)
    assert busy["calls"] == 20, busy  # stopped polling once nothing was in flight
    busy["left"] = 10 ** 9  # always busy: close() must still end it
    w.kick()
    time.sleep(0.01)
    t0 = time.monotonic()
    w.close()
    assert time.monotonic() - t0 < 1.0
    assert not w._t.is_alive()
