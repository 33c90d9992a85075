"""Push layer by layer with CUDA KV caches: vLLM calls save_kv_layer when the
layer's kernels are queued on the stream, not done.  save_kv_layer records a
CUDA event on the current stream for that layer (record); a background
thread waits for the events in order and hands each completed layer to the
push producer (on_ready), which starts that layer's writes.  The events are
made with blocking synchronisation and the thread waits in the driver
(event.synchronize(): the GIL released, the thread asleep until the GPU
reaches the event).  It used to poll event.query() every 0.1 ms: each poll
took the GIL from vLLM's forward thread, whose eager forward is Python
launching kernels, and the H200 serving run 17 traced the prefill's forward
0.4-2.2 ms slower per request with the pollers running.  vLLM's forward
thread never waits for this thread.  Bounded: at most MAX_QUEUED layers wait; a layer that
does not fit, or any event error, is simply written with the whole prompt
after the forward (wait_for_save: the stream's synchronize, as before)."""
import logging
import queue
import threading

logger = logging.getLogger("vllm.mooncake_connector")


def _cuda_event():
    import torch
    # blocking=True: synchronize() sleeps (cudaEventBlockingSync) instead of
    # spinning a core; no timing wanted.
    return torch.cuda.Event(blocking=True)


class LayerWaiter:
    MAX_QUEUED = 4096   # layers recorded and not yet completed (a stalled GPU)

    def __init__(self, on_ready, make_event=None):
        self._on_ready = on_ready  # on_ready(layer index, jobs) on the waiter thread
        self._make_event = make_event or _cuda_event
        self._q = queue.Queue(maxsize=self.MAX_QUEUED)
        self._closed = False
        self.failed = None         # an event error: no more layer events (whole prompts)
        self._t = threading.Thread(target=self._run, name="mc-push-layers", daemon=True)
        self._t.start()

    def record(self, li, jobs):
        """vLLM's forward thread: layer li's KV kernels are queued on the
        current stream.  False when the layer is not streamed (closed,
        failed, too many waiting): it goes with the prompt after the forward."""
        if self._closed or self.failed is not None:
            return False
        try:
            ev = self._make_event()
            ev.record()  # on the current stream: after the layer's KV writes
        except RuntimeError as e:
            self._fail(e)
            return False
        try:
            self._q.put_nowait((li, ev, jobs))
        except queue.Full:
            return False
        return True

    def _fail(self, e):
        if self.failed is None:
            self.failed = str(e)
            logger.warning("MooncakeConnector push: CUDA layer events failed (%s); CUDA KV "
                           "caches push whole prompts after the forward from now on", e)

    def _run(self):
        while True:
            item = self._q.get()
            if item is None:
                return
            li, ev, jobs = item
            if self._closed:
                return
            try:
                ev.synchronize()  # GIL released; asleep in the driver (blocking event)
            except RuntimeError as e:
                self._fail(e)
                continue
            try:
                self._on_ready(li, jobs)
            except Exception as e:  # noqa: BLE001 - the thread must go on; the prompt is
                logger.exception("MooncakeConnector push: layer %d's writes: %s", li, e)
                # written (or ended) by the producer's own path after the forward

    def close(self):
        self._closed = True
        try:
            self._q.put_nowait(None)
        except queue.Full:
            pass  # the thread sees _closed after the event it waits for
        self._t.join(timeout=10)
