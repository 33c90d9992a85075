#!/usr/bin/env bash
# The connector's worker-half GPU tests alone (tests/test_gpu_worker.py -m
# gpu: CUDA KV caches between two workers, vLLM 0.34's driver-mapped KV cache
# where .vllm034 is carried, layer-wise push and layer read on CUDA), on the
# GPU machine, in about a minute once started: no C test binaries, no
# benchmark.  Carry .debs and .wheels (docs/device.md); optional first
# argument: a pytest -k expression.
#   OUT=$OUT bash scripts/device-gpu-worker.sh ["layer_read or layerwise"]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-/tmp/device-gpu-worker}"
mkdir -p "$out"
source scripts/device-lib.sh
mc_unpack_debs
python3 -m venv --system-site-packages /tmp/mcvenv >"$out/venv.log" 2>&1
tsite=$(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')
echo "$tsite" >"$(/tmp/mcvenv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz-torch-site.pth"
/tmp/mcvenv/bin/pip install -q --no-index --find-links .wheels aiohttp pytest pytest-timeout \
    >>"$out/venv.log" 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/machine.txt"
MC_WERROR=1 /tmp/mcvenv/bin/python -m pip install -q --no-build-isolation . >"$out/pip.log" 2>&1 \
    || { tail -30 "$out/pip.log"; exit 1; }
[ -d .vllm034 ] && export VLLM034_SRC=$PWD/.vllm034
k=(); [ -n "${1:-}" ] && k=(-k "$1")
(cd /tmp && MC_LOG_LEVEL=info /tmp/mcvenv/bin/python -m pytest -q -rs -p no:cacheprovider -m gpu \
    "$OLDPWD/tests/test_gpu_worker.py" "${k[@]}" --timeout 240 -s >"$out/pytest.log" 2>&1)
rc=$?
grep -E "layer read on CUDA|passed|failed|error|SKIP" "$out/pytest.log" | tail -30
exit $rc
