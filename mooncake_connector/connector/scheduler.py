"""Scheduler-side half of MooncakeConnector: decides what each step's
workers load and publish.  Pure Python and never touches a GPU; only a
flow-a consumer's probe (probe.py) imports the extension, at its first probe.

Flows (docs/connector.md):
  A  consumer, request without kv_transfer_params: the prompt's full blocks
     are looked up by token hashes at the configured producer (prefill_url).
  B  kv_transfer_params {"do_remote_prefill": true, "remote_engine_id": ...}:
     the same lookup at the named producer; a producer answering a request
     with {"do_remote_decode": true} returns these params in its response.
How much to load is known before the request is scheduled: flow B's params
carry num_tokens (what the producer published); in flow A the scheduler
probes the producer (probe.py, one round trip; a miss costs nothing more).
The probe runs on its own thread, started when the request arrives
(on_new_request): until its answer is in, get_num_new_matched_tokens says
"not known yet" (None) and vLLM asks again next step, so the scheduler,
and every running request with it, never waits on the network; only a step
with no other request running waits for the answer, up to probe_wait_ms
(else vLLM would run an empty step and sleep 1 ms: ~2 ms per request).  An answer
later than lookup_timeout_s + PROBE_GRACE_S counts as a miss.
Loads up to sync_load_max_bytes run inside the step that schedules the
request (vLLM's synchronous load: no extra scheduler steps); larger ones, and
flow B loads whose size is not known yet, run asynchronously (the request
waits in WAITING_FOR_REMOTE_KVS).  Blocks a worker could not fill are
reported as load errors and vLLM computes them locally.
"""
import logging
import os
import time

from mooncake_connector.connector.legs import LegLedger
from mooncake_connector.connector.metadata import (LoadSpec, MooncakeConnectorMetadata,
                                                   PublishSpec)
from mooncake_connector.connector.push import is_push, transfer_id
from mooncake_connector.connector.settings import dp_base, shift_port
from mooncake_connector.hostport import engine_name_problem, is_engine_name, join_hostport
from mooncake_connector.connector.stats import MooncakeKVConnectorStats, recompute_reason
from mooncake_connector import trace

logger = logging.getLogger("vllm.mooncake_connector")

PROBE_REUSE_S = 0.5  # a probe's answer serves the same waiting request this long
PROBE_GRACE_S = 0.1  # a probe pending this much past lookup_timeout_s is a miss
PENDING = object()   # _known_size: the producer's answer is not in yet
TRACE = os.environ.get("MC_PUSH_TRACE") == "1"  # log push layer loads' timelines
_GRAPH_WARNED = False  # _graph_safe's warning: once per process
_ASYNC_SAID = set()  # async scheduling's notes: each once per process


def _log_async_once(msg, level=logging.INFO):
    if msg not in _ASYNC_SAID:
        _ASYNC_SAID.add(msg)
        logger.log(level, msg)


_BAD_FLAGS = set()  # kv_transfer_params keys already warned about (once per key)


def _flag(params, key):
    """A per-request switch of kv_transfer_params (push_layer_load,
    push_layer_read, push_layerwise, push_layer_watch): True or False, None
    when absent or null (the server's setting).  Any other value (a client
    sending "true", 1 or "yes" to the server directly; our proxy sends JSON
    booleans) is the server's setting too, said once per key in a WARNING
    naming the value and the fix, never taken silently."""
    v = params.get(key)
    if v is None or isinstance(v, bool):
        return v
    if key not in _BAD_FLAGS:
        _BAD_FLAGS.add(key)
        logger.warning("MooncakeConnector: kv_transfer_params %r is %s, not true or false: "
                       "ignored, this server's %s setting is used; send a JSON boolean (said "
                       "once per key)", key, repr(v)[:80], key)
    return None


def bytes_per_block(kv_cache_config):
    """KV bytes one block holds on one worker (all layers), or None."""
    try:
        return sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names)
                   for g in kv_cache_config.kv_cache_groups) or None
    except (AttributeError, TypeError):
        return None


class SchedulerSide:
    def __init__(self, settings, block_size, tp_size, kv_cache_manager_getter,
                 block_bytes=None, probe=None, groups=1, graphs=(False, False, 1),
                 async_scheduling=False, early=None, dp_size=1, dp_local=0, pp_size=1,
                 stale_recompute=None):
        self.s = settings
        # vLLM's data parallelism inside this server: a forget (legs.py) may
        # reach another engine than its leg's, which would answer "unseen"
        # for a leg its sibling pulls; such a server always answers "seen"
        self.dp_size = dp_size
        self.dp_local = dp_local  # this engine's index in its server (connector.dp_local)
        # early.SchedulerEarly (async scheduling, one worker in this process):
        # a background load's end told with the output vLLM takes next
        self.early = early
        # vLLM's async scheduling (connector.async_scheduling_on): no in-step
        # loads, whose failure vLLM cannot recover then; every load goes in
        # the background (WAITING_FOR_REMOTE_KVS) and a layer load is taken
        # as a whole-prompt push.
        self.async_scheduling = async_scheduling
        # connector.stale_recompute_runner under load_failure_policy
        # "recompute" (what runs here, else None): vLLM would recompute a
        # failed in-step load at stale positions (a wrong answer), so no
        # in-step loads either; "fail" lifts it (the request ends with an
        # error, which our proxy takes again).
        self.stale_recompute = stale_recompute
        # connector.cudagraph_facts: (mixed batches replay FULL CUDA graphs,
        # uniform decode batches do, the uniform decode query length)
        self.graphs = graphs
        self.groups = groups      # KV-cache groups (a layer load needs exactly one)
        self.block_size = block_size
        self.tp_size = tp_size
        self.block_bytes = block_bytes  # per worker; None = unknown (loads go async)
        self._kvm = kv_cache_manager_getter  # () -> KVCacheManager | None
        from mooncake_connector.connector.holds import BlockHolds
        self.holds = BlockHolds(kv_cache_manager_getter)  # blocks kept for a same-host producer
        self._probe = probe       # ProducerProbe (flow A consumers) or None
        self._claims = {}         # req_id -> (tokens claimed through, sync)
        self._probed = {}         # req_id -> (held tokens or None, monotonic time)
        self._found_at = {}       # flow A: req_id -> producer DP engine holding it (probe)
        self._located = {}        # in-tree push leg: req_id -> producer DP engine holding
                                  # its prompt, None: the named one (_locate)
        self._asked = {}          # req_id -> monotonic time its probe was asked
        self._loads = {}          # req_id -> LoadSpec, sent with the next metadata
        self._publishes = []      # PublishSpec, sent with the next metadata
        self._held = []           # req ids newly held, sent with the next metadata
        self._unpublish = []
        self._push_dropped = []   # producer: push transfer ids that ended without KV
        self._push_gone = []      # consumer: push requests ended without a target sent
        self._releases = []       # consumer: (tokens, producer, producer_tp) not to be pulled
        self._drops = []          # producer: (req id, tokens, X-Request-Id) the proxy released
        self._to_release = {}     # consumer: req_id -> full-block tokens, released once
                                  # vLLM has allocated its blocks (update_state_after_alloc)
        self._published = {}      # req_id -> published tokens
        self._reqs = {}           # producer: req_id -> Request while it runs
        self._blocks = {}         # producer: req_id -> block ids (when no cache manager)
        self._tried = set()       # consumer: requests that had their one load
        self._recomputed = set()  # consumer: requests counted as recomputed (once each)
        self._batch = set()       # req ids the previous step scheduled (still running)
        self._busy = set()        # consumer: layer loads turned into whole-prompt pushes
        self._graphed = set()     # consumer: the same, because of FULL CUDA graphs
        self._in_step = set()     # consumer: requests with an in-step load (blocks cached early)
        self._new = (set(), set())  # consumer: requests first scheduled in the last two steps
        self._unrecomputed = {}   # consumer: in-step load failed -> [(index, block id)] from
                                  # its first failed block, trimmed as its steps compute them
        self._load_errors = []    # consumer: block ids to report failed again (next step)
        self._readers = set()     # consumer: requests that were scheduled on such blocks
        self.stats = MooncakeKVConnectorStats()
        self._traced_bg = {}      # consumer, MC_TRACE only: req_id -> push transfer id of a
                                  # background (whole-prompt) load until first computed
        # consumer: which decode legs (flows a, b) paid for their prompt's
        # hold at the producer (legs.py: the proxy's "mc_forget")
        self._legs = LegLedger() if settings.is_consumer else None
        self.producer_base = None
        if settings.is_producer:
            url = settings.local_hostname or settings.mooncake.get("prefill_url")
            # this engine's own names (vLLM data parallelism: lifecycle._name)
            self.producer_base = dp_base(url, dp_local, tp_size, pp_size) if url else None
        # producer: the port of this server's bootstrap server as configured
        # (bootstrap.py; None: none), named in push answers so that our
        # proxy can find the server's engine table without
        # --prefill-bootstrap (proxy_engines.PrefillEngines.hint checks that
        # the table found there names the engine that answered)
        self.bootstrap_port = _bootstrap_port(settings) if settings.is_producer else None

    # ---- consumer ----

    def _source(self, request):
        """(flow, producer base name or None) if this request loads, else None."""
        if not self.s.is_consumer:
            return None
        params = getattr(request, "kv_transfer_params", None) or {}
        if _is_retake(params):
            return None  # the proxy's retake of a leg whose load failed: computed here
        if params.get("do_remote_prefill"):
            producer = params.get("remote_engine_id")
            if not producer and params.get("remote_host") and params.get("remote_port"):
                producer = join_hostport(params['remote_host'], params['remote_port'])
            if is_push(params) and transfer_id(params):
                # push: the producer writes into our blocks (an in-tree leg:
                # the engine found holding its prompt, _locate)
                return "P", self._located.get(request.request_id) or producer or None
            return "B", producer or None
        if self.s.role == "kv_consumer" and self.s.flow_a:
            # the producer's data-parallel engine its probe found the prompt
            # in (probe.dp_engines); None: the configured one
            return "A", self._found_at.get(request.request_id)
        return None

    def _full_tokens(self, request):
        prompt = request.prompt_token_ids or []
        n = (len(prompt) // self.block_size) * self.block_size
        params = getattr(request, "kv_transfer_params", None) or {}
        published = params.get("num_tokens") if params.get("do_remote_prefill") else None
        if isinstance(published, int) and 0 <= published < n:
            n = (published // self.block_size) * self.block_size
        return n

    def _known_size(self, request, src, n_full):
        """Tokens the producer holds (from block 0), None if not known yet."""
        if src[0] == "P":
            return None  # pushed once computed: claim every full block, async
        if src[0] == "B":
            params = getattr(request, "kv_transfer_params", None) or {}
            return n_full if isinstance(params.get("num_tokens"), int) else None
        if self._probe is None:
            return None
        # A request vLLM could not schedule yet (no free blocks) is offered
        # again every step: reuse a fresh answer instead of asking again.
        now = time.monotonic()
        rid = request.request_id
        cached = self._probed.get(rid)
        if cached is not None and now - cached[1] < PROBE_REUSE_S:
            return cached[0]
        if rid not in self._asked:
            self._ask(request, src, n_full, now)  # vLLM without on_new_request
        done, held = self._probe.answer(rid)
        if not done and self._may_wait(rid):
            t0 = time.monotonic()
            if self._probe.wait(rid, self.s.probe_wait_ms / 1000.0):
                done, held = self._probe.answer(rid)
            if trace.ON:
                trace.event("probe_wait", rid, ms=(time.monotonic() - t0) * 1e3, got=done)
        if done:
            where = getattr(self._probe, "last_where", None)
            if where is not None:
                self._found_at[rid] = where
            else:
                self._found_at.pop(rid, None)
        if not done:
            asked = self._asked.get(rid, now)
            patience = self._probe.timeout_for(src[1])  # longer for a first contact
            if now - asked < patience + PROBE_GRACE_S:
                return PENDING
            self._probe.forget(rid)  # too late: compute the prompt, drop a late answer
            self._probe.last_unreachable = (
                f"producer {src[1] or 'prefill_url'} did not answer the lookup within "
                f"{patience:g} s (lookup_timeout_s={self.s.lookup_timeout_s}, or longer for a "
                f"first contact) (timed out)")
            held = 0
        self._asked.pop(rid, None)
        held = None if held is None else min(held, n_full)
        self._probed[rid] = (held, now)
        return held

    def _may_wait(self, rid):
        """Whether this step may wait (probe_wait_ms) for `rid`'s probe: only
        while no other request runs (the step would compute nothing else, and
        vLLM would run empty steps, 1 ms apart, until the answer is in)."""
        return self.s.probe_wait_ms > 0 and not (self._batch - {rid})

    def _recompute(self, request, reason, why):
        """No silent recompute: a prompt this consumer was meant to load is
        computed here; one warning and one count (by reason) per request."""
        rid = request.request_id
        if rid in self._recomputed:
            return
        self._recomputed.add(rid)
        self.stats.add(f"recompute_{reason}")
        logger.warning("MooncakeConnector: request %s: its prompt (%d tokens) is computed "
                       "locally, not loaded (%s: %s)", rid, len(request.prompt_token_ids or ()),
                       reason, why)

    def _gone(self, request, src):
        """A push request that sends its producer no target (its prompt all
        in this side's prefix cache, aborted before its load started): the
        workers send each producer rank a cancel with the next metadata."""
        params = getattr(request, "kv_transfer_params", None) or {}
        if len(request.prompt_token_ids or ()) >= self.block_size and \
                (src[1] is None or is_engine_name(src[1])):
            self._push_gone.append((transfer_id(params), src[1],
                                    _int_or_none(params.get("tp_size"))))

    def _release(self, request, src, n_full):
        """Flow A/B: this consumer will not pull a prompt its producer may
        hold for it (every full block it would read is in the local prefix
        cache, or only the block holding the last token is left, which this
        step computes): the workers send each producer rank of its route a
        pull of no blocks with the next metadata (Loads.release).  That
        consumes the producer's entry as the pull would have, so it frees
        the prompt's KV now instead of holding it until hold_timeout_s; a
        producer holding nothing answers a miss."""
        params = getattr(request, "kv_transfer_params", None) or {}
        if n_full < self.block_size or (src[1] is not None and not is_engine_name(src[1])):
            return False
        if src[0] == "B" and params.get("num_tokens") == 0:
            return False  # the producer published nothing
        if src[0] == "A" and self._probe is not None:
            why = getattr(self._probe, "last_unreachable", None)
            done, held = self._probe.answer(request.request_id)  # taken: it is not needed
            self._probe.last_unreachable = why
            if done and held == 0:
                return False  # its probe found nothing there
        self._releases.append((list(request.prompt_token_ids[:n_full]), src[1],
                               _int_or_none(params.get("tp_size"))))
        self.stats.add("load_releases")
        return True

    def _release_unpulled(self, request, src, unstarted):
        """Flow A/B: a request that ends (aborted: its client left, the
        proxy closed the decode leg) before its pull was sent leaves the
        producer holding the prompt for it until hold_timeout_s: released
        now instead (a pull of no blocks, as for a local prefix-cache hit).
        Only where this request's producer is known to hold it: flow B's
        params name num_tokens > 0; flow A's probe answered a hit (a probe
        still in flight, or a miss, releases nothing: the producer may hold
        that prompt for another request's pull).  Each producer entry serves
        one pull, and this request's prefill leg published one, so another
        request of the same prompt still finds its own."""
        rid = request.request_id
        n_full = self._full_tokens(request)
        if unstarted is not None:
            n_full = len(unstarted.tokens)
        elif rid in self._tried:
            return  # its load ran (or was decided against): nothing owed
        if n_full < self.block_size:
            return
        if src[0] == "A":
            if self._probe is None:
                return
            cached = self._probed.get(rid)
            if cached is not None:
                done, held = True, cached[0]
            else:
                why = getattr(self._probe, "last_unreachable", None)
                done, held = self._probe.answer(rid)
                self._probe.last_unreachable = why
            if not done or not held:
                return
            n_full = min(n_full, held)
        self._tried.add(rid)
        if self._release(request, src, n_full):
            self.stats.add("load_releases_aborted")

    def _release_asked(self, request):
        """Flow A/B, legs.py: the proxy's forget found this request here and
        was answered "seen", so the proxy releases nothing; the request
        ended without pulling or releasing (aborted while its flow-a probe
        was in flight, which alone releases nothing): it releases now, as
        the proxy would have on "unseen".  The proxy asks only after the
        leg's prefill answered, i.e. published the prompt for this leg."""
        src = self._source(request)
        if src is not None and self._release(request, src, self._full_tokens(request)):
            self.stats.add("load_releases_aborted")

    def _check_unloadable(self, request, src):
        """Counts requests a consumer was meant to load but cannot (decided
        before any load: no params, or the producer published nothing)."""
        if len(request.prompt_token_ids or ()) < self.block_size:
            return  # no full block: nothing to load anyway
        if src is None:
            if _is_retake(getattr(request, "kv_transfer_params", None) or {}):
                self._recompute(request, "retake",
                                "the proxy sent it once more after its KV load failed here "
                                "(load_failure_policy 'fail'): computed, not loaded again")
            elif self.s.role == "kv_consumer" and not self.s.flow_a:
                self._recompute(request, "no_kv_transfer_params",
                                "the request came without kv_transfer_params (flow A is off: "
                                "send it through the proxy with --flow b)")
            return
        params = getattr(request, "kv_transfer_params", None) or {}
        if src[0] == "B" and params.get("num_tokens") == 0:
            self._recompute(request, "not_held", f"producer {src[1]} published no KV for it "
                            "(aborted or failed there)")

    def _locatable(self, request, src):
        """An in-tree push leg (vLLM's router: a transfer_id, no "push" key)
        naming the first engine of the configured producer while that
        producer has several data-parallel engines.  A router that does not
        pin the prefill leg to a rank (no X-data-parallel-rank) but names
        rank 0's engine, while vLLM's own balancing may have run the leg on
        another engine: its target would wait there for a prompt that never
        comes (the lease, then the prompt computed here)."""
        probe = self._probe
        if src is None or src[0] != "P" or probe is None or src[1] is None or \
                request.request_id in self._located:
            return False
        params = getattr(request, "kv_transfer_params", None) or {}
        known = getattr(probe, "known_engines", None)
        return ("push" not in params and known is not None
                and src[1] == getattr(probe, "default_producer", None) and len(known()) > 1)

    def _locate(self, request, src, n_full):
        """For a _locatable leg: looks its prompt up in each of the
        producer's engines (the probe, as flow A) and sends the target to
        the one holding it (_source); held nowhere yet (a router sending
        both legs at once) or no answer in time: the named engine.  PENDING
        while the answer is not in, else None."""
        if not self._locatable(request, src):
            return None
        rid, probe = request.request_id, self._probe
        now = time.monotonic()
        if rid not in self._asked:
            self._ask(request, (src[0], None), n_full, now)
        done, held = probe.answer(rid)
        if not done and self._may_wait(rid):
            if probe.wait(rid, self.s.probe_wait_ms / 1000.0):
                done, held = probe.answer(rid)
        if not done:
            if now - self._asked.get(rid, now) < probe.timeout_for(None) + PROBE_GRACE_S:
                return PENDING
            probe.forget(rid)
        where = getattr(probe, "last_where", None) if done and held else None
        self._asked.pop(rid, None)
        self._located[rid] = where
        if where is not None:
            logger.info("MooncakeConnector: request %s: its push leg names producer engine %s, "
                        "its prompt is held by %s (another data-parallel engine of that "
                        "server): the target goes there", rid, src[1], where)
        return None

    def _ask(self, request, src, n_full, now):
        self._asked[request.request_id] = now
        self._probe.ask(request.request_id, src[1], request.prompt_token_ids[:n_full])

    def _arrived(self, request, src):
        """A flow A/B request is here (legs.py).  False for one whose leg
        the proxy was told "unseen" for before it came (its client left,
        the prefill released the prompt): it neither loads nor releases."""
        rid = request.request_id
        if src is None or src[0] not in ("A", "B") or \
                len(request.prompt_token_ids or ()) < self.block_size:
            return True
        if self._legs.arrived(rid):
            return True
        if rid in self._tried:
            return False  # said once
        self._tried.add(rid)
        self.stats.add("legs_late")
        logger.info("MooncakeConnector: request %s came after the proxy was told its decode leg "
                    "was not here (its client left; the prefill released the prompt): computed "
                    "here if it runs at all", rid)
        return False

    def on_new_request(self, request):
        """vLLM calls this when a request arrives: a flow-A probe starts now,
        so its answer is usually in when the scheduler first asks."""
        if self._probe is None:
            return
        src = self._source(request)
        if self._locatable(request, src) and request.request_id not in self._asked:
            n_full = self._full_tokens(request)
            if n_full > 0:  # an in-tree push leg's lookup (_locate) starts now
                self._ask(request, (src[0], None), n_full, time.monotonic())
            return
        if not self._arrived(request, src) or src is None or src[0] != "A" or \
                request.request_id in self._tried:
            return
        n_full = self._full_tokens(request)
        if n_full > 0 and request.request_id not in self._asked:
            self._ask(request, src, n_full, time.monotonic())

    def may_load_async(self, request):
        """vLLM >= 0.34: whether get_num_new_matched_tokens may answer
        load_kv_async=True for this request.  Cheap (no probe, no network):
        True for every request this consumer would load (flow B's
        do_remote_prefill, and flow A's parameterless requests, which vLLM's
        default misses) and has not tried yet.  A flow-A load that turns out
        synchronous or a miss is a false positive: it only holds another
        async load back until a slot frees."""
        return self._source(request) is not None and request.request_id not in self._tried

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        src = self._source(request)
        if src is not None:
            self._arrived(request, src)
        if src is None or request.request_id in self._tried:
            if src is None and self.s.is_consumer:
                self._check_unloadable(request, src)
            return 0, False  # one load per request: after a miss or failure, compute
        n_full = self._full_tokens(request)
        # A local prefix-cache hit of every full block before the last
        # token's block: the rest (nothing, or the block holding the last
        # token of a block-aligned prompt) is computed here in this step
        # rather than waited for (a push, or an async load: two more steps).
        last = (len(request.prompt_token_ids or ()) - 1) // self.block_size * self.block_size
        if n_full - num_computed_tokens <= 0 or 0 < last <= num_computed_tokens:
            if num_computed_tokens == 0:
                self._check_unloadable(request, src)
            elif src[0] == "P":
                # Nothing is pushed, so the producer is told now (it frees the
                # prompt's KV instead of holding it for a target until
                # hold_timeout_s).
                self._tried.add(request.request_id)
                self._gone(request, src)
            else:
                self._to_release[request.request_id] = n_full  # once it is scheduled
            return 0, False
        if src[0] in ("B", "P") and src[1] is not None and not is_engine_name(src[1]):
            # vLLM's in-tree contract names the producer by its engine id; ours
            # (our bootstrap server's /query) is the engine's host:port.
            self._tried.add(request.request_id)
            params = getattr(request, "kv_transfer_params", None) or {}
            problem = engine_name_problem(src[1])
            if "IPv6" in problem:  # ours, brackets left out by whatever sent it
                self._recompute(request, "producer_unreachable", (
                    f"kv_transfer_params remote_engine_id {str(src[1])[:80]!r}: {problem}; "
                    "the router or proxy that sent it must bracket an IPv6 engine address"))
                return 0, False
            self._recompute(request, "producer_unreachable", (
                f"kv_transfer_params remote_engine_id {str(src[1])[:80]!r} is not a "
                "mooncake-connector engine address (host:port); the prefill server at "
                f"{str(params.get('remote_bootstrap_addr') or '?')[:80]} runs another "
                "connector (e.g. vLLM's in-tree MooncakeConnector): serve both sides with "
                "this package's MooncakeConnector"))
            return 0, False
        if src[0] == "P" and self._locate(request, src, n_full) is PENDING:
            return None, False  # vLLM skips the request this step and asks again
        if src[0] == "P":
            src = self._source(request)
            held = self._layer_load_claim(request, n_full)
            if trace.ON:
                trace.event("sched_match", transfer_id(request.kv_transfer_params or {}),
                            held=held, computed=num_computed_tokens,
                            arrival_w=getattr(request, "arrival_time", None))
            if held > num_computed_tokens:  # push, layer load: scheduled now, in-step load
                self._claims[request.request_id] = (held, True)
                return held - num_computed_tokens, False
        held = self._known_size(request, src, n_full)
        if held is PENDING:
            return None, False  # vLLM skips the request this step and asks again
        if trace.ON and src[0] != "P":  # a pull (flows a, b): keyed by vLLM's request id
            trace.event("sched_match", request.request_id, held=held, flow=src[0],
                        computed=num_computed_tokens,
                        arrival_w=getattr(request, "arrival_time", None))
        if held == 0 and num_computed_tokens == 0:
            probe = self._probe
            if probe is not None and getattr(probe, "last_unreachable", None):
                self._recompute(request, recompute_reason(probe.last_unreachable),
                                probe.last_unreachable)
            else:
                self._recompute(request, "not_held", "the producer does not hold its first "
                                "block (never published, consumed or evicted)")
        if held is None:  # not known before the load: claim it all, load in the background
            self._claims[request.request_id] = (n_full, False)
            return n_full - num_computed_tokens, True
        nbytes = None if self.block_bytes is None else \
            (held - num_computed_tokens) // self.block_size * self.block_bytes
        sync = nbytes is not None and nbytes <= self.s.sync_load_max_bytes
        if sync and self.stale_recompute and not self.async_scheduling:
            sync = False
            _log_async_once("MooncakeConnector: loads go in the background "
                            "(WAITING_FOR_REMOTE_KVS), not in the step that computes the "
                            f"prompt's rest: {self.stale_recompute} would recompute a failed "
                            "in-step load at stale positions (a wrong answer; vLLM issue "
                            "#49250) under load_failure_policy 'recompute'; "
                            "load_failure_policy 'fail' brings in-step loads back (a failed "
                            "one then ends its request with an error, which our proxy sends "
                            "once more) (docs/connector.md, The V2 model runner)",
                            level=logging.WARNING)
        if sync and self.async_scheduling:
            sync = False
            _log_async_once("MooncakeConnector: loads go in the background "
                            "(WAITING_FOR_REMOTE_KVS), not in the step that computes the "
                            "prompt's rest: vLLM's asynchronous scheduling is on, and vLLM "
                            "cannot recover a failed in-step load under it (its engine dies); "
                            "--no-async-scheduling on this server brings in-step loads back "
                            "(docs/connector.md, Asynchronous scheduling)")
        producer_holds = held > 0
        if sync:
            # The step must compute >= 1 token: a block-aligned prompt leaves
            # its last block to local compute (an async load would recompute
            # its last token instead, for two more scheduler steps).
            last = len(request.prompt_token_ids) - 1
            held = min(held, last // self.block_size * self.block_size)
        ext = held - num_computed_tokens
        if ext <= 0:
            if producer_holds:  # and this side reads none of it
                self._to_release[request.request_id] = n_full  # once it is scheduled
            return 0, False
        self._claims[request.request_id] = (held, sync)
        return ext, not sync

    def _layer_read(self, params):
        """A layer load the decode READs itself (push_layer_read; per request
        kv_transfer_params "push_layer_read" wins)."""
        on = _flag(params, "push_layer_read")
        return on if on is not None else bool(self.s.push_layer_read)

    def _layer_load_claim(self, request, n_full):
        """Push with push_layer_load (docs/connector.md, "Layer load"): the
        full blocks before the prompt's last token, or 0 (the regular async
        push).  The block holding the last token is left to the decode's own
        forward, so no slot is written by both the producer and the decode.
        One KV-cache group only: vLLM maps in-step load errors (invalid block
        ids) back to requests for a single group only."""
        params = getattr(request, "kv_transfer_params", None) or {}
        on = _flag(params, "push_layer_load")
        if not (on if on is not None else self.s.push_layer_load) or self.groups != 1:
            return 0
        rid = request.request_id
        if self.async_scheduling and not self.s.push_layer_load_async:
            # A layer load is an in-step load: under vLLM's async scheduling
            # its failure (a stopped or slow prefill, an abort) kills the
            # engine unless vLLM fails the request instead (settings:
            # push_layer_load_async needs load_failure_policy "fail").  The
            # whole-prompt push instead; counted, logged once.
            if rid not in self._busy:
                self._busy.add(rid)
                self.stats.add("push_layer_load_async_sched")
                _log_async_once("MooncakeConnector: push_layer_load requests take the "
                                "whole-prompt push on this server: vLLM's asynchronous "
                                "scheduling is on, and vLLM cannot recover a failed in-step "
                                "load under it (its engine dies); start the decode server "
                                "with --no-async-scheduling for layer loads (or set "
                                "push_layer_load_async with load_failure_policy 'fail').  "
                                "Counted "
                                "vllm:mooncake_push_layer_load_async_sched_total",
                                level=logging.WARNING)
            return 0
        if self.stale_recompute:
            # An in-step load whose failure (a stopped or dead prefill, a
            # lease run out) vLLM's runner here would recompute into a wrong
            # answer: the whole-prompt push instead (its failure is an async
            # load's, recomputed correctly); counted, logged once.
            if rid not in self._busy:
                self._busy.add(rid)
                self.stats.add("push_layer_load_runner")
                _log_async_once("MooncakeConnector: push_layer_load requests take the "
                                f"whole-prompt push on this server: {self.stale_recompute} "
                                "would recompute a failed in-step load at stale positions (a "
                                "wrong answer; vLLM issue #49250) under load_failure_policy "
                                "'recompute'; set load_failure_policy 'fail' for layer loads "
                                "(a failed one ends its request with an error, which our proxy "
                                "sends once more).  Counted "
                                "vllm:mooncake_push_layer_load_runner_total",
                                level=logging.WARNING)
            return 0
        others = len(self._batch - {rid})
        if others > self.s.push_layer_load_max_batch:
            # Every request of the step would wait with this one, layer by
            # layer, for the prefill: a busy decode takes it as a whole-prompt
            # push (its attention does not wait); counted, not silent.
            if rid not in self._busy:
                self._busy.add(rid)
                self.stats.add("push_layer_load_busy")
                logger.info("MooncakeConnector: request %s takes the whole-prompt push, not "
                            "a layer load: %d other requests are running (> "
                            "push_layer_load_max_batch=%d)", rid, others,
                            self.s.push_layer_load_max_batch)
            return 0
        last = len(request.prompt_token_ids or ()) - 1
        held = min(n_full, max(last, 0) // self.block_size * self.block_size)
        return self._graph_safe(request, held)

    def _graph_safe(self, request, held):
        """A layer load's claim, shaped so the step that loads it is not a
        FULL CUDA-graph replay, which would run its attention without
        wait_for_layer_load (docs/connector.md, "CUDA graphs"): with FULL
        graphs for uniform decode batches, the decode computes more than the
        uniform decode query length itself (one block fewer claimed, the
        rest of the prompt pushed); with FULL graphs for mixed batches too, or
        a prompt too short for that, the whole-prompt push (counted
        push_layer_load_cudagraph, logged once)."""
        mixed, decode, uniform = self.graphs
        if held <= 0 or not (mixed or decode):
            return held
        n = len(request.prompt_token_ids or ())
        if not mixed:
            while held > 0 and n - held <= uniform:
                held -= self.block_size
            if held > 0:
                return held
        rid = request.request_id
        if rid not in self._graphed:
            self._graphed.add(rid)
            self.stats.add("push_layer_load_cudagraph")
            global _GRAPH_WARNED
            log = logger.debug if _GRAPH_WARNED else logger.warning
            _GRAPH_WARNED = True
            log("MooncakeConnector: request %s takes the whole-prompt push, not a layer "
                "load: this decode replays FULL CUDA graphs for %s, where vLLM does not call "
                "wait_for_layer_load; kv_connector_extra_config \"push_layer_load\": true "
                "makes vLLM use PIECEWISE graphs (then every layer load overlaps), or "
                "--enforce-eager.  Counted vllm:mooncake_push_layer_load_cudagraph_total "
                "(this warning once)", rid,
                "every batch (cudagraph_mode FULL)" if mixed else
                f"its {n}-token prompt's last step")
        return 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._probed.pop(request.request_id, None)
        n_rel = self._to_release.pop(request.request_id, None)
        if n_rel is not None and num_external_tokens <= 0:
            # Scheduled on its local prefix-cache hit: the decision stands
            # (were it not scheduled, e.g. no free blocks, the next step
            # decides again, its hit maybe evicted meanwhile).
            src = self._source(request)
            if src is not None:
                self._tried.add(request.request_id)
                self._release(request, src, n_rel)
        if self.s.is_producer and request.request_id not in self._reqs:
            self._reqs[request.request_id] = request
        if num_external_tokens <= 0:
            return
        src = self._source(request)
        if src is None:
            return
        self._tried.add(request.request_id)
        params = getattr(request, "kv_transfer_params", None) or {}
        end, sync = self._claims.pop(request.request_id, (self._full_tokens(request), False))
        if trace.ON:
            # a push by its transfer id, a pull (flows a, b) by vLLM's request id
            key = transfer_id(params) if src[0] == "P" else request.request_id
            trace.event("sched_alloc", key, sync=sync, ext=num_external_tokens, flow=src[0])
            if not sync and key:
                self._traced_bg[request.request_id] = key
        if TRACE and src[0] == "P" and sync:
            arrived = getattr(request, "arrival_time", None)
            if isinstance(arrived, float):
                logger.info("MooncakeConnector push layer load %s: scheduled %.1f ms after "
                            "it arrived", request.request_id, (time.time() - arrived) * 1e3)
        local = end - num_external_tokens
        skip = max(local, 0) // self.block_size
        groups = [list(g)[skip:end // self.block_size] for g in blocks.get_block_ids()]
        if sync:  # vLLM cached these blocks already: on_load_errors
            self._in_step.add(request.request_id)
        elif self.early is not None:
            self.early.waiting.add(request.request_id)
        self._loads[request.request_id] = LoadSpec(
            req_id=request.request_id, tokens=list(request.prompt_token_ids[:end]),
            block_ids=groups[0], skip_blocks=skip, producer=src[1], flow=src[0], sync=sync,
            more_groups=groups[1:],
            producer_tp=_int_or_none(params.get("tp_size")),
            push_tid=transfer_id(params) if src[0] == "P" else None,
            layer_load=src[0] == "P" and sync,
            layer_read=src[0] == "P" and sync and self._layer_read(params))

    def trace_recv_seen(self, finished_recving):
        """MC_TRACE: vLLM's scheduler has learnt that these background loads
        (whole-prompt pushes, pulls) are in (update_connector_output)."""
        for rid in finished_recving or ():
            tid = self._traced_bg.get(rid)
            if tid:
                trace.event("sched_recv_seen", tid)

    def on_load_errors(self, invalid_block_ids):
        """vLLM's update_connector_output: take the blocks of a failed load
        out of the prefix cache.  vLLM caches an in-step load's blocks when
        it schedules the request, before the load runs, and its "recompute"
        policy leaves them cached on the grounds that the request computes
        them again next step; a request freed before that (aborted,
        preempted) would leave a failed load's bytes under its prompt's
        hashes, and the next request with that prefix would attend to them
        (tests/test_failed_load_prefix_cache.py).  Evicted: from the first
        failed block of each request holding one to its last block (those
        after it were computed on top of it), for the in-step loads and the
        requests first scheduled beside them (a prefix hit on their blocks
        in the same step).  An async load's blocks are cached by vLLM only
        after the load, up to its first failed block: nothing to do.  The
        recomputed blocks stay out of the prefix cache (vLLM caches a
        request's blocks once).  A request scheduled beside a failed
        in-step load with a prefix hit on its blocks keeps counting them
        computed (vLLM: the failed request computes them next step); if that
        one is freed or preempted first, its blocks are reported failed once
        more in the next step (_forget_unrecomputed) so the other computes
        them."""
        kvm = self._kvm()
        if not invalid_block_ids or kvm is None or self.groups != 1:
            return  # several groups: vLLM refuses block-level load errors itself
        bad = set(invalid_block_ids)
        evict = set()
        for rid in self._in_step.union(self._readers, *self._new):
            try:
                blocks = list(kvm.get_block_ids(rid)[0])
            except (KeyError, IndexError, TypeError, AttributeError):
                continue  # finished meanwhile: its blocks are not ours to judge
            first = next((i for i, b in enumerate(blocks) if b in bad), None)
            if first is not None:
                evict.update(blocks[first:])
                if rid in self._in_step:
                    self._unrecomputed[rid] = list(enumerate(blocks))[first:]
        self._readers.clear()
        if not evict:
            return
        try:
            kvm.evict_blocks(evict)
        except Exception as e:  # noqa: BLE001 -- an older vLLM without evict_blocks
            logger.error("MooncakeConnector: could not take %d block(s) of a failed load "
                         "out of vLLM's prefix cache (%s); a request freed before its "
                         "recompute may leave them there", len(evict), e)
            return
        self.stats.add("load_error_blocks_uncached", len(evict))

    def _trim_unrecomputed(self, so):
        """A request whose in-step load failed computes those blocks in its
        next steps: in one, or in chunks over several when its prompt
        exceeds the step's token budget.  A block counts as recomputed once
        a step fills it (by whichever request holds it); the rest stay
        listed, so a request freed or preempted in the middle of its
        recompute still reports them failed.  A request scheduled in this
        step that counts a still-listed block among its computed tokens (a
        sharer scheduled beside a chunk of the recompute: vLLM's
        long_prefill_token_threshold leaves it budget) would attend to a
        failed load's bytes: those blocks are reported failed in this step,
        so vLLM throws the step's result away and the sharer computes
        them."""
        kvm = self._kvm()
        bs = self.block_size
        cached = so.scheduled_cached_reqs
        span = {r: (n, n + so.num_scheduled_tokens.get(r, 0))
                for r, n in zip(cached.req_ids, cached.num_computed_tokens)}
        for nr in so.scheduled_new_reqs:
            n = nr.num_computed_tokens
            span[nr.req_id] = (n, n + so.num_scheduled_tokens.get(nr.req_id, 0))
        ids = {}
        for rid in so.num_scheduled_tokens:
            try:
                ids[rid] = list(kvm.get_block_ids(rid)[0]) if kvm is not None else []
            except (KeyError, IndexError, TypeError, AttributeError):
                ids[rid] = []
        filled = set()  # blocks this step completes (a request's last one: up to b)
        for rid, (a, b) in span.items():
            last = len(ids.get(rid, ())) - 1
            filled.update(blk for i, blk in enumerate(ids.get(rid, ()))
                          if a < (i + 1) * bs <= b or (i == last and a < b and i * bs < b))
        for rid in list(self._unrecomputed):
            if rid in so.num_scheduled_tokens and rid not in span:
                del self._unrecomputed[rid]  # no count to judge by: computed this step
                continue
            left = [(i, blk) for i, blk in self._unrecomputed[rid] if blk not in filled]
            if left:
                self._unrecomputed[rid] = left
            else:
                del self._unrecomputed[rid]
        pending = {blk for v in self._unrecomputed.values() for _, blk in v}
        if not pending:
            return
        for rid, (a, _) in span.items():
            if rid in self._unrecomputed:
                continue
            read = [blk for blk in ids.get(rid, ())[:(a + bs - 1) // bs] if blk in pending]
            if read:
                self._load_errors.extend(read)
                self._readers.add(rid)
                logger.warning("MooncakeConnector: request %s is scheduled on %d block(s) a "
                               "failed in-step load left and no step has computed yet; "
                               "reported failed so it computes them", rid, len(read))

    def _forget_unrecomputed(self, rid, why):
        """Request rid leaves (freed or preempted) before computing the
        blocks its failed in-step load left: a request holding them as a
        prefix hit must not read them, so they are load errors once more."""
        blocks = [b for _, b in self._unrecomputed.pop(rid, None) or ()]
        if blocks:
            self._load_errors.extend(blocks)
            logger.warning("MooncakeConnector: request %s %s before computing the %d block(s) "
                           "its in-step load failed to fill; reported failed again so a "
                           "request sharing them computes them", rid, why, len(blocks))

    # ---- producer ----

    def _should_publish(self, request):
        params = getattr(request, "kv_transfer_params", None) or {}
        if self.s.role == "kv_producer":
            return params.get("do_remote_decode", True) is not False
        return self.s.role == "kv_both" and bool(params.get("do_remote_decode"))

    def _block_ids(self, req_id):
        """The request's block ids, one list per KV-cache group."""
        kvm = self._kvm()
        if kvm is not None:
            try:
                return [list(g) for g in kvm.get_block_ids(req_id)]
            except Exception:  # an older vLLM: fall back to what we tracked
                pass
        return self._blocks.get(req_id, [[]])

    def _track_blocks(self, so):
        if self._kvm() is not None:
            return
        for nr in so.scheduled_new_reqs:
            if nr.req_id in self._reqs:
                self._blocks[nr.req_id] = [list(g) for g in nr.block_ids]
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            if rid not in self._reqs or new is None:
                continue
            if rid in resumed or rid not in self._blocks:
                self._blocks[rid] = [list(g) for g in new]
            else:
                for have, more in zip(self._blocks[rid], new):
                    have.extend(more)

    def build_connector_meta(self, so):
        meta = MooncakeConnectorMetadata(loads=list(self._loads.values()))
        self._loads.clear()
        self._batch = set(so.num_scheduled_tokens)
        if self.s.is_consumer:
            self._new = (self._new[1], {nr.req_id for nr in so.scheduled_new_reqs})
            if self._traced_bg:
                # a background load's request (whole-prompt push, pull), its KV
                # received: its first step
                for rid in self._new[1] & self._traced_bg.keys():
                    trace.event("sched_compute", self._traced_bg.pop(rid))
            if self._unrecomputed:
                for rid in getattr(so, "preempted_req_ids", None) or ():
                    self._forget_unrecomputed(rid, "was preempted")
                self._trim_unrecomputed(so)
            meta.load_errors, self._load_errors = self._load_errors, []
        if self.s.is_producer:
            self._track_blocks(so)
            for rid in getattr(so, "preempted_req_ids", None) or ():
                if self._published.pop(rid, None) is not None:
                    self._unpublish.append(rid)
            for rid, n_sched in so.num_scheduled_tokens.items():
                req = self._reqs.get(rid)
                if req is None or rid in self._published or not self._should_publish(req):
                    continue
                n_prompt = len(req.prompt_token_ids or [])
                if req.num_computed_tokens + n_sched < n_prompt:
                    continue  # the prompt is not complete after this step
                n_full = (n_prompt // self.block_size) * self.block_size
                nb = n_full // self.block_size
                groups = [g[:nb] for g in self._block_ids(rid)]
                if n_full == 0 or any(len(g) < nb for g in groups):
                    continue
                params = getattr(req, "kv_transfer_params", None) or {}
                # Producer side: "push": true is push only; a bare transfer_id
                # (flow b's and the in-tree connector's prefill leg alike) is
                # published for a pull AND pushed if a decode side's target
                # comes for it (docs/connector.md, Push flow).
                push = _push_mode(self.s, params)
                lw = _flag(params, "push_layerwise")
                if trace.ON:  # a pull's (flows a, b): keyed by vLLM's request id
                    trace.event("sched_publish", transfer_id(params) if push else rid,
                                n_sched=n_sched, arrival_w=getattr(req, "arrival_time", None))
                self._publishes.append(PublishSpec(rid, list(req.prompt_token_ids[:n_full]),
                                                   groups[0], more_groups=groups[1:],
                                                   push_tid=transfer_id(params) if push else None,
                                                   layerwise=lw,
                                                   watch=_flag(params, "push_layer_watch"),
                                                   push_optional=push == "optional"))
                self._published[rid] = n_full
        meta.publishes, self._publishes = self._publishes, []
        meta.held, self._held = self._held, []
        meta.unpublish, self._unpublish = self._unpublish, []
        meta.push_dropped, self._push_dropped = self._push_dropped, []
        meta.push_gone, self._push_gone = self._push_gone, []
        meta.releases, self._releases = self._releases, []
        meta.drops, self._drops = self._drops, []
        meta.idle = not getattr(so, "total_num_scheduled_tokens", 1) and not meta.loads
        return meta

    def request_finished(self, request, block_ids):
        """block_ids: the request's blocks, one list per KV-cache group (HMA)
        or one list (a single group)."""
        if block_ids and isinstance(block_ids[0], (list, tuple)):
            block_ids = block_ids[0]
        rid = request.request_id
        self._reqs.pop(rid, None)
        self._blocks.pop(rid, None)
        unstarted = self._loads.pop(rid, None)
        if self._legs is not None:
            self._arrived(request, self._source(request))  # aborted before it was scheduled
        if self.s.is_consumer and (rid not in self._tried or unstarted is not None):
            src = self._source(request)  # ended before its load started: no target sent
            if src is not None and src[0] == "P":
                self._gone(request, src)
            elif src is not None:
                self._release_unpulled(request, src, unstarted)
        if self._legs is not None and self._legs.finished(rid, rid in self._tried):
            self._release_asked(request)
        self._claims.pop(rid, None)
        self._to_release.pop(rid, None)
        self._probed.pop(rid, None)
        self._found_at.pop(rid, None)
        self._located.pop(rid, None)
        if self._asked.pop(rid, None) is not None:
            self._probe.forget(rid)
        self._tried.discard(rid)
        self._traced_bg.pop(rid, None)
        if self.early is not None:
            self.early.waiting.discard(rid)  # aborted while loading: told as before
        self._batch.discard(rid)
        self._busy.discard(rid)
        self._graphed.discard(rid)
        self._in_step.discard(rid)
        self._readers.discard(rid)
        self._forget_unrecomputed(rid, "finished")
        for new in self._new:
            new.discard(rid)
        self._recomputed.discard(rid)
        n = self._published.pop(rid, None)
        params = getattr(request, "kv_transfer_params", None) or {}
        if self.s.is_producer and isinstance(params.get("mc_release"), dict):
            self._proxy_release(params["mc_release"])
        forget = params.get("mc_forget")
        if self._legs is not None and isinstance(forget, dict) and \
                isinstance(forget.get("x_request_id"), str) and forget["x_request_id"]:
            out = {}
            if self.dp_size > 1:
                # Another engine may hold the leg: this one answers for
                # itself only when the forget was sent to it (the proxy asks
                # each engine with X-data-parallel-rank and names the rank as
                # dp_rank), else "seen" (never released twice); mc_dp tells
                # the proxy to ask every engine.
                rank = forget.get("dp_rank")
                if isinstance(rank, int) and not isinstance(rank, bool) and \
                        rank == self.dp_local:
                    verdict = self._legs.forget(forget["x_request_id"], forget.get("ask"))
                else:
                    verdict = "seen"
                out["mc_dp"] = True
            else:
                verdict = self._legs.forget(forget["x_request_id"], forget.get("ask"))
            self.stats.add(f"legs_forget_{verdict}")
            return False, dict(out, mc_forget=verdict)
        if n is not None:
            self._held.append(rid)
            if trace.ON and not _push_mode(self.s, params):
                trace.event("sched_finished", rid)
        if not params.get("do_remote_decode"):
            return n is not None, None
        push = _push_mode(self.s, params)
        if push and n is None:  # aborted or failed before its prompt was computed
            self._push_dropped.append(transfer_id(params))
        if push == "push":
            out = {"push": True, "transfer_id": transfer_id(params), "num_tokens": n or 0}
            if self.producer_base:
                out["remote_engine_id"] = self.producer_base
            if self.bootstrap_port:
                out["bootstrap_port"] = self.bootstrap_port
            return n is not None, out
        # Flow B: always answer with params, so the proxy can go on to decode;
        # num_tokens 0 (prompt shorter than a block, or aborted before its
        # prompt completed) tells the decode side to compute the prompt.
        host, _, port = (self.producer_base or ":").rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]  # remote_host is a bare host, as vLLM's connectors send it
        out = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.producer_base,
            "remote_host": host,
            "remote_port": int(port) if port.isdigit() else None,
            "remote_block_ids": list(block_ids),
            "remote_request_id": rid,
            "num_tokens": n or 0,
            "tp_size": self.tp_size,
        }
        if params.get("transfer_id") is not None:
            out["transfer_id"] = params["transfer_id"]
        return n is not None, out

    def _proxy_release(self, rel):
        """A request carrying kv_transfer_params {"mc_release": {"request_id",
        "prompt_token_ids"}} (our proxy's, a one-token prompt): the prefill
        leg it names was answered but no decode leg follows (the client
        left, or the first token ended the request), so the workers drop
        that prompt's entries now (Publishes.drop) instead of holding them
        for a pull until hold_timeout_s."""
        rid = rel.get("request_id")
        ids = rel.get("prompt_token_ids")
        tokens = None
        if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
            n_full = len(ids) // self.block_size * self.block_size
            tokens = list(ids[:n_full]) or None
        if not isinstance(rid, str):
            rid = None
        xid = rel.get("x_request_id")
        xid = xid if isinstance(xid, str) and xid else None
        if rid is not None or tokens is not None or xid is not None:
            self._drops.append((rid, tokens, xid))

    def take_stats(self):
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, MooncakeKVConnectorStats()
        return out

    def shutdown(self):
        if self._probe is not None:
            self._probe.close()
        if self.early is not None:
            self.early.close()


def _bootstrap_port(settings):
    """The bootstrap server's port as configured (bootstrap.start's choice:
    bootstrap_port, else VLLM_MOONCAKE_BOOTSTRAP_PORT, else 8998); None for
    0 (none) or an unreadable environment value."""
    from mooncake_connector.connector.bootstrap import default_port
    if settings.bootstrap_port is not None:
        return settings.bootstrap_port or None
    try:
        return default_port(os.environ) or None
    except ValueError:
        return None


def _is_retake(params):
    """kv_transfer_params {"mc_retake": true}: the proxy's second sending of
    a decode leg whose KV load failed (mooncake_connector.proxy_retake); the
    consumer computes its prompt instead of loading it again.  A decode
    without this key's meaning (an older one) loads as for a request
    without kv_transfer_params (flow A's probe)."""
    return isinstance(params, dict) and params.get("mc_retake") is True


def _push_mode(settings, params):
    """Producer: "push" ("push": true), "optional" (a bare transfer_id: pull
    or push, whichever the decode side asks for) or None."""
    if settings.role != "kv_producer" or not params.get("do_remote_decode", True) or \
            not transfer_id(params) or params.get("push") is False:
        return None
    return "push" if params.get("push") is True else "optional"


def _int_or_none(v):
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def producer_for_rank(base, tp_rank):
    return shift_port(base, tp_rank)
