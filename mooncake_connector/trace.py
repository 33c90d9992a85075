"""Per-request timeline of the push flow, for finding where a request's
milliseconds go (issue 31).  Off unless ``MC_TRACE=<file>`` is set in the
environment of the processes to trace (proxy, prefill and decode servers):
then each appends one JSON line per event to that file,

    {"t": <time.monotonic()>, "w": <time.time()>, "pid": ..., "ev": "...", "k": "<key>", ...}

``t`` is CLOCK_MONOTONIC, one clock for every process of a host, so lines
from the proxy, the prefill and the decode order on one axis.  ``k`` is the
push transfer id (the proxy's ``push-<request id>-<hex>``) or, where none is
known (the proxy's pass-through, the first chunk), the proxy's request id.
Events: docs/connector.md, "Tracing one request".  Bounded: a process stops
writing after ``MC_TRACE_MAX_MB`` (default 64) MiB and says so once.
``benchmarks/ttft_timeline.py`` reads the file back into a table.
"""
import json
import logging
import os
import threading
import time

logger = logging.getLogger("vllm.mooncake_connector")

PATH = os.environ.get("MC_TRACE") or None
ON = PATH is not None


def _max_bytes():
    raw = os.environ.get("MC_TRACE_MAX_MB", "64")
    try:
        mb = float(raw)
    except ValueError:
        raise ValueError(f"MC_TRACE_MAX_MB={raw!r}: expected a number of MiB, e.g. 64") \
            from None
    if not 0 < mb < float("inf"):  # nan and inf included
        raise ValueError(f"MC_TRACE_MAX_MB={raw!r}: must be a finite number > 0 (unset "
                         "MC_TRACE to trace nothing)")
    return int(mb * (1 << 20))


_lock = threading.Lock()
_fd = None
_written = 0
_limit = _max_bytes() if ON else 0
_full = False


def event(ev, key, **fields):
    """Append one event (a no-op unless MC_TRACE is set)."""
    if not ON:
        return
    t, w = time.monotonic(), time.time()
    # ct: this thread's CPU seconds so far (tid: which thread), so a stretch
    # between two events of one thread splits into computing and waiting
    line = json.dumps({"t": t, "w": w, "pid": os.getpid(), "tid": threading.get_native_id(),
                       "ct": time.thread_time(), "ev": ev, "k": key, **fields},
                      separators=(",", ":"), default=str) + "\n"
    data = line.encode()
    global _fd, _written, _full
    with _lock:
        if _full:
            return
        if _written + len(data) > _limit:
            _full = True
            logger.warning("MC_TRACE: %s reached MC_TRACE_MAX_MB (%d bytes written by this "
                           "process); no more events", PATH, _written)
            return
        if _fd is None:
            _fd = os.open(PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(_fd, data)  # O_APPEND: one line per write, lines of processes do not mix
        _written += len(data)


def read(path):
    """The events of a trace file, oldest first."""
    out = []
    with open(path, encoding="utf-8") as f:
        for ln in f:
            ln = ln.strip()
            if ln:
                try:
                    out.append(json.loads(ln))
                except ValueError:
                    continue  # a line cut by a process killed mid-write
    out.sort(key=lambda e: e["t"])
    return out
