#!/usr/bin/env bash
# Assembles and installs the vLLM 0.26.0 parts made by scripts/vllm-gpu-prepare.sh
# on the GPU machine (issue #27, docs/device.md).  Run there:
#   bash PART/vllm-gpu-install.sh stage PART     once per part, in consecutive calls
#   bash PART/vllm-gpu-install.sh install [TARGET]   after the last part
# stage: checks the part's sha256 sums and copies it to $MC_VLLM_GPU_STAGE
# (/tmp/vllm-gpu-stage; /tmp survives between calls while the machine is warm).
# install: checks that every file the MANIFEST names is staged with its sum,
# installs the wheels with pip --target into TARGET (/tmp/vllm-site), unpacks
# vLLM there, and checks `import vllm` with the machine's torch.  Then
#   export PYTHONPATH=TARGET      (before the machine's own site-packages)
set -uo pipefail
stage="${MC_VLLM_GPU_STAGE:-/tmp/vllm-gpu-stage}"
py="${PYTHON:-python3}"
die() { echo "vllm-gpu-install: $*" >&2; exit 1; }
case "${1:-}" in
stage)
  part="${2:?usage: vllm-gpu-install.sh stage PARTDIR}"
  [ -f "$part/SHA256SUMS" ] || die "$part/SHA256SUMS not found (is $part a part of scripts/vllm-gpu-prepare.sh?)"
  (cd "$part" && sha256sum -c --quiet SHA256SUMS) || die "$part: checksum mismatch (a broken transfer: carry it again)"
  mkdir -p "$stage"
  while read -r _ f; do cp "$part/$f" "$stage/$f" || die "copying $f"; done <"$part/SHA256SUMS"
  cp "$part/MANIFEST" "$stage/MANIFEST"
  echo "vllm-gpu-install: staged $(basename "$part") ($(wc -l <"$part/SHA256SUMS") files) in $stage"
  ;;
install)
  target="${2:-/tmp/vllm-site}"
  [ -f "$stage/MANIFEST" ] || die "nothing staged in $stage (run 'stage PARTDIR' for each part first)"
  missing=""
  while read -r p sum f; do
    if [ ! -f "$stage/$f" ]; then missing="$missing $p"; continue; fi
    echo "$sum  $stage/$f" | sha256sum -c --quiet - || die "$f: checksum mismatch"
  done <"$stage/MANIFEST"
  [ -z "$missing" ] || die "not staged yet:$(echo "$missing" | tr ' ' '\n' | sort -u | tr '\n' ' ')(the machine went back between calls? stage every part again)"
  # Files the prepare script cut into NAME.split00, .split01, ... are joined.
  for first in "$stage"/*.split00; do
    [ -f "$first" ] || continue
    cat "${first%.split00}".split[0-9][0-9] >"${first%.split00}" || die "joining ${first%.split00}"
  done
  rm -rf "$target" && mkdir -p "$target"
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
      --target "$target" "$stage"/*.whl || die "pip install of the dependency wheels failed"
  xz -dc "$stage/vllm-py.tar.xz" | tar -xf - -C "$target" || die "unpacking vllm-py.tar.xz"
  xz -dc "$stage/vllm-C.so.xz" >"$target/vllm/_C_stable_libtorch.abi3.so" || die "unpacking vllm-C.so.xz"
  xz -dc "$stage/vllm-fa3.so.xz" >"$target/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so" \
      || die "unpacking vllm-fa3.so.xz"
  echo "vllm-gpu-install: installed into $target ($(du -sh "$target" | cut -f1))"
  PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}" "$py" - <<'PY' || die "import check failed (above)"
import importlib.metadata as md
import torch
import vllm
import vllm._C_stable_libtorch  # noqa: F401  the CUDA kernels, against this torch
import vllm.vllm_flash_attn  # noqa: F401  needs FA3 (vLLM's model code imports it)
from vllm.platforms import current_platform
print(f"vllm-gpu-install: import vllm {vllm.__version__} from {vllm.__file__}")
print(f"vllm-gpu-install: torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"GPU {torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}, "
      f"platform {type(current_platform).__name__}")
import vllm.entrypoints.openai.api_server  # noqa: F401  the server's whole import chain
print("vllm-gpu-install: vllm.entrypoints.openai.api_server imports")
for n in ("transformers", "tokenizers", "numpy", "protobuf", "setuptools", "numba", "triton"):
    try:
        print(f"  {n} {md.version(n)}")
    except md.PackageNotFoundError:
        print(f"  {n} not installed")
PY
  echo "export PYTHONPATH=$target\${PYTHONPATH:+:\$PYTHONPATH}"
  ;;
*)
  die "usage: vllm-gpu-install.sh stage PARTDIR | install [TARGET]" ;;
esac
