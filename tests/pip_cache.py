"""One helper for the test packages fetched with pip into a cache dir, never
into the venv (tests/mooncake_wheel.py, vllm_router_pkg.py, sglang_pkg.py):
where the cache is, one pip run that answers with the reason it failed, and
the command scripts/env.sh runs to fill a cache for CI:

    python tests/pip_cache.py mooncake_wheel|vllm_router_pkg|sglang_pkg

(prints where the package is, or why not; exit status 1 when not)."""
import importlib
import os
import subprocess
import sys


def cache_dir(env_var, name):
    """$env_var, else ~/.cache/mooncake_connector/<name>."""
    return os.environ.get(env_var) or os.path.join(
        os.path.expanduser("~"), ".cache", "mooncake_connector", name)


def pip(verb, args, label, where, timeout):
    """`python -m pip <verb> --no-deps -q <args>` (verb: "download" or
    "install"): None when it worked, else why not, naming `label` and
    `where`."""
    try:
        r = subprocess.run([sys.executable, "-m", "pip", verb, "--no-deps",
                            "--disable-pip-version-check", "-q", *args],
                           capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot {verb} {label} into {where}: {e}"
    if r.returncode != 0:
        return (f"cannot {verb} {label} into {where} (no network?): "
                f"{(r.stderr or r.stdout).strip()[-300:]}")
    return None


FINDERS = {"mooncake_wheel": "find_server", "vllm_router_pkg": "find_router",
           "sglang_pkg": "find_site"}


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also with PYTHONSAFEPATH=1
    if len(sys.argv) != 2 or sys.argv[1] not in FINDERS:
        sys.exit(f"usage: {sys.argv[0]} {'|'.join(FINDERS)}")
    mod = importlib.import_module(sys.argv[1])
    where, why = getattr(mod, FINDERS[sys.argv[1]])()
    print(where or why)
    sys.exit(0 if where else 1)
