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
