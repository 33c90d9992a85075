#!/usr/bin/env bash
# The stopped-producer fault probe on the GPU machine (docs/vllm-gpu.md,
# "Stopped-producer probe"): benchmarks/stopped_producer_probe.py with its
# vLLM 0.26 prefill, decode and colocated servers on GPU 0, the producer
# writing into the decode's KV cache over the engine's same-host GPU path
# (ipc: CUDA IPC) or TCP with GPU staging (tcp).
#   OUT=$OUT bash scripts/vllm-gpu-stopped-producer.sh ipc|tcp [probe args...]
# Set up as scripts/vllm-gpu-serving.sh (the first call of a lease builds
# _core, installs vLLM into /tmp/vllm-site and keeps the built copy in
# /tmp/mc-gpu-serving; a later call while the machine is warm runs from that
# copy, this script's probe copied in if the copy predates it).  Out:
# stopped_producer_<path>/{stopped_producer_probe.json,.txt,logs.tar.xz} and
# stopped_producer_<path>.txt (the printout).  Exit status: the probe's (0 all
# checks passed, 1 a check failed, 2 the servers did not start).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/device-lib.sh
path="${1:-}"
gpu_path=$(mc_gpu_path_arg "$path" "$0 ipc|tcp [stopped_producer_probe.py args...]") || exit 2
shift
out="${OUT:-/tmp/vllm-gpu-serving-out}"
probe=benchmarks/stopped_producer_probe.py
mkdir -p "$out"
t0=$SECONDS
mc_gpu_serving_enter "$out" "$probe" || exit 1
uptime | tee -a "$out/machine.txt"
rm -rf "/tmp/sp-$path"
timeout "${MC_PROBE_TIMEOUT:-420}" python3 -P "$probe" --device cuda --gpu-path "$gpu_path" \
    --start-timeout 200 --workdir "/tmp/sp-$path" --out "$out/stopped_producer_$path" "$@" \
    2>&1 | tee "$out/stopped_producer_$path.txt"
rc=${PIPESTATUS[0]}
uptime | tee -a "$out/machine.txt"
echo "stopped_producer_probe ($path) rc=$rc after $((SECONDS - t0)) s"
exit $rc
