#!/bin/bash
# Issue 31 gap 1->2: ttft_timeline.py with perf's scheduler events recorded
# while it measures (servers up -> done), then benchmarks/gap_window.py.
#   benchmarks/gap_window_run.sh OUTDIR [ttft_timeline.py args...]
# (root: perf record -a; the VM's perf_event_paranoid allows it for root)
set -u
out=$1; shift
mkdir -p "$out"
here=$(cd "$(dirname "$0")/.." && pwd)
PYTHONPATH=$here "$here/.venv/bin/python" -P "$here/benchmarks/ttft_timeline.py" \
    --out "$out/tl.json" "$@" > "$out/tl.txt" 2>&1 &
tl=$!
until grep -q "processes up" "$out/tl.txt" 2>/dev/null; do
    kill -0 $tl 2>/dev/null || { echo "ttft_timeline ended early"; tail "$out/tl.txt"; exit 1; }
    sleep 1
done
perf record -q -a -k CLOCK_MONOTONIC -e sched:sched_switch -e sched:sched_wakeup \
    -o "$out/perf.data" > "$out/perf.log" 2>&1 &
pf=$!
wait $tl; rc=$?
kill -INT $pf; wait $pf
perf script -i "$out/perf.data" -F comm,pid,tid,cpu,time,event,trace 2>/dev/null | xz -1 > "$out/sched.txt.xz"
rm -f "$out/perf.data"
# the decode's / colocated's own step windows (token k's output -> token k+1's)
for k in 1 2 3; do
    "$here/.venv/bin/python" "$here/benchmarks/gap_window.py" "$out/tl.json" "$out/sched.txt.xz" \
        --gap $k --engine-side --threads --json "$out/gap$k.json" > "$out/gap$k.txt"
done
"$here/.venv/bin/python" "$here/benchmarks/gap_window.py" "$out/tl.json" "$out/sched.txt.xz" \
    --json "$out/gap1_client.json" > "$out/gap1_client.txt"
"$here/.venv/bin/python" "$here/benchmarks/gap_wait_who.py" "$out/tl.json" "$out/sched.txt.xz" > "$out/wait_who.txt"
grep -A9 "bars (issue" "$out/tl.txt"
cut -c1-140 "$out/gap1.txt"
exit $rc
