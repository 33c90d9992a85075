"""Worker-side half of MooncakeConnector: owns this rank's transfer engine,
the registered paged KV cache, the producer's lookup buffer, the consumer's
pulls.

Producer: when a prompt's last chunk has been computed (wait_for_save of that
step, before the response can leave the server) its full blocks are
inserted, zero-copy, into the lookup buffer keyed by token hashes.  vLLM
keeps the blocks (request_finished returned True) until the buffer reports
every extent free: a consumer pulled them (consume mode), they expired
(hold_timeout_s) or were evicted (kv_buffer_size); then get_finished reports
the request in finished_sending and vLLM frees them.

Consumer: start_load_kv queues each load on the engine's pull threads
(KVTransfer.pull_start: recv_kv(pull=True) in C, no Python thread): the
producer leases the matching blocks and this engine READs them straight into
the request's blocks.  A pull is reported done only when nothing more can
land (its own batch completed or was cancelled), so a request aborted
mid-load gets finished_recving only after that: vLLM never reuses a block a
late write could still hit.  Blocks not filled (miss,
shorter match, error) are reported by get_block_ids_with_load_errors and
vLLM computes them.
"""
import json
import logging
import threading
import time

from mooncake_connector.connector import peer_record, tp_map
from mooncake_connector.connector.layout import NULL_BLOCK, KVLayout
from mooncake_connector.connector.settings import SettingsError, shift_port
from mooncake_connector.connector.stats import MooncakeKVConnectorStats, recompute_reason

logger = logging.getLogger("vllm.mooncake_connector")


def _rows(spec):
    """Block rows of a Load/PublishSpec: one id per KV-cache group."""
    if not spec.more_groups:
        return spec.block_ids
    return list(zip(spec.block_ids, *spec.more_groups))


class _Load:
    """One request's load: a pull per producer engine the TP map names."""

    def __init__(self, spec, t0):
        self.spec, self.t0 = spec, t0
        self.pulls = {}    # producer engine name -> pull id (None: not started)
        self.results = {}  # producer engine name -> (matched tokens, error or None)
        self.error = None  # the load could not start at all

    def running(self):
        return [i for n, i in self.pulls.items() if i is not None and n not in self.results]


class WorkerSide:
    def __init__(self, settings, block_size, tp_rank, tp_size, num_blocks=None, facts=None,
                 layer_groups=None, pp_rank=0, dp_rank=0):
        self.s = settings
        self.dp_rank = dp_rank
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
        self.engine = self.kv = self.lb = self.layout = None
        self.name = None
        self.default_producer = None
        self._lock = threading.Lock()
        self._loading = {}        # req_id -> _Load
        self._invalid = set()     # block ids that failed to load, reported once
        self._tag_next = 1
        self._tag_req = {}        # extent tag (one per published block) -> req_id
        self._req_tags = {}       # req_id -> its tags
        self._outstanding = {}    # req_id -> extents the lookup buffer still references
        self._pub_tokens = {}     # req_id -> published tokens (for unpublish)
        self._held = {}           # req_id -> monotonic time vLLM started holding it for us
        self._finished_seen = set()
        self._idle = False        # this step schedules nothing (may wait for releases)
        self._idle_streak = 0     # consecutive idle steps that freed nothing
        self._cuda_sync = None
        self.push_outbox = self.push_c = self.push_p = None  # push flow (push.py)
        self.stats = MooncakeKVConnectorStats()

    # ---- setup ----

    def register_kv_caches(self, kv_caches):
        self._kv_caches = kv_caches
        self._start_engine()
        self._start_bootstrap()

    def _start_bootstrap(self):
        """Producer, TP rank 0 of PP stage 0: the bootstrap server of vLLM's
        in-tree MooncakeConnector contract (bootstrap.py), naming every
        rank's engine.  Once per process: it outlives a sleep-mode restart
        of the engine (the names stay)."""
        if (not self.s.is_producer or self.tp_rank != 0 or self.pp_rank != 0
                or self.bootstrap is not None):
            return
        import os

        from mooncake_connector.connector import bootstrap
        base = self._base
        pp_size = int(self.facts.get("pp_size") or 1)
        self.bootstrap = bootstrap.start(
            self.s, shift_port(base, 0), self.dp_rank, self.tp_size, pp_size,
            lambda t, p: shift_port(base, p * self.tp_size + t), os.environ)

    def _start_engine(self):
        """Engine, registered KV regions, lookup buffer (producer), KVTransfer,
        for the addresses the KV cache tensors have now."""
        from mooncake_connector import _core  # the extension: workers only

        heads = self.facts.get("kv_heads")
        if heads and not self.facts.get("mla"):
            heads = tp_map.heads_per_rank(heads, self.tp_size)
        self.layout = KVLayout(self._kv_caches, self.num_blocks, heads=heads,
                               block_size=self.block_size, layer_groups=self.layer_groups)
        text = json.dumps({k: v for k, v in self.s.mooncake.items() if v is not None})
        cfg = _core.parse_config(text, self.s.config_path or "kv_connector_extra_config")
        if self.s.local_hostname:
            base = self.s.local_hostname
        elif self.s.role == "kv_consumer":
            base = f"{cfg['decode_host']}:{cfg['decode_port']}"
        else:
            base = f"{cfg['prefill_host']}:{cfg['prefill_port']}"
        self._base = base
        self.name = shift_port(base, self.pp_rank * self.tp_size + self.tp_rank)
        self.default_producer = f"{cfg['prefill_host']}:{cfg['prefill_port']}"
        eng = _core.TransferEngine()
        # auth_secret None: the engine reads MC_AUTH_SECRET (docs/security.md).
        eng.initialize(self.name, cfg["metadata_server"], cfg["protocol"], cfg["device_name"],
                       auth_secret=cfg["auth_secret"] or None,
                       same_host_cpu=cfg["same_host_cpu"])
        for addr, n, dev in self.layout.regions():
            eng.register_memory(addr, n, dev)
        self.engine = eng
        if self.s.is_producer:
            self.lb = _core.LookupBuffer(self.s.kv_buffer_size, block_size=self.block_size,
                                         mode="consume", policy="evict",
                                         ttl_s=self.s.hold_timeout_s,
                                         extents_per_block=self.layout.extents_per_block,
                                         track_freed=True)
        self.kv = _core.KVTransfer(eng, self.lb, workers=max(2, self.s.load_workers))
        from mooncake_connector.connector import push as push_mod
        self.push_outbox = push_mod.Outbox(eng)
        if self.s.is_consumer:
            self.push_c = push_mod.PushConsumer(self)
        if self.s.role == "kv_producer":
            self.push_p = push_mod.PushProducer(self)
        self._check_peer_at_start(_core, cfg)
        if any(d.startswith("cuda") for d in self.layout.devices):
            import torch
            self._cuda_sync = torch.cuda.current_stream().synchronize
        if self.tp_rank == 0 and self.pp_rank == 0:
            logger.info("MooncakeConnector worker: engine %s (%s, metadata %s), %d layers, %d "
                        "extents x %d bytes per block, %d blocks on %s", self.name,
                        cfg["protocol"], cfg["metadata_server"], len(self.layout.layers),
                        self.layout.extents_per_block, self.layout.layers[0].block_bytes,
                        self.layout.num_blocks, ",".join(self.layout.devices))
            if self.layout.num_groups > 1:
                logger.info("MooncakeConnector worker: %d KV-cache groups %s (sliding-window "
                            "blocks outside the window are not moved)",
                            self.layout.num_groups, self.facts.get("groups"))

    def _check_peer_at_start(self, core, cfg):
        """Publish this worker's fingerprint; a consumer checks its producer's
        (if that one is up already, else at the first load) and a producer
        its consumer's (at its first publish), before any block moves."""
        self._record = peer_record.make(self.s.role, self.tp_rank, self.tp_size, self.layout,
                                        self.block_size, self.facts)
        self._meta = None
        self._routes = {}         # producer base -> [(engine name, [Piece per layer])]
        self._consumer = None     # producer: (consumer record or None, checked at, fanout)
        self.consumer_base = f"{cfg['decode_host']}:{cfg['decode_port']}"
        if cfg.get("metadata_backend") == "p2p":
            return
        try:
            self._meta = core.MetadataClient(cfg["metadata_server"])
            peer_record.publish(self._meta, self.name, self._record)
        except core.MooncakeError as e:
            logger.warning("MooncakeConnector: layout record not published (%s)", e)
            self._meta = None
            return
        if self.s.role == "kv_consumer":
            self._route(self.default_producer, at_start=True)

    def _route(self, base, at_start=False, producer_tp=None):
        """[(producer engine name, [tp_map.Piece per layer])]: the pulls this
        rank makes for one load from producer `base`.  Raises SettingsError
        if the producer's fingerprint does not fit ours."""
        got = self._routes.get(base)
        if got is not None:
            return got
        theirs = None
        if self._meta is not None:
            from mooncake_connector import MooncakeError
            try:
                theirs = peer_record.fetch(self._meta, shift_port(base, 0))
            except MooncakeError:
                theirs = None  # metadata trouble is reported by the transfer itself
        if theirs is None:  # not up yet / P2P: assume what flow B says, else our own TP
            p_tp = producer_tp or self.tp_size
            theirs = dict(self._record, role="kv_producer", tp_size=p_tp,
                          tp_rank=0, connector=self._record.get("connector"))
            if p_tp != self.tp_size and self.facts.get("kv_heads") is not None:
                heads = self.facts["kv_heads"]
                theirs["extent_bytes"] = [
                    n * tp_map.heads_per_rank(heads, self.tp_size) //
                    tp_map.heads_per_rank(heads, p_tp) if not self.facts.get("mla") else n
                    for n in self._record["extent_bytes"]]
            known = False
        else:
            known = True
        why, pl = peer_record.check(self._record, theirs, shift_port(base, 0), self.tp_rank)
        if why:
            raise SettingsError(("cannot start: " if at_start else "") + why)
        per = {}
        for L_i, (a, b) in enumerate(zip(theirs["extent_bytes"], self._record["extent_bytes"])):
            for p_rank, pc in tp_map.pieces(pl, self.tp_rank, a, b, self.layout.head_order
                                            if theirs.get("layout") == self.layout.head_order
                                            else tp_map.UNKNOWN):
                per.setdefault(p_rank, []).append(pc)
        first = self.pp_rank * theirs["tp_size"]  # the producer's ranks of our PP stage
        route = [(shift_port(base, first + p), pcs) for p, pcs in sorted(per.items())]
        if known:
            self._routes[base] = route
            if not pl.identity or self.tp_rank == 0:
                logger.info("MooncakeConnector: producer %s fits (%s)", base,
                            tp_map.describe(pl))
        return route

    def _fanout(self):
        """Producer: how many pulls of this rank's blocks one prompt gets (the
        decode_url consumer's TP size decides; unknown: 1, i.e. equal TP).
        The consumer's fingerprint is checked here too: one that cannot
        fit is an error in this log, and nothing is published for it."""
        now = time.monotonic()
        c = self._consumer
        if c is not None and now - c[1] < (10.0 if c[0] is not None else 1.0):
            return c[2]
        theirs = None
        if self._meta is not None:
            from mooncake_connector import MooncakeError
            try:
                theirs = peer_record.fetch(self._meta, shift_port(self.consumer_base, 0))
            except MooncakeError:
                theirs = None
        fanout = 1
        if theirs is not None and theirs.get("role") == "kv_consumer":
            why, pl = peer_record.check(self._record, theirs, shift_port(self.consumer_base, 0))
            if why:
                if c is None or c[0] != theirs:
                    logger.error("MooncakeConnector: nothing is published for consumer %s: %s",
                                 self.consumer_base, why)
                fanout = 0
            else:
                fanout = pl.fanout[self.tp_rank]
                if c is None or c[0] != theirs:
                    logger.info("MooncakeConnector: consumer %s fits (%s); this rank serves "
                                "%d pull(s) per prompt", self.consumer_base,
                                tp_map.describe(pl), fanout)
        self._consumer = (theirs, now, fanout)
        return fanout

    # ---- per step ----

    def on_metadata(self, meta):
        self._idle = bool(getattr(meta, "idle", False))
        now = time.monotonic()
        for rid in meta.held:
            self._held.setdefault(rid, now)
        if self.push_p is not None:
            self._drain_notifies()
            for tid in getattr(meta, "push_dropped", None) or ():
                self.push_p.dropped(tid)
            for p in meta.publishes:
                if p.push_tid:
                    lw = self.s.push_layerwise if p.layerwise is None else p.layerwise
                    # Layer by layer needs the layer's KV written when
                    # save_kv_layer runs: true on CPU; on CUDA it would need
                    # an event per layer, so CUDA KV caches push whole prompts.
                    self.push_p.begin(p, expected=self._fanout(),
                                      layerwise=lw and self._cuda_sync is None,
                                      optional=p.push_optional)

    def _drain_notifies(self):
        """Route the push flow's notifications (push.py) to their side."""
        if self.engine is None or self.push_outbox is None:
            return
        from mooncake_connector.connector import push as push_mod
        for sender, msg in self.engine.get_notifies():
            try:
                head, body = push_mod.decode(msg)
            except push_mod.PushError as e:
                logger.warning("MooncakeConnector: notification from %s ignored: %s", sender, e)
                continue
            if head["t"] in ("target", "cancel"):
                if self.push_p is not None:
                    self.push_p.on_message(sender, head, body)
            elif self.push_c is not None:
                self.push_c.on_message(sender, head)

    def withdraw(self, rid):
        """Push took over a prompt published for a pull: its lookup entries
        go (leased ones when their lease ends), so the blocks are not held
        for a pull that will not come."""
        tokens = self._pub_tokens.get(rid)
        if tokens is not None and self.lb is not None:
            self.lb.remove(tokens)

    def save_kv_layer(self, layer_name):
        """Push, layer by layer: this layer's KV is computed for this step."""
        if self.push_p is not None and self.push_p.jobs:
            self.push_p.layer_done(layer_name)

    def start_load(self, meta):
        """Queue each load on the engine's pull threads (C, no Python thread:
        nothing waits for the GIL while the step loop runs): one pull per
        producer rank the TP map names.  In-step (sync) loads are waited for
        here, before the forward reads their blocks."""
        sync = []
        for spec in meta.loads:
            if spec.req_id in self._loading:
                continue
            ld = self._loading[spec.req_id] = _Load(spec, time.monotonic())
            if spec.flow == "P":
                self.stats.add("push_loads")
                self.push_c.start(ld)
                continue
            self._start_pulls(ld)
            if spec.sync:
                sync.append(spec.req_id)
        if sync:
            self._wait_sync(sync)

    def _wait_sync(self, rids):
        ids = [i for r in rids for i in self._loading[r].running()]
        # A pull ends by its own timeout (sync_load_timeout_s), fenced: only
        # then may the forward run, or a late write could land after it.
        while ids and not self.kv.pull_wait(ids, timeout=self.s.sync_load_timeout_s + 5):
            logger.warning("MooncakeConnector: in-step KV loads still running after %.0f s",
                           self.s.sync_load_timeout_s + 5)
        for rid in rids:
            res = self._poll_load(rid)
            self._finish_load(rid, res if res is not None else (0, "load did not finish"))

    def _start_pulls(self, ld, only=None):
        """Start the load's pulls (or those to the engines in `only`)."""
        from mooncake_connector import MooncakeError

        spec = ld.spec
        try:
            if self.kv is None:
                raise ValueError("the KV cache is unregistered (sleep mode)")
            route = self._route(spec.producer or self.default_producer,
                                producer_tp=getattr(spec, "producer_tp", None))
        except SettingsError as e:  # the producer's layout/parallelism cannot map to ours
            ld.error = f"layout mismatch: {e}"
            return
        except (MooncakeError, ValueError) as e:
            ld.error = str(e)
            return
        limit = self.s.sync_load_timeout_s if spec.sync else self.s.load_timeout_s
        for name, pieces in route:
            if only is not None and name not in only:
                continue
            ld.pulls[name] = None
            ld.results.pop(name, None)
            try:
                dest = self.layout.mapped_extents(_rows(spec), pieces)
                left = limit - (time.monotonic() - ld.t0)
                ld.pulls[name] = self.kv.pull_start(
                    name, spec.tokens, dest, timeout=max(left, 0.001),
                    extents_per_block=self.layout.extents_per_block,
                    skip_blocks=spec.skip_blocks)
            except SettingsError as e:
                ld.results[name] = (0, f"layout mismatch: {e}")
            except (MooncakeError, ValueError) as e:
                ld.results[name] = (0, str(e))

    def _poll_load(self, rid):
        """(matched, error) once every pull of the load is over, else None."""
        ld = self._loading[rid]
        if ld.spec.flow == "P":
            return self.push_c.poll(ld)
        if ld.error is not None:
            return 0, ld.error
        for name, pid in ld.pulls.items():
            if name in ld.results or pid is None:
                continue
            r = self.kv.pull_poll(pid)
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
                time.monotonic() - ld.t0 + 0.005 < self.s.load_timeout_s):
            self._start_pulls(ld, only=set(missed))
            return None
        matched = min(m for m, _ in ld.results.values()) if ld.results else 0
        errs = [e for _, e in ld.results.values() if e]
        return matched, (errs[0] if errs else None)

    def _finish_load(self, rid, res):
        """Counts a finished load; blocks it did not fill become load errors."""
        ld = self._loading.pop(rid)
        spec, t0 = ld.spec, ld.t0
        if spec.flow == "P" and getattr(ld, "push", None) is not None and ld.push.aborted:
            return  # aborted while waiting: its blocks are freed, nothing to count
        matched, err = res
        secs = time.monotonic() - t0
        loaded = max(0, min(matched // self.block_size - spec.skip_blocks, len(spec.block_ids)))
        self.stats.add("loads")
        if spec.sync:
            self.stats.add("loads_in_step")
        self.stats.add("load_bytes", loaded * self.layout.bytes_per_block())
        self.stats.add("load_bytes_same_host_cpu", self._same_host_cpu_read_delta())
        self.stats.add("load_tokens", loaded * self.block_size)
        self.stats.add_time(secs)
        if loaded < len(spec.block_ids):
            self._invalid.update(spec.block_ids[loaded:])
            for g in spec.more_groups:  # HMA: the other groups' blocks, less null ones
                self._invalid.update(b for b in g[loaded:] if b != NULL_BLOCK)
            self.stats.add("load_tokens_missed", (len(spec.block_ids) - loaded) * self.block_size)
            # No silent recompute: one warning and one count, by reason.
            reason = recompute_reason(err)
            self.stats.add(f"recompute_{reason}")
            if err:
                self.stats.add("loads_failed")
                logger.warning("MooncakeConnector: loading request %s failed (%s: %s); its "
                               "prompt is computed locally", rid, reason, err)
            else:
                logger.warning("MooncakeConnector: request %s: producer %s held %d of %d "
                               "blocks (not_held: never published, consumed or evicted); the "
                               "rest of its prompt is computed locally", rid,
                               spec.producer or self.default_producer, loaded,
                               len(spec.block_ids))

    def _same_host_cpu_read_delta(self):
        """Bytes this engine READ through the same-host CPU path since the
        last call (the engine's counter; loads are this engine's READs)."""
        if self.engine is None:
            return 0
        now = int(self.engine.get_stats().get("same_host_cpu_bytes_read", 0))
        last, self._shc_read = getattr(self, "_shc_read", 0), now
        return max(0, now - last)

    def publish(self, meta):
        if not meta.publishes or self.lb is None:
            return
        if self._cuda_sync is not None:
            self._cuda_sync()  # the step's KV writes must be done before anyone reads
        from mooncake_connector import MooncakeError

        copies = self._fanout()
        for p in meta.publishes:
            if p.push_tid and self.push_p is not None:
                self.push_p.prompt_done(p.req_id)  # written into the consumer's blocks
                if not (p.push_optional and not self.push_p.has_targets(p.push_tid)):
                    continue
                # A bare transfer_id and no target yet: published for a pull
                # too; a target arriving later withdraws it (withdraw()).
            if copies <= 0:  # no consumer rank reads this rank (or none fits)
                self._pub_tokens[p.req_id] = p.tokens
                self._outstanding[p.req_id] = 0
                continue
            tags = list(range(self._tag_next, self._tag_next + len(p.block_ids)))
            self._tag_next += len(p.block_ids)
            ext = self.layout.extents(_rows(p), tags)
            for t in tags:
                self._tag_req[t] = p.req_id
            self._req_tags[p.req_id] = tags
            # One entry per pull it will serve (consume mode: each pull takes
            # one); the blocks are shared, so their extents come back from
            # take_freed once per extra copy at once, and once at the end.
            done = 0
            try:
                for _ in range(copies):
                    self.kv.send_kv(p.tokens, ext)
                    done += 1
            except MooncakeError as e:
                logger.warning("MooncakeConnector: KV of request %s published for %d of %d "
                               "consumer pulls (%s); the others compute it", p.req_id, done,
                               copies, e)
                self.stats.add("publish_failed")
            if done == 0:
                self._forget_tags(p.req_id, tags)
                continue
            self._outstanding[p.req_id] = len(ext) * done
            self._pub_tokens[p.req_id] = p.tokens
            self.stats.add("publishes")
            self.stats.add("publish_bytes", len(p.block_ids) * self.layout.bytes_per_block())

    def _forget_tags(self, rid, tags=None):
        for t in tags if tags is not None else self._req_tags.pop(rid, ()):
            self._tag_req.pop(t, None)
        self._outstanding[rid] = 0

    def unpublish(self, meta):
        """Preempted after publishing: its blocks are about to be reused."""
        if self.lb is None:
            return
        for rid in meta.unpublish:
            tokens = self._pub_tokens.pop(rid, None)
            if tokens is None:
                continue
            self.lb.remove(tokens)
            # A consumer may be reading the blocks under a lease: wait for it.
            deadline = time.monotonic() + self.s.load_timeout_s + 6
            while self._outstanding.get(rid, 0) > 0 and time.monotonic() < deadline:
                self._drain_freed()
                if self._outstanding.get(rid, 0) > 0:
                    time.sleep(0.001)
            if self._outstanding.get(rid, 0) > 0:
                logger.warning("MooncakeConnector: preempted request %s: %d KV extents still "
                               "shared with other published prompts", rid,
                               self._outstanding[rid])
            self._forget_tags(rid)
            self._outstanding.pop(rid, None)
            self._held.pop(rid, None)

    def _drain_freed(self):
        if self.lb is None:
            return
        self.lb.expire()
        for _addr, _len, tag in self.lb.take_freed():
            rid = self._tag_req.get(tag)  # one tag per block: extents_per_block reports
            if rid is not None and rid in self._outstanding:
                self._outstanding[rid] -= 1

    def get_finished(self, finished_req_ids):
        self._finished_seen.update(finished_req_ids)
        if self.push_outbox is not None:
            self._drain_notifies()
            if self.push_c is not None:
                for rid in finished_req_ids:  # aborted while waiting for pushed KV
                    if rid in self._loading:
                        self.push_c.abort(rid)
            if self.push_p is not None:
                self.push_p.poll()
        done_recv = set()
        for rid in list(self._loading):
            res = self._poll_load(rid)
            if res is None:
                continue
            self._finish_load(rid, res)
            done_recv.add(rid)
        if (self._idle and not done_recv and self._loading and self.push_c is not None
                and self.s.idle_wait_ms > 0
                and all(ld.spec.flow == "P" for ld in self._loading.values())):
            # Only requests waiting for pushed KV and nothing to compute: vLLM
            # would step again at once; wait up to idle_wait_ms for a "done"
            # instead (polled, GIL released while sleeping) so this process
            # leaves the CPU to the prefill.  A new request may start this
            # much later.
            deadline = time.monotonic() + self.s.idle_wait_ms / 1000.0
            while not done_recv and time.monotonic() < deadline:
                time.sleep(0.0002)
                self._drain_notifies()
                for rid in list(self._loading):
                    res = self._poll_load(rid)
                    if res is not None:
                        self._finish_load(rid, res)
                        done_recv.add(rid)
        done_send = self._finished_sends()
        # A step with nothing to compute while we hold finished requests'
        # KV: vLLM runs such steps back to back until every hold ends, so
        # wait (GIL released) for a consumer's release instead: idle_wait_ms,
        # doubling while such steps free nothing, up to idle_wait_max_ms.
        if (self._idle and self._held and not done_send and not done_recv and
                not self._loading and self.push_p is not None and self.push_p.jobs):
            # Push jobs wait for a target or for their writes: poll briefly
            # (notifications have no waitable handle here).
            wait_ms = min(self.s.idle_wait_ms * (1 << min(self._idle_streak, 16)),
                          max(self.s.idle_wait_max_ms, self.s.idle_wait_ms))
            deadline = time.monotonic() + wait_ms / 1000.0
            while not done_send and time.monotonic() < deadline:
                time.sleep(0.0002)
                self._drain_notifies()
                self.push_p.poll()
                done_send = self._finished_sends()
            self._idle_streak = 0 if done_send else self._idle_streak + 1
        elif (self._idle and self._held and not done_send and not done_recv
                and not self._loading and self.s.idle_wait_ms > 0 and self.lb is not None):
            wait_ms = min(self.s.idle_wait_ms * (1 << min(self._idle_streak, 16)),
                          max(self.s.idle_wait_max_ms, self.s.idle_wait_ms))
            deadline = time.monotonic() + wait_ms / 1000.0
            while not done_send:  # a release may free a request's blocks in pieces
                left = deadline - time.monotonic()
                if left <= 0 or not self.lb.wait_freed(left):
                    break
                done_send = self._finished_sends()
            self._idle_streak = 0 if done_send else self._idle_streak + 1
        else:
            self._idle_streak = 0
        self._idle = False
        # Requests that finished without us holding them need no tracking.
        self._finished_seen.intersection_update(self._held)
        return (done_send or None), (done_recv or None)

    def _finished_sends(self):
        """Held requests whose blocks no consumer references any more."""
        done = set()
        if self.lb is None and not self._held:
            return done
        self._drain_freed()
        for rid in list(self._held):
            if rid in self._finished_seen and self._outstanding.get(rid, 0) <= 0 and \
                    not (self.push_p is not None and self.push_p.holds(rid)):
                del self._held[rid]
                self._finished_seen.discard(rid)
                self._forget_tags(rid)
                self._outstanding.pop(rid, None)
                self._pub_tokens.pop(rid, None)
                if self.push_p is not None:
                    self.push_p.forget(rid)
                done.add(rid)
                self.stats.add("sends_finished")
        return done

    def take_invalid_blocks(self):
        out, self._invalid = self._invalid, set()
        return out

    def gauges(self):
        lb = self.lb.stats() if self.lb is not None else {}
        return {"held_bytes": int(lb.get("used_bytes", 0)),
                "lookup_entries": int(lb.get("entries", 0)),
                "loads_in_flight": len(self._loading)}

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
        """Before vLLM frees the KV cache memory.  Every load is over (vLLM
        drained them; any left are waited for, fenced), every published
        prompt is dropped and its request reported finished (its KV is about
        to be gone), and the engine is closed: its regions are unregistered,
        its segment unpublished, its connections closed, so every peer drops
        what it cached about our regions (address, RDMA keys, GPU IPC
        handles) and can only reach us again through a new connection, which
        carries the regions registered at wake-up.  Idempotent."""
        if self.engine is None:
            return
        ids = [i for ld in self._loading.values() for i in ld.running()]
        while ids and not self.kv.pull_wait(ids, timeout=self.s.load_timeout_s + 5):
            logger.warning("MooncakeConnector: KV loads still running before sleep")
        for ld in self._loading.values():  # reported by the next get_finished
            for name, pid in ld.pulls.items():
                if pid is None or name in ld.results:
                    continue
                r = self.kv.pull_poll(pid)  # over (waited above): no flow-b retry now
                ld.results[name] = (r[0], r[1]) if r is not None else \
                    (0, "the KV cache was unregistered for sleep mode")
            ld.pulls = {n: None for n in ld.pulls}  # no pull id outlives this engine
        dropped = len(self._pub_tokens)
        # Every published request is reported in finished_sending once vLLM
        # holds it for us (now or after its finish reaches this worker).
        for rid in list(self._outstanding):
            self._forget_tags(rid)
        self._pub_tokens.clear()
        name = self.name
        self._stop_engine()
        logger.info("MooncakeConnector worker: KV cache unregistered for sleep mode (engine %s "
                    "closed, %d published prompts dropped)", name, dropped)

    def restore_kv_caches(self):
        """After vLLM remapped the KV cache: register it where it is now, with a
        new engine under the same name (peers reconnect and learn these
        regions before their first transfer).  Idempotent."""
        if self.engine is not None or getattr(self, "_kv_caches", None) is None:
            return
        self._start_engine()
        logger.info("MooncakeConnector worker: KV cache registered again after sleep mode "
                    "(engine %s, %d regions)", self.name, len(self.layout.regions()))

    def _stop_engine(self):
        if self.push_p is not None:
            self.push_p.close()
        if self.push_outbox is not None:
            self.push_outbox.close()
        self.push_outbox = self.push_c = self.push_p = None
        for obj in (self.kv, self.engine, getattr(self, "_meta", None)):
            if obj is not None:
                try:
                    obj.close()
                except Exception:  # already closed
                    pass
        self.kv = self.lb = self.engine = self._meta = None
        self._shc_read = 0  # a new engine counts from 0

    def shutdown(self):
        if self.bootstrap is not None:
            self.bootstrap.close()
            self.bootstrap = None
        self._stop_engine()
