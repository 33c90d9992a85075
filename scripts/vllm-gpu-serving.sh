#!/usr/bin/env bash
# The serving benchmark on the GPU machine (issue #31, docs/vllm-gpu.md):
# benchmarks/serving_bench.py with its vLLM 0.26 servers on GPU 0, over the
# engine's same-host GPU path (ipc) or TCP with GPU staging (tcp).
#   OUT=$OUT bash scripts/vllm-gpu-serving.sh ipc|tcp [serving_bench.py args...]
# The first call of a lease (from a copy of this repository that carries
# .debs, once every part of scripts/vllm-gpu-prepare.sh is staged there:
# vllm-gpu-install.sh stage) builds _core, installs vLLM into /tmp/vllm-site
# and keeps the built copy in /tmp/mc-gpu-serving; a later call while the
# machine is warm runs from that copy (`bash /tmp/mc-gpu-serving/scripts/
# vllm-gpu-serving.sh tcp`), nothing carried.  Default benchmark: --kv32k,
# lengths 128,512,1024,1900, 10 requests, colocated, flows a and b (first
# token both ways), push (whole prompt), push layer by layer (the producer
# streams CUDA layers as computed) and push_layer_load (decode waits per
# layer too); serving_bench.py args given later win.  Out:
# serving_gpu_<path>.{json,png,txt}, logs_<path>.tar.xz.  With
# MC_SERVING_TIMELINE="<ttft_timeline.py args>" a traced
# benchmarks/ttft_timeline.py pass follows on fresh servers (same path;
# MC_TIMELINE_TIMEOUT, 200 s): timeline_<path>.tar.xz (its JSON, printout,
# MC_TRACE file capped at MC_TRACE_MAX_MB per process, 12, and server logs).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/device-lib.sh
path="${1:-}"
gpu_path=$(mc_gpu_path_arg "$path" "$0 ipc|tcp [serving_bench.py args...]") || exit 2
shift
out="${OUT:-/tmp/vllm-gpu-serving-out}"
mkdir -p "$out"
t0=$SECONDS
mc_gpu_serving_enter "$out" || exit 1
uptime | tee -a "$out/machine.txt"
timeout "${MC_SERVING_TIMEOUT:-420}" python3 -P benchmarks/serving_bench.py --device cuda \
    --gpu-path "$gpu_path" --kv32k --lengths 128,512,1024,1900 --requests 10 \
    --modes disaggregated,disaggregated_decode_first,flow_b,flow_b_decode_first,push,push_layerwise,push_layer_load \
    --start-timeout 200 --workdir "/tmp/gs-$path" --out "$out/serving_gpu_$path.json" \
    --plot "$out/serving_gpu_$path.png" "$@" 2>&1 | tee "$out/serving_gpu_$path.txt"
rc=${PIPESTATUS[0]}
uptime | tee -a "$out/machine.txt"
tar -C "/tmp/gs-$path" -cf - logs 2>/dev/null | xz -3 -T4 >"$out/logs_$path.tar.xz"
if [ -n "${MC_SERVING_TIMELINE:-}" ]; then
  # Then one traced pass of benchmarks/ttft_timeline.py on fresh servers
  # (MC_TRACE; MC_SERVING_TIMELINE holds its args, e.g. "--lengths
  # 128,1024,1900 --requests 6"): where push_layer_load's TTFT goes.
  tl="/tmp/tl-$path"
  rm -rf "$tl" && mkdir -p "$tl/work"
  # shellcheck disable=SC2086 # the args are words on purpose
  MC_TRACE_MAX_MB="${MC_TRACE_MAX_MB:-12}" timeout "${MC_TIMELINE_TIMEOUT:-200}" \
      python3 -P benchmarks/ttft_timeline.py --device cuda --gpu-path "$gpu_path" \
      --workdir "$tl/work" --out "$tl/ttft_timeline_$path.json" $MC_SERVING_TIMELINE 2>&1 \
      | tee "$tl/ttft_timeline_$path.txt"
  echo "ttft_timeline ($path) rc=${PIPESTATUS[0]}"
  uptime | tee -a "$out/machine.txt"
  tar -C "$tl" -cf - . 2>/dev/null | xz -3 -T4 >"$out/timeline_$path.tar.xz"
fi
echo "serving_bench ($path) rc=$rc after $((SECONDS - t0)) s"
exit $rc
