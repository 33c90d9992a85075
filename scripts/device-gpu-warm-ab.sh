#!/usr/bin/env bash
# Issue 30: the pipelined 64 KiB x 128 row with and without a busy GPU before
# the timed passes.  On the GPU machine, this tree (B) carried inside the
# checkout whose root is main (A), .debs/ beside this tree (docs/device.md):
# builds both, then ROUNDS rounds of fresh processes of that row alone,
# alternating A (main's tool), B0 (this tool, GFC_WARMUP_MS=0: one warm-up
# pass as before) and B (this tool's default: warm-up passes for 200 ms);
# this tool prints the SM clock (NVML) at each pass.  Then
# benchmarks/gpu_fixed_cost_bench.py (batch:128 rows, torch in the same run)
# for B and A, and, time permitting, the CUDA push test of test_gpu_worker.py.
#   OUT=$OUT bash scripts/device-gpu-warm-ab.sh ROOT_OF_A [rounds] [seconds]
set -uo pipefail
a=$(cd "$1" && pwd) rounds=${2:-4} budget=${3:-170}
out="${OUT:-/tmp/device-warm-ab}"
mkdir -p "$out"
log="$out/warm.txt"
cd "$(dirname "$0")/.."
b=$PWD
source scripts/device-lib.sh
(cd .. && mc_unpack_debs)
export CPATH=/opt/debs/usr/include LIBRARY_PATH=/opt/debs/usr/lib/x86_64-linux-gnu \
  LD_LIBRARY_PATH=/opt/debs/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
{ date -u; cat /proc/loadavg; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm \
    --format=csv,noheader; } >"$log" 2>&1
rm -rf build # the extension's objects apart from make's build/
(MC_WERROR=1 timeout 200 python3 setup.py -q build_ext --inplace -j 16 -t /tmp/mc-ext-build \
   >"$out/ext.log" 2>&1) &
ext=$!
for t in "$a" "$b"; do
  (cd "$t" && { [ "$t" = "$b" ] || rm -rf build; } && make -s -j16 WERROR=1 lib build/bench/gpu_fixed_cost) \
    >>"$out/make.log" 2>&1 || echo "make failed in $t" >>"$log"
done
echo "make done after ${SECONDS} s" >>"$log"
mkdir -p /tmp/gfc
row() { # label tree [env...]
  local label=$1 t=$2
  shift 2
  echo "== $label $r $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >>"$log"
  (cd "$t" && env "$@" MC_LOG_LEVEL=warn GPU_FIXED_COST_ONLY=row:65536:128:pipe \
    timeout 30 build/bench/gpu_fixed_cost /tmp/gfc 200 5) 2>&1 | grep -v '"diag"' \
    | sed "s/^/$label $r /" >>"$log"
}
for r in $(seq 1 "$rounds"); do
  if [ $((r % 2)) = 1 ]; then
    row A "$a"; row B0 "$b" GFC_WARMUP_MS=0; row B "$b"
  else
    row B "$b"; row B0 "$b" GFC_WARMUP_MS=0; row A "$a"
  fi
done
echo "rows done after ${SECONDS} s" >>"$log"
for t in "$b" "$a"; do
  l=$([ "$t" = "$b" ] && echo B || echo A)
  echo "== gpu_fixed_cost_bench.py $l $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >>"$log"
  (cd "$t" && MC_LOG_LEVEL=warn GPU_FIXED_COST_ONLY=batch:128 timeout 60 python3 \
    benchmarks/gpu_fixed_cost_bench.py --passes 5 --iters 1000 --out "$out/gfc_$l.json") >>"$log" 2>&1
done
echo "benches done after ${SECONDS} s" >>"$log"
wait $ext || echo "extension build failed" >>"$log"
left=$((budget - SECONDS - 5))
if [ $left -gt 30 ]; then
  echo "== pytest push test (${left} s) after ${SECONDS} s" >>"$log"
  PYTHONPATH=$PWD MC_LOG_LEVEL=warn timeout $left python3 -m pytest -v -x -s -p no:cacheprovider \
    "tests/test_gpu_worker.py::test_push_layerwise_streams_cuda_layers_before_wait_for_save" \
    --timeout $((left - 8)) >"$out/pytest.txt" 2>&1
  echo "pytest rc=$?" >>"$log"
fi
echo "done after ${SECONDS} s" >>"$log"
