#!/usr/bin/env bash
# Issue 30, direct launches (MC_GPU_DIRECT) on the GPU machine, one lease:
# two source trees side by side, A (e.g. main) and B (e.g. a branch), each
# built here; the C GPU tests of both, then benchmarks/gpu_fixed_cost_bench.py
# (GPU_FIXED_COST_ONLY=batch:128: 4 KiB, 64 KiB and 2 MiB in batches of 128,
# seq and pipe, each against torch in the same process) alternating
#   A with MC_GPU_DIRECT=0 (the copy worker launches every job),
#   A with the default, B with the default,
# the order reversed on the second turn, a third turn if time is left; then
# B's pytest GPU tests.  Carry .debs in the directory above the trees
# (docs/device.md).  Everything lands in $OUT/ab.txt and $OUT/results.tar.gz
# (the JSON results and build logs; the device tool returns at most 8 files).
#   OUT=$OUT bash TREE_B/scripts/device-gpu-direct-ab.sh TREE_A TREE_B [seconds]
set -uo pipefail
a=$(cd "$1" && pwd) b=$(cd "$2" && pwd) budget=${3:-420}
out="${OUT:-/tmp/device-direct-ab}"
work=/tmp/device-direct-ab-w # many files: they come back as one tar
rm -rf "$work"
mkdir -p "$out" "$work"
log="$out/ab.txt"
cd "$(dirname "$a")" && source "$b/scripts/device-lib.sh"
[ -d .debs ] && mc_unpack_debs
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc
  python3 -c 'import torch; print("torch", torch.__version__)'; date -u; cat /proc/loadavg
} >"$log" 2>&1
rc=0
pids=()
for t in "$a" "$b"; do
  (cd "$t" && rm -rf build && make -s -j8 WERROR=1 lib build/bench/gpu_fixed_cost \
      build/tests/test_gpu build/tests/test_gpu_same_host build/tests/test_cuda_driver \
      build/tests/test_gpu_vmm >"$work/make_$(basename "$t").log" 2>&1) &
  pids+=($!)
done
(cd "$b" && MC_WERROR=1 timeout 200 python3 setup.py -q build_ext --inplace -j 8 \
    >"$work/ext_build.log" 2>&1) &
pids+=($!)
for p in "${pids[@]}"; do wait "$p" || { rc=1; echo "a build failed (pid $p)" >>"$log"; }; done
echo "builds done after ${SECONDS} s" >>"$log"
for t in "$a" "$b"; do
  for c in test_cuda_driver test_gpu test_gpu_same_host test_gpu_vmm; do
    echo "== $(basename "$t") $c" >>"$log"
    (cd "$t" && MC_LOG_LEVEL=warn timeout 120 build/tests/$c) >>"$log" 2>&1 \
      || { rc=1; echo "FAILED: $(basename "$t") $c" >>"$log"; }
  done
done
echo "C tests done after ${SECONDS} s" >>"$log"
one() { # tree label turn [env...]
  local t=$1 label=$2 turn=$3
  shift 3
  echo "== A/B turn $turn: $label ($(date -u +%T), load $(cut -d' ' -f1-3 /proc/loadavg))" >>"$log"
  (cd "$t" && env "$@" GPU_FIXED_COST_ONLY=batch:128 timeout 90 python3 \
      benchmarks/gpu_fixed_cost_bench.py --passes 5 --iters 2000 \
      --out "$work/ab_${label}_${turn}.json") >>"$log" 2>&1 || rc=1
}
for turn in 1 2 3; do
  if [ $turn = 3 ] && [ $SECONDS -gt $((budget - 200)) ]; then
    echo "no third turn: ${SECONDS} s used" >>"$log"
    break
  fi
  if [ $turn = 2 ]; then
    one "$b" B "$turn"; one "$a" A "$turn"; one "$a" A_direct0 "$turn" MC_GPU_DIRECT=0
  else
    one "$a" A_direct0 "$turn" MC_GPU_DIRECT=0; one "$a" A "$turn"; one "$b" B "$turn"
  fi
  if [ $turn = 2 ]; then # B's pytest GPU tests between turns 2 and 3
    echo "== B pytest tests/test_gpu*.py after ${SECONDS} s" >>"$log"
    (cd "$b" && PYTHONPATH="$b" MC_LOG_LEVEL=warn timeout 120 python3 -m pytest -q -rs \
        -p no:cacheprovider tests/test_gpu.py tests/test_gpu_worker.py \
        tests/test_gpu_build.py --timeout 100) >>"$log" 2>&1 || { rc=1; echo "pytest FAILED" >>"$log"; }
  fi
done
echo "done after ${SECONDS} s, rc=$rc" >>"$log"
tar -czf "$out/results.tar.gz" -C "$work" .
exit $rc
