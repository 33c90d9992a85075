"""SGLang's Mooncake transfer-engine wrapper (``MooncakeTransferEngine`` in
``sglang/srt/distributed/device_communicators/mooncake_transfer_engine.py``,
SGLang 0.5.23; older SGLang had it at
``sglang/srt/disaggregation/mooncake/transfer_engine.py``) on our engine:
SGLang's real code, unmodified, imported without a GPU, its
``from mooncake.engine import TransferEngine`` served by our package
(MC_MOONCAKE_SHIM=1).  SGLang is pip-installed ``--no-deps --target`` a cache
dir, never into the venv (tests/sglang_pkg.py); offline the test skips with
the reason.  docs/compat.md."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mooncake_shim_env import no_real_mooncake, shim_env  # noqa: E402
from sglang_pkg import MODULE, find_site  # noqa: E402

# Two SGLang engines in one process (P2PHANDSHAKE, as SGLang runs them),
# every method of the wrapper, bytes checked.
EXERCISE = r"""
import os, numpy as np
from {module} import MooncakeTransferEngine
import mooncake.engine
assert mooncake.engine.TransferEngine.__module__ == "mooncake_connector.compat"
a = MooncakeTransferEngine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
b = MooncakeTransferEngine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
assert a.get_session_id() == "127.0.0.1:%d" % a.engine.get_rpc_port()
src = np.frombuffer(np.random.default_rng(1).bytes(1 << 20), dtype=np.uint8).copy()
dst = np.zeros(1 << 20, dtype=np.uint8)
a.register(src.ctypes.data, src.nbytes)
b.register(dst.ctypes.data, dst.nbytes)
assert a.transfer_sync(b.get_session_id(), src.ctypes.data, dst.ctypes.data, 1 << 20) == 0
assert bytes(dst) == bytes(src)
dst[:] = 0
extra = np.zeros(1 << 16, dtype=np.uint8)
assert b.batch_register([extra.ctypes.data], [extra.nbytes]) == 0
offs, lens = [0, 8192, 65536, 1 << 19], [1000, 2000, 3000, 4000]
assert a.batch_transfer_sync(b.get_session_id(), [src.ctypes.data + o for o in offs],
                             [dst.ctypes.data + o for o in offs], lens) == 0
assert a.batch_transfer_sync(b.get_session_id(), [src.ctypes.data], [extra.ctypes.data],
                             [4096]) == 0
for o, n in zip(offs, lens):
    assert bytes(dst[o:o + n]) == bytes(src[o:o + n])
assert bytes(dst[1000:8192]) == bytes(7192) and bytes(extra[:4096]) == bytes(src[:4096])
assert a.send_probe(b.get_session_id()) == 0
assert a.send_probe("127.0.0.1:1") != 0
assert a.transfer_sync("127.0.0.1:1", src.ctypes.data, dst.ctypes.data, 8) < 0
assert b.batch_deregister([extra.ctypes.data]) == 0
assert a.batch_transfer_sync(b.get_session_id(), [src.ctypes.data], [extra.ctypes.data],
                             [8]) < 0   # no longer registered there
assert a.get_engine() is a.engine
b.deregister(dst.ctypes.data)
# SGLang's own switch instead of MC_FORCE_TCP: MOONCAKE_PROTOCOL=tcp.
os.environ.pop("MC_FORCE_TCP")
os.environ["MOONCAKE_PROTOCOL"] = "tcp"
c = MooncakeTransferEngine(hostname="127.0.0.1", gpu_id=0, ib_device="")
c.register(dst.ctypes.data, dst.nbytes)
assert a.transfer_sync(c.get_session_id(), src.ctypes.data, dst.ctypes.data, 4096) == 0
assert bytes(dst[:4096]) == bytes(src[:4096])
c.deregister(dst.ctypes.data)
a.deregister(src.ctypes.data)
assert a.transfer_sync(c.get_session_id(), src.ctypes.data, dst.ctypes.data, 8) < 0
# Neither: SGLang's default protocol "rdma" means RDMA; on a host without an
# RDMA NIC initialize fails (-1) and the wrapper raises.
if not os.path.isdir("/sys/class/infiniband"):
    del os.environ["MOONCAKE_PROTOCOL"]
    try:
        MooncakeTransferEngine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
        raise SystemExit("rdma without an RDMA NIC was accepted")
    except RuntimeError as e:
        assert "initialization failed" in str(e), e
print("SGLANG-OK")
"""


def test_sglang_mooncake_transfer_engine_on_ours(tmp_path):
    no_real_mooncake()
    site, why = find_site()
    if not site:
        pytest.skip(why)
    env = shim_env(tmp_path, MC_FORCE_TCP="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), site) if p)
    r = subprocess.run([sys.executable, "-c", EXERCISE.format(module=MODULE)], cwd=str(tmp_path),
                       env=env, capture_output=True, text=True, timeout=180)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "SGLANG-OK" in r.stdout, out
    assert out.count("mooncake.engine is provided by mooncake_connector") == 1, out
    assert "MC_FORCE_TCP=1: protocol 'rdma' replaced by \"tcp\"" not in out  # INFO, not shown
    assert 'protocol "rdma": no RDMA device on this host' in out or \
        os.path.isdir("/sys/class/infiniband"), out
