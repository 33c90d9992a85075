"""Peer routes of one worker rank: its fingerprint in the metadata server,
which producer ranks hold the blocks a load needs and which heads land where
(consumer, `route`), and how many pulls of its blocks a prompt gets
(producer, `fanout`).  One per engine (a sleep-mode restart makes a new one).
"""
import logging
import time

from mooncake_connector.connector import peer_record, tp_map
from mooncake_connector.connector.settings import SettingsError, shift_port
from mooncake_connector.hostport import join_hostport

logger = logging.getLogger("vllm.mooncake_connector")


class Routes:
    def __init__(self, worker, cfg):
        w = self.w = worker
        self.record = peer_record.make(w.s.role, w.tp_rank, w.tp_size, w.layout,
                                       w.block_size, w.facts,
                                       dp_local=getattr(w, "dp_local", 0))
        self.meta = None
        self._routes = {}         # producer base -> [(engine name, [Piece per layer])]
        self._consumer = None     # producer: (consumer record or None, checked at, fanout)
        self.consumer_base = join_hostport(cfg['decode_host'], cfg['decode_port'])

    def check_at_start(self, core, cfg):
        """Publish this worker's fingerprint; a consumer checks its producer's
        (if that one is up already, else at the first load) and a producer
        its consumer's (at its first publish), before any block moves."""
        w = self.w
        if cfg.get("metadata_backend") == "p2p":
            return
        try:
            self.meta = core.MetadataClient(cfg["metadata_server"])
            peer_record.publish(self.meta, w.name, self.record)
        except core.MooncakeError as e:
            logger.warning("MooncakeConnector: layout record not published (%s)", e)
            self.meta = None
            return
        if w.s.role == "kv_consumer":
            self.route(w.default_producer, at_start=True)

    def _fetch(self, base):
        """The record published by `base`'s rank 0, or None."""
        if self.meta is None:
            return None
        from mooncake_connector import MooncakeError
        try:
            return peer_record.fetch(self.meta, shift_port(base, 0))
        except MooncakeError:
            return None  # metadata trouble is reported by the transfer itself

    def _assumed(self, producer_tp):
        """A producer not up yet / P2P: assume what flow B says, else our own TP."""
        w, mine = self.w, self.record
        p_tp = producer_tp or w.tp_size
        theirs = dict(mine, role="kv_producer", tp_size=p_tp,
                      tp_rank=0, connector=mine.get("connector"))
        if p_tp != w.tp_size and w.facts.get("kv_heads") is not None:
            heads = w.facts["kv_heads"]
            theirs["extent_bytes"] = [
                n * tp_map.heads_per_rank(heads, w.tp_size) //
                tp_map.heads_per_rank(heads, p_tp) if not w.facts.get("mla") else n
                for n in mine["extent_bytes"]]
        return theirs

    def route(self, base, at_start=False, producer_tp=None):
        """[(producer engine name, [tp_map.Piece per layer])]: the pulls this
        rank makes for one load from producer `base`.  Raises SettingsError
        if the producer's fingerprint does not fit ours."""
        got = self._routes.get(base)
        if got is not None:
            return got
        w = self.w
        theirs = self._fetch(base)
        known = theirs is not None
        if not known:
            theirs = self._assumed(producer_tp)
        why, pl = peer_record.check(self.record, theirs, shift_port(base, 0), w.tp_rank)
        if why:
            raise SettingsError(("cannot start: " if at_start else "") + why)
        per = {}
        order = (w.layout.head_order if theirs.get("layout") == w.layout.head_order
                 else tp_map.UNKNOWN)
        for a, b in zip(theirs["extent_bytes"], self.record["extent_bytes"]):
            for p_rank, pc in tp_map.pieces(pl, w.tp_rank, a, b, order):
                per.setdefault(p_rank, []).append(pc)
        first = w.pp_rank * theirs["tp_size"]  # the producer's ranks of our PP stage
        route = [(shift_port(base, first + p), pcs) for p, pcs in sorted(per.items())]
        if known:
            self._routes[base] = route
            if not pl.identity or w.tp_rank == 0:
                logger.info("MooncakeConnector: producer %s fits (%s)", base,
                            tp_map.describe(pl))
        return route

    def fanout(self):
        """Producer: how many pulls of this rank's blocks one prompt gets (the
        decode_url consumer's TP size decides; unknown: 1, i.e. equal TP).
        The consumer's fingerprint is checked here too: one that cannot
        fit is an error in this log, and nothing is published for it."""
        now = time.monotonic()
        c = self._consumer
        if c is not None and now - c[1] < (10.0 if c[0] is not None else 1.0):
            return c[2]
        theirs = self._fetch(self.consumer_base)
        fanout = 1
        if theirs is not None and theirs.get("role") == "kv_consumer":
            why, pl = peer_record.check(self.record, theirs, shift_port(self.consumer_base, 0))
            if why:
                if c is None or c[0] != theirs:
                    logger.error("MooncakeConnector: nothing is published for consumer %s: %s",
                                 self.consumer_base, why)
                fanout = 0
            else:
                fanout = pl.fanout[self.w.tp_rank]
                if c is None or c[0] != theirs:
                    logger.info("MooncakeConnector: consumer %s fits (%s); this rank serves "
                                "%d pull(s) per prompt", self.consumer_base,
                                tp_map.describe(pl), fanout)
        self._consumer = (theirs, now, fanout)
        return fanout

    def close(self):
        if self.meta is not None:
            try:
                self.meta.close()
            except Exception:  # already closed
                pass
        self.meta = None
