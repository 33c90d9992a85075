"""The soak's memory verdict (benchmarks/soak.py: memory_verdict and the
memwatch samples it reads): "0 leaked" must mean no server leaks, and a
real leak must still fail it.

glibc keeps freed memory inside its heaps, so a server's RSS grows for a
long time without any leak (issue 31: in-use heap flat while RSS grew
13-16 MiB/min); the verdict judges malloc's in-use bytes, Python's
allocated blocks and the RSS left after malloc_trim(0), each against the
reference server's.  The synthetic series check the rules; the real-process
test runs memwatch in two Python processes, one with an injected leak
(memwatch's test-only MC_MEMWATCH_LEAK_KB_S / MC_MEMWATCH_LEAK_OBJS_S), and
the verdict must name the leaking one and only it."""
import os
import signal
import subprocess
import sys
import time

import pytest

from soak_util import load_soak

sk = load_soak("soak_mem_mod")
T0 = 1_000_000.0  # the load's start (unix time); 30 minutes of load
LOAD = 1800.0


def _proc(rss0, rss_per_min, used0, used_per_min, blocks_per_min=0.0, born=T0 - 300,
          end=T0 + LOAD, trim_after=None, every=20.0):
    rows = []
    t = born
    while t <= end:
        m = max(0.0, (t - T0) / 60)
        rows.append({"t": t, "rss": rss0 + rss_per_min * m, "used": used0 + used_per_min * m,
                     "blocks": 2.5e6 + blocks_per_min * m})
        t += every
    if trim_after is not None:
        rows.append(dict(rows[-1], t=end + 30, trim_before=rows[-1]["rss"],
                         trim_after=trim_after))
    return rows


def _verdict(series, **kw):
    table, v, not_judged = sk.memory_verdict(series, T0, T0 + LOAD, **kw)
    return table, v


def _reference():
    # R (one lifetime, group 1): RSS +4 MiB/min of retained free heap, in use
    # flat, 1200 MiB after trim
    return {1: {1: _proc(1100, 4.0, 260, 0.1, 300, trim_after=1100 + 240),
                2: _proc(900, 0.0, 20, 0.0, 0, trim_after=900)}}


def test_retained_free_heap_is_not_a_leak():
    """A server whose RSS grows 15 MiB/min (glibc keeping freed memory) with
    malloc in-use bytes and Python blocks flat, and that gives it back to
    malloc_trim(0) as R does, passes; the old RSS-slope rule (R + 4 MiB/min)
    would have failed it."""
    series = {"R": _reference(),
              "D1": {3: {3: _proc(1080, 15.0, 250, 0.3, 800, trim_after=1080 + 265),
                         4: _proc(900, 0.0, 20, 0.0, 0, trim_after=900)}}}
    table, v = _verdict(series)
    assert v == [], v
    d1, = table["D1"]
    assert abs(d1["rss"] - 15.0) < 0.01  # reported
    assert abs(d1["used"] - 0.3) < 0.01
    assert d1["kept_after_trim"] == 265.0 and table["R"][0]["kept_after_trim"] == 240.0
    samples = [{"t": r["t"] - T0, "server": "D1", "pid": 3, "rss": r["rss"] * 2**20}
               for r in series["D1"][3][3]]
    assert sk.rss_slope(samples, "D1", LOAD / 2, LOAD) > 4.0 + 4.0


@pytest.mark.parametrize("what,proc,needle", [
    ("malloc leak 2 MiB/min", _proc(1080, 17.0, 250, 2.0, 800, trim_after=1080 + 300),
     "malloc in-use bytes grow 2.0 MiB/min"),
    ("Python objects 10k/min", _proc(1080, 5.0, 250, 0.3, 10_000, trim_after=1080 + 260),
     "Python blocks grow 10000.0 /min"),
    ("kept after trim", _proc(1080, 5.0, 250, 0.3, 800, trim_after=1080 + 400),
     "RSS after malloc_trim(0) is 400.0 MiB above the load's start"),
])
def test_a_leak_fails(what, proc, needle):
    table, v = _verdict({"R": _reference(), "D1": {3: {3: proc}}})
    assert len(v) == 1 and v[0].startswith("D1: ") and needle in v[0], (what, v)
    assert "R's" in v[0]


def test_restarted_late_lifetime_and_missing_reference():
    """A lifetime born 20 minutes into the load (a fault restarted it) is
    warming up over the 5 minutes of its second half: not judged, and said so.
    Without a reference the slopes are judged against 0 + margin and the RSS
    kept after trim (hundreds of MiB of warm-up) is reported, not judged."""
    young = _proc(600, 200.0, 100, 50.0, 50_000, born=T0 + 1200, trim_after=2000)
    table, v, not_judged = sk.memory_verdict({"R": _reference(), "P1": {7: {7: young}}},
                                             T0, T0 + LOAD)
    assert v == [] and "rss" not in table["P1"][0], table
    assert not_judged == ["P1: not judged, the second half of its time under load is 5.0 min "
                          "(< 10)"], not_judged
    ok = _proc(1080, 15.0, 250, 0.5, 800, trim_after=1080 + 265)
    table, v = _verdict({"D1": {3: {3: ok}}})
    assert v == [] and table["D1"][0]["kept_after_trim"] == 265.0
    table, v = _verdict({"D1": {3: {3: _proc(1080, 15.0, 250, 1.5, 800)}}})
    assert v == ["D1: malloc in-use bytes grow 1.5 MiB/min (> 0 + 1)"], v


# Session 29's 25-minute soak (load 11:36:57-12:01:59 UTC): P3's EngineCore
# climbed to its plateau (577 MiB in use) in ~5 minutes, stepped to 584-590 in
# its last 2 minutes, was SIGKILLed 16.2 minutes into the load and restarted;
# the restarted one climbed back to ~580 in 5 minutes.  The old rule judged
# the first lifetime over its last 3.6 minutes inside the load's second half:
# +3.6 MiB/min, a violation.
S29_LOAD = 1500.0
S29_KILL = T0 + 972.0


def _engine_core(born, end, plateau, steps=(), climb_s=300.0, leak_per_min=0.0):
    """A lifetime's EngineCore in use: 160 MiB at birth, a straight climb to
    plateau over climb_s, then flat but for steps [((from, to), +MiB)] and a
    leak (MiB/min from the plateau on)."""
    rows, t = [], born
    while t <= end:
        used = 160 + (plateau - 160) * min(1.0, (t - born) / climb_s)
        used += sum(d for (a, b), d in steps if a <= t < b)
        used += leak_per_min * max(0.0, t - born - climb_s) / 60
        rows.append({"t": t, "rss": 1500 + used, "used": used, "blocks": 2.5e6})
        t += 20.0
    return rows


def _s29_p3():
    api = lambda born, end: _proc(900, 0.0, 221.5, 0.0, born=born, end=end)  # noqa: E731
    wobble = (((T0 + 2, S29_KILL - 480), 0.0),
              ((S29_KILL - 130, S29_KILL - 60), 9.0),   # 577 -> 586 (the s29 series:
              ((S29_KILL - 60, S29_KILL - 40), 13.0),   # 584.5, 588.3, 589.5, 584.3,
              ((S29_KILL - 40, S29_KILL + 1), 7.0))     # 584.2, 590.3, 584.2)
    first = {10: api(T0 - 50, S29_KILL), 11: _engine_core(T0 - 20, S29_KILL, 577, wobble)}
    born2 = S29_KILL + 30
    second = {20: api(born2, T0 + S29_LOAD + 60),
              21: _engine_core(born2 + 25, T0 + S29_LOAD + 60, 580)}
    return {10: first, 20: second}


def test_a_plateau_cut_by_a_restart_is_not_judged_as_growth():
    """Session 29's false verdict: a prefill SIGKILLed in the load's second
    half.  Per lifetime, the first one's window (the second half of its 16.2
    minutes under load: 8.1 min) and the restarted one's (4.2 min) are both
    under 10 minutes: no violation, each named as not judged.  The old
    rule's window (the load's second half, the first lifetime's 3.6 minutes
    in it) reads > 1 MiB/min on this series."""
    p3 = _s29_p3()
    old = sum(sk._per_min([(r["t"], r["used"]) for r in rows
                           if T0 + S29_LOAD / 2 <= r["t"] <= S29_KILL])
              for rows in p3[10].values())
    assert old > 2.0, old  # the old rule: +3.6 on the real series
    table, v, not_judged = sk.memory_verdict({"P3": p3}, T0, T0 + S29_LOAD)
    assert v == [], v
    assert [r["window_min"] for r in table["P3"]] == [8.1, 4.2], table
    assert len(not_judged) == 2 and all(x.startswith("P3 (lifetime ") and "not judged" in x
                                        for x in not_judged), not_judged
    assert "lifetime 1 of 2, born" in not_judged[0] and "8.1 min (< 10)" in not_judged[0]
    # A shorter minimum would judge the first lifetime over 8.1 minutes of
    # plateau and its end-step: the reason for 10.
    _, v, _ = sk.memory_verdict({"P3": p3}, T0, T0 + S29_LOAD, min_window_s=480)
    assert v and v[0].startswith("P3 (lifetime 1 of 2"), v


def test_a_leak_in_a_restarted_lifetime_fails():
    """A real leak: a P1 restarted 3 minutes into a 30-minute load warms up,
    then its in-use bytes grow 2 MiB/min for the rest of its 27 minutes.  Its
    window (the second half: 13.5 min) is judged and fails, named by its
    lifetime; the first lifetime (3 minutes) is reported as not judged.  (The
    old rule never judged a restarted process.)"""
    kill = T0 + 180
    p1 = {10: {11: _engine_core(T0 - 20, kill, 577)},
          20: {21: _engine_core(kill + 30, T0 + LOAD + 60, 577, leak_per_min=2.0)}}
    table, v, not_judged = sk.memory_verdict({"R": _reference(), "P1": p1}, T0, T0 + LOAD)
    assert len(v) == 1 and v[0].startswith("P1 (lifetime 2 of 2, born "), v
    assert "malloc in-use bytes grow 2.0" in v[0] and "R's 0.1 + 1" in v[0], v
    assert not_judged == [next(x for x in not_judged if x.startswith("P1 (lifetime 1 of 2"))]
    assert "1.5 min (< 10)" in not_judged[0], not_judged


def test_the_report_prints_the_lifetimes_not_judged(capsys):
    """Not judged is not "ok": the report logs each lifetime too short."""
    table, v, not_judged = sk.memory_verdict({"P3": _s29_p3(), "R": _reference()},
                                             T0, T0 + S29_LOAD)
    rc = sk.report({"memory": table, "memory_not_judged": not_judged, "violations": v})
    out = capsys.readouterr().out
    assert rc == 0
    assert "memory P3 (lifetime 1 of 2, born" in out and "memory R: the second half" in out
    assert out.count("not judged") == 2, out


def test_memory_series_maps_processes_to_servers(tmp_path):
    """memwatch lines (one file per process) are grouped by process group
    (one lifetime of a server): a server's API process and its EngineCore
    add up; other groups (proxies, etcd) are left out; a line cut by a
    SIGKILL is skipped."""
    import json
    mall = {"uordblks": 100 << 20, "hblkhd": 28 << 20}
    for pid, pgid in ((11, 10), (12, 10), (21, 20)):
        with open(tmp_path / f"{pid}.jsonl", "w") as f:
            for i in range(3):
                f.write(json.dumps({"t": T0 + i, "pid": pid, "pgid": pgid, "VmRSS": 1024 * 1024,
                                    "mall": mall, "py_blocks": 5}) + "\n")
            f.write('{"t": 12, "pid"')
    series = sk.memory_series(sk.read_memwatch(str(tmp_path)), {10: "D1"})
    assert sorted(series) == ["D1"] and sorted(series["D1"]) == [10]
    assert sorted(series["D1"][10]) == [11, 12]
    assert series["D1"][10][11][0] == {"t": T0, "rss": 1024.0, "used": 128.0, "blocks": 5}


def _start(tmp_path, env_extra):
    env = dict(os.environ, MC_MEMWATCH=str(tmp_path), MC_MEMWATCH_S="0.5",
               PYTHONPATH=sk.MEMWATCH_DIR, **env_extra)
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env,
                            start_new_session=True)


def test_injected_leak_in_a_real_process_fails_the_verdict(tmp_path):
    """Three real processes under memwatch for ~10 s: R (nothing), OK
    (nothing), LEAK (MC_MEMWATCH_LEAK_KB_S=1024: 60 MiB/min of malloc'd,
    touched, never freed memory; MC_MEMWATCH_LEAK_OBJS_S=2000: 120,000
    Python objects a minute); then the soak's malloc_trim round and its
    verdict over the second half of the 8 s "load" (a 3 s minimum window):
    LEAK fails on all three counts, OK passes."""
    procs = {"R": _start(tmp_path, {}), "OK": _start(tmp_path, {}),
             "LEAK": _start(tmp_path, {"MC_MEMWATCH_LEAK_KB_S": "1024",
                                       "MC_MEMWATCH_LEAK_OBJS_S": "2000"})}
    try:
        time.sleep(1.5)
        t_load = time.time()
        time.sleep(8.0)
        t_end = time.time()
        of = {p.pid: n for n, p in procs.items()}
        res = {}
        sk.trim_memwatch(str(tmp_path), of, res, wait_s=10)
        series = sk.memory_series(sk.read_memwatch(str(tmp_path)), of)
        table, v, _ = sk.memory_verdict(series, t_load, t_end, kept_margin=4.0,
                                        min_window_s=3.0)
    finally:
        for p in procs.values():
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert sorted(series) == ["LEAK", "OK", "R"]
    table = {n: lives[0] for n, lives in table.items()}  # one lifetime each
    assert all("kept_after_trim" in table[n] for n in table), table
    assert table["LEAK"]["used"] > 40.0 and table["LEAK"]["blocks"] > 60_000, table
    assert table["OK"]["used"] < 1.0, table
    assert [x.split(":")[0] for x in v] == ["LEAK"] * 3, v
    assert any("malloc in-use" in x for x in v) and any("Python blocks" in x for x in v)
    assert any("after malloc_trim" in x for x in v), v
