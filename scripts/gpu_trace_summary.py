"""Medians of the MC_GPU_TRACE=1 lines of one run (scripts/device-gpu-fixed-cost.sh):
the submit call's stages and each copy job's queue -> launch -> done."""
import re
import statistics
import sys

pats = {
    "submit": re.compile(r"(\d+) requests at ([\d.]+) us: validate ([\d.]+) us, locate \(first "
                         r"chunk\) ([\d.]+) us, submit all ([\d.]+) us"),
    "chunk": re.compile(r"chunk of (\d+) requests: plan ([\d.]+) us, accept ([\d.]+) us, "
                        r"start ([\d.]+) us"),
    "plan": re.compile(r"plan of (\d+) requests: run ([\d.]+) us, map and ops ([\d.]+) us"),
    "job": re.compile(r"D2D job cuda:\d+, (\d+) copies: queued at ([\d.]+) us, launched \+([\d.]+)"
                      r" us, done seen \+([\d.]+) us(?:, picked up \+([\d.]+) us)?"),
    "wait": re.compile(r"wait: (\d+) pending at ([\d.]+) us"),
}
rows = {k: [] for k in pats}
direct = {"waiter": 0, "copy worker": 0}
for line in open(sys.argv[1], errors="replace"):
    for who in direct:
        direct[who] += f"(direct, seen by the {who})" in line
    for k, p in pats.items():
        m = p.search(line)
        if m:
            rows[k].append([float(x) if x is not None else float("nan") for x in m.groups()])


def med(vals, i):
    return statistics.median(v[i] for v in vals) if vals else float("nan")


s, pl, j = rows["submit"][-200:], rows["plan"][-200:], rows["job"][-200:]
c = rows["chunk"][-200:]
print(f"  submit calls {len(s)}: validate {med(s, 2):.1f}, locate {med(s, 3):.1f}, submit all "
      f"{med(s, 4):.1f} us (medians); per chunk ({med(c, 0):.0f} requests): plan "
      f"{med(c, 1):.1f} (call start {med(pl, 1):.1f}, map and build ops {med(pl, 2):.1f}), "
      f"engine accept {med(c, 2):.1f}, start jobs {med(c, 3):.1f} us")
print(f"  copy jobs {len(j)} ({med(j, 0):.0f} copies): queued -> picked up {med(j, 4):.1f} us, "
      f"-> launched {med(j, 2):.1f} us, -> done seen {med(j, 3):.1f} us")
print(f"  launched by the submitting thread (all traced jobs): {sum(direct.values())}, "
      f"completion seen by the waiter {direct['waiter']}, by the copy worker "
      f"{direct['copy worker']}")
if len(s) > 1:
    gaps = [b[1] - a[1] for a, b in zip(s, s[1:])]
    print(f"  submit call start to the next: median {statistics.median(gaps):.1f} us")
