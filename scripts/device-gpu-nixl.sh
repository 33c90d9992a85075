#!/usr/bin/env bash
# Issue 30's NIXL rows on the GPU machine: installs the carried NIXL wheels
# (nixl-cu13 matches the machine's CUDA 13 torch; pip download --no-deps
# --python-version 3.12 --platform manylinux_2_28_x86_64 --only-binary=:all:
# nixl-cu13 here, then carry the folder) into a --target folder outside the
# tree and runs benchmarks/gpu_nixl_bench.py (NIXL vs torch's on-GPU copy,
# same process).  Run benchmarks/gpu_fixed_cost_bench.py in the same lease
# for our rows (scripts/device-gpu-fixed-cost.sh).
#   OUT=$OUT bash scripts/device-gpu-nixl.sh WHEEL_DIR
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
wheels="${1:?usage: device-gpu-nixl.sh WHEEL_DIR (holding nixl_cu13-*.whl)}"
out="${OUT:-/tmp/device-nixl}"
site=/tmp/nixl-site
mkdir -p "$out"
if [ ! -d "$site/nixl_cu13" ] && [ ! -d "$site/nixl_cu12" ]; then
  python3 -m pip install -q --no-deps --no-index --target "$site" "$wheels"/nixl_cu*.whl \
      >"$out/pip.log" 2>&1 || { tail -20 "$out/pip.log"; exit 1; }
fi
PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" NIXL_LOG_LEVEL=WARN timeout 500 \
    python3 benchmarks/gpu_nixl_bench.py --out "$out/nixl.json" 2>&1 | tee "$out/nixl.log"
exit "${PIPESTATUS[0]}"
