"""Finds Mooncake's own HTTP metadata server program (a small aiohttp script,
``mooncake/http_metadata_server.py`` in Mooncake's wheel) for tests that run
our engines against it.

Looked up in order: ``MC_MOONCAKE_METADATA_SERVER_PY`` (a path to the file);
the cache dir ``$MC_MOONCAKE_CACHE`` (default
``~/.cache/mooncake_connector/mooncake-wheel``); else, when the network
allows, ``pip download --no-deps mooncake-transfer-engine-non-cuda`` into that
cache and the one file is extracted from the wheel (nothing is installed).
``scripts/env.sh`` runs the same download for CI.  Returns (path, None) or
(None, reason)."""
import glob
import os
import sys
import zipfile

import pip_cache

MEMBER = "mooncake/http_metadata_server.py"
DIST = "mooncake-transfer-engine-non-cuda"


def cache_dir():
    return pip_cache.cache_dir("MC_MOONCAKE_CACHE", "mooncake-wheel")


def _extract(cache):
    for whl in sorted(glob.glob(os.path.join(cache, "mooncake_transfer_engine*.whl"))):
        try:
            with zipfile.ZipFile(whl) as z:
                data = z.read(MEMBER)
        except (KeyError, zipfile.BadZipFile, OSError):
            continue
        out = os.path.join(cache, "http_metadata_server.py")
        with open(out + ".tmp", "wb") as f:
            f.write(data)
        os.replace(out + ".tmp", out)
        return out
    return None


def find_server(download=True, timeout=180):
    p = os.environ.get("MC_MOONCAKE_METADATA_SERVER_PY")
    if p:
        return (p, None) if os.path.isfile(p) else (
            None, f"MC_MOONCAKE_METADATA_SERVER_PY={p} does not exist")
    cache = cache_dir()
    path = os.path.join(cache, "http_metadata_server.py")
    if os.path.isfile(path):
        return path, None
    if os.path.isdir(cache) and _extract(cache):
        return path, None
    if not download:
        return None, f"Mooncake's metadata server is not in {cache}"
    os.makedirs(cache, exist_ok=True)
    why = pip_cache.pip("download", ["-d", cache, DIST], DIST, cache, timeout)
    if why:
        return None, why
    if _extract(cache):
        return path, None
    return None, f"the downloaded {DIST} wheel in {cache} has no {MEMBER}"

