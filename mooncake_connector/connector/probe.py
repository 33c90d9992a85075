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
"""
import json
import logging
import time

from mooncake_connector.connector.settings import shift_port

logger = logging.getLogger("vllm.mooncake_connector")

BACKOFF_S = 1.0
RESTART_S = 10.0  # after the probe engine failed to start, try again this much later


class ProducerProbe:
    def __init__(self, settings):
        self.s = settings
        self.kv = self.engine = None
        self.default_producer = None
        self._broken_until = 0.0   # the probe engine failed to start: not before then
        self.start_failures = 0
        self._down_until = {}      # producer -> monotonic time probing resumes
        self.probes = self.failures = 0
        self.last_unreachable = None  # why the last held_tokens answered 0 without asking

    def _start(self):
        from mooncake_connector import _core  # first probe only

        text = json.dumps({k: v for k, v in self.s.mooncake.items() if v is not None})
        cfg = _core.parse_config(text, self.s.config_path or "kv_connector_extra_config")
        host = (self.s.local_hostname.rpartition(":")[0] if self.s.local_hostname
                else cfg["decode_host"])
        self.default_producer = f"{cfg['prefill_host']}:{cfg['prefill_port']}"
        eng = _core.TransferEngine()
        # No port: any free one; the control channel is TCP whatever the
        # workers' protocol, and no memory is registered here.
        eng.initialize(host, cfg["metadata_server"], "tcp", "",
                       auth_secret=cfg["auth_secret"] or None)
        self.engine = eng
        self.kv = _core.KVTransfer(eng, None, workers=1)
        logger.info("MooncakeConnector scheduler: probing producers from %s",
                    eng.get_segment_name())

    def held_tokens(self, producer, tokens):
        """Tokens of the longest block-aligned prefix `producer` (base name,
        None = configured prefill_url) holds now; 0 when it cannot say in
        time; None if this process cannot probe at all (then the caller
        loads asynchronously and lets the worker find out)."""
        now = time.monotonic()
        if self.kv is None:
            if now < self._broken_until:
                return None
            try:
                self._start()
            except Exception as e:  # noqa: BLE001 - any failure: fall back, say why
                self.close()
                self.start_failures += 1
                self._broken_until = now + RESTART_S
                logger.warning("MooncakeConnector scheduler: cannot probe producers (%s); "
                               "loads are decided by the workers for the next %.0f s", e,
                               RESTART_S)
                return None
        name = shift_port(producer or self.default_producer, 0)
        self.last_unreachable = None
        if self._down_until.get(name, 0) > now:
            self.last_unreachable = f"producer {name} did not answer a lookup lately"
            return 0
        from mooncake_connector import MooncakeError

        self.probes += 1
        try:
            return self.kv.probe(name, tokens, timeout=self.s.lookup_timeout_s)
        except MooncakeError as e:
            self.failures += 1
            self._down_until[name] = now + BACKOFF_S
            self.last_unreachable = f"producer {name} did not answer a lookup ({e})"
            logger.warning("MooncakeConnector: producer %s did not answer a lookup (%s); "
                           "prompts are computed locally for the next %.0f s", name, e,
                           BACKOFF_S)
            return 0

    def close(self):
        for obj in (self.kv, self.engine):
            if obj is not None:
                try:
                    obj.close()
                except Exception:  # noqa: BLE001 - already closed
                    pass
        self.kv = self.engine = None
