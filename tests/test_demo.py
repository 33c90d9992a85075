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


def test_demo_with_a_mooncake_json(tmp_path):
    cfg = tmp_path / "mooncake.json"
    cfg.write_text(json.dumps({"prefill_url": "127.0.0.1:23011", "decode_url": "127.0.0.1:23011",
                               "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
                               "device_name": ""}))
    out = subprocess.run(
        [sys.executable, "-m", "mooncake_connector.demo", "--config", str(cfg), "--layers", "2",
         "--blocks", "16", "--repeat", "1", "--json"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "127.0.0.1:23111" in out.stdout  # decode port moved by the seed's +100 rule
    assert json.loads(out.stdout.strip().splitlines()[-1])["verified"] is True
    # rdma is refused clearly, never silently replaced by tcp
    cfg.write_text(json.dumps({"prefill_url": "127.0.0.1:23011", "decode_url": "127.0.0.1:23111",
                               "metadata_server": "P2PHANDSHAKE", "protocol": "rdma",
                               "device_name": "mlx5_0"}))
    out = subprocess.run(
        [sys.executable, "-m", "mooncake_connector.demo", "--config", str(cfg), "--layers", "2",
         "--blocks", "16", "--repeat", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "rdma" in out.stderr and "Traceback" not in out.stderr
