"""KVConnectorStats for vLLM's stat logger and Prometheus (both sides)."""
from dataclasses import dataclass

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError:  # vLLM absent
    from dataclasses import field

    @dataclass
    class KVConnectorStats:  # type: ignore[no-redef]
        data: dict = field(default_factory=dict)

COUNTERS = ("loads", "loads_in_step", "loads_failed", "load_bytes", "load_tokens", "load_tokens_missed",
            "publishes", "publish_failed", "publish_bytes", "sends_finished",
            "sends_expired")


@dataclass
class MooncakeKVConnectorStats(KVConnectorStats):
    """data: counters (COUNTERS) plus load_time_s, a list of per-load seconds."""

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

    def aggregate(self, other):
        if other is None or not getattr(other, "data", None):
            return self
        for k, v in other.data.items():
            if isinstance(v, list):
                self.data.setdefault(k, []).extend(v)
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self):
        out = {k: self.data.get(k, 0) for k in COUNTERS}
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
        return not any(self.data.get(k) for k in COUNTERS) and not self.data.get("load_time_s")
