#!/usr/bin/env bash
# Runs a program inside a small qemu guest booted from Debian's kernel, where
# the SoftRoCE driver (rdma_rxe) gives two real verbs devices, rxe0 on v0 and
# rxe1 on v1 (a veth pair; use port 1, GID index 0).  Exits with the
# program's exit code (125 if the guest never reported one, 124 if the kernel
# package could not be downloaded).
#
#   tests/softroce/run-in-guest.sh BINARY [ARGS...]
#   TIMEOUT=seconds (default 180)   KEEP_LOG=1 prints the whole console
#   MC_GUEST_PERFTEST=1 also puts perftest's ib_write_bw in the guest
#   (/usr/bin; installs the perftest package on the host if missing)
#
# Needs root for apt-get the first time.  The kernel package is downloaded
# once into .cache/softroce (about 70 MB; ~400 MB unpacked).  No KVM needed:
# qemu's TCG runs it in about 10 s.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${MC_SOFTROCE_CACHE:-$repo/.cache/softroce}"
timeout_s="${TIMEOUT:-180}"
[ $# -ge 1 ] || { sed -n '2,12p' "$0"; exit 2; }
bin="$(readlink -f "$1")"; shift

pkgs=(qemu-system-x86 busybox-static rdma-core ibverbs-providers iproute2 kmod cpio)
[ "${MC_GUEST_PERFTEST:-0}" = 1 ] && pkgs+=(perftest)
missing=()
for p in "${pkgs[@]}"; do
  [ "$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null)" = installed ] || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" \
      >/dev/null
fi

# The kernel Debian ships today, unpacked (not installed) once.
mkdir -p "$cache"
kpkg="$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-/ {print $2; exit}')"
kv="${kpkg#linux-image-}"
kdir="$cache/kernel-$kv"
if [ ! -f "$kdir/boot/vmlinuz-$kv" ]; then
  # Stale package lists may name a kernel the mirror no longer has: refresh once.
  if ! (cd "$cache" && apt-get download -q "$kpkg" >/dev/null 2>&1); then
    apt-get update -q >/dev/null 2>&1 || true
    kpkg="$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-/ {print $2; exit}')"
    kv="${kpkg#linux-image-}"
    kdir="$cache/kernel-$kv"
    if ! (cd "$cache" && apt-get download -q "$kpkg" >/dev/null 2>&1); then
      echo "run-in-guest: cannot download the kernel package $kpkg from Debian's mirror" >&2
      exit 124
    fi
  fi
  rm -rf "$kdir.tmp" && dpkg-deb -x "$cache/${kpkg}"_*.deb "$kdir.tmp"
  depmod -b "$kdir.tmp" "$kv"
  rm -f "$cache/${kpkg}"_*.deb
  mv "$kdir.tmp" "$kdir"
fi

root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,modules,etc/libibverbs.d,proc,sys,dev}
cp /bin/busybox "$root/bin/busybox"

# Modules in load order.  rdma_rxe needs crc32 through the crypto API, which
# no module dependency names: load crc32_generic first.
{
  find "$kdir/lib/modules/$kv" -name 'crc32_generic.ko*' | head -1
  for mod in veth rdma_rxe; do  # one per call: a second name would be a parameter
    modprobe -d "$kdir" -S "$kv" --show-depends "$mod" | awk '$1 == "insmod" {print $2}'
  done
} | awk '!seen[$0]++' | while read -r m; do
  cp "$m" "$root/modules/"
  echo "/modules/$(basename "$m")"
done > "$root/modules.order"

# Programs and every library they load (the rxe provider and libgcc_s are
# dlopen'ed, so ldd does not list them).
copy_with_libs() {
  local f="$1" dest="$2"
  mkdir -p "$root$(dirname "$dest")"
  cp "$f" "$root$dest"
  ldd "$f" 2>/dev/null | grep -o '/[^ ]*' | while read -r lib; do
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
  done
}
copy_with_libs "$(command -v ip)" /usr/sbin/ip
copy_with_libs "$(command -v rdma)" /usr/sbin/rdma
copy_with_libs "$bin" /bin/test-program
if [ "${MC_GUEST_PERFTEST:-0}" = 1 ]; then
  copy_with_libs "$(command -v ib_write_bw)" /usr/bin/ib_write_bw
fi
# The verbs libraries too: programs may dlopen them rather than link them.
for lib in /usr/lib/x86_64-linux-gnu/libibverbs.so.1 /usr/lib/x86_64-linux-gnu/librdmacm.so.1; do
  [ -e "$lib" ] && copy_with_libs "$(readlink -f "$lib")" "$lib"
done
provider="$(ls /usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav*.so | head -1)"
copy_with_libs "$provider" "$provider"
cp /etc/libibverbs.d/rxe.driver "$root/etc/libibverbs.d/"
libgcc="$(ls /lib/x86_64-linux-gnu/libgcc_s.so.1 /usr/lib/x86_64-linux-gnu/libgcc_s.so.1 2>/dev/null | head -1)"
mkdir -p "$root$(dirname "$libgcc")" && cp -L "$libgcc" "$root$libgcc"

install -m 755 "$here/guest-init.sh" "$root/init"
{
  printf 'cd /tmp\n/bin/test-program'
  for a in "$@"; do printf ' %q' "$a"; done
  printf '\n'
} > "$root/test.sh"
(cd "$root" && find . | cpio -o -H newc 2>/dev/null | gzip -1) > "$root.cpio.gz"

# TCG by default: a /dev/kvm node can exist (and look writable to root)
# where KVM does not work, and qemu then spins.  MC_SOFTROCE_KVM=1 opts in.
accel=tcg
[ "${MC_SOFTROCE_KVM:-0}" = 1 ] && accel=kvm
log="$(mktemp)"
set +e
timeout "$timeout_s" qemu-system-x86_64 -accel "$accel" -cpu max -m 2048 -smp 2 \
    -kernel "$kdir/boot/vmlinuz-$kv" -initrd "$root.cpio.gz" \
    -append "console=ttyS0 quiet panic=-1 loglevel=3" -nographic -no-reboot -nic none \
    < /dev/null > "$log" 2>&1
set -e
rm -f "$root.cpio.gz"
# No marker (the guest ran out of TIMEOUT): print the console, exit 125 --
# not a silent exit 1 from grep under pipefail.
rc="$( (grep -ao 'MC_GUEST_EXIT=[0-9]*' "$log" || true) | tail -1 | cut -d= -f2)"
if [ -n "${KEEP_LOG:-}" ] || [ -z "$rc" ]; then
  tr -d '\r' < "$log"
else
  # The program's output: between the start and exit markers, without
  # kernel messages.
  tr -d '\r' < "$log" | awk '/MC_GUEST_EXIT=/ {exit} on {print} /MC_GUEST_START/ {on = 1}' \
      | grep -v -E '^\[ *[0-9.]+\]' || true
fi
rm -f "$log"
exit "${rc:-125}"
