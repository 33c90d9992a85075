"""Giving the worker process's freed heap memory back to the system (glibc).

glibc's malloc keeps memory the process freed inside its heaps for reuse;
its RSS stays at the high-water mark of every mix of allocations it has
served.  A vLLM EngineCore (the process our worker side runs in) frees and
reallocates activations and per-step tensors all the time, so its RSS grows
for tens of minutes under a changing load although the bytes in use level
off (benchmarks/JOURNAL.md, issue 31: in use flat while RSS grew 13-16
MiB/min; malloc_trim(0) afterwards gave 255-455 MiB back).

IdleTrim (knob malloc_trim_idle_s): once no step has run for that long --
the server is idle -- one malloc_trim(0), which returns the free pages of
every arena to the system (a trimmed heap refills on demand).  It runs on
its own thread, only while idle: a step that starts during a trim waits for
the arena it needs (measured: see docs/connector.md).  Not on other C
libraries (no malloc_trim): off, logged once.
"""
import ctypes
import logging
import threading
import time

logger = logging.getLogger("vllm.mooncake_connector")


def _libc_trim():
    """glibc's malloc_trim, or None (another C library)."""
    try:
        libc = ctypes.CDLL(None)
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def rss_bytes():
    """This process's resident bytes (0 when /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    except (OSError, ValueError, IndexError):
        return 0


class IdleTrim:
    """One malloc_trim(0) after idle_s seconds without a step (step() marks
    one); a thread checks every min(1, idle_s / 4) seconds.  stats(): trims,
    bytes they returned (RSS before minus after), the last one's seconds."""

    def __init__(self, idle_s, trim=None, clock=time.monotonic, rss=rss_bytes):
        self.idle_s = float(idle_s)
        self._trim = trim if trim is not None else _libc_trim()
        self._clock, self._rss = clock, rss
        self._last = clock()
        self._dirty = False      # a step ran since the last trim
        self._stop = threading.Event()
        self.trims = 0
        self.freed_bytes = 0
        self.last_s = 0.0
        self._thread = None
        if self.idle_s <= 0:
            return
        if self._trim is None:
            logger.info("MooncakeConnector: malloc_trim_idle_s %.3g ignored: this C library "
                        "has no malloc_trim (not glibc)", self.idle_s)
            return
        self._thread = threading.Thread(target=self._run, name="mc-idle-trim", daemon=True)
        self._thread.start()

    @property
    def on(self):
        return self._thread is not None

    def step(self):
        """A step ran (get_finished): the server is not idle."""
        self._last = self._clock()
        self._dirty = True

    def check(self):
        """Trim once if idle for idle_s since a step; True when it trimmed."""
        if not self._dirty or self._clock() - self._last < self.idle_s:
            return False
        self._dirty = False
        before = self._rss()
        t = time.perf_counter()
        self._trim(0)
        self.last_s = time.perf_counter() - t
        self.trims += 1
        self.freed_bytes += max(0, before - self._rss())
        return True

    def _run(self):
        every = min(1.0, self.idle_s / 4)
        while not self._stop.wait(every):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - never take the server down for this
                logger.exception("MooncakeConnector: idle malloc_trim failed; stopped")
                return

    def close(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
