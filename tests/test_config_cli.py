import json
import subprocess
import sys

import pytest


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


def test_printed_config_hides_the_secrets(tmp_path):
    """auth_secret and a Redis metadata URL's password are not printed (the
    password was, in metadata_server and metadata_server_raw)."""
    p = tmp_path / "mooncake.json"
    p.write_text(json.dumps({"prefill_url": "127.0.0.1:13003", "decode_url": "127.0.0.1:13103",
                             "metadata_server": "redis://:hunter2pw@127.0.0.1:6379/0",
                             "auth_secret": "a-secret-of-sixteen-bytes"}))
    r = run(str(p))
    assert r.returncode == 0, r.stderr
    assert "hunter2pw" not in r.stdout + r.stderr and "a-secret" not in r.stdout + r.stderr
    cfg = json.loads(r.stdout)
    assert cfg["metadata_server"] == cfg["metadata_server_raw"] == \
        "redis://:***@127.0.0.1:6379/0", cfg
    assert cfg["metadata_backend"] == "redis"


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


# ---- --kv-transfer-config: vLLM's flag checked as a server's start would take it

SEED_C = ('{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer","kv_rank":1,'
          '"kv_parallel_size":2,"kv_buffer_size":2e9}')  # the seed's decode, verbatim


def _mooncake_json(tmp_path, **over):
    import os
    p = tmp_path / "mooncake.json"
    p.write_text(json.dumps({"prefill_url": "127.0.0.1:13003", "decode_url": "127.0.0.1:13103",
                             "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
                             "device_name": "", **over}))
    env = {k: v for k, v in os.environ.items() if k != "MOONCAKE_CONFIG_PATH"}
    return p, env


def test_kv_transfer_config_of_the_seed_yields_the_connectors_settings(tmp_path):
    p, env = _mooncake_json(tmp_path, auth_secret="a-secret-of-sixteen-bytes")
    r = run("--kv-transfer-config", SEED_C, str(p), env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["role"] == "kv_consumer" and out["kv_rank"] == 1 and out["kv_parallel_size"] == 2
    assert out["kv_buffer_size"] == 2_000_000_000 and out["engine"] == "127.0.0.1:13103"
    assert out["config_path"] == str(p) and out["load_failure_policy"] == "recompute"
    assert "a-secret" not in r.stdout and out["mooncake"]["auth_secret"] == "(set, not shown)"
    assert "resolves to this package's connector" in r.stderr
    assert "moved into kv_connector_extra_config" in r.stderr
    # The same through MOONCAKE_CONFIG_PATH, as the seed's command sets it,
    # and with = between the option and its value
    r2 = run(f"--kv-transfer-config={SEED_C}", env=dict(env, MOONCAKE_CONFIG_PATH=str(p)))
    assert r2.returncode == 0 and json.loads(r2.stdout) == out, r2.stderr


@pytest.mark.parametrize("ktc, path, msg", [
    # what the server's start says, seconds after the model loaded
    ('{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer",'
     '"kv_connector_extra_config":{"push_layer_load_async":true}}', True,
     "push_layer_load_async is true but load_failure_policy is 'recompute'"),
    ('{"kv_connector":"MooncakeConnector","kv_role":"kv_producer",'
     '"kv_connector_extra_config":{"hold_timout_s":3}}', True,
     "'hold_timout_s': did you mean 'hold_timeout_s'?"),
    ('{"kv_connector":"MooncakeConnector","kv_role":"kv_prod","kv_rank":0}', True,
     "kv_role is 'kv_prod'"),
    ('{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer","kv_rank":2,'
     '"kv_parallel_size":2}', True, "kv_rank 2 must be below kv_parallel_size 2"),
    ('{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer",'
     '"kv_connector_extra_config":{"load_timeout_s":0}}', True, "load_timeout_s must be > 0"),
    # no mooncake.json: no address for the engine (the seed's fields make it ours)
    (SEED_C, False, "no engine address: set decode_url in mooncake.json"),
    # the plugin's choice: the in-tree connector's shape keeps vLLM's class
    ('{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer",'
     '"kv_connector_extra_config":{"mooncake_protocol":"tcp"}}', True,
     "resolves to vLLM's in-tree connector here"),
    ('{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer"}', False,
     "set MOONCAKE_CONFIG_PATH (or give PATH), or add \"kv_connector_module_path\""),
    ('{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}', True,
     "kv_connector is 'NixlConnector'"),
    ('{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer",'
     '"kv_connector_module_path":"vllm.distributed"}', True,
     "kv_connector_module_path is 'vllm.distributed'"),
    ('{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer",'
     '"kv_connector_module_path":""}', True, "kv_connector_module_path is empty"),
    ('{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer",'
     '"kv_connector_extra_config":[1]}', True, "kv_connector_extra_config is a JSON list"),
    ("{kv_connector: 1}", True, "--kv-transfer-config is not valid JSON: Expecting property"),
    ("[]", True, "--kv-transfer-config is a JSON list, not an object"),
    ("", True, "--kv-transfer-config is not valid JSON"),
    ("[" * 100_000, True, "nests JSON arrays or objects too deeply"),
    ('{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer",'
     '"kv_connector_extra_config":{"hold_timeout_s":NaN}}', True,
     "hold_timeout_s must be a finite number, not nan"),
    ('{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer",'
     '"kv_connector_extra_config":{"mooncake_config_path":"/dev/zero"}}', False,
     "is over 1048576 bytes; refused"),
    # mooncake.json's fields given in the extra config: the workers' C parser
    # reads them with the file's (was: exit 0, the start refused them)
    ('{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer",'
     '"kv_connector_extra_config":{"protocol":"udp"}}', True,
     'field "protocol": value "udp" is not a supported protocol'),
    ('{"kv_connector":"MooncakeConnector","kv_role":"kv_producer",'
     '"kv_connector_extra_config":{"prefill_url":"127.0.0.1:13003"}}', False,
     'kv_connector_extra_config: field "decode_url": is missing (required)'),
    # a value nested deeper than Python's stack renders (was: RecursionError)
    ('{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer","kv_connector_extra_config":'
     '{"protocol":' + "[" * 600 + "]" * 600 + "}}", True,
     'field "protocol": value ' + "[" * 80 + "... is an array; expected a string"),
    # the engine's name through the engine's own address parser
    ('{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer",'
     '"kv_connector_extra_config":{"local_hostname":"bad host:13200"}}', True,
     'field "local_hostname": value "bad host:13200" is not a valid address'),
    # bootstrap_host's form (was: exit 0; the start refused it)
    ('{"kv_connector":"MooncakeConnector","kv_role":"kv_producer",'
     '"kv_connector_extra_config":{"bootstrap_host":"[::1]:8998"}}', True,
     "kv_connector_extra_config.bootstrap_host '[::1]:8998': it has a port"),
    ('{"kv_connector":"MooncakeConnector","kv_role":"kv_producer",'
     '"kv_connector_extra_config":{"bootstrap_host":"[::1"}}', True,
     "kv_connector_extra_config.bootstrap_host '[::1': unbalanced brackets"),
    # what vLLM's own KVTransferConfig refuses (was: exit 0)
    ('{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer","push_layer_load":true}', True,
     "'push_layer_load' is a setting of this package's connector, not a field of vLLM's"),
    ('{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer","kv_rank":1,'
     '"kv_conector_extra_config":{"push_layer_load":true}}', True,
     "did you mean 'kv_connector_extra_config'?"),
    ('{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer","kv_rank":1,'
     '"kv_load_failure_policy":"retry"}', True,
     "kv_load_failure_policy is 'retry': vLLM takes 'recompute' or 'fail'"),
])
def test_kv_transfer_config_mistakes_are_named(tmp_path, ktc, path, msg):
    p, env = _mooncake_json(tmp_path)
    r = run("--kv-transfer-config", ktc, *([str(p)] if path else []), env=env)
    assert r.returncode == 2 and msg in r.stderr, r.stderr
    assert r.stdout == "" and "Traceback" not in r.stderr


def test_kv_transfer_config_checks_the_mooncake_json_too(tmp_path):
    """The file through the workers' parser and the settings reader: a bad
    field is the same error `config PATH` gives; the one named in the extra
    config (mooncake_config_path) is the one read."""
    p, env = _mooncake_json(tmp_path, protocol="udp")
    r = run("--kv-transfer-config", SEED_C, str(p), env=env)
    assert r.returncode == 2 and "protocol" in r.stderr and "udp" in r.stderr, r.stderr
    (tmp_path / "good").mkdir()
    good, _ = _mooncake_json(tmp_path / "good", protocol="tcp")
    ktc = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_producer",
                      "kv_connector_extra_config": {"mooncake_config_path": str(good)}})
    r = run("--kv-transfer-config", ktc, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["engine"] == "127.0.0.1:13003"
    # a PATH beside it is not what the server reads: said (was silent)
    r = run("--kv-transfer-config", ktc, str(p), env=env)
    assert r.returncode == 0 and f"PATH {p} is not read" in r.stderr, r.stderr
    ktc = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_producer",
                      "kv_connector_extra_config": {"mooncake_config_path": str(p)}})
    r = run("--kv-transfer-config", ktc, env=env)
    assert r.returncode == 2 and "udp" in r.stderr, r.stderr


def test_kv_transfer_config_roles_and_vllms_own_policy(tmp_path):
    """push_layer_load_async binds the roles that load KV only; vLLM's own
    kv_load_failure_policy is replaced by the connector's (said)."""
    p, env = _mooncake_json(tmp_path)
    extra = {"push_layer_load_async": True}
    for role, code in (("kv_producer", 0), ("kv_consumer", 2), ("kv_both", 2)):
        ktc = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role,
                          "kv_connector_extra_config": extra})
        assert run("--kv-transfer-config", ktc, str(p), env=env).returncode == code, role
    ktc = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer",
                      "kv_load_failure_policy": "fail",
                      "kv_connector_extra_config": dict(extra, load_failure_policy="fail")})
    r = run("--kv-transfer-config", ktc, str(p), env=env)
    assert r.returncode == 0 and json.loads(r.stdout)["push_layer_load_async"] is True, r.stderr
    ktc = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer",
                      "kv_load_failure_policy": "fail", "kv_connector_extra_config": {}})
    r = run("--kv-transfer-config", ktc, str(p), env=env)
    assert r.returncode == 0 and "kv_load_failure_policy 'fail' (vLLM's) is replaced by the " \
        "connector's load_failure_policy 'recompute'" in r.stderr, r.stderr


def test_an_unreadable_mooncake_config_path_names_where_it_came_from(tmp_path):
    """The fix names the setting the path came from: the extra config's
    mooncake_config_path, or MOONCAKE_CONFIG_PATH (the message named the
    variable either way)."""
    import os
    env = {k: v for k, v in os.environ.items() if k != "MOONCAKE_CONFIG_PATH"}
    gone = str(tmp_path / "nope.json")
    ktc = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer",
                      "kv_connector_extra_config": {"mooncake_config_path": gone}})
    r = run("--kv-transfer-config", ktc, env=env)
    assert r.returncode == 2 and "cannot be read" in r.stderr, r.stderr
    assert "set kv_connector_extra_config.mooncake_config_path to a readable" in r.stderr
    ktc = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer",
                      "kv_rank": 1})
    r = run("--kv-transfer-config", ktc, env=dict(env, MOONCAKE_CONFIG_PATH=gone))
    assert r.returncode == 2 and "set MOONCAKE_CONFIG_PATH to a readable" in r.stderr, r.stderr


def test_kv_transfer_config_usage_errors(tmp_path):
    p, env = _mooncake_json(tmp_path)
    r = run("--kv-transfer-config", env=env)
    assert r.returncode == 2 and "--kv-transfer-config needs a value" in r.stderr
    r = run("--kv-transfer-config", SEED_C, "--kv-transfer-config", SEED_C, env=env)
    assert r.returncode == 2 and "given twice" in r.stderr
    r = run("--kv-transfer-config", SEED_C, str(p), str(p), env=env)
    assert r.returncode == 2 and "one PATH only, got 2" in r.stderr


@pytest.mark.parametrize("role, name", [("kv_consumer", "[::1]:13103"),
                                         ("kv_producer", "[::1]:13003")])
def test_kv_transfer_config_ipv6_engine_names_keep_their_brackets(tmp_path, role, name):
    """IPv6 prefill_url / decode_url: the engine's name as the start makes
    it, brackets kept (was: exit 2, '::1:13103', which the engine refuses:
    the start wrote the C parser's bare host before the port)."""
    p, env = _mooncake_json(tmp_path)
    ktc = ('{"kv_connector":"MooncakeConnector","kv_role":"%s","kv_connector_extra_config":'
           '{"prefill_url":"[::1]:13003","decode_url":"[::1]:13103"}}' % role)
    r = run("--kv-transfer-config", ktc, str(p), env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["engine"] == name


def test_kv_transfer_config_engine_and_secrets_as_the_start_has_them(tmp_path):
    """The engine name after the C parser's port rule (decode_url equal to
    prefill_url: decode port + 100; was: the unmoved port), the seed's field
    given twice named, the metadata server's password masked (the
    auth_secret already was)."""
    p, env = _mooncake_json(tmp_path, decode_url="127.0.0.1:13003",
                            metadata_server="redis://:hunter2pw@127.0.0.1:6379",
                            auth_secret="a-secret-of-sixteen-bytes")
    ktc = ('{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer","kv_rank":1,'
           '"kv_parallel_size":4,"kv_connector_extra_config":{"kv_rank":3}}')
    r = run("--kv-transfer-config", ktc, str(p), env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["engine"] == "127.0.0.1:13103" and out["kv_rank"] == 3, out
    assert "kv_rank is given twice: 1 at the top level is ignored, " \
        "kv_connector_extra_config's 3 is used" in r.stderr, r.stderr
    assert "hunter2pw" not in r.stdout + r.stderr and "a-secret" not in r.stdout + r.stderr
    assert out["mooncake"]["metadata_server"] == "redis://:***@127.0.0.1:6379"


def test_connector_settings_log_line_hides_the_secrets(tmp_path):
    """The "effective config" line the connector logs at start
    (Settings.summary) carried auth_secret and the Redis password."""
    from types import SimpleNamespace

    from mooncake_connector.connector.settings import resolve
    p, _ = _mooncake_json(tmp_path, metadata_server="redis://:hunter2pw@127.0.0.1:6379",
                          auth_secret="a-secret-of-sixteen-bytes")
    s = resolve(SimpleNamespace(kv_role="kv_producer",
                                kv_connector_extra_config={"mooncake_config_path": str(p)}))
    line = s.summary()
    assert "hunter2pw" not in line and "a-secret" not in line, line
    assert json.loads(line)["mooncake"]["auth_secret"] == "(set, not shown)"
    # the engine still gets them
    assert s.mooncake["auth_secret"] == "a-secret-of-sixteen-bytes"
    assert s.mooncake["metadata_server"] == "redis://:hunter2pw@127.0.0.1:6379"


def test_kv_transfer_config_empty_path_is_a_usage_error(tmp_path):
    _, env = _mooncake_json(tmp_path)
    r = run("--kv-transfer-config", SEED_C, "", env=env)
    assert r.returncode == 2 and "PATH is empty" in r.stderr and r.stdout == "", r.stderr


def test_kv_transfer_config_mooncake_json_nested_as_the_c_parser_takes_it(tmp_path):
    """The settings reader refuses a file nested past the C parser's 64
    levels as that parser does (was: accepted to 63 levels inside a value
    too, and a value some 600 deep a RecursionError traceback)."""
    _, env = _mooncake_json(tmp_path)
    for depth, msg in ((63, 'field "protocol": value [[[['), (64, "nesting too deep"),
                       (600, "nesting too deep")):
        p = tmp_path / f"deep{depth}.json"
        p.write_text('{"prefill_url": "127.0.0.1:13003", "decode_url": "127.0.0.1:13103", '
                     '"metadata_server": "P2PHANDSHAKE", "protocol": '
                     + "[" * depth + "]" * depth + "}")
        for args in (("--kv-transfer-config", SEED_C, str(p)), (str(p),)):
            r = run(*args, env=env)
            assert r.returncode == 2 and msg in r.stderr, (depth, args, r.stderr)
            assert "Traceback" not in r.stderr and r.stdout == ""


VLLM_JUDGES = r"""
import json, sys
from mooncake_connector.config import CheckError, check_kv_transfer_config
out = []
for ktc in json.loads(sys.argv[1]):
    try:
        out.append(check_kv_transfer_config(ktc, sys.argv[2])[0]["kv_buffer_size"])
    except CheckError as e:
        out.append("error: " + str(e))
print("RESULT " + json.dumps(out))
"""


def test_kv_transfer_config_what_only_vllm_judges(tmp_path):
    """vLLM's own code, imported only for such a flag (one process here:
    the import is the slow part): a bare 2G, which vLLM expands, is 2 GiB
    (was "not valid JSON"); a value of one of vLLM's own fields this
    connector does not use (kv_port "x") is vLLM's refusal (was: never
    judged, vLLM refused the flag), a port as a string ("123") its lax
    acceptance."""
    pytest.importorskip("vllm")
    import os
    p, env = _mooncake_json(tmp_path)
    base = '{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer","kv_rank":1,'
    cases = [base + '"kv_buffer_size":2G}', base + '"kv_port":"x"}', base + '"kv_port":"123"}']
    r = subprocess.run([sys.executable, "-c", VLLM_JUDGES, json.dumps(cases), str(p)],
                       capture_output=True, text=True, env=env, cwd=os.path.dirname(p))
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    hr, port, lax = json.loads(line[-1][len("RESULT "):])
    assert hr == 2 << 30, hr
    assert port.startswith("error: vLLM refuses --kv-transfer-config: kv_port: "), port
    assert lax == 2_000_000_000, lax
