#!/usr/bin/env bash
# GPU checks on the device machine (issue #7): build, the C GPU tests
# (test_cuda_driver, test_gpu*), the pytest GPU tests (-m gpu: the engine and
# the connector's worker half) and benchmarks/gpu_bench.py.  Carry .debs and
# .wheels as for scripts/device-check.sh (see docs/device.md).
#   OUT=$OUT bash scripts/device-gpu.sh [--no-bench] [--quick-bench] [--full]
# --full also runs every C test and the whole pytest suite.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-/tmp/device-gpu}"
mkdir -p "$out"
bench=1 quick="" full=0 pytest=1 allc=0
for a in "$@"; do
  case "$a" in
  --no-bench) bench=0 ;;
  --quick-bench) quick=--quick ;;
  --full) full=1 ;;
  --no-pytest) pytest=0 ;;
  --all-c) allc=1 ;;
  esac
done
rm -rf build build-san
source scripts/device-lib.sh
mc_unpack_debs
export PATH=/opt/debs/usr/bin:$PATH
python3 -m venv --system-site-packages /tmp/mcvenv >"$out/venv.log" 2>&1
# python3 there may itself be a venv (torch lives in it): make its packages
# visible in ours too.
tsite=$(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))' 2>/dev/null)
if [ -n "$tsite" ]; then
  echo "$tsite" >"$(/tmp/mcvenv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz-torch-site.pth"
fi
/tmp/mcvenv/bin/pip install -q --no-index --find-links .wheels aiohttp pytest pytest-timeout \
    >>"$out/venv.log" 2>&1
py=/tmp/mcvenv/bin/python
{ nproc; $py --version; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader;
  nvidia-smi topo -m; $py -c 'import torch; print(torch.__version__, torch.cuda.device_count())'
} >"$out/machine.txt" 2>&1
rc=0
make -s -j8 WERROR=1 all >"$out/make.log" 2>&1 || rc=1
# A subshell: a failing test binary must fail this step, not end the script
# (the pytest tests and the benchmark still run and report).
( echo "== test_cuda_driver"; timeout 120 build/tests/test_cuda_driver || exit 1
  for t in build/tests/test_gpu*; do
    echo "== $(basename "$t")"; MC_LOG_LEVEL=info timeout 300 "$t" || exit 1
  done ) >"$out/test-c.log" 2>&1 || rc=1
if [ $full = 1 ] || [ $allc = 1 ]; then
  timeout 400 make -s test-c >>"$out/test-c.log" 2>&1 || rc=1
fi
MC_WERROR=1 $py -m pip install -q --no-build-isolation . >"$out/pip.log" 2>&1 || rc=1
sel=(-m gpu "$PWD/tests/test_gpu.py" "$PWD/tests/test_gpu_worker.py")
[ $full = 1 ] && sel=("$PWD/tests")
if [ $pytest = 1 ]; then
  (cd /tmp && MC_LOG_LEVEL=info $py -m pytest -q -rs -p no:cacheprovider "${sel[@]}" --timeout 300 \
      >"$out/pytest.log" 2>&1) || rc=1
fi
if [ $bench = 1 ]; then
  (cd /tmp && timeout 420 $py "$OLDPWD/benchmarks/gpu_bench.py" $quick --out "$out/gpu_bench.json" \
      >"$out/gpu_bench.log" 2>&1) || rc=1
fi
{ cat "$out/machine.txt"; tail -30 "$out/test-c.log"; tail -15 "$out/pytest.log";
  cat "$out/gpu_bench.log" 2>/dev/null; tail -20 "$out/make.log"; } >"$out/summary.txt"
cat "$out/summary.txt"
exit $rc
