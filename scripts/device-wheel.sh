#!/usr/bin/env bash
# The binary wheel on the GPU machine, with nothing else carried (no .debs,
# no build): a fresh venv over the machine's Python (torch visible),
# `pip install --no-index --no-deps` of the wheel, then the GPU tests and
# doctor importing the INSTALLED wheel.  docs/install.md says how to carry it.
#   OUT=$OUT bash scripts/device-wheel.sh WHEEL TESTS_DIR
set -uo pipefail
whl="$1" tests="$(cd "$2" && pwd)"
out="${OUT:-/tmp/device-wheel}"
mkdir -p "$out"
venv=/tmp/mcwheel
rm -rf "$venv"
{
  echo "== machine"; nproc; python3 --version; uname -r
  grep PRETTY_NAME /etc/os-release; ldd --version | head -1
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  echo "== system copies of the libraries the wheel vendors (not used: ldd in install.log shows its own)"
  ldconfig -p | grep -E 'libcjson|libhiredis|libxxhash' || echo "none"
} >"$out/machine.txt" 2>&1
python3 -m venv --system-site-packages "$venv" >"$out/install.log" 2>&1
# python3 there is itself a venv holding torch: make its packages visible.
tsite=$(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')
echo "$tsite" >"$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz-torch-site.pth"
rc=0
"$venv/bin/pip" install --no-index --no-deps "$whl" >>"$out/install.log" 2>&1 || rc=1
py="$venv/bin/python"
(cd /tmp && VENV=$venv $py -P -c 'import mooncake_connector._core as c, os
assert c.__file__.startswith(os.environ["VENV"]), c.__file__ + " is not the installed wheel"
print("installed wheel imported:", c.__file__)' &&
  ldd "$venv"/lib/python3*/site-packages/mooncake_connector/_core*.so) >>"$out/install.log" 2>&1 || rc=1
(cd /tmp && PYTHONSAFEPATH=1 MC_LOG_LEVEL=warning $py -P -m pytest -q -rs -p no:cacheprovider \
    --timeout 300 -m gpu "$tests/test_gpu.py" "$tests/test_gpu_worker.py" >"$out/pytest-gpu.log" 2>&1) || rc=1
(cd /tmp && PYTHONSAFEPATH=1 $py -P -m pytest -q -rs -p no:cacheprovider --timeout 120 \
    "$tests/test_doctor.py" "$tests/test_transfer.py" >"$out/pytest-cpu.log" 2>&1) || rc=1
printf '{"prefill_url": "127.0.0.1:17311", "decode_url": "127.0.0.1:17511", "metadata_server": "P2PHANDSHAKE"}' >/tmp/mc.json
(cd /tmp && "$venv/bin/mooncake-connector" doctor --config /tmp/mc.json >"$out/doctor.txt" 2>&1) || rc=1
{ cat "$out/machine.txt"; tail -25 "$out/install.log"; tail -15 "$out/pytest-gpu.log";
  tail -8 "$out/pytest-cpu.log"; cat "$out/doctor.txt"; } >"$out/summary.txt"
cat "$out/summary.txt"
exit $rc
