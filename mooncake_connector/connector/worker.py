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

from mooncake_connector.connector import peer_record
from mooncake_connector.connector.layout import KVLayout
from mooncake_connector.connector.settings import SettingsError, shift_port
from mooncake_connector.connector.stats import MooncakeKVConnectorStats

logger = logging.getLogger("vllm.mooncake_connector")


class WorkerSide:
    def __init__(self, settings, block_size, tp_rank, tp_size, num_blocks=None):
        self.s = settings
        self.block_size = block_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.num_blocks = num_blocks
        self.engine = self.kv = self.lb = self.layout = None
        self.name = None
        self.default_producer = None
        self._lock = threading.Lock()
        self._loading = {}        # req_id -> [pull id, LoadSpec, start time, early result]
        self._invalid = set()     # block ids that failed to load, reported once
        self._tag_next = 1
        self._tag_req = {}        # extent tag (one per published block) -> req_id
        self._req_tags = {}       # req_id -> its tags
        self._outstanding = {}    # req_id -> extents the lookup buffer still references
        self._pub_tokens = {}     # req_id -> published tokens (for unpublish)
        self._held = {}           # req_id -> monotonic time vLLM started holding it for us
        self._finished_seen = set()
        self._idle = False        # this step schedules nothing (may wait for releases)
        self._cuda_sync = None
        self.stats = MooncakeKVConnectorStats()

    # ---- setup ----

    def register_kv_caches(self, kv_caches):
        self._kv_caches = kv_caches
        self._start_engine()

    def _start_engine(self):
        """Engine, registered KV regions, lookup buffer (producer), KVTransfer,
        for the addresses the KV cache tensors have now."""
        from mooncake_connector import _core  # the extension: workers only

        self.layout = KVLayout(self._kv_caches, self.num_blocks)
        text = json.dumps({k: v for k, v in self.s.mooncake.items() if v is not None})
        cfg = _core.parse_config(text, self.s.config_path or "kv_connector_extra_config")
        if self.s.local_hostname:
            base = self.s.local_hostname
        elif self.s.role == "kv_consumer":
            base = f"{cfg['decode_host']}:{cfg['decode_port']}"
        else:
            base = f"{cfg['prefill_host']}:{cfg['prefill_port']}"
        self.name = shift_port(base, self.tp_rank)
        self.default_producer = f"{cfg['prefill_host']}:{cfg['prefill_port']}"
        eng = _core.TransferEngine()
        eng.initialize(self.name, cfg["metadata_server"], cfg["protocol"], cfg["device_name"])
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
        self._check_peer_at_start(_core, cfg)
        if any(d.startswith("cuda") for d in self.layout.devices):
            import torch
            self._cuda_sync = torch.cuda.current_stream().synchronize
        if self.tp_rank == 0:
            logger.info("MooncakeConnector worker: engine %s (%s, metadata %s), %d layers, %d "
                        "extents x %d bytes per block, %d blocks on %s", self.name,
                        cfg["protocol"], cfg["metadata_server"], len(self.layout.layers),
                        self.layout.extents_per_block, self.layout.layers[0].block_bytes,
                        self.layout.num_blocks, ",".join(self.layout.devices))

    def _check_peer_at_start(self, core, cfg):
        """Publish this worker's layout record; a consumer compares it with its
        producer's, if that one is up already (else at the first load)."""
        self._record = peer_record.make(self.s.role, self.tp_rank, self.tp_size, self.layout,
                                        self.block_size)
        self._meta = None
        self._peer_ok = set()
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
            self._check_peer(shift_port(self.default_producer, self.tp_rank), at_start=True)

    def _check_peer(self, producer, at_start=False):
        """Raise SettingsError if `producer` published a layout we cannot use."""
        if self._meta is None or producer in self._peer_ok:
            return
        from mooncake_connector import MooncakeError
        try:
            theirs = peer_record.fetch(self._meta, producer)
        except MooncakeError:
            return  # metadata trouble is reported by the transfer itself
        why = peer_record.mismatch(self._record, theirs, producer)
        if why:
            raise SettingsError(("cannot start: " if at_start else "") + why)
        if theirs:
            self._peer_ok.add(producer)

    # ---- per step ----

    def on_metadata(self, meta):
        self._idle = bool(getattr(meta, "idle", False))
        now = time.monotonic()
        for rid in meta.held:
            self._held.setdefault(rid, now)

    def start_load(self, meta):
        """Queue each load on the engine's pull threads (C, no Python thread:
        nothing waits for the GIL while the step loop runs).  In-step (sync)
        loads are waited for here, before the forward reads their blocks."""
        sync = []
        for spec in meta.loads:
            if spec.req_id in self._loading:
                continue
            t0 = time.monotonic()
            self._loading[spec.req_id] = [None, spec, t0, None]
            self._start_pull(spec.req_id)
            if spec.sync:
                sync.append(spec.req_id)
        if sync:
            self._wait_sync(sync)

    def _wait_sync(self, rids):
        ids = [self._loading[r][0] for r in rids if self._loading[r][0] is not None]
        # A pull ends by its own timeout (sync_load_timeout_s), fenced: only
        # then may the forward run, or a late write could land after it.
        while ids and not self.kv.pull_wait(ids, timeout=self.s.sync_load_timeout_s + 5):
            logger.warning("MooncakeConnector: in-step KV loads still running after %.0f s",
                           self.s.sync_load_timeout_s + 5)
        for rid in rids:
            res = self._poll_load(rid)
            self._finish_load(rid, res if res is not None else (0, "load did not finish"))

    def _start_pull(self, rid):
        from mooncake_connector import MooncakeError

        entry = self._loading[rid]
        spec = entry[1]
        try:
            if self.kv is None:
                raise ValueError("the KV cache is unregistered (sleep mode)")
            producer = shift_port(spec.producer or self.default_producer, self.tp_rank)
            self._check_peer(producer)
            dest = [(a, n) for a, n, _t in self.layout.extents(spec.block_ids)]
            limit = self.s.sync_load_timeout_s if spec.sync else self.s.load_timeout_s
            left = limit - (time.monotonic() - entry[2])
            entry[0] = self.kv.pull_start(producer, spec.tokens, dest,
                                          timeout=max(left, 0.001),
                                          extents_per_block=self.layout.extents_per_block,
                                          skip_blocks=spec.skip_blocks)
        except (MooncakeError, SettingsError, ValueError) as e:
            entry[0], entry[3] = None, (0, str(e))

    def _poll_load(self, rid):
        """(matched, error) once the load is over, else None."""
        entry = self._loading[rid]
        if entry[0] is None:
            return entry[3]
        r = self.kv.pull_poll(entry[0])
        if r is None:
            return None
        matched, err, _secs = r
        spec = entry[1]
        # Flow B names a producer that will have the KV (a proxy may ask both
        # sides at once): a miss there means "not yet"; ask again.
        if (not matched and not err and spec.flow == "B" and not spec.sync and
                time.monotonic() - entry[2] + 0.005 < self.s.load_timeout_s):
            self._start_pull(rid)
            return self._poll_load(rid) if entry[0] is None else None
        return matched, err

    def _finish_load(self, rid, res):
        """Counts a finished load; blocks it did not fill become load errors."""
        spec, t0 = self._loading.pop(rid)[1:3]
        matched, err = res
        secs = time.monotonic() - t0
        loaded = max(0, min(matched // self.block_size - spec.skip_blocks, len(spec.block_ids)))
        self.stats.add("loads")
        if spec.sync:
            self.stats.add("loads_in_step")
        self.stats.add("load_bytes", loaded * self.layout.bytes_per_block())
        self.stats.add("load_tokens", loaded * self.block_size)
        self.stats.add_time(secs)
        if loaded < len(spec.block_ids):
            self._invalid.update(spec.block_ids[loaded:])
            self.stats.add("load_tokens_missed", (len(spec.block_ids) - loaded) * self.block_size)
            if err:
                self.stats.add("loads_failed")
                logger.warning("MooncakeConnector: loading request %s failed (%s); its "
                               "prompt is computed locally", rid, err)

    def publish(self, meta):
        if not meta.publishes or self.lb is None:
            return
        if self._cuda_sync is not None:
            self._cuda_sync()  # the step's KV writes must be done before anyone reads
        from mooncake_connector import MooncakeError

        for p in meta.publishes:
            tags = list(range(self._tag_next, self._tag_next + len(p.block_ids)))
            self._tag_next += len(p.block_ids)
            ext = self.layout.extents(p.block_ids, tags)
            for t in tags:
                self._tag_req[t] = p.req_id
            self._req_tags[p.req_id] = tags
            self._outstanding[p.req_id] = len(ext)
            try:
                self.kv.send_kv(p.tokens, ext)
                self._pub_tokens[p.req_id] = p.tokens
                self.stats.add("publishes")
                self.stats.add("publish_bytes", len(p.block_ids) * self.layout.bytes_per_block())
            except MooncakeError as e:
                logger.warning("MooncakeConnector: KV of request %s not published (%s); a "
                               "consumer will compute it", p.req_id, e)
                self.stats.add("publish_failed")
                self._forget_tags(p.req_id, tags)

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
        done_recv = set()
        for rid in list(self._loading):
            res = self._poll_load(rid)
            if res is None:
                continue
            self._finish_load(rid, res)
            done_recv.add(rid)
        done_send = self._finished_sends()
        # A step with nothing to compute while we hold finished requests'
        # KV: vLLM runs such steps back to back until every hold ends, so
        # wait (GIL released) for a consumer's release instead, briefly.
        if (self._idle and self._held and not done_send and not done_recv
                and not self._loading and self.s.idle_wait_ms > 0 and self.lb is not None):
            deadline = time.monotonic() + self.s.idle_wait_ms / 1000.0
            while not done_send:  # a release may free a request's blocks in pieces
                left = deadline - time.monotonic()
                if left <= 0 or not self.lb.wait_freed(left):
                    break
                done_send = self._finished_sends()
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
            if rid in self._finished_seen and self._outstanding.get(rid, 0) <= 0:
                del self._held[rid]
                self._finished_seen.discard(rid)
                self._forget_tags(rid)
                self._outstanding.pop(rid, None)
                self._pub_tokens.pop(rid, None)
                done.add(rid)
                self.stats.add("sends_finished")
        return done

    def take_invalid_blocks(self):
        out, self._invalid = self._invalid, set()
        return out

    def take_stats(self):
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
        ids = [e[0] for e in self._loading.values() if e[0] is not None]
        while ids and not self.kv.pull_wait(ids, timeout=self.s.load_timeout_s + 5):
            logger.warning("MooncakeConnector: KV loads still running before sleep")
        for entry in self._loading.values():  # reported by the next get_finished
            if entry[0] is not None:
                r = self.kv.pull_poll(entry[0])  # over (waited above): no retry now
                entry[3] = (r[0], r[1]) if r is not None else \
                    (0, "the KV cache was unregistered for sleep mode")
                entry[0] = None
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
        for obj in (self.kv, self.engine, getattr(self, "_meta", None)):
            if obj is not None:
                try:
                    obj.close()
                except Exception:  # already closed
                    pass
        self.kv = self.lb = self.engine = self._meta = None

    def shutdown(self):
        self._stop_engine()
