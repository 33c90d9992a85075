#!/usr/bin/env bash
# Issue 30 on the GPU machine: build, the same-host GPU C tests, and
# benchmarks/gpu_fixed_cost_bench.py (ours vs torch's on-GPU copy, same run)
# with the regions version page (default) and without it (MC_GPU_GEN=0),
# plus a traced 4 KiB run (MC_GPU_TRACE=1: the stages of one transfer).
# Carry .debs as for scripts/device-gpu.sh (docs/device.md).
#   OUT=$OUT bash scripts/device-gpu-fixed-cost.sh [--no-before] [--no-tests]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-/tmp/device-gfc}"
mkdir -p "$out"
before=1 tests=1
for a in "$@"; do
  case "$a" in
  --no-before) before=0 ;;
  --no-tests) tests=0 ;;
  esac
done
rm -rf build build-san
source scripts/device-lib.sh
mc_unpack_debs
rc=0
make -s -j16 WERROR=1 lib build/bench/gpu_fixed_cost build/tests/test_gpu_same_host \
    build/tests/test_gpu >"$out/make.log" 2>&1 || { rc=1; tail -30 "$out/make.log"; exit 1; }
if [ $tests = 1 ]; then
  for t in test_gpu_same_host test_gpu; do
    echo "== $t"; MC_LOG_LEVEL=warn timeout 300 build/tests/$t || rc=1
  done >"$out/test-c.log" 2>&1
  tail -25 "$out/test-c.log"
fi
timeout 400 python3 benchmarks/gpu_fixed_cost_bench.py --out "$out/gfc.json" 2>&1 \
    | tee "$out/gfc.log" || rc=1
if [ $before = 1 ]; then
  echo "== MC_GPU_GEN=0 (every call checks the descriptor by RPC, as before)"
  MC_GPU_GEN=0 timeout 400 python3 benchmarks/gpu_fixed_cost_bench.py \
      --out "$out/gfc_gen0.json" 2>&1 | tee "$out/gfc_gen0.log" || rc=1
fi
echo "== 4 KiB, a single copy by the copy engine (MC_GPU_SINGLE_COPY=driver)"
MC_GPU_SINGLE_COPY=driver GPU_FIXED_COST_ONLY=small timeout 60 \
    build/bench/gpu_fixed_cost /tmp 2000 1 2>&1 | tee "$out/gfc_single_driver.log"
echo "== 4 KiB, the copy kernel's large parameter block for one copy (MC_GPU_SMALL_PARAMS=0)"
MC_GPU_SMALL_PARAMS=0 GPU_FIXED_COST_ONLY=small timeout 60 \
    build/bench/gpu_fixed_cost /tmp 2000 1 2>&1 | tee "$out/gfc_large_params.log"
echo "== 64 KiB x 128 pipe WRITE, one kernel launch per job (MC_GPU_MERGE=0) and merged (default)"
for m in 0 1; do
  MC_GPU_MERGE=$m GPU_FIXED_COST_ONLY=row:65536:128:pipe timeout 60 \
      build/bench/gpu_fixed_cost /tmp 200 3 2>&1 | tee "$out/gfc_merge$m.log"
done
echo "== 64 KiB x 128 WRITE seq and pipe, the copy worker launching every job (MC_GPU_DIRECT=0) and direct launches (default), alternating"
for turn in 1 2; do
  for d in 0 1; do
    for mode in seq pipe; do
      MC_GPU_DIRECT=$d GPU_FIXED_COST_ONLY=row:65536:128:$mode timeout 60 \
          build/bench/gpu_fixed_cost /tmp 200 5 2>&1 | tee -a "$out/gfc_direct$d.log"
    done
  done
done
echo "== 4 KiB, an event recorded per job (MC_GPU_LAZY_EVENTS=0)"
MC_GPU_LAZY_EVENTS=0 GPU_FIXED_COST_ONLY=small timeout 60 \
    build/bench/gpu_fixed_cost /tmp 2000 1 2>&1 | tee "$out/gfc_events.log"
# Traced runs (MC_GPU_TRACE=1): the stages of each transfer, medians.
for only in small row:65536:128:seq row:65536:128:pipe; do
  echo "== traced: ${only}"
  MC_GPU_TRACE=1 MC_LOG_LEVEL=info GPU_FIXED_COST_ONLY=$only timeout 120 \
      build/bench/gpu_fixed_cost /tmp 200 2 >"$out/trace-${only//:/_}.log" 2>&1
  python3 scripts/gpu_trace_summary.py "$out/trace-${only//:/_}.log"
done
exit $rc
