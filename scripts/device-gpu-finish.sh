#!/usr/bin/env bash
# Issue 30, step 6: where the slow pipelined 64 KiB x 128 WRITE processes
# spend the worker's time after the GPU finished (MC_GPU_DIAG=1's completion
# counters), ROUNDS fresh processes per variant (base, merge0), one line each.
#   OUT=$OUT bash scripts/device-gpu-finish.sh [rounds]   (from a tree with ../.debs)
set -uo pipefail
rounds=${1:-4}
cd "$(dirname "$0")/.."
source scripts/device-lib.sh
[ -d ../.debs ] && (cd .. && mc_unpack_debs) && export CPATH=/opt/debs/usr/include \
  LIBRARY_PATH=/opt/debs/usr/lib/x86_64-linux-gnu \
  LD_LIBRARY_PATH=/opt/debs/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
make -s -j16 WERROR=1 lib build/bench/gpu_fixed_cost >"${OUT:-/tmp}/make.log" 2>&1 || { tail "${OUT:-/tmp}/make.log"; exit 1; }
cat /proc/loadavg
mkdir -p /tmp/gfc
for r in $(seq 1 "$rounds"); do
  for v in base merge0; do
    e=""; [ $v = merge0 ] && e="MC_GPU_MERGE=0"
    env $e MC_GPU_DIAG=1 MC_LOG_LEVEL=warn GPU_FIXED_COST_ONLY=row:65536:128:pipe \
      timeout 20 build/bench/gpu_fixed_cost /tmp/gfc 200 5 2>&1 | tee -a "${OUT:-/tmp}/finish.txt" |
      python3 -c '
import sys, json
d = {}
for l in sys.stdin:
    if l.startswith("{"):
        j = json.loads(l); d[j["row"]] = j
g, w = d.get("diag", {}), d.get("write_65536_b128_pipe", {})
k = ["launches", "copies_per_launch", "launch_us", "done_us", "gpu_us_per_kernel", "queries",
     "query_us", "finish_us_per_launch", "polls", "loops"]
print(sys.argv[1], w.get("median_gbps"), w.get("per_batch_us"), w.get("submit_per_batch_us"),
      " ".join("%s=%s" % (x, g.get(x)) for x in k))' "$v $r"
  done
done
