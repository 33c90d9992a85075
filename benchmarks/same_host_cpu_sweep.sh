#!/usr/bin/env bash
# Same-host CPU path: 4 KiB and 64 KiB blocks, adjacent and scattered, over
# copy threads (MC_CMA_THREADS) x the split threshold (MC_CMA_SPLIT_KB), to
# choose their defaults by measurement; each line one transfer_bench.py
# point (GB/s), the memcpy references of benchmarks/c/memcpy_ref first.
#   bash benchmarks/same_host_cpu_sweep.sh [python] [threads...] -- [split KB...]
# e.g. bash benchmarks/same_host_cpu_sweep.sh .venv/bin/python 1 4 8 -- 64 256
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
py=${1:-.venv/bin/python}
shift || true
threads=() splits=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do threads+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
splits=("$@")
[ ${#threads[@]} -eq 0 ] && threads=(1 4)
[ ${#splits[@]} -eq 0 ] && splits=(256)
make -s build/bench/memcpy_ref || exit 1
echo "# $(nproc) CPUs, THP $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)"
for bs in 65536 4096; do
  for sc in 0 1; do
    echo "# memcpy ${bs} B blocks scatter=$sc: $(build/bench/memcpy_ref 1073741824 $bs 0 $sc) GB/s"
  done
done
for th in "${threads[@]}"; do
  for sp in "${splits[@]}"; do
    for sc in "" --scatter; do
      MC_CMA_THREADS=$th MC_CMA_SPLIT_KB=$sp MC_SAME_HOST_CPU=1 "$py" benchmarks/transfer_bench.py \
          --engine ours --mode bandwidth --ops write,read --block-sizes 64K,4K --batch-sizes 128 \
          --threads 1 --total-bytes 1G --buffer-size 1G --max-seconds 20 $sc 2>&1 |
        awk -v th="$th" -v sp="$sp" -v sc="${sc:-adjacent}" \
          '/^# (write|read) /{printf "threads %-2s split %-4s KiB %-9s %-5s %6s x%s %7s GB/s\n", th, sp, sc, $2, $3, $4, $6}'
    done
  done
done
