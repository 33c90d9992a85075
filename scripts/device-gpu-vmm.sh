#!/usr/bin/env bash
# Driver-mapped (cuMem) KV memory on the GPU machine (issue #25): builds, runs
# the C GPU tests (test_gpu_vmm: several cuMemCreate chunks in one range,
# two processes, same-host GPU path and TCP GPU staging, GB/s of each against
# classic cuMemAlloc memory in the same run; test_gpu, test_gpu_same_host,
# test_cuda_driver), then the worker-half tests of tests/test_gpu_worker.py,
# including KV caches allocated by vLLM 0.34's own allocator (its wheel's
# vllm/utils/{extensible_tensor,vmm_driver}.py under .vllm034/, see
# docs/device.md).  Carry .debs and .wheels (pytest, pytest-timeout).
#   OUT=$OUT bash scripts/device-gpu-vmm.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-/tmp/device-gpu-vmm}"
mkdir -p "$out"
rm -rf build
source scripts/device-lib.sh
mc_unpack_debs
rc=0
make -s -j16 WERROR=1 lib tests >"$out/make.log" 2>&1 || { rc=1; tail -30 "$out/make.log"; }
for t in test_gpu_vmm test_cuda_driver test_gpu test_gpu_same_host; do
  echo "== $t"; MC_LOG_LEVEL=warn timeout 240 build/tests/$t || rc=1
done 2>&1 | tee "$out/test-c.log"
py=python3
if ! $py -c 'import pytest, pytest_timeout' 2>/dev/null; then
  $py -m venv --system-site-packages /tmp/mcvenv >/dev/null 2>&1
  /tmp/mcvenv/bin/pip install -q --no-index --find-links .wheels pytest pytest-timeout \
      >"$out/venv.log" 2>&1
  py=/tmp/mcvenv/bin/python
fi
MC_WERROR=1 $py setup.py -q build_ext --inplace -j 16 >"$out/build_ext.log" 2>&1 || {
  rc=1; tail -20 "$out/build_ext.log"; }
VLLM034_SRC="$PWD/.vllm034" PYTHONPATH="$PWD" MC_LOG_LEVEL=info timeout 400 \
  $py -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_gpu_worker.py --timeout 200 -s \
  >"$out/pytest.log" 2>&1 || rc=1
grep -E "worker load|passed|failed|Error|error:" "$out/pytest.log" | tail -30
exit $rc
