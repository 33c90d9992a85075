#!/usr/bin/env python3
"""Two-process transfer-engine benchmark, for our engine or Mooncake's.

    python benchmarks/transfer_bench.py --engine ours
    python benchmarks/transfer_bench.py --engine mooncake --mode latency

By default (``--role both``) this process is the initiator and it starts the
target as a second OS process (this same script with ``--role target``).  The
target registers a buffer, prints one ``READY {json}`` line with its segment
name and buffer address, and then serves a tiny line protocol on stdin/stdout
(poison / crc / exit) that the initiator uses to check the data.  It exits on
``exit``, on EOF or on Ctrl-C.

For two hosts, start ``--role target`` on one and ``--role initiator
--target-segment HOST:PORT --target-addr ADDR --target-size N`` on the other;
the data check then goes through the engine itself (read-back), which is
weaker than the default.

Bandwidth mode: for each op (write/read) x block size x batch size x thread
count ("point"), every thread loops over its own slice of the buffers,
submitting batches of ``batch`` requests of ``block`` bytes, until
``--total-bytes`` were moved (shared by all threads) or ``--max-seconds``
passed.  GB/s is 1e9 bytes per second.  Batch latency is the wall time of one
batch call; "per-request" latency is batch latency / batch size (amortized; for
batch 1 it is the true per-request latency).

Latency mode: ``--latency-size`` (4 KiB) single-request transfer_sync_write
(and _read) round trips, p50/p99/mean in microseconds.

Every point is checked: before it, sample spans of the destination are
poisoned; after it, their CRC32 must equal the CRC32 of the same spans of the
source.  A mismatch makes the point (and the exit status) fail.

Output: one JSON object per line on stdout for every point, then a table
(lines starting with '#').  ``--json-out PATH`` also writes the JSON lines to a
file.  The exit status is 0 only if every point ran and verified.
"""
import argparse
import ctypes
import json
import mmap
import os
import random
import subprocess
import sys
import threading
import time
import zlib

GB = 1e9
POISON = 0xA5
SCRATCH_SIZE = 4 << 20  # standalone-initiator verification scratch


# ----------------------------------------------------------------- helpers

def parse_size(text):
    """'4K', '64KiB', '1G', '1048576' -> bytes (binary units)."""
    s = text.strip().upper().replace("IB", "").replace("B", "")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if s.endswith(suffix):
            s, mult = s[:-1], m
            break
    value = int(float(s) * mult)
    if value <= 0:
        raise argparse.ArgumentTypeError("size must be > 0: %r" % text)
    return value


def size_list(text):
    return [parse_size(x) for x in text.split(",") if x.strip()]


def int_list(text):
    out = [int(x) for x in text.split(",") if x.strip()]
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError("need positive integers: %r" % text)
    return out


def human(n):
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m and n % m == 0:
            return "%d%s" % (n // m, unit)
    return "%dB" % n


def pct(sorted_vals, p):
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_vals:
        return None
    k = max(1, min(len(sorted_vals), int(-(-p * len(sorted_vals) // 100))))
    return sorted_vals[k - 1]


def r3(x):
    return None if x is None else round(x, 3)


class Buffer:
    """Anonymous, page-aligned, pre-faulted memory with an integer address."""

    def __init__(self, size):
        self.size = size
        self.mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if os.environ.get("MC_BENCH_HUGEPAGES") == "1":  # same_host_cpu_bench --hugepages
            self.mm.madvise(mmap.MADV_HUGEPAGE)
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.addr = ctypes.addressof(self._anchor)
        self.view = memoryview(self.mm)

    def fill_pattern(self, seed):
        """Position-dependent pattern: every 8-byte word differs, and differs
        between seeds, so misplaced or stale data is detected."""
        import numpy as np
        words = np.frombuffer(self.mm, dtype=np.uint64)
        chunk = 1 << 21
        mul = np.uint64(0x9E3779B97F4A7C15)
        add = np.uint64((seed * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & (2**64 - 1))
        with np.errstate(over="ignore"):
            for start in range(0, len(words), chunk):
                idx = np.arange(start, min(start + chunk, len(words)), dtype=np.uint64)
                words[start:start + len(idx)] = idx * mul + add
        del words

    def poison(self, spans, value=POISON):
        for off, ln in spans:
            ctypes.memset(self.addr + off, value, ln)

    def crcs(self, spans):
        return [zlib.crc32(self.view[off:off + ln]) for off, ln in spans]


# ----------------------------------------------------------------- engines

class EngineError(RuntimeError):
    pass


class Engine:
    """Thin adapter: same call shape for both engines; Mooncake's 0/-1 return
    codes (and 0 batch ids) become exceptions like ours."""

    def __init__(self, kind):
        self.kind = kind
        if kind == "ours":
            from mooncake_connector import TransferEngine
        elif kind == "mooncake":
            from mooncake.engine import TransferEngine
        else:
            raise ValueError(kind)
        self.e = TransferEngine()

    def _rc(self, what, rc):
        if isinstance(rc, int) and not isinstance(rc, bool) and rc < 0:
            raise EngineError("%s failed (rc=%d)" % (what, rc))
        return rc

    def initialize(self, hostname, metadata_server, protocol, device):
        rc = self.e.initialize(hostname, metadata_server, protocol, device)
        if self.kind == "mooncake" and rc != 0:
            raise EngineError("initialize failed (rc=%r)" % (rc,))
        return self._rc("initialize", rc)

    def rpc_port(self):
        return int(self.e.get_rpc_port())

    def register(self, addr, length):
        return self._rc("register_memory", self.e.register_memory(addr, length))

    def sync(self, op, target, local, remote, length):
        fn = self.e.transfer_sync_write if op == "write" else self.e.transfer_sync_read
        return self._rc("transfer_sync_" + op, fn(target, local, remote, length))

    def batch_sync(self, op, target, locs, rems, lens):
        fn = (self.e.batch_transfer_sync_write if op == "write"
              else self.e.batch_transfer_sync_read)
        return self._rc("batch_transfer_sync_" + op, fn(target, locs, rems, lens))

    def batch_async(self, op, target, locs, rems, lens):
        fn = (self.e.batch_transfer_async_write if op == "write"
              else self.e.batch_transfer_async_read)
        bid = fn(target, locs, rems, lens)
        if self.kind == "mooncake" and not bid:
            raise EngineError("batch_transfer_async_%s failed" % op)
        return bid

    def wait(self, batch_ids):
        return self._rc("get_batch_transfer_status",
                        self.e.get_batch_transfer_status(list(batch_ids)))


def init_engine(args):
    eng = Engine(args.engine)
    eng.initialize(args.local_hostname, args.metadata_server, args.protocol, args.device_name)
    return eng


def segment_name(args, eng):
    host = args.local_hostname.rsplit(":", 1)[0] if args.local_hostname.count(":") == 1 \
        else args.local_hostname
    if args.metadata_server.upper() == "P2PHANDSHAKE":
        return "%s:%d" % (host, eng.rpc_port())
    return args.local_hostname


# ------------------------------------------------------------------ target

def run_target(args):
    eng = init_engine(args)
    buf = Buffer(args.buffer_size)
    buf.fill_pattern(seed=2)
    eng.register(buf.addr, buf.size)
    info = {"segment": segment_name(args, eng), "buffer_addr": buf.addr,
            "buffer_size": buf.size, "engine": args.engine, "pid": os.getpid()}
    print("READY " + json.dumps(info), flush=True)
    out = sys.stdout
    try:
        for line in sys.stdin:
            line = line.strip()
            if not line:
                continue
            if line == "exit":
                break
            try:
                req = json.loads(line)
                cmd = req.get("cmd")
                if cmd == "exit":
                    break
                if cmd == "poison":
                    buf.poison(req["spans"], int(req.get("value", POISON)))
                    reply = {"ok": True}
                elif cmd == "crc":
                    reply = {"ok": True, "crcs": buf.crcs(req["spans"])}
                elif cmd == "fill":
                    buf.fill_pattern(int(req["seed"]))
                    reply = {"ok": True}
                else:
                    reply = {"ok": False, "error": "unknown cmd %r" % cmd}
            except Exception as exc:  # keep serving; report to initiator
                reply = {"ok": False, "error": repr(exc)}
            out.write(json.dumps(reply) + "\n")
            out.flush()
    except KeyboardInterrupt:
        pass
    return 0


class LocalTarget:
    """Target started as a child process; control over its stdin/stdout."""

    def __init__(self, args):
        cmd = [sys.executable, os.path.abspath(__file__), "--role", "target",
               "--engine", args.engine, "--buffer-size", str(args.buffer_size),
               "--local-hostname", args.target_hostname or args.local_hostname,
               "--metadata-server", args.metadata_server, "--protocol", args.protocol,
               "--device-name", args.device_name]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        deadline = time.time() + args.startup_timeout
        self.info = None
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith("READY "):
                self.info = json.loads(line[6:])
                break
        if self.info is None:
            self.close()
            raise EngineError("target process did not become ready (exit code %r)"
                              % self.proc.poll())

    def call(self, req):
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise EngineError("target process died (exit code %r)" % self.proc.poll())
        reply = json.loads(line)
        if not reply.get("ok"):
            raise EngineError("target: %s" % reply.get("error"))
        return reply

    def poison(self, spans, value=POISON):
        self.call({"cmd": "poison", "spans": spans, "value": value})

    def crcs(self, spans):
        return self.call({"cmd": "crc", "spans": spans})["crcs"]

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("exit\n")
                self.proc.stdin.flush()
                self.proc.stdin.close()
            except (BrokenPipeError, OSError, ValueError):
                pass
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class EngineSideTarget:
    """Standalone initiator: poison/CRC the remote side through the engine
    itself, via a small registered scratch buffer (weaker check)."""

    def __init__(self, eng, segment, remote_base, scratch):
        self.eng, self.segment, self.base, self.scratch = eng, segment, remote_base, scratch

    def _pieces(self, spans):
        for off, ln in spans:
            done = 0
            while done < ln:
                n = min(ln - done, self.scratch.size)
                yield off + done, n
                done += n

    def poison(self, spans, value=POISON):
        ctypes.memset(self.scratch.addr, value, self.scratch.size)
        for off, n in self._pieces(spans):
            self.eng.sync("write", self.segment, self.scratch.addr, self.base + off, n)

    def crcs(self, spans):
        out = []
        for off, ln in spans:
            crc = 0
            for o, n in self._pieces([(off, ln)]):
                ctypes.memset(self.scratch.addr, 0, n)
                self.eng.sync("read", self.segment, self.scratch.addr, self.base + o, n)
                crc = zlib.crc32(self.scratch.view[:n], crc)
            out.append(crc)
        return out

    def close(self):
        pass


# --------------------------------------------------------------- initiator

class Layout:
    """Where request k of thread t goes: same offset in both buffers.
    Consecutive requests go to consecutive slots, or with scatter to the
    slots in a random order (seeded): two requests of a batch are then
    adjacent in memory only by chance (about 2 in slots), so an engine
    cannot merge them and moves each block on its own, as it must KV blocks
    scattered across a paged cache."""

    def __init__(self, buf_size, block, threads, scatter=False, seed=0):
        self.block = block
        slots_total = buf_size // block
        if slots_total == 0:
            raise ValueError("block %d larger than buffer %d" % (block, buf_size))
        self.slots = max(1, slots_total // threads)
        self.bases = [((t * self.slots) % max(1, slots_total - self.slots + 1)) * block
                      for t in range(threads)]
        self.perm = None
        if scatter and self.slots > 2:
            import random
            order = list(range(self.slots))
            random.Random(seed).shuffle(order)
            self.perm = order

    def offset(self, t, k):
        slot = k % self.slots
        return self.bases[t] + (self.perm[slot] if self.perm else slot) * self.block


def pick_candidates(layout, threads, total_reqs, rng, max_blocks=16):
    """Before a point: (thread, slot, spans) to poison and check afterwards.
    Slot 0 of every thread is always included (done as soon as the thread
    finished one batch); the rest are random among the slots the thread is
    expected to reach."""
    block = layout.block
    per_thread = max(1, min(layout.slots, -(-total_reqs // threads)))
    picks = set()
    for t in range(threads):
        picks.add((t, 0))
    while len(picks) < min(max_blocks, threads * per_thread):
        picks.add((rng.randrange(threads), rng.randrange(per_thread)))
    out = []
    piece = 64 << 10
    for t, k in sorted(picks):
        off = layout.offset(t, k)
        if block <= 256 << 10:
            spans = [(off, block)]
        else:
            mid = rng.randrange(piece, block - 2 * piece) // 8 * 8
            spans = [(off, piece), (off + mid, piece), (off + block - piece, piece)]
        out.append((t, k, spans))
    return out


class Verifier:
    def __init__(self, local, remote):
        self.local, self.remote = local, remote
        self.counter = 0

    def poison_dest(self, op, spans):
        """Poison with a byte that changes at every call, so that stale poison
        left by an earlier (time-capped) point never matches."""
        self.counter += 1
        value = (POISON + self.counter) & 0xFF
        (self.remote if op == "write" else self.local).poison(spans, value)

    def check(self, op, spans):
        lc, rc = self.local.crcs(spans), self.remote.crcs(spans)
        src, dst = (lc, rc) if op == "write" else (rc, lc)
        return [spans[i] for i in range(len(spans)) if src[i] != dst[i]]


def run_point(eng, args, verifier, segment, local_base, remote_base, op, block, batch,
              threads, rng):
    layout = Layout(args.buffer_size, block, threads, args.scatter, args.seed)
    total_reqs = max(1, -(-args.total_bytes // block))
    cands = pick_candidates(layout, threads, total_reqs, rng)

    lock = threading.Lock()
    state = {"issued": 0, "stop": False}
    done = [0] * threads
    lat = [[] for _ in range(threads)]
    errors = []
    deadline_holder = {}
    start_evt = threading.Event()

    # The request lists are built before the clock starts (Python building
    # three lists per batch costs ~0.5 us a request, as much as moving a
    # 4 KiB block): the timed loop measures the engine, as a C caller sees
    # it.  Keyed by where the batch starts in the thread's slots (offsets
    # wrap around them), so the cache never holds more than the slots.
    lists = {}

    def batch_lists(t, k, n):
        key = (t, k % layout.slots, n)
        got = lists.get(key)
        if got is None:
            offs = [layout.offset(t, k + i) for i in range(n)]
            got = lists[key] = ([local_base + o for o in offs],
                                [remote_base + o for o in offs], [block] * n)
        return got

    per_thread = -(-total_reqs // threads)
    for t in range(threads):
        k = 0
        while k < per_thread:
            n = min(batch, total_reqs - k)
            if (t, k % layout.slots, n) in lists:
                break  # wrapped around: the rest repeats
            batch_lists(t, k, n)
            k += n

    # --warmup: the prepared batches (every request the timed run makes, up
    # to where its offsets wrap) moved PASSES times untimed, then the
    # destination is poisoned, so the check still sees the timed run's
    # bytes.  The first copies into a page cost the kernel more than later
    # ones (on the same-host CPU path the first pinned write marks each
    # target page dirty; on the development VM the second pass was still
    # slower than later ones: --warmup 2 for steady state); the memcpy
    # reference is measured warm (best of 3) and a KV cache's blocks are
    # written again and again, so warm against warm compares like with like.
    for _ in range(args.warmup):
        for loc_l, rem_l, lens in lists.values():
            eng.batch_sync(op, segment, loc_l, rem_l, lens)
    verifier.poison_dest(op, [sp for _, _, spans in cands for sp in spans])

    def worker(t):
        k = 0
        try:
            start_evt.wait()
            deadline = deadline_holder["deadline"]
            while True:
                with lock:
                    if state["stop"] or state["issued"] >= total_reqs:
                        return
                    n = min(batch, total_reqs - state["issued"])
                    state["issued"] += n
                loc_l, rem_l, lens = batch_lists(t, k, n)
                t0 = time.perf_counter()
                if args.api == "sync":
                    eng.batch_sync(op, segment, loc_l, rem_l, lens)
                else:
                    bid = eng.batch_async(op, segment, loc_l, rem_l, lens)
                    eng.wait([bid])
                t1 = time.perf_counter()
                lat[t].append(((t1 - t0) * 1e6, n))
                k += n
                done[t] = k
                if t1 > deadline:
                    with lock:
                        state["stop"] = True
        except Exception as exc:
            errors.append("thread %d: %r" % (t, exc))
            with lock:
                state["stop"] = True

    ths = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(threads)]
    for th in ths:
        th.start()
    t_start = time.perf_counter()
    deadline_holder["deadline"] = t_start + args.max_seconds
    start_evt.set()
    for th in ths:
        th.join()
    elapsed = time.perf_counter() - t_start

    moved = sum(done) * block
    all_lat = sorted(us for l in lat for us, _ in l)
    per_req = sorted(us / n for l in lat for us, n in l)
    res = {
        "kind": "bandwidth", "engine": args.engine, "op": op, "api": args.api,
        "block": block, "batch": batch, "threads": threads, "scatter": bool(args.scatter),
        "warmup": args.warmup,
        "requests": sum(done), "bytes": moved, "seconds": round(elapsed, 6),
        "gbps": round(moved / elapsed / GB, 4) if elapsed > 0 else None,
        "batch_p50_us": r3(pct(all_lat, 50)), "batch_p99_us": r3(pct(all_lat, 99)),
        "req_p50_us": r3(pct(per_req, 50)), "req_p99_us": r3(pct(per_req, 99)),
        "time_capped": moved < args.total_bytes,
    }
    if errors:
        res["ok"] = False
        res["error"] = errors[0]
        return res
    spans = [sp for t, k, sps in cands if done[t] > k for sp in sps]
    bad = verifier.check(op, spans)
    res["verified_spans"] = len(spans)
    res["ok"] = bool(spans) and not bad
    if not spans:
        res["error"] = "nothing transferred to verify"
    elif bad:
        res["error"] = "data mismatch in %d of %d sampled spans, e.g. offset %d" % (
            len(bad), len(spans), bad[0][0])
    return res


def run_latency(eng, args, verifier, segment, local_base, remote_base, op):
    size = args.latency_size
    off = 0
    verifier.poison_dest(op, [(off, size)])
    samples = []
    for i in range(args.latency_warmup + args.latency_iters):
        t0 = time.perf_counter()
        eng.sync(op, segment, local_base + off, remote_base + off, size)
        t1 = time.perf_counter()
        if i >= args.latency_warmup:
            samples.append((t1 - t0) * 1e6)
    s = sorted(samples)
    bad = verifier.check(op, [(off, size)])
    return {
        "kind": "latency", "engine": args.engine, "op": op, "size": size,
        "iters": len(s), "p50_us": r3(pct(s, 50)), "p99_us": r3(pct(s, 99)),
        "mean_us": r3(sum(s) / len(s)), "min_us": r3(s[0]), "max_us": r3(s[-1]),
        "ok": not bad, **({"error": "data mismatch"} if bad else {}),
    }


def emit(res, json_file):
    line = json.dumps(res)
    print(line, flush=True)
    if json_file:
        json_file.write(line + "\n")
        json_file.flush()


def print_table(results):
    bw = [r for r in results if r.get("kind") == "bandwidth"]
    lt = [r for r in results if r.get("kind") == "latency"]
    if lt:
        print("#")
        print("# %-5s %8s %7s %10s %10s %10s  %s" % ("op", "size", "iters", "p50_us",
                                                    "p99_us", "mean_us", "check"))
        for r in lt:
            print("# %-5s %8s %7d %10s %10s %10s  %s" % (
                r["op"], human(r["size"]), r["iters"], r["p50_us"], r["p99_us"],
                r["mean_us"], "ok" if r.get("ok") else "FAIL"))
    if bw:
        print("#")
        print("# %-5s %8s %5s %3s %9s %11s %11s %11s %11s  %s" % (
            "op", "block", "batch", "thr", "GB/s", "batch_p50", "batch_p99",
            "req_p50", "req_p99", "check"))
        for r in bw:
            print("# %-5s %8s %5d %3d %9s %11s %11s %11s %11s  %s" % (
                r["op"], human(r["block"]), r["batch"], r["threads"],
                "-" if r.get("gbps") is None else "%.3f" % r["gbps"],
                r.get("batch_p50_us"), r.get("batch_p99_us"),
                r.get("req_p50_us"), r.get("req_p99_us"),
                ("ok" if r.get("ok") else "FAIL") + (" (time-capped)" if r.get("time_capped")
                                                     else "")))
    sys.stdout.flush()


def run_initiator(args):
    eng = init_engine(args)
    buf = Buffer(args.buffer_size)
    buf.fill_pattern(seed=1)
    eng.register(buf.addr, buf.size)

    scratch = None
    if args.role == "both":
        remote = LocalTarget(args)
        segment = remote.info["segment"]
        remote_base = int(remote.info["buffer_addr"])
        remote_size = int(remote.info["buffer_size"])
    else:
        if not (args.target_segment and args.target_addr is not None):
            sys.exit("--role initiator needs --target-segment and --target-addr")
        segment, remote_base = args.target_segment, args.target_addr
        remote_size = args.target_size or args.buffer_size
        scratch = Buffer(SCRATCH_SIZE)
        eng.register(scratch.addr, scratch.size)
        remote = EngineSideTarget(eng, segment, remote_base, scratch)
    if remote_size < args.buffer_size:
        args.buffer_size = remote_size  # both sides use the same offsets

    verifier = Verifier(buf, remote)
    rng = random.Random(args.seed)
    json_file = open(args.json_out, "a") if args.json_out else None
    results = []
    failed = False
    try:
        header = {"kind": "config", "engine": args.engine, "segment": segment,
                  "buffer_size": args.buffer_size, "total_bytes": args.total_bytes,
                  "max_seconds": args.max_seconds, "api": args.api,
                  "protocol": args.protocol, "metadata_server": args.metadata_server,
                  "env": {k: v for k, v in os.environ.items() if k.startswith("MC_")}}
        emit(header, json_file)
        if args.mode in ("latency", "all"):
            for op in args.ops:
                try:
                    res = run_latency(eng, args, verifier, segment, buf.addr, remote_base, op)
                except Exception as exc:
                    res = {"kind": "latency", "engine": args.engine, "op": op,
                           "size": args.latency_size, "iters": 0, "p50_us": None,
                           "p99_us": None, "mean_us": None, "ok": False, "error": repr(exc)}
                results.append(res)
                emit(res, json_file)
                failed |= not res.get("ok")
        if args.mode in ("bandwidth", "all"):
            for op in args.ops:
                for block in args.block_sizes:
                    if block > args.buffer_size:
                        print("# skip block %s > buffer" % human(block), flush=True)
                        continue
                    for batch in args.batch_sizes:
                        if batch * block > max(args.total_bytes, block):
                            print("# skip %s block x batch %d > total bytes" % (
                                human(block), batch), flush=True)
                            continue
                        for threads in args.threads:
                            try:
                                res = run_point(eng, args, verifier, segment, buf.addr,
                                                remote_base, op, block, batch, threads, rng)
                            except Exception as exc:
                                res = {"kind": "bandwidth", "engine": args.engine, "op": op,
                                       "block": block, "batch": batch, "threads": threads,
                                       "gbps": None, "ok": False, "error": repr(exc)}
                            results.append(res)
                            emit(res, json_file)
                            failed |= not res.get("ok")
    finally:
        remote.close()
        if json_file:
            json_file.close()
    print_table(results)
    for r in results:
        if not r.get("ok"):
            print("# FAILED: %s" % json.dumps(r), file=sys.stderr)
    return 1 if failed else 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["ours", "mooncake"], default="ours")
    p.add_argument("--role", choices=["both", "target", "initiator"], default="both")
    p.add_argument("--mode", choices=["bandwidth", "latency", "all"], default="all")
    p.add_argument("--ops", type=lambda s: [x for x in s.split(",") if x],
                   default=["write", "read"], help="comma list of write,read")
    p.add_argument("--api", choices=["sync", "async"], default="sync",
                   help="batch_transfer_sync_* or batch_transfer_async_* + status")
    p.add_argument("--buffer-size", type=parse_size, default=1 << 30)
    p.add_argument("--block-sizes", type=size_list,
                   default=size_list("4K,16K,64K,256K,1M,4M,16M,64M"))
    p.add_argument("--batch-sizes", type=int_list, default=[1, 16, 128])
    p.add_argument("--threads", type=int_list, default=[1, 2])
    p.add_argument("--total-bytes", type=parse_size, default=1 << 30,
                   help="bytes per point, all threads together")
    p.add_argument("--max-seconds", type=float, default=10.0,
                   help="stop a point early after this long (reported as time_capped)")
    p.add_argument("--latency-size", type=parse_size, default=4096)
    p.add_argument("--latency-iters", type=int, default=5000)
    p.add_argument("--latency-warmup", type=int, default=200)
    p.add_argument("--local-hostname", default="127.0.0.1")
    p.add_argument("--target-hostname", default=None,
                   help="local_hostname of the spawned target (default: same)")
    p.add_argument("--metadata-server", default="P2PHANDSHAKE")
    p.add_argument("--protocol", default="tcp")
    p.add_argument("--device-name", default="")
    p.add_argument("--target-segment", help="(--role initiator) target segment name")
    p.add_argument("--target-addr", type=int, help="(--role initiator) target buffer address")
    p.add_argument("--target-size", type=parse_size, help="(--role initiator) target buffer size")
    p.add_argument("--startup-timeout", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--warmup", type=int, nargs="?", const=1, default=0, metavar="PASSES",
                   help="move the bytes PASSES times (default 1), untimed, before each "
                        "bandwidth point (first copies into a page cost more: see run_point)")
    p.add_argument("--scatter", action="store_true",
                   help="blocks of a batch at random, never adjacent slots (no merging)")
    p.add_argument("--json-out", help="append JSON lines here too")
    args = p.parse_args(argv)
    for op in args.ops:
        if op not in ("write", "read"):
            p.error("--ops takes write and/or read")
    try:
        __import__("numpy")  # pattern fill needs it; fail before starting engines
    except ImportError:
        print("transfer_bench: needs numpy (pip install numpy; scripts/env.sh installs it "
              "into .venv)", file=sys.stderr)
        return 2
    try:
        if args.role == "target":
            return run_target(args)
        return run_initiator(args)
    except (ImportError, EngineError, OSError) as exc:
        print("transfer_bench: %s engine (%s): %s: %s" % (
            args.engine, args.role, type(exc).__name__, exc), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
