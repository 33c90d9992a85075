#!/usr/bin/env bash
# vLLM's in-tree MooncakeConnector on the GPU machine (issue 31,
# docs/vllm-gpu.md "The in-tree connector on the GPU"): the serving
# benchmark's in-tree phase (benchmarks/serving_bench.py --device cuda
# --modes ...,intree) on Mooncake's own CUDA engine behind vllm-router and
# behind benchmarks/intree_proxy.py, beside our push modes, on GPU 0.
#
#   bash scripts/vllm-gpu-intree.sh prepare [DIR]     here, with network (DIR: .intree-gpu)
#   bash scripts/vllm-gpu-intree.sh stage [DIR]       there, in a call that carries DIR
#   OUT=$OUT bash scripts/vllm-gpu-intree.sh run ipc|tcp [serving_bench.py args...]   there
#
# prepare: DIR/mooncake/ gets Mooncake's CUDA engine (mooncake-transfer-engine
#   MC_MOONCAKE_VERSION, 0.3.13.post1, cp312) trimmed to what `mooncake.engine`
#   loads (its NEEDED closure inside the wheel, and the Python files) plus
#   libcudart.so.12 (nvidia-cuda-runtime-cu12 12.9.79) in
#   mooncake_transfer_engine.libs/ (the engine's RPATH; the machine has CUDA
#   13 only), as one tar.xz; DIR/router/ gets vllm-router (the version
#   tests/vllm_router_pkg.py pins) and orjson for CPython 3.12 installed with
#   pip --target, as one tar.xz.  Each with SHA256SUMS; downloads kept in
#   .cache/intree-gpu.  MC_MOONCAKE_GPU_TAR=FILE: take an already trimmed
#   engine tarball instead of the wheel (its unused libraries still dropped).
# stage: checks and unpacks what of DIR was carried into $MC_INTREE_STAGE
#   (/tmp/mc-intree: mooncake-site/, router-site/; /tmp survives while the
#   machine is warm) and tries the imports.
# run: the serving scripts' set-up (scripts/device-lib.sh
#   mc_gpu_serving_enter: the first call of a lease builds _core and installs
#   the staged vLLM, later calls run from /tmp/mc-gpu-serving), stages DIR
#   first if it was carried and is not staged yet, then serving_bench.py
#   --device cuda with our servers over the engine's same-host GPU path (ipc)
#   or TCP with GPU staging (tcp; the in-tree connector always uses Mooncake's
#   TCP transport), default --kv32k --lengths 128,1024,1900 --requests 8
#   --modes push,push_layer_load,intree (colocated always measured;
#   serving_bench.py args given later win), MC_INTREE_TIMEOUT (420 s).  Out:
#   intree_gpu_<path>.{json,png,txt}, logs_intree_<path>.tar.xz.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
stage_dir="${MC_INTREE_STAGE:-/tmp/mc-intree}"
die() { echo "vllm-gpu-intree: $*" >&2; exit 1; }

intree_prepare() {
  local dir="$1" cache=.cache/intree-gpu ver="${MC_MOONCAKE_VERSION:-0.3.13.post1}" rver tmp
  local py="${PYTHON:-python3}"
  local plat=(--only-binary=:all: --python-version 3.12 --implementation cp
              --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
              --platform manylinux2014_x86_64)
  rver=$(sed -n 's/^ROUTER_VERSION = "\(.*\)"/\1/p' tests/vllm_router_pkg.py)
  [ -n "$rver" ] || die "no ROUTER_VERSION in tests/vllm_router_pkg.py"
  tmp="$cache/build"
  rm -rf "$tmp" && mkdir -p "$tmp" "$dir/mooncake" "$dir/router"
  # Mooncake's CUDA engine, trimmed.
  if [ -n "${MC_MOONCAKE_GPU_TAR:-}" ]; then
    mkdir -p "$tmp/mc"
    xz -dc "$MC_MOONCAKE_GPU_TAR" | tar -xf - -C "$tmp/mc" || die "unpacking $MC_MOONCAKE_GPU_TAR"
  else
    "$py" -m pip download -q --no-deps --disable-pip-version-check "${plat[@]}" -d "$cache" \
        "mooncake-transfer-engine==$ver" nvidia-cuda-runtime-cu12==12.9.79 \
      || die "pip download of mooncake-transfer-engine $ver / nvidia-cuda-runtime-cu12 failed"
    mkdir -p "$tmp/mc" "$tmp/rt"
    unzip -q "$cache/mooncake_transfer_engine-$ver-cp312-"*.whl -d "$tmp/mc" || die "unzip engine"
    unzip -q "$cache"/nvidia_cuda_runtime_cu12-12.9.79-*.whl 'nvidia/cuda_runtime/lib/libcudart.so.12' \
        -d "$tmp/rt" || die "unzip cudart"
    cp "$tmp/rt/nvidia/cuda_runtime/lib/libcudart.so.12" "$tmp/mc/mooncake_transfer_engine.libs/"
  fi
  [ -f "$tmp/mc/mooncake_transfer_engine.libs/libcudart.so.12" ] \
    || die "no mooncake_transfer_engine.libs/libcudart.so.12 in the engine"
  # Keep what `mooncake.engine` loads: the shared objects NEEDED from
  # engine.so (and the package's two small modules) found inside the
  # package, every Python file, and drop the rest (store, pg, ep, binaries).
  "$py" - "$tmp/mc" <<'PY' || die "trimming the engine"
import os, re, subprocess, sys
root = sys.argv[1]
dirs = ["mooncake", "mooncake_transfer_engine.libs"]
libs = {}
for d in dirs:
    for dp, _, fs in os.walk(os.path.join(root, d)):
        for f in fs:
            if ".so" in f and os.path.isfile(os.path.join(dp, f)):
                libs.setdefault(f, os.path.join(dp, f))
todo = [f for f in libs if f == "engine.so" or f.startswith(("_fast_copy.", "nvlink_allocator"))]
if "engine.so" not in todo:
    sys.exit("no mooncake/engine.so in the wheel")
keep = set()
while todo:
    f = todo.pop()
    if f in keep:
        continue
    keep.add(f)
    out = subprocess.run(["readelf", "-d", libs[f]], capture_output=True, text=True, check=True)
    todo += [n for n in re.findall(r"\(NEEDED\)\s+Shared library: \[(.*)\]", out.stdout) if n in libs]
gone = 0
for d in dirs:
    for dp, _, fs in os.walk(os.path.join(root, d)):
        for f in fs:
            p = os.path.join(dp, f)
            if not (f.endswith((".py", ".c")) or f in keep):
                gone += os.path.getsize(p)
                os.remove(p)
print(f"vllm-gpu-intree: engine kept {sorted(keep)}; dropped {gone >> 20} MiB")
PY
  rm -f "$dir"/mooncake/*.tar.xz
  (cd "$tmp/mc" && tar -cf - mooncake mooncake_transfer_engine.libs mooncake_transfer_engine-*.dist-info) \
    | xz -9e -T2 >"$dir/mooncake/mooncake-cuda-engine.tar.xz" || die "packing the engine"
  (cd "$dir/mooncake" && sha256sum mooncake-cuda-engine.tar.xz >SHA256SUMS)
  # vllm-router and orjson (its launcher imports it) for CPython 3.12.
  "$py" -m pip download -q --no-deps --disable-pip-version-check "${plat[@]}" -d "$cache" \
      "vllm-router==$rver" orjson || die "pip download of vllm-router $rver / orjson failed"
  mkdir -p "$tmp/router"
  "$py" -m pip install -q --no-deps --no-index --no-compile --disable-pip-version-check \
      "${plat[@]}" --find-links "$cache" --target "$tmp/router" "vllm-router==$rver" orjson \
    || die "pip install --target of the router"
  rm -f "$dir"/router/*.tar.xz
  tar -C "$tmp/router" -cf - . | xz -9e -T2 >"$dir/router/vllm-router-site.tar.xz" \
    || die "packing the router"
  (cd "$dir/router" && sha256sum vllm-router-site.tar.xz >SHA256SUMS)
  rm -rf "$tmp"
  du -b "$dir"/*/*.tar.xz
  echo "vllm-gpu-intree: carry $dir (or $dir/mooncake and $dir/router in calls of their own)"
}

# Unpacks what of DIR was carried (each part checked) into $stage_dir.
intree_stage() {
  local dir="$1" part site n=0
  for part in mooncake router; do
    [ -f "$dir/$part/SHA256SUMS" ] || continue
    (cd "$dir/$part" && sha256sum -c --quiet SHA256SUMS) \
      || die "$dir/$part: checksum mismatch (a broken transfer: carry it again)"
    site="$stage_dir/$part-site"
    rm -rf "$site" && mkdir -p "$site"
    xz -dc "$dir/$part"/*.tar.xz | tar -xf - -C "$site" || die "unpacking $dir/$part"
    echo "vllm-gpu-intree: staged $part in $site ($(du -sh "$site" | cut -f1))"
    n=$((n + 1))
  done
  [ $n -gt 0 ] || die "nothing to stage in $dir (carry $dir made by '$0 prepare')"
  intree_check
}

# Tries the imports that need no vLLM (the engine: libcudart 12 and the
# driver; the router's Rust module and orjson).
intree_check() {
  local ld="${LD_LIBRARY_PATH:-}"
  [ -d /opt/debs/usr/lib/x86_64-linux-gnu ] && ld="/opt/debs/usr/lib/x86_64-linux-gnu:$ld"
  if [ -d "$stage_dir/mooncake-site/mooncake" ]; then
    LD_LIBRARY_PATH="$ld" PYTHONPATH="$stage_dir/mooncake-site" python3 -c \
      'import mooncake.engine as e; print("vllm-gpu-intree: import mooncake.engine:", e.__file__)' \
      || echo "vllm-gpu-intree: mooncake.engine does not import (above); the in-tree phase will fail"
  fi
  if [ -d "$stage_dir/router-site/vllm_router" ]; then
    PYTHONPATH="$stage_dir/router-site" python3 -c \
      'import vllm_router_rs, orjson; print("vllm-gpu-intree: import vllm_router_rs, orjson", orjson.__version__)' \
      || echo "vllm-gpu-intree: the router's modules do not import (above)"
  fi
}

intree_staged() {
  [ -f "$stage_dir/mooncake-site/mooncake/engine.so" ] \
    && ls "$stage_dir"/router-site/vllm_router_rs*.so >/dev/null 2>&1
}

cmd="${1:-}"
shift || true
case "$cmd" in
prepare) intree_prepare "${1:-.intree-gpu}" ;;
stage) intree_stage "${1:-.intree-gpu}" ;;
run)
  source scripts/device-lib.sh
  path="${1:-}"
  gpu_path=$(mc_gpu_path_arg "$path" "$0 run ipc|tcp [serving_bench.py args...]") || exit 2
  shift
  out="${OUT:-/tmp/vllm-gpu-intree-out}"
  mkdir -p "$out"
  t0=$SECONDS
  if ! intree_staged && [ -d .intree-gpu ]; then
    intree_stage .intree-gpu
  fi
  intree_staged || die "Mooncake's engine and vllm-router are not both staged in $stage_dir (the machine went back, or a part was not carried?): carry .intree-gpu (made by '$0 prepare') and run '$0 stage', or this again"
  mc_gpu_serving_enter "$out" benchmarks/serving_bench.py benchmarks/intree_proxy.py \
      mooncake_connector/vllm_gpu.py scripts/vllm-gpu-intree.sh || exit 1
  uptime | tee -a "$out/machine.txt"
  rm -rf "/tmp/gi-$path"
  MC_VLLM_ROUTER_SITE="$stage_dir/router-site" timeout "${MC_INTREE_TIMEOUT:-420}" \
      python3 -P benchmarks/serving_bench.py --device cuda --gpu-path "$gpu_path" --kv32k \
      --lengths 128,1024,1900 --requests 8 --modes push,push_layer_load,intree \
      --mooncake-site "$stage_dir/mooncake-site" --start-timeout 200 --workdir "/tmp/gi-$path" \
      --out "$out/intree_gpu_$path.json" --plot "$out/intree_gpu_$path.png" "$@" 2>&1 \
    | tee "$out/intree_gpu_$path.txt"
  rc=${PIPESTATUS[0]}
  uptime | tee -a "$out/machine.txt"
  tar -C "/tmp/gi-$path" -cf - logs 2>/dev/null | xz -3 -T4 >"$out/logs_intree_$path.tar.xz"
  echo "serving_bench in-tree ($path) rc=$rc after $((SECONDS - t0)) s"
  exit "$rc"
  ;;
*)
  die "usage: $0 prepare [DIR] | stage [DIR] | run ipc|tcp [serving_bench.py args...]" ;;
esac
