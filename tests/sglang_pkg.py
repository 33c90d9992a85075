"""SGLang's Python package for tests that run its Mooncake transfer-engine
wrapper on our engine (tests/test_sglang_mooncake.py).  Never installed into
the venv: ``pip install --no-deps --target`` into a cache dir,
``$MC_SGLANG_CACHE`` (default ``~/.cache/mooncake_connector/sglang-py<X.Y>``),
with the three extra modules its import chain needs beyond our venv (found by
importing it there).  ``scripts/env.sh`` fills the cache for CI; offline the
test skips with the reason.  Returns (site dir, None) or (None, reason)."""
import os
import subprocess
import sys

PINS = ["sglang==0.5.23", "orjson==3.13.0", "ipython==9.18.1", "traitlets==5.16.1"]
MODULE = "sglang.srt.distributed.device_communicators.mooncake_transfer_engine"


def cache_dir():
    return os.environ.get("MC_SGLANG_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "mooncake_connector",
        "sglang-py%d.%d" % sys.version_info[:2])


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
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--upgrade",
                            "--disable-pip-version-check", "-q", "--target", site, *PINS],
                           capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"cannot install {' '.join(PINS)} into {site}: {e}"
    if r.returncode != 0:
        return None, (f"cannot install {' '.join(PINS)} into {site} (no network?): "
                      f"{(r.stderr or r.stdout).strip()[-300:]}")
    with open(mark, "w") as f:
        f.write(" ".join(PINS) + "\n")
    return site, None


if __name__ == "__main__":  # scripts/env.sh: fill the cache for CI
    path, why = find_site()
    print(path or why)
    sys.exit(0 if path else 1)
