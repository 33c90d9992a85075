#!/usr/bin/env bash
# Build and test this checkout on the GPU machine (no network there).
#
# Here, once:   ../shared/tools/device-debs.sh libcjson1 libcjson-dev libhiredis0.14 libhiredis-dev \
#                   libxxhash0 libxxhash-dev libcurl4-openssl-dev iperf3 libiperf0 libsctp1
#               .venv/bin/pip download aiohttp pytest pytest-timeout --python-version 3.12 \
#                   --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
#                   --platform manylinux_2_28_x86_64 --platform any -d .wheels
# There:        scripts/device-check.sh        (device run with carry [".debs", ".wheels"])
# Writes logs and a summary under ${OUT:-/tmp/device-check}.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-/tmp/device-check}"
mkdir -p "$out"

# 1. Debian packages the machine lacks, unpacked beside (not over) its own.
rm -rf build build-san
source scripts/device-lib.sh
mc_unpack_debs
export PATH=/opt/debs/usr/bin:$PATH

# 2. A venv on the machine's Python (keeps its torch/numpy) plus carried wheels.
python3 -m venv --system-site-packages /tmp/mcvenv >"$out/venv.log" 2>&1
/tmp/mcvenv/bin/pip install -q --no-index --find-links .wheels aiohttp pytest pytest-timeout \
    >>"$out/venv.log" 2>&1
py=/tmp/mcvenv/bin/python
{ nproc; $py --version; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } \
    >"$out/machine.txt" 2>&1

# 3. C side: -Werror build, C tests (the CUDA one sees the GPU here).
rc=0
make -s WERROR=1 all >"$out/make.log" 2>&1 || rc=1
make -s test-c >"$out/test-c.log" 2>&1 || rc=1

# 4. The package and the Python tests.
$py -m pip install -q --no-build-isolation . >"$out/pip.log" 2>&1 || rc=1
(cd /tmp && $py -m pytest -q -p no:cacheprovider "$OLDPWD/tests" --timeout 300 \
    >"$out/pytest.log" 2>&1) || rc=1

# 5. Bandwidth on this many-core host: our engine vs iperf3, same run.
if command -v iperf3 >/dev/null; then
  iperf3 -s -1 -p 5201 >/dev/null 2>&1 &
  sleep 0.5
  iperf3 -c 127.0.0.1 -p 5201 -t 5 >"$out/iperf3.log" 2>&1
fi
coproc T { MC_TCP_IO_THREADS=4 build/bench/mc_bench target --size 1073741824; }
T_PID=$!
read -r _ SEG _ ADDR <&"${T[0]}"
for op in write read; do
  build/bench/mc_bench initiator --segment "$SEG" --addr "$ADDR" --op $op --block 65536 \
      --lat-iters 20000 >>"$out/mc_bench.log" 2>&1
  # The same 1 GiB through a 4 MiB working set, as iperf3 reuses one buffer.
  build/bench/mc_bench initiator --segment "$SEG" --addr "$ADDR" --op $op --block 65536 \
      --ws 4194304 >>"$out/mc_bench.log" 2>&1
done
for t in 2 4; do  # striping over several connections and I/O threads
  MC_TCP_CONNS_PER_PEER=$t MC_TCP_IO_THREADS=$t build/bench/mc_bench initiator --segment "$SEG" \
      --addr "$ADDR" --block 65536 >>"$out/mc_bench.log" 2>&1
done
[ -n "${T_PID:-}" ] && kill "$T_PID" 2>/dev/null
wait

tail -3 "$out/test-c.log" "$out/pytest.log" "$out/iperf3.log" "$out/mc_bench.log" 2>/dev/null \
    >"$out/summary.txt"
cat "$out/machine.txt" "$out/summary.txt"
exit $rc
