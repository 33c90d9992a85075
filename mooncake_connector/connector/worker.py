"""Worker-side half of MooncakeConnector: the hooks vLLM's worker calls, over
this rank's transfer engine, the registered paged KV cache, the producer's
lookup buffer and the consumer's pulls.  One module per concern:

  lifecycle.py  the engine from start to close (and sleep mode), bootstrap server
  routes.py     fingerprints; which producer ranks hold a load's blocks (route),
                how many pulls of ours a prompt gets (fanout)
  loads.py      consumer: pulls and push loads, finished_recving, load errors
  publishes.py  producer: publishing/holding blocks, finished_sending, idle waits
  push.py       the push flow (both sides), its notifications routed from here
  layer_events.py  push layer by layer with CUDA KV caches: a CUDA event per layer
  memory.py     malloc_trim(0) once the server is idle (malloc_trim_idle_s)
"""
import logging

from mooncake_connector import trace
from mooncake_connector.connector import lifecycle
from mooncake_connector.connector.loads import Load as _Load  # noqa: F401  (old name)
from mooncake_connector.connector.loads import Loads
from mooncake_connector.connector.loads import rows as _rows  # noqa: F401  (old name)
from mooncake_connector.connector.publishes import Publishes
from mooncake_connector.connector.stats import MooncakeKVConnectorStats

logger = logging.getLogger("vllm.mooncake_connector")


class WorkerSide:
    def __init__(self, settings, block_size, tp_rank, tp_size, num_blocks=None, facts=None,
                 layer_groups=None, pp_rank=0, dp_rank=0, early_key=None,
                 async_scheduling=False, dp_local=0, dp_count=1):
        self.s = settings
        # vLLM's async scheduling: an idle step's get_finished runs while the
        # previous step's output still waits in vLLM's batch queue
        self.async_scheduling = async_scheduling
        self.early_key = early_key  # early.py: the key this worker's scheduler side uses
        self.dp_rank = dp_rank
        self.dp_local = dp_local  # this engine's index in its server (connector.dp_local)
        self.dp_count = dp_count  # the server's DP engines where vLLM says (connector.dp_count)
        self.bootstrap = None     # producer TP 0 / PP 0: bootstrap.BootstrapServer
        # Pipeline parallel: stage s's TP rank r is engine port + s * tp_size + r
        # on both sides (equal PP sizes: the fingerprint checks it).
        self.pp_rank = pp_rank
        self.facts = dict(facts or {})  # model facts (connector.model_facts) for the fingerprint
        self.layer_groups = dict(layer_groups or {})  # layer name -> KV-cache group (HMA)
        self.block_size = block_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.num_blocks = num_blocks
        self.engine = self.kv = self.lb = self.layout = self.routes = None
        self.name = self.default_producer = None
        self.cuda_sync = None     # CUDA KV cache: the stream's synchronize
        self.push_outbox = self.push_c = self.push_p = None  # push flow (push.py)
        self.hold_events = []     # push: held blocks for the scheduler side (take_hold_events)
        self.loads = Loads(self)
        self.publishes = Publishes(self)
        self._idle = False        # this step schedules nothing (may wait for releases)
        self._prev_idle = True    # so did the step before it
        self._traced = ()         # MC_TRACE: this step's push transfer ids
        self.stats = MooncakeKVConnectorStats()
        self.idle_trim = None     # memory.IdleTrim (malloc_trim_idle_s), from register_kv_caches
        self._trims_seen = (0, 0)

    # ---- setup ----

    def register_kv_caches(self, kv_caches):
        self._kv_caches = kv_caches
        lifecycle.start_engine(self)
        self._start_bootstrap()
        if self.idle_trim is None and self.s.malloc_trim_idle_s > 0:
            from mooncake_connector.connector.memory import IdleTrim
            self.idle_trim = IdleTrim(self.s.malloc_trim_idle_s)

    def _start_bootstrap(self):
        lifecycle.start_bootstrap(self)

    # ---- per step ----

    def on_metadata(self, meta):
        self._idle = bool(getattr(meta, "idle", False))
        if trace.ON:
            self._traced = [x.push_tid for x in (*meta.loads, *meta.publishes)
                            if getattr(x, "push_tid", None)]
            # a prompt published for a pull (flows a, b): keyed by vLLM's id
            self._traced += [p.req_id for p in meta.publishes if not p.push_tid]
            for tid in self._traced:
                trace.event("step_bound", tid, rank=self.tp_rank)
        self.publishes.on_held(meta.held)
        self.publishes.drop(getattr(meta, "drops", None) or ())
        self.loads.invalid.update(getattr(meta, "load_errors", None) or ())
        if self.push_p is not None:
            self.drain_notifies()
            for tid in getattr(meta, "push_dropped", None) or ():
                self.push_p.dropped(tid)
            for p in meta.publishes:
                if p.push_tid:
                    lw = self.s.push_layerwise if p.layerwise is None else p.layerwise
                    # Layer by layer needs the layer's KV written: on CPU
                    # when save_kv_layer runs; on CUDA once that layer's
                    # event completed (layer_events.py, push_layerwise_cuda).
                    watch = getattr(p, "watch", None)
                    self.push_p.begin(p, expected=self.routes.fanout(),
                                      layerwise=lw and self.push_p.streams,
                                      optional=p.push_optional,
                                      watch=self.s.push_layer_watch if watch is None else watch)

    def drain_notifies(self):
        """Route the push flow's notifications (push.py) to their side."""
        eng = self.engine
        if eng is None or self.push_outbox is None:
            return
        from mooncake_connector.connector import push as push_mod
        for sender, msg in eng.get_notifies():
            try:
                head, body = push_mod.decode(msg)
            except push_mod.PushError as e:
                logger.warning("MooncakeConnector: notification from %s ignored: %s", sender, e)
                continue
            if head["t"] in ("target", "cancel", "rdone"):
                if self.push_p is not None:
                    self.push_p.on_message(sender, head, body)
            elif self.push_c is not None:
                self.push_c.on_message(sender, head, body)
        lost = eng.take_lost_peers()  # after the messages sent before the loss
        if lost and self.push_c is not None:
            for name in lost:
                self.push_c.peer_lost(name)

    def save_kv_layer(self, layer_name):
        """Push, layer by layer: this layer's KV is computed for this step."""
        if self.push_p is not None and self.push_p.jobs:
            for tid in self._traced:
                trace.event("save_in", tid)
            # CUDA through the engine's gate: one engine call (push.py
            # gate_layer), unless a notification waits.  A target that
            # arrived during this forward (the decode leg runs beside the
            # prefill) gets the layers computed so far now, and the rest
            # layer by layer, not the whole prompt after the forward.
            pp = self.push_p
            if not pp.gate_layer(layer_name):
                self.drain_notifies()
                if not pp.gate_layer(layer_name):
                    pp.layer_done(layer_name)
            for tid in self._traced:
                trace.event("save_out", tid)

    def start_load(self, meta):
        for tid in self._traced:
            trace.event("fwd_start", tid, rank=self.tp_rank)
        if self.push_c is not None:
            for tid, producer, producer_tp in getattr(meta, "push_gone", ()):
                self.push_c.gone(tid, producer, producer_tp)
        self.loads.release(getattr(meta, "releases", ()))
        self.loads.start(meta)

    def wait_for_layer_load(self, layer_name):
        """Push layer load (push_layer_load): this layer's KV has landed, or
        its load failed (reported when the step ends)."""
        self.loads.wait_layer(layer_name)

    def publish(self, meta):
        for tid in self._traced:
            trace.event("fwd_end", tid, rank=self.tp_rank)
        self.publishes.publish(meta)
        if meta.publishes:
            for tid in self._traced:
                trace.event("published", tid, rank=self.tp_rank)
        if self.publishes.pending_drops:  # a release that came before this publish
            self.publishes.drop(())
        if self.push_p is not None and self.push_p.jobs:
            self.push_p.flush_layers()  # decode attention waiting per layer: tell it now
            for tid in self._traced:
                trace.event("flushed", tid, rank=self.tp_rank)

    def unpublish(self, meta):
        self.publishes.unpublish(meta)

    def withdraw(self, rid):
        self.publishes.withdraw(rid)

    def get_finished(self, finished_req_ids):
        self.loads.end_layered()  # before vLLM may reuse or recompute their blocks
        for tid in self._traced:
            trace.event("get_finished", tid, rank=self.tp_rank)
        self._traced = ()
        self.publishes.finished_seen.update(finished_req_ids)
        if self.push_outbox is not None:
            self.drain_notifies()
            if self.push_c is not None:
                self.loads.abort_pushed(finished_req_ids)
            if self.push_p is not None:
                self.push_p.poll()
        # An idle step may wait (a "done", a release, a hold's answer).  Under
        # async scheduling not right after a step that computed: vLLM takes
        # that step's output (tokens, a prefill's answer) only once this
        # get_finished returns; the wait would hold it back (the next idle
        # step waits).
        idle = self._idle and (self._prev_idle or not self.async_scheduling)
        self._prev_idle, self._idle = self._idle, idle
        done_recv = self.loads.finished(self._idle)
        if self.early_key is not None:
            self._tell_early(done_recv)
        if self.push_c is not None and self.push_c.held:
            self._poll_holds()
        busy = bool(done_recv or self.loads.loading)
        done_send = self.publishes.finished(self._idle, busy)
        self._idle = False
        if self.idle_trim is not None:
            self.idle_trim.step()
            self._count_trims()
        return (done_send or None), (done_recv or None)

    def _early_channel(self):
        from mooncake_connector.connector import early
        ch = early.channel(self.early_key)
        return ch if ch.armed else None

    def _tell_early(self, done_recv):
        """Loads over cleanly (every block landed, none a load error) go to
        this process's scheduler side as well, which tells vLLM with the
        output it takes next: under async scheduling the previous step's
        (early.py).  Only once get_finished returns them: nothing more can
        land in their blocks."""
        clean, self.loads.clean = self.loads.clean, {}
        if not done_recv:
            return
        ch = self._early_channel()
        if ch is None:
            return
        bad = self.loads.invalid
        ok = [r for r in done_recv if r in clean and not (bad and bad.intersection(clean[r]))]
        if ok:
            ch.put(ok)

    def early_watched(self):
        """A load is in flight, or told early but not yet taken by the
        scheduler side: this step's output must reach update_connector_output
        (early.py)."""
        if self.early_key is None:
            return False
        ch = self._early_channel()
        return ch is not None and bool(self.loads.loading or ch.pending())

    def _poll_holds(self):
        """Blocks held for a same-host producer that has not answered
        (push.PushConsumer._hold): back once it answers or exits.  vLLM
        keeps stepping while any are held (has_pending_push_work); a step
        with nothing else to do waits for the answer asleep on the engine's
        notifications (its answer wakes it), up to idle_wait_max_ms: a
        stopped producer may stay stopped for minutes."""
        pc = self.push_c
        pc.poll_holds()
        wait_ms = max(self.s.idle_wait_ms, self.s.idle_wait_max_ms)
        if (self._idle and pc.held and not self.loads.loading and self.s.idle_wait_ms > 0
                and self.engine is not None):
            try:
                self.engine.wait_notifies(wait_ms / 1000.0)
            except Exception:  # noqa: BLE001 - closed meanwhile
                return
            self.drain_notifies()
            pc.poll_holds()

    def take_hold_events(self):
        """("hold", req_id, [block ids per group]) / ("release", req_id)
        since the last call, for the scheduler side (build_connector_worker_meta)."""
        if self.push_c is not None:
            self.hold_events.extend(self.push_c.take_hold_events())
        out, self.hold_events = self.hold_events, []
        return out

    def _count_trims(self):
        t = self.idle_trim
        seen = (t.trims, t.freed_bytes)
        if seen != self._trims_seen:
            self.stats.add("malloc_trims", seen[0] - self._trims_seen[0])
            self.stats.add("malloc_trim_freed_bytes", seen[1] - self._trims_seen[1])
            self._trims_seen = seen

    def take_invalid_blocks(self):
        return self.loads.take_invalid()

    def gauges(self):
        lb = self.lb.stats() if self.lb is not None else {}
        return {"held_bytes": int(lb.get("used_bytes", 0)),
                "lookup_entries": int(lb.get("entries", 0)),
                "loads_in_flight": len(self.loads.loading)}

    def take_stats(self):
        g = self.gauges() if self.kv is not None else None
        if g is not None and g != getattr(self, "_last_gauges", None):
            self.stats.set_gauges(self.tp_rank, g)  # reported when they change
            self._last_gauges = g
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, MooncakeKVConnectorStats()
        return out

    # ---- sleep mode (vLLM >= 0.33: the KV cache memory is freed, then remapped) ----

    def unregister_kv_caches(self):
        lifecycle.unregister_for_sleep(self)

    def restore_kv_caches(self):
        lifecycle.restore_after_sleep(self)

    def shutdown(self):
        if self.idle_trim is not None:
            self.idle_trim.close()
            self.idle_trim = None
        if self.bootstrap is not None:
            self.bootstrap.close()
            self.bootstrap = None
        lifecycle.stop_engine(self)
