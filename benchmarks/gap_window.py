"""Who ran on the host's CPUs between a request's first and second token
(issue 31: the push layer load's token 1->2 gap vs colocated's).

    perf record -a -k CLOCK_MONOTONIC -e sched:sched_switch -e sched:sched_wakeup -o P.data \\
        -- <while benchmarks/ttft_timeline.py --out T.json ... measures>
    python3 benchmarks/gap_window.py T.json P.data [--json OUT] [--gap 1]

ttft_timeline.py's rows give each request's send time (time.monotonic) and
its client-side token times; perf's scheduler events (CLOCK_MONOTONIC, the
same clock) give every thread's time on a CPU.  For each request the window
is [token k arrives, token k+1 arrives] at the client (--gap k, default 1:
the 1->2 gap); in it, per request, then the median per mode and length:

  window          the gap itself, ms
  eng_cpu         the answering server's engine thread (its busiest thread
                  in the run: vLLM's EngineCore) on a CPU, ms
  eng_wait        that thread runnable but not on a CPU (woken or preempted
                  -> switched in), ms
  <group>         CPU ms of every thread of that server / proxy (by the
                  pid:tid keys of the rows' cpu_ms), "client" (the
                  benchmark itself), "perf", "other" (anything else on the
                  host), "idle" (both CPUs' idle time)

Which server answers: the decode for push modes, the colocated server for
colocated ones.  Scheduling accounting, not a stopwatch: the numbers add up
to (window x CPUs) whatever else runs, so a busy host shows as "other".
"""
import argparse
import json
import lzma
import re
import statistics
import subprocess
import sys

SW = re.compile(r"^\s*(?P<comm>.+?)\s+(?P<pid>-?\d+)/(?P<tid>-?\d+)\s+\[(?P<cpu>\d+)\]\s+"
                r"(?P<t>\d+\.\d+):\s+sched:(?P<ev>sched_switch|sched_wakeup):\s+(?P<rest>.*)$")
SWITCH = re.compile(r"prev_comm=.* prev_pid=(?P<prev>\d+) .*prev_state=(?P<state>\S+) ==> "
                    r"next_comm=.* next_pid=(?P<next>\d+) ")
WAKE = re.compile(r"comm=.* pid=(?P<pid>\d+) prio=")


def perf_lines(path):
    if path.endswith(".txt") or path.endswith(".txt.xz"):
        op = lzma.open if path.endswith(".xz") else open
        with op(path, "rt") as f:
            yield from f
        return
    p = subprocess.Popen(["perf", "script", "-i", path, "-F", "comm,pid,tid,cpu,time,event,trace"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    yield from p.stdout
    p.wait()


def intervals(lines):
    """({tid: [(start, end), ...] on a CPU}, {tid: [(start, end), ...]
    runnable, waiting for a CPU}, {tid: comm}, {waker tid: [(t, woken
    tid), ...]}, (t_first, t_last))."""
    run, wait, comm, wakes = {}, {}, {}, {}
    on = {}          # cpu -> (tid, since)
    ready = {}       # tid -> since (woken or preempted, not yet on a CPU)
    t_first = t_last = None
    for ln in lines:
        m = SW.match(ln)
        if not m:
            continue
        t = float(m["t"])
        t_first = t if t_first is None else t_first
        t_last = t
        if m["ev"] == "sched_wakeup":
            w = WAKE.search(m["rest"])
            if w:
                ready.setdefault(int(w["pid"]), t)
                wakes.setdefault(int(m["tid"]), []).append((t, int(w["pid"])))
            continue
        s = SWITCH.search(m["rest"])
        if not s:
            continue
        cpu, prev, nxt = int(m["cpu"]), int(s["prev"]), int(s["next"])
        comm[int(m["tid"])] = m["comm"].strip()
        cur = on.get(cpu)
        if cur is not None and cur[0] == prev:
            run.setdefault(prev, []).append((cur[1], t))
        elif prev != 0:
            run.setdefault(prev, [])  # switched out without a seen start: ignore the stretch
        if prev != 0 and s["state"].startswith("R"):
            ready[prev] = t  # preempted: runnable from now
        r0 = ready.pop(nxt, None)
        if r0 is not None and nxt != 0:
            wait.setdefault(nxt, []).append((r0, t))
        on[cpu] = (nxt, t)
    return run, wait, comm, wakes, (t_first, t_last)


def overlap(ivs, a, b):
    return sum(max(0.0, min(e, b) - max(s, a)) for s, e in ivs)


def groups_of(rows):
    """{tid: group} from the rows' cpu_ms keys ("pid:tid:name"); the
    client's pid from the request ids; {server: its busiest tid}."""
    g, busy, client = {}, {}, set()
    PID_OF.clear()
    NAME_OF.clear()
    for recs in rows.values():
        for r in recs:
            client.add(int(r["rid"].rsplit("-", 1)[1]))
            for srv, th in (r.get("cpu_ms") or {}).items():
                for k, v in th.items():
                    if k.startswith("rq:"):
                        continue
                    pid, tid, _ = k.split(":", 2)
                    g[int(tid)] = srv
                    PID_OF[int(tid)] = int(pid)
                    NAME_OF[int(tid)] = _
                    b = busy.setdefault(srv, {})
                    b[int(tid)] = b.get(int(tid), 0.0) + v
    eng = {srv: max(b, key=b.get) for srv, b in busy.items() if b}
    return g, eng, client


def server_of(mode):
    if mode.startswith("push"):
        return "decode" + mode[len("push_ll"):] if mode.startswith("push_ll") else "decode"
    if mode.startswith("colocated"):
        return "colocated"
    if mode == "prefill_plain":
        return "prefill"
    return None


PID_OF = {}   # tid -> pid, from the rows (groups_of)
NAME_OF = {}  # tid -> thread name, from the rows


def emissions(wakes, g, srv, eng_tid):
    """Times the engine thread handed a step's outputs on: its wake-ups of
    the VLLM::EngineCor thread of its own process it wakes most (vLLM's
    output thread; a timer's wake-up of another thread is charged to
    whatever ran when it fired), the wake-ups within 1 ms of each other as
    one."""
    cnt = {}
    for _, w in wakes:
        if PID_OF.get(w) == PID_OF.get(eng_tid) and w != eng_tid and \
                NAME_OF.get(w) == NAME_OF.get(eng_tid):
            cnt[w] = cnt.get(w, 0) + 1
    if not cnt:
        return []
    out_tid = max(cnt, key=cnt.get)
    out = []
    for t, w in wakes:
        if w == out_tid and (not out or t - out[-1] > 1e-3):
            out.append(t)
    return out


def _last_before(ts, x):
    import bisect
    i = bisect.bisect_right(ts, x)
    return ts[i - 1] if i else None


def analyse(tl_json, perf_path, gap=1, engine_side=False):
    with (lzma.open if tl_json.endswith(".xz") else open)(tl_json, "rt") as f:
        d = json.load(f)
    rows = d["rows"]
    g, eng, client = groups_of(rows)
    run, wait, comm, wakes, (t0, t1) = intervals(perf_lines(perf_path))
    emits = {srv: emissions(wakes.get(e, ()), g, srv, e) for srv, e in eng.items()}
    ncpu = d["summary"].get("cpus") or 2
    out = {}
    for n, recs in rows.items():
        for r in recs:
            itl = r.get("itl_ms") or []
            srv = server_of(r["mode"])
            if len(itl) < gap or srv is None:
                continue
            a = r["t_send"] + (r["ttft_ms"] + sum(itl[:gap - 1])) / 1e3
            b = a + itl[gap - 1] / 1e3
            if t0 is None or a < t0 or b > t1:
                continue
            if engine_side:
                # the engine's own outputs of token gap and gap+1: the last
                # output before the client had each
                ea, eb = (_last_before(emits.get(srv, ()), x) for x in (a, b))
                if ea is None or eb is None or eb <= ea or ea < r["t_send"]:
                    continue
                a, b = ea, eb
            cell = {"window": (b - a) * 1e3}
            e = eng.get(srv)
            cell["eng_cpu"] = overlap(run.get(e, ()), a, b) * 1e3
            cell["eng_wait"] = overlap(wait.get(e, ()), a, b) * 1e3
            used = 0.0
            for tid, ivs in run.items():
                if tid == 0:
                    continue
                ms = overlap(ivs, a, b) * 1e3
                if ms <= 0:
                    continue
                grp = g.get(tid)
                if grp is None:
                    grp = ("client" if tid in client else
                           "perf" if comm.get(tid, "").startswith("perf") else "other")
                cell[grp] = cell.get(grp, 0.0) + ms
                used += ms
                if grp in eng:  # which of the server's threads
                    role = ("engine" if tid == eng[grp] else
                            "main" if PID_OF.get(tid) == tid else "threads")
                    cell[f"{grp}.{role}"] = cell.get(f"{grp}.{role}", 0.0) + ms
            cell["idle"] = max(0.0, ncpu * (b - a) * 1e3 - used)
            out.setdefault(n, {}).setdefault(r["mode"], []).append(cell)
    return out


def summarize(out):
    res = {}
    for n, modes in out.items():
        for mode, cells in modes.items():
            keys = sorted({k for c in cells for k in c})
            res.setdefault(n, {})[mode] = {
                "n": len(cells),
                **{k: statistics.median(c.get(k, 0.0) for c in cells) for k in keys}}
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("timeline_json")
    ap.add_argument("perf", help="perf.data of `perf record -k CLOCK_MONOTONIC -e "
                                 "sched:sched_switch -e sched:sched_wakeup`, or its `perf script` "
                                 "text (.txt / .txt.xz)")
    ap.add_argument("--gap", type=int, default=1, help="k: the window token k -> k+1")
    ap.add_argument("--engine-side", action="store_true",
                    help="the window between the answering engine's own outputs of the two "
                         "tokens (its thread waking vLLM's output thread), not the client's")
    ap.add_argument("--threads", action="store_true",
                    help="also each server's CPU split: <server>.engine (its engine thread), "
                         ".main (a process's main thread: the API server's event loop), "
                         ".threads (the rest)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    res = summarize(analyse(a.timeline_json, a.perf, a.gap, a.engine_side))
    first = ("window", "eng_cpu", "eng_wait")
    for n, modes in res.items():
        cols = list(first) + sorted({k for m in modes.values() for k in m
                                     if a.threads or "." not in k} - set(first) - {"n"})
        print(f"== {n} words, gap {a.gap}->{a.gap + 1} "
              f"({'engine' if a.engine_side else 'client'} side), median per request, ms")
        print(f"  {'mode':16s} {'n':>3s} " + " ".join(f"{c[:12]:>12s}" for c in cols))
        for mode, s in sorted(modes.items()):
            print(f"  {mode:16s} {s['n']:3d} " + " ".join(f"{s.get(c, 0.0):12.2f}" for c in cols))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
