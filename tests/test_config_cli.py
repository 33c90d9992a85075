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


def test_options_and_extra_arguments_are_usage_errors(tmp_path):
    """`config --bogus` tried to open a file named --bogus, and `config a b`
    checked a and said nothing of b; an empty MOONCAKE_CONFIG_PATH was
    reported as not set."""
    import os
    p = tmp_path / "mooncake.json"
    p.write_text(json.dumps({"prefill_url": "127.0.0.1:13003", "decode_url": "127.0.0.1:13103",
                             "metadata_server": "P2PHANDSHAKE"}))
    r = run("--bogus")
    assert r.returncode == 2 and "unknown option '--bogus'" in r.stderr, r.stderr
    r = run(str(p), str(p))
    assert r.returncode == 2 and "one PATH only, got 2" in r.stderr, r.stderr
    r = run(env=dict(os.environ, MOONCAKE_CONFIG_PATH=""))
    assert r.returncode == 2 and "MOONCAKE_CONFIG_PATH is set but empty" in r.stderr, r.stderr
