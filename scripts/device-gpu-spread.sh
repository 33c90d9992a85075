#!/usr/bin/env bash
# Issue 30: why the pipelined 64 KiB x 128 WRITE row is bimodal per process.
# On the GPU machine, from a source tree with .debs/ beside it (docs/device.md):
# the machine's CPU/GPU topology, a build, the C GPU tests, then ROUNDS
# rounds of fresh processes of that row alone (`build/bench/gpu_fixed_cost`,
# MC_GPU_DIAG=1: where the threads ran and what the copy worker did), one
# per variant per round, the variants rotated each round:
#   base          as built
#   merge0        MC_GPU_MERGE=0 (no merged launches: no pinned kernel table)
#   poll2us       MC_GPU_POLL_NS=2000 (the worker spins on cheap checks 2 us
#                 between CUDA queries instead of sched_yield)
#   pin_apart     the submitting thread on CPU S, the worker on CPU W (another core)
#   pin_same      both on CPU S
#   pin_sib       the worker on S's SMT sibling (only where there is one)
#   streams1      MC_GPU_D2D_STREAMS=1 (one D2D stream instead of two)
# MC_GPU_DIAG=2 (default 1) also writes each process's launch timeline to
# $OUT/trace.txt and a "timeline" line per row.
# then, time permitting, pytest tests/test_gpu*.py.  $OUT/spread.txt.
#   [SPREAD_VARIANTS="base ..."] OUT=$OUT bash scripts/device-gpu-spread.sh [rounds] [seconds]
set -uo pipefail
rounds=${1:-8} budget=${2:-330}
out="${OUT:-/tmp/device-spread}"
mkdir -p "$out"
log="$out/spread.txt"
cd "$(dirname "$0")/.."
source scripts/device-lib.sh
[ -d ../.debs ] && (cd .. && mc_unpack_debs) && export CPATH=/opt/debs/usr/include \
  LIBRARY_PATH=/opt/debs/usr/lib/x86_64-linux-gnu \
  LD_LIBRARY_PATH=/opt/debs/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
{ date -u; cat /proc/loadavg; nproc
  nvidia-smi --query-gpu=name,driver_version,pci.bus_id --format=csv,noheader
  nvidia-smi topo -m 2>&1 | head -8
  lscpu | grep -E 'Model name|Thread|Core|Socket|NUMA|MHz' 
  for c in /sys/devices/system/cpu/cpu[0-9]*; do
    printf '%s sib=%s core=%s pkg=%s\n' "${c##*/}" "$(cat $c/topology/thread_siblings_list)" \
      "$(cat $c/topology/core_id)" "$(cat $c/topology/physical_package_id)"
  done
  bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | head -1 | tr 'A-F' 'a-f')
  echo "gpu local_cpulist: $(cat /sys/bus/pci/devices/${bus#0000}/local_cpulist 2>/dev/null \
    || cat /sys/bus/pci/devices/${bus:4}/local_cpulist 2>/dev/null)"
} >"$log" 2>&1
rm -rf build
(make -s -j16 WERROR=1 lib build/bench/gpu_fixed_cost build/tests/test_gpu \
   build/tests/test_gpu_same_host build/tests/test_cuda_driver build/tests/test_gpu_vmm \
   >"$out/make.log" 2>&1) &
mk=$!
# the extension's objects apart from make's build/ (session 15 lost a
# pytest run to the two sharing it)
(MC_WERROR=1 timeout 200 python3 setup.py -q build_ext --inplace -j 16 -t /tmp/mc-ext-build \
   >"$out/ext.log" 2>&1) &
ext=$!
wait $mk || { echo "make failed"; cat "$out/make.log"; } >>"$log"
echo "make done after ${SECONDS} s" >>"$log"
rc=0
for c in test_cuda_driver test_gpu test_gpu_same_host test_gpu_vmm; do
  echo "== $c" >>"$log"
  MC_LOG_LEVEL=warn timeout 120 build/tests/$c >>"$log" 2>&1 || { rc=1; echo "FAILED: $c" >>"$log"; }
done
echo "C tests done after ${SECONDS} s" >>"$log"
S=2
sib=$(cat /sys/devices/system/cpu/cpu$S/topology/thread_siblings_list)
W=""
for c in 5 6 7 8 9 10 11; do
  case ",$sib," in *",$c,"*) ;; *) W=$c; break ;; esac
done
T=$(echo "$sib" | tr ',-' '\n\n' | grep -vx "$S" | head -1)
variants="base merge0 poll2us pin_apart pin_same"
[ -n "$T" ] && variants="$variants pin_sib"
variants=${SPREAD_VARIANTS:-$variants} # e.g. SPREAD_VARIANTS=base
echo "S=$S W=$W sibling=${T:-none}; variants: $variants" >>"$log"
envs() {
  case $1 in
    base) echo "" ;;
    merge0) echo "MC_GPU_MERGE=0" ;;
    poll2us) echo "MC_GPU_POLL_NS=2000" ;;
    pin_apart) echo "GFC_MAIN_CPU=$S MC_GPU_WORKER_CPU=$W" ;;
    pin_same) echo "GFC_MAIN_CPU=$S" ;;
    pin_sib) echo "GFC_MAIN_CPU=$S MC_GPU_WORKER_CPU=$T" ;;
    streams1) echo "MC_GPU_D2D_STREAMS=1" ;;
  esac
}
mkdir -p /tmp/gfc
set -- $variants
nv=$#
for r in $(seq 1 "$rounds"); do
  if [ $SECONDS -gt $((budget - 90)) ]; then echo "stopped before round $r: ${SECONDS} s" >>"$log"; break; fi
  for k in $(seq 0 $((nv - 1))); do
    i=$(( (k + r - 1) % nv + 1 ))
    v=${!i}
    echo "== $v $r $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >>"$log"
    env $(envs "$v") MC_GPU_DIAG=${MC_GPU_DIAG:-1} GFC_GPU_TRACE="$out/trace.txt" MC_LOG_LEVEL=info GPU_FIXED_COST_ONLY=row:65536:128:pipe \
      timeout 30 build/bench/gpu_fixed_cost /tmp/gfc 200 5 2>&1 | sed "s/^/$v $r /" >>"$log"
  done
done
echo "rows done after ${SECONDS} s" >>"$log"
wait $ext || echo "extension build failed: $(tail -5 "$out/ext.log")" >>"$log"
if [ $SECONDS -lt $((budget - 100)) ]; then
  echo "== pytest tests/test_gpu*.py after ${SECONDS} s" >>"$log"
  PYTHONPATH=$PWD MC_LOG_LEVEL=warn timeout $((budget - SECONDS - 10)) python3 -m pytest -q -rs \
    -p no:cacheprovider tests/test_gpu.py tests/test_gpu_worker.py tests/test_gpu_build.py \
    --timeout 100 >>"$log" 2>&1 || { rc=1; echo "pytest FAILED" >>"$log"; }
else
  echo "no time left for pytest: ${SECONDS} s" >>"$log"
fi
echo "done after ${SECONDS} s, rc=$rc" >>"$log"
exit $rc
