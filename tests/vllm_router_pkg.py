"""Finds vLLM's Rust router (`vllm-router` on PyPI) for the tests that put it
in front of our servers (tests/test_router_mooncake.py).

Looked up in order: ``MC_VLLM_ROUTER_SITE`` (a directory where
``pip install --target`` put vllm-router); the cache dir
``$MC_VLLM_ROUTER_CACHE`` (default ``~/.cache/mooncake_connector/vllm-router``);
else, when the network allows, ``pip install --no-deps --target`` of
vllm-router ROUTER_VERSION (and orjson, which its launcher imports; its
other dependencies, aiohttp, fastapi, uvicorn, requests, setproctitle, come
with vLLM) into that cache.  Nothing is installed into the environment: the
router runs as ``python -m vllm_router.launch_router`` with PYTHONPATH set to
the directory.  ``scripts/env.sh`` runs the same install for CI.
Returns (site dir, None) or (None, reason)."""
import glob
import os
import sys

import pip_cache

ROUTER_VERSION = "0.1.17"
DIST = "vllm-router"


def cache_dir():
    return pip_cache.cache_dir("MC_VLLM_ROUTER_CACHE", "vllm-router")


def _complete(site):
    return (bool(glob.glob(os.path.join(site, "vllm_router_rs*.so")))
            and os.path.isfile(os.path.join(site, "vllm_router", "launch_router.py"))
            and os.path.isdir(os.path.join(site, "orjson")))


def find_router(download=True, timeout=300):
    p = os.environ.get("MC_VLLM_ROUTER_SITE")
    if p:
        return (p, None) if _complete(p) else (
            None, f"MC_VLLM_ROUTER_SITE={p} has no vllm_router_rs module, vllm_router package "
                  "and orjson (pip install --target DIR vllm-router orjson)")
    site = os.path.join(cache_dir(), ROUTER_VERSION)
    if _complete(site):
        return site, None
    if not download:
        return None, f"vllm-router {ROUTER_VERSION} is not in {site}"
    os.makedirs(site, exist_ok=True)
    pin = f"{DIST}=={ROUTER_VERSION}"
    why = pip_cache.pip("install", ["--target", site, pin, "orjson"], pin, site, timeout)
    if why:
        return None, why
    if _complete(site):
        return site, None
    return None, f"{DIST} installed into {site} but its router module is missing"


def router_cmd(site, prefill, decode, port, python=None, kv_connector="mooncake",
               host="127.0.0.1", extra=()):
    """(argv, env additions) to run vllm-router in PD mode: prefill is a list of
    (url, bootstrap port or None), decode a list of urls; extra: more router
    arguments (e.g. --intra-node-data-parallel-size 2)."""
    argv = [python or sys.executable, "-m", "vllm_router.launch_router",
            "--vllm-pd-disaggregation", "--kv-connector", kv_connector,
            "--host", host, "--port", str(port), "--policy", "round_robin", *extra]
    for url, bport in prefill:
        argv += ["--prefill", url] + ([str(bport)] if bport is not None else [])
    for url in decode:
        argv += ["--decode", url]
    path = site + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    return argv, {"PYTHONPATH": path}

