"""The chaos soak's same-host CPU path coverage (benchmarks/soak.py), without
vLLM: P1 and P2 run in a network namespace, and the engines refuse the
same-host CPU path across network namespaces (csrc/transport/cma/cma.c), so
before P3 the soak's push flows never took the path that run 30 moved onto
the engine's gate thread (every soak JSON under benchmarks/results/:
load_bytes_same_host_cpu 0 on every server).  P3, a prefill on the host,
serves the host flows; its path counters are summed over its lifetimes (the
soak SIGKILLs and restarts it) and a host flow whose counter stayed 0 fails
the run."""
import os
import sys
import textwrap
import time
import types

import pytest

from mooncake_connector import serving
from soak_util import load_soak

sk = load_soak("soak_same_host_mod")

BYTES = "vllm:mooncake_push_bytes_same_host_cpu_total"
GATE = "vllm:mooncake_push_gate_host_batches_total"
PUSHED = "vllm:mooncake_push_bytes_total"

METRICS = textwrap.dedent("""
    import http.server, sys
    port, value = int(sys.argv[1]), sys.argv[2]
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = (f'vllm:mooncake_push_bytes_total{{engine="0"}} {value}\\n'
                    f'vllm:mooncake_push_bytes_same_host_cpu_total{{engine="0"}} {value}\\n'
                    'vllm:mooncake_push_gate_host_batches_total{engine="0"} 3.0\\n'
                    'vllm:mooncake_held_bytes{engine="0"} 0.0\\n').encode()
            self.send_response(200); self.end_headers(); self.wfile.write(body)
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


def test_path_totals_sum_every_lifetime_and_the_share():
    counters = {"P3": {101: {PUSHED: 1000.0, BYTES: 1000.0, GATE: 7.0},
                       202: {PUSHED: 500.0, BYTES: 400.0, GATE: 0.0}},
                "P1": {303: {PUSHED: 800.0, BYTES: 0.0, GATE: 0.0}}}
    t = sk.path_totals(counters)
    assert t["P3"]["push_bytes"] == 1500 and t["P3"]["push_bytes_same_host_cpu"] == 1400
    assert t["P3"]["push_gate_host_batches"] == 7 and t["P3"]["lifetimes"] == 2
    assert t["P3"]["same_host_share"] == round(1400 / 1500, 3)
    assert t["P1"]["same_host_share"] == 0.0 and t["P1"]["push_bytes_same_host_cpu"] == 0


def test_a_host_flow_that_never_took_the_path_fails_the_run():
    flows = list(sk.FLOWS)
    ok = {"P3": {"push_bytes_same_host_cpu": 5, "push_gate_host_batches": 2}}
    assert sk.same_host_verdict(ok, flows) == []
    # the path silently gone (P3's pushes over TCP): every host flow fails
    v = sk.same_host_verdict({"P3": {"push_bytes_same_host_cpu": 0,
                                     "push_gate_host_batches": 0}}, flows)
    assert len(v) == 4 and all("coverage lost" in x for x in v), v
    assert sum("push-host-ll" in x for x in v) == 2, v
    # the gate thread never used: only the layer-load flow fails
    v = sk.same_host_verdict({"P3": {"push_bytes_same_host_cpu": 5}}, flows)
    assert v == ["flow push-host-ll: P3's push_gate_host_batches stayed 0 over the run (the "
                 "same-host CPU path gate thread never used: coverage lost)"], v
    # no P3 row at all (never answered /metrics) with host flows: fails too
    assert len(sk.same_host_verdict({}, ["push-host"])) == 1
    # the namespace flows alone ask nothing of it
    assert sk.same_host_verdict({}, ["a", "b", "push", "push-lw", "push-ll"]) == []


def test_monitor_keeps_each_lifetimes_path_counters(tmp_path):
    """Monitor.sample records every live server's PATH_COUNTERS per process:
    a SIGKILLed and restarted P3 (a new pid, its counters from 0 again)
    keeps its first lifetime's last values, so path_totals adds both."""
    script = tmp_path / "metrics.py"
    script.write_text(METRICS)
    port = serving.free_port()

    def proc(value):
        p = serving.Process("P3", [sys.executable, str(script), str(port), value],
                            str(tmp_path / "P3.log"), health_url=f"http://127.0.0.1:{port}/")
        p.url = f"http://127.0.0.1:{port}"
        return p
    mon = sk.Monitor(types.SimpleNamespace(servers={}), time.monotonic())
    first = proc("100.0")
    first.start()
    try:
        first.wait_ready(20)
        mon.c.servers["P3"] = first
        mon.sample()
        first.stop(grace=2)
        second = proc("40.0")
        second.start()
        second.wait_ready(20)
        mon.c.servers["P3"] = second
        mon.sample()
        mon.sample()
    finally:
        first.stop(grace=2)
        second.stop(grace=2)
    assert len(mon.counters["P3"]) == 2, mon.counters
    t = sk.path_totals(mon.counters)["P3"]
    assert t["push_bytes_same_host_cpu"] == 140 and t["push_bytes"] == 140, t
    assert t["push_gate_host_batches"] == 6 and t["lifetimes"] == 2, t


def _cluster(tmp_path, flows, decode_extra=None):
    args = types.SimpleNamespace(
        flows=flows, hold_timeout_s=30.0, load_timeout_s=10.0, small_kv_buffer=1 << 20,
        kv_cache_bytes=64 << 20, reference=False, env_of={}, memwatch_dir=None,
        proxy_timeout_s=120.0, proxy_idle_timeout_s=60.0, decode_extra=decode_extra or {})
    net = sk.Net("t1", enabled=True)   # commands only: nothing is started or set up
    return sk.Cluster(str(tmp_path), "/nonexistent-model", net, args), net


def test_host_prefill_runs_outside_the_namespace_and_serves_the_host_flows(tmp_path):
    import json
    c, net = _cluster(tmp_path, list(sk.FLOWS))
    try:
        p3 = c.servers["P3"]
        assert p3.cmd[:3] != ["ip", "netns", "exec"] and "127.0.0.1" in p3.url
        for n in ("P1", "P2"):   # in the namespace, as before
            assert c.servers[n].cmd[:4] == ["ip", "netns", "exec", net.ns]
        # the path on in every server whatever the soak inherits (this test
        # process has conftest's MC_SAME_HOST_CPU=0, as a --ci soak run by
        # pytest does): a deployment's default
        assert os.environ.get("MC_SAME_HOST_CPU") == "0"
        for n, srv in c.servers.items():
            assert srv.env["MC_SAME_HOST_CPU"] == "1", n
        cfg = json.load(open(tmp_path / "mooncake-P3.json"))
        assert cfg["prefill_url"].startswith("127.0.0.1:")
        d1 = json.load(open(tmp_path / "mooncake-D1.json"))
        assert cfg["decode_url"] == d1["decode_url"]  # the decodes' published name
        for flow, lw, ll in (("push-host", "off", "off"), ("push-host-lw", "on", "off"),
                             ("push-host-ll", "on", "on")):
            cmd = c.proxies[flow].cmd
            pre = cmd[cmd.index("--prefill") + 1:cmd.index("--decode")]
            assert pre == [p3.url], (flow, cmd)
            assert cmd[cmd.index("--prefill-engine") + 1] == cfg["prefill_url"]
            assert cmd[cmd.index("--push-layerwise") + 1] == lw
            assert cmd[cmd.index("--push-layer-load") + 1] == ll
        for flow in ("push", "push-lw", "push-ll"):   # the namespace's push flows: P1, P2
            cmd = c.proxies[flow].cmd
            assert p3.url not in cmd, (flow, cmd)
    finally:
        c.launcher.close()
    c, _ = _cluster(tmp_path, ["a", "b", "push", "push-lw", "push-ll"])
    try:
        assert "P3" not in c.servers and set(c.proxies) == {"a", "b", "push", "push-lw",
                                                            "push-ll"}
    finally:
        c.launcher.close()


def test_decode_extra_config_reaches_the_decodes_only(tmp_path):
    """--decode-extra-c load_failure_policy=fail (the soak with the proxies'
    retake in play): the decodes' kv_connector_extra_config has it, the
    prefills' not; a bad item is a usage error naming it."""
    import json
    args = sk.parse_args(["--decode-extra-c", "load_failure_policy=fail",
                          "--decode-extra-c", "load_timeout_s=4"])
    assert args.decode_extra == {"load_failure_policy": "fail", "load_timeout_s": 4}
    c, _ = _cluster(tmp_path, list(sk.FLOWS), args.decode_extra)
    try:
        for n, srv in c.servers.items():
            cmd = srv.cmd
            ktc = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
            extra = ktc["kv_connector_extra_config"]
            if n.startswith("D"):
                assert extra["load_failure_policy"] == "fail" and extra["load_timeout_s"] == 4, n
                assert extra["hold_timeout_s"] == 30.0, n
            else:
                assert "load_failure_policy" not in extra and extra["load_timeout_s"] == 10.0, n
    finally:
        c.launcher.close()
    with pytest.raises(SystemExit):
        sk.parse_args(["--decode-extra-c", "load_failure_policy"])
