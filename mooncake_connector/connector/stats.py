"""KVConnectorStats for vLLM's stat logger and Prometheus (both sides).

Counters (COUNTERS) add up over workers and over time.  recompute_<reason>
counts prompts a consumer computed although it was meant to load them, by
RECOMPUTE_REASONS.  Gauges (held bytes, lookup entries, loads in flight) are
kept per worker under "gauges": {"r<tp_rank>": {name: value}}; aggregating
keeps each worker's latest value, so the sum over workers is the current one.
MooncakePromMetrics exports all of it in vLLM's /metrics (build_prom_metrics).
"""
from dataclasses import dataclass

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError:  # vLLM absent
    from dataclasses import field

    @dataclass
    class KVConnectorStats:  # type: ignore[no-redef]
        data: dict = field(default_factory=dict)

#: Why a consumer computed a prompt it was meant to load (docs/connector.md).
RECOMPUTE_REASONS = ("producer_unreachable", "not_held", "timed_out", "layout_mismatch",
                     "no_kv_transfer_params", "layer_wait_skipped", "retake")
COUNTERS = ("loads", "loads_in_step", "loads_failed", "load_bytes", "load_bytes_same_host_cpu",
            "load_tokens",
            "load_tokens_missed", "publishes", "publish_failed", "publish_bytes",
            "sends_finished", "sends_expired", "push_loads", "push_sends", "push_bytes",
            "push_failed", "push_layer_loads", "push_producer_lost", "push_layer_load_busy",
            "push_layer_load_cudagraph", "push_layer_load_async_sched",
            "push_layer_load_runner",
            "push_target_resends", "push_targets_direct", "push_fence_cuts", "push_fence_holds",
            "push_untargeted_cancels", "push_layer_reads", "push_layer_read_gave_up",
            "push_bytes_same_host_cpu", "push_gate_host_batches", "malloc_trims",
            "malloc_trim_freed_bytes",
            "load_error_blocks_uncached", "load_releases", "load_releases_aborted",
            "prefill_releases", "prefill_releases_late", "legs_forget_seen", "legs_forget_unseen", "legs_late",
            *(f"recompute_{r}" for r in RECOMPUTE_REASONS))
GAUGES = ("held_bytes", "lookup_entries", "loads_in_flight")


def recompute_reason(err):
    """RECOMPUTE_REASONS entry for a load that filled nothing: err is the
    load's error text (None/"" = the producer answered, holding less)."""
    if not err:
        return "not_held"
    low = err.lower()
    if "did not call wait_for_layer_load" in low:
        return "layer_wait_skipped"
    if "layout" in low or "mismatch" in low or "cannot use" in low:
        return "layout_mismatch"
    # Refused or unresolvable first: such a text may name a timeout knob
    # (e.g. "... within 2000 ms (MC_P2P_HANDSHAKE_TIMEOUT_MS) ...: Connection
    # refused") without anything having timed out.
    if any(w in low for w in ("connection refused", "no engine accepts", "cannot resolve",
                              "unreachable")):
        return "producer_unreachable"
    if "timed out" in low or "timeout" in low:
        return "timed_out"
    return "producer_unreachable"


@dataclass
class MooncakeKVConnectorStats(KVConnectorStats):
    """data: counters (COUNTERS), load_time_s (a list of per-load seconds),
    gauges ({"r<rank>": {GAUGES name: value}})."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {k: 0 for k in COUNTERS}
        self.data["load_time_s"] = []

    def add(self, key, value=1):
        self.data[key] = self.data.get(key, 0) + value

    def add_time(self, secs):
        self.data.setdefault("load_time_s", []).append(secs)

    def set_gauges(self, rank, values):
        self.data.setdefault("gauges", {})[f"r{rank}"] = dict(values)

    def aggregate(self, other):
        if other is None or not getattr(other, "data", None):
            return self
        for k, v in other.data.items():
            if k == "gauges":
                self.data.setdefault("gauges", {}).update(v)  # latest per worker
            elif isinstance(v, list):
                self.data.setdefault(k, []).extend(v)
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def gauge_totals(self):
        out = {}
        for vals in (self.data.get("gauges") or {}).values():
            for k, v in vals.items():
                out[k] = out.get(k, 0) + v
        return out

    def reduce(self):
        out = {k: self.data.get(k, 0) for k in COUNTERS
               if not k.startswith("recompute_") or self.data.get(k)}
        out.update(self.gauge_totals())
        times = sorted(self.data.get("load_time_s", []))
        if times:
            total = sum(times)
            out["load_time_avg_ms"] = round(1000 * total / len(times), 3)
            out["load_time_p99_ms"] = round(1000 * times[min(len(times) - 1,
                                                             int(0.99 * len(times)))], 3)
            if total > 0:
                out["load_throughput_GBps"] = round(self.data.get("load_bytes", 0) / total / 1e9,
                                                    3)
        return out

    def is_empty(self):
        return (not any(self.data.get(k) for k in COUNTERS) and not self.data.get("load_time_s")
                and not self.data.get("gauges"))


#: Prometheus names (vLLM's "vllm:" prefix) for the counters.
PROM_COUNTERS = {
    "loads": ("vllm:mooncake_loads_total", "KV loads finished (hit, miss or failed)"),
    "loads_failed": ("vllm:mooncake_load_failures_total", "KV loads that failed with an error"),
    "load_bytes": ("vllm:mooncake_load_bytes_total", "KV bytes loaded from producers"),
    "load_bytes_same_host_cpu": ("vllm:mooncake_load_bytes_same_host_cpu_total",
                                 "KV bytes loaded through the same-host CPU path "
                                 "(cross-memory attach, no socket)"),
    "load_tokens": ("vllm:mooncake_load_tokens_total", "Prompt tokens loaded from producers"),
    "load_tokens_missed": ("vllm:mooncake_load_tokens_missed_total",
                           "Prompt tokens a load was meant to fill but did not"),
    "publishes": ("vllm:mooncake_publishes_total", "Prompts published for consumers"),
    "publish_failed": ("vllm:mooncake_publish_failures_total", "Prompts not published"),
    "publish_bytes": ("vllm:mooncake_publish_bytes_total", "KV bytes published"),
    "sends_finished": ("vllm:mooncake_sends_finished_total",
                       "Held requests whose blocks were released back to vLLM"),
    "push_loads": ("vllm:mooncake_push_loads_total",
                   "Consumer: push loads started (blocks lent to a producer)"),
    "push_sends": ("vllm:mooncake_push_sends_total",
                   "Producer: prompts written into a consumer's blocks (push flow)"),
    "push_bytes": ("vllm:mooncake_push_bytes_total", "Producer: KV bytes pushed"),
    "push_bytes_same_host_cpu": ("vllm:mooncake_push_bytes_same_host_cpu_total",
                                 "Producer: KV bytes pushed through the same-host CPU path "
                                 "(cross-memory attach into the consumer, no socket)"),
    "push_gate_host_batches": ("vllm:mooncake_push_gate_host_batches_total",
                               "Producer: layer writes on the same-host CPU path that the "
                               "engine's gate thread copied (off vLLM's forward thread)"),
    "push_layer_reads": ("vllm:mooncake_push_layer_reads_total",
                         "Consumer: layer loads whose layers this decode READ from the "
                         "producer's blocks (push_layer_read)"),
    "push_layer_read_gave_up": ("vllm:mooncake_push_layer_read_gave_up_total",
                                "Consumer: layer reads given up after "
                                "push_layer_read_stall_s without a layer announced"),
    "push_layer_loads": ("vllm:mooncake_push_layer_loads_total",
                         "Consumer: push loads whose attention waited per layer "
                         "(push_layer_load)"),
    "push_layer_load_busy": ("vllm:mooncake_push_layer_load_busy_total",
                             "Consumer: push_layer_load requests taken as whole-prompt pushes "
                             "because the decode was running other requests "
                             "(push_layer_load_max_batch)"),
    "push_layer_load_cudagraph": ("vllm:mooncake_push_layer_load_cudagraph_total",
                                  "Consumer: push_layer_load requests taken as whole-prompt "
                                  "pushes because their step would replay a FULL CUDA graph, "
                                  "where vLLM skips wait_for_layer_load"),
    "push_layer_load_async_sched": ("vllm:mooncake_push_layer_load_async_sched_total",
                                    "Consumer: push_layer_load requests taken as whole-prompt "
                                    "pushes because vLLM's asynchronous scheduling is on "
                                    "(vLLM cannot recover a failed in-step load under it)"),
    "push_layer_load_runner": ("vllm:mooncake_push_layer_load_runner_total",
                               "Consumer: push_layer_load requests taken as whole-prompt "
                               "pushes because vLLM's model runner here (V2 on a GPU) would "
                               "recompute a failed in-step load wrongly under "
                               "load_failure_policy recompute"),
    "push_producer_lost": ("vllm:mooncake_push_producer_lost_total",
                           "Consumer: push loads that stopped waiting at once because the "
                           "producer's connection was lost"),
    "push_target_resends": ("vllm:mooncake_push_target_resends_total",
                            "Consumer: push targets sent again after a send that may have "
                            "been lost (timed out, reset), within the lease"),
    "push_targets_direct": ("vllm:mooncake_push_targets_direct_total",
                            "Consumer: layer-load targets the decode's forward thread sent "
                            "itself (push_target_direct), not through the push outbox"),
    "load_releases": ("vllm:mooncake_load_releases_total",
                      "Consumer: prompts a producer held for it that it did not pull (their "
                      "blocks in its prefix cache): the producer ranks told to free the KV"),
    "load_releases_aborted": ("vllm:mooncake_load_releases_aborted_total",
                              "Consumer: of load_releases, those for requests that ended "
                              "(aborted: the client left) before their pull was sent"),
    "prefill_releases": ("vllm:mooncake_prefill_releases_total",
                         "Producer: prompts released at the proxy's word (no decode leg "
                         "followed the prefill leg: the client left, or the first token "
                         "ended the request): their KV freed at once"),
    "prefill_releases_late": ("vllm:mooncake_prefill_releases_late_total",
                              "Producer: the proxy's releases that came hold_timeout_s after "
                              "their leg published (its entries expired): nothing released"),
    "legs_forget_seen": ("vllm:mooncake_legs_forget_seen_total",
                         "Consumer: the proxy asked about a decode leg whose client left "
                         "before its answer; it was here or had pulled / released its prompt"),
    "legs_forget_unseen": ("vllm:mooncake_legs_forget_unseen_total",
                           "Consumer: the same, for a decode leg that never reached this "
                           "connector (or ended owing its pull): the proxy released the "
                           "prompt at the prefill"),
    "legs_late": ("vllm:mooncake_legs_late_total",
                  "Consumer: decode-leg requests that came after their leg was answered "
                  "unseen: neither loaded nor released (the prefill released the prompt)"),
    "push_untargeted_cancels": ("vllm:mooncake_push_untargeted_cancels_total",
                                "Consumer: push requests that ended without sending their "
                                "producer a target (aborted before their load, prompt all in "
                                "the prefix cache): the producer ranks told to free the KV"),
    "push_fence_cuts": ("vllm:mooncake_push_fence_cuts_total",
                        "Consumer: producers whose connections were cut (Engine.cut_peer) "
                        "before blocks lent to them were freed without their answer"),
    "push_fence_holds": ("vllm:mooncake_push_fence_holds_total",
                         "Consumer: push loads whose blocks were kept from vLLM's reuse after "
                         "the load ended, because their same-host producer process was alive "
                         "and had not answered (stopped or unresponsive): returned once it "
                         "answers or its process ends"),
    "load_error_blocks_uncached": ("vllm:mooncake_load_error_blocks_uncached_total",
                                   "Consumer: blocks of failed loads taken out of vLLM's "
                                   "prefix cache (in-step loads: cached before they ran)"),
    "malloc_trims": ("vllm:mooncake_malloc_trims_total",
                     "Worker: malloc_trim(0) calls after malloc_trim_idle_s without a step"),
    "malloc_trim_freed_bytes": ("vllm:mooncake_malloc_trim_freed_bytes_total",
                                "Worker: resident bytes those calls gave back to the system"),
    "push_failed": ("vllm:mooncake_push_failures_total",
                    "Producer: push targets ended without the KV (lease, failure, timeout)"),
}
PROM_GAUGES = {
    "held_bytes": ("vllm:mooncake_held_bytes",
                   "Producer: KV bytes in the lookup buffer (held for consumers)"),
    "lookup_entries": ("vllm:mooncake_lookup_entries",
                       "Producer: prompts in the lookup buffer"),
    "loads_in_flight": ("vllm:mooncake_loads_in_flight", "Consumer: loads not finished yet"),
}
LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0)


def build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues):
    """MooncakeConnector.build_prom_metrics: None without vLLM."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
    except ImportError:
        return None

    class MooncakePromMetrics(KVConnectorPromMetrics):
        def __init__(self):
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            eng = per_engine_labelvalues

            def per_engine(metric, extra=()):
                return {i: metric.labels(*lv, *extra) for i, lv in eng.items()}

            self.counters = {k: per_engine(self._counter_cls(name=n, documentation=d,
                                                             labelnames=labelnames))
                             for k, (n, d) in PROM_COUNTERS.items()}
            rec = self._counter_cls(
                name="vllm:mooncake_recomputes_total",
                documentation="Prompts a consumer computed although it was meant to load "
                              "them, by reason", labelnames=labelnames + ["reason"])
            self.recomputes = {r: per_engine(rec, (r,)) for r in RECOMPUTE_REASONS}
            self.gauges = {k: per_engine(self._gauge_cls(name=n, documentation=d,
                                                         labelnames=labelnames,
                                                         multiprocess_mode="mostrecent"))
                           for k, (n, d) in PROM_GAUGES.items()}
            self._latest = {}  # engine -> {worker: gauges}
            self.load_seconds = per_engine(self._histogram_cls(
                name="vllm:mooncake_load_seconds",
                documentation="Time from a load's start to its end (hit, miss or failure)",
                labelnames=labelnames, buckets=LOAD_BUCKETS))

        def observe(self, transfer_stats_data, engine_idx=0):
            data = transfer_stats_data or {}
            for k, per in self.counters.items():
                if data.get(k):
                    per[engine_idx].inc(data[k])
            for r, per in self.recomputes.items():
                if data.get(f"recompute_{r}"):
                    per[engine_idx].inc(data[f"recompute_{r}"])
            for secs in data.get("load_time_s") or ():
                self.load_seconds[engine_idx].observe(secs)
            if data.get("gauges"):
                # Each observation has the workers whose gauges changed.
                latest = self._latest.setdefault(engine_idx, {})
                latest.update(data["gauges"])
                totals = MooncakeKVConnectorStats(data={"gauges": latest}).gauge_totals()
                for k, per in self.gauges.items():
                    if k in totals:
                        per[engine_idx].set(totals[k])

    return MooncakePromMetrics()
