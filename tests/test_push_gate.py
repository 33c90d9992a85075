"""Gated write batches (csrc/engine/gate.c, TransferEngine.
batch_transfer_async_write_gated) and the push producer's CUDA path over
them (push.py _layer_gated, push_layer_gate).

The engine half: the notification a batch carries arrives only after its
writes landed, never for a failed or canceled one, and a batch gated on a
CUDA event writes nothing before the event completed.  The push half: with
CUDA KV caches each layer costs vLLM's forward thread one engine call and
wakes no Python thread (the layer-event thread, the landing thread and the
outbox thread each took the GIL per layer before), and the decode's
per-layer load still sees every layer land.

CUDA does not run here: the CUDA tests load the host-memory libcuda
stand-in (tests/c/fakecuda.c, built into a temporary directory) in a
child pytest, whose stream can be held busy so an event completes later.
The engine loads libcuda.so.1 by name once per process, so the child loads
the stand-in by its path before anything looks for it (a library already
loaded is found by its soname).  Where vLLM is installed the child is
forked from conftest's vllm_forks server, which imported vLLM once for
every test that uses it, instead of importing it again (~20 s of CPU)."""
import ctypes
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

import mooncake_connector as mc
from conftest import local_engines

HERE = os.path.dirname(os.path.abspath(__file__))
FAKE = os.environ.get("MC_TEST_FAKECUDA")  # set in the child: the stand-in is loaded


def _wait_notify(eng, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = eng.get_notifies()
        if got:
            return got
        eng.wait_notifies(0.05)
    return []


# ---------------------------------------------------------------- engine, host memory

def test_notify_after_the_batch_landed_and_not_for_a_failed_one(monkeypatch):
    monkeypatch.setenv("MC_SAME_HOST_CPU", "0")
    n = 16 << 20
    with local_engines(2) as (a, b):
        seg = b.get_segment_name()
        src, dst = a.allocate_managed_buffer(n), b.allocate_managed_buffer(n)
        for r in range(3):
            pat = bytes([65 + r]) * 4096
            for off in range(0, n, 1 << 20):
                a.write_bytes_to_buffer(src + off, pat * 256, 1 << 20)
            bid = a.batch_transfer_async_write_gated(seg, [src], [dst], [n],
                                                     notify=b"landed %d" % r)
            got = _wait_notify(b, 10)
            assert [m.msg for m in got] == [b"landed %d" % r]
            # at the message, every byte is there (the last first: it lands last)
            assert b.read_bytes_from_buffer(dst + n - 4096, 4096) == pat
            assert b.read_bytes_from_buffer(dst, 4096) == pat
            deadline = time.monotonic() + 5
            while a.transfer_check_status(bid) == 0 and time.monotonic() < deadline:
                time.sleep(0.001)
        # a batch with one write outside the decode's memory: failed, nothing told
        bid = a.batch_transfer_async_write_gated(seg, [src, src], [dst, dst + (n << 4)],
                                                 [4096, 4096], notify=b"never")
        deadline = time.monotonic() + 5
        while (r := a.transfer_check_status(bid)) == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert r < 0
        assert _wait_notify(b, 0.3) == []
        assert a.get_stats()["gate_notified"] == 3


@pytest.mark.parametrize("spin_us", ["0", "3000"])
def test_notification_waiters_and_gated_batches_with_a_wake_spin(monkeypatch, spin_us):
    """MC_WAKE_SPIN_US (the gate, its notifier and wait_notifies look before
    sleeping): a notification sent while the receiver waits is seen, a wait
    with nothing coming says so, a loss wakes a waiter once, and gated
    batches' notifications (event-less here) come after their writes, in
    order, from the spinning gate and notifier threads."""
    monkeypatch.setenv("MC_SAME_HOST_CPU", "0")
    monkeypatch.setenv("MC_WAKE_SPIN_US", spin_us)
    with local_engines(2) as (a, b):
        seg = b.get_segment_name()
        assert b.wait_notifies(0.002) is False
        t = threading.Timer(0.001, lambda: a.send_notify(seg, b"hello", 5.0))
        t.start()
        assert _wait_notify(b, 5)[0].msg == b"hello"
        t.join()
        n = 1 << 16
        src, dst = a.allocate_managed_buffer(n), b.allocate_managed_buffer(n)
        for r in range(8):
            a.write_bytes_to_buffer(src, bytes([r + 1]) * n, n)
            a.batch_transfer_async_write_gated(seg, [src], [dst], [n], notify=b"L%d" % r)
            got = _wait_notify(b, 5)
            assert [m.msg for m in got] == [b"L%d" % r]
            assert b.read_bytes_from_buffer(dst + n - 16, 16) == bytes([r + 1]) * 16
        assert b.wait_notifies(0.001) is False


def test_bad_arguments_are_named():
    with local_engines(2) as (a, b):
        seg = b.get_segment_name()
        src, dst = a.allocate_managed_buffer(4096), b.allocate_managed_buffer(4096)
        with pytest.raises(ValueError, match="notify must be bytes"):
            a.batch_transfer_async_write_gated(seg, [src], [dst], [8], notify="text")
        with pytest.raises(ValueError, match="cuda_device"):
            a.batch_transfer_async_write_gated(seg, [src], [dst], [8], cuda_event=1,
                                               cuda_device=-1)
        with pytest.raises(ValueError, match="cuda_event must be an int"):
            a.batch_transfer_async_write_gated(seg, [src], [dst], [8], cuda_event="ev")
        # the whole message (PyErr_Format has no %g: Python 3.12 raised SystemError)
        with pytest.raises(ValueError, match=r"notify_timeout must be a number of seconds in "
                           r"[\[(]0, \d+(\.\d+)?(e\+\d+)?\], not -1"):
            a.batch_transfer_async_write_gated(seg, [src], [dst], [8], notify_timeout=-1)
        if not FAKE:  # no libcuda in this process: an event cannot be waited for
            with pytest.raises(mc.MooncakeError, match="CUDA driver is not loaded"):
                a.batch_transfer_async_write_gated(seg, [src], [dst], [8], cuda_event=1)
        with pytest.raises(mc.MooncakeError, match="at least one request"):
            a.batch_transfer_async_write_gated(seg, [], [], [])


# ---------------------------------------------------------------- the child with fake CUDA

def _build_fake(tmp):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the libcuda stand-in")
    out = os.path.join(tmp, "libcuda.so.1")
    subprocess.run([cc, "-std=gnu11", "-O2", "-fPIC", "-shared", "-pthread",
                    "-Wl,-soname,libcuda.so.1", os.path.join(HERE, "c", "fakecuda.c"),
                    "-o", out], check=True)
    return tmp


# The child: the stand-in (argv[1]) loaded by its path first, then pytest
# (argv[2:]).
FAKE_CHILD = """
import ctypes, sys
ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
import pytest
sys.exit(pytest.main(sys.argv[2:]))
"""


@pytest.mark.skipif(bool(FAKE), reason="the child itself")
def test_cuda_paths_with_the_libcuda_stand_in(tmp_path, request):
    d = _build_fake(str(tmp_path))
    env = dict(os.environ, MC_TEST_FAKECUDA="1",
               LD_LIBRARY_PATH=d + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""))
    argv = [os.path.join(d, "libcuda.so.1"), "-x", "-q", "-p", "no:cacheprovider", "-s",
            os.path.join(HERE, "test_push_gate.py"), "-k", "fake_"]
    have_vllm = importlib.util.find_spec("vllm") is not None
    if have_vllm:
        r = request.getfixturevalue("vllm_forks").run(FAKE_CHILD, argv, env=env,
                                                       cwd=os.path.dirname(HERE), timeout=600)
    else:
        r = subprocess.run([sys.executable, "-c", FAKE_CHILD, *argv], env=env,
                           cwd=os.path.dirname(HERE), capture_output=True, text=True,
                           timeout=600)
    print(r.stdout[-6000:], r.stderr[-3000:])
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    tail = r.stdout.split("\n")[-2]
    # every fake_ test ran (the vLLM ones skip only where vllm is not installed)
    assert " passed" in r.stdout and ("skipped" not in tail or not have_vllm), tail


class Fake:
    """The stand-in's streams and events (ctypes: calls release the GIL)."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.fakecuda_stream_hold.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
        for f in ("cuEventRecord",):
            getattr(self.lib, f).argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.lib.cuEventSynchronize.argtypes = [ctypes.c_void_p]
        self.lib.cuEventQuery.argtypes = [ctypes.c_void_p]
        s = ctypes.c_void_p()
        assert self.lib.cuStreamCreate(ctypes.byref(s), 0) == 0
        self.stream = s

    def hold(self, seconds):
        self.lib.fakecuda_stream_hold(self.stream, int(seconds * 1e9))

    def event(self):
        e = ctypes.c_void_p()
        assert self.lib.cuEventCreate(ctypes.byref(e), 0) == 0
        assert self.lib.cuEventRecord(e, self.stream) == 0
        return e.value


needs_fake = pytest.mark.skipif(not FAKE, reason="runs in the child with the libcuda stand-in "
                                "(test_cuda_paths_with_the_libcuda_stand_in)")


@needs_fake
@pytest.mark.parametrize("spin_us", ["0", "5000"])
def test_fake_event_gates_the_write_and_the_notification(monkeypatch, spin_us):
    """MC_WAKE_SPIN_US: the gate thread looks at the event (cuEventQuery)
    before sleeping in the driver; an event not complete within the spin
    still holds the write and its notification back."""
    monkeypatch.setenv("MC_SAME_HOST_CPU", "0")
    monkeypatch.setenv("MC_WAKE_SPIN_US", spin_us)
    f = Fake()
    n = 1 << 20
    with local_engines(2) as (a, b):
        seg = b.get_segment_name()
        src, dst = a.allocate_managed_buffer(n), b.allocate_managed_buffer(n)
        a.write_bytes_to_buffer(src, b"\x07" * n, n)
        f.hold(0.3)
        ev = f.event()
        t0 = time.monotonic()
        bid = a.batch_transfer_async_write_gated(seg, [src], [dst], [n], cuda_event=ev,
                                                 notify=b"layer")
        assert _wait_notify(b, 0.15) == []           # the "GPU" is not there yet
        assert a.transfer_check_status(bid) == 0     # pending, not landed
        assert b.read_bytes_from_buffer(dst, 16) == b"\x00" * 16
        got = _wait_notify(b, 5)
        took = time.monotonic() - t0
        assert [m.msg for m in got] == [b"layer"] and took >= 0.29, took
        assert b.read_bytes_from_buffer(dst + n - 16, 16) == b"\x07" * 16
        # canceled before its event: no write, no message, even once it completes
        f.hold(0.2)
        ev = f.event()
        a.write_bytes_to_buffer(src, b"\x09" * 16, 16)
        bid = a.batch_transfer_async_write_gated(seg, [src], [dst], [16], cuda_event=ev,
                                                 notify=b"never")
        t0 = time.monotonic()
        with pytest.raises(mc.MooncakeError):
            a.get_batch_transfer_status([bid], timeout=0)
        assert time.monotonic() - t0 < 0.1
        time.sleep(0.3)
        assert _wait_notify(b, 0.1) == []
        assert b.read_bytes_from_buffer(dst, 16) == b"\x07" * 16


@needs_fake
def test_fake_engine_gate_layer_takes_and_returns_plain_data(monkeypatch):
    """Engine.gate_layer, one CUDA layer's writes to several targets in one
    call, on plain data (no object of the connector): for each plan entry
    (name, lease_until, per-layer arrays, per-layer notes or None) it
    submits the layer's arrays gated on the engine's own event recorded on
    the stream (nothing lands before the held stream passes it), with the
    layer's note; it returns (event, ids): a batch id, or None for an entry
    whose lease ends within the margin or with nothing to write in the layer.
    None when a notification waits (nothing done, no event); 0 for plan
    None; a bad plan is named."""
    from array import array
    monkeypatch.setenv("MC_SAME_HOST_CPU", "0")
    f = Fake()
    n = 1 << 16
    with local_engines(2) as (a, b):
        seg = b.get_segment_name()
        src, dst = a.allocate_managed_buffer(2 * n), b.allocate_managed_buffer(2 * n)
        a.write_bytes_to_buffer(src, b"\x03" * (2 * n), 2 * n)
        arrs = [(array("Q", [src + i * n]), array("Q", [dst + i * n]), array("Q", [n]))
                for i in range(2)]
        empty = [(array("Q"), array("Q"), array("Q"))] * 2
        now = time.time()
        plan = ((seg, now + 30, arrs, [b"L0", b"L1"]), (seg, now + 0.5, arrs, [b"x", b"y"]),
                (seg, now + 30, empty, None))
        f.hold(0.3)
        ev, ids = a.gate_layer(0, plan, f.stream.value, 0, 1.0, 2.0)
        assert ev and isinstance(ids, tuple) and len(ids) == 3
        assert isinstance(ids[0], int) and ids[1] is None and ids[2] is None, ids
        assert _wait_notify(b, 0.15) == []  # the held stream: nothing written yet
        assert b.read_bytes_from_buffer(dst, 16) == b"\x00" * 16
        assert [m.msg for m in _wait_notify(b, 5)] == [b"L0"]
        assert b.read_bytes_from_buffer(dst + n - 16, 16) == b"\x03" * 16
        assert a.transfer_check_status(ids[0]) == 1
        # layer 1 without a note: written, nothing told
        ev1, ids1 = a.gate_layer(1, plan[:1] + ((seg, now + 30, arrs, None),),
                                 f.stream.value, 0, 1.0, 2.0)
        assert ev1 and ev1 != ev and all(isinstance(x, int) for x in ids1), ids1
        assert [m.msg for m in _wait_notify(b, 5)] == [b"L1"]
        assert a.gate_layer(1, (), f.stream.value, 0, 1.0, 2.0)[1] == ()
        # a notification waiting: nothing done
        b.send_notify(a.get_segment_name(), b"hello", 5.0)
        deadline = time.time() + 5
        while a.gate_layer(0, plan, f.stream.value, 0, 1.0, 2.0) is not None:
            assert time.time() < deadline  # (it is in flight)
            time.sleep(0.01)
        assert [m.msg for m in a.get_notifies()] == [b"hello"]
        assert a.gate_layer(0, None, f.stream.value, 0, 1.0, 2.0) == 0
        with pytest.raises(ValueError, match="must be >= 0"):
            a.gate_layer(-1, None, 0, 0, 1.0, 2.0)
        with pytest.raises(TypeError, match="plan must be None or a tuple"):
            a.gate_layer(0, [], f.stream.value, 0, 1.0, 2.0)
        with pytest.raises(TypeError, match="name, lease_until, arrays, notes"):
            a.gate_layer(0, ((seg, now + 30, arrs),), f.stream.value, 0, 1.0, 2.0)
        with pytest.raises(TypeError, match="name must be a str"):
            a.gate_layer(0, ((1, now + 30, arrs, None),), f.stream.value, 0, 1.0, 2.0)
        with pytest.raises(TypeError, match=r"\(src, dst, len\) tuple"):
            a.gate_layer(0, ((seg, now + 30, [None], None),), f.stream.value, 0, 1.0, 2.0)


def test_gate_plan_holds_the_open_caught_up_targets_with_arrays():
    """push.py's plan for Engine.gate_layer (_gate_plan): the open targets
    of layerwise jobs being computed that have every queued layer and their
    arrays, as plain tuples; a canceled, stopped or ended target is left
    out; an open one without arrays or behind is left to the per-target
    path (rest)."""
    from types import SimpleNamespace as NS
    from mooncake_connector.connector.push import PushProducer
    garr, notes = [("s0", "d0", "n0")], [b"L0"]

    def target(name, **kw):
        t = dict(name=name, state="writing", cancel=False, stop=None, garr=garr,
                 layers_sent={0}, lease_until=5.0, lnotify=True, gnote=notes)
        t.update(kw)
        return NS(**t)

    tgs = {k: target(k) for k in ("ok", "quiet")}
    tgs["quiet"].lnotify = False
    tgs.update(canceled=target("c", cancel=True), stopped=target("s", stop="why"),
               done=target("d", state="done"))
    job = NS(all_ready=False, layerwise=True, queued={0}, targets=tgs)
    whole = NS(all_ready=False, layerwise=False, queued={0}, targets={"w": target("w")})
    ready = NS(all_ready=True, layerwise=True, queued={0}, targets={"r": target("r")})
    p = NS(jobs={"a": job, "b": whole, "c": ready}, _cpu=False)
    plan, who, live, rest = PushProducer._gate_plan(p, 1)
    assert plan == (("ok", 5.0, garr, notes), ("quiet", 5.0, garr, None)) and not rest
    assert [(k, j, t) for k, j, t in who] == [(0, job, tgs["ok"]), (1, job, tgs["quiet"])]
    assert live == (job, whole)
    tgs["late"] = target("late", garr=None)  # arrays not built
    assert PushProducer._gate_plan(p, 1)[3]
    tgs["late"] = target("late", layers_sent=set())  # layer 0 not sent
    plan, _, _, rest = PushProducer._gate_plan(p, 1)
    assert rest and len(plan) == 2
    assert PushProducer._gate_plan(NS(jobs={"c": ready}, _cpu=False), 1) == \
        (None, (), (), False)


def test_gate_plan_is_rebuilt_as_each_other_lock_holder_lets_go():
    """The plan gate_layer keeps is rebuilt whenever a locked method of the
    producer ran (a target arrived, a job began, ended or was computed),
    so a layer's save never writes from a stale plan; without the one call
    per layer (_fast false) none is kept."""
    import threading
    from types import SimpleNamespace as NS
    from mooncake_connector.connector.push import PushProducer, _locked

    class P:
        _gate_plan = PushProducer._gate_plan

        def __init__(self):
            self.lock, self.jobs, self._fast, self._gplan = threading.RLock(), {}, True, None
            self._cpu = False

        @_locked
        def add(self, tid, job):
            self.jobs[tid] = job

        @_locked
        def done(self, tid):
            self.jobs[tid].all_ready = True

    tg = NS(name="d", state="pending", cancel=False, stop=None, garr=[1], layers_sent=set(),
            lease_until=9.0, lnotify=False, gnote=None)
    job = NS(all_ready=False, layerwise=True, queued=set(), targets={"d": tg})
    p = P()
    p.add("t", job)
    assert p._gplan[0] == (("d", 9.0, [1], None),) and p._gplan[2] == (job,)
    p.done("t")
    assert p._gplan == (None, (), (), False)
    p._fast = False
    p.add("u", job)
    assert p._gplan is None


# ---------------------------------------------------------------- the push producer

class FakeTorchEvent:
    """What LayerWaiter uses of torch.cuda.Event, over the stand-in."""

    def __init__(self, fake):
        self.f, self.h = fake, None

    def record(self):
        self.h = self.f.event()

    def synchronize(self):
        self.f.lib.cuEventSynchronize(self.h)


def _count_producer_wakes(w, f, wakes, fwd, cuda, gpu_lag_s, fast):
    """_layer_load_rounds' producer worker w, instrumented: its collects,
    layer-waiter and landing wake-ups, layer messages and (cuda) stream
    synchronizes counted in wakes; CUDA stand-ins for its gate events, layer
    events and the engine's stream (each completes gpu_lag_s later);
    fast=False: the per-target Python path.  fwd[0]: the forward thread's id
    (a landing check on another thread is a wake-up).  Returns the stream
    stub (None without cuda)."""
    if cuda:
        def sync():  # CUDA KV caches (the stand-in forward writes them at once)
            wakes["syncs"] += 1
        w.cuda_sync = sync
    pp_ = w.push_p
    orig_collect = pp_._collect

    def collect(tg, rows, layers, out):  # a Python loop over a target's blocks
        if len(layers) == 1:
            wakes["collects"] += 1  # ... for one layer (a layer's save)
        else:
            wakes["collects_all"] += 1  # a target that came after the saves
        return orig_collect(tg, rows, layers, out)
    pp_._collect = collect

    def gate_event():
        f.hold(gpu_lag_s)
        return None, f.event(), 0

    pp_._gate_event = gate_event
    from mooncake_connector.connector.layer_events import LayerWaiter
    orig_ready, orig_check = pp_._layer_ready, pp_._check_layer_writes

    def layer_ready(li, jobs):
        wakes["waiter"] += 1
        return orig_ready(li, jobs)

    def check(watched):
        if threading.get_ident() != fwd[0] and watched:
            wakes["landing"] += 1
        return orig_check(watched)

    pp_._layer_ready = layer_ready
    pp_._check_layer_writes = check

    def make_ev():
        f.hold(gpu_lag_s)
        return FakeTorchEvent(f)

    if cuda:
        pp_._waiter = LayerWaiter(pp_._layer_ready, make_event=make_ev)
    ob = w.push_outbox
    orig_send = ob.send

    def send(target, msg, *a, **kw):
        if b'"t":"layer"' in msg:
            wakes["outbox_layer"] += 1
        return orig_send(target, msg, *a, **kw)

    ob.send = send
    stream = None
    if cuda:  # the engine's own event per layer (gate_layer), on the stand-in's stream
        def stream(dev):
            f.hold(gpu_lag_s)
            return f.stream.value

        pp_._stream, pp_._gdev = stream, 0
    if not fast:  # the per-target Python path (_layer_gated; CPU: layer_done)
        pp_._fast = False
    return stream


def _measure_saves(w, wakes, fwd, timings, profile, skip):
    """_layer_load_rounds' producer save_kv_layer, wrapped: records the
    forward thread in fwd[0]; each save of a prompt being computed counted in
    wakes["saves"] and, with profile (and no timings), the calls it made
    (the code objects in skip not counted) in wakes["py_calls"]; with
    timings, its wall and thread CPU seconds."""
    orig_save, pp_ = w.save_kv_layer, w.push_p

    def save(name):
        fwd[0] = threading.get_ident()
        computing = any(not j.all_ready for j in list(pp_.jobs.values()))
        if computing:
            wakes["saves"] += 1  # a layer of a prompt being computed
        if computing and timings is None and profile:
            # Python functions and C functions called by the save (the
            # stand-in's stream stub excluded: torch's raw stream getter)
            n = [0]

            def prof(frame, event, arg):
                if event in ("call", "c_call") and frame.f_code not in skip:
                    n[0] += 1

            sys.setprofile(prof)
            try:
                orig_save(name)
            finally:
                sys.setprofile(None)
            wakes["py_calls"].append(n[0] - 1)  # less setprofile(None) itself
            return
        if timings is None or not computing:
            return orig_save(name)
        t0, c0 = time.perf_counter(), time.thread_time()
        orig_save(name)
        timings["save_s"].append(time.perf_counter() - t0)
        timings["save_cpu_s"].append(time.thread_time() - c0)

    w.save_kv_layer = save


def _time_forwards(p, timings):
    """timings["forward_s"]: the producer side p's forward seconds per step
    that computes the prompt "pq" (and the save lists started)."""
    timings.setdefault("save_s", [])
    timings.setdefault("forward_s", [])
    timings.setdefault("save_cpu_s", [])
    orig_fwd = p._forward

    def forward(so):
        t0 = time.perf_counter()
        orig_fwd(so)
        if "pq" in so.num_scheduled_tokens:
            timings["forward_s"].append(time.perf_counter() - t0)

    p._forward = forward


def _start_round(p, d, w, f, wakes, tag, t, pause, late, early):
    """One _layer_load_rounds round's requests for the tokens t (push params
    tag): the producer's "pq" and the decode's "q", in the order pause, late,
    early or neither ask for.  Returns (run: the producer's stepping thread,
    decode_step: returns the decode's step that schedules "q", last_ev: with
    late, the producer's last layer's event)."""
    from test_push_layer_load import Stepper, both_legs, dp, make_request, pp as p_params
    last_ev = None
    decode_step = d.step
    if pause:  # the decode's request only once the prefill paused after layer 0
        p.pause_after_layer = 0
        p.paused.clear()
        p.add(make_request("pq", t, max_tokens=1, params=p_params(tag)))
        run = Stepper(p)
        assert p.paused.wait(10)
        d.add(make_request("q", t, max_tokens=2, params=dp(tag)))
    elif late:
        pp_ = w.push_p
        p.add(make_request("pq", t, max_tokens=1, params=p_params(tag)))
        p.step()  # the whole forward queued before the decode's target exists
        last_ev = [j.qev[1] for j in pp_.jobs.values()]  # its last layer's event
        assert len(last_ev) == 1 and last_ev[0], pp_.jobs
        wakes["late_unfinished"] += f.lib.cuEventQuery(last_ev[0]) != 0
        d.add(make_request("q", t, max_tokens=2, params=dp(tag)))
        run = Stepper(p)
    elif early:
        p.add(make_request("pq", t, max_tokens=1, params=p_params(tag)))
        d.add(make_request("q", t, max_tokens=2, params=dp(tag)))
        box = {}
        dstep = threading.Thread(target=lambda: box.setdefault("so", d.step()))
        dstep.start()  # sends the target, then waits for the layers
        assert w.engine.wait_notifies(10)  # the target is there (not taken)
        run = Stepper(p)

        def joined():
            dstep.join(30)
            return box["so"]
        decode_step = joined
    else:
        run = both_legs(p, d, tag, t, 2)
    return run, decode_step, last_ev


def _layer_load_rounds(model_dir, urls, gate, rounds=3, gpu_lag_s=0.002, blocks=4,
                       timings=None, cuda=True, fast=True, profile=False,
                       pause=False, late=False, early=False, read=False):  # noqa: F811
    """push_layer_load rounds with a CUDA-like producer (its layers' events
    complete gpu_lag_s after each save; cuda=False: CPU KV caches, no
    event); returns (wake-ups per layer, the counts, the producer engine's
    stats, the decode's per-layer views).  timings (a dict): filled with the
    producer's save_kv_layer seconds per call (a prompt being computed) and
    its forward's seconds per prompt.  fast=False: layers through the
    per-target Python path (CUDA: _layer_gated; CPU: layer_done), not
    Engine.gate_layer.
    profile: the counts' "py_calls" lists, per save of a prompt being
    computed, the Python and C functions it called (sys.setprofile).
    pause: the producer's forward waits after layer 0 for the decode's
    target, so the next layer's save drains it (mid-forward arrival).
    late: the decode's request comes only after the producer's step (its
    forward queued, its last layer's event not complete): counts
    "late_unfinished" (that event not complete then) and "late_early_data"
    (the decode had the layers before it completed: a write not gated on the
    forward).  early: the decode's target is in the producer engine's
    queue before the producer's step starts (taken when the step binds,
    before the forward).  read: the decode READs each announced layer
    (push_layer_read).  The counts' "syncs": the producer's stream synchronizes
    (the stand-in's cuda_sync only counts: it does not wait)."""
    from test_push_layer_load import AttnSide, BS, toks
    from vllm_harness import recomputes

    f = Fake() if cuda else None
    nb = max(64, 2 * blocks + 8)
    p = AttnSide(model_dir, "kv_producer", {**urls, "push_layer_gate": gate}, block_size=BS,
                 num_blocks=nb)
    d = AttnSide(model_dir, "kv_consumer", {**urls, "flow_a": False, "push_layer_load": True,
                                            "push_layer_read": read},
                 block_size=BS, num_blocks=nb)
    try:
        w = p.worker._worker
        wakes = {"waiter": 0, "landing": 0, "outbox_layer": 0, "saves": 0, "collects": 0,
                 "collects_all": 0, "syncs": 0, "late_unfinished": 0, "late_early_data": 0}
        fwd = [threading.get_ident()]  # the forward thread (save_kv_layer's)
        stream = _count_producer_wakes(w, f, wakes, fwd, cuda, gpu_lag_s, fast)
        pp_ = w.push_p
        wakes["py_calls"] = []  # per profiled save: the calls it made
        skip = {Fake.hold.__code__} | ({stream.__code__} if stream else set())
        _measure_saves(w, wakes, fwd, timings, profile, skip)
        if timings is not None:
            _time_forwards(p, timings)
        seen = []
        c0 = time.process_time()
        for r in range(rounds):
            t = toks(40 + r, blocks * BS + 5)
            run, decode_step, last_ev = _start_round(p, d, w, f, wakes, f"G{gate}{r}", t,
                                                     pause, late, early)
            try:
                so = decode_step()
                if late:  # the layers are there: the "GPU" must have finished the forward
                    wakes["late_early_data"] += f.lib.cuEventQuery(last_ev[0]) != 0
                assert so.num_scheduled_tokens.get("q") == 5
                seen.append(d.seen.get("q"))
                assert d.block_matches_pattern("q", t, blocks) and not d.invalid
                assert d.run_until(lambda: "q" not in d.sched.requests, steps=50)
            finally:
                run.join()
            assert p.run_until(lambda: p.is_empty(), steps=500)
            d.seen.clear()
        if timings is not None:  # this process's CPU over the rounds (both sides)
            timings["cpu_s"] = time.process_time() - c0
        assert d.is_empty() and recomputes(d) == {}
        time.sleep(0.2)  # late wake-ups counted too
        # back at idle: no job, no batch left open, nothing waiting in the gate
        assert not pp_.jobs and w.engine.get_stats()["open_batches"] == 0, \
            (pp_.jobs, w.engine.get_stats())
        per_layer = (wakes["waiter"] + wakes["landing"] + wakes["outbox_layer"]) / \
            max(1, wakes["saves"])
        return per_layer, wakes, w.engine.get_stats(), seen
    finally:
        p.close()
        d.close()


def _urls():
    from test_connector_vllm import urls
    return urls.__wrapped__()


@needs_fake
def test_fake_gate_wakes_no_python_thread_per_layer(tmp_path):
    pytest.importorskip("vllm", reason="vllm is not installed")
    from vllm_harness import tiny_model_dir
    md = tiny_model_dir(str(tmp_path))
    before, wb, _, seen_b = _layer_load_rounds(md, _urls(), gate=False)
    after, wa, stats, seen_a = _layer_load_rounds(md, _urls(), gate=True)
    print(f"wake-ups per layer: layer-event path {before:.2f} {wb}, gate {after:.2f} {wa}")
    assert all(all(s) for s in seen_b) and all(all(s) for s in seen_a), (seen_b, seen_a)
    assert before >= 2.0, wb
    assert after == 0, wa
    assert wa["saves"] == wb["saves"] == 3 * 2, (wa, wb)  # 3 prompts x 2 layers
    # the engine told the layers: one message per gated batch (a target that
    # arrived after layer 0 or after the forward gets several layers in one)
    assert 3 <= stats["gate_notified"] <= wa["saves"], stats


@needs_fake
def test_fake_gate_layer_is_one_engine_call_per_layer(tmp_path):
    """CUDA through the gate: a layer's save costs vLLM's forward thread one
    engine call (Engine.gate_layer: the look for notifications, the
    engine's own event recorded on the stream, each target of the
    producer's plan (built when targets change, not per layer) given its
    gated batch from its prebuilt arrays and 'layer' message; the batch ids
    noted by push.py without a call per target), not
    the per-target Python path (the drain's two engine calls, the gate
    checks, torch's event, the arrays and the submit per target: H200 run
    22 measured 0.15-0.17 ms of the forward thread per save).  Counted:
    the Python and C functions each save calls; the decode still sees
    every layer land and no Python thread wakes per layer."""
    pytest.importorskip("vllm", reason="vllm is not installed")
    from vllm_harness import tiny_model_dir
    md = tiny_model_dir(str(tmp_path))
    kw = dict(gate=True, profile=True, pause=True)  # each target arrives mid-forward
    _, wb, _, seen_b = _layer_load_rounds(md, _urls(), fast=False, blocks=24, **kw)
    _, w4, _, seen_4 = _layer_load_rounds(md, _urls(), blocks=4, **kw)
    per, wa, stats, seen_a = _layer_load_rounds(md, _urls(), blocks=24, **kw)
    calls_b, calls_4, calls_a = (sorted(x["py_calls"]) for x in (wb, w4, wa))
    print(f"calls per save: per-target path {calls_b}, gate_layer {calls_a} "
          f"(4-block prompts: {calls_4})")
    assert all(all(s) for x in (seen_b, seen_4, seen_a) for s in x), (seen_b, seen_4, seen_a)
    assert per == 0 and wa["saves"] == wb["saves"] == 3 * 2, (per, wa, wb)
    assert len(calls_a) == len(calls_b) == 6
    # a save with no notification waiting: one engine call and its few
    # Python steps (before: >= 20; 4 with the plan kept)
    assert calls_a[0] <= 5 and sum(c <= 12 for c in calls_a) == 3, calls_a
    assert calls_b[0] >= 3 * calls_a[0], (calls_b, calls_a)
    # the save that drains the decode's target (its parse, its per-layer
    # arrays, the layers saved before it): no Python step per block (the
    # arrays in one C pass), so 24-block prompts (one step) cost what 4-block ones do;
    # before, a Python loop over the blocks (at least a step per block)
    assert calls_a[-1] <= calls_4[-1] + 10, (calls_a, calls_4)
    assert calls_b[-1] >= calls_a[-1] + 24, (calls_b, calls_a)
    assert 3 <= stats["gate_notified"] <= wa["saves"], stats


@needs_fake
def test_fake_gated_push_needs_no_stream_synchronize(tmp_path):
    """CUDA through the engine's gate: a push whose every write is gated on
    its layers' CUDA events needs no stream synchronize after the forward
    (wait_for_save): vLLM's forward thread then queues the logits and the
    sampler at once instead of waiting for the GPU to finish the forward
    (issue 31: the push's cost on the prefill outside save_kv_layer).  A
    target arriving after the forward, while the GPU still computes it, gets
    its writes gated on the last layer's event: the decode never has the
    layers before the (stand-in's) stream finished.  The layer-event thread's
    path (push_layer_gate false) keeps its synchronize (the reference: one
    per prompt)."""
    pytest.importorskip("vllm", reason="vllm is not installed")
    from vllm_harness import tiny_model_dir
    md = tiny_model_dir(str(tmp_path))
    _, wb, _, seen_b = _layer_load_rounds(md, _urls(), gate=False, pause=True)
    _, wa, _, seen_a = _layer_load_rounds(md, _urls(), gate=True, pause=True)
    _, wl, _, seen_l = _layer_load_rounds(md, _urls(), gate=True, late=True, gpu_lag_s=0.15)
    _, wp, _, seen_p = _layer_load_rounds(md, _urls(), gate=True, fast=False, late=True,
                                          gpu_lag_s=0.15)
    print(f"stream synchronizes in 3 prompts: layer-event path {wb['syncs']}, gate "
          f"{wa['syncs']}, gate with late targets {wl['syncs']} (per-target path "
          f"{wp['syncs']}); late: {wl}")
    assert all(all(s) for x in (seen_b, seen_a, seen_l, seen_p) for s in x), \
        (seen_b, seen_a, seen_l, seen_p)
    assert wb["syncs"] == 3, wb
    assert wa["syncs"] == 0 and wl["syncs"] == 0 and wp["syncs"] == 0, (wa, wl, wp)
    for w_ in (wl, wp):
        assert w_["late_unfinished"] == 3, w_  # the targets came while the forward ran
        assert w_["late_early_data"] == 0, w_


@needs_fake
def test_fake_layer_read_announced_by_the_engine_on_each_layers_event(tmp_path):
    """Layer read (push_layer_read) with CUDA KV caches through the gate:
    each layer's "layer" note is queued in the producer engine's gate FIFO
    gated on that layer's CUDA event (Engine.notify_gated), so no Python
    thread wakes per layer (no layer-event thread, no outbox send), the
    forward needs no stream synchronize, and a target arriving while the
    GPU still computes the forward (late: events 0.15 s away) hears of
    the layers only once the last layer's event completed: the decode
    never reads a layer still being computed.  Seen failing on the outbox
    path: read layers were announced after the forward's synchronize
    through the outbox (outbox_layer 3, syncs 3 in 3 prompts), a late
    target's before the forward's last event completed (late_early_data
    3: the stand-in's synchronize does not wait)."""
    pytest.importorskip("vllm", reason="vllm is not installed")
    from vllm_harness import tiny_model_dir
    md = tiny_model_dir(str(tmp_path))
    per, wa, stats, seen_a = _layer_load_rounds(md, _urls(), gate=True, read=True)
    _, wl, _, seen_l = _layer_load_rounds(md, _urls(), gate=True, read=True, late=True,
                                          gpu_lag_s=0.15)
    print(f"layer read through the gate: {wa}; late targets: {wl}; engine {stats}")
    assert all(all(s) for x in (seen_a, seen_l) for s in x), (seen_a, seen_l)
    assert wa["saves"] == 3 * 2 and per == 0, wa
    assert wa["syncs"] == 0 and wl["syncs"] == 0, (wa, wl)
    assert wl["outbox_layer"] == 0, wl
    assert wl["late_unfinished"] == 3, wl  # the targets came while the forward ran
    assert wl["late_early_data"] == 0, wl
    assert stats["gate_notified"] >= 3 and stats["gate_notes_dropped"] == 0, stats


def test_cpu_layer_load_wakes_no_python_thread_per_layer(tmp_path, monkeypatch):
    """CPU KV caches (vLLM's CPU backend): a layer's KV is in memory at its
    save_kv_layer, so its write batch carries the decode's 'layer'
    notification and the engine sends it once the writes landed: no landing
    thread check and no outbox send per layer on the prefill's host (each
    took the GIL from the prefill's forward thread: issue 31, CPU per push
    request on a 2-vCPU host).  push_layer_gate false: the landing thread
    and the outbox as before.  Both transports a same-host deployment can
    get: the same-host CPU path (its default) and TCP."""
    pytest.importorskip("vllm", reason="vllm is not installed")
    from vllm_harness import tiny_model_dir
    md = tiny_model_dir(str(tmp_path))
    for same_host in ("1", "0"):
        monkeypatch.setenv("MC_SAME_HOST_CPU", same_host)
        before, wb, _, seen_b = _layer_load_rounds(md, _urls(), gate=False, cuda=False)
        after, wa, stats, seen_a = _layer_load_rounds(md, _urls(), gate=True, cuda=False)
        print(f"MC_SAME_HOST_CPU={same_host}: Python wake-ups per layer: landing thread "
              f"{before:.2f} {wb}, engine-told {after:.2f} {wa}")
        assert all(all(s) for s in seen_b) and all(all(s) for s in seen_a), (seen_b, seen_a)
        assert wa["saves"] == wb["saves"] == 3 * 2, (wa, wb)  # 3 prompts x 2 layers
        assert wb["outbox_layer"] >= 3, wb  # at least one per prompt before
        assert wa["landing"] == 0 and wa["outbox_layer"] == 0 and wa["waiter"] == 0, wa
        # a layer's save makes one engine call with the target's per-layer
        # arrays (built once per target, every layer in one pass), not a
        # loop over the target's blocks for that layer
        # the reference loops over the target's blocks in Python: per layer
        # where the target was there at the saves, else once for all layers
        # (a target late under load: seen once in CI)
        assert wb["collects"] + wb["collects_all"] >= 1, wb
        assert wa["collects"] == 0, wa
        # the engine told the layers: one message per write batch (a target
        # that arrived after layer 0 or after the forward gets several in one)
        assert 3 <= stats["gate_notified"] <= wa["saves"], stats


def test_cpu_layer_save_is_one_engine_call(tmp_path, monkeypatch):
    """CPU KV caches, push_layer_load: a layer's save on vLLM's forward
    thread is one engine call (Engine.gate_layer with no event: the look
    for notifications and every plan target's writes with its 'layer'
    message), not the drain's two engine calls and the per-target Python
    path (issue 31: save_kv_layer, 8 calls of ~0.08-0.16 ms, was 1.27 ms of
    the prefill's 2.05 ms of hooks per push step on the CPU VM).  Counted:
    the Python and C functions each save of a prompt being computed calls,
    with the decode's target there before the forward and arriving after
    layer 0 (the save that drains it takes the per-target path once), on
    both transports of a same-host deployment; the decode sees every layer
    land and the engine tells each layer.  On the same-host CPU path the
    layer's copy is the engine's gate thread's (gate_host_batches), so the
    forward thread's call only queues it."""
    pytest.importorskip("vllm", reason="vllm is not installed")
    from vllm_harness import tiny_model_dir
    md = tiny_model_dir(str(tmp_path))
    for same_host in ("1", "0"):
        monkeypatch.setenv("MC_SAME_HOST_CPU", same_host)
        _, wb, _, seen_b = _layer_load_rounds(md, _urls(), gate=True, cuda=False, early=True,
                                              profile=True, fast=False, blocks=8)
        for how in ("early", "pause"):
            per, wa, stats, seen_a = _layer_load_rounds(
                md, _urls(), gate=True, cuda=False, profile=True, blocks=8,
                early=how == "early", pause=how == "pause")
            calls = sorted(wa["py_calls"])
            print(f"MC_SAME_HOST_CPU={same_host} target {how}: calls per save "
                  f"{calls} (per-target path, target early: {sorted(wb['py_calls'])})")
            assert all(all(s) for s in seen_a), seen_a
            assert per == 0 and wa["saves"] == 3 * 2 and len(calls) == 6, (per, wa)
            assert 3 <= stats["gate_notified"] <= wa["saves"], stats
            if how == "early":  # a layer's save: the engine call, a few Python steps
                # (one may find a notification waiting and drain it first)
                assert sum(c <= 5 for c in calls) >= 5, calls
                # same-host CPU path: every layer saved once the route is
                # known (after the first write to the decode) was copied by
                # the engine's gate thread, not the forward thread; TCP: none
                # (its threads send)
                if same_host == "1":
                    assert stats["gate_host_batches"] >= wa["saves"] - 2, stats
                else:
                    assert stats["gate_host_batches"] == 0, stats
            else:  # layer 0 before the target (no job target), layer 1 drains it
                assert sum(c <= 5 for c in calls) >= 2, calls
        calls_b = sorted(wb["py_calls"])
        assert all(all(s) for s in seen_b), seen_b
        assert calls_b[0] >= 12 and calls_b[0] >= 3 * calls[0], calls_b  # main: 42


def test_cpu_gate_layer_hands_the_same_host_copy_to_the_gate_thread(monkeypatch):
    """Engine.gate_layer without an event (CPU KV caches): to a peer the
    same-host CPU path serves, the layer's copy (process_vm_writev, one
    copy thread here) is handed to the engine's gate thread -- the calling
    thread (vLLM's forward thread) only queues it: its CPU time in the call
    is a small part of what copying the layer in the call costs
    (handover=False, main's behaviour: the reference), and the batch is
    still in flight when the call returns -- and the layer's note reaches
    the target only after every byte of the layer landed.  Over TCP nothing
    is handed over (its threads send; gate_host_batches stays 0)."""
    from array import array
    monkeypatch.setenv("MC_CMA_THREADS", "1")
    n, L = 1 << 20, 48
    cpu = {}
    for same_host in ("1", "0"):
        monkeypatch.setenv("MC_SAME_HOST_CPU", same_host)
        with local_engines(2) as (a, b):
            seg = b.get_segment_name()
            src, dst = a.allocate_managed_buffer(L * n), b.allocate_managed_buffer(L * n)
            arrs = [(array("Q", [src + i * n for i in range(L)]),
                     array("Q", [dst + i * n for i in range(L)]), array("Q", [n] * L))]
            bid = a.batch_transfer_async_write(seg, [src], [dst], [64])  # the route known
            a.get_batch_transfer_status([bid])
            for k, handover in enumerate((False, True, False, True)):
                val = bytes([k + 1]) * (L * n)
                a.write_bytes_to_buffer(src, val, L * n)
                plan = ((seg, time.time() + 30, arrs, [b"L%d" % k]),)
                c0 = time.thread_time()
                ev, ids = a.gate_layer(0, plan, 0, -1, 1.0, 2.0, handover)
                took = time.thread_time() - c0
                at_return = a.transfer_check_status(ids[0])
                cpu.setdefault((same_host, handover), []).append(took)
                got = [m.msg for m in _wait_notify(b, 10)]
                # the note is there: so is every byte of the layer
                assert got == [b"L%d" % k] and b.read_bytes_from_buffer(dst, L * n) == val
                if at_return == 0:
                    assert a.transfer_wait(ids[0], 10)
                    assert a.transfer_check_status(ids[0]) == 1
                # Handed over (same host): queued, the gate thread copies it;
                # not asserted through at_return (a caller descheduled after
                # the call may already see the gate thread's copy landed): the
                # gate_host_batches count below says it was handed over.
                if same_host == "1" and not handover:
                    assert at_return == 1, at_return  # copied in the call: landed
            st = a.get_stats()
            assert st["gate_host_batches"] == (2 if same_host == "1" else 0), st
            assert (st["same_host_cpu_bytes_written"] > 0) == (same_host == "1"), st
            assert st["open_batches"] == 0, st
    print("forward thread's CPU in gate_layer, ms:",
          {k: [round(1e3 * x, 3) for x in v] for k, v in cpu.items()})
    inline, handed = min(cpu[("1", False)]), max(cpu[("1", True)])
    assert inline > 4 * handed and handed < 2e-3, cpu


def test_gate_thread_writes_nothing_past_the_lease(monkeypatch):
    """A layer handed to the engine's gate thread (the same-host CPU path)
    is copied only while its lease allows (lease_until - margin, what
    gate_layer checks when it queues): one whose turn comes later -- the
    gate thread busy with a long copy ahead of it here; in a deployment
    the producer SIGSTOPped with layers queued and resumed after the
    lease -- ends timed out with nothing written and no note.  The
    consumer may have freed those blocks at the lease's end, and
    Engine.cut_peer cannot fence this path's copies (the producer process
    makes them itself), so a copy started past the lease would write into
    another request's KV.  Before the check the gate thread copied it
    whenever its turn came."""
    from array import array
    monkeypatch.setenv("MC_CMA_THREADS", "1")
    monkeypatch.setenv("MC_SAME_HOST_CPU", "1")
    big, small, margin = 512 << 20, 1 << 16, 1.0
    with local_engines(2) as (a, b):
        seg = b.get_segment_name()
        src, dst = a.allocate_managed_buffer(big), b.allocate_managed_buffer(big)
        s2, d2 = a.allocate_managed_buffer(small), b.allocate_managed_buffer(small)
        bid = a.batch_transfer_async_write(seg, [src], [dst], [64])  # the route known
        a.get_batch_transfer_status([bid])
        a.write_bytes_to_buffer(s2, b"\x07" * small, small)
        b.write_bytes_to_buffer(d2, b"\x00" * small, small)

        def plan(s, d, n, lease, note):
            return ((seg, lease, [(array("Q", [s]), array("Q", [d]), array("Q", [n]))],
                     None if note is None else [note]),)
        # The long copies first, four of them (each ~50 ms idle, more under
        # load): the gate thread busy with them; the late layer queued while
        # its lease still allows (50 ms of it left), turned to after them.
        # (One long copy and 5 ms of lease: on a loaded host the queueing
        # could come too late, or the copy end too soon, and after 3 tries
        # the test skipped.)  Wanted: the first long copy still running when
        # the late layer was queued (3 more queued ahead of it).
        def settle(bids):
            for x in bids:
                if x is not None:
                    try:
                        a.transfer_wait(x, 30)
                        a.transfer_check_status(x)
                    except ValueError:  # taken by the check below: over
                        pass
        for _ in range(5):
            ids_big = [a.gate_layer(0, plan(src, dst, big, time.time() + 60, None), 0, -1,
                                    margin, 2.0, True)[1][0] for _k in range(4)]
            t_q = time.time()
            _, ids = a.gate_layer(0, plan(s2, d2, small, t_q + margin + 0.05, b"late"), 0, -1,
                                  margin, 2.0, True)
            if ids[0] is not None and a.transfer_check_status(ids_big[0]) == 0:
                break
            settle(ids_big + ids)
        else:
            pytest.fail("the long copies were never still running when the late layer queued")
        for x in ids_big:
            assert a.transfer_wait(x, 60)
            assert a.transfer_check_status(x) == 1
        a.transfer_wait(ids[0], 10)
        st = a.transfer_check_status(ids[0])
        assert st < 0, st                               # failed: not written
        assert b.read_bytes_from_buffer(d2, small) == b"\x00" * small
        assert [m.msg for m in _wait_notify(b, 0.5)] == []  # and nothing told
        assert a.get_stats()["open_batches"] <= 2


def test_consumer_merges_per_batch_layer_messages():
    """The engine sends one "layer" message per gated batch, naming only
    that batch's layers (the Python path sent every layer landed so far):
    the consumer takes the union, in any order, duplicates harmless, and
    the load is over once every layer landed."""
    from mooncake_connector.connector.push import ConsumerLoad, PushConsumer
    c = PushConsumer(worker=None)
    cl = ConsumerLoad(spec=None, lease_s=10, nlayers=4)
    cl.ranks["P"], cl.landed["P"] = "sent", set()
    c.loads["T"] = cl
    for got, want in (([2], {2}), ([0], {0, 2}), ([0, 2], {0, 2}), ([1], {0, 1, 2})):
        c.on_message("P", {"t": "layer", "tid": "T", "l": got})
        assert cl.landed["P"] == want and cl.ranks["P"] == "sent"
    c.on_message("P", {"t": "layer", "tid": "T", "l": [3]})
    assert cl.ranks["P"] == "done"
    c.on_message("P", {"t": "layer", "tid": "T", "l": [3, 1]})  # a late duplicate
    assert cl.ranks["P"] == "done" and cl.landed["P"] == {0, 1, 2, 3}


def test_gate_events_are_reused_in_a_ring():
    """The gate's CUDA events (push.GateEvents): vLLM's forward thread
    records one per layer; the ring makes at most `size` events, records
    each again `size` records later (never two live records of one event
    sooner), and asks for the CUevent handle and the device once."""
    from mooncake_connector.connector.push import GateEvents, GATE_KEEP

    class Ev:
        made = 0

        def __init__(self):
            Ev.made += 1
            self.n, self.records, self.handle_reads = Ev.made, 0, 0

        def record(self):
            self.records += 1

        @property
        def cuda_event(self):
            self.handle_reads += 1
            return 1000 + self.n

    devs = []
    ring = GateEvents(make=Ev, device=lambda: devs.append(1) or 3, size=4)
    got = [ring.record() for _ in range(10)]
    assert Ev.made == 4 and ring.made == 4
    assert [h for _, h, _ in got] == [1001, 1002, 1003, 1004] * 2 + [1001, 1002]
    assert all(d == 3 for _, _, d in got) and devs == [1]
    evs = {id(e): e for e, _, _ in got}.values()
    assert sorted(e.records for e in evs) == [2, 2, 3, 3]
    assert all(e.handle_reads == 1 for e in evs)
    assert GateEvents(make=Ev, device=lambda: 0)._size == 2 * GATE_KEEP
    with pytest.raises(ValueError, match="size must be >= 1"):
        GateEvents(make=Ev, size=0)
