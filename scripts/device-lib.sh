# Sourced by the scripts run on the GPU machine (device-check.sh,
# device-gpu*.sh, vllm-gpu-run.sh), from the repository root.  No network
# there: what the machine lacks is carried (docs/device.md).

# The carried Debian packages (.debs/) unpacked into /opt/debs, beside (not
# over) the machine's own: headers and libraries found there for the build
# and at run time, linked against the machine's own libcurl (its
# dependencies are there).
mc_unpack_debs() {
  rm -rf /opt/debs
  mkdir -p /opt/debs
  for f in .debs/*.deb; do dpkg -x "$f" /opt/debs; done
  export CPATH=/opt/debs/usr/include LIBRARY_PATH=/opt/debs/usr/lib/x86_64-linux-gnu
  export LD_LIBRARY_PATH=/opt/debs/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
  local sys_curl
  sys_curl=$(ls /usr/lib/x86_64-linux-gnu/libcurl.so.4 2>/dev/null || true)
  if [ -n "$sys_curl" ]; then
    ln -sf "$sys_curl" /opt/debs/usr/lib/x86_64-linux-gnu/libcurl.so
  fi
}

# The vLLM GPU runs (vllm-gpu-run.sh, vllm-gpu-serving.sh): records the
# machine in $1/machine.txt, builds _core in place while installing the
# staged vLLM parts into /tmp/vllm-site; logs in $1; returns nonzero when
# either failed.
mc_build_and_install_vllm() {
  local out="$1" t0=$SECONDS build brc irc
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
    python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.is_available())'
  } 2>&1 | tee "$out/machine.txt"
  (MC_WERROR=1 python3 setup.py -q build_ext --inplace -j 16 >"$out/build.log" 2>&1 \
     || python3 setup.py -q build_ext --inplace >>"$out/build.log" 2>&1) &
  build=$!
  bash scripts/vllm-gpu-install.sh install /tmp/vllm-site >"$out/install.log" 2>&1
  irc=$?
  wait $build; brc=$?
  tail -5 "$out/install.log"; tail -5 "$out/build.log"
  echo "build rc=$brc install rc=$irc after $((SECONDS - t0)) s"
  [ $brc = 0 ] && [ $irc = 0 ]
}

# The serving scripts on the GPU machine (vllm-gpu-serving.sh,
# vllm-gpu-stopped-producer.sh): the first call of a lease builds _core,
# installs vLLM into /tmp/vllm-site and keeps the built copy in
# /tmp/mc-gpu-serving; a later call (from a fresh carry or from that copy)
# runs from the copy, FILE... (repository paths) copied in first where the
# caller's differ.  Leaves the caller's shell in the copy with the build's
# and vLLM's paths set; nonzero when the build, the install or the import
# failed.   mc_gpu_serving_enter OUT [FILE...]
mc_gpu_serving_enter() {
  local out="$1" run=/tmp/mc-gpu-serving f
  shift
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  if [ ! -f "$run/.built" ] || [ "$PWD" != "$run" ]; then
    if [ ! -f "$run/.built" ]; then
      mc_unpack_debs
      mc_build_and_install_vllm "$out" || return 1
      rm -rf "$run" && mkdir -p "$run" && tar --exclude=./.debs -cf - . | tar -xf - -C "$run"
      touch "$run/.built"
    else
      for f in "$@"; do
        if [ -f "$f" ] && ! cmp -s "$f" "$run/$f"; then cp "$f" "$run/$f"; fi
      done
    fi
    cd "$run" || return 1
  fi
  export CPATH=/opt/debs/usr/include LIBRARY_PATH=/opt/debs/usr/lib/x86_64-linux-gnu
  export LD_LIBRARY_PATH=/opt/debs/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
  export PYTHONPATH=/tmp/vllm-site:$PWD PYTHONUNBUFFERED=1
  python3 -c 'import mooncake_connector._core as c; print("_core", c.__file__)'
}

# The serving scripts' first argument (vllm-gpu-serving.sh,
# vllm-gpu-stopped-producer.sh): ipc (the same-host GPU path) prints the
# --gpu-path value on, tcp (MC_GPU_IPC=0, TCP with GPU staging) off; anything
# else writes "usage: USAGE (...)" to stderr and returns 2.
#   gpu_path=$(mc_gpu_path_arg "$path" "$0 ipc|tcp [x.py args...]") || exit 2
mc_gpu_path_arg() {
  case "$1" in
    ipc) echo on ;;
    tcp) echo off ;;
    *) echo "usage: $2 (ipc: the same-host GPU path, tcp: MC_GPU_IPC=0, TCP with GPU staging)" >&2
       return 2 ;;
  esac
}
