"""The transfer demo (`python -m mooncake_connector.demo --transfer-only`, or
`python -m mooncake_connector.transfer_demo`) runs and verifies its data."""
import json
import os
import subprocess
import sys

import pytest
from conftest import TRANSPORTS


@pytest.mark.parametrize("transport", TRANSPORTS, indirect=True)
def test_demo_runs_and_verifies(transport, transport_env):
    out = subprocess.run(
        [sys.executable, "-m", "mooncake_connector.demo", "--transfer-only", "--layers", "4",
         "--blocks", "64", "--block-kib", "16", "--repeat", "1", "--json"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["verified"] is True
    assert summary["bytes"] == 4 * 2 * 64 * 16 * 1024
    assert "GB/s" in out.stdout and "metadata server (embedded)" in out.stdout
    # The demo reports the bytes that took the same-host CPU path: all of
    # them when it is on (both processes on this host), none when off.
    want = summary["bytes"] if transport == "same-host-cpu" else 0
    assert summary["same_host_cpu_bytes"] == want, out.stdout
    assert f"{want:,} of {summary['bytes']:,} bytes went through the same-host CPU path" \
        in out.stdout


def _transfer_demo(tmp_path, *args, env=None, **fields):
    """python -m mooncake_connector.transfer_demo (2 layers, 16 blocks, once)
    with a mooncake.json of P2PHANDSHAKE, prefill 127.0.0.1:23011 and these
    fields."""
    cfg = tmp_path / "mooncake.json"
    cfg.write_text(json.dumps({"prefill_url": "127.0.0.1:23011",
                               "metadata_server": "P2PHANDSHAKE", **fields}))
    return subprocess.run(
        [sys.executable, "-m", "mooncake_connector.transfer_demo", "--config", str(cfg),
         "--layers", "2", "--blocks", "16", "--repeat", "1", *args],
        capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def test_demo_with_a_mooncake_json(tmp_path):
    out = _transfer_demo(tmp_path, "--json", decode_url="127.0.0.1:23011", protocol="tcp",
                         device_name="")
    assert out.returncode == 0, out.stderr
    assert "127.0.0.1:23111" in out.stdout  # decode port moved by the seed's +100 rule
    assert json.loads(out.stdout.strip().splitlines()[-1])["verified"] is True
    # "same_host_cpu": false keeps the bytes off the same-host CPU path even
    # where the environment allows it.
    out = _transfer_demo(tmp_path, "--json", env={"MC_SAME_HOST_CPU": "1"},
                         decode_url="127.0.0.1:23111", protocol="tcp", same_host_cpu=False)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["verified"] is True and summary["same_host_cpu_bytes"] == 0, out.stdout
    assert '"same_host_cpu": false)' in out.stdout
    # rdma is refused clearly, never silently replaced by tcp
    out = _transfer_demo(tmp_path, decode_url="127.0.0.1:23111", protocol="rdma",
                         device_name="mlx5_0")
    assert out.returncode != 0
    assert "rdma" in out.stderr and "Traceback" not in out.stderr


def test_demo_from_a_directory_holding_another_copy_of_the_package(tmp_path):
    """The decode child must import the same built package as the parent, not
    a source tree (without the compiled _core) in the working directory."""
    import mooncake_connector
    shadow = tmp_path / "mooncake_connector"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('shadow copy without _core')\n")
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(mooncake_connector.__file__)))
    code = ("import sys; sys.path.insert(0, %r); sys.argv = ['demo', '--layers', '2', "
            "'--blocks', '16', '--repeat', '1']; "
            "from mooncake_connector.transfer_demo import main; sys.exit(main())" % pkg_parent)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "every block verified" in out.stdout


def test_serving_demo_help_names_its_options():
    """The serving demo itself (README command 1) runs in tests/test_e2e_serving.py
    against the session's servers; here only its command line."""
    out = subprocess.run([sys.executable, "-m", "mooncake_connector.demo", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for opt in ("--transfer-only", "--connector", "--requests", "--keep-running"):
        assert opt in out.stdout
    bad = subprocess.run([sys.executable, "-m", "mooncake_connector.demo", "--requests", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--requests must be >= 1" in bad.stderr
    assert "--device" in out.stdout
    env = dict(os.environ, MC_DEMO_DEVICE="tpu")
    dev = subprocess.run([sys.executable, "-m", "mooncake_connector.demo"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert dev.returncode == 2 and "MC_DEMO_DEVICE='tpu': expected cpu or cuda" in dev.stderr
