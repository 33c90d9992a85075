"""`from mooncake.engine import TransferEngine` served by our package when no
Mooncake is installed (opt-in: MC_MOONCAKE_SHIM=1 / mooncake_shim.install()),
never shadowing a real Mooncake."""
import os
import subprocess
import sys

import pytest

WT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRANSFER = r"""
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
{setup}
from mooncake.engine import TransferEngine, TransferOpcode
import mooncake.engine as me
a, b = TransferEngine(), TransferEngine()
assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
src, dst = a.allocate_managed_buffer(4096), b.allocate_managed_buffer(4096)
a.write_bytes_to_buffer(src, b"moon" * 1024)
seg = "127.0.0.1:%d" % b.get_rpc_port()
assert a.transfer_sync(seg, src, dst, 4096, TransferOpcode.Write) == 0
assert b.read_bytes_from_buffer(dst, 4) == b"moon"
assert a.transfer_sync_write("127.0.0.1:1", src, dst, 8) == -1   # Mooncake's code
print("OK", me.__name__, me.SUPPORT_CUDA, type(a).__module__)
"""


def _run(code, env_extra=None, path_extra=None):
    env = dict(os.environ)
    env.pop("MC_MOONCAKE_SHIM", None)
    env.update(env_extra or {})
    pp = ([path_extra] if path_extra else []) + [env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in pp if p)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=60, cwd="/")


def _no_real_mooncake():
    r = _run("import importlib.util as u; print(u.find_spec('mooncake') is None)")
    if r.stdout.strip() != "True":
        pytest.skip("a real Mooncake package is installed here")


def test_install_then_transfer():
    _no_real_mooncake()
    r = _run(TRANSFER.format(setup="import mooncake_connector.mooncake_shim as s; s.install()"))
    assert r.returncode == 0, r.stderr
    assert "OK mooncake.engine False mooncake_connector.compat" in r.stdout
    assert r.stderr.count("mooncake.engine is provided by mooncake_connector") == 1, r.stderr


def test_off_by_default_and_env_switch(tmp_path):
    _no_real_mooncake()
    r = _run("import mooncake.engine")
    assert r.returncode != 0 and "No module named 'mooncake'" in r.stderr
    # The .pth our wheel installs, exercised through a site dir of its own.
    site = tmp_path / "site"
    site.mkdir()
    with open(os.path.join(WT, "mooncake_connector_shim.pth")) as f:
        (site / "mooncake_connector_shim.pth").write_text(f.read())
    code = "import site; site.addsitedir(%r)\n" % str(site)
    r = _run(code + TRANSFER.format(setup=""), {"MC_MOONCAKE_SHIM": "1"})
    assert r.returncode == 0, r.stderr
    assert "MC_MOONCAKE_SHIM=1" in r.stderr
    r = _run(code + "import mooncake.engine", {"MC_MOONCAKE_SHIM": "0"})
    assert r.returncode != 0


def test_real_mooncake_is_never_shadowed(tmp_path):
    real = tmp_path / "real" / "mooncake"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("REAL = True\n")
    (real / "engine.py").write_text("TransferEngine = 'real'\n")
    code = ("import mooncake_connector.mooncake_shim as s; s.install()\n"
            "import mooncake, mooncake.engine as e\n"
            "print(mooncake.REAL, e.TransferEngine)\n")
    r = _run(code, path_extra=str(tmp_path / "real"))
    assert r.returncode == 0 and r.stdout.split() == ["True", "real"], r.stderr
    # A real Mooncake without an engine module is not completed by ours.
    (real / "engine.py").unlink()
    r = _run(code, path_extra=str(tmp_path / "real"))
    assert r.returncode != 0 and "No module named 'mooncake.engine'" in r.stderr


def test_stats_switch_logs_each_sync_transfer():
    """MC_MOONCAKE_SHIM_STATS=1: one line per successful synchronous transfer
    of an engine served as mooncake.engine (bytes, the engine's counters);
    none for a failed one, none without the switch."""
    _no_real_mooncake()
    code = TRANSFER.format(setup="import mooncake_connector.mooncake_shim as s; s.install()")
    code += ("assert a.batch_transfer_sync_write(seg, [src, src + 100], [dst, dst + 200], "
             "[100, 300]) == 0\n")
    r = _run(code, {"MC_MOONCAKE_SHIM_STATS": "1"})
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "served as mooncake.engine" in ln]
    assert len(lines) == 2, r.stderr  # transfer_sync and the batch; not the failed write
    assert "transfer_sync to " in lines[0] and " ok, 4096 bytes" in lines[0], lines
    assert "batch_transfer_sync_write to " in lines[1] and " ok, 400 bytes; this engine so " \
        "far 2 transfers, 4496 bytes" in lines[1], lines
    assert "same_host_cpu_bytes_written=" in lines[1], lines
    r = _run(code)
    assert r.returncode == 0 and "served as mooncake.engine" not in r.stderr, r.stderr
