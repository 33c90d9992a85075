"""The CUDA layer waiter (connector/layer_events.py) hands layers on in order
and waits for each event asleep (synchronize), never by polling query():
polling took the GIL from vLLM's forward thread every 0.1 ms (H200 run 17).
CUDA does not run on this machine; the events here are host stand-ins with
the two calls the waiter may use."""
import threading
import time

from mooncake_connector.connector.layer_events import LayerWaiter


class HostEvent:
    """Completes when the test says so; counts how it was waited for."""
    queries = 0

    def __init__(self):
        self.done = threading.Event()
        self.syncs = 0

    def record(self):
        pass

    def query(self):
        HostEvent.queries += 1
        return self.done.is_set()

    def synchronize(self):
        self.syncs += 1
        self.done.wait()


def test_layers_handed_on_in_order_without_polling():
    made, ready = [], []
    got = threading.Event()

    def make():
        ev = HostEvent()
        made.append(ev)
        return ev

    def on_ready(li, jobs):
        ready.append((li, jobs))
        got.set()

    HostEvent.queries = 0
    w = LayerWaiter(on_ready, make_event=make)
    try:
        for li in range(3):
            assert w.record(li, ["job%d" % li])
        time.sleep(0.05)
        assert ready == []                     # nothing done on the "GPU" yet
        made[0].done.set()
        assert got.wait(5)
        time.sleep(0.02)
        assert ready == [(0, ["job0"])]        # layer 1 still running
        made[2].done.set()                     # a later event done first: order kept
        time.sleep(0.05)
        assert ready == [(0, ["job0"])]
        made[1].done.set()
        deadline = time.monotonic() + 5
        while len(ready) < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert ready == [(0, ["job0"]), (1, ["job1"]), (2, ["job2"])]
        assert HostEvent.queries == 0, "the waiter polled event.query()"
        assert all(ev.syncs == 1 for ev in made)
    finally:
        for ev in made:
            ev.done.set()
        w.close()


def test_event_error_fails_over_to_whole_prompts():
    class Broken(HostEvent):
        def synchronize(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    ready = []
    w = LayerWaiter(lambda li, jobs: ready.append(li), make_event=Broken)
    try:
        assert w.record(0, [])
        deadline = time.monotonic() + 5
        while w.failed is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert "illegal memory access" in (w.failed or "")
        assert not w.record(1, [])             # from now on: whole prompts after the forward
        assert ready == []
    finally:
        w.close()


def test_close_ends_the_thread():
    evs = []

    def make():
        evs.append(HostEvent())
        return evs[-1]

    w = LayerWaiter(lambda li, jobs: None, make_event=make)
    w.record(0, [])
    w.close()
    evs[0].done.set()
    w._t.join(5)
    assert not w._t.is_alive()
    assert not w.record(1, [])
