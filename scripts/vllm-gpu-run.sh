#!/usr/bin/env bash
# The GPU end-to-end run (issue #27, docs/vllm-gpu.md), on the GPU machine,
# from a copy of this repository that carries .debs (as for
# scripts/device-gpu.sh) once every part of scripts/vllm-gpu-prepare.sh is
# staged there (vllm-gpu-install.sh stage):
#   OUT=$OUT bash scripts/vllm-gpu-run.sh [vllm_gpu_e2e.py args...]
# Builds _core in place, installs vLLM 0.26 into /tmp/vllm-site, runs
# scripts/vllm_gpu_e2e.py; logs and vllm_gpu_e2e.json under $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-/tmp/vllm-gpu-out}"
mkdir -p "$out"
t0=$SECONDS
source scripts/device-lib.sh
mc_unpack_debs
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mc_build_and_install_vllm "$out" || exit 1
export PYTHONPATH=/tmp/vllm-site:$PWD PYTHONUNBUFFERED=1
python3 -c 'import mooncake_connector._core as c; print("_core", c.__file__)' || exit 1
timeout "${MC_E2E_TIMEOUT:-480}" python3 scripts/vllm_gpu_e2e.py --workdir /tmp/vgpu-e2e \
    --out "$out/vllm_gpu_e2e.json" "$@" 2>&1 | tee "$out/e2e.log"
rc=${PIPESTATUS[0]}
# Server logs: the decode/prefill ones hold the connector's lines.
tar -C /tmp/vgpu-e2e -cf - --exclude=model . 2>/dev/null | xz -3 -T4 >"$out/logs.tar.xz"
echo "e2e rc=$rc after $((SECONDS - t0)) s"
exit $rc
