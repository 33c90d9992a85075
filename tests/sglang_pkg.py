"""SGLang's Python package for tests that run its Mooncake transfer-engine
wrapper on our engine (tests/test_sglang_mooncake.py).  Never installed into
the venv: ``pip install --no-deps --target`` into a cache dir,
``$MC_SGLANG_CACHE`` (default ``~/.cache/mooncake_connector/sglang-py<X.Y>``),
with the three extra modules its import chain needs beyond our venv (found by
importing it there).  ``scripts/env.sh`` fills the cache for CI; offline the
test skips with the reason.  Returns (site dir, None) or (None, reason)."""
import os
import sys

import pip_cache

PINS = ["sglang==0.5.23", "orjson==3.13.0", "ipython==9.18.1", "traitlets==5.16.1"]
MODULE = "sglang.srt.distributed.device_communicators.mooncake_transfer_engine"


def cache_dir():
    return pip_cache.cache_dir("MC_SGLANG_CACHE", "sglang-py%d.%d" % sys.version_info[:2])


def find_site(download=True, timeout=600):
    site = cache_dir()
    mark = os.path.join(site, ".complete")
    if os.path.isfile(mark):
        with open(mark) as f:
            if f.read().split() == PINS:
                return site, None
    if not download:
        return None, f"SGLang is not in {site}"
    os.makedirs(site, exist_ok=True)
    why = pip_cache.pip("install", ["--upgrade", "--target", site, *PINS], " ".join(PINS),
                        site, timeout)
    if why:
        return None, why
    with open(mark, "w") as f:
        f.write(" ".join(PINS) + "\n")
    return site, None

