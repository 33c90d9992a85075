"""The consumer side of a worker: loads.  start_load_kv queues each load on
the engine's pull threads (KVTransfer.pull_start: recv_kv(pull=True) in C,
no Python thread), one pull per producer rank the route names (routes.py);
a push load (flow "P") sends targets instead (push.PushConsumer).  A load is
reported in finished_recving only when nothing more can land (its pulls
completed or were cancelled); blocks it did not fill become load errors
(get_block_ids_with_load_errors) and vLLM computes them.
"""
import logging
import os
import time

from mooncake_connector import trace
from mooncake_connector.connector.layout import NULL_BLOCK
from mooncake_connector.connector.settings import SettingsError
from mooncake_connector.connector.stats import recompute_reason

logger = logging.getLogger("vllm.mooncake_connector")
TRACE = os.environ.get("MC_PUSH_TRACE") == "1"  # log each push layer load's timeline
# A release (Loads.release) holds a pull thread this long at most: a producer
# that does not answer frees the prompt at hold_timeout_s anyway.
RELEASE_TIMEOUT_S = 5.0


def rows(spec):
    """Block rows of a Load/PublishSpec: one id per KV-cache group."""
    if not spec.more_groups:
        return spec.block_ids
    return list(zip(spec.block_ids, *spec.more_groups))


class Load:
    """One request's load: a pull per producer engine the TP map names."""

    def __init__(self, spec, t0):
        self.spec, self.t0 = spec, t0
        self.pulls = {}    # producer engine name -> pull id (None: not started)
        self.results = {}  # producer engine name -> (matched tokens, error or None)
        self.error = None  # the load could not start at all

    def running(self):
        return [i for n, i in self.pulls.items() if i is not None and n not in self.results]


class Loads:
    def __init__(self, worker):
        self.w = worker
        self.loading = {}     # req_id -> Load
        self.invalid = set()  # block ids that failed to load, reported once
        self.layered = []     # this step's push layer loads (push_layer_load)
        self.waited = set()   # layer names wait_for_layer_load saw in this step
        self._shc_read = 0    # the engine's same-host CPU READ bytes, last seen
        self.releasing = []   # pull ids of releases (pulls of no blocks), until polled
        self.clean = {}       # req_id -> its block ids: over with every block landed
                              # (worker._tell_early, get_finished)

    def start(self, meta):
        """Queue each load on the engine's pull threads (C, no Python thread:
        nothing waits for the GIL while the step loop runs): one pull per
        producer rank the TP map names.  In-step (sync) loads are waited for
        here, before the forward reads their blocks."""
        sync = []
        for spec in meta.loads:
            if spec.req_id in self.loading:
                continue
            ld = self.loading[spec.req_id] = Load(spec, time.monotonic())
            if spec.flow == "P":
                self.w.stats.add("push_loads")
                self.w.push_c.start(ld)
                if getattr(spec, "layer_load", False):
                    self.w.stats.add("push_layer_loads")
                    self.layered.append(ld)  # attention waits per layer; over in this step
                continue
            if trace.ON:
                trace.event("pull_start", spec.req_id, sync=spec.sync, flow=spec.flow,
                            blocks=len(spec.block_ids))
            self._start_pulls(ld)
            if spec.sync:
                sync.append(spec.req_id)
        if sync:
            self._wait_sync(sync)

    def release(self, specs):
        """Prompts this consumer will not pull although a producer may hold
        them for it (SchedulerSide._release: in the local prefix cache): a
        pull of no blocks (skip_blocks = all of them) to each producer rank
        the route names.  The producer matches and consumes its entry as for
        a pull, leases nothing and frees the KV; nothing lands here and
        nothing waits for the answer (polled by finished())."""
        from mooncake_connector import MooncakeError

        w = self.w
        for tokens, producer, producer_tp in specs:
            if w.kv is None or w.layout is None:
                return
            try:
                route = w.routes.route(producer or w.default_producer, producer_tp=producer_tp)
            except (SettingsError, MooncakeError, ValueError) as e:
                logger.info("MooncakeConnector: no producer to release a prompt at (%s)", e)
                continue
            for name, _ in route:
                try:
                    self.releasing.append(w.kv.pull_start(
                        name, tokens, [], timeout=min(w.s.load_timeout_s, RELEASE_TIMEOUT_S),
                        extents_per_block=w.layout.extents_per_block,
                        skip_blocks=len(tokens) // w.block_size))
                except (MooncakeError, ValueError) as e:
                    logger.info("MooncakeConnector: releasing a prompt at %s: %s", name, e)

    def _poll_releases(self):
        left = []
        for pid in self.releasing:
            try:
                if self.w.kv.pull_poll(pid) is None:
                    left.append(pid)
            except Exception:  # noqa: BLE001 - unknown id (engine closed): nothing to free
                pass
        self.releasing = left

    def wait_layer(self, layer_name):
        """Push layer load: block (GIL released) until this layer's KV landed
        for every such load of the step, or the load failed (producer nokv,
        cancel, unreachable, push_layer_timeout_s): a failed load is not waited
        for again and its blocks become load errors when the step ends."""
        if not self.layered:
            return
        self.waited.add(layer_name)
        li = self.w.layout.layer_index(layer_name) if self.w.layout is not None else None
        if li is None:
            return
        pc = self.w.push_c
        if trace.ON:
            trace.event("layer_wait", self.layered[0].spec.push_tid, li=li)
        while True:
            self.w.drain_notifies()
            if all(pc.layer_state(ld, li) != "wait" for ld in self.layered):
                if trace.ON:
                    trace.event("layer_go", self.layered[0].spec.push_tid, li=li)
                return
            self._nap()

    def end_layered(self):
        """End of a step with push layer loads: each is over (nothing more
        can land: every layer landed, or the producer answered the cancel,
        or its lease + grace passed) before vLLM may reuse or recompute its
        blocks; failed ones, and any whose layer the forward did not wait
        for, become load errors now (vLLM drops that step's token for them
        and computes the prompt)."""
        if not self.layered:
            return
        w = self.w
        names = [L.name for L in w.layout.layers] if w.layout is not None else []
        skipped = [n for n in names if n not in self.waited]
        for ld in self.layered:
            rid = ld.spec.req_id
            while True:
                w.drain_notifies()
                res = w.push_c.poll(ld)
                if res is not None:
                    break
                self._nap(end=True)
            if skipped and res[1] is None and res[0] > 0:
                # e.g. a FULL CUDA-graph replay (scheduler.py _graph_safe keeps
                # layer loads out of those): the attention may have read the
                # blocks before the KV landed
                res = (0, f"vLLM did not call wait_for_layer_load for layer {skipped[0]} "
                       "in the step (its attention may have read the blocks before the KV "
                       "landed)")
            if TRACE:
                t = ld.push.t_ok
                logger.info("MooncakeConnector push layer load %s: from the step's start, "
                            "layers landed at %s ms, step fenced at %.1f ms (%s)", rid,
                            [round((t[i] - ld.t0) * 1e3, 1) for i in sorted(t)],
                            (time.monotonic() - ld.t0) * 1e3, res[1] or "ok")
            if rid in self.loading:
                self._finish(rid, res)
        self.layered, self.waited = [], set()

    NAP_S = 0.02  # the longest wait for a notification (failure paths' latency)

    def _nap(self, end=False):
        """Until a notification comes (GIL released: a layer landed, a
        producer answered, a connection went) or the step's push loads have
        something to do by time (the layer deadline, or the lease's end
        when the step ends, a target re-send), at most NAP_S: an outbox
        failure is seen that late at worst.  No 2 ms polling: each wake-up
        takes the GIL and runs the loads' checks on the decode's CPU, which
        the prefill's forward shares on small hosts (issue 31)."""
        eng = self.w.engine
        if eng is not None:
            now = time.monotonic()
            until = now + self.NAP_S
            rbid = None
            for ld in self.layered:
                cl = getattr(ld, "push", None)
                if cl is None:
                    continue
                until = min(until, cl.hard_end if end else cl.deadline,
                            *cl.resend_at.values())
                if cl.read and cl.failed is None:
                    # layer read: its give-up time; our own read in flight
                    # is waited for on its batch (no notification ends it)
                    until = min(until, cl.last_note + self.w.s.push_layer_read_stall_s)
                    if rbid is None:
                        rbid = self.w.push_c.read_wait(ld)
            timeout = min(max(until - now, 0.0005), self.NAP_S)
            try:
                if rbid is not None:
                    eng.transfer_wait(rbid, timeout)
                    have = True
                else:
                    have = eng.wait_notifies(timeout)
            except Exception:  # noqa: BLE001 - a read taken meanwhile: the next check
                # sees it; the engine closed meanwhile (sleep mode, shutdown): a nap
                have = None
            if have and trace.ON and hasattr(eng, "last_wake"):
                wake = eng.last_wake()
                if wake is not None:  # when the wait ended in C, then the GIL's wait
                    trace.event("woke", self.layered[0].spec.push_tid if self.layered else "",
                                cw=wake[0], gil_ms=round(wake[1] * 1e3, 3))
            if have is not None or rbid is not None:
                return
        time.sleep(0.0005)

    def _wait_sync(self, rids):
        w = self.w
        ids = [i for r in rids for i in self.loading[r].running()]
        # A pull ends by its own timeout (sync_load_timeout_s), fenced: only
        # then may the forward run, or a late write could land after it.
        while ids and not w.kv.pull_wait(ids, timeout=w.s.sync_load_timeout_s + 5):
            logger.warning("MooncakeConnector: in-step KV loads still running after %.0f s",
                           w.s.sync_load_timeout_s + 5)
        for rid in rids:
            res = self._poll(rid)
            res = res if res is not None else (0, "load did not finish")
            if trace.ON:
                trace.event("recv_done", rid, matched=res[0], err=res[1], sync=True)
            self._finish(rid, res)

    def _start_pulls(self, ld, only=None):
        """Start the load's pulls (or those to the engines in `only`)."""
        from mooncake_connector import MooncakeError

        w, spec = self.w, ld.spec
        try:
            if w.kv is None:
                raise ValueError("the KV cache is unregistered (sleep mode)")
            route = w.routes.route(spec.producer or w.default_producer,
                                   producer_tp=getattr(spec, "producer_tp", None))
        except SettingsError as e:  # the producer's layout/parallelism cannot map to ours
            ld.error = f"layout mismatch: {e}"
            return
        except (MooncakeError, ValueError) as e:
            ld.error = str(e)
            return
        limit = w.s.sync_load_timeout_s if spec.sync else w.s.load_timeout_s
        for name, pieces in route:
            if only is not None and name not in only:
                continue
            ld.pulls[name] = None
            ld.results.pop(name, None)
            try:
                dest = w.layout.mapped_extents(rows(spec), pieces)
                left = limit - (time.monotonic() - ld.t0)
                ld.pulls[name] = w.kv.pull_start(
                    name, spec.tokens, dest, timeout=max(left, 0.001),
                    extents_per_block=w.layout.extents_per_block,
                    skip_blocks=spec.skip_blocks)
            except SettingsError as e:
                ld.results[name] = (0, f"layout mismatch: {e}")
            except (MooncakeError, ValueError) as e:
                ld.results[name] = (0, str(e))

    def _poll(self, rid):
        """(matched, error) once every pull of the load is over, else None."""
        w, ld = self.w, self.loading[rid]
        if ld.spec.flow == "P":
            return w.push_c.poll(ld)
        if ld.error is not None:
            return 0, ld.error
        for name, pid in ld.pulls.items():
            if name in ld.results or pid is None:
                continue
            r = w.kv.pull_poll(pid)
            if r is not None:
                ld.results[name] = (r[0], r[1])
        if len(ld.results) < len(ld.pulls):
            return None
        spec = ld.spec
        # Flow B names a producer that will have the KV (a proxy may ask both
        # sides at once): a miss there means "not yet"; ask again (only the
        # ranks that missed: a hit consumed its entry).
        missed = [n for n, (m, err) in ld.results.items() if not m and not err]
        if (missed and spec.flow == "B" and not spec.sync and
                time.monotonic() - ld.t0 + 0.005 < w.s.load_timeout_s):
            self._start_pulls(ld, only=set(missed))
            return None
        matched = min(m for m, _ in ld.results.values()) if ld.results else 0
        errs = [e for _, e in ld.results.values() if e]
        return matched, (errs[0] if errs else None)

    def _finish(self, rid, res):
        """Counts a finished load; blocks it did not fill become load errors."""
        w, ld = self.w, self.loading.pop(rid)
        spec, t0 = ld.spec, ld.t0
        if spec.flow == "P" and getattr(ld, "push", None) is not None and ld.push.aborted:
            return  # aborted while waiting: its blocks are freed, nothing to count
        matched, err = res
        secs = time.monotonic() - t0
        loaded = max(0, min(matched // w.block_size - spec.skip_blocks, len(spec.block_ids)))
        w.stats.add("loads")
        if spec.sync:
            w.stats.add("loads_in_step")
        w.stats.add("load_bytes", loaded * w.layout.bytes_per_block())
        w.stats.add("load_bytes_same_host_cpu", self._same_host_cpu_read_delta())
        w.stats.add("load_tokens", loaded * w.block_size)
        w.stats.add_time(secs)
        if loaded < len(spec.block_ids):
            self._missed(rid, spec, loaded, err)
        elif getattr(w, "early_key", None) is not None:
            self.clean[rid] = [b for g in (spec.block_ids, *spec.more_groups) for b in g]

    def _missed(self, rid, spec, loaded, err):
        """The blocks past `loaded` become load errors: counted, one warning."""
        w = self.w
        self.invalid.update(spec.block_ids[loaded:])
        for g in spec.more_groups:  # HMA: the other groups' blocks, less null ones
            self.invalid.update(b for b in g[loaded:] if b != NULL_BLOCK)
        w.stats.add("load_tokens_missed", (len(spec.block_ids) - loaded) * w.block_size)
        # No silent recompute: one warning and one count, by reason.
        reason = recompute_reason(err)
        w.stats.add(f"recompute_{reason}")
        if err:
            w.stats.add("loads_failed")
            logger.warning("MooncakeConnector: loading request %s failed (%s: %s); its "
                           "prompt is computed locally", rid, reason, err)
        else:
            logger.warning("MooncakeConnector: request %s: producer %s held %d of %d "
                           "blocks (not_held: never published, consumed or evicted); the "
                           "rest of its prompt is computed locally", rid,
                           spec.producer or w.default_producer, loaded,
                           len(spec.block_ids))

    def _same_host_cpu_read_delta(self):
        """Bytes this engine READ through the same-host CPU path since the
        last call (the engine's counter; loads are this engine's READs)."""
        if self.w.engine is None:
            return 0
        now = int(self.w.engine.get_stats().get("same_host_cpu_bytes_read", 0))
        last, self._shc_read = self._shc_read, now
        return max(0, now - last)

    def abort_pushed(self, finished_req_ids):
        """Requests aborted while waiting for pushed KV: cancel their targets."""
        for rid in finished_req_ids:
            if rid in self.loading:
                self.w.push_c.abort(rid)

    def _poll_all(self, done):
        for rid in list(self.loading):
            res = self._poll(rid)
            if res is not None:
                if trace.ON:  # a push by its transfer id, a pull by vLLM's request id
                    tid = getattr(self.loading[rid].spec, "push_tid", None)
                    trace.event("recv_done", tid or rid, matched=res[0], err=res[1])
                self._finish(rid, res)
                done.add(rid)

    def finished(self, idle):
        """Loads over since the last call (finished_recving)."""
        w, done = self.w, set()
        if self.releasing:
            self._poll_releases()
        self._poll_all(done)
        if (idle and not done and self.loading and w.push_c is not None
                and w.s.idle_wait_ms > 0
                and all(ld.spec.flow == "P" for ld in self.loading.values())):
            # Only requests waiting for pushed KV and nothing to compute: vLLM
            # would step again at once; wait up to idle_wait_ms for a "done"
            # instead, asleep on the engine's notifications (GIL released;
            # a "done", a connection lost or close wakes it), so this process
            # leaves the CPU to the prefill.  It used to look every 0.2 ms
            # (~10 looks per 2 ms idle step, each taking the GIL and running
            # the loads' checks on the CPU the prefill's forward needs on a
            # small host: issue 31).  A new request may start this much later.
            self._idle_wait(done, time.monotonic() + w.s.idle_wait_ms / 1000.0)
        return done

    def _idle_wait(self, done, deadline):
        w = self.w
        while not done:
            now = time.monotonic()
            if now >= deadline:
                return
            until = deadline
            for ld in self.loading.values():  # an outbox result, a re-send, a lease's end
                cl = getattr(ld, "push", None)
                if cl is not None:
                    until = min(until, cl.hard_end, *cl.resend_at.values())
                    if cl.deadline > now:  # the cancel goes out at the deadline
                        until = min(until, cl.deadline)
                    if any(st in ("sending", "cancelling") for st in cl.ranks.values()):
                        until = min(until, now + self.OUTBOX_LOOK_S)
            try:
                w.engine.wait_notifies(max(until - now, 0.0002))
            except Exception:  # noqa: BLE001 - closed meanwhile (sleep mode, shutdown)
                time.sleep(0.0002)
            w.drain_notifies()
            self._poll_all(done)

    OUTBOX_LOOK_S = 0.002  # an idle wait with a send's result due looks this often

    def take_invalid(self):
        out, self.invalid = self.invalid, set()
        return out

    def end_for_sleep(self):
        """Before the engine closes: wait for every running pull (fenced) and
        keep its result for the next get_finished; no pull id outlives the
        engine."""
        w = self.w
        ids = [i for ld in self.loading.values() for i in ld.running()] + self.releasing
        while ids and not w.kv.pull_wait(ids, timeout=w.s.load_timeout_s + 5):
            logger.warning("MooncakeConnector: KV loads still running before sleep")
        self._poll_releases()
        for ld in self.loading.values():  # reported by the next get_finished
            for name, pid in ld.pulls.items():
                if pid is None or name in ld.results:
                    continue
                r = w.kv.pull_poll(pid)  # over (waited above): no flow-b retry now
                ld.results[name] = (r[0], r[1]) if r is not None else \
                    (0, "the KV cache was unregistered for sleep mode")
            ld.pulls = {n: None for n in ld.pulls}  # no pull id outlives this engine
        self._shc_read = 0  # a new engine counts from 0
