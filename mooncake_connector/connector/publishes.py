"""The producer side of a worker: publishing and holding blocks.  When a
prompt's last chunk has been computed (wait_for_save of that step, before the
response can leave the server) its full blocks are inserted, zero-copy, into
the lookup buffer keyed by token hashes, one tag per block, once per pull
that will read them (routes.fanout).  vLLM keeps the blocks (request_finished
returned True) until the buffer has given every tag back (take_freed): a
consumer pulled them (consume mode), they expired (hold_timeout_s) or were
evicted (kv_buffer_size), and no push job still writes from them; then
get_finished reports the request in finished_sending and vLLM frees them.
"""
import logging
import time
from collections import OrderedDict

from mooncake_connector.connector.legs import carries
from mooncake_connector.connector.loads import rows

logger = logging.getLogger("vllm.mooncake_connector")


#: The proxy's release naming a prefill leg by its X-Request-Id is looked
#: for this long (each step) when the leg has not published yet.
DROP_WAIT_S = 5.0
#: A leg whose held request ended because another request of its prompt
#: pulled its entries (entries of one prompt are interchangeable) still owes
#: a pull: remembered this long (at most ENDED_MAX of them) for the proxy's
#: release, which then removes one entry of its prompt.
ENDED_S = 60.0
ENDED_MAX = 4096
#: A release that comes when its leg's entries may have expired
#: (hold_timeout_s after it published, less this) removes nothing.
LATE_MARGIN_S = 1.0


class Publishes:
    def __init__(self, worker):
        self.w = worker
        self.tag_next = 1
        self.tag_req = {}       # extent tag (one per published block) -> req_id
        self.req_tags = {}      # req_id -> its tags
        self.outstanding = {}   # req_id -> extents the lookup buffer still references
        self.pub_tokens = {}    # req_id -> published tokens (for unpublish)
        self.pub_t = {}         # req_id -> monotonic time just before it published
        self.pub_n = {}         # req_id -> lookup entries it inserted (one per pull)
        self.held = {}          # req_id -> monotonic time vLLM started holding it for us
        self.finished_seen = set()
        self.dropped = set()    # req_ids the proxy released (drop), until finished
        self.pending_drops = []  # (drop spec, monotonic deadline) not matched yet
        self.ended = OrderedDict()  # req_id -> (tokens, monotonic end, publish time):
                                    # held, ended, not released (ENDED_S)
        self.idle_streak = 0    # consecutive idle steps that freed nothing

    def on_held(self, rids):
        now = time.monotonic()
        for rid in rids:
            self.held.setdefault(rid, now)

    def publish(self, meta):
        w = self.w
        if not meta.publishes or w.lb is None:
            return
        pp = w.push_p
        synced = w.cuda_sync is None
        if not synced and (pp is None or not all(p.push_tid and pp.gated_through(p.req_id)
                                                 for p in meta.publishes)):
            # the step's KV writes must be done before anyone reads them; not
            # for a push whose every write is gated on its layers' CUDA events
            # (push.py gated_through): vLLM's forward thread queues the logits
            # and the sampler at once instead of waiting for the GPU here
            w.cuda_sync()
            synced = True
        copies = w.routes.fanout()
        for p in meta.publishes:
            if p.push_tid and pp is not None:
                pp.prompt_done(p.req_id, synced)  # written into the consumer's blocks
                if not (p.push_optional and not w.push_p.has_targets(p.push_tid)):
                    continue
                # A bare transfer_id and no target yet: published for a pull
                # too; a target arriving later withdraws it (withdraw()).
            if copies <= 0:  # no consumer rank reads this rank (or none fits)
                self.pub_tokens[p.req_id] = p.tokens
                self.outstanding[p.req_id] = 0
                continue
            self._publish_one(p, copies)

    def _publish_one(self, p, copies):
        from mooncake_connector import MooncakeError

        w = self.w
        tags = list(range(self.tag_next, self.tag_next + len(p.block_ids)))
        self.tag_next += len(p.block_ids)
        ext = w.layout.extents(rows(p), tags)
        for t in tags:
            self.tag_req[t] = p.req_id
        self.req_tags[p.req_id] = tags
        t_pub = time.monotonic()  # no entry of it can expire before t_pub + hold_timeout_s
        # One entry per pull it will serve (consume mode: each pull takes
        # one); the blocks are shared, so their extents come back from
        # take_freed once per extra copy at once, and once at the end.
        done = 0
        try:
            for _ in range(copies):
                w.kv.send_kv(p.tokens, ext)
                done += 1
        except MooncakeError as e:
            logger.warning("MooncakeConnector: KV of request %s published for %d of %d "
                           "consumer pulls (%s); the others compute it", p.req_id, done,
                           copies, e)
            w.stats.add("publish_failed")
        if done == 0:
            self.forget_tags(p.req_id, tags)
            return
        self.outstanding[p.req_id] = len(ext) * done
        self.pub_tokens[p.req_id] = p.tokens
        self.pub_t[p.req_id] = t_pub
        self.pub_n[p.req_id] = done
        if p.push_tid and w.push_p is not None:
            # Another held request of the same prompt is in the buffer: its
            # blocks (nodes) were kept and ours came back at once (the
            # buffer stores one copy of a block): our entry counts on its
            # blocks, none of ours is referenced, so our outstanding is 0
            # now.  Our push job must not end with that (nothing would
            # hold our blocks for our decode's target): it waits for its
            # target as a push-only job does (PushProducer.shared).
            self._drain_freed()
            if self.outstanding.get(p.req_id, 0) <= 0:
                w.push_p.shared(p.push_tid)
        w.stats.add("publishes")
        w.stats.add("publish_bytes", len(p.block_ids) * w.layout.bytes_per_block())

    def forget_tags(self, rid, tags=None):
        for t in tags if tags is not None else self.req_tags.pop(rid, ()):
            self.tag_req.pop(t, None)
        self.outstanding[rid] = 0

    def unpublish(self, meta):
        """Preempted after publishing: its blocks are about to be reused."""
        w = self.w
        if w.lb is None:
            return
        for rid in meta.unpublish:
            tokens = self.pub_tokens.pop(rid, None)
            self.pub_t.pop(rid, None)
            self.dropped.discard(rid)
            if tokens is None:
                continue
            w.lb.remove(tokens)
            # A consumer may be reading the blocks under a lease: wait for it.
            deadline = time.monotonic() + w.s.load_timeout_s + 6
            while self.outstanding.get(rid, 0) > 0 and time.monotonic() < deadline:
                self._drain_freed()
                if self.outstanding.get(rid, 0) > 0:
                    time.sleep(0.001)
            if self.outstanding.get(rid, 0) > 0:
                logger.warning("MooncakeConnector: preempted request %s: %d KV extents still "
                               "shared with other published prompts", rid,
                               self.outstanding[rid])
            self.forget_tags(rid)
            self.outstanding.pop(rid, None)
            self.pub_n.pop(rid, None)
            self.held.pop(rid, None)

    def drop(self, specs):
        """The proxy's release (SchedulerSide, kv_transfer_params
        "mc_release"): no decode leg follows the prefill leg that published
        this prompt (its client left, or its first token ended it), so the
        pull it was held for will not come.  Removes one pull's worth of the
        entries stored for exactly that prompt (one per consumer rank reading
        this rank, as the pulls would; never a longer prompt's), so the
        blocks come back through take_freed now instead of at hold_timeout_s.
        Entries of one prompt are interchangeable: another request of the
        same prompt keeps its own.  Named by the prefill's request id (flow
        b's remote_request_id, released once), by the X-Request-Id the leg
        was sent with (the latest held request whose id holds it), or by the
        prompt's tokens.  One that comes when the leg's own entries may
        have expired (hold_timeout_s after it published) removes nothing:
        the leg owes nothing then, and an entry of that prompt left is
        another request's (counted prefill_releases_late; the proxy asks a
        silent decode again for a while, docs/connector.md)."""
        lb = self.w.lb
        if lb is None or not (specs or self.pending_drops):
            return
        now = time.monotonic()
        todo = [(s, now + DROP_WAIT_S) for s in specs] + self.pending_drops
        self.pending_drops = []
        for spec, until in todo:
            rid, tokens = spec[0], spec[1]
            xid = spec[2] if len(spec) > 2 else None
            if rid not in self.pub_tokens and rid not in self.ended and xid:
                # vLLM's request id holds the X-Request-Id the leg was sent
                # with ("cmpl-<id>-0-<random>"): its latest held request, or
                # one that ended since (another request of its prompt pulled
                # its entries: it still owes one)
                rid = next((r for r in reversed(list(self.pub_tokens))
                            if carries(r, xid) and r not in self.dropped), None) or \
                    next((r for r in reversed(self.ended) if carries(r, xid)), None)
                if rid is None and not tokens:
                    # A leg its client left: the release may come before the
                    # leg's last step published (a step runs both, or the
                    # leg's prompt is computed after): looked for again in
                    # the next steps, DROP_WAIT_S at most.
                    if now < until:
                        self.pending_drops.append((spec, until))
                    continue
            t_pub = None
            if rid in self.pub_tokens:
                tokens, t_pub = self.pub_tokens[rid], self.pub_t.get(rid)
            elif rid in self.ended:
                tokens, _end, t_pub = self.ended.pop(rid)  # released once
            if t_pub is not None and now - t_pub >= self.w.s.hold_timeout_s - LATE_MARGIN_S:
                self.w.stats.add("prefill_releases_late")
                logger.info("MooncakeConnector: the proxy's release of request %s came %.1f s "
                            "after it published (hold_timeout_s %g): nothing released (its "
                            "entries expired; one left of that prompt is another request's)",
                            rid, now - t_pub, self.w.s.hold_timeout_s)
                continue
            if not tokens or (rid is not None and rid in self.dropped):
                continue
            if rid is not None and rid in self.pub_tokens:
                self.dropped.add(rid)  # (discarded with its pub_tokens: bounded by them)
            try:
                n = lb.remove(tokens, max=max(1, self.w.routes.fanout()))
            except Exception as e:  # noqa: BLE001 - freed at hold_timeout_s then
                logger.info("MooncakeConnector: releasing request %s: %s", rid, e)
                continue
            if n:
                self.w.stats.add("prefill_releases")

    def withdraw(self, rid):
        """Push took over a prompt published for a pull: its lookup entries
        go (leased ones when their lease ends), so the blocks are not held
        for a pull that will not come."""
        tokens = self.pub_tokens.get(rid)
        self.dropped.add(rid)  # its entries are gone: never released (Publishes.drop)
        n = self.pub_n.pop(rid, 0)
        if tokens is not None and n and self.w.lb is not None:
            # Only its own entries' worth (one per pull it was published
            # for): another request of the same prompt, published under
            # another transfer id, keeps its own; removing every entry of
            # the prompt ended that one as if pulled, and its decode's
            # target then found no job (recomputed, not_held).
            self.w.lb.remove(tokens, max=n)

    def _drain_freed(self):
        lb = self.w.lb
        if lb is None:
            return
        lb.expire()
        for _addr, _len, tag in lb.take_freed():
            rid = self.tag_req.get(tag)  # one tag per block: extents_per_block reports
            if rid is not None and rid in self.outstanding:
                self.outstanding[rid] -= 1

    def _ended(self, rid):
        """A held request ends (its entries pulled, released or expired):
        its prompt kept ENDED_S for a release naming it (drop)."""
        now = time.monotonic()
        ended = self.ended
        while ended and (len(ended) >= ENDED_MAX or now - next(iter(ended.values()))[1] > ENDED_S):
            ended.popitem(last=False)
        tokens = self.pub_tokens.get(rid)
        if tokens and rid not in self.dropped:
            ended[rid] = (tokens, now, self.pub_t.get(rid))

    def _finished_sends(self):
        """Held requests whose blocks no consumer references any more."""
        w, done = self.w, set()
        if w.lb is None and not self.held:
            return done
        self._drain_freed()
        for rid in list(self.held):
            if rid in self.finished_seen and self.outstanding.get(rid, 0) <= 0 and \
                    not (w.push_p is not None and w.push_p.holds(rid)):
                del self.held[rid]
                self.finished_seen.discard(rid)
                self._ended(rid)
                self.dropped.discard(rid)
                self.forget_tags(rid)
                self.outstanding.pop(rid, None)
                self.pub_tokens.pop(rid, None)
                self.pub_t.pop(rid, None)
                self.pub_n.pop(rid, None)
                if w.push_p is not None:
                    w.push_p.forget(rid)
                done.add(rid)
                w.stats.add("sends_finished")
        return done

    def finished(self, idle, busy):
        """Held requests over since the last call (finished_sending).  A step
        with nothing to compute (`idle`, and no load `busy`) while we hold
        finished requests' KV: vLLM runs such steps back to back until every
        hold ends, so wait (GIL released) for a consumer's release instead:
        idle_wait_ms, doubling while such steps free nothing, up to
        idle_wait_max_ms."""
        w = self.w
        done = self._finished_sends()
        waits = idle and self.held and not done and not busy
        if waits and w.push_p is not None and w.push_p.jobs:
            done = self._wait_push()
            self.idle_streak = 0 if done else self.idle_streak + 1
        elif waits and w.s.idle_wait_ms > 0 and w.lb is not None:
            done = self._wait_freed()
            self.idle_streak = 0 if done else self.idle_streak + 1
        else:
            self.idle_streak = 0
        # Requests that finished without us holding them need no tracking.
        self.finished_seen.intersection_update(self.held)
        return done

    def _wait_ms(self):
        s = self.w.s
        return min(s.idle_wait_ms * (1 << min(self.idle_streak, 16)),
                   max(s.idle_wait_max_ms, s.idle_wait_ms))

    def _wait_push(self):
        """Push jobs wait for a target or for their writes: asleep (GIL
        released) on the oldest write in flight (the batch's condition
        variable) or, with none in flight, on the engine's notifications (a
        target, a cancel, a lost peer), then one look; until a held request
        is over or the wait's end.  It polled every 0.2 ms before, on vLLM's
        engine thread, while the decode computed its last layer beside it
        on a small host (issue 31: ~1,500 looks in a 0.3 s wait, a handful
        now; tests/test_push.py)."""
        w, done = self.w, set()
        deadline = time.monotonic() + self._wait_ms() / 1000.0
        last = None
        while not done:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            bid = w.push_p.write_in_flight()
            if bid is not None and bid != last:
                w.push_p.wait_write(bid, left)
            elif not w.engine.wait_notifies(left):
                break  # nothing came: the wait is over
            last = bid  # a write seen over but not yet reaped is not waited on twice
            w.drain_notifies()
            w.push_p.poll()
            done = self._finished_sends()
        return done

    def _wait_freed(self):
        done = set()
        deadline = time.monotonic() + self._wait_ms() / 1000.0
        while not done:  # a release may free a request's blocks in pieces
            left = deadline - time.monotonic()
            if left <= 0 or not self.w.lb.wait_freed(left):
                break
            done = self._finished_sends()
        return done

    def drop_all(self):
        """Sleep mode: every published prompt is dropped (its KV is about to
        be gone); each is reported in finished_sending once vLLM holds it for
        us (now or after its finish reaches this worker).  Returns how many."""
        dropped = len(self.pub_tokens)
        for rid in list(self.outstanding):
            self.forget_tags(rid)
        self.pub_tokens.clear()
        self.pub_t.clear()
        self.pub_n.clear()
        self.dropped.clear()
        self.ended.clear()  # their entries are gone with the KV
        return dropped
