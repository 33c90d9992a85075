"""close() racing every other call of the bindings, from other threads.

Each call made while (or after) another thread closes the TransferEngine or
the KVTransfer either does its work or raises the closed error
(MooncakeError naming "closed"); never a crash, a double free or a hang.
(transfer_wait included).  The same for KVTransfer.close() against recv_kv (push and pull),
pull_start / pull_poll / pull_wait, probe and stats.
The hammering runs in a child process: the bug this guards against (a batch
freed by close and again by transfer_check_status / get_batch_transfer_status,
an engine used after close destroyed it) killed the process or corrupted its
heap.  MC_CLOSE_RACE_ROUNDS picks the number of rounds (default 12).
"""
import json
import os
import subprocess
import sys

# Both hammer scripts start with this: once closed, the hammering threads
# `ts` are stopped and must end, and every call (f, args) of `calls` raises
# the closed error; anything else goes to `unexpected`.
AFTER_CLOSE = r"""
import mooncake_connector as mc


def all_closed(stop, ts, calls):
    stop.set()
    for t in ts:
        t.join(60)
        if t.is_alive():
            unexpected.append("a thread hung after close")
    for f, args in calls:
        try:
            f(*args)
            unexpected.append("%s worked after close" % f.__name__)
        except mc.MooncakeError as e:
            if "closed" not in str(e):
                unexpected.append("%s after close: %s" % (f.__name__, e))
"""

HAMMER = AFTER_CLOSE + r"""
import json, os, random, sys, threading, time

rounds, seed = int(sys.argv[1]), int(sys.argv[2])
rng = random.Random(seed)
N = 4096
unexpected, counts = [], {"ok": 0, "closed": 0, "unknown": 0}
lock = threading.Lock()


def call(f, *a):
    try:
        r = f(*a)
        with lock:
            counts["ok"] += 1
        return r
    except mc.MooncakeError as e:
        with lock:
            if "closed" in str(e):
                counts["closed"] += 1
            else:
                unexpected.append("%s: %s" % (type(e).__name__, e))
    except ValueError as e:  # an id another thread consumed
        with lock:
            if "unknown batch id" in str(e):
                counts["unknown"] += 1
            else:
                unexpected.append("ValueError: %s" % e)
    except Exception as e:  # noqa: BLE001
        with lock:
            unexpected.append("%s: %s" % (type(e).__name__, e))
    return None


def one_round(r):
    a, b = mc.TransferEngine(), mc.TransferEngine()
    a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    seg = b.get_segment_name()
    src = a.allocate_managed_buffer(64 * N)
    dst = b.allocate_managed_buffer(64 * N)
    assert a.transfer_sync_write(seg, src, dst, N) == 0  # connected
    ids, stop = [], threading.Event()

    def submit_poll():
        while not stop.is_set():
            bid = call(a.batch_transfer_async_write, seg, [src] * 4, [dst] * 4, [N] * 4)
            if bid is None:
                continue
            ids.append(bid)
            for _ in range(1000):
                st = call(a.transfer_check_status, bid)
                if st != 0:
                    break
                call(a.get_batch_status, bid)

    def submit_wait():
        while not stop.is_set():
            bid = call(a.batch_transfer_async_read, seg, [src], [dst], [N])
            if bid is not None:
                ids.append(bid)
                call(a.get_batch_transfer_status, [bid])
            call(a.transfer_sync_write, seg, src + N, dst + N, N)

    def steal():  # the same ids from another thread: polls and waits race
        while not stop.is_set():
            if ids:
                bid = rng.choice(ids[-8:])
                call(a.transfer_wait, bid, 0.001)
                call(a.transfer_check_status, bid)
                call(a.get_batch_status, bid)
                call(a.get_batch_transfer_status, [bid])
            else:
                time.sleep(0)

    def misc():
        while not stop.is_set():
            call(a.get_notifies)
            call(a.get_stats)
            call(a.get_segment_name)
            call(a.get_metadata)
            call(a.get_rpc_port)
            call(a.wait_notifies, 0.001)
            call(a.take_lost_peers)
            call(a.send_notify, seg, b"x", 1.0)
            call(a.read_bytes_from_buffer, src, 16)
            call(a.write_bytes_to_buffer, src, b"y" * 16)
            m = call(a.allocate_managed_buffer, 8192)
            if m is not None:
                call(a.free_managed_buffer, m, 8192)

    ts = [threading.Thread(target=f) for f in
          (submit_poll, submit_poll, submit_wait, steal, misc)]
    for t in ts:
        t.start()
    time.sleep(rng.uniform(0.005, 0.08))
    how = r % 3
    if how == 0:
        a.close()
    elif how == 1:
        a.__exit__(None, None, None)
    else:  # two closers at once
        c = threading.Thread(target=a.close)
        c.start()
        a.close()
        c.join(30)
    all_closed(stop, ts, ((a.transfer_check_status, (1,)), (a.transfer_wait, (1, 0.0)),
                          (a.get_notifies, ()), (a.get_stats, ()), (a.get_batch_status, (1,)),
                          (a.get_batch_transfer_status, ([1],))))
    a.close()  # again: a no-op
    b.close()


for r in range(rounds):
    one_round(r)
print(json.dumps({"unexpected": unexpected[:20], "counts": counts}), flush=True)
"""


def _hammer(script, seed):
    """Runs a hammer script in a child process; nothing unexpected, and both
    outcomes happened: calls ran, and calls met the close."""
    rounds = os.environ.get("MC_CLOSE_RACE_ROUNDS", "12")
    env = {**os.environ, "MC_SAME_HOST_CPU": "0"}
    r = subprocess.run([sys.executable, "-c", script, rounds, seed], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["unexpected"] == [], out
    assert out["counts"]["ok"] > 0 and out["counts"]["closed"] > 0, out


def test_close_races_every_engine_call():
    _hammer(HAMMER, "1")


KV_HAMMER = AFTER_CLOSE + r"""
import json, random, sys, threading, time

rounds, seed = int(sys.argv[1]), int(sys.argv[2])
rng = random.Random(seed)
BB, BS, NB = 4096, 16, 8
unexpected, counts = [], {"ok": 0, "closed": 0}
lock = threading.Lock()


def call(f, *a, **k):
    try:
        r = f(*a, **k)
        with lock:
            counts["ok"] += 1
        return r
    except mc.MooncakeError as e:
        with lock:
            if "closed" in str(e) or "shutting down" in str(e):
                counts["closed"] += 1
            else:
                unexpected.append("%s: %s" % (type(e).__name__, e))
    except Exception as e:  # noqa: BLE001
        with lock:
            unexpected.append("%s: %s" % (type(e).__name__, e))
    return None


p, c = mc.TransferEngine(), mc.TransferEngine()
p.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
c.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
src = p.allocate_managed_buffer(NB * BB)
dst = c.allocate_managed_buffer(4 * NB * BB)
lb = mc.LookupBuffer(1 << 24, BS)
kvp = mc.KVTransfer(p, lb)
toks = [rng.randrange(50000) for _ in range(NB * BS)]
assert kvp.send_kv(toks, [(src + i * BB, BB) for i in range(NB)]) == NB * BS
seg = p.get_segment_name()


def one_round(r):
    kv = mc.KVTransfer(c)
    stop = threading.Event()

    def dest(k):
        return [(dst + (k * NB + i) * BB, BB) for i in range(NB)]

    def push():
        while not stop.is_set():
            call(kv.recv_kv, seg, toks, dest(0), timeout=5.0)

    def pull():
        while not stop.is_set():
            call(kv.recv_kv, seg, toks, dest(1), timeout=5.0, pull=True)

    def background():
        while not stop.is_set():
            pid = call(kv.pull_start, seg, toks, dest(2), timeout=5.0)
            if pid is not None:
                call(kv.pull_wait, [pid], timeout=5.0)
                call(kv.pull_poll, pid)

    def misc():
        while not stop.is_set():
            call(kv.probe, seg, toks, timeout=1.0)
            call(kv.stats)

    ts = [threading.Thread(target=f) for f in (push, pull, background, misc)]
    for t in ts:
        t.start()
    time.sleep(rng.uniform(0.005, 0.08))
    if r % 2:
        kv.close()
    else:
        k2 = threading.Thread(target=kv.close)
        k2.start()
        kv.__exit__(None, None, None)
        k2.join(30)
    all_closed(stop, ts,
               ((kv.recv_kv, (seg, toks, dest(0))), (kv.stats, ()), (kv.pull_poll, (1,))))
    kv.close()


for r in range(rounds):
    one_round(r)
kvp.close()
c.close()
p.close()
print(json.dumps({"unexpected": unexpected[:20], "counts": counts}), flush=True)
"""


def test_close_races_every_kv_call():
    _hammer(KV_HAMMER, "2")


def test_close_wakes_a_waiting_wait_notifies():
    # close() waits for the calls in flight: a wait_notifies(30) in another
    # thread returns at once instead of holding the close for 30 s.
    import threading
    import time

    import mooncake_connector as mc

    e = mc.TransferEngine()
    e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    got = []
    t = threading.Thread(target=lambda: got.append(e.wait_notifies(30.0)))
    t.start()
    time.sleep(0.3)  # the waiter is inside
    t0 = time.monotonic()
    e.close()
    took = time.monotonic() - t0
    t.join(5)
    assert not t.is_alive() and got == [False]
    assert took < 5, took
