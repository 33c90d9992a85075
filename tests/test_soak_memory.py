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
    return sk.memory_verdict(series, T0, T0 + LOAD / 2, T0 + LOAD, **kw)


def _reference():
    # R: RSS +4 MiB/min of retained free heap, in use flat, 1200 MiB after trim
    return {1: _proc(1100, 4.0, 260, 0.1, 300, trim_after=1100 + 240),
            2: _proc(900, 0.0, 20, 0.0, 0, trim_after=900)}


def test_retained_free_heap_is_not_a_leak():
    """A server whose RSS grows 15 MiB/min (glibc keeping freed memory) with
    malloc in-use bytes and Python blocks flat, and that gives it back to
    malloc_trim(0) as R does, passes; the old RSS-slope rule (R + 4 MiB/min)
    would have failed it."""
    series = {"R": _reference(),
              "D1": {3: _proc(1080, 15.0, 250, 0.3, 800, trim_after=1080 + 265),
                     4: _proc(900, 0.0, 20, 0.0, 0, trim_after=900)}}
    table, v = _verdict(series)
    assert v == [], v
    assert abs(table["D1"]["rss"] - 15.0) < 0.01  # reported
    assert abs(table["D1"]["used"] - 0.3) < 0.01
    assert table["D1"]["kept_after_trim"] == 265.0 and table["R"]["kept_after_trim"] == 240.0
    samples = [{"t": r["t"] - T0, "server": "D1", "pid": 3, "rss": r["rss"] * 2**20}
               for r in series["D1"][3]]
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
    table, v = _verdict({"R": _reference(), "D1": {3: proc}})
    assert len(v) == 1 and v[0].startswith("D1: ") and needle in v[0], (what, v)
    assert "R's" in v[0]


def test_restarted_process_and_missing_reference():
    """A process born after the load began (a fault restarted it) is warming
    up: not judged; a server with only such processes has no row.  Without a
    reference the slopes are judged against 0 + margin and the RSS kept
    after trim (hundreds of MiB of warm-up) is reported, not judged."""
    young = _proc(600, 200.0, 100, 50.0, 50_000, born=T0 + 600, trim_after=2000)
    table, v = _verdict({"R": _reference(), "P1": {7: young}})
    assert table["P1"] is None and v == []
    ok = _proc(1080, 15.0, 250, 0.5, 800, trim_after=1080 + 265)
    table, v = _verdict({"D1": {3: ok}})
    assert v == [] and table["D1"]["kept_after_trim"] == 265.0
    table, v = _verdict({"D1": {3: _proc(1080, 15.0, 250, 1.5, 800)}})
    assert v == ["D1: malloc in-use bytes grow 1.5 MiB/min (> 0 + 1)"], v


def test_memory_series_maps_processes_to_servers(tmp_path):
    """memwatch lines (one file per process) are grouped by process group:
    a server's API process and its EngineCore add up; other groups (proxies,
    etcd) are left out; a line cut by a SIGKILL is skipped."""
    import json
    mall = {"uordblks": 100 << 20, "hblkhd": 28 << 20}
    for pid, pgid in ((11, 10), (12, 10), (21, 20)):
        with open(tmp_path / f"{pid}.jsonl", "w") as f:
            for i in range(3):
                f.write(json.dumps({"t": T0 + i, "pid": pid, "pgid": pgid, "VmRSS": 1024 * 1024,
                                    "mall": mall, "py_blocks": 5}) + "\n")
            f.write('{"t": 12, "pid"')
    series = sk.memory_series(sk.read_memwatch(str(tmp_path)), {10: "D1"})
    assert sorted(series) == ["D1"] and sorted(series["D1"]) == [11, 12]
    assert series["D1"][11][0] == {"t": T0, "rss": 1024.0, "used": 128.0, "blocks": 5}


def _start(tmp_path, env_extra):
    env = dict(os.environ, MC_MEMWATCH=str(tmp_path), MC_MEMWATCH_S="0.5",
               PYTHONPATH=sk.MEMWATCH_DIR, **env_extra)
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env,
                            start_new_session=True)


def test_injected_leak_in_a_real_process_fails_the_verdict(tmp_path):
    """Three real processes under memwatch for ~8 s: R (nothing), OK
    (nothing), LEAK (MC_MEMWATCH_LEAK_KB_S=1024: 60 MiB/min of malloc'd,
    touched, never freed memory; MC_MEMWATCH_LEAK_OBJS_S=2000: 120,000
    Python objects a minute); then the soak's malloc_trim round and its
    verdict over the whole run: LEAK fails on all three counts, OK passes."""
    procs = {"R": _start(tmp_path, {}), "OK": _start(tmp_path, {}),
             "LEAK": _start(tmp_path, {"MC_MEMWATCH_LEAK_KB_S": "1024",
                                       "MC_MEMWATCH_LEAK_OBJS_S": "2000"})}
    try:
        time.sleep(1.5)
        t_load = time.time()
        time.sleep(7.0)
        t_end = time.time()
        of = {p.pid: n for n, p in procs.items()}
        res = {}
        sk.trim_memwatch(str(tmp_path), of, res, wait_s=10)
        series = sk.memory_series(sk.read_memwatch(str(tmp_path)), of)
        table, v = sk.memory_verdict(series, t_load, t_load, t_end, kept_margin=4.0)
    finally:
        for p in procs.values():
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert sorted(series) == ["LEAK", "OK", "R"]
    assert all("kept_after_trim" in table[n] for n in table), table
    assert table["LEAK"]["used"] > 40.0 and table["LEAK"]["blocks"] > 60_000, table
    assert table["OK"]["used"] < 1.0, table
    assert [x.split(":")[0] for x in v] == ["LEAK"] * 3, v
    assert any("malloc in-use" in x for x in v) and any("Python blocks" in x for x in v)
    assert any("after malloc_trim" in x for x in v), v
