"""Push layer load: tell the decode each layer as soon as its writes land.

The decode's attention waits per layer (push_layer_load) for a "layer"
notification, which the producer sends once a layer's writes are
acknowledged.  Polled from vLLM's forward thread alone, that happens at the
next layer's save_kv_layer, and for the last layer only after the rest of
the forward (the last layer's MLP, the final norm) in wait_for_save: the
decode's last layer waited for the prefill's whole forward (issue 31's TTFT
timeline, benchmarks/JOURNAL.md).  This thread is woken when a layer's
writes start; it checks them (transfer_check_status under the producer's
lock) and then blocks, GIL released, on the oldest write still in flight
(TransferEngine.transfer_wait: the batch's condition variable, signalled by
the engine's I/O thread as the write completes; no polling, no sleeps), and
checks again, until none is in flight, telling the decode each layer as it
lands.  The forward thread never waits for it.  Bounded: it waits only
while a target with per-layer notifications has writes in flight and its
lease is not over (WAIT_S at most per wait, so stops and closes are seen);
then it sleeps until woken again.
"""
import logging
import threading

logger = logging.getLogger("vllm.mooncake_connector")


class LandingWatcher:
    WAIT_S = 0.02  # the longest block on one write before checking again

    def __init__(self, check, wait):
        # check() -> None once no watched write is in flight, else a write
        # (batch id) still in flight; wait(bid, timeout) blocks until that
        # write is over or timeout seconds passed.
        self._check = check
        self._wait = wait
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
                    bid = self._check()
                    if bid is None:
                        break
                    self._wait(bid, self.WAIT_S)
                except Exception as e:  # noqa: BLE001 - the thread must go on; the
                    # forward thread's own checks (next layer, wait_for_save) still tell
                    logger.exception("MooncakeConnector push: checking layer writes: %s", e)
                    break
            if self._closed:
                return

    def close(self):
        self._closed = True
        self._wake.set()
        self._t.join(timeout=10)
