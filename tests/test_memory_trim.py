"""malloc_trim_idle_s (mooncake_connector/connector/memory.py): once the
server is idle, one malloc_trim(0) gives the memory glibc kept in its heaps
back to the system (issue 31: a loaded EngineCore's RSS grows with freed
heap memory, not with memory in use)."""
import threading
import time

import pytest

from mooncake_connector.connector import memory
from mooncake_connector.connector import settings as settings_mod


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_trims_once_per_idle_period():
    """No trim before the first step (a server that never served keeps what
    start-up left), none while steps run, exactly one once idle_s passed
    without a step, and no second one until a step ran again."""
    clock, calls = Clock(), []
    t = memory.IdleTrim(10.0, trim=lambda pad: calls.append(pad) or 1, clock=clock,
                        rss=lambda: 1000)
    try:
        assert t.on
        clock.t += 60
        assert not t.check() and calls == []
        for _ in range(5):  # a step every 5 s: never idle for 10 s
            t.step()
            clock.t += 5
            assert not t.check()
        clock.t += 5.01
        assert t.check() and calls == [0] and t.trims == 1
        clock.t += 100
        assert not t.check() and t.trims == 1
        t.step()
        clock.t += 9.9
        assert not t.check()
        clock.t += 0.2
        assert t.check() and t.trims == 2
    finally:
        t.close()


def test_off_and_other_c_libraries(monkeypatch, caplog):
    """0 starts no thread; a C library without malloc_trim is logged once and
    off (not an error)."""
    before = {th.name for th in threading.enumerate()}
    assert not memory.IdleTrim(0).on
    monkeypatch.setattr(memory, "_libc_trim", lambda: None)
    with caplog.at_level("INFO", logger="vllm.mooncake_connector"):
        t = memory.IdleTrim(5.0)
    assert not t.on and "has no malloc_trim" in caplog.text
    t.step()
    t.close()
    assert "mc-idle-trim" not in {th.name for th in threading.enumerate()} - before


def _rss():
    return memory.rss_bytes()


REAL_TRIM = """
import ctypes, json, time
from mooncake_connector.connector import memory
if memory._libc_trim() is None:
    print(json.dumps({"skip": "not glibc"}))
    raise SystemExit(0)
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
n, size = 2048, 32 << 10
ptrs = [libc.malloc(size) for _ in range(n)]
assert all(ptrs)
for p in ptrs:
    ctypes.memset(p, 7, size)
for p in ptrs[:-1]:
    libc.free(p)
kept = memory.rss_bytes()
time.sleep(0.3)
out = {"kept": kept, "later": memory.rss_bytes()}
t = memory.IdleTrim(0.2)
t.step()
deadline = time.monotonic() + 10
while t.trims == 0 and time.monotonic() < deadline:
    time.sleep(0.05)
out.update(trims=t.trims, freed=t.freed_bytes, after=memory.rss_bytes(), last_s=t.last_s)
time.sleep(0.5)
out["trims_later"] = t.trims
t.close()
libc.free(ptrs[-1])
print(json.dumps(out))
"""


def test_real_trim_returns_freed_heap_memory():
    """glibc, for real: 64 MiB in 32 KiB blocks (below the mmap threshold:
    heap memory), touched, then all freed but the last block, which pins
    the heap's top: glibc keeps the 64 MiB resident.  The idle thread's
    malloc_trim(0) gives it back: RSS falls by most of it, counted in
    freed_bytes.  Fails without the trim (RSS stays).  In a process of its
    own: malloc_trim works on the whole process, and an idle-trim thread
    another test left in pytest's process could trim first (CI saw
    freed_bytes 0 once)."""
    import json
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", REAL_TRIM], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    kept = out["kept"]
    assert out["later"] > kept - (16 << 20), ("glibc gave the freed heap back by itself", out)
    assert out["trims"] == 1, out
    assert out["freed"] > 40 << 20, out
    assert out["after"] < kept - (40 << 20), out
    assert out["last_s"] < 1.0, out
    assert out["trims_later"] == 1, out  # idle on: once per idle period


class _Extra:
    kv_role = "kv_consumer"

    def __init__(self, **extra):
        self.kv_connector_extra_config = extra


def test_knob_default_and_bad_values():
    assert settings_mod.resolve(_Extra(), env={}).malloc_trim_idle_s == 30.0
    assert settings_mod.resolve(_Extra(malloc_trim_idle_s=0), env={}).malloc_trim_idle_s == 0
    for bad in (-1, float("nan"), 1e9):
        with pytest.raises(settings_mod.SettingsError, match="malloc_trim_idle_s must be"):
            settings_mod.resolve(_Extra(malloc_trim_idle_s=bad), env={})


@pytest.mark.vllm
def test_worker_trims_when_vllm_stops_stepping(tmp_path):
    """vLLM's real scheduler and our worker connector (tests/vllm_harness.py):
    steps run, then none for longer than malloc_trim_idle_s; the worker's
    thread trims once, and the next step reports it in the connector's stats
    (vllm:mooncake_malloc_trims_total).  0 starts no thread; shutdown ends it."""
    pytest.importorskip("vllm")
    from test_connector_vllm import free_port, free_port_away
    from vllm_harness import Side, make_request, tiny_model_dir

    p = free_port()
    urls = {"prefill_url": f"127.0.0.1:{p}", "decode_url": f"127.0.0.1:{free_port_away(p)}",
            "metadata_server": "P2PHANDSHAKE", "protocol": "tcp"}
    model = tiny_model_dir(str(tmp_path / "tiny"))

    def trims(side):
        return sum(st.data.get("malloc_trims", 0) for st in side.stats)

    off = Side(model, "kv_producer", {**urls, "malloc_trim_idle_s": 0})
    try:
        assert off.workers[0]._worker.idle_trim is None
    finally:
        off.close()
    p = Side(model, "kv_producer", {**urls, "malloc_trim_idle_s": 0.3, "hold_timeout_s": 0.2})
    try:
        p.add(make_request("r", list(range(3, 40)), max_tokens=1))
        for _ in range(5):
            p.step()
        assert trims(p) == 0
        assert "mc-idle-trim" in {th.name for th in threading.enumerate()}
        time.sleep(1.5)
        p.step()
        assert trims(p) == 1, [st.data for st in p.stats]
        assert sum(st.data.get("malloc_trim_freed_bytes", 0) for st in p.stats) >= 0
    finally:
        p.close()
    assert p.workers[0]._worker.idle_trim is None
