"""A finished load told to vLLM's scheduler one step earlier, under vLLM's
asynchronous scheduling on a one-worker instance (issue 31).

vLLM's engine loop with async scheduling (EngineCore.step_with_batch_queue,
a batch queue of 2) schedules step k, runs it, and only then hands the
scheduler the output of step k-1.  A load the worker reports over in step
k's get_finished (finished_recving) therefore reached the scheduler after
step k+1 was scheduled: step k+1 ran without the request (an empty step
when nothing else runs, followed by vLLM's 1 ms sleep) and the request was
computed in step k+2.

With one worker (TP 1, PP 1: vLLM's UniProcExecutor runs the worker in the
engine-core process, on its thread, before the scheduler takes step k-1's
output), the worker puts each load it reports over cleanly (every block
landed: no load error to go with it) here as well, and the scheduler side,
in update_connector_output of the output it takes next, adds those loads to
that output's finished_recving (vLLM reads finished_recving after calling
update_connector_output) and takes them out of the later output that
carries them (vLLM must not see a load over twice).  Nothing changes for
the worker's fence: a load is put here by the get_finished that reports it
over, i.e. once nothing more can land in its blocks.  Without async
scheduling the next output taken is the one carrying the load: nothing is
added.  vLLM calls update_connector_output only for a step whose connector
output is not empty, so while a load is in flight the worker's
build_connector_worker_meta returns an empty HoldEvents (connector.py).

Only where both halves live in one process under one key (the engine id and
the data-parallel rank): with several workers (vLLM aggregates their
reports) or workers in other processes the channel stays empty and nothing
changes.
"""
import threading

_lock = threading.Lock()
_channels = {}


class Channel:
    """One instance's: the loads its worker reported over, not yet seen by
    its scheduler side."""

    def __init__(self):
        self.lock = threading.Lock()
        self.armed = False  # the scheduler side takes from it (async scheduling)
        self.over = set()

    def put(self, rids):
        with self.lock:
            self.over.update(rids)

    def take(self):
        with self.lock:
            out, self.over = self.over, set()
        return out

    def pending(self):
        return bool(self.over)


def channel(key):
    """The channel of this key, made on first use (either half may come first:
    vLLM builds the worker before the scheduler)."""
    with _lock:
        ch = _channels.get(key)
        if ch is None:
            ch = _channels[key] = Channel()
        return ch


def drop(key):
    with _lock:
        _channels.pop(key, None)


class SchedulerEarly:
    """The scheduler side's part: what it added early, to take out of the
    output that carries it later."""

    KEEP_OUTPUTS = 8  # an entry not seen again within this many outputs goes

    def __init__(self, key):
        self.key = key
        self.ch = channel(key)
        self.ch.armed = True
        self.told = {}       # req_id -> outputs taken since it was told early
        self.waiting = set()  # requests whose background load may be told early

    def on_output(self, connector_output):
        """vLLM's update_connector_output, before it reads finished_recving:
        returns the req ids told early now."""
        fr = getattr(connector_output, "finished_recving", None)
        seen = set(fr or ())
        out = set(seen)
        if self.told:
            for rid in list(self.told):
                if rid in out:
                    out.discard(rid)
                    del self.told[rid]
                else:
                    self.told[rid] += 1
                    if self.told[rid] > self.KEEP_OUTPUTS:
                        del self.told[rid]
        early = set()
        for rid in self.ch.take():
            if rid in seen:
                self.waiting.discard(rid)  # this output carries it (no pipeline)
            elif rid in self.waiting:
                self.waiting.discard(rid)
                early.add(rid)
                self.told[rid] = 0
        out |= early
        if out != seen:
            connector_output.finished_recving = out or None
        return early

    def close(self):
        self.ch.armed = False
        drop(self.key)
