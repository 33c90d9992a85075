"""mooncake.json through the Python API: load_config / parse_config."""
import json
import os
import subprocess
import sys
import threading

import pytest

from mooncake_connector import ConfigError, MooncakeError, load_config, parse_config

SEED_RDMA = {
    "prefill_url": "192.168.0.137:13003",
    "decode_url": "192.168.0.139:13003",
    "metadata_server": "192.168.0.139:2379",
    "metadata_backend": "etcd",
    "protocol": "rdma",
    "device_name": "erdma_0",
}

SEED_TCP = {
    "prefill_url": "192.168.0.137:13003",
    "decode_url": "192.168.0.139:13003",
    "metadata_server": "192.168.0.139:2379",
    "metadata_backend": "etcd",
    "protocol": "tcp",
    "device_name": "",
}

KEYS = {
    "origin", "prefill_url", "decode_url", "prefill_host", "prefill_port",
    "decode_host", "decode_port", "metadata_server", "metadata_server_raw",
    "metadata_backend", "metadata_backend_given", "protocol", "device_name",
    "decode_port_adjusted", "notes", "auth_secret", "same_host_cpu",
}


def cfg(**overrides):
    """A valid tcp/P2P config with some fields replaced (None removes one)."""
    base = {
        "prefill_url": "10.0.0.1:13003",
        "decode_url": "10.0.0.2:13003",
        "metadata_server": "P2PHANDSHAKE",
    }
    base.update(overrides)
    return json.dumps({k: v for k, v in base.items() if v is not None})


@pytest.fixture
def write(tmp_path):
    def _write(content, name="mooncake.json"):
        p = tmp_path / name
        if isinstance(content, dict):
            content = json.dumps(content, indent=2)
        p.write_bytes(content.encode() if isinstance(content, str) else content)
        return p

    return _write


# ---- the seed's two examples -------------------------------------------------


def test_seed_rdma_from_env(write, monkeypatch):
    path = write(SEED_RDMA)
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    c = load_config()
    assert set(c) == KEYS
    assert c["origin"] == str(path)
    assert c["prefill_url"] == "192.168.0.137:13003"
    assert c["decode_url"] == "192.168.0.139:13003"
    assert (c["prefill_host"], c["prefill_port"]) == ("192.168.0.137", 13003)
    assert (c["decode_host"], c["decode_port"]) == ("192.168.0.139", 13003)
    assert c["metadata_server"] == "etcd://192.168.0.139:2379"
    assert c["metadata_server_raw"] == "192.168.0.139:2379"
    assert c["metadata_backend"] == "etcd"
    assert c["metadata_backend_given"] is True
    assert c["protocol"] == "rdma"
    assert c["device_name"] == "erdma_0"
    assert c["decode_port_adjusted"] is False
    assert "metadata_backend is deprecated" in c["notes"]


def test_seed_tcp_explicit_path(write):
    path = write(SEED_TCP)
    for arg in (str(path), path, os.fsencode(path)):  # str, PathLike, bytes
        c = load_config(arg)
        assert c["protocol"] == "tcp"
        assert c["device_name"] == ""
        assert c["metadata_server"] == "etcd://192.168.0.139:2379"
        assert c["origin"] == str(path)


def test_explicit_path_beats_env(write, monkeypatch):
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", "/nonexistent/mooncake.json")
    assert load_config(path=write(SEED_TCP))["protocol"] == "tcp"


def test_env_unset(monkeypatch):
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    with pytest.raises(ConfigError, match="set MOONCAKE_CONFIG_PATH"):
        load_config()
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", "")
    with pytest.raises(ConfigError, match="MOONCAKE_CONFIG_PATH"):
        load_config(None)


def test_env_points_to_missing_file(monkeypatch, tmp_path):
    missing = tmp_path / "nope.json"
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(missing))
    with pytest.raises(ConfigError) as ei:
        load_config()
    msg = str(ei.value)
    assert str(missing) in msg
    assert os.strerror(2) in msg  # "No such file or directory"
    assert "MOONCAKE_CONFIG_PATH" in msg
    assert ei.value.code_name == "MC_ECONFIG"


def test_parse_config_str_and_bytes():
    text = json.dumps(SEED_RDMA)
    assert parse_config(text) == parse_config(text.encode())
    c = parse_config(text)
    assert c["origin"] == "<string>"
    assert parse_config(text, origin="inline.json")["origin"] == "inline.json"
    assert parse_config(text=text, origin="x")["device_name"] == "erdma_0"


# ---- normalisation and the port rules ------------------------------------------


@pytest.mark.parametrize(
    "server, backend, kind, normalised",
    [
        ("P2PHANDSHAKE", None, "p2p", "P2PHANDSHAKE"),
        ("etcd://m:2379", None, "etcd", "etcd://m:2379"),
        ("etcd://a:1,b:2", None, "etcd", "etcd://a:1,b:2"),
        ("m:2379", None, "etcd", "etcd://m:2379"),
        ("redis://:pw@r:6379/3", None, "redis", "redis://:pw@r:6379/3"),
        ("r:6379", "redis", "redis", "redis://r:6379"),
        ("http://h:8080/metadata", None, "http", "http://h:8080/metadata"),
        ("https://h/md", None, "http", "https://h/md"),
        ("h:8080", "http", "http", "http://h:8080/metadata"),
    ],
)
def test_metadata_server_forms(server, backend, kind, normalised):
    c = parse_config(cfg(metadata_server=server, metadata_backend=backend))
    assert c["metadata_backend"] == kind
    assert c["metadata_server"] == normalised
    assert c["metadata_server_raw"] == server
    assert c["metadata_backend_given"] is (backend is not None)


def test_identical_urls_move_decode_up_100():
    c = parse_config(cfg(prefill_url="192.168.0.137:13003", decode_url="192.168.0.137:13003"))
    assert c["decode_port"] == 13103
    assert c["decode_url"] == "192.168.0.137:13103"
    assert c["prefill_url"] == "192.168.0.137:13003"
    assert c["decode_port_adjusted"] is True
    assert "using decode port 13103" in c["notes"]


def test_ports_50_apart_and_other_hosts_ok():
    c = parse_config(cfg(prefill_url="h:13003", decode_url="h:13053"))
    assert c["decode_port"] == 13053 and not c["decode_port_adjusted"]
    c = parse_config(cfg(prefill_url="a:13003", decode_url="b:13004"))
    assert c["decode_port"] == 13004


def test_ipv6_urls():
    c = parse_config(cfg(prefill_url="[fe80::1]:13003", decode_url="[fe80::1]:13003"))
    assert c["prefill_host"] == "fe80::1"
    assert c["decode_url"] == "[fe80::1]:13103"


# ---- errors ------------------------------------------------------------------------


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)
    assert issubclass(ConfigError, MooncakeError)


def test_ports_too_close():
    with pytest.raises(ConfigError) as ei:
        parse_config(cfg(prefill_url="h:13003", decode_url="h:13010"), origin="m.json")
    msg = str(ei.value)
    assert msg.startswith('m.json: field "decode_url": value "h:13010"')
    assert '"h:13003"' in msg
    assert "at least 50 apart" in msg


def test_unknown_field_suggests():
    with pytest.raises(ConfigError, match=r'field "protcol": unknown field; did you mean "protocol"\?'):
        parse_config(cfg(protcol="tcp"))


def test_wrong_type():
    with pytest.raises(ConfigError) as ei:
        parse_config(cfg(protocol=5))
    assert 'field "protocol": value 5 is a number; expected a string' in str(ei.value)
    assert 'accepted: "tcp", "rdma"' in str(ei.value)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"protocol": "udp"}, 'field "protocol": value "udp" is not a supported protocol'),
        ({"protocol": "rdma"}, 'field "device_name": is missing'),
        ({"protocol": "rdma", "device_name": "mlx5_0,"}, "empty NIC name at position 2"),
        ({"metadata_server": "zk://h:2181"}, 'unknown scheme "zk"'),
        ({"metadata_server": "redis://r:6379/x"}, "not a non-negative integer"),
        (
            {"metadata_server": "etcd://m:2379", "metadata_backend": "redis"},
            'field "metadata_backend": value "redis" conflicts with metadata_server',
        ),
        ({"prefill_url": "10.0.0.1"}, 'field "prefill_url": value "10.0.0.1" has no port'),
        ({"decode_url": "10.0.0.2:70000"}, "out of range"),
        ({"decode_url": "10.0.0.2:0"}, "port 0"),
        ({"metadata_server": None}, 'field "metadata_server": is missing (required)'),
    ],
)
def test_field_errors(overrides, expected):
    with pytest.raises(ConfigError) as ei:
        parse_config(cfg(**overrides), origin="cfg.json")
    msg = str(ei.value)
    assert msg.startswith("cfg.json: ")
    assert expected in msg
    assert "; accepted: " in msg
    assert "\n" not in msg


def test_bad_json_reports_line_and_column(write):
    path = write('{\n  "prefill_url": "a:1000",\n  "decode_url": "b:1000",\n}\n')
    with pytest.raises(ConfigError) as ei:
        load_config(str(path))
    msg = str(ei.value)
    assert msg.startswith(f"{path}: invalid JSON at line 4, column 1")
    assert "trailing comma" in msg


def test_empty_and_non_object(write):
    with pytest.raises(ConfigError, match="config is empty"):
        load_config(write(""))
    with pytest.raises(ConfigError, match="top-level JSON value is an array"):
        parse_config("[]")


def test_oversized_file_refused(write):
    path = write(b"{" + b" " * (1 << 20) + b"}")
    with pytest.raises(ConfigError, match="at most 1048576"):
        load_config(path)
    with pytest.raises(ConfigError, match="at most 1048576"):
        parse_config("{" + " " * (1 << 20) + "}")


def test_password_not_leaked_in_error():
    with pytest.raises(ConfigError) as ei:
        parse_config(cfg(metadata_server="redis://:hunter2@r:6379/x"))
    assert "hunter2" not in str(ei.value)
    assert "redis://:***@r:6379/x" in str(ei.value)


def test_non_utf8_value_gives_config_error():
    text = cfg().encode()[:-1] + b', "protocol": "\xff"}'
    with pytest.raises(ConfigError, match=r"\\xff"):
        parse_config(text)


def test_argument_errors():
    with pytest.raises(TypeError):
        parse_config(5)
    with pytest.raises(TypeError):
        load_config(5)
    with pytest.raises(ValueError):
        load_config("a\0b")


def test_parallel_threads(write):
    """No shared state: concurrent loads all succeed with their own results."""
    paths = [write(cfg(decode_url=f"10.0.0.2:{1000 + i}"), name=f"c{i}.json") for i in range(8)]
    results = {}

    def run(i):
        for _ in range(50):
            results[i] = load_config(paths[i])["decode_port"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: 1000 + i for i in range(8)}


# ---- same_host_cpu (docs/connector.md) --------------------------------------
def test_same_host_cpu_switch():
    assert parse_config(cfg())["same_host_cpu"] is True
    assert parse_config(cfg(same_host_cpu=False))["same_host_cpu"] is False
    with pytest.raises(ConfigError, match=r'field "same_host_cpu": value "off" is a string; '
                                          r'expected true or false'):
        parse_config(cfg(same_host_cpu="off"))


# ---- auth_secret (docs/security.md) ------------------------------------------

def test_auth_secret_is_parsed_and_never_echoed():
    assert parse_config(cfg())["auth_secret"] == ""
    assert parse_config(cfg(auth_secret="s3cr3t-value"))["auth_secret"] == "s3cr3t-value"
    with pytest.raises(ConfigError, match='field "auth_secret".*expected a string') as ei:
        parse_config(cfg(auth_secret=982451653))
    assert "982451653" not in str(ei.value)
    with pytest.raises(ConfigError, match='field "auth_secret": is 2000 bytes long') as ei:
        parse_config(cfg(auth_secret="q" * 2000))
    assert "qqqq" not in str(ei.value)


def test_config_cli_does_not_print_the_secret(write):
    p = write(cfg(auth_secret="s3cr3t-value"))
    r = subprocess.run([sys.executable, "-m", "mooncake_connector.config", str(p)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "s3cr3t-value" not in r.stdout + r.stderr
    assert '"auth_secret": "(set, not shown)"' in r.stdout


def test_fifo_without_a_writer_does_not_hang(tmp_path):
    """MOONCAKE_CONFIG_PATH naming a FIFO nothing writes to: open() waited
    for a writer forever (a process stuck at startup, no message).  Now the
    open does not wait: nothing to read is an empty config, named.  A pipe
    that has a writer (bash's <(...)) is still read."""
    fifo = tmp_path / "mooncake.json"
    os.mkfifo(fifo)
    code = ("import sys\nfrom mooncake_connector import load_config, ConfigError\n"
            "try:\n    load_config(sys.argv[1])\nexcept ConfigError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-P", "-c", code, str(fifo)], capture_output=True,
                       text=True, timeout=30, cwd=str(tmp_path))
    assert "config is empty" in r.stdout and str(fifo) in r.stdout, (r.stdout, r.stderr)
    good = json.dumps({"prefill_url": "127.0.0.1:13003", "decode_url": "127.0.0.1:13103",
                       "metadata_server": "P2PHANDSHAKE"})
    r = subprocess.run(["bash", "-c", f"{sys.executable} -P -c \"import sys; from "
                        "mooncake_connector import load_config; "
                        "print(load_config(sys.argv[1])['decode_port'])\" "
                        f"<(echo '{good}')"], capture_output=True, text=True, timeout=30,
                       cwd=str(tmp_path))
    assert r.stdout.strip() == "13103", (r.stdout, r.stderr)


@pytest.mark.parametrize("escape", ["\\ud800", "\\udc00", "a\\ud800b", "\\ud800\\u0041",
                                    "\\udbff\\ud800"])
def test_lone_surrogate_escape_is_a_config_error(escape):
    """A \\u escape of half a UTF-16 surrogate pair passed the syntax check
    (RFC 8259 allows it) but cJSON refuses it, which the parser took for
    running out of memory: a bare MemoryError with no message, from
    load_config / `mooncake-connector config` and in every worker."""
    text = ('{"prefill_url": "127.0.0.1:13003", "decode_url": "127.0.0.1:13103", '
            '"metadata_server": "P2PHANDSHAKE", "auth_secret": "' + escape + '"}')
    with pytest.raises(ConfigError, match="surrogate"):
        parse_config(text, "x.json")


def test_surrogate_pair_escape_is_accepted():
    text = ('{"prefill_url": "127.0.0.1:13003", "decode_url": "127.0.0.1:13103", '
            '"metadata_server": "P2PHANDSHAKE", "auth_secret": "\\ud83d\\ude00xyz"}')
    assert parse_config(text, "x.json")["auth_secret"] == "\U0001F600xyz"
