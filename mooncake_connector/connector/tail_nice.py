"""push_tail_nice (issue 31): a push prefill on CPU KV caches whose every
layer was written as it was saved has nothing left to give its decode once
the step's last layer is saved: the rest of vLLM's forward (the last
layer's MLP and the final norm over the whole prompt) and its sampled token
are not what the decode waits for (it computes the first token itself).
On a host the two servers share, that tail competes with the decode's last
layer, its sampling and the API servers and proxy answering the client.
From the last layer's save until the forward ends (wait_for_save) the
forward thread runs `delta` nicer (setpriority on its own thread id), then
at its old value again.

Lowering a nice value back needs RLIMIT_NICE room or CAP_SYS_NICE: the
round trip is tried once on a throwaway thread at start, and where it is
refused the knob is off with one warning (a forward thread left nicer
would slow every later prefill)."""
import logging
import os
import threading

logger = logging.getLogger("vllm.mooncake_connector")


def _tid():
    return threading.get_native_id()


def probe(delta):
    """None if a thread of this process may go `delta` nicer and back, else
    the error (tried on a throwaway thread: none of ours is left nicer)."""
    out = []

    def run():
        tid = _tid()
        try:
            old = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(old + delta, 19))
            os.setpriority(os.PRIO_PROCESS, tid, old)
            if os.getpriority(os.PRIO_PROCESS, tid) != old:
                raise OSError(f"nice {old} was not restored")
            out.append(None)
        except OSError as e:
            out.append(e)

    t = threading.Thread(target=run, name="mc-nice-probe", daemon=True)
    t.start()
    t.join(5)
    return out[0] if out else OSError("the probe thread did not finish")


class TailNice:
    def __init__(self, delta):
        self.delta = int(delta)
        self.on = self.delta > 0
        self.lowered = 0        # forward tails run nicer (counted)
        self._held = None       # (thread id, its nice value before)
        if self.on:
            err = probe(self.delta)
            if err is not None:
                self._off(f"this process may not lower a thread's nice value back ({err}); "
                          "set RLIMIT_NICE or CAP_SYS_NICE, or leave push_tail_nice at 0")

    def _off(self, why):
        self.on = False
        logger.warning("MooncakeConnector: push_tail_nice is off: %s", why)

    def lower(self):
        """The calling (forward) thread runs `delta` nicer until restore()."""
        if not self.on or self._held is not None:
            return
        tid = _tid()
        try:
            old = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(old + self.delta, 19))
        except OSError as e:
            self._off(f"setpriority failed: {e}")
            return
        self._held = (tid, old)
        self.lowered += 1

    def restore(self):
        if self._held is None:
            return
        tid, old = self._held
        self._held = None
        try:
            os.setpriority(os.PRIO_PROCESS, tid, old)
        except OSError as e:  # the probe passed: not expected; loud, and no more lowering
            logger.error("MooncakeConnector: push_tail_nice could not restore the forward "
                         "thread's nice value %d (%s); it stays nicer", old, e)
            self.on = False
