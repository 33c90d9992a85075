"""MC_TRACE (mooncake_connector/trace.py): one JSON line per event, from
several processes onto one monotonic axis, bounded by MC_TRACE_MAX_MB, and a
clear error for a bad bound."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EMIT = ("from mooncake_connector import trace\n"
        "import sys\n"
        "for i in range(int(sys.argv[1])):\n"
        "    trace.event('x', 'k%d' % i, i=i, tag=sys.argv[2])\n")


def _run(env, n, tag):
    return subprocess.run([sys.executable, "-c", EMIT, str(n), tag], capture_output=True,
                          text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT, **env})


def test_two_processes_one_axis(tmp_path):
    from mooncake_connector import trace
    path = str(tmp_path / "t.jsonl")
    for tag in ("a", "b"):
        r = _run({"MC_TRACE": path}, 50, tag)
        assert r.returncode == 0, r.stderr
    ev = trace.read(path)
    assert len(ev) == 100
    assert [e["t"] for e in ev] == sorted(e["t"] for e in ev)
    assert {e["tag"] for e in ev[:50]} == {"a"} and {e["tag"] for e in ev[50:]} == {"b"}
    assert len({e["pid"] for e in ev}) == 2 and ev[0]["k"] == "k0" and ev[0]["i"] == 0


def test_off_without_mc_trace(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MC_TRACE"}
    r = subprocess.run([sys.executable, "-c", EMIT, "5", "a"], capture_output=True, text=True,
                       timeout=120, cwd=str(tmp_path), env={**env, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr
    assert os.listdir(tmp_path) == []


def test_bounded(tmp_path):
    path = str(tmp_path / "t.jsonl")
    r = _run({"MC_TRACE": path, "MC_TRACE_MAX_MB": "0.01"}, 5000, "a")
    assert r.returncode == 0, r.stderr
    assert os.path.getsize(path) <= 0.01 * (1 << 20)
    with open(path) as f:
        lines = f.read().splitlines()
    assert 0 < len(lines) < 5000 and all(json.loads(x)["ev"] == "x" for x in lines)
    assert "MC_TRACE_MAX_MB" in r.stderr  # said once, not silent


def test_bad_bound_names_the_variable(tmp_path):
    r = _run({"MC_TRACE": str(tmp_path / "t"), "MC_TRACE_MAX_MB": "lots"}, 1, "a")
    assert r.returncode != 0 and "MC_TRACE_MAX_MB='lots'" in r.stderr


def test_nan_or_infinite_bound_names_the_variable(tmp_path):
    """nan and inf were a bare "cannot convert float NaN/infinity to
    integer" not naming the variable."""
    for raw in ("nan", "inf", "-inf"):
        r = _run({"MC_TRACE": str(tmp_path / "t"), "MC_TRACE_MAX_MB": raw}, 1, "a")
        assert r.returncode != 0 and f"MC_TRACE_MAX_MB={raw!r}" in r.stderr, r.stderr
