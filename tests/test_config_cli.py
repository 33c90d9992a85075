import json
import subprocess
import sys


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "mooncake_connector.config", *args],
                          capture_output=True, text=True, env=env)


def test_valid_config_prints_effective_values(tmp_path):
    p = tmp_path / "mooncake.json"
    p.write_text(json.dumps({"prefill_url": "127.0.0.1:13003", "decode_url": "127.0.0.1:13003",
                             "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
                             "device_name": ""}))
    r = run(str(p))
    assert r.returncode == 0, r.stderr
    cfg = json.loads(r.stdout)
    assert cfg["decode_url"] == "127.0.0.1:13103"  # the seed's +100 rule
    assert "13103" in r.stderr  # ...and it says so


def test_invalid_config_names_file_field_and_value(tmp_path):
    p = tmp_path / "mooncake.json"
    p.write_text('{"prefill_url": "a:1", "decode_url": "b:2", "metadata_server": "P2PHANDSHAKE",'
                 ' "protocol": "udp"}')
    r = run(str(p))
    assert r.returncode == 2
    assert str(p) in r.stderr and "protocol" in r.stderr and "udp" in r.stderr
    assert "tcp" in r.stderr and "rdma" in r.stderr
