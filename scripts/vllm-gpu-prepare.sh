#!/usr/bin/env bash
# Prepares vLLM 0.26.0 for the GPU machine (issue #27): the newest vLLM that
# pins the machine's torch (2.11.0), trimmed to what a Hopper GPU and a small
# Llama need, plus the pure-Python and small binary packages the machine
# lacks, packed into parts that each fit one device call's carry limit.
#
#   scripts/vllm-gpu-prepare.sh [OUT]        (default OUT: <repo>/.vllm-gpu)
#
# Out: OUT/part1, OUT/part2, ...; each holds its files, SHA256SUMS, the
# whole MANIFEST (every part's files and sums) and vllm-gpu-install.sh.
# Carry one part per call, back to back (the machine keeps /tmp while warm):
#   bash .vllm-gpu/partN/vllm-gpu-install.sh stage .vllm-gpu/partN
# and after the last one
#   bash .vllm-gpu/partN/vllm-gpu-install.sh install      (docs/device.md)
# Trimmed away (see docs/vllm-gpu.md): FlashAttention 2 (FlashAttention 3,
# Hopper's, stays: vLLM 0.26's model code imports vllm_flash_attn, which
# needs FA2 or FA3; the servers use TRITON_ATTN for fp32), _moe_C (dense models only; vLLM imports it
# optionally), FlashMLA, QuTLASS, the vllm-rs frontend binary, the C++
# headers and prebuilt extensions under third_party/.  Needs python3 with pip, unzip, xz, sha256sum.
# Env: MC_VLLM_GPU_PART_MB (31: each part, MiB; a call carries 64 MiB in
# all and the checkout itself is ~26 MiB by 2026-12-06: 4 parts), MC_VLLM_GPU_CACHE
# (downloads, <repo>/.cache/vllm-gpu).  A file over the part limit (vLLM's
# kernels, 53 MiB compressed) is cut into NAME.splitNN pieces that pack like
# any file; the installer joins them.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$(mkdir -p "${1:-$repo/.vllm-gpu}" && cd "${1:-$repo/.vllm-gpu}" && pwd)"
cache="${MC_VLLM_GPU_CACHE:-$repo/.cache/vllm-gpu}"
ver=0.26.0
limit_mb="${MC_VLLM_GPU_PART_MB:-31}"
py="${PYTHON:-python3}"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64
      --platform manylinux1_x86_64 --platform any)
mkdir -p "$cache/wheel" "$cache/deps"
echo "vllm-gpu-prepare: downloading vllm==$ver and $(grep -c '==' "$repo/scripts/vllm-gpu-deps.txt") packages"
"$py" -m pip download -q --disable-pip-version-check --no-deps "${plat[@]}" \
    -d "$cache/wheel" "vllm==$ver"
"$py" -m pip download -q --disable-pip-version-check --no-deps "${plat[@]}" \
    -d "$cache/deps" -r "$repo/scripts/vllm-gpu-deps.txt"
whl=$(ls "$cache"/wheel/vllm-$ver-*.whl)
tree="$cache/tree"
rm -rf "$tree" && mkdir -p "$tree"
# third_party/: its Python stays (pynvml: vLLM's CUDA platform detection), its
# C++ headers and prebuilt extensions go.
unzip -q "$whl" -d "$tree" -x 'vllm/third_party/*/include/*' 'vllm/third_party/*.h' \
    'vllm/third_party/*.cu' 'vllm/third_party/*.so' 'vllm/vllm_flash_attn/_vllm_fa2_C*.so' \
    'vllm/_moe_C*.so' 'vllm/_flashmla*.so' 'vllm/_qutlass_C*.so' 'vllm/vllm-rs'
test -f "$tree/vllm/_C_stable_libtorch.abi3.so"
work="$cache/pack"
rm -rf "$work" && mkdir -p "$work"
echo "vllm-gpu-prepare: compressing (xz -9, one thread; a few minutes)"
xz -9 -T1 -c "$tree/vllm/_C_stable_libtorch.abi3.so" >"$work/vllm-C.so.xz"
fa3=$(cd "$tree" && ls vllm/vllm_flash_attn/_vllm_fa3_C*.so)
xz -9 -T1 -c "$tree/$fa3" >"$work/vllm-fa3.so.xz"
tar -C "$tree" -cf - --exclude=vllm/_C_stable_libtorch.abi3.so --exclude="$fa3" vllm "vllm-$ver.dist-info" \
    | xz -9 -T1 >"$work/vllm-py.tar.xz"
# The deps list must resolve to exactly one wheel per line.
n_deps=$(grep -c '==' "$repo/scripts/vllm-gpu-deps.txt")
"$py" - "$cache/deps" "$repo/scripts/vllm-gpu-deps.txt" <<'PY'
import os, re, sys
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
want = {norm(l.split("==")[0]): l.split("==")[1].strip()
        for l in open(sys.argv[2]) if "==" in l and not l.startswith("#")}
have = {}
for f in os.listdir(sys.argv[1]):
    if f.endswith(".whl"):
        n, v = f.split("-")[:2]
        have.setdefault(norm(n), set()).add(v)
bad = [n for n in want if want[n] not in have.get(n, ())]
extra = [n for n in have if n not in want]
if bad or extra:
    sys.exit(f"vllm-gpu-prepare: deps mismatch: missing {bad}, not listed {extra}")
PY
while read -r line; do
  case "$line" in ''|'#'*) continue ;; esac
  n="${line%%==*}" v="${line##*==}"
  f=$(ls "$cache/deps" | "$py" -c "import re,sys; n,v=sys.argv[1:]; norm=lambda s: re.sub(r'[-_.]+','-',s).lower()
print(next(f.strip() for f in sys.stdin if norm(f.split('-')[0])==norm(n) and f.split('-')[1]==v))" "$n" "$v")
  cp "$cache/deps/$f" "$work/"
done <"$repo/scripts/vllm-gpu-deps.txt"
# Pack: the largest files first, each into the first part with room.
rm -rf "$out"/part* "$out/MANIFEST"
"$py" - "$work" "$out" "$limit_mb" <<'PY'
import hashlib, os, shutil, sys
work, out, limit = sys.argv[1], sys.argv[2], int(sys.argv[3]) << 20
room = limit - (64 << 10)
if room < (1 << 20):
    sys.exit(f"vllm-gpu-prepare: MC_VLLM_GPU_PART_MB={sys.argv[3]} is too small (1 or more MiB)")
for f in sorted(os.listdir(work)):
    path = os.path.join(work, f)
    if os.path.getsize(path) > room:  # cut into pieces the installer joins
        with open(path, "rb") as src:
            k = 0
            while chunk := src.read(room):
                with open(f"{path}.split{k:02d}", "wb") as dst:
                    dst.write(chunk)
                k += 1
        os.remove(path)
        print(f"vllm-gpu-prepare: {f} cut into {k} pieces of at most {room >> 20} MiB")
files = sorted(os.listdir(work), key=lambda f: -os.path.getsize(os.path.join(work, f)))
parts = []
for f in files:
    size = os.path.getsize(os.path.join(work, f))
    for p in parts:
        if p["size"] + size <= room:
            break
    else:
        p = {"files": [], "size": 0}
        parts.append(p)
    p["files"].append(f)
    p["size"] += size
manifest = []
for i, p in enumerate(parts, 1):
    d = os.path.join(out, f"part{i}")
    os.makedirs(d)
    for f in p["files"]:
        shutil.move(os.path.join(work, f), os.path.join(d, f))
        h = hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
        manifest.append(f"part{i} {h} {f}")
    print(f"vllm-gpu-prepare: part{i}: {len(p['files'])} files, {p['size'] / 2**20:.1f} MiB")
open(os.path.join(out, "MANIFEST"), "w").write("\n".join(manifest) + "\n")
PY
for d in "$out"/part*; do
  p=$(basename "$d")
  grep "^$p " "$out/MANIFEST" | awk '{print $2"  "$3}' >"$d/SHA256SUMS"
  cp "$out/MANIFEST" "$d/MANIFEST"
  cp "$repo/scripts/vllm-gpu-install.sh" "$d/vllm-gpu-install.sh"
done
(cd "$out" && for d in part*; do (cd "$d" && sha256sum -c --quiet SHA256SUMS); done)
echo "vllm-gpu-prepare: $(ls -d "$out"/part* | wc -l) parts in $out ($n_deps packages + vLLM $ver); du:"
du -sh "$out"/part*
