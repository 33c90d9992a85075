"""The quick-start main job (README command 1) runs and verifies its data."""
import json
import subprocess
import sys


def test_demo_runs_and_verifies():
    out = subprocess.run(
        [sys.executable, "-m", "mooncake_connector.demo", "--layers", "4", "--blocks", "64",
         "--block-kib", "16", "--repeat", "1", "--json"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["verified"] is True
    assert summary["bytes"] == 4 * 2 * 64 * 16 * 1024
    assert "GB/s" in out.stdout and "metadata server (embedded)" in out.stdout
