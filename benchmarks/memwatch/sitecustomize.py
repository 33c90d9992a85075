"""Where a server's memory goes, sampled from inside each Python process
(benchmarks only; issue 31's RSS question).  Nothing happens unless
MC_MEMWATCH=<dir> is set; put this folder on PYTHONPATH:

    MC_MEMWATCH=/tmp/mw PYTHONPATH=$PWD:$PWD/benchmarks/memwatch python -P benchmarks/soak.py ...

Every MC_MEMWATCH_S seconds (default 30) each process (also one forked
later: vLLM's EngineCore) appends a JSON line to <dir>/<pid>.jsonl:
RSS and RssAnon (/proc/self/status), glibc's mallinfo2 over all arenas
(arena: bytes the malloc heaps hold from the system; uordblks: in use;
fordblks: free inside them; hblkhd: mmap'ed chunks), Python's allocated
blocks, threads (Python and all), and with PYTHONTRACEMALLOC set the bytes
tracemalloc traces (and its own overhead).  With tracemalloc on, every
MC_MEMWATCH_SNAP_S (default 300) the line also carries the 15 allocation
sites that grew most since the first snapshot (taken MC_MEMWATCH_SNAP_S
after start: warm-up excluded).  MC_MEMWATCH_TRACE=<frames> starts
tracemalloc MC_MEMWATCH_TRACE_AFTER_S (120) after the process started
instead (start-up under PYTHONTRACEMALLOC is several times slower): it
traces only what is allocated from then on.  Once <dir>/trim-now exists (looked for
every second), each process takes one more sample, calls malloc_trim(0)
and records RSS before and after: memory the allocator held free inside
its heaps goes back to the system.

Also in every line: the host's load average, the process group (the soak
maps a server to its processes by it), glibc's arenas from malloc_info
(per heap: bytes held from the system and free inside: "heaps"), thread
names and how many threading.Thread objects were ever made (short-lived
threads).  MC_MEMWATCH_TRIM_S=<s> calls malloc_trim(0) every <s> seconds
(a periodic-trim experiment) and records each call's duration and the RSS
it gave back ("ptrim").

Test only (the soak's memory verdict must fail on a real leak:
tests/test_soak_memory.py): MC_MEMWATCH_LEAK_KB_S=<n> mallocs n KiB a
second, touches it and never frees it; MC_MEMWATCH_LEAK_OBJS_S=<n> keeps n
small Python objects a second.
"""
import ctypes
import json
import os
import sys
import threading
import time
import tracemalloc

DIR = os.environ.get("MC_MEMWATCH")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]


def _status():
    out = {}
    with open("/proc/self/status") as f:
        for ln in f:
            k, _, v = ln.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile", "Threads"):
                out[k] = int(v.split()[0])
    return out


def _heaps(libc):
    """[[heap nr, bytes held from the system, bytes free inside]] from malloc_info's XML."""
    import re
    path = os.path.join(DIR, f".mi-{os.getpid()}.xml")
    fp = libc.fopen(path.encode(), b"w")
    if not fp:
        return None
    try:
        libc.malloc_info(0, ctypes.c_void_p(fp))
    finally:
        libc.fclose(ctypes.c_void_p(fp))
    with open(path) as f:
        xml = f.read()
    os.unlink(path)
    out = []
    for m in re.finditer(r'<heap nr="(\d+)">(.*?)</heap>', xml, re.S):
        body = m.group(2)
        cur = re.search(r'<system type="current" size="(\d+)"', body)
        free = sum(int(x) for x in re.findall(r'<total type="(?:fast|rest)" count="\d+" '
                                              r'size="(\d+)"', body))
        out.append([int(m.group(1)), int(cur.group(1)) if cur else None, free])
    return out


def _threads():
    names = {}
    try:
        for t in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{t}/comm") as f:
                    n = f.read().strip()
            except OSError:
                continue
            names[n] = names.get(n, 0) + 1
    except OSError:
        pass
    return names


def _name():
    try:
        with open("/proc/self/comm") as f:
            comm = f.read().strip()
        return comm + " " + " ".join(sys.argv[:3])[:120]
    except OSError:
        return "?"


def _run(pid):
    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    mallinfo2 = getattr(libc, "mallinfo2", None)
    if mallinfo2 is not None:
        mallinfo2.restype = _MallInfo2
    every = float(os.environ.get("MC_MEMWATCH_S", "30"))
    snap_every = float(os.environ.get("MC_MEMWATCH_SNAP_S", "300"))
    path = os.path.join(DIR, f"{pid}.jsonl")
    t0 = time.monotonic()
    first = None
    next_snap = t0 + snap_every
    trimmed = False
    trace = int(os.environ.get("MC_MEMWATCH_TRACE", "0"))  # frames; 0: off
    trace_at = t0 + float(os.environ.get("MC_MEMWATCH_TRACE_AFTER_S", "120"))
    trim_file = os.path.join(DIR, "trim-now")
    due = time.monotonic() + every
    ptrim_every = float(os.environ.get("MC_MEMWATCH_TRIM_S", "0"))
    ptrim_due = time.monotonic() + ptrim_every
    ptrims = []  # [t, seconds, rss_before_kb, rss_after_kb] since the last sample
    leak_kb = int(os.environ.get("MC_MEMWATCH_LEAK_KB_S", "0"))
    leak_objs = int(os.environ.get("MC_MEMWATCH_LEAK_OBJS_S", "0"))
    kept = []
    libc.malloc.restype = ctypes.c_void_p
    last_leak = time.monotonic()
    while True:
        time.sleep(min(1.0, every))
        if os.getpid() != pid:
            return  # forked: the child has its own thread
        trim = not trimmed and os.path.exists(trim_file)
        if (leak_kb or leak_objs) and not trimmed:
            now = time.monotonic()
            secs, last_leak = now - last_leak, now
            if leak_kb:
                n = int(leak_kb * 1024 * secs)
                p = libc.malloc(n)
                if p:
                    ctypes.memset(p, 1, n)
            kept.extend(object() for _ in range(int(leak_objs * secs)))
        if ptrim_every > 0 and time.monotonic() >= ptrim_due:
            ptrim_due = time.monotonic() + ptrim_every
            before = _status().get("VmRSS")
            t1 = time.perf_counter()
            libc.malloc_trim(0)
            ptrims.append([round(time.time(), 1), round(time.perf_counter() - t1, 4), before,
                           _status().get("VmRSS")])
        if time.monotonic() < due and not trim:
            continue
        due = time.monotonic() + every
        if trace and not tracemalloc.is_tracing() and time.monotonic() >= trace_at:
            tracemalloc.start(trace)  # after start-up: only what is allocated later
            next_snap = time.monotonic()  # the reference snapshot at the next sample
        rec = {"t": time.time(), "up_s": round(time.monotonic() - t0, 1), "pid": pid,
               "name": _name(), "py_blocks": sys.getallocatedblocks(),
               "py_threads": threading.active_count(), "pgid": os.getpgid(0),
               "threads_made": repr(getattr(getattr(threading, "_counter", None), "__self__", "")),
               "tnames": _threads()}
        try:
            with open("/proc/loadavg") as f:
                rec["load"] = [float(x) for x in f.read().split()[:3]]
        except OSError:
            pass
        try:
            rec["heaps"] = _heaps(libc)
        except (OSError, AttributeError, ValueError):
            pass
        if ptrims:
            rec["ptrim"], ptrims = ptrims, []
        try:
            rec.update(_status())
        except OSError:
            pass
        if mallinfo2 is not None:
            m = mallinfo2()
            rec["mall"] = {k: getattr(m, k) for k, _ in _MallInfo2._fields_}
        if tracemalloc.is_tracing():
            cur, peak = tracemalloc.get_traced_memory()
            rec["traced"], rec["traced_peak"] = cur, peak
            rec["tracemalloc_overhead"] = tracemalloc.get_tracemalloc_memory()
            if time.monotonic() >= next_snap:
                next_snap += snap_every
                snap = tracemalloc.take_snapshot().filter_traces(
                    (tracemalloc.Filter(False, tracemalloc.__file__),))
                if first is None:
                    first = snap
                else:
                    top = sorted(snap.compare_to(first, "traceback"), key=lambda s: -s.size_diff)[:15]
                    rec["grew"] = [{"kb": round(s.size_diff / 1024, 1), "n": s.count_diff,
                                    "at": [f"{fr.filename}:{fr.lineno}"
                                           for fr in s.traceback[-4:]]} for s in top]
        if trim:
            trimmed = True
            before = _status().get("VmRSS")
            libc.malloc_trim(0)
            rec["trim"] = {"rss_before_kb": before, "rss_after_kb": _status().get("VmRSS")}
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def _start():
    pid = os.getpid()
    threading.Thread(target=_run, args=(pid,), name="mc-memwatch", daemon=True).start()


if DIR:
    os.makedirs(DIR, exist_ok=True)
    _start()
    os.register_at_fork(after_in_child=_start)
