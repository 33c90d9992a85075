"""What a careless or hostile user can feed the package, as a user would:
the console scripts and `python -m` entry points, the environment, the
Python API.  Each bad input gets one clear message naming the input and the
fix: no traceback, crash, hang or silent fallback.

The proxy's command line and hostile HTTP requests: tests/test_proxy.py
(test_bad_command_lines_name_the_argument, test_malformed_requests_*,
test_client_kv_transfer_params_are_refused); the metadata server's HTTP API:
tests/test_metadata_server.py; wire bytes: tests/fuzz and
tests/test_hostile_peers.py; mooncake.json field by field: tests/test_config.py.
"""
import json
import os
import subprocess
import sys

import pytest

import mooncake_connector as mc

PY = sys.executable
GOOD = ('{"prefill_url": "127.0.0.1:13003", "decode_url": "127.0.0.1:13103", '
        '"metadata_server": "P2PHANDSHAKE"}')


def run(args, env=None, timeout=60, stdin=None):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MC_", "MOONCAKE_"))}
    e.update(env or {})
    return subprocess.run([PY, "-P", *args], capture_output=True, text=True, env=e,
                          timeout=timeout, cwd="/", stdin=subprocess.DEVNULL)


def one_clear_line(r, *needles, rc=2):
    assert r.returncode == rc, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in r.stderr, (n, r.stderr)


# ---- mooncake.json through `mooncake-connector config` (python -m mooncake_connector config)

CONFIGS = [
    ("list", b"[1, 2]", "top-level JSON value is an array"),
    ("string", b'"x"', "top-level JSON value is a string"),
    ("empty", b"", "config is empty"),
    ("not utf-8", GOOD.replace("P2PHANDSHAKE", "P2P\udcff").encode("utf-8", "surrogateescape"),
     "metadata_server"),
    ("trailing text", GOOD.encode() + b" xx", "unexpected text after the JSON value"),
    ("deep", b"[" * 100000, "nesting too deep"),
    ("typo", GOOD.replace("metadata_server", "metadata_sever").encode(),
     'did you mean "metadata_server"'),
    ("wrong type", GOOD.replace('"127.0.0.1:13003"', "13003").encode(), "expected a string"),
    ("empty string", GOOD.replace('"127.0.0.1:13003"', '""').encode(), "is empty"),
    ("port 0", GOOD.replace(":13003", ":0").encode(), "port 0"),
    ("port 70000", GOOD.replace(":13003", ":70000").encode(), "out of range"),
    ("no port", GOOD.replace(":13003", "").encode(), "has no port"),
    ("duplicate key", GOOD.replace("{", '{"protocol": "tcp", "protocol": "tcp", ').encode(),
     "appears more than once"),
    ("NUL", GOOD.replace("P2PHANDSHAKE", "P2P\\u0000x").encode(), "NUL"),
    ("bad scheme", GOOD.replace("P2PHANDSHAKE", "ftp://x:1").encode(), 'unknown scheme "ftp"'),
    ("protocol", GOOD.replace("}", ', "protocol": "udp"}').encode(), "not a supported protocol"),
    ("bool", GOOD.replace("}", ', "same_host_cpu": "yes"}').encode(), "expected true or false"),
]


@pytest.mark.parametrize("raw,expect", [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_config_cli_names_the_mistake(tmp_path, raw, expect):
    p = tmp_path / "mooncake.json"
    p.write_bytes(raw)
    one_clear_line(run(["-m", "mooncake_connector", "config", str(p)]), str(p), expect)


def test_config_cli_file_problems(tmp_path):
    one_clear_line(run(["-m", "mooncake_connector", "config", str(tmp_path / "no.json")]),
                   "cannot open config file", "MOONCAKE_CONFIG_PATH")
    one_clear_line(run(["-m", "mooncake_connector", "config", str(tmp_path)]), "is a directory")
    one_clear_line(run(["-m", "mooncake_connector", "config", "/dev/zero"]), "over 1048576")
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (2 << 20))
    one_clear_line(run(["-m", "mooncake_connector", "config", str(big)]), "at most 1048576")
    one_clear_line(run(["-m", "mooncake_connector", "config"]),
                   "MOONCAKE_CONFIG_PATH is not set")
    one_clear_line(run(["-m", "mooncake_connector", "config"],
                       env={"MOONCAKE_CONFIG_PATH": str(tmp_path / "gone.json")}),
                   "gone.json", "cannot open config file")


def test_cli_unknown_command():
    one_clear_line(run(["-m", "mooncake_connector", "doctr"]), "unknown command 'doctr'",
                   "doctor")


# ---- the metadata server's command line

@pytest.mark.parametrize("args,expect,rc", [
    (["--port", "70000"], "--port 70000 is out of range", 2),
    (["--port", "-1"], "--port -1 is out of range", 2),
    (["--token-file", "/nonexistent/token"], "No such file", 2),
    (["--host", "no-such-host.invalid", "--port", "0"], "cannot listen on", 1),
    (["--bogus"], "unrecognized arguments: --bogus", 2),
])
def test_metadata_server_command_line(args, expect, rc):
    one_clear_line(run(["-m", "mooncake_connector.metadata_server", *args], timeout=30),
                   expect, rc=rc)


# ---- the environment: MC_* knobs with garbage

ENGINE = ("import mooncake_connector as mc\n"
          "a = mc.TransferEngine(); a.initialize('127.0.0.1', 'P2PHANDSHAKE', 'tcp', '')\n"
          "b = mc.TransferEngine(); b.initialize('127.0.0.1', 'P2PHANDSHAKE', 'tcp', '')\n"
          "x = a.allocate_managed_buffer(1 << 16); y = b.allocate_managed_buffer(1 << 16)\n"
          "a.transfer_sync_write(b.get_segment_name(), x, y, 1 << 16)\n"
          "kv = mc.KVTransfer(b, mc.LookupBuffer(1 << 20))\n"
          "print('same-host', a.get_stats()['same_host_cpu_bytes_written'])\n"
          "kv.close(); a.close(); b.close()\n")


@pytest.mark.parametrize("var,value,bytes_cma", [
    ("MC_SAME_HOST_CPU", "no", 0), ("MC_SAME_HOST_CPU", "OFF", 0),
    ("MC_SAME_HOST_CPU", "yes", 1 << 16), ("MC_SAME_HOST_CPU", "1", 1 << 16)])
def test_same_host_cpu_switch_spellings(var, value, bytes_cma):
    """"no" used to mean on (only 0, false, off were off)."""
    r = run(["-c", ENGINE], env={var: value, "MC_LOG_LEVEL": "warn"})
    assert r.returncode == 0, r.stderr
    assert f"same-host {bytes_cma}" in r.stdout and "ignoring" not in r.stderr, r.stderr


@pytest.mark.parametrize("var,value", [
    ("MC_SAME_HOST_CPU", "disable"),   # was silently on
    ("MC_KV_WORKERS", "abc"),          # was silently 2 (atoi)
    ("MC_KV_WORKERS", "1000"),         # was silently 64
    ("MC_KV_QUEUE_MB", "-3"),          # was silently 64
    ("MC_TRANSFER_TIMEOUT", "abc"),
    ("MC_SLICE_SIZE", "1"),
    ("MC_TCP_IO_THREADS", "1000000"),
])
def test_garbage_env_knob_is_named_not_silent(var, value):
    r = run(["-c", ENGINE], env={var: value})
    assert r.returncode == 0, r.stderr
    assert f'ignoring {var}="{value}"' in r.stderr and "expected" in r.stderr, r.stderr


def test_garbage_log_level_is_named():
    r = run(["-c", ENGINE], env={"MC_LOG_LEVEL": "verbose"})
    assert r.returncode == 0, r.stderr
    assert r.stderr.count('ignoring MC_LOG_LEVEL="verbose"') == 1, r.stderr
    assert "error, warn, info or debug" in r.stderr


# ---- scripts/test.sh's settings: refused before its first (slow) stage.  A
# copy of the script whose first stage (scripts/env.sh) only says it started.
TEST_SH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "test.sh")


def run_test_sh(tmp_path, env):
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "test.sh"
    with open(TEST_SH) as f:
        script.write_text(f.read())
    (tmp_path / "scripts" / "env.sh").write_text("echo FIRST-STAGE-STARTED\nexit 1\n")
    e = {k: v for k, v in os.environ.items() if not k.startswith("MC_")}
    return subprocess.run(["bash", str(script)], capture_output=True, text=True,
                          env={**e, **env}, timeout=60, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("value", ["x", "0", "-1", "2.5", " 2", "two"])
def test_test_sh_refuses_a_bad_worker_count_before_starting(tmp_path, value):
    r = run_test_sh(tmp_path, {"MC_PYTEST_WORKERS": value})
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "FIRST-STAGE-STARTED" not in r.stdout and "===" not in r.stdout, r.stdout
    assert (f"MC_PYTEST_WORKERS must be a whole number >= 1 (1: one process; "
            f"unset: 2 pytest-xdist workers), not '{value}'") in r.stderr, r.stderr


@pytest.mark.parametrize("env", [{}, {"MC_PYTEST_WORKERS": "1"}, {"MC_PYTEST_WORKERS": "3"},
                                 {"MC_PYTEST_WORKERS": ""}])
def test_test_sh_takes_a_good_worker_count(tmp_path, env):
    r = run_test_sh(tmp_path, env)
    assert "FIRST-STAGE-STARTED" in r.stdout and "MC_PYTEST_WORKERS" not in r.stderr, r


@pytest.mark.parametrize("value,why", [("not-an-ip", "is not a numeric IP"),
                                       ("192.0.2.77", "Cannot assign requested address")])
def test_bad_bind_address_names_the_variable(value, why):
    r = run(["-c", ENGINE], env={"MC_TCP_BIND_ADDRESS": value})
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert f'MC_TCP_BIND_ADDRESS="{value}"' in last and why in last and "unset it" in last, last


@pytest.mark.parametrize("var,value,expect", [
    ("MC_METADATA_TIMEOUT_MS", "x", "MC_METADATA_TIMEOUT_MS"),
    ("MC_METADATA_TOKEN", "a b", "MC_METADATA_TOKEN has a space"),
])
def test_metadata_env_refused(var, value, expect):
    code = ("import mooncake_connector as mc\n"
            "e = mc.TransferEngine()\n"
            "e.initialize('127.0.0.1', 'http://127.0.0.1:9/metadata', 'tcp', '')\n")
    r = run(["-c", code], env={var: value})
    assert r.returncode == 1 and expect in r.stderr.strip().splitlines()[-1], r.stderr


# ---- the Python API

@pytest.mark.parametrize("cap,exc,expect", [
    (-1, mc.ConfigError, "capacity_bytes -1 is out of range"),     # was a buffer without bound
    (1 << 64, mc.ConfigError, "out of range"),                      # was read as 0
    (0, mc.ConfigError, "must be > 0"),
    (1.5, TypeError, "must be an int"),
    (True, TypeError, "not bool"),
    ("1", TypeError, "not str"),
])
def test_lookup_buffer_capacity(cap, exc, expect):
    with pytest.raises(exc, match=expect):
        mc.LookupBuffer(cap)


def test_send_kv_negative_extent_is_named(engine):
    buf = engine.allocate_managed_buffer(1 << 16)
    kv = mc.KVTransfer(engine, mc.LookupBuffer(1 << 20))
    try:
        toks = list(range(32))
        with pytest.raises(ValueError, match=r"extents\[1\]: length -1 is out of range"):
            kv.send_kv(toks, [(buf, 4096), (buf + 4096, -1)])
        with pytest.raises(ValueError, match=r"extents\[0\]: addr -4096 is out of range"):
            kv.send_kv(toks, [(-4096, 4096), (buf, 4096)])
        assert kv.send_kv(toks, [(buf, 4096), (buf + 4096, 4096)]) == 32
    finally:
        kv.close()


def test_api_misuse_table(engine):
    """Each misuse raises an exception saying what is wrong (none crashes,
    none returns a silent -1)."""
    buf = engine.allocate_managed_buffer(1 << 16)
    seg = engine.get_segment_name()
    cases = [
        (lambda: engine.register_memory(0x1000, -5), ValueError, "non-negative"),
        (lambda: engine.register_memory(0x10, 4096), mc.ConfigError, "not mapped"),
        (lambda: engine.register_memory("abc", 4096), TypeError, "must be an int"),
        (lambda: engine.unregister_memory(0x1234), mc.TransferError, "no registered region"),
        (lambda: engine.allocate_managed_buffer(-1), ValueError, "non-negative"),
        (lambda: engine.allocate_managed_buffer(1 << 60), ValueError, "1..2\\*\\*46"),
        (lambda: engine.transfer_sync_write(seg, buf, 0x10, 100), mc.TransferError,
         "not inside any memory region registered by segment"),
        (lambda: engine.transfer_sync_write(seg, 0x10, buf, 100), mc.ConfigError,
         "register the buffer first"),
        (lambda: engine.transfer_sync_write("nonsense", buf, buf, 100), mc.ConfigError,
         "is not \"host:port\""),
        (lambda: engine.batch_transfer_sync_write(seg, [buf], [buf, buf], [10]), ValueError,
         "must have the same length"),
        (lambda: engine.get_batch_transfer_status([12345]), ValueError, "unknown batch id"),
        (lambda: engine.send_notify(seg, b"x" * (17 << 20)), mc.MooncakeError, "exceeds"),
        (lambda: engine.free_managed_buffer(0x1234, 10), ValueError,
         "not a buffer from allocate_managed_buffer"),
        (lambda: engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""), mc.MooncakeError,
         "already initialized"),
        (lambda: mc.LookupBuffer(1 << 20, block_size=0), mc.ConfigError, "block_size 0"),
        (lambda: mc.LookupBuffer(1 << 20, ttl_s=float("nan")), mc.ConfigError, "ttl_s nan"),
        (lambda: mc.hash_token_blocks([1, -2, 3] * 10), mc.ConfigError, "token id -2"),
    ]
    for f, exc, expect in cases:
        with pytest.raises(exc, match=expect):
            f()


def test_batch_id_arguments_name_the_argument_and_the_value(engine):
    """get_batch_transfer_status("abc") said "unknown batch id 'a'" (the
    str read as a list of one-character ids); transfer_check_status,
    get_batch_status and transfer_wait said "unknown batch id" naming
    nothing, and a float or bool equal to a batch id found that batch (the
    float 1.0 polled batch 1).  Each now names the argument, what it must be
    and the value; a refused call leaves the batch to a right one."""
    buf = engine.allocate_managed_buffer(1 << 16)
    seg = engine.get_segment_name()
    bid = engine.batch_transfer_async_write(seg, [buf], [buf + 4096], [64])
    must = r"must be a batch id \(the int batch_transfer_async_\* returned\)"
    cases = [
        (lambda: engine.get_batch_transfer_status("abc"), TypeError,
         r"batch_ids must be a list of batch ids .*one batch: \[batch_id\]\), not str 'abc'"),
        (lambda: engine.get_batch_transfer_status(bid), TypeError,
         rf"batch_ids must be a list of batch ids .*, not int {bid}"),
        (lambda: engine.get_batch_transfer_status(["x"]), TypeError,
         rf"batch_ids\[0\] {must}, not str 'x'"),
        (lambda: engine.transfer_check_status(float(bid)), TypeError,
         rf"batch_id {must}, not float {float(bid)}"),
        (lambda: engine.transfer_check_status(True), TypeError, rf"batch_id {must}, not bool True"),
        (lambda: engine.get_batch_status(None), TypeError, rf"batch_id {must}, not NoneType None"),
        (lambda: engine.transfer_wait("abc", 1.0), TypeError, rf"batch_id {must}, not str 'abc'"),
        (lambda: engine.transfer_check_status(-1), ValueError, r"unknown batch id -1 \("),
    ]
    for f, exc, expect in cases:
        with pytest.raises(exc, match=expect):
            f()
    assert engine.get_batch_transfer_status([bid]) == 0


def test_address_and_length_arguments_refuse_bools_and_name_the_value(engine):
    """A bool was taken as an int: register_memory(buf, True) registered 1
    byte, allocate_managed_buffer(True) gave a buffer, and
    transfer_sync_write(..., True) moved one byte; a str where a list of
    ints goes was read character by character ("lengths[i] must be an
    int"), and no error said which item or what value.  Now each names
    the argument (a list's item by its index), what it must be and the
    value."""
    buf = engine.allocate_managed_buffer(1 << 16)
    seg = engine.get_segment_name()
    cases = [
        (lambda: engine.register_memory(buf, True), TypeError,
         r"length must be an int \(.*not a bool\), not bool True"),
        (lambda: engine.allocate_managed_buffer(True), TypeError, r"length must be an int.*True"),
        (lambda: engine.transfer_sync_write(seg, buf, buf + 4096, True), TypeError,
         r"length must be an int.*not bool True"),
        (lambda: engine.batch_transfer_sync_write(seg, [buf], [buf + 4096], "abc"), TypeError,
         r"lengths must be a list of ints .*, not str 'abc'"),
        (lambda: engine.batch_transfer_sync_write(seg, [buf, "x"], [buf, buf], [1, 1]),
         TypeError, r"buffers\[1\] must be an int .*, not str 'x'"),
        (lambda: engine.batch_register_memory([buf], [-5]), ValueError,
         r"lengths\[0\] must be a non-negative 64-bit integer .*, not int -5"),
        (lambda: engine.register_memory(-1, 4096), ValueError,
         r"addr must be a non-negative 64-bit integer .*, not int -1"),
        (lambda: engine.register_memory(None, 4096), TypeError,
         r"addr must be an int .*, not NoneType None"),
    ]
    for f, exc, expect in cases:
        with pytest.raises(exc, match=expect):
            f()
    assert engine.transfer_sync_write(seg, buf, buf + 4096, 1) == 0


def test_closed_engine_and_double_close():
    e = mc.TransferEngine()
    e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    buf = e.allocate_managed_buffer(4096)
    seg = e.get_segment_name()
    kv = mc.KVTransfer(e)
    with pytest.raises(mc.MooncakeError, match="used by 1 KVTransfer object.*close them first"):
        e.close()
    kv.close()
    kv.close()
    e.close()
    e.close()
    for f in (lambda: e.transfer_sync_write(seg, buf, buf, 100),
              lambda: e.register_memory(buf, 10), lambda: e.get_segment_name(),
              lambda: mc.KVTransfer(e)):
        with pytest.raises(mc.MooncakeError, match="not initialized .* or was closed"):
            f()
    with pytest.raises(mc.MooncakeError, match="KVTransfer is closed"):
        kv.recv_kv("127.0.0.1:1", list(range(16)), [(buf, 4096)], timeout=1)


# ---- --kv-transfer-config: kv_connector_extra_config and the mooncake.json it names

@pytest.mark.parametrize("extra,msg", [
    ({"hold_timeout_s": "nan"}, "hold_timeout_s must be a finite number"),   # was accepted
    ({"load_timeout_s": float("inf")}, "load_timeout_s must be a finite number"),
    ({"lookup_timeout_s": "inf"}, "lookup_timeout_s must be a finite number"),
    ({"push_layer_timeout_s": float("nan")}, "push_layer_timeout_s must be a finite number"),
    ({"load_timeout_s": 1e7}, "load_timeout_s must be at most 86400"),
    ({"load_workers": 2.7}, "load_workers must be an integer, not 2.7"),     # was 2
    ({"load_workers": True}, "load_workers must be an integer, not True"),   # was 1
    ({"load_workers": 0}, "load_workers must be 1-64"),
    ({"load_workers": 10 ** 9}, "load_workers must be 1-64"),               # was silently 64
    ({"sync_load_max_bytes": "lots"}, "sync_load_max_bytes must be an integer"),
    ({"local_hostname": 123}, "local_hostname must be a string, not 123"),  # was "123"
    ({"bootstrap_host": {"a": 1}}, "bootstrap_host must be a string"),
    ({"kv_rank": float("nan")}, "kv_rank must be an integer, not nan"),      # was a bare ValueError
    ({"kv_rank": float("inf")}, "kv_rank must be an integer, not inf"),      # was OverflowError
    ({"kv_buffer_size": 1e30}, "kv_buffer_size must be <="),
    ({"mooncake_config_path": 5}, "path must be a non-empty string"),
    # was the environment's MOONCAKE_CONFIG_PATH instead, without a word
    ({"mooncake_config_path": ""}, "path must be a non-empty string"),
    ({"mooncake_config_path": "/dev/zero"}, "is over 1048576 bytes"),        # was read forever
    ({"flow_a": "maybe"}, "flow_a must be true or false"),
    ({"hold_timout_s": 5}, "unknown kv_connector_extra_config key(s) ['hold_timout_s']"),
    ({"hold_timout_s": 5}, "did you mean 'hold_timeout_s'?"),               # no hint before
    ({"push_layer_load_batch": 1}, "did you mean 'push_layer_load_max_batch'?"),
    ({"push_layer_read_stall_s": 0}, "push_layer_read_stall_s must be 0.01-86400"),
    ({"push_layer_read_stall_s": "nan"}, "push_layer_read_stall_s must be a finite number"),
    ({"push_layer_read": "maybe"}, "push_layer_read must be true or false"),
    # were accepted: a stall never noticed before the lease ends
    ({"push_layer_read_stall_s": 10}, "push_layer_read_stall_s=10 is not below "
                                      "push_layer_timeout_s=10"),
    ({"push_layer_read_stall_s": 30, "push_layer_timeout_s": 20},
     "set push_layer_read_stall_s below push_layer_timeout_s"),
    # were accepted as 1.0 (float(True)): a number knob given a boolean
    ({"hold_timeout_s": True}, "hold_timeout_s must be a number, not True"),
    ({"push_layer_read_stall_s": True}, "push_layer_read_stall_s must be a number, not True"),
    ({"probe_wait_ms": False}, "probe_wait_ms must be a number, not False"),
    # were an OverflowError traceback (a JSON integer past the double range)
    ({"hold_timeout_s": 10 ** 400}, "hold_timeout_s must be a finite number, not an integer "
                                    "of 401 digits"),
    ({"push_layer_read_stall_s": -10 ** 400}, "push_layer_read_stall_s must be a finite number"),
    # was accepted: the pull path's lookup buffer took ttl 0 as never (a
    # prompt held until evicted), the push path as at once
    ({"hold_timeout_s": 0}, "hold_timeout_s must be > 0 seconds, not 0.0"),
    # was a TypeError from sorting the unknown keys (a Python caller's int key)
    ({1: "x", "hold_timout_s": 5}, "unknown kv_connector_extra_config key(s) [1, 'hold_timout_s']"),
])
def test_extra_config_names_the_key(extra, msg):
    from types import SimpleNamespace

    from mooncake_connector.connector.settings import SettingsError, resolve
    with pytest.raises(SettingsError) as ei:
        resolve(SimpleNamespace(kv_role="kv_consumer", kv_connector_extra_config=extra), env={})
    assert msg in str(ei.value)


def test_mooncake_json_not_utf8_names_the_file(tmp_path):
    from types import SimpleNamespace

    from mooncake_connector.connector.settings import SettingsError, resolve
    p = tmp_path / "mooncake.json"
    p.write_bytes(b'{"prefill_url": "\xff:1"}')
    with pytest.raises(SettingsError, match=r"mooncake.json' is not UTF-8 text .*0xff"):
        resolve(SimpleNamespace(kv_role="kv_consumer", kv_connector_extra_config={}),
                env={"MOONCAKE_CONFIG_PATH": str(p)})


@pytest.mark.parametrize("text", ["[" * 100000 + "]" * 100000,
                                  '{"a":' * 100000 + "1" + "}" * 100000])
def test_mooncake_json_nested_too_deep_is_a_settings_error(tmp_path, text):
    """A mooncake.json nesting arrays or objects thousands deep was a bare
    RecursionError from json.loads in vLLM's scheduler process (the C
    parser says "nesting too deep")."""
    from types import SimpleNamespace

    from mooncake_connector.connector.settings import SettingsError, resolve
    p = tmp_path / "mooncake.json"
    p.write_text(text)
    with pytest.raises(SettingsError, match=r"mooncake.json' is not valid JSON: nesting too "
                                            r"deep"):
        resolve(SimpleNamespace(kv_role="kv_consumer", kv_connector_extra_config={}),
                env={"MOONCAKE_CONFIG_PATH": str(p)})


def test_mooncake_json_fifo_without_a_writer_does_not_hang(tmp_path):
    """MOONCAKE_CONFIG_PATH naming a FIFO nothing writes to blocked the
    scheduler's open() forever; now it reads as empty, named."""
    import subprocess
    import sys
    fifo = tmp_path / "mooncake.json"
    os.mkfifo(fifo)
    code = ("import sys, types\n"
            "from mooncake_connector.connector.settings import SettingsError, resolve\n"
            "try:\n"
            "    resolve(types.SimpleNamespace(kv_role='kv_consumer', "
            "kv_connector_extra_config={}), env={'MOONCAKE_CONFIG_PATH': sys.argv[1]})\n"
            "except SettingsError as e:\n"
            "    print(e)\n")
    r = subprocess.run([sys.executable, "-P", "-c", code, str(fifo)], capture_output=True,
                       text=True, timeout=30, cwd=str(tmp_path))
    assert "is not valid JSON" in r.stdout and str(fifo) in r.stdout, (r.stdout, r.stderr)


def test_mooncake_json_with_a_utf8_bom_is_read_as_the_c_parser_reads_it(tmp_path):
    """A mooncake.json saved with a UTF-8 byte order mark (Windows editors
    write one): the workers' C parser and `mooncake-connector config` take
    it, but the scheduler process refused it ("Unexpected UTF-8 BOM"), so
    vLLM did not start on a file the checker called valid."""
    from types import SimpleNamespace

    from mooncake_connector.connector.settings import resolve
    p = tmp_path / "mooncake.json"
    p.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prefill_url": "127.0.0.1:13003",
                                                "decode_url": "127.0.0.1:13103",
                                                "metadata_server": "P2PHANDSHAKE"}).encode())
    assert mc.load_config(str(p))["decode_port"] == 13103
    s = resolve(SimpleNamespace(kv_role="kv_consumer", kv_connector_extra_config={}),
                env={"MOONCAKE_CONFIG_PATH": str(p)})
    assert s.mooncake["decode_url"] == "127.0.0.1:13103"


def _both_refuse(p, role="kv_consumer", match=None):
    """The workers' C parser (mc.parse_config) and the connector's settings
    reader (resolve, MOONCAKE_CONFIG_PATH=p) both refuse the mooncake.json
    at p, with one message, returned."""
    from types import SimpleNamespace

    from mooncake_connector.connector.settings import SettingsError, resolve
    with pytest.raises(mc.ConfigError) as c_err:
        mc.parse_config(p.read_text(), str(p))
    with pytest.raises(SettingsError, match=match) as py_err:
        resolve(SimpleNamespace(kv_role=role, kv_connector_extra_config={}),
                env={"MOONCAKE_CONFIG_PATH": str(p)})
    assert str(py_err.value) == str(c_err.value)
    return str(py_err.value)


MISSPELT = ["metadata_sever", "prefil_url", "decode-url", "protcol", "device", "kv_role",
            "local_hostname", "x" * 100, "a\x01b", "same_host_cpu_path", "kv_connector"]


@pytest.mark.parametrize("key", MISSPELT)
def test_mooncake_json_unknown_field_as_the_c_parser_says(tmp_path, key):
    """The connector's settings reader (the scheduler process; no extension)
    took mooncake.json's keys as they came: "metadata_sever" was silently
    ignored there (the workers' C parser refused it later).  It now refuses
    it with the C parser's message, word for word: the field, the near miss
    (within two edits), vLLM's and Mooncake Store's keys named as such."""
    p = tmp_path / "mooncake.json"
    p.write_text(GOOD.replace("}", ", " + json.dumps(key) + ': "v"}'))
    msg = _both_refuse(p)
    assert "unknown field" in msg
    if key == "metadata_sever":
        assert 'did you mean "metadata_server"?' in msg


def _knob_keys():
    from mooncake_connector.connector.settings import KNOBS, STORE_KEYS
    return [k for k in ("mooncake_config_path", *KNOBS) if k not in STORE_KEYS]


@pytest.mark.parametrize("key", _knob_keys())
def test_a_connector_setting_in_mooncake_json_is_pointed_to_the_extra_config(tmp_path, key):
    """A connector setting (hold_timeout_s, push_layer_read, ...) put in
    mooncake.json: refused as before, and now the message says where it
    belongs (kv_connector_extra_config), by both parsers, word for word;
    before, "unknown field; accepted: prefill_url, ..." and no pointer (a
    near miss of none of mooncake.json's fields).  Also keeps the C
    parser's list of these keys in step with settings.KNOBS."""
    p = tmp_path / "mooncake.json"
    p.write_text(GOOD.replace("}", ", " + json.dumps(key) + ": 1}"))
    msg = _both_refuse(p)
    assert f'field "{key}": unknown field (a connector setting: it belongs in ' \
           "kv_connector_extra_config of vLLM's --kv-transfer-config, not mooncake.json)" in msg


def test_mooncake_json_field_twice_as_the_c_parser_says(tmp_path):
    """json.loads kept the last of two "protocol" fields; the C parser
    refuses the file: both refuse it now, with one message."""
    p = tmp_path / "mooncake.json"
    p.write_text(GOOD.replace("{", '{"protocol": "rdma", "protocol": "tcp", '))
    _both_refuse(p, match="appears more than once")


WRONG_TYPES = [  # (id, fields: each replaces GOOD's own or comes after them)
    ("url number", '"prefill_url": 13003'),
    ("protocol number", '"protocol": 5'),
    ("protocol bool", '"protocol": true'),
    ("meta array", '"metadata_server": ["x"]'),
    ("url null", '"decode_url": null'),
    ("backend object", '"metadata_backend": {"a": 1, "a": [1.5, "x\\n\\"q\\u00e9"]}'),
    ("device float", '"device_name": 0.30000000000000004'),
    ("device 17 digits", '"device_name": 123456789012345.67'),
    ("device big int", '"device_name": 12345678901234567890'),
    ("device inf", '"device_name": 1e400'),
    ("device exponent", '"device_name": 1e300'),
    ("secret number", '"auth_secret": 12345'),
    ("bool string", '"same_host_cpu": "yes"'),
    ("bool number", '"same_host_cpu": 1'),
    ("bool null", '"same_host_cpu": null'),
    ("long array", '"protocol": [' + ", ".join(['"\u00e9\u00e9"'] * 40) + "]"),
    ("message cut", '"same_host_cpu": ["' + "\u20ac" * 100 + '"]'),  # at 511 bytes
    ("message cut in a character", '"protocol": ["' + "\U0001f600" * 90 + '"]'),
    ("long string", '"metadata_server": "' + "m\u00e9" * 600 + '"'),
    ("long secret", '"auth_secret": "' + "s" * 1024 + '"'),
    ("type before unknown", '"protocol": 5, "protcol": "tcp"'),
    ("unknown before type", '"protcol": "tcp", "protocol": 5'),
]


def with_fields(fields):
    """GOOD with fields (JSON text "key": value, ...) in place of its own."""
    good = json.loads(GOOD)
    given = json.loads("{" + fields + "}", object_pairs_hook=list)
    for key, _ in given:
        good.pop(key, None)
    return json.dumps(good)[:-1] + ", " + fields + "}"


@pytest.mark.parametrize("dirs", [("\u00e9" * 70, "\u00e9" * 70), ("\x01" * 100,)],
                         ids=["long path", "control bytes in path"])  # C keeps the tail
@pytest.mark.parametrize("fields", [c[1] for c in WRONG_TYPES], ids=[c[0] for c in WRONG_TYPES])
def test_mooncake_json_wrong_value_type_as_the_c_parser_says(tmp_path, fields, dirs):
    """The settings reader (scheduler process) took mooncake.json's values
    as they came: "prefill_url": 13003 went on to "13003 is not host:port"
    (engine_name), "protocol": 5 or a 2000-byte metadata_server to the
    workers' C parser only.  It now refuses a value of the wrong JSON type
    (or too long for the C parser) with the C parser's message, word for
    word: the field, the value as cJSON prints it, its type, what is
    expected and accepted; never the secret."""
    p = tmp_path.joinpath(*dirs, "mooncake.json")
    p.parent.mkdir(parents=True)
    p.write_text(with_fields(fields))
    msg = _both_refuse(p, role="kv_producer")
    if "auth_secret" in fields:
        assert "12345" not in msg and "s" * 20 not in msg


@pytest.mark.parametrize("number", ["1e400", "-1e400", "1" + "0" * 400])
@pytest.mark.parametrize("key", ["device_name", "same_host_cpu", "protocol"])
def test_a_number_out_of_range_is_named_not_shown_as_null(tmp_path, number, key):
    """A number past the double range (cJSON prints it as null) is shown as
    such by both readers; before: 'value null is a number', a value the
    file does not hold."""
    p = tmp_path / "mooncake.json"
    p.write_text(with_fields(f'"{key}": {number}'))
    msg = _both_refuse(p)
    assert f'field "{key}": value <a number out of range> is a number; expected' in msg, msg
    assert "null" not in msg


@pytest.mark.parametrize("path", [False, True])
@pytest.mark.parametrize("extra", [{"prefill_url": 13003}, {"protocol": ["tcp"]},
                                   {"same_host_cpu": "false"}, {"metadata_server": "h" * 1024}])
def test_extra_config_mooncake_field_wrong_type_as_the_worker_says(tmp_path, extra, path):
    """mooncake.json's fields given in kv_connector_extra_config reach the
    worker's C parser as json.dumps of the merged fields (lifecycle); the
    settings reader refuses a wrong type there too, with that message."""
    from types import SimpleNamespace

    from mooncake_connector.connector.settings import SettingsError, resolve
    env, origin, merged = {}, "kv_connector_extra_config", dict(extra)
    if path:
        p = tmp_path / "mooncake.json"
        p.write_text(GOOD)
        env, origin = {"MOONCAKE_CONFIG_PATH": str(p)}, str(p)
        merged = {**json.loads(GOOD), **extra}
    with pytest.raises(mc.ConfigError) as c_err:
        mc.parse_config(json.dumps(merged), origin)
    with pytest.raises(SettingsError) as py_err:
        resolve(SimpleNamespace(kv_role="kv_producer", kv_connector_extra_config=dict(extra)),
                env=env)
    assert str(py_err.value) == str(c_err.value)


def test_mooncake_json_every_accepted_field_still_reads(tmp_path):
    from types import SimpleNamespace

    from mooncake_connector.connector.settings import C_FIELDS, MOONCAKE_FIELDS, resolve
    assert set(C_FIELDS) == set(MOONCAKE_FIELDS)
    p = tmp_path / "mooncake.json"
    p.write_text(json.dumps({"prefill_url": "127.0.0.1:13003", "decode_url": "127.0.0.1:13103",
                             "metadata_server": "P2PHANDSHAKE", "metadata_backend": "http",
                             "protocol": "tcp", "device_name": "", "auth_secret": "s" * 20,
                             "same_host_cpu": False}))
    mc.parse_config(p.read_text(), str(p))
    s = resolve(SimpleNamespace(kv_role="kv_consumer", kv_connector_extra_config={}),
                env={"MOONCAKE_CONFIG_PATH": str(p)})
    assert set(s.mooncake) == set(C_FIELDS)


# ---- per-request kv_transfer_params switches (a client at the server directly)

@pytest.mark.parametrize("bad", ["true", "yes", 1, 0, [True], {"on": True}, 1.5])
def test_request_switch_of_another_type_is_said_not_taken_silently(caplog, bad):
    """kv_transfer_params "push_layer_read" / "push_layer_load" (decode leg)
    and "push_layerwise" / "push_layer_watch" (prefill leg) other than a JSON
    boolean: the server's own setting, as before, but said in one WARNING per
    key naming the value and the fix (was silent: "push_layer_read": "true"
    read nothing and nobody was told)."""
    import logging
    import types

    from mooncake_connector.connector import scheduler as sched_mod
    from mooncake_connector.connector import settings as settings_mod
    from mooncake_connector.connector.scheduler import SchedulerSide
    getattr(sched_mod, "_BAD_FLAGS", set()).clear()
    cfg = types.SimpleNamespace(kv_role="kv_consumer", kv_connector_extra_config={
        "prefill_url": "127.0.0.1:13003", "decode_url": "127.0.0.1:13103", "flow_a": False,
        "push_layer_read": True})
    sch = SchedulerSide(settings_mod.resolve(cfg, env={}), 32, 1, lambda: None,
                        block_bytes=32768)
    with caplog.at_level(logging.WARNING, logger="vllm.mooncake_connector"):
        assert sch._layer_read({"push_layer_read": bad}) is True   # the server's setting
        assert sch._layer_read({"push_layer_read": bad}) is True
        assert sch._layer_read({"push_layer_read": False}) is False
        assert sch._layer_read({"push_layer_read": None}) is True
        said = [r.getMessage() for r in caplog.records if "not true or false" in r.getMessage()]
        assert len(said) == 1, said  # said, once
        for key in ("push_layer_load", "push_layerwise", "push_layer_watch"):
            assert sched_mod._flag({key: bad}, key) is None
            assert sched_mod._flag({key: True}, key) is True
    said = [r.getMessage() for r in caplog.records if "not true or false" in r.getMessage()]
    assert len(said) == 4, said  # once per key
    assert f"'push_layer_read' is {bad!r}"[:60] in said[0] and "send a JSON boolean" in said[0]


# ---- the plugin's choice of a bare "MooncakeConnector"

@pytest.mark.parametrize("typo", ["push_layer_rad", "hold_timout_s", "push-layer-load",
                                  "Push_layer_read", "kv_rnak", "mooncake_config"])
@pytest.mark.parametrize("env", [{}, {"MOONCAKE_CONFIG_PATH": "/x/mooncake.json"}])
def test_a_typo_of_our_key_chooses_ours_so_its_start_names_it(typo, env):
    """kv_connector_extra_config with only a misspelt key of ours: the
    plugin took it for the in-tree connector's configuration ("only keys
    this package does not know") and vLLM's class was used in ours' place.
    Now ours is chosen, and resolve() refuses the key with its near miss.
    The in-tree connector's own keys still choose vLLM's class."""
    from types import SimpleNamespace

    from mooncake_connector.connector.plugin import choose
    from mooncake_connector.connector.settings import SettingsError, resolve
    ours, why = choose({typo: True}, env=env)
    assert ours, why
    assert "near misses" in why and typo in why
    with pytest.raises(SettingsError, match="did you mean"):
        resolve(SimpleNamespace(kv_role="kv_consumer", kv_connector_extra_config={typo: True}),
                env={})
    for intree in ("mooncake_protocol", "num_workers", "bootstrap_server_address",
                   "enable_lookup", "store_tp_size", "preferred_segment", "load_async"):
        assert not choose({intree: 1}, env=env)[0], intree
