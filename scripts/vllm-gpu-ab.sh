#!/usr/bin/env bash
# Same-lease A/B of two code trees on the GPU machine (issue 31, run 20):
# benchmarks/ttft_timeline.py --device cuda with this tree's servers (A),
# a second prefill + decode + push layer-load proxy from TREE_B, all on GPU
# 0 at once, every prompt through every mode (docs/vllm-gpu.md).
#   OUT=$OUT bash scripts/vllm-gpu-ab.sh TREE_B TAG [ttft_timeline.py args...]
# The first call of a lease (this tree carrying .debs, every part of
# scripts/vllm-gpu-prepare.sh staged: vllm-gpu-install.sh stage) builds
# _core in place in both trees, installs vLLM into /tmp/vllm-site and keeps
# both built trees in /tmp/mc-ab/{a,b}; a later call while the machine is
# warm runs from there (`bash /tmp/mc-ab/a/scripts/vllm-gpu-ab.sh
# /tmp/mc-ab/b TAG ...`), nothing carried.  MC_AB_TIMEOUT (420 s) caps the
# benchmark.  Out: ab_TAG.{txt,json}, logs_TAG.tar.xz (server logs; the
# MC_TRACE file when traced), machine.txt, build logs on the first call.
set -uo pipefail
tree_b="${1:?usage: $0 TREE_B TAG [ttft_timeline.py args...]}"
tag="${2:?usage: $0 TREE_B TAG [ttft_timeline.py args...]}"
shift 2
[ -d "$tree_b/mooncake_connector" ] \
  || { echo "$0: $tree_b has no mooncake_connector/ (a source tree)" >&2; exit 2; }
tree_b=$(cd "$tree_b" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-/tmp/vllm-gpu-ab-out}"
run=/tmp/mc-ab
mkdir -p "$out"
t0=$SECONDS
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ ! -f "$run/.built" ]; then
  source scripts/device-lib.sh
  mc_unpack_debs
  # B's _core beside A's build and vLLM's install (16 cores)
  (cd "$tree_b" && { MC_WERROR=1 python3 setup.py -q build_ext --inplace -j 8 \
      || python3 setup.py -q build_ext --inplace; }) >"$out/build_b.log" 2>&1 &
  bpid=$!
  mc_build_and_install_vllm "$out" || exit 1
  wait $bpid || { echo "tree B build failed:"; tail -30 "$out/build_b.log"; exit 1; }
  tail -3 "$out/build_b.log"
  rm -rf "$run" && mkdir -p "$run/a" "$run/b"
  tar --exclude=./.debs -cf - . | tar -xf - -C "$run/a"
  (cd "$tree_b" && tar --exclude=./.debs -cf - .) | tar -xf - -C "$run/b"
  touch "$run/.built"
  echo "built both trees, vLLM installed, after $((SECONDS - t0)) s"
fi
cd "$run/a"
export CPATH=/opt/debs/usr/include LIBRARY_PATH=/opt/debs/usr/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH=/opt/debs/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export PYTHONPATH=/tmp/vllm-site:$PWD PYTHONUNBUFFERED=1
for t in "$run/a" "$run/b"; do
  PYTHONPATH=/tmp/vllm-site:$t python3 -P -c \
      'import mooncake_connector._core as c; print("_core", c.__file__)' || exit 1
done
# which commits (written beside each tree when it was carried, if at all)
for t in a b; do echo "tree $t: $(cat "$run/$t/.ab-commit" 2>/dev/null || echo '?')"; done
uptime | tee -a "$out/machine.txt"
w="/tmp/ab-$tag"
rm -rf "$w" && mkdir -p "$w"
MC_TRACE_MAX_MB="${MC_TRACE_MAX_MB:-24}" timeout "${MC_AB_TIMEOUT:-420}" \
    python3 -P benchmarks/ttft_timeline.py --device cuda --no-ab --tree-b "$run/b" \
    --workdir "$w/work" --out "$out/ab_$tag.json" "$@" 2>&1 | tee "$out/ab_$tag.txt"
rc=${PIPESTATUS[0]}
uptime | tee -a "$out/machine.txt"
nvidia-smi --query-gpu=memory.used --format=csv,noheader >>"$out/machine.txt" 2>&1
(cd "$w/work" && find . -name '*.log' -o -name 'trace.jsonl' | tar -cf - -T -) \
    2>/dev/null | xz -3 -T4 >"$out/logs_$tag.tar.xz"
echo "ab ($tag) rc=$rc after $((SECONDS - t0)) s"
exit $rc
