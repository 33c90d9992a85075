"""Push layer load: tell the decode each layer as soon as its writes land.

The decode's attention waits per layer (push_layer_load) for a "layer"
notification, which the producer sends once a layer's writes are
acknowledged.  Polled from vLLM's forward thread alone, that happens at the
next layer's save_kv_layer, and for the last layer only after the rest of
the forward (the last layer's MLP, the final norm) in wait_for_save: the
decode's last layer waited for the prefill's whole forward (issue 31's TTFT
timeline, benchmarks/JOURNAL.md).  This thread is woken when a layer's
writes start; it checks them (transfer_check_status under the producer's
lock, 0.2 ms sleeps between checks: the GIL is free while it sleeps, the
forward thread never waits for it) until none is in flight, telling the
decode each layer as it lands.  Bounded: it checks only while a target with
per-layer notifications has writes in flight and its lease is not over;
then it sleeps until woken again.
"""
import logging
import threading
import time

logger = logging.getLogger("vllm.mooncake_connector")


class LandingWatcher:
    POLL_S = 0.0002  # between checks while a layer's writes are in flight

    def __init__(self, check):
        self._check = check  # check() -> True while writes are still in flight
        self._wake = threading.Event()
        self._closed = False
        self._t = threading.Thread(target=self._run, name="mc-push-landing", daemon=True)
        self._t.start()

    def kick(self):
        """A layer's writes started (called under the producer's lock)."""
        self._wake.set()

    def _run(self):
        while True:
            self._wake.wait()
            self._wake.clear()
            while not self._closed:
                try:
                    busy = self._check()
                except Exception as e:  # noqa: BLE001 - the thread must go on; the
                    # forward thread's own checks (next layer, wait_for_save) still tell
                    logger.exception("MooncakeConnector push: checking layer writes: %s", e)
                    busy = False
                if not busy:
                    break
                time.sleep(self.POLL_S)
            if self._closed:
                return

    def close(self):
        self._closed = True
        self._wake.set()
        self._t.join(timeout=10)
