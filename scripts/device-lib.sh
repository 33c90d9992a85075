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
