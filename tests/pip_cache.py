"""One helper for the test packages fetched with pip into a cache dir, never
into the venv (tests/mooncake_wheel.py, vllm_router_pkg.py, sglang_pkg.py):
where the cache is, one pip run that answers with the reason it failed, and
the command-line entry scripts/env.sh runs to fill the cache for CI."""
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


def main(find):
    """scripts/env.sh: fill the cache; prints where it is or why not."""
    where, why = find()
    print(where or why)
    sys.exit(0 if where else 1)
