"""The environment for programs written for Mooncake run unmodified on our
engine: ``MC_MOONCAKE_SHIM=1`` with our package's .pth active, so their
``from mooncake.engine import TransferEngine`` is served by our package
(docs/compat.md).  Used by tests/test_mooncake_own_tests.py and
tests/test_sglang_mooncake.py."""
import os
import site
import subprocess
import sys

import pytest

PTH = "mooncake_connector_shim.pth"


def no_real_mooncake():
    r = subprocess.run([sys.executable, "-c",
                        "import importlib.util as u; print(u.find_spec('mooncake') is None)"],
                       capture_output=True, text=True, timeout=60)
    if r.stdout.strip() != "True":
        pytest.skip("a real Mooncake package is installed here: the shim never shadows it")


def shim_env(tmp_path, **extra):
    """The environment Mooncake's programs run in: MC_MOONCAKE_SHIM=1 and
    our package's .pth.  An installed wheel has the .pth in site-packages;
    a source checkout (PYTHONPATH=checkout) gets the checkout's .pth through a
    site dir of its own, processed by a sitecustomize (the same line runs).
    ``MC_FORCE_TCP=1`` as Mooncake's CI sets it; ``extra`` overrides (None
    unsets)."""
    env = dict(os.environ)
    # Mooncake's programs are run as `python prog.py`: their own directory on
    # sys.path (the fault-tolerant ones import their transfer_engine.py).
    env.pop("PYTHONSAFEPATH", None)
    env.update(MC_MOONCAKE_SHIM="1", PYTHONUNBUFFERED="1", MC_FORCE_TCP="1",
               PYTHONDONTWRITEBYTECODE="1")  # no __pycache__ in tests/third_party
    for k, v in extra.items():  # None: unset
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    dirs = site.getsitepackages() + [site.getusersitepackages()]
    if not any(os.path.isfile(os.path.join(d, PTH)) for d in dirs):
        import mooncake_connector
        src = os.path.join(os.path.dirname(os.path.dirname(mooncake_connector.__file__)), PTH)
        if not os.path.isfile(src):
            pytest.skip(f"{PTH} is neither installed nor next to {mooncake_connector.__file__}")
        sdir = tmp_path / "shim-site"
        sdir.mkdir(exist_ok=True)
        with open(src) as f:
            (sdir / PTH).write_text(f.read())
        (sdir / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(sdir)!r})\n")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(sdir), env.get("PYTHONPATH")) if p)
    return env
