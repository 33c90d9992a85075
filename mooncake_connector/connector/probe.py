"""Scheduler-side probe: asks a producer how much of a prompt it holds, so the
scheduler decides hit or miss before it schedules the request (flow A).

One small engine per scheduler process, started on the first probe (the
extension is imported then, not before), speaking only the control channel:
a probe is one round trip (KVTransfer.probe; nothing is pinned or consumed
at the producer, the worker's pull decides).  A failed or slow probe counts
as a miss (the prompt is computed locally) and probing that producer pauses
for BACKOFF_S, so a dead producer costs one timeout, not one per request.
If the probe engine itself cannot start (e.g. the metadata server is down),
loads go the asynchronous way (the workers find out) and the start is tried
again after RESTART_S.

ask() queues a question and returns at once; one thread (started with the
first question) starts the engine and asks the producers, one round trip at
a time (the C call releases the GIL); answer() says whether the answer is
in, wait() waits for it a bounded time (the scheduler does only while no
other request runs: probe_wait_ms).  Until it is in, the scheduler tells
vLLM "not known yet" and vLLM asks again next step.
"""
import collections
import json
import logging
import threading
import time

from mooncake_connector.connector.settings import shift_port
from mooncake_connector.hostport import bracket_host, join_hostport

logger = logging.getLogger("vllm.mooncake_connector")

BACKOFF_S = 1.0
RESTART_S = 10.0  # after the probe engine failed to start, try again this much later
# The first probe to a producer also sets up the connections both ways
# (metadata lookups, TCP handshakes, the producer's HELLO to our probe
# engine): it gets this long, lookup_timeout_s only once that producer has
# answered.  A warm-up probe at start-up usually pays it before any request.
FIRST_CONTACT_S = 3.0
WARM = object()  # the warm-up question's key
# vLLM data parallelism on the producer (one server, several engines, each
# with its own names: settings.dp_base): which engines the configured
# producer has is looked up in the metadata server (each engine's rank-0
# record, peer_record.make's dp_local) at most this often, off the probe's
# path (dp_engines), and up to MAX_DP.
DISCOVER_S = 5.0
MAX_DP = 64


class ProducerProbe:
    def __init__(self, settings):
        self.s = settings
        self.kv = self.engine = None
        self.default_producer = None
        self._broken_until = 0.0   # the probe engine failed to start: not before then
        self.start_failures = 0
        self._down_until = {}      # producer -> monotonic time probing resumes
        self.probes = self.failures = 0
        # Why the last answer handed to the scheduler (answer()) was 0 without
        # asking the producer (unreachable lately / did not answer), else None.
        self.last_unreachable = None
        # The producer engine (base name) of the last answer handed to the
        # scheduler, None for the configured one (vLLM data parallelism there).
        self.last_where = None
        self._why = None           # the probe thread's: why held_tokens just said 0
        self._whys = {}            # key -> _why for that answer
        self._cv = threading.Condition()
        self._queue = collections.deque()  # (key, producer, tokens) to ask, in order
        self._answers = {}         # key -> held tokens or None (see held_tokens)
        self._asked = set()        # keys queued or being asked
        self._thread = None
        self._closing = False
        self._answered = set()     # producers (base names) that answered a probe
        self._meta = None          # metadata client: the producer's DP engines (dp_engines)
        self._engines = None       # the configured producer's DP engines' base names
        self._discovered_at = None
        self._refreshing = False   # a background lookup of those engines is out
        self._where = None         # the probe thread's: the DP engine holding the last answer
        self._wheres = {}          # key -> that engine's base name (None: the configured one)

    def _start(self):
        from mooncake_connector import _core  # first probe only

        text = json.dumps({k: v for k, v in self.s.mooncake.items() if v is not None})
        cfg = _core.parse_config(text, self.s.config_path or "kv_connector_extra_config")
        host = bracket_host(self.s.local_hostname.rpartition(":")[0] if self.s.local_hostname
                            else cfg["decode_host"])
        self.default_producer = join_hostport(cfg['prefill_host'], cfg['prefill_port'])
        eng = _core.TransferEngine()
        # No port: any free one; the control channel is TCP whatever the
        # workers' protocol, and no memory is registered here.
        eng.initialize(host, cfg["metadata_server"], "tcp", "",
                       auth_secret=cfg["auth_secret"] or None)
        self.engine = eng
        self.kv = _core.KVTransfer(eng, None, workers=1)
        if cfg.get("metadata_backend") != "p2p":
            try:
                self._meta = _core.MetadataClient(cfg["metadata_server"])
            except Exception as e:  # noqa: BLE001 - only the configured engine is probed then
                logger.warning("MooncakeConnector scheduler: no metadata client (%s): only the "
                               "producer's first data-parallel engine is probed", e)
        logger.info("MooncakeConnector scheduler: probing producers from %s",
                    eng.get_segment_name())

    def _ensure_engine(self, now):
        """Starts the probe engine if needed; False if it cannot run now."""
        if self.kv is not None:
            return True
        if now < self._broken_until:
            return False
        try:
            self._start()
            return True
        except Exception as e:  # noqa: BLE001 - any failure: fall back, say why
            self._close_engine()
            self.start_failures += 1
            self._broken_until = now + RESTART_S
            logger.warning("MooncakeConnector scheduler: cannot probe producers (%s); "
                           "loads are decided by the workers for the next %.0f s", e,
                           RESTART_S)
            return False

    def dp_engines(self, now=None):
        """Base names of the configured producer's vLLM data-parallel engines
        (the configured one first): those whose rank-0 record in the metadata
        server says dp_local k at the configured base + k * tp_size * pp_size.
        Only the configured one without a metadata server (P2P handshake).
        The last known list, so a probe does not wait for the metadata
        server: the first call looks them up (the warm-up does, before any
        request), later ones start a lookup in the background once the list
        is DISCOVER_S old (engines start and stop)."""
        now = time.monotonic() if now is None else now
        base = self.default_producer
        if self._meta is None or base is None:
            return [base]
        if self._engines is None:
            self._look_up_engines(self._meta, base, now)
        elif now - self._discovered_at >= DISCOVER_S:
            self._refresh_engines(base, now)
        return self._engines

    def known_engines(self):
        """The configured producer's data-parallel engines as last looked up
        (dp_engines), without looking them up: [] before the first lookup."""
        return list(self._engines or ())

    def _refresh_engines(self, base, now):
        """Looks the producer's engines up again on a thread of its own (one
        at a time); dp_engines keeps answering with the list it has."""
        with self._cv:
            if self._refreshing or self._closing:
                return
            self._refreshing = True
        meta = self._meta  # close() may clear it; the client outlives a call in flight

        def run():
            try:
                self._look_up_engines(meta, base, now)
            finally:
                with self._cv:
                    self._refreshing = False
                    self._cv.notify_all()
        threading.Thread(target=run, daemon=True, name="mooncake-probe-engines").start()

    def _look_up_engines(self, meta, base, now):
        """One lookup (peer_record.dp_engines) into self._engines; a failure
        keeps what was known ([base] at first) until the next DISCOVER_S."""
        from mooncake_connector.connector import peer_record
        self._discovered_at = now
        known = self._engines or [base]
        try:
            found = peer_record.dp_engines(meta, base, MAX_DP)
        except Exception as e:  # noqa: BLE001 - keep what was known
            logger.debug("MooncakeConnector scheduler: producer engines not looked up: %s", e)
            found = known
        if found != known:
            logger.info("MooncakeConnector scheduler: the producer has %d data-parallel "
                        "engine(s) (%s): flow-A prompts are looked up in each", len(found),
                        ", ".join(found))
        self._engines = found

    def held_tokens(self, producer, tokens):
        """As _held_tokens, for the configured producer (producer None) in
        each of its data-parallel engines (dp_engines) until one holds the
        whole prompt; the most held wins, its engine in self._where (None:
        the configured one)."""
        self._where = None
        if producer is not None or not tokens:
            return self._held_tokens(producer, tokens)
        if not self._ensure_engine(time.monotonic()):
            return None
        best, where, best_why = None, None, None
        engines = self.dp_engines()
        for i, b in enumerate(engines):
            held = self._held_tokens(b if i else None, tokens)
            if held is None:
                return None
            why = self._why
            if best is None or held > best:
                best, where, best_why = held, (b if i else None), why
            if held >= len(tokens):
                break
        self._where, self._why = where, best_why
        return best

    def _held_tokens(self, producer, tokens):
        """Tokens of the longest block-aligned prefix `producer` (base name,
        None = configured prefill_url) holds now; 0 when it cannot say in
        time; None if this process cannot probe at all (then the caller
        loads asynchronously and lets the worker find out).  Blocks up to
        lookup_timeout_s: only the probe thread (or a test) calls it."""
        now = time.monotonic()
        if not self._ensure_engine(now):
            return None
        name = shift_port(producer or self.default_producer, 0)
        self._why = None
        if self._down_until.get(name, 0) > now:
            self._why = f"producer {name} did not answer a lookup lately"
            return 0
        from mooncake_connector import MooncakeError

        self.probes += 1
        try:
            held = self.kv.probe(name, tokens, timeout=self.timeout_for(name))
            self._answered.add(name)
            return held
        except MooncakeError as e:
            self.failures += 1
            self._down_until[name] = now + BACKOFF_S
            self._why = f"producer {name} did not answer a lookup ({e})"
            logger.warning("MooncakeConnector: producer %s did not answer a lookup (%s); "
                           "prompts are computed locally for the next %.0f s", name, e,
                           BACKOFF_S)
            return 0

    def timeout_for(self, producer):
        """How long a probe to `producer` may take: lookup_timeout_s once it
        has answered one, else the first contact's FIRST_CONTACT_S."""
        name = shift_port(producer or self.default_producer, 0) if (
            producer or self.default_producer) else None
        if name in self._answered:
            return self.s.lookup_timeout_s
        return max(self.s.lookup_timeout_s, FIRST_CONTACT_S)

    def _warm_up(self):
        """Starts the probe engine and makes first contact with the configured
        producer (an empty probe) before any request needs it.  A producer not
        up yet is no failure: no back-off, no warning."""
        from mooncake_connector import MooncakeError
        if not self._ensure_engine(time.monotonic()):
            return
        self.dp_engines()  # the first lookup of the producer's engines, off a request's path
        name = shift_port(self.default_producer, 0)
        if name in self._answered:
            return
        try:
            self.kv.probe(name, [], timeout=FIRST_CONTACT_S)
            self._answered.add(name)
            logger.info("MooncakeConnector scheduler: producer %s answers probes", name)
        except MooncakeError as e:
            logger.debug("MooncakeConnector scheduler: warm-up probe of %s: %s", name, e)

    def warm(self):
        """Queues the warm-up (see _warm_up); never blocks."""
        with self._cv:
            if self._closing or self._thread is not None:
                return
            self._asked.add(WARM)
            self._queue.append((WARM, None, []))
            self._start_thread_locked()

    def _start_thread_locked(self):
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="mooncake-probe")
            self._thread.start()
        self._cv.notify()

    # ---- non-blocking interface (the scheduler's) ----

    def ask(self, key, producer, tokens):
        """Queue the question "how much of `tokens` does `producer` hold" for
        `key` (a request id) unless it is already asked or answered.  Never
        blocks on the network."""
        with self._cv:
            if self._closing or key in self._asked or key in self._answers:
                return
            self._asked.add(key)
            self._queue.append((key, producer, list(tokens)))
            self._start_thread_locked()

    def answer(self, key):
        """(True, held) once the answer for `key` is in (held as held_tokens
        returns it: tokens, 0, or None), else (False, None).  Taking it
        forgets it."""
        with self._cv:
            if key in self._answers:
                self.last_unreachable = self._whys.pop(key, None)
                self.last_where = self._wheres.pop(key, None)
                return True, self._answers.pop(key)
            return False, None

    def wait(self, key, timeout):
        """Waits (GIL released) up to `timeout` s for the answer for `key`;
        True once it is in (take it with answer())."""
        with self._cv:
            return self._cv.wait_for(lambda: key in self._answers or key not in self._asked,
                                     timeout) and key in self._answers

    def pending(self, key):
        with self._cv:
            return key in self._asked

    def forget(self, key):
        """The request is gone: drop its answer (a late one is dropped too)."""
        with self._cv:
            self._answers.pop(key, None)
            self._whys.pop(key, None)
            self._wheres.pop(key, None)
            if key in self._asked:
                self._asked.discard(key)
                self._queue = collections.deque(q for q in self._queue if q[0] != key)

    def _run(self):
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if self._closing:
                    return
                key, producer, tokens = self._queue.popleft()
            if key is WARM:
                try:
                    self._warm_up()
                except Exception as e:  # noqa: BLE001 - never fatal
                    logger.debug("MooncakeConnector scheduler: warm-up failed: %s", e)
                with self._cv:
                    self._asked.discard(WARM)
                continue
            try:
                self._why = None
                held = self.held_tokens(producer, tokens)
            except Exception as e:  # noqa: BLE001 - a bug must not kill the thread: miss
                logger.warning("MooncakeConnector: probing %s failed (%s); the prompt is "
                               "computed locally", producer or self.default_producer, e)
                held = 0
            with self._cv:
                if key in self._asked:  # not forgotten meanwhile
                    self._asked.discard(key)
                    self._answers[key] = held
                    self._whys[key] = self._why
                    self._wheres[key] = self._where
                    self._cv.notify_all()  # a scheduler may wait for it (wait())

    def close(self):
        with self._cv:
            self._closing = True
            self._queue.clear()
            self._cv.notify_all()
            t = self._thread
        if t is not None and t is not threading.current_thread():
            # At most one probe is in flight; it ends by its own timeout.
            t.join(max(self.s.lookup_timeout_s, FIRST_CONTACT_S) + 5.0)
        self._close_engine()

    def _close_engine(self):
        for obj in (self.kv, self.engine, self._meta):
            if obj is not None:
                try:
                    obj.close()
                except Exception:  # noqa: BLE001 - already closed
                    pass
        self.kv = self.engine = self._meta = None
