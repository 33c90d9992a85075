"""Push flow: the decode side admits a request first, tells the producer where
its blocks are, and the producer WRITEs the prompt's KV straight into them
(whole prompt after the forward, or layer by layer from save_kv_layer).

Messages travel as engine notifications (our engine's NOTIFY, acknowledged by
the receiving engine), each `MAGIC + JSON header + b"\\n" + body`:

  consumer rank -> producer rank
    target  {"t": "target", "tid", "rank", "lease_until", "ntok", "h", "skip",
             "nblocks", "epb", "n", "lnotify"}; body: n x (u64 addr, u64 len, u64 src_off)
             destination extents, block-major then layer then outer (K/V)
             slice, the order of layout.extents(); src_off: byte offset in the
             producer's extent (TP head slices; 0 = from its start)
    cancel  {"t": "cancel", "tid"}: write nothing more, answer "cancelled"; from a
            rank whose target the job does not have (lost on the way,
            dropped at its lease's end, or never sent: the decode request
            ended before its load, PushConsumer.gone), the job counts that
            rank served and frees the KV without waiting for hold_timeout_s
  producer rank -> consumer rank
    done       {"t": "done", "tid", "ntok"}: every write landed (acknowledged)
    layer      {"t": "layer", "tid", "l": [layer index, ...]}: these layers'
               writes landed (acknowledged); sent only for a target with
               "lnotify": true (the consumer's push_layer_load: its attention
               waits per layer); every layer landed means no write is left
    nokv       {"t": "nokv", "tid", "why"}: nothing (more) will be written
    cancelled  {"t": "cancelled", "tid"}: answer to cancel; no write in flight
               and none will start

The lease (docs/connector.md, "Push flow"): the consumer owns its blocks and
lends them to the producer until `lease_until` (wall clock, the consumer's
now + load_timeout_s).  The producer starts no write after lease_until -
PUSH_MARGIN_S and cancels writes still running then (returning only when no
I/O thread of its engine touches them); the consumer frees (reports the
request to vLLM) only after done / nokv / cancelled from every producer rank
it sent a target to, or after lease_until + PUSH_GRACE_S.  A target that
provably never left (connection refused, the peer's segment not registered:
NEVER_SENT) needs no wait.  One whose send failed but may have arrived
(timed out, reset) is sent again, the same bytes, every RESEND_S after a
failure until an answer comes, within the lease (not in its last
PUSH_MARGIN_S); the producer takes an identical copy as a no-op.  Every try
waits RESEND_TIMEOUT_S for the receipt, the first one to a producer not
heard from yet FIRST_CONTACT_SEND_S.
"""
import hashlib
import json
import logging
import os
import queue
import functools
import select
import sys
import threading
import time
from array import array
from collections import OrderedDict

from mooncake_connector import json_in
from mooncake_connector import trace

logger = logging.getLogger("vllm.mooncake_connector")

MAGIC = b"MCPUSH1\n"
PUSH_MARGIN_S = 1.0   # producer: no write starts later than lease_until - this
PUSH_GRACE_S = 2.0    # consumer: blocks kept until lease_until + this without an answer
FENCE_TIMEOUT_S = 5.0  # consumer: Engine.cut_peer's bound before blocks freed unanswered
MAX_TID = 256
ENDED_KEEP_S = 120.0  # producer: a transfer id that ended answers late targets "nokv"
EARLY_MAX = 4096      # producer: transfer ids with targets waiting for their prompt
EARLY_MAX_BYTES = 256 << 20  # producer: bytes of those targets' extents
# Engine error codes of a send that never left: the peer's segment is not
# registered (a producer that died and expired: MC_ENOTFOUND), the metadata
# server did not answer the lookup, or the connection never came up.
NEVER_SENT = ("MC_ENOTFOUND", "MC_EMETADATA", "MC_ECONNECT")
# Consumer: a target whose send failed in a way that may be transient (timed
# out, connection reset: it may or may not have arrived) is sent again, the
# same bytes, this long after the failure, while the lease lives and no answer
# came; each re-send waits at most RESEND_TIMEOUT_S for the receipt.  The
# producer takes an identical duplicate as a no-op.
RESEND_S = 0.5
RESEND_TIMEOUT_S = 2.0
# Layer read: announcements the engine's gate sent (Engine.notify_gated) are
# sent again through the outbox when the decode has not said "rdone" this
# long after the last one (a note the engine dropped or could not deliver;
# the decode ignores duplicates), below push_layer_read_stall_s's default:
# the "layer" note (a few bytes) each time, also the decode's sign that we
# still lend (its stall bound counts from the last note); the "src" message
# (tens of KB) only until one sent so was delivered (the decode's engine
# took it), one at a time.
READ_REANNOUNCE_S = 0.2
# The first send of a target waits this long for the receipt when its
# producer took a message from us before (a connection, or a quick connect,
# is there: a longer wait only delays the re-send of a target lost to a link
# cut); FIRST_CONTACT_SEND_S for a producer not heard from yet (the metadata
# lookup and the connection's set-up come first).
FIRST_CONTACT_SEND_S = 5.0
# Consumer, before its first message to a producer: who it is (its engine's
# descriptor, Engine.describe_segment: host identity, pid), so that blocks a
# same-host producer process may still copy into itself are not given back
# to vLLM while that process lives and has not answered (PushConsumer's
# holds, docs/connector.md "The lease").  The describe waits at most this.
DESCRIBE_TIMEOUT_S = 1.0
DESCRIBE_RETRY_S = 5.0  # a failed describe is tried again at a later send, not sooner
HOLD_CANCEL_S = 1.0     # a held load's cancel is sent again this often until answered
# A held load's producer process seen running (not stopped: /proc state not
# T or t) this long without answering (an idle producer drains its
# notifications only when vLLM steps it) is over with its copies.
HOLD_RUNNING_S = 2.0
# Layer read: no read of the producer's blocks starts later than the
# lease's end minus this (the producer keeps them at least the lease's
# length from the target's arrival; a read started before this ends well
# before: a layer is a few MiB of process_vm_readv).
READ_MARGIN_S = 1.0


class PushError(ValueError):
    pass


GATE_KEEP = 4096  # = the engine's MC_GATE_MAX: batches waiting for CUDA events


def _torch_event():
    """A CUDA event for the gate.  Blocking sync: the engine's gate thread
    sleeps in cuEventSynchronize instead of spinning a core."""
    import torch
    return torch.cuda.Event(blocking=True)


def _torch_device():
    import torch
    return torch.cuda.current_device()


class GateEvents:
    """The gate's CUDA events, reused in a ring: record() records the next
    one on the current stream (after the layer's KV kernels) and returns
    (event, CUevent handle, device).  vLLM's forward thread records one per
    layer; a ring makes no event and destroys none per layer (each
    torch.cuda.Event is created, its CUevent made at its first record and
    destroyed when dropped), and asks torch for the handle and the device
    once.  An event is recorded again only `size` records later; the
    engine's gate holds at most GATE_KEEP batches, each waiting for the
    event of one of the layers before it, so with size = 2 x GATE_KEEP an
    event the gate may still wait for is not recorded again in a normal run
    (and were it, on the same stream, the gate would wait for the later
    point of that stream: later, never early)."""

    def __init__(self, make=_torch_event, device=_torch_device, size=None):
        self._make, self._device = make, device
        self._size = 2 * GATE_KEEP if size is None else size
        if self._size < 1:
            raise ValueError(f"GateEvents size must be >= 1, not {self._size}")
        self._ring = []   # [event, its CUevent handle (after its first record)]
        self._next = 0
        self._dev = None
        self.made = 0     # events created (bounded by size)

    def record(self):
        if len(self._ring) < self._size:
            slot = [self._make(), None]
            self.made += 1
            self._ring.append(slot)
        else:
            slot = self._ring[self._next]
            self._next = (self._next + 1) % self._size
        ev = slot[0]
        ev.record()
        if slot[1] is None:
            slot[1] = int(ev.cuda_event)
        if self._dev is None:
            self._dev = self._device()
        return ev, slot[1], self._dev


def _layers_of(per, todo):
    """The (src, dst, len) arrays of these layers out of a target's
    per-layer arrays (PushProducer._gate_arrays): the layer's own when one."""
    if len(todo) == 1:
        return per[todo[0]]
    src, dst, lens = array("Q"), array("Q"), array("Q")
    for li in todo:
        src.extend(per[li][0])
        dst.extend(per[li][1])
        lens.extend(per[li][2])
    return src, dst, lens


def _layer_notes(tid, nl):
    """Each layer's encoded "layer" message of a transfer id, the bytes
    encode({"t": "layer", "tid": tid, "l": [li]}) makes, for li < nl."""
    pre = MAGIC + b'{"t":"layer","tid":' + json.dumps(tid).encode() + b',"l":['
    return [pre + b"%d]}\n" % li for li in range(nl)]


def _layer_note(job, tg, todo):
    """The "layer" message telling these layers of the job to target tg:
    the one built for that layer (tg.gnote, _layer_notes) when one."""
    return tg.gnote[todo[0]] if len(todo) == 1 else \
        encode({"t": "layer", "tid": job.tid, "l": todo})


def _no_stream(dev):
    """gate_layer's stream for CPU KV caches: none (no event is recorded)."""
    return 0


def _core_mod():
    from mooncake_connector import _core
    return _core


def _row_ids(lay, rows):
    """Block rows as the array('Q') (blocks x groups ids) the C builds take:
    one id per row (ints) without a Python step per block; rows of ids, or
    ids the array cannot hold, through layout._row (its LayoutError)."""
    try:
        if lay.num_groups == 1:
            return array("Q", rows)
    except (OverflowError, TypeError):
        pass
    return array("Q", [b for r in rows for b in lay._row(r)])


def _target_spec(lay, pieces):
    """_core.target_extents' layers for one route's tp_map pieces (one per
    layer): (base, group, block_stride, outer offsets, dst_off, len,
    src_off), cached on the pieces' identity (a route's are kept)."""
    key = id(pieces)
    got = _TARGET_SPECS.get(key)
    if got is not None and got[0] is pieces and got[1] is lay:
        return got[2]
    if len(pieces) != len(lay.layers):
        raise ValueError(f"the route has {len(pieces)} layer pieces for "
                         f"{len(lay.layers)} layers here")
    spec = tuple((L.base, L.group, L.block_stride, array("Q", L.outer), pc.dst_off,
                  pc.length, 0 if pc.whole else pc.src_off)
                 for L, pc in zip(lay.layers, pieces))
    if len(_TARGET_SPECS) >= 64:
        _TARGET_SPECS.clear()
    _TARGET_SPECS[key] = (pieces, lay, spec)
    return spec


_TARGET_SPECS = {}  # id(pieces) -> (pieces, layout, spec): the objects kept alive with it


def _extent_too_long(k, b, n, s_off, s_len):
    return (f"extent {k} of block {b}: {n} bytes from offset {s_off} "
            f"exceed this side's {s_len}-byte extent")


def is_push(params):
    """kv_transfer_params of a push leg (either side): "push": true, or a
    transfer_id without flow b's num_tokens (the in-tree connector's shape)."""
    if not isinstance(params, dict):
        return False
    if params.get("push") is True:
        return True
    if params.get("push") is False:
        return False
    return isinstance(params.get("transfer_id"), str) and "num_tokens" not in params \
        and "remote_block_ids" not in params


def transfer_id(params):
    tid = params.get("transfer_id") if isinstance(params, dict) else None
    if not isinstance(tid, str) or not tid or len(tid) > MAX_TID:
        return None
    return tid


def token_hash(tokens):
    return hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16).hexdigest()


def encode(header, body=b""):
    return MAGIC + json.dumps(header, separators=(",", ":")).encode() + b"\n" + bytes(body)


def decode(msg):
    """(header dict, body bytes) or raises PushError naming what is wrong."""
    msg = bytes(msg)
    if not msg.startswith(MAGIC):
        raise PushError("not a push message")
    nl = msg.find(b"\n", len(MAGIC))
    if nl < 0:
        raise PushError("push message without a header line")
    try:
        head = json_in.loads(msg[len(MAGIC):nl])
    except ValueError as e:
        raise PushError(f"push message header is not JSON ({e})") from None
    if not isinstance(head, dict) or not isinstance(head.get("t"), str) or \
            not isinstance(head.get("tid"), str) or not 0 < len(head["tid"]) <= MAX_TID:
        raise PushError("push message header lacks t / tid")
    return head, msg[nl + 1:]


def _int(head, key, lo=0, hi=1 << 62):
    v = head.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise PushError(f"push target field {key!r} must be an integer in [{lo}, {hi}], "
                        f"not {v!r}")
    return v


def _seconds(head, key, default=None):
    """A finite number of head (a time or a duration); default when the
    key is absent or null and a default is given.  Anything else is a
    PushError: a str, list or an integer past the double range raised
    ValueError/TypeError/OverflowError out of the worker's notification
    drain (the engine died), NaN kept a read target's blocks for ever."""
    v = head.get(key)
    if v is None and default is not None:
        return default
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        try:
            f = float(v)
        except OverflowError:
            f = float("inf")
        if f == f and abs(f) != float("inf"):
            return f
    raise PushError(f"push target field {key!r} must be a finite number, not {str(v)[:40]!r}")


def never_sent(e):
    """Whether a failed send_notify proves its message did not arrive: only
    a connection that never came up does; anything else (a timeout, a reset
    after sending) may have delivered it."""
    text = str(e)
    return (getattr(e, "code_name", None) in NEVER_SENT or
            any(w in text for w in ("refused", "not found", "no such segment", "resolve",
                                    "unreachable")))


class Outbox:
    """Sends notifications off the vLLM step: one thread per peer engine
    (send_notify waits for the peer engine's receipt, GIL released), so a
    stalled or stopped peer delays only its own messages.  Results: key ->
    None (delivered) or (maybe_delivered, error text).  A message with
    `retry_until` (wall clock) that may not have arrived is sent again until
    then (a consumer stopped for a few seconds still gets its "done").  A
    key whose owner is gone (forget) has its results still in flight
    dropped as they come: nothing is kept for a load that ended first (its
    cancel's "cancelled" can arrive before the cancel's own receipt).  A
    peer's thread that had nothing to send for IDLE_S ends and its entry
    goes (decode servers rescheduled on new addresses leave nothing)."""

    MAX_PEERS = 256
    IDLE_S = 60.0  # a peer thread with nothing to send this long ends
    MAX_QUEUED = 4096  # messages waiting for one peer (a peer that never answers)
    MAX_RESULTS = 65536  # results nobody took (a backstop: forget() drops them)

    def __init__(self, engine, describe=False):
        self.engine = engine
        # describe: before the first message to a peer, learn whether it is
        # another process on this host (who_is); a consumer's outbox does.
        self.describe = describe
        self._who = OrderedDict()  # peer -> (pid, pidfd or -1) | None (not such a process)
        self._who_failed = {}      # peer -> monotonic time of a failed describe
        self._host = None          # this engine's boot id (its descriptor's host_id)
        self.results = {}
        self._inflight = {}  # key -> sends queued or running whose result is not in yet
        self._dropped = {}   # key -> how many of those results to drop (forgotten)
        self._lock = threading.Lock()
        self._peers = {}   # target -> (queue, thread)
        self._closed = False
        self._ok = OrderedDict()  # peers that took a message, latest last (MAX_PEERS at most)

    def send(self, target, msg, key=None, timeout=5.0, retry_until=None):
        with self._lock:
            if self._closed:
                return
            if key is not None:
                self._inflight[key] = self._inflight.get(key, 0) + 1
            ent = self._peers.get(target)
            if ent is None:
                if len(self._peers) >= self.MAX_PEERS:  # bounded: reuse the oldest's thread
                    ent = next(iter(self._peers.values()))
                else:
                    q = queue.Queue(maxsize=self.MAX_QUEUED)
                    t = threading.Thread(target=self._run, args=(q, target),
                                         name=f"mc-push-{target}", daemon=True)
                    ent = self._peers[target] = (q, t)
                    t.start()
            try:  # under the lock: an idle thread ends only with its queue empty
                ent[0].put_nowait((target, msg, key, timeout, retry_until))
                return
            except queue.Full:  # that peer has not taken a message for a long time
                pass
        text = (f"push outbox to {target} full ({self.MAX_QUEUED} messages waiting): "
                "the peer engine does not answer notifications; message not sent")
        if key is None:
            logger.warning("MooncakeConnector push: %s", text)
        else:
            self._store(key, (False, text))

    def take(self, key):
        with self._lock:
            return self.results.pop(key, "pending")

    def forget(self, key):
        """The key's owner is gone: its result is dropped, now or when it comes."""
        with self._lock:
            self.results.pop(key, None)
            n = self._inflight.get(key, 0)
            if n:
                self._dropped[key] = n

    def who_is(self, target):
        """(pid, pidfd dup or -1) of `target` if it is another process on
        this host (learned before the first message to it), else None (on
        another host, this process, or not known)."""
        with self._lock:
            w = self._who.get(target)
            if w is None:
                return None
            pid, fd = w
            try:
                return pid, (os.dup(fd) if fd >= 0 else -1)
            except OSError:
                return pid, -1

    def forget_who(self, target):
        """`target`'s connection went: a same-host process known under that
        name that has exited may come back as another one (a restart),
        learned again before the next message to it.  Kept while that
        process still runs (a stopped one loses its connections to our
        fence: still the same process), and for a peer on another host (no
        describe on the way to a cut link)."""
        with self._lock:
            w = self._who.get(target)
            if w is None or process_alive(*w):
                return
            del self._who[target]
        _close_fd(w)

    def _learn(self, target, timeout):
        with self._lock:
            if target in self._who:
                return
            failed = self._who_failed.get(target)
            if failed is not None and time.monotonic() - failed < DESCRIBE_RETRY_S:
                return
        who = None
        try:
            if self._host is None:
                self._host = _boot_id(json_in.loads(self.engine.get_metadata()).get("host_id"))
            d = json_in.loads(self.engine.describe_segment(
                target, max(0.05, min(timeout, DESCRIBE_TIMEOUT_S))))
            pid = d.get("pid")
            same = self._host and _boot_id(d.get("host_id")) == self._host
            if same and isinstance(pid, int) and 0 < pid != os.getpid():
                fd = _pidfd(pid)  # first: the process checked below is the one it watches
                if _same_process(pid, d.get("gen")) and process_alive(pid, fd):
                    who = (pid, fd)
                else:  # another pid namespace (a container), gone, or not ours to read
                    _close_fd((pid, fd))
                    logger.info("MooncakeConnector push: producer %s runs on this host but "
                                "its process cannot be watched from here (another pid "
                                "namespace?); blocks it did not answer for go back at the "
                                "lease's end", target)
        except Exception as e:  # noqa: BLE001 - not known: tried again at a later send
            logger.debug("MooncakeConnector push: could not describe %s: %s", target, e)
            with self._lock:
                self._who_failed[target] = time.monotonic()
            return
        with self._lock:
            self._who_failed.pop(target, None)
            old = self._who.pop(target, None)
            self._who[target] = who
            while len(self._who) > self.MAX_PEERS:
                old2 = self._who.popitem(last=False)[1]
                _close_fd(old2)
        _close_fd(old)
        if who is not None:
            logger.info("MooncakeConnector push: producer %s is process %d on this host",
                        target, who[0])

    def delivered_to(self, target):
        """Whether a message to `target` was delivered (receipt) before."""
        with self._lock:
            return target in self._ok

    def known(self, target):
        """Delivered to before, and (describe) what process it is learned
        since its last connection loss (forget_who): a message to it may go
        another way than this outbox's thread (PushConsumer._send_direct)."""
        with self._lock:
            return target in self._ok and (not self.describe or target in self._who)

    def _store(self, key, res):
        with self._lock:
            n = self._inflight.pop(key, 1) - 1
            if n > 0:
                self._inflight[key] = n
            drop = self._dropped.get(key, 0)
            if drop:  # forgotten while in flight (results of one key come in order)
                if drop > 1:
                    self._dropped[key] = drop - 1
                else:
                    del self._dropped[key]
                return
            self.results[key] = res
            while len(self.results) > self.MAX_RESULTS:  # results nobody took
                self.results.pop(next(iter(self.results)))

    def _idle_end(self, q, peer):
        """Whether the thread serving q (made for peer) ends: nothing queued
        for IDLE_S."""
        with self._lock:
            if not q.empty():
                return False
            ent = self._peers.get(peer)
            if ent is not None and ent[0] is q:
                del self._peers[peer]
            return True

    def _run(self, q, peer):
        from mooncake_connector import MooncakeError

        while True:
            try:
                item = q.get(timeout=self.IDLE_S)
            except queue.Empty:
                if self._idle_end(q, peer):
                    return
                continue
            if item is None:
                return
            target, msg, key, timeout, retry_until = item
            if self.describe:
                self._learn(target, timeout)
            while True:
                res = None
                try:
                    self.engine.send_notify(target, msg, timeout)
                    if trace.ON:
                        h = decode(msg)[0]
                        trace.event("notify_sent", h.get("tid"), what=h.get("t"), l=h.get("l"))
                except (MooncakeError, ValueError, RuntimeError) as e:
                    res = (not never_sent(e), str(e))
                if res is not None and res[0] and retry_until is not None and \
                        time.time() + timeout < retry_until and not self._closed:
                    time.sleep(0.05)  # not a busy loop against a peer that resets at once
                    continue  # maybe lost: the receiver ignores a duplicate
                break
            if res is None:
                with self._lock:
                    self._ok[target] = True
                    self._ok.move_to_end(target)
                    if len(self._ok) > self.MAX_PEERS:
                        self._ok.popitem(last=False)
            if res is not None and key is None:
                logger.warning("MooncakeConnector push: notification to %s failed: %s",
                               target, res[1])
            if key is not None:
                self._store(key, res)

    def close(self):
        with self._lock:
            self._closed = True
            peers = list(self._peers.values())
        for q, _ in peers:
            q.put(None)
        for _, t in peers:
            t.join(timeout=10)
        with self._lock:
            who, self._who = list(self._who.values()), OrderedDict()
        for w in who:
            _close_fd(w)


def _boot_id(host_id):
    """The boot id of a descriptor's host identity ("boot id/hostname"):
    one kernel, one host.  "" if not said."""
    return host_id.split("/", 1)[0] if isinstance(host_id, str) else ""


def _same_process(pid, gen):
    """Whether process `pid`, as numbered here, is the engine that described
    itself: the descriptor's "gen" names a sealed memfd page of that engine
    holding a random token (the same-host GPU path watches it), which must
    be open in that process under that fd.  A number from another pid
    namespace names another process here, or none."""
    try:
        path = f"/proc/{pid}/fd/{int(gen['fd'])}"
        token = int(gen["token"], 16)
        if not os.readlink(path).startswith("/memfd:mc-regions-gen"):
            return False
        with open(path, "rb") as f:
            head = f.read(16)
        return len(head) == 16 and int.from_bytes(head[8:16], sys.byteorder) == token
    except (OSError, KeyError, TypeError, ValueError):
        return False


def _pidfd(pid):
    """A pidfd of process `pid` (this one, not a later process given the
    same number), or -1 where the kernel or Python has none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return -1


def _close_fd(who):
    if who is not None and who[1] >= 0:
        try:
            os.close(who[1])
        except OSError:
            pass


def process_stopped(pid):
    """Whether process `pid` is stopped (SIGSTOP, a tracer): /proc state T
    or t.  Unreadable: counted stopped (the hold stays until an answer or
    the exit)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            st = f.read()
        return st[st.rindex(b")") + 2:st.rindex(b")") + 3] in (b"T", b"t")
    except (OSError, ValueError):
        return True


def process_alive(pid, pidfd=-1):
    """Whether process `pid` still runs (stopped counts as running): its
    pidfd is not readable yet (it becomes readable when the process exits,
    a zombie included); without one, signal 0 reaches it and /proc does not
    call it a zombie."""
    if pidfd >= 0:
        try:
            return not select.select([pidfd], [], [], 0)[0]
        except (OSError, ValueError):
            pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            st = f.read()
        return st[st.rindex(b")") + 2:st.rindex(b")") + 3] not in (b"Z", b"X")
    except (OSError, ValueError):
        return True


# ---------------------------------------------------------------- consumer

class ConsumerLoad:
    """A push load of one request on one consumer rank."""

    def __init__(self, spec, lease_s, nlayers=0):
        self.spec = spec
        self.nlayers = nlayers  # layer load: layers to land before the load is over
        self.landed = {}        # layer load: producer engine -> layer indices landed
        self.failed = None      # layer load: why it stopped waiting in this step
        self.t_ok = {}          # layer load: layer index -> monotonic time seen landed
        self.t0 = time.monotonic()
        self.lease_until = time.time() + lease_s
        self.deadline = self.t0 + lease_s            # our own patience (monotonic)
        self.hard_end = self.t0 + lease_s + PUSH_GRACE_S  # blocks free even unanswered
        self.ranks = {}   # producer engine -> state: sending|sent|done|nokv|cancelled|unsent
        self.why = {}     # producer engine -> reason text
        self.lost = set()  # producer engines whose connection the engine saw go
        self.msgs = {}     # producer engine -> the encoded target (re-sent as is)
        self.resend_at = {}  # producer engine -> monotonic time to send the target again
        self.maybe = set()   # producer engines a target may have reached
        self.heard = set()   # producer engines that answered (layer, done, nokv, cancelled)
        self.aborted = False
        self.error = None  # could not start at all (no target sent)
        # Layer read (push_layer_read): this side READs each layer the
        # producer announces; the producer writes nothing into our blocks.
        self.read = False
        self.allowed = {}  # producer engine -> {(dst, len)} of the extents we sent it
        self.rsrc = {}     # producer engine -> per layer (src, dst, len) arrays ("src")
        self.rreq = {}     # producer engine -> layer indices whose read was started
        self.rok = {}      # producer engine -> layer indices read (in our blocks)
        self.rbat = {}     # producer engine -> {batch id: [layer indices]} in flight
        self.wrote = set()  # producer engines that wrote after all (no "src": not a reader)
        self.last_note = self.t0  # monotonic: the target's send, then the last layer announced
        self.read_by = self.t0 + lease_s - READ_MARGIN_S  # no read starts later


TERMINAL = ("done", "nokv", "cancelled", "unsent")


class _Held:
    """A load's blocks kept from vLLM's reuse after the load ended: its
    producer is another process on this host that may still copy into
    them itself (same-host CPU / GPU paths: no connection of ours to cut)
    and has not answered."""
    __slots__ = ("rid", "pid", "pidfd", "t0", "next_cancel", "sending", "answer", "running")

    def __init__(self, rid, pid, pidfd, now):
        self.rid, self.pid, self.pidfd, self.t0 = rid, pid, pidfd, now
        self.running = None  # monotonic time since which its process is seen not stopped
        self.next_cancel = now
        self.sending = False  # a cancel to it is in the outbox
        self.answer = None  # the producer's done / nokv / cancelled, once it came


class PushConsumer:
    def __init__(self, worker):
        self.w = worker
        self.loads = {}   # tid -> ConsumerLoad (tid unique per load)
        self.by_rid = {}  # req_id -> tid
        # Blocks kept from vLLM after their load ended (_hold): (tid, producer)
        # -> _Held; req_id -> its held (tid, producer) keys; and what the
        # scheduler side is to be told (take_hold_events): ("hold", rid,
        # [block ids per KV-cache group]) / ("release", rid).  Bounded by the
        # loads that were in flight with a producer when it stopped answering.
        self.held = {}
        self.held_rids = {}
        self.hold_events = []

    def start(self, ld):
        """ld: the worker's loads.Load (spec.flow == "P"); sends the targets."""
        w, spec = self.w, ld.spec
        tid = spec.push_tid
        layered = bool(getattr(spec, "layer_load", False))
        cl = ConsumerLoad(spec, w.s.push_layer_timeout_s if layered else w.s.load_timeout_s,
                          nlayers=len(w.layout.layers) if layered and w.layout else 0)
        ld.push = cl
        try:
            if w.kv is None:
                raise ValueError("the KV cache is unregistered (sleep mode)")
            route = w.routes.route(spec.producer or w.default_producer,
                                   producer_tp=spec.producer_tp)
        except ValueError as e:  # SettingsError too
            cl.error = f"layout mismatch: {e}" if "fit" in str(e) else str(e)
            return
        from mooncake_connector.connector.loads import rows as block_rows

        end = spec.skip_blocks + len(spec.block_ids)
        ntok = end * w.block_size
        h = token_hash(spec.tokens[:ntok])
        rows = block_rows(spec)
        if tid in self.loads:  # two live requests joined by one transfer id: refuse the 2nd
            cl.error = (f"transfer_id {tid!r} is already used by another request waiting "
                        "here (each push needs its own)")
            return
        self.loads[tid] = cl
        self.by_rid[spec.req_id] = tid
        ids = None
        for name, pieces in route:
            try:
                if ids is None:
                    ids = _row_ids(w.layout, rows)
                body = _core_mod().target_extents(ids, w.layout.num_groups,
                                                  w.layout.num_blocks,
                                                  _target_spec(w.layout, pieces))
            except ValueError as e:
                cl.ranks[name] = "unsent"
                cl.why[name] = f"layout mismatch: {e}"
                continue
            head = {"t": "target", "tid": tid, "rank": w.tp_rank, "lease_until": cl.lease_until,
                    "ntok": ntok, "h": h, "skip": spec.skip_blocks,
                    "nblocks": len(spec.block_ids), "epb": w.layout.extents_per_block,
                    "n": len(body) // 24}
            if layered:
                head["lnotify"] = True
                cl.landed[name] = set()
                if getattr(spec, "layer_read", False):
                    cl.read = True
                    head["rd"] = True
                    head["lease_s"] = w.s.push_layer_timeout_s
                    ext = array("Q")
                    ext.frombytes(body)
                    cl.allowed[name] = {(ext[i], ext[i + 1]) for i in range(0, len(ext), 3)
                                        if ext[i + 1]}
                    cl.rreq[name], cl.rok[name], cl.rbat[name] = set(), set(), {}
            cl.ranks[name] = "sending"
            cl.msgs[name] = encode(head, body)
            trace.event("target_queued", tid, to=name)
            # one producer rank (equal TP): a wider route's round trips would
            # add up on the forward thread; the outbox sends those in parallel
            if layered and len(route) == 1 and self._send_direct(name, cl, tid):
                continue
            ob = w.push_outbox
            ob.send(name, cl.msgs[name], key=("t", tid, name),
                    timeout=RESEND_TIMEOUT_S if ob.delivered_to(name) else FIRST_CONTACT_SEND_S)

    DIRECT_TIMEOUT_S = 0.05  # the forward thread's wait for the producer's receipt

    def _send_direct(self, name, cl, tid):
        """A layer load's target sent by vLLM's forward thread itself (the
        engine's send_notify: one round trip, GIL released) to a producer
        this decode has reached before, the one rank of its route
        (push_target_direct): the outbox's thread would first have to take
        the GIL, which another thread of this process running Python keeps
        up to the switch interval (5 ms; benchmarks/JOURNAL.md, run 52).  The forward waits for the layers
        next anyway.  Nothing else for this transfer id was sent before, and
        whatever follows (a cancel) is sent after this returns: the order the
        producer sees stays the outbox's.  A failed send goes to the outbox
        as before, the same bytes (a producer that got the first copy keeps
        it: Target.same); one that may have arrived (a timeout) keeps the
        lease rules.  True: delivered."""
        w = self.w
        if not getattr(w.s, "push_target_direct", False) or not w.push_outbox.known(name) or \
                not hasattr(w.engine, "send_notify"):
            return False
        from mooncake_connector import MooncakeError
        try:
            w.engine.send_notify(name, cl.msgs[name], self.DIRECT_TIMEOUT_S)
        except (MooncakeError, ValueError, RuntimeError) as e:
            if not never_sent(e):
                cl.maybe.add(name)
            logger.info("MooncakeConnector push: target of %s to %s through the outbox (its "
                        "direct send: %s)", tid, name, e)
            return False
        if trace.ON:
            trace.event("notify_sent", tid, what="target", direct=True)
        cl.ranks[name] = "sent"
        cl.maybe.add(name)
        w.stats.add("push_targets_direct")
        return True

    def gone(self, tid, producer, producer_tp):
        """A push request that ends here without a target sent (aborted
        before its load started, its prompt all in this side's prefix
        cache): each producer rank of its route gets a cancel, so it frees
        the prompt's KV (now, or when computed) instead of holding it for a
        target until hold_timeout_s.  Nothing waits for the answer."""
        w = self.w
        if not tid or tid in self.loads:  # a live load of that transfer id owns it
            return
        try:
            route = w.routes.route(producer or w.default_producer, producer_tp=producer_tp)
        except ValueError as e:  # no producer to tell (its load would have failed alike)
            logger.info("MooncakeConnector push: %s ended without a target; no producer "
                        "to tell (%s)", tid, e)
            return
        ob = w.push_outbox
        for name, _ in route:
            key = ("g", tid, name)
            ob.send(name, encode({"t": "cancel", "tid": tid}), key=key,
                    timeout=RESEND_TIMEOUT_S if ob.delivered_to(name) else FIRST_CONTACT_SEND_S)
            ob.forget(key)  # its result is not waited for
        w.stats.add("push_untargeted_cancels")

    def on_message(self, sender, head, body=b""):
        cl = self.loads.get(head["tid"])
        if cl is None or sender not in cl.ranks:
            h = self.held.get((head["tid"], sender)) if self.held else None
            if h is not None and head["t"] in ("done", "nokv", "cancelled"):
                h.answer = head["t"]  # over with it: no copy of it can still run
            return
        t = head["t"]
        if trace.ON:
            trace.event("c_recv", head["tid"], what=t, l=head.get("l"))
        cl.heard.add(sender)  # the target arrived: no re-send
        if cl.read and sender in cl.allowed and sender not in cl.wrote:
            if t == "src":
                if sender not in cl.rsrc:
                    self._read_src(cl, sender, head, body)
                return
            if t == "layer":
                if head.get("rd") is not True or sender not in cl.rsrc:
                    # A producer that does not read-lend wrote this layer:
                    # the write rules (fence, hold) for it from now on.
                    cl.wrote.add(sender)
                else:
                    got = head.get("l")
                    if isinstance(got, list):
                        cl.landed[sender].update(i for i in got if isinstance(i, int) and
                                                 0 <= i < cl.nlayers)
                        cl.last_note = time.monotonic()
                    self._read_start(cl, head["tid"], sender)
                    return
        if t == "layer" and sender in cl.landed:
            got = head.get("l")
            if isinstance(got, list):
                cl.landed[sender].update(i for i in got if isinstance(i, int) and
                                         0 <= i < cl.nlayers)
            # Every layer landed: the producer sent and saw acknowledged all
            # it will write for us (nothing more can land).
            if len(cl.landed[sender]) == cl.nlayers and cl.ranks[sender] not in TERMINAL:
                cl.ranks[sender] = "done"
            return
        if t in ("done", "nokv", "cancelled") and cl.ranks[sender] not in TERMINAL:
            cl.ranks[sender] = t
            if t != "done":
                cl.why[sender] = str(head.get("why") or t)[:300]

    def _read_src(self, cl, name, head, body):
        """Layer read: the producer's "src" message, per layer the (src,
        dst, len) arrays of its blocks; every (dst, len) must be one of the
        extents we sent it (nothing outside this load's blocks is read
        into), else the load fails here."""
        cnt = head.get("cnt")
        arr = array("Q")
        ok = isinstance(cnt, list) and len(cnt) == cl.nlayers and \
            all(isinstance(c, int) and c >= 0 for c in cnt) and len(body) % 8 == 0
        if ok:
            arr.frombytes(body)
            ok = len(arr) == 3 * sum(cnt)
        per, allowed, off = [], cl.allowed[name], 0
        if ok:
            for c in cnt:
                src, dst, lens = arr[off:off + c], arr[off + c:off + 2 * c], \
                    arr[off + 2 * c:off + 3 * c]
                off += 3 * c
                if any((d, n) not in allowed for d, n in zip(dst, lens)):
                    ok = False
                    break
                per.append((src, dst, lens))
        if not ok:
            cl.why[name] = f"producer {name}: its read extents do not match our target"
            cl.ranks[name] = "nokv"  # nothing of it is read; its blocks are its own
            return
        cl.rsrc[name] = per
        cl.last_note = time.monotonic()
        # The producer lends its blocks keep_s more (its hold_timeout_s may
        # be shorter than our lease): no read starts after that, less the
        # margin (a producer without keep_s keeps them our lease's length).
        keep = head.get("keep_s")
        if isinstance(keep, (int, float)) and not isinstance(keep, bool) and keep == keep:
            cl.read_by = min(cl.read_by, cl.last_note + keep - READ_MARGIN_S)
        self.w.stats.add("push_layer_reads")

    def _read_start(self, cl, tid, name):
        """Layer read: READ the layers announced and not read yet (one batch;
        this engine's own I/O: process_vm_readv on the same host); none
        starts past read_by (the producer keeps its blocks until the lease)."""
        per = cl.rsrc.get(name)
        if per is None or cl.failed is not None or cl.aborted:
            return
        todo = sorted(cl.landed[name] - cl.rreq[name])
        if not todo:
            return
        if time.monotonic() > cl.read_by:
            cl.failed = (f"producer {name}: layer {todo[0]} was announced after the read "
                         "lease's end (timed out)")
            return
        cl.rreq[name].update(todo)
        src, dst, lens = _layers_of(per, todo)
        if not src:
            cl.rok[name].update(todo)
            return
        from mooncake_connector import MooncakeError
        try:
            bid = self.w.engine.batch_transfer_async_read(name, dst, src, lens)
        except (MooncakeError, ValueError) as e:
            cl.failed = f"producer {name}: a read of layer {todo[0]} failed to start: {e}"
            return
        cl.rbat[name][bid] = todo
        if trace.ON:
            trace.event("read_issued", tid, l=todo, bytes=sum(lens))

    def _read_check(self, cl, tid, name):
        """Layer read: reads over are noted; every layer read: "done", and
        the producer is told (rdone) so it frees its blocks now."""
        bat = cl.rbat.get(name)
        for bid, lis in list(bat.items()):
            r = self.w.engine.transfer_check_status(bid)
            if r == 0:
                continue
            del bat[bid]
            if r > 0:
                cl.rok[name].update(lis)
            elif cl.failed is None:
                cl.failed = f"producer {name}: a read of layer {lis[0]} failed"
        if len(cl.rok[name]) == cl.nlayers and cl.ranks.get(name) not in TERMINAL:
            cl.ranks[name] = "done"
            key = ("r", tid, name)
            self.w.push_outbox.send(name, encode({"t": "rdone", "tid": tid}), key=key)
            self.w.push_outbox.forget(key)

    def read_wait(self, ld):
        """A batch id of this load's reads in flight, or None."""
        cl = ld.push
        for bat in cl.rbat.values():
            for bid in bat:
                return bid
        return None

    def _read_end(self, cl):
        """Layer read, the load over: our own reads still in flight are
        cancelled (returns once no I/O thread of this engine touches them);
        then nothing more can land in the blocks: no producer writes into
        them in this mode."""
        for bat in cl.rbat.values():
            if bat:
                try:
                    self.w.engine.get_batch_transfer_status(list(bat), timeout=0)
                except Exception:  # noqa: BLE001 - a cancelled batch raises; that is the point
                    pass
                bat.clear()

    def peer_lost(self, name):
        """The engine saw the connection to or from producer `name` fail or
        close (Engine.take_lost_peers): loads still waiting for its writes
        stop waiting now instead of at their timeout; the usual cancel goes
        out and the fence rules stay (the blocks are freed once the producer
        answers the cancel, or its connect is refused: the process is gone,
        or at lease end + grace)."""
        now = time.monotonic()
        self.w.push_outbox.forget_who(name)  # may come back as another process
        for cl in self.loads.values():
            if cl.ranks.get(name) in ("sending", "sent"):
                if cl.deadline > now:
                    self.w.stats.add("push_producer_lost")
                cl.why[name] = (f"the connection to producer {name} was lost while waiting "
                                "for its KV (producer gone?)")
                cl.deadline = min(cl.deadline, now)
                cl.lost.add(name)

    def _fence(self, name, why):
        """Blocks lent to producer `name` are about to be freed without its
        answer: its connections into this engine are cut first (reset, on
        the I/O threads; returns once none of its bytes can land), so what
        its kernel still sends (a slow link's socket buffer, a stopped
        process) never reaches reused blocks.  Its other loads in flight
        fail with it and are rescheduled (docs/connector.md, "The lease")."""
        try:
            n = self.w.engine.cut_peer(name, FENCE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 -- the blocks are freed at the lease anyway
            logger.error("MooncakeConnector push: could not cut producer %s's connections "
                         "before freeing blocks (%s): %s; bytes it still sends may land in "
                         "reused blocks", name, why, e)
            return
        self.w.stats.add("push_fence_cuts")
        logger.warning("MooncakeConnector push: cut %d connection(s) from producer %s before "
                       "freeing its blocks: %s", n, name, why)

    def _hold(self, ld, name, why):
        """The load ends without producer `name`'s answer.  Over TCP the cut
        (_fence) stops its bytes; but a producer on this host may copy into
        our memory itself (same-host CPU: process_vm_writev; same-host GPU:
        CUDA IPC), with no connection of ours in the path: stopped between
        its lease check and the end of a copy, it would finish the copy
        whenever it resumes.  So while that process lives and has not
        answered, the load's blocks stay out of vLLM's reuse (the scheduler
        side holds a reference on them: take_hold_events); the load itself
        ends now, as before (its request recomputes or ends).  Its answer
        (to the cancel, sent again every HOLD_CANCEL_S) comes only once none
        of its copies for this target can run; its process ending does the
        same.  Counted push_fence_holds, one WARN per request."""
        spec, tid = ld.spec, ld.spec.push_tid
        if (tid, name) in self.held:
            return
        who = self.w.push_outbox.who_is(name)
        if who is None:
            return  # another host (the cut fences it), this process, or not known
        pid, fd = who
        if not process_alive(pid, fd):
            _close_fd(who)
            return
        now = time.monotonic()
        self.held[(tid, name)] = _Held(spec.req_id, pid, fd, now)
        keys = self.held_rids.setdefault(spec.req_id, set())
        if not keys:
            groups = [list(spec.block_ids)] + [list(g) for g in spec.more_groups]
            self.hold_events.append(("hold", spec.req_id, groups))
            self.w.stats.add("push_fence_holds")
            logger.warning("MooncakeConnector push: request %s: producer %s (process %d on this "
                           "host) %s; the load ends, but its %d block(s) are not given back to "
                           "vLLM until that process answers or exits (it may still copy into "
                           "them itself)", spec.req_id, name, pid, why, len(spec.block_ids))
        keys.add((tid, name))

    def poll_holds(self):
        """Held blocks whose producer answered or whose process ended go
        back (a "release" event); the others' cancel is sent again."""
        if not self.held:
            return
        now = time.monotonic()
        for key, h in list(self.held.items()):
            tid, name = key
            k = ("h", tid, name)
            if h.answer is None and process_alive(h.pid, h.pidfd):
                # An idle producer answers only at its next vLLM step (its
                # worker drains notifications there): a process seen not
                # stopped for HOLD_RUNNING_S has finished or dropped any copy
                # it was in (none starts past the lease: submit_by_ns).
                if process_stopped(h.pid):
                    h.running = None
                elif h.running is None:
                    h.running = now
                elif now - h.running >= HOLD_RUNNING_S:
                    h.answer = "running"
            if h.answer is None and process_alive(h.pid, h.pidfd):
                if h.sending and self.w.push_outbox.take(k) != "pending":
                    h.sending = False  # the answer is a message, not this receipt
                if not h.sending and now >= h.next_cancel:
                    h.next_cancel, h.sending = now + HOLD_CANCEL_S, True
                    self.w.push_outbox.send(name, encode({"t": "cancel", "tid": tid}), key=k,
                                            timeout=HOLD_CANCEL_S)
                continue
            del self.held[key]
            self.w.push_outbox.forget(k)
            _close_fd((h.pid, h.pidfd))
            keys = self.held_rids.get(h.rid)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self.held_rids[h.rid]
                    self.hold_events.append(("release", h.rid))
            logger.warning("MooncakeConnector push: request %s: producer %s (process %d) %s "
                           "after %.1f s; its blocks go back to vLLM", h.rid, name, h.pid,
                           ("ran " + f"{HOLD_RUNNING_S:g} s without being stopped"
                            if h.answer == "running" else f"answered {h.answer}")
                           if h.answer else "exited", now - h.t0)

    def take_hold_events(self):
        out, self.hold_events = self.hold_events, []
        return out

    def release_all_holds(self):
        """The worker closes (shutdown, sleep): nothing of ours is written
        any more; every hold goes back."""
        for h in self.held.values():
            _close_fd((h.pid, h.pidfd))
        for rid in self.held_rids:
            self.hold_events.append(("release", rid))
        self.held.clear()
        self.held_rids.clear()

    def abort(self, rid):
        tid = self.by_rid.get(rid)
        if tid is not None and tid in self.loads:
            self.loads[tid].aborted = True

    def layer_state(self, ld, li):
        """Layer load: "ok" once layer li landed from every producer rank,
        "failed" (cl.failed says why) once it cannot in this step, else
        "wait".  Advances the load (outbox results, cancel at its deadline)."""
        cl = ld.push
        if cl.failed is not None:
            return "failed"
        if cl.error is not None:
            cl.failed = cl.error
            return "failed"
        self._progress(ld)
        wait = False
        for name, st in cl.ranks.items():
            if cl.read and name in cl.allowed and name not in cl.wrote:
                r = self._read_state(ld, name, st, li)
                if r == "failed":
                    self._progress(ld)  # the cancel goes out now
                    return r
                wait = wait or r == "wait"
                continue
            if st == "done" or li in cl.landed.get(name, ()):
                continue
            if st in ("sending", "sent") and time.monotonic() < cl.deadline:
                wait = True
                continue
            if st in ("sending", "sent", "cancelling") and name not in cl.lost:
                # No answer by the deadline, the connection not seen lost: a
                # timeout (recompute reason timed_out), as the whole-prompt
                # push's at its lease (poll).  A send that failed but may have
                # arrived (timed out, reset: a stopped producer never sends
                # its receipt) left cl.why "producer ... unreachable: ...",
                # which proves nothing; only a target that provably never left
                # (unsent) or a lost connection is producer_unreachable.
                cl.failed = (f"producer {name}: layer {li} did not land within "
                             f"push_layer_timeout_s={self.w.s.push_layer_timeout_s} "
                             "(timed out)")
            else:
                cl.failed = cl.why.get(name) or f"producer {name}: {st}"
            self._progress(ld)  # at the deadline: the cancel goes out now
            return "failed"
        if wait:
            return "wait"
        cl.t_ok.setdefault(li, time.monotonic())
        return "ok"

    def _read_state(self, ld, name, st, li):
        """Layer read, one producer rank: "ok" once layer li is in our
        blocks, "wait", or "failed" (cl.failed says why): the producer
        answered nokv, a read failed, or it announced no layer for
        push_layer_read_stall_s (stopped, dead, queued: this side owns its
        blocks, so it need not wait for the producer's answer)."""
        cl, tid = ld.push, ld.spec.push_tid
        if st == "done" or li in cl.rok[name]:
            return "ok"
        if st in ("nokv", "cancelled", "unsent"):
            cl.failed = cl.why.get(name) or f"producer {name}: {st}"
            return "failed"
        self._read_start(cl, tid, name)
        self._read_check(cl, tid, name)
        if cl.failed is not None:
            return "failed"
        if cl.ranks[name] == "done" or li in cl.rok[name]:
            return "ok"
        now = time.monotonic()
        if name in cl.lost:  # its connection went (peer_lost): gone, not merely silent
            cl.failed = cl.why.get(name) or f"producer {name}: its connection was lost"
            return "failed"
        stall = self.w.s.push_layer_read_stall_s
        # (a read of ours still in flight that long, e.g. over TCP from a
        # stopped producer, is given up too: poll() cancels our reads)
        if now - cl.last_note >= stall or now >= cl.deadline:
            cl.failed = (f"producer {name}: no layer announced for {now - cl.last_note:.2f} s "
                         f"(push_layer_read_stall_s={stall:g}) while waiting for layer {li} "
                         "(timed out)")
            self.w.stats.add("push_layer_read_gave_up")
            return "failed"
        return "wait"

    def _progress(self, ld):
        """Outbox results of the load's messages; cancels once aborted or
        past its deadline.  Returns the producer ranks not over yet."""
        cl, tid = ld.push, ld.spec.push_tid
        for name, st in list(cl.ranks.items()):
            if st == "sending":
                r = self.w.push_outbox.take(("t", tid, name))
                if r == "pending":
                    continue
                if r is None:
                    cl.ranks[name] = "sent"
                    cl.maybe.add(name)
                else:
                    maybe, text = r
                    cl.why[name] = f"producer {name} unreachable: {text}"
                    # A target that may have arrived (this send or an earlier
                    # one) keeps the lease rules, and is sent again (below).
                    if maybe:
                        cl.maybe.add(name)
                    if name in cl.maybe:
                        cl.ranks[name] = "sent"
                        cl.resend_at[name] = time.monotonic() + RESEND_S
                    else:
                        cl.ranks[name] = "unsent"
            elif st == "cancelling":
                r = self.w.push_outbox.take(("c", tid, name))
                if r not in ("pending", None) and not r[0]:
                    # The producer is gone: no write starts; what its kernel
                    # still sends (an exited process's sockets drain) is cut.
                    cl.ranks[name] = "unsent"
                    self._fence(name, f"its cancel of {tid} was refused (producer gone)")
                    self._hold(ld, name, "refused its cancel (its engine is not listening) "
                               "while its process still runs")
                elif r not in ("pending", None):  # may have arrived: the lease rules stay
                    logger.warning("MooncakeConnector push: cancel of %s to %s may not have "
                                   "arrived (%s); its blocks wait for the lease's end",
                                   tid, name, r[1])
        now = time.monotonic()
        failed = cl.failed is not None and cl.nlayers  # a layer load given up in its step
        live = [n for n, st in cl.ranks.items() if st not in TERMINAL]
        if cl.resend_at and not (cl.aborted or failed or now >= cl.deadline):
            self._resend(cl, tid, now)
        if live and (cl.aborted or failed or now >= cl.deadline):
            for name in live:
                if cl.ranks[name] != "sent":
                    continue  # sending: canceled once sent; cancelling: asked already
                cl.ranks[name] = "cancelling"
                # To a producer whose connection went: it may be mid-exit
                # (connections closed, its listener not yet), so a cancel
                # unanswered within 1 s is sent again until one is refused
                # (gone: nothing more can land) or answered, within the lease.
                lost = name in cl.lost
                self.w.push_outbox.send(name, encode({"t": "cancel", "tid": tid}),
                                        key=("c", tid, name), timeout=1.0 if lost else 5.0,
                                        retry_until=cl.lease_until if lost else None)
        return live

    def _resend(self, cl, tid, now):
        """Targets whose last send failed but may be transient (timed out,
        reset) and that no answer followed: sent again, the same bytes,
        RESEND_S after the failure, while the lease lets the producer still
        write (its last second excluded); never after an abort or the
        load's deadline (the cancel follows the last send)."""
        left = cl.lease_until - PUSH_MARGIN_S - time.time()
        for name, at in list(cl.resend_at.items()):
            if name in cl.heard or cl.ranks.get(name) != "sent" or left <= 0:
                del cl.resend_at[name]
                continue
            if now < at:
                continue
            del cl.resend_at[name]
            cl.ranks[name] = "sending"
            self.w.stats.add("push_target_resends")
            logger.info("MooncakeConnector push: target of %s to %s sent again (%s)", tid,
                        name, cl.why.get(name))
            trace.event("target_queued", tid, to=name, resend=True)
            self.w.push_outbox.send(name, cl.msgs[name], key=("t", tid, name),
                                    timeout=max(0.2, min(RESEND_TIMEOUT_S, left)))

    def poll(self, ld):
        """(matched tokens, error) once the load is over and nothing more can
        be written into its blocks, else None."""
        cl, spec = ld.push, ld.spec
        if cl.error is not None:
            return 0, cl.error
        tid = spec.push_tid
        live = self._progress(ld)
        now = time.monotonic()
        if cl.read and live and (cl.failed is not None or cl.aborted or now >= cl.deadline):
            # Layer read: the producers that only lend their blocks write
            # nothing here; once our own reads are over the load is over,
            # whatever they answer (the cancel went out; they free their
            # blocks at its arrival or at the lease's end).
            self._read_end(cl)
            for name in [n for n in live if n in cl.allowed and n not in cl.wrote]:
                live.remove(name)
                if cl.ranks[name] == "sending":  # the cancel follows the target (one queue)
                    key = ("g", tid, name)
                    self.w.push_outbox.send(name, encode({"t": "cancel", "tid": tid}),
                                            key=key, timeout=RESEND_TIMEOUT_S)
                    self.w.push_outbox.forget(key)
                cl.ranks[name] = "cancelled"
                cl.why.setdefault(name, f"producer {name}: given up")
        if live and now < cl.hard_end:
            return None
        if cl.read:
            self._read_end(cl)
        for name in live:  # lease over: the producer may not write any more
            self._fence(name, f"it did not answer {tid} by the lease's end + grace")
            self._hold(ld, name, "did not answer by the lease's end + grace (stopped "
                       "or unresponsive)")
            cl.ranks[name] = "nokv"
            cl.why[name] = (f"producer {name} did not answer within the lease "
                            f"(load_timeout_s={self.w.s.load_timeout_s} + {PUSH_GRACE_S} s) "
                            "(timed out)")
        self.loads.pop(tid, None)
        self.by_rid.pop(spec.req_id, None)
        for name in cl.ranks:  # results that sit in the outbox or are still to come
            self.w.push_outbox.forget(("t", tid, name))
            self.w.push_outbox.forget(("c", tid, name))

        if all(st == "done" for st in cl.ranks.values()) and cl.ranks and cl.failed is None:
            return (spec.skip_blocks + len(spec.block_ids)) * self.w.block_size, None
        errs = [cl.why.get(n) or st for n, st in cl.ranks.items() if st != "done"]
        if cl.aborted:
            return 0, None
        if errs and all("ended" in e and "KV" in e for e in errs):
            return 0, None  # the prefill never had the KV: recompute reason not_held
        if cl.failed is not None:  # a layer load: its step's forward ran without it
            return 0, cl.failed
        return 0, errs[0] if errs else "no producer rank to push from"


# ---------------------------------------------------------------- producer

def _locked(fn):
    """PushProducer's state is shared by vLLM's thread and, with CUDA KV
    caches layer by layer, the layer waiter's thread (layer_events.py)."""
    @functools.wraps(fn)
    def run(self, *a, **kw):
        with self.lock:
            try:
                return fn(self, *a, **kw)
            finally:  # whatever it changed: gate_layer's plan anew, outside the layer's save
                self._gplan = self._gate_plan() if self._fast else None
    return run


class Target:
    def __init__(self, sender, head, body, arrived, keep_max_s=86400.0):
        self.name = sender
        self.head = head
        self.lease_until = _seconds(head, "lease_until")
        self.skip = _int(head, "skip", 0, 1 << 24)
        self.nblocks = _int(head, "nblocks", 0, 1 << 24)
        self.epb = _int(head, "epb", 1, 1 << 16)
        self.ntok = _int(head, "ntok", 0, 1 << 31)
        n = _int(head, "n", 0, 1 << 26)
        if len(body) != 24 * n:
            raise PushError(f"push target carries {len(body)} bytes of extents for n={n} "
                            f"(expected {24 * n})")
        if n != self.nblocks * self.epb:
            raise PushError(f"push target has {n} extents for {self.nblocks} blocks x "
                            f"{self.epb} extents per block")
        self.dest = array("Q")
        self.dest.frombytes(body)
        self.arrived = arrived
        self.layers_sent = set()
        self.lnotify = head.get("lnotify") is True  # "layer" messages as layers land
        # Layer read (push_layer_read): the decode READs each layer from our
        # blocks once told it is computed; nothing is written into its memory.
        # Our blocks are kept until it says "rdone", cancels, or keep_until:
        # our own clock's arrival + the lease's length (a duration, never
        # shorter than the decode's own lease, whatever the clocks say), but
        # never longer than our own hold_timeout_s (keep_max_s): a decode's
        # push_layer_timeout_s (up to 86400 s) does not pin our blocks past
        # it.  The "src" message tells the decode (keep_s), which starts no
        # read after it (PushConsumer._read_src).
        self.read = self.lnotify and head.get("rd") is True
        lease = min(max(_seconds(head, "lease_s", 0.0), 0.0), 86400.0) if self.read else 0.0
        self.keep_until = arrived + min(lease, keep_max_s) if self.read else 0.0
        self.keep_why = ("the decode side's read lease ended" if lease <= keep_max_s else
                         f"the prefill's hold_timeout_s ({keep_max_s:g} s, shorter than the "
                         f"decode's push_layer_timeout_s {lease:g} s) ended the read lease")
        self.rdone = False       # layer read: the decode read every layer
        # Layer read: announcements through the engine's gate FIFO
        # (Engine.notify_gated; None: none yet, True: some, False: the
        # outbox from now on) and when the last one was queued (monotonic)
        self.rgate = None
        self.rtold_at = 0.0
        # Layer read: "src" re-sent through the outbox (_reannounce): None
        # not (or its send failed), "sent" its receipt not in yet, "ok"
        # delivered (the decode has it: not sent again)
        self.rsrc_sent = None
        self.landed = set()      # layer indices whose writes were acknowledged
        self.told = set()        # layer indices the consumer was told (or the engine tells
        #                          it: a gated batch's own notification)
        self.garr = None         # CUDA gate: per layer (src, dst, len) array('Q'), built once
        self.gnote = None        # CUDA gate, lnotify: per layer its encoded "layer" message
        self.gbytes = None       # CUDA gate: per layer the bytes written
        self.blayers = {}        # batch id -> the layer indices it writes
        self.batches = []
        self.state = "pending"   # pending | writing | done | nokv | cancelled
        self.cancel = False      # the consumer asked to stop (abort, its timeout)
        self.stop = None         # why this side stops writing (lease, failure, timeout)
        self.why = None          # why it ended "nokv" (answered again to a duplicate)

    def notify_timeout(self):
        """Seconds the engine may try to deliver a gated batch's note: at most
        RESEND_TIMEOUT_S and not past the lease, at least 0.1."""
        return max(0.1, min(RESEND_TIMEOUT_S, self.lease_until - time.time()))

    def same(self, other):
        """An identical copy (the consumer re-sent it): same lease, same
        blocks, same prompt."""
        return isinstance(other, Target) and other.head == self.head and \
            other.dest == self.dest


class _Served:
    """A consumer that canceled before the prompt was computed."""
    state = "cancelled"
    batches = ()
    lnotify = False
    read = False


class ProducerJob:
    def __init__(self, spec, expected, layerwise, optional=False, watch=True):
        self.optional = optional  # also published for a pull (a bare transfer_id)
        self.watch = watch     # layer load: the landing thread tells each layer as it lands
        self.spec = spec
        self.rid = spec.req_id
        self.tid = spec.push_tid
        self.expected = max(1, expected)
        self.layerwise = layerwise
        self.ready = set()     # layer indices computed
        self.queued = set()    # CUDA gate: layer indices whose kernels are queued (saved)
        self.qev = None        # CUDA gate: the latest layer's event (ev, handle, device)
        self.all_ready = False
        # CUDA gate: the prompt is complete with no stream synchronize after
        # its forward (every layer's writes were gated on its event); a
        # write started later is gated on the last layer's event (qev)
        self.unsynced = False
        self.targets = {}      # consumer engine -> Target
        self.t0 = time.monotonic()
        self.bytes = 0
        # optional: published for a pull on another request's blocks (the
        # same prompt, held): held for its target like a push-only job
        self.shared = False


class PushProducer:
    def __init__(self, worker):
        self.w = worker
        self.jobs = {}       # tid -> ProducerJob
        self.by_rid = {}     # req_id -> tid
        self.early = {}      # tid -> {sender: Target} (target before the prompt)
        self.ended = {}      # tid -> monotonic time its job ended / it was dropped
        self.canceled = {}   # tid -> (monotonic time, {consumer engine}) canceled before the prompt
        self._early_bytes = 0
        self.lock = threading.RLock()
        self._waiter = None  # CUDA KV caches: layer_events.LayerWaiter, made at first use
        self._landing = None  # layer load: landing.LandingWatcher, made at first use
        # CUDA gate (push_layer_gate): record a layer's event -> (event, CUevent handle,
        # device); the events given to the engine are kept alive by the ring (GateEvents)
        self._gate_event = GateEvents().record
        self._gate_failed = None
        # gate_layer: the engine's one call per layer (None: not decided yet;
        # decided at the first save, when torch has its CUDA context), the
        # current stream's raw handle of a device, and the device
        self._fast = None
        self._gate_spec = None  # _gate_arrays: the layers' geometry tuples for _core.gate_arrays
        # gate_layer's plan (_gate_plan), rebuilt after anything else took the lock
        self._gplan = None
        self._stream = None
        self._gdev = 0
        self._cpu = False     # gate_layer without an event (CPU KV caches)
        self._layer_index = {L.name: i for i, L in enumerate(worker.layout.layers)}
        self._eng_seen = {}   # _count_engine_paths: the engine's counters last read
        off, self._layer_off = 0, []
        for L in worker.layout.layers:
            self._layer_off.append((off, len(L.outer)))
            off += len(L.outer)

    @property
    def streams(self):
        """Layer by layer is possible: on CPU (a layer's KV is in memory when
        save_kv_layer runs) or with CUDA layer events (push_layerwise_cuda)."""
        return self.w.cuda_sync is None or bool(self.w.s.push_layerwise_cuda)

    # messages

    @_locked
    def on_message(self, sender, head, body):
        t, tid = head["t"], head["tid"]
        if trace.ON:
            trace.event("p_recv", tid, what=t, job=tid in self.jobs)
        if t == "target":
            try:
                tg = Target(sender, head, body, time.monotonic(), self.w.s.hold_timeout_s)
            except PushError as e:
                logger.warning("MooncakeConnector push: refused a target from %s for %s: %s",
                               sender, tid, e)
                self._reply(sender, tid, "nokv", f"target refused: {e}")
                return
            job = self.jobs.get(tid)
            if job is not None:
                self._add_target(job, tg)
            elif sender in self.canceled.get(tid, (0, ()))[1]:
                # This consumer canceled first: a copy that came after its
                # cancel (another path, a duplicate) is not kept for the
                # prompt, whose blocks there may be another request's now.
                self._reply(sender, tid, "cancelled", "canceled before any write")
            elif tid in self.ended:
                self._reply(sender, tid, "nokv", "the prefill request ended before the decode "
                            "side's target arrived (aborted, failed, or its KV held past "
                            "hold_timeout_s)")
            else:
                # Bounded (a peer may send targets for prompts that never
                # come): at most EARLY_MAX transfer ids, EARLY_MAX_BYTES of
                # extents; the oldest are answered nokv and dropped.
                while self.early and (len(self.early) >= EARLY_MAX or
                                      self._early_bytes + len(body) > EARLY_MAX_BYTES):
                    old = next(iter(self.early))
                    for snd, otg in self.early.pop(old).items():
                        self._early_bytes -= 24 * len(otg.dest) // 3
                        self._reply(snd, old, "nokv", "too many targets waiting for prompts "
                                    "on this prefill")
                prev = self.early.setdefault(tid, {}).get(sender)
                if prev is not None:
                    self._early_bytes -= 24 * len(prev.dest) // 3
                self.early[tid][sender] = tg
                self._early_bytes += len(body)
        elif t == "rdone":  # layer read: the decode read every layer; our blocks are free
            job = self.jobs.get(tid)
            tg = job.targets.get(sender) if job is not None else None
            if tg is not None and getattr(tg, "read", False):
                tg.rdone = True
        elif t == "cancel":
            job = self.jobs.get(tid)
            tg = job.targets.get(sender) if job is not None else None
            if tg is None:
                early = self.early.get(tid, {})
                gone = early.pop(sender, None)
                if gone is not None:
                    self._early_bytes -= 24 * len(gone.dest) // 3
                if not early:
                    self.early.pop(tid, None)
                if job is not None:
                    # The job began but this consumer's target never reached
                    # it (lost on the way, or dropped at its lease's end
                    # while waiting for the prompt): served, nothing written,
                    # so the KV is not held for it until hold_timeout_s.
                    job.targets[sender] = _Served()
                else:
                    if len(self.canceled) >= EARLY_MAX:  # bounded like early targets
                        self.canceled.pop(next(iter(self.canceled)))
                    # The prompt may still come: it is served (nothing
                    # written) for this consumer, so its blocks are not held
                    # for it.
                    self.canceled.setdefault(tid, (time.monotonic(), set()))[1].add(sender)
                self._reply(sender, tid, "cancelled", "canceled before any write")
                return
            tg.cancel = True

    def _reply(self, sender, tid, t, why=None, retry_until=None, body=b"", **kw):
        head = {"t": t, "tid": tid, **kw}
        if why:
            head["why"] = why
        self.w.push_outbox.send(sender, encode(head, body), retry_until=retry_until)

    # jobs

    @_locked
    def begin(self, spec, expected, layerwise, optional=False, watch=True):
        """A push request's prompt completes in this step (before the forward)."""
        tid = spec.push_tid
        if tid in self.jobs:
            return
        job = ProducerJob(spec, expected, layerwise, optional, watch)
        self.jobs[tid] = job
        self.by_rid[spec.req_id] = tid
        early = self.early.get(tid, {})
        if self.streams and any(tg.lnotify for tg in early.values()):
            job.layerwise = True  # the decode's attention waits for each layer
        for tg in self.early.pop(tid, {}).values():
            self._early_bytes -= 24 * len(tg.dest) // 3
            self._add_target(job, tg)
        for sender in self.canceled.pop(tid, (0, ()))[1]:
            job.targets.setdefault(sender, _Served())

    @_locked
    def dropped(self, tid):
        """The prefill request ended without a prompt to push."""
        self._end_tid(tid, time.monotonic())
        for sender, tg in self.early.pop(tid, {}).items():
            self._early_bytes -= 24 * len(tg.dest) // 3
            self._reply(sender, tid, "nokv", "the prefill request ended without KV (aborted "
                        "or failed before its prompt was computed)")

    def _add_target(self, job, tg):
        old = job.targets.get(tg.name)
        if old is not None:
            if tg.same(old):  # re-sent by the consumer: the first copy stands
                self._repeat(job, old)
                return
            why = "a second, different target for this transfer id from the same decode rank"
            if old.state in ("pending", "writing"):
                # Refused without an answer: a nokv would tell the decode
                # that nothing more is written while the first one's writes
                # go on.  (A consumer keeps one load per transfer id and
                # re-sends only identical copies: not seen in a correct run.)
                logger.warning("MooncakeConnector push: %s -> %s: %s while the first is "
                               "being served; refused (ignored)", job.rid, tg.name, why)
                return
            self._reply(tg.name, job.tid, "nokv", f"{why} (refused)")
            return
        spec = job.spec
        n_full = len(spec.tokens)
        mismatch = None
        if tg.ntok > n_full or tg.ntok != (tg.skip + tg.nblocks) * self.w.block_size or \
                token_hash(spec.tokens[:tg.ntok]) != tg.head.get("h"):
            mismatch = (f"prompt mismatch: the decode side's {tg.ntok} tokens are not this "
                        f"prefill's first tokens ({n_full} held)")
        elif tg.epb != self.w.layout.extents_per_block:
            mismatch = (f"layout mismatch: {tg.epb} extents per block vs "
                        f"{self.w.layout.extents_per_block} here")
        if mismatch:
            job.targets[tg.name] = tg
            tg.state = "nokv"
            tg.why = mismatch
            self._reply(tg.name, job.tid, "nokv", tg.why)
            return
        if job.optional and not job.targets and job.all_ready:
            self.w.publishes.withdraw(job.rid)  # published for a pull too: push takes it
        if tg.lnotify and not job.all_ready and self.streams:
            job.layerwise = True  # before the forward: each layer as it is computed
        job.targets[tg.name] = tg
        self._submit(job, tg)
        if job.layerwise and not job.all_ready and self._gate_on():
            # the per-layer arrays now (usually before the forward), not in a layer's save
            if self._gate_arrays(job, tg) is not None and job.queued:
                self._submit_gated(job, tg)  # layers saved before the target arrived
        elif job.layerwise and not job.all_ready and tg.lnotify and tg.garr is None and \
                tg.state in ("pending", "writing") and not tg.stop and self._engine_tells(job):
            self._gate_arrays(job, tg)  # CPU: gate_layer's arrays before the next save

    def _repeat(self, job, tg):
        """An identical duplicate of a target this job has: nothing is
        written twice; an ended one gets its answer again (the first may
        have been lost), a layer load in progress the layers landed so far."""
        if tg.state == "done":
            self._reply(tg.name, job.tid, "done", ntok=tg.ntok)
        elif tg.state in ("nokv", "cancelled"):
            self._reply(tg.name, job.tid, tg.state, tg.why)
        elif tg.read and tg.state == "lent":
            self._reannounce(job, tg, time.monotonic())
        elif tg.lnotify and tg.landed and not tg.stop:
            self._reply(tg.name, job.tid, "layer", l=sorted(tg.landed))

    def _fast_gate(self):
        """Whether gate_layer can take the layers: CUDA through the gate,
        an engine with gate_layer, torch's raw current stream; or CPU KV
        caches whose layers the engine tells (_engine_tells: push_layer_gate,
        an engine with gated batches): no event (device -1); the engine
        hands a target the same-host CPU path serves to its gate thread
        (the layer's process_vm_writev off vLLM's forward thread), other
        targets' writes start in the call (TCP: its threads send)."""
        if self.w.cuda_sync is None:
            if not (self._gate_failed is None and bool(getattr(self.w.s, "push_layer_gate", True))
                    and hasattr(self.w.engine, "gate_layer")
                    and hasattr(self.w.engine, "batch_transfer_async_write_gated")):
                return False
            self._stream, self._gdev, self._cpu = _no_stream, -1, True
            return True
        if not self._gate_on() or not hasattr(self.w.engine, "gate_layer"):
            return False
        if self._stream is None:
            try:
                import torch
                self._stream = torch._C._cuda_getCurrentRawStream
                self._gdev = int(torch.cuda.current_device())
            except (ImportError, AttributeError, RuntimeError) as e:
                logger.info("MooncakeConnector push: the gate's one call per layer is off "
                            "(torch's raw stream: %s)", e)
                return False
        return True

    def gate_layer(self, layer_name):
        """vLLM's forward thread, after each layer's attention, CUDA KV
        caches through the engine's gate: one engine call (Engine.gate_layer,
        plain data in and out) records the engine's next event on torch's
        current stream and hands each target of the plan (_gate_plan: its
        prebuilt arrays, "layer" messages and lease) the layer's writes gated
        on it; the batches it returns are noted here (no Python call per
        target).  CPU KV caches (the layer in memory now) take the same call
        without an event for targets whose layers the engine tells
        (push_layer_load): the look for notifications and every plan
        target's writes in one call, not the drain's two engine calls and
        the per-target Python path per layer (issue 31: save_kv_layer was
        1.27 ms of the prefill's 2.05 ms of hooks per push step on the CPU
        VM); on the same-host CPU path the call only queues the layer for
        the engine's gate thread, which copies it and has the 'layer' note
        sent once it landed (run 29: the copy was ~0.25 ms of each save on
        the forward thread).  False: not taken (no such path, or a notification waits: the
        caller drains it and calls again or layer_done)."""
        fast = self._fast
        if fast is None:
            fast = self._fast = self._fast_gate()
        if not fast or self._gate_failed is not None:
            return False
        try:
            li = self._layer_index[layer_name]
        except KeyError:
            return False
        dev, cpu = self._gdev, self._cpu
        try:
            with self.lock:
                gp = self._gplan
                if gp is not None:
                    for job in gp[2]:
                        if li in (job.ready if cpu else job.queued):  # a layer saved again
                            gp = None
                            break
                if gp is None:  # a lock holder set it None, or the layer came again
                    gp = self._gplan = self._gate_plan(li)
                plan, who, live, rest = gp
                r = self.w.engine.gate_layer(li, plan, self._stream(dev), dev,
                                             PUSH_MARGIN_S, RESEND_TIMEOUT_S)
                if r is None or plan is None:
                    return r is not None  # None: a notification waits, drained first
                if trace.ON:
                    for job in live:
                        trace.event("layer_saved", job.tid, li=li)
                ev, ids = r
                lis, qev = {li}, (None, ev, dev)
                if cpu:  # in memory now (a target arriving later in this forward gets it)
                    for job in live:
                        job.ready |= lis
                else:
                    for job in live:
                        job.queued |= lis
                        job.qev = qev
                # what _submit_gated notes after a submit, in operators (no
                # call per target; the plan's targets stay caught up)
                for k, job, tg in who:
                    bid = ids[k]
                    if bid is None:  # not taken: the per-target path says why
                        rest = True
                        continue
                    tg.layers_sent |= lis
                    tg.state = "writing"
                    tg.batches += (bid,)
                    tg.blayers[bid] = [li]
                    if tg.lnotify:
                        tg.told |= lis  # the engine tells it once it landed
                    job.bytes += tg.gbytes[li]
                    if trace.ON:
                        trace.event("write_issued", job.tid, l=[li], bytes=tg.gbytes[li],
                                    gated=True)
                if rest:  # targets the plan left to the per-target path
                    self._gplan = None
                    for job in live:
                        if job.layerwise and not job.all_ready:
                            if cpu:
                                self._submit_ready(job)
                                continue
                            for tg in list(job.targets.values()):
                                self._submit_gated(job, tg)
        except Exception as e:  # noqa: BLE001 - an event error: the layer-event path
            self._gplan = None
            self._gate_fail(f"the gate's layer call failed: {e}")
            return False
        return True

    def _gate_plan(self, li=-1):
        """gate_layer's plan before layer li: (plan, who, live, rest).  live:
        the jobs whose prompt is being computed; plan (None without any): per
        open target of a layerwise one that has every queued layer but li
        and its arrays built, the plain tuple Engine.gate_layer takes (name,
        lease_until, per-layer arrays, per-layer "layer" messages or None);
        who: (index in plan, job, target); rest: another open target waits
        (arrays not built, layers behind): the per-target path looks.  Built
        as each other holder of the lock lets it go (_locked; the others set
        None: built in the save), kept while only gate_layer takes the lock
        (its targets stay caught up).  CPU KV caches: the layers computed
        (job.ready) stand for the queued ones, and only targets whose
        layers the engine tells (lnotify, _engine_tells) are in the plan."""
        live, plan, who, rest = (), (), (), False
        cpu = self._cpu
        for job in self.jobs.values():
            if job.all_ready:
                continue
            live += (job,)
            if not job.layerwise or not job.targets:
                continue
            done = (job.ready if cpu else job.queued) - {li}
            tells = not cpu or self._engine_tells(job)
            for tg in job.targets.values():
                if getattr(tg, "read", False) and tg.state in ("pending", "lent"):
                    rest = True  # layer read: announced by the per-target path (_submit)
                    continue
                if tg.state not in ("pending", "writing") or tg.cancel or tg.stop:
                    continue
                if tg.garr is None or li in tg.layers_sent or tg.layers_sent != done or \
                        (cpu and not (tells and tg.lnotify)):
                    rest = True
                    continue
                who += ((len(plan), job, tg),)
                plan += ((tg.name, tg.lease_until, tg.garr, tg.gnote if tg.lnotify else None),)
        return (plan if live else None), who, live, rest

    def layer_done(self, layer_name):
        """vLLM's forward thread, after each layer's attention."""
        li = self._layer_index.get(layer_name)
        if li is None:
            return
        if self.w.cuda_sync is not None and self.streams:
            if not (self._gate_on() and self._layer_gated(li)):
                self._layer_queued(li)
            return
        with self.lock:
            if trace.ON:
                for job in self.jobs.values():
                    if not job.all_ready:
                        trace.event("layer_saved", job.tid, li=li)
            self._gplan = None
            cpu = self.w.cuda_sync is None  # on CPU the layer's KV is in memory now
            for job in self.jobs.values():
                if cpu and not job.all_ready:
                    job.ready.add(li)  # (a target arriving later in this forward gets it)
                if job.layerwise and not job.all_ready:
                    self._submit_ready(job)

    def _submit_ready(self, job):
        """CPU, layer by layer: each target of the job gets the layers
        computed and not sent yet (the per-target path), and, where no
        engine tells them, the earlier layers that landed."""
        told = self._engine_tells(job)
        for tg in list(job.targets.values()):
            self._submit(job, tg)
            if tg.lnotify and tg.batches and not told:
                self._poll_batches(tg, job)  # earlier layers landed: say so

    def _gate_on(self):
        """CUDA layer by layer through the engine's gate: each layer's
        writes handed over at once with the layer's CUDA event."""
        return (self.w.cuda_sync is not None and self.streams and self._gate_failed is None
                and bool(getattr(self.w.s, "push_layer_gate", True))
                and hasattr(self.w.engine, "batch_transfer_async_write_gated"))

    def _engine_tells(self, job):
        """Layer load: the engine sends the decode a layer's 'layer'
        notification itself once that layer's writes landed (the write
        batch carries it; the engine's notifier thread sends it, no GIL):
        CUDA through the gate (_gate_on); CPU KV caches too (a layer's KV is
        in memory at its save_kv_layer, so the batch needs no event) for
        jobs the landing thread would otherwise watch (push_layer_watch), so
        no Python thread (the landing thread, the outbox's) wakes per layer
        on the prefill's host and takes the GIL from its forward thread
        (issue 31: CPU per request on small hosts).  push_layer_gate false:
        the landing thread and the outbox as before."""
        if self._gate_on():
            return True
        return (self.w.cuda_sync is None and job.watch and self._gate_failed is None
                and bool(getattr(self.w.s, "push_layer_gate", True))
                and hasattr(self.w.engine, "batch_transfer_async_write_gated"))

    def _gate_fail(self, why):
        if self._gate_failed is None:
            self._gate_failed = str(why)
            if self._cpu:  # CPU KV caches: Engine.gate_layer without an event failed
                logger.warning("MooncakeConnector push: the engine's layer call is off (%s); "
                               "layers go through the per-target path and the landing "
                               "thread from now on", why)
                return
            logger.warning("MooncakeConnector push: the engine's CUDA gate is off (%s); "
                           "layers go through the layer-event thread from now on", why)

    def _layer_gated(self, li):
        """vLLM's forward thread, CUDA, layer li's kernels queued: one event
        recorded on the current stream, and for every target one engine call
        with its pre-built arrays, the event and (push_layer_load) the
        encoded "layer" notification; the engine's gate thread starts the
        writes once the event completed and its notifier tells the decode
        once they landed.  No Python thread is woken.  False: the gate is
        off (event error): the caller takes the layer-event path."""
        live = [job for job in list(self.jobs.values()) if not job.all_ready]
        if not live:
            return True
        try:
            ev = self._gate_event()
        except Exception as e:  # noqa: BLE001 - any event error: the fallback path
            self._gate_fail(f"recording a CUDA event failed: {e}")
            return False
        with self.lock:
            self._gplan = None
            if trace.ON:
                for job in live:
                    trace.event("layer_saved", job.tid, li=li)
            for job in live:
                if job.all_ready or self.jobs.get(job.tid) is not job:
                    continue
                job.queued.add(li)
                job.qev = ev
                if job.layerwise:
                    for tg in job.targets.values():
                        self._submit_gated(job, tg)
        return True

    def _gate_arrays(self, job, tg):
        """The target's per-layer (src, dst, len) arrays and each layer's
        bytes (tg.gbytes), built once (the checks of _submit) in one C pass
        (_core.gate_arrays: the target often arrives inside the forward, a
        layer's save drains it, and a Python loop over blocks x extents cost
        the H200's forward thread ~1 ms at 1966 tokens, run 21); None when
        the target cannot be written (tg.stop says why).  Ids out of range
        raise LayoutError, as _collect's layer_extents does."""
        if tg.garr is not None:
            return tg.garr
        rows = job.spec.block_ids if not job.spec.more_groups else \
            list(zip(job.spec.block_ids, *job.spec.more_groups))
        if tg.skip + tg.nblocks > len(rows):
            tg.stop = (f"the decode side asks for blocks {tg.skip}..{tg.skip + tg.nblocks - 1}; "
                       f"this prefill holds {len(rows)}")
            return None
        from mooncake_connector import _core
        rows = rows[tg.skip:tg.skip + tg.nblocks]
        lay = self.w.layout
        if self._gate_spec is None:  # the layers' geometry, plain
            self._gate_spec = tuple(
                (k0, nk, L.base, L.group, L.block_stride, L.block_bytes, array("Q", L.outer))
                for (k0, nk), L in zip(self._layer_off, lay.layers))
        try:  # one id per row (ints): no Python step per block
            ids = array("Q", rows) if lay.num_groups == 1 else None
        except (OverflowError, TypeError):  # rows of ids, or ids _row names
            ids = None
        if ids is None:
            ids = array("Q", [b for r in rows for b in lay._row(r)])
        per, gbytes = _core.gate_arrays(ids, tg.dest, lay.extents_per_block, lay.num_groups,
                                        self._gate_spec, lay.num_blocks)
        if per is None:  # the first extent that asks for more bytes than this side's
            tg.stop = _extent_too_long(*gbytes)
            return None
        tg.gbytes = gbytes
        if tg.lnotify:  # each layer's own "layer" message, encoded once
            tg.gnote = _layer_notes(job.tid, len(per))
        tg.garr = per
        return per

    def _collect(self, tg, rows, layers, out):
        """Appends the writes of these layers of the target's blocks (rows:
        this side's block rows for them, in order) to out(li) = (src, dst,
        lens), block by block, then layer, then extent.  False (tg.stop
        set) when an extent asks for more bytes than this side's holds."""
        lay = self.w.layout
        epb = lay.extents_per_block
        dest = tg.dest
        for b, row in enumerate(rows):
            for li in layers:
                src, dst, lens = out(li)
                # this layer's extents only: a layer's save costs O(blocks),
                # not O(blocks x layers) on the prefill's forward thread
                for k, (s_addr, s_len) in enumerate(lay.layer_extents(row, li),
                                                    self._layer_off[li][0]):
                    i = (b * epb + k) * 3
                    d_addr, n, s_off = dest[i], dest[i + 1], dest[i + 2]
                    if n == 0:
                        continue  # HMA: a null block on the consumer
                    if s_off + n > s_len:
                        tg.stop = _extent_too_long(k, b, n, s_off, s_len)
                        return False
                    src.append(s_addr + s_off)
                    dst.append(d_addr)
                    lens.append(n)
        return True

    @staticmethod
    def _unsent(tg, layers):
        """The layers of `layers` not sent to tg yet, in order; none also when
        tg's lease ends within PUSH_MARGIN_S (tg.stop then says so)."""
        todo = sorted(layers - tg.layers_sent)
        if todo and time.time() > tg.lease_until - PUSH_MARGIN_S:
            tg.stop = "the decode side's lease expired before the KV was written"
            return []
        return todo

    def _submit_gated(self, job, tg):
        """Hand the queued layers not sent yet to this target to the engine,
        gated on the latest layer's event (one stream: it covers the earlier
        layers).  A layer the gate does not take (busy) goes with the whole
        prompt after the forward (prompt_done)."""
        if tg.read:  # layer read: announced gated on the layer's event, nothing written
            if job.qev is not None:
                self._announce(job, tg, job.qev)
            return
        if tg.state not in ("pending", "writing") or tg.cancel or tg.stop or job.qev is None:
            return
        todo = self._unsent(tg, job.queued)
        if not todo:
            return
        per = self._gate_arrays(job, tg)
        if per is None:
            return
        src, dst, lens = _layers_of(per, todo)
        if not src:
            tg.layers_sent.update(todo)
            tg.state = "writing"
            tg.landed.update(todo)  # nothing to write (HMA null blocks): landed as is
            return
        _, handle, dev = job.qev
        note = _layer_note(job, tg, todo) if tg.lnotify else None
        from mooncake_connector import MooncakeError
        try:
            bid = self.w.engine.batch_transfer_async_write_gated(
                tg.name, src, dst, lens, cuda_event=handle, cuda_device=dev, notify=note,
                notify_timeout=tg.notify_timeout())
        except MooncakeError as e:
            if getattr(e, "code_name", None) == "MC_EBUSY":
                return  # the gate is full: these layers go after the forward
            if getattr(e, "code_name", None) == "MC_EUNAVAIL":
                self._gate_fail(e)
                return
            tg.stop = f"write to {tg.name} failed to start: {e}"
            return
        except ValueError as e:
            tg.stop = f"write to {tg.name} failed to start: {e}"
            return
        tg.layers_sent.update(todo)
        tg.state = "writing"
        tg.batches.append(bid)
        tg.blayers[bid] = todo
        if note is not None:
            tg.told.update(todo)  # the engine tells them once they landed
        nbytes = tg.gbytes[todo[0]] if len(todo) == 1 else sum(lens)
        job.bytes += nbytes
        if trace.ON:
            trace.event("write_issued", job.tid, l=todo, bytes=nbytes, gated=True)

    def _layer_queued(self, li):
        """CUDA, layer by layer: the layer's kernels are queued, not done;
        its writes start on the waiter's thread once its event completed
        (_layer_ready, which also tells the layers landed so far).  Without
        the producer's lock: the forward thread never waits while the
        waiter's or the landing thread submits or checks writes.  list() of
        the jobs is one step under the GIL; a job that ends meanwhile is
        skipped by _layer_ready."""
        live = [job for job in list(self.jobs.values()) if not job.all_ready]
        if not live:
            return
        if trace.ON:
            for job in live:
                trace.event("layer_saved", job.tid, li=li)
        waiter = self._waiter
        if waiter is None:
            with self.lock:
                if self._waiter is None:
                    from mooncake_connector.connector.layer_events import LayerWaiter
                    self._waiter = LayerWaiter(self._layer_ready)
                waiter = self._waiter
        waiter.record(li, live)

    @_locked
    def _layer_ready(self, li, jobs):
        """The waiter's thread: layer li's KV of these jobs is in memory."""
        for job in jobs:
            if job.all_ready or self.jobs.get(job.tid) is not job:
                continue  # written with the whole prompt, or over (cancelled, ended)
            job.ready.add(li)
            if job.layerwise:
                for tg in job.targets.values():
                    self._submit(job, tg)
                    if tg.lnotify and tg.batches:
                        self._poll_batches(tg, job)

    def _check_layer_writes(self, watched):
        """One look at the writes of targets whose decode attention waits
        per layer (of jobs with push_layer_watch on or off), telling the
        layers that landed; a write still in flight (the oldest of the
        first target that has one), or None."""
        pending = None
        wall = time.time()
        with self.lock:  # not while waiting: the other threads may go on
            self._gplan = None
            for job in self.jobs.values():
                if job.watch != watched:
                    continue
                for tg in job.targets.values():
                    if tg.lnotify and tg.batches and not tg.stop and not tg.cancel and \
                            wall < tg.lease_until - PUSH_MARGIN_S:
                        if not self._poll_batches(tg, job) and pending is None:
                            pending = tg.batches[0]
        return pending

    def _wait_write(self, bid, timeout):
        """Block (GIL released, the batch's condition variable) until this
        write is over or timeout seconds passed."""
        try:
            self.w.engine.transfer_wait(bid, min(timeout, 60.0))
        except ValueError:
            pass  # another thread's check took it: it is over

    wait_write = _wait_write

    @_locked
    def write_in_flight(self):
        """The oldest write of any target not reaped yet (a batch id), or
        None (publishes.py: what an idle step waits on)."""
        for job in self.jobs.values():
            for tg in job.targets.values():
                if tg.batches:
                    return tg.batches[0]
        return None

    def flush_layers(self):
        """After the forward (wait_for_save), jobs without the landing
        thread (push_layer_watch false): wait (GIL released, bounded) for
        the writes of targets whose decode attention waits per layer,
        telling each layer as it lands, so the last layer does not wait for
        this instance's next step.  The landing thread tells the others."""
        cap = time.monotonic() + 1.0
        while True:
            bid = self._check_layer_writes(False)
            left = cap - time.monotonic()
            if bid is None or left < 0:
                return
            self._wait_write(bid, min(left, 0.02))

    def _watch_landing(self):
        """Layer load: a write of a watched job started; the landing thread
        tells the decode as soon as it lands (landing.py)."""
        if self._landing is None:
            from mooncake_connector.connector.landing import LandingWatcher
            self._landing = LandingWatcher(lambda: self._check_layer_writes(True),
                                           self._wait_write)
        self._landing.kick()

    @_locked
    def gated_through(self, rid):
        """Whether this request's push needs no stream synchronize after its
        forward (publishes.publish): CUDA through the engine's gate, every
        layer's kernels queued with an event (job.qev: the last one's) and
        every open target handed every layer, gated on those events; it is
        not published for a pull too.  A target arriving later is gated on
        the last layer's event (_submit).  The synchronize held vLLM's
        forward thread until the GPU finished the forward before it could
        queue the logits and the sampler (issue 31: the push's cost on the
        prefill outside save_kv_layer)."""
        job = self.jobs.get(self.by_rid.get(rid))
        if job is None or job.all_ready or job.qev is None or \
                not self._gate_on() or (job.optional and not job.targets):
            return False
        nl = len(self._layer_off)
        if len(job.queued) != nl:
            return False
        return all(len(tg.layers_sent) == nl for tg in job.targets.values()
                   if tg.state in ("pending", "writing") and not tg.cancel and not tg.stop)

    @_locked
    def prompt_done(self, rid, synced=True):
        """The prompt's forward is queued (synced: and done, the stream was
        synchronized; else gated_through said its writes need no wait)."""
        tid = self.by_rid.get(rid)
        job = self.jobs.get(tid)
        if job is None:
            return
        job.all_ready = True
        job.unsynced = not synced and job.qev is not None
        job.ready = set(range(len(self._layer_off)))
        for tg in job.targets.values():
            self._submit(job, tg)

    def _submit(self, job, tg):
        """WRITE the layers that are ready and not sent yet to this target."""
        if tg.read:
            if job.unsynced and job.qev is not None:
                # prompt_done without a synchronize (gated_through): the last
                # layers' kernels may still run; their announcements go
                # gated on the last layer's event (the engine's gate) ...
                self._announce(job, tg, job.qev)
            if job.unsynced and tg.state in ("pending", "lent") and not (tg.cancel or tg.stop) \
                    and job.ready - tg.layers_sent:
                # ... or, not taken, the decode would READ them at once: wait
                # for the GPU here (as the write path does when its gate is full).
                self.w.cuda_sync()
                job.unsynced = False
            self._announce(job, tg)
            return
        if tg.state not in ("pending", "writing") or tg.cancel or tg.stop:
            return
        todo = self._unsent(tg, job.ready)
        if not todo:
            return
        if job.unsynced:
            # No synchronize after the forward (gated_through): the KV is
            # complete once the last layer's event is; the writes wait for it
            # in the engine's gate.  Not taken (the gate full): wait here.
            self._submit_gated(job, tg)
            if tg.stop or tg.state not in ("pending", "writing") or \
                    not (job.ready - tg.layers_sent):
                return
            self.w.cuda_sync()
            job.unsynced = False
            todo = sorted(job.ready - tg.layers_sent)
        # The engine tells the decode these layers once they landed (CUDA
        # gate on: the stream was synchronized, no event; CPU KV caches: in
        # memory already), not the landing thread and the outbox.
        gate = tg.lnotify and self._engine_tells(job)
        if gate:
            # the target's per-layer arrays and "layer" messages, built once
            # (with _submit's checks): a layer's save_kv_layer costs the
            # forward thread one engine call, not a Python loop over blocks
            per = self._gate_arrays(job, tg)
            if per is None:
                return
            src, dst, lens = _layers_of(per, todo)
        else:
            rows = job.spec.block_ids if not job.spec.more_groups else \
                list(zip(job.spec.block_ids, *job.spec.more_groups))
            if tg.skip + tg.nblocks > len(rows):
                tg.stop = (f"the decode side asks for blocks {tg.skip}.."
                           f"{tg.skip + tg.nblocks - 1}; this prefill holds {len(rows)}")
                return
            src, dst, lens = [], [], []
            out = (src, dst, lens)
            if not self._collect(tg, rows[tg.skip:tg.skip + tg.nblocks], todo, lambda li: out):
                return
        # The whole prompt in one batch (its forward done, nothing of it sent
        # before): the batch carries this target's "done", which the engine's
        # notifier sends the moment every write of it completed, not at this
        # prefill's next poll (a step or more later: under vLLM's async
        # scheduling one idle iteration and its 1 ms sleep; issue 31).  poll()
        # still answers "done" when it sees the batch over (a duplicate the
        # decode ignores; the reliable one, re-sent until the lease's end).
        done_note = None
        if not gate and not tg.lnotify and job.all_ready and not tg.layers_sent \
                and len(todo) == len(self._layer_off) and \
                hasattr(self.w.engine, "batch_transfer_async_write_gated"):
            done_note = encode({"t": "done", "tid": job.tid, "ntok": tg.ntok})
        tg.layers_sent.update(todo)
        tg.state = "writing"
        if not src:
            tg.landed.update(todo)  # nothing to write (HMA null blocks): landed as is
            return
        from mooncake_connector import MooncakeError
        try:
            bid = None
            if done_note is not None:
                bid = self._write_telling_done(job, tg, src, dst, lens, done_note)
                if bid is None:  # the engine cannot send it: poll() tells "done"
                    done_note = None
            elif gate:
                bid = self.w.engine.batch_transfer_async_write_gated(
                    tg.name, src, dst, lens,
                    notify=_layer_note(job, tg, todo),
                    notify_timeout=tg.notify_timeout())
                tg.told.update(todo)
            if bid is None:
                bid = self.w.engine.batch_transfer_async_write(tg.name, src, dst, lens)
            tg.batches.append(bid)
            tg.blayers[bid] = todo
            if trace.ON:
                trace.event("write_issued", job.tid, l=todo, bytes=sum(lens),
                            done=done_note is not None)
            if tg.lnotify and job.watch and not gate:
                self._watch_landing()
        except (MooncakeError, ValueError) as e:
            tg.stop = f"write to {tg.name} failed to start: {e}"
            return
        job.bytes += sum(lens)

    def _send_src(self, job, tg):
        """Layer read: where the target's layers are in this side's memory:
        per layer the (src, dst, len) arrays _gate_arrays builds (the same
        checks as a write's), in one "src" message; the decode checks every
        (dst, len) against the extents it sent and READs them itself."""
        per = self._gate_arrays(job, tg)
        if per is None:
            return False
        self._read_send(job, tg, self._src_msg(job, tg, per))
        return True

    @staticmethod
    def _src_msg(job, tg, per):
        body = bytearray()
        for src, dst, lens in per:
            body += src.tobytes() + dst.tobytes() + lens.tobytes()
        return encode({"t": "src", "tid": job.tid, "cnt": [len(x[0]) for x in per],
                       "keep_s": round(tg.keep_until - time.monotonic(), 3)}, bytes(body))

    def _announce(self, job, tg, qev=None):
        """Layer read: the first time, the "src" message; then each layer
        computed and not announced yet, in one "layer" note (rd: nothing of
        it is written, the decode reads it).  qev (CUDA, the gate: the
        latest queued layer's event): the layers queued, announced by the
        engine once that event completed; not taken, they wait for
        prompt_done (after a synchronize).  Nothing is announced in the
        lease's last PUSH_MARGIN_S (the decode starts no read then; a note
        the engine still holds then is dropped, send_by)."""
        if tg.cancel or tg.stop or tg.rdone or tg.state not in ("pending", "lent"):
            return
        if tg.state == "pending":
            if not self._send_src(job, tg):
                return  # tg.stop says why; poll() answers nokv
            tg.state = "lent"
        todo = sorted((job.ready if qev is None else job.queued) - tg.layers_sent)
        if not todo or time.monotonic() > tg.keep_until - PUSH_MARGIN_S:
            return
        msg = encode({"t": "layer", "tid": job.tid, "l": todo, "rd": True})
        if not self._read_send(job, tg, msg, qev):
            return  # kernels maybe still running: not through the outbox
        tg.layers_sent.update(todo)
        tg.told.update(todo)
        if trace.ON:
            trace.event("layer_announced", job.tid, l=todo, gated=bool(tg.rgate))

    def _read_gate_on(self):
        """Layer read: announcements go through the engine's gate FIFO
        (Engine.notify_gated: the engine's notifier thread sends them, no
        Python thread is woken, so vLLM's busy forward thread does not
        delay them by the interpreter's switch interval): the same switch
        and conditions as the write path's gate (push_layer_gate; CUDA:
        _gate_on)."""
        return (self._gate_failed is None and bool(getattr(self.w.s, "push_layer_gate", True))
                and hasattr(self.w.engine, "notify_gated")
                and (self.w.cuda_sync is None or self._gate_on()))

    def _read_send(self, job, tg, msg, qev=None):
        """One layer-read announcement to tg, in order with the earlier
        ones: through the engine's gate FIFO when it takes it (gated on
        qev's CUDA event if given), else the outbox.  After a refusal every
        later one goes through the outbox, and if some went through the
        gate the "src" message goes first again (a "layer" note before
        "src" would make the decode treat this side as a writer; it
        ignores the duplicate).  False: qev given and the gate did not
        take it (the caller announces it later, synchronized)."""
        if tg.rgate is not False and self._read_gate_on():
            from mooncake_connector import MooncakeError
            handle, dev = (qev[1], qev[2]) if qev is not None else (0, 0)
            send_by = time.time() + (tg.keep_until - PUSH_MARGIN_S - time.monotonic())
            try:
                self.w.engine.notify_gated(tg.name, msg, cuda_event=handle, cuda_device=dev,
                                           timeout=tg.notify_timeout(), send_by=send_by)
                tg.rgate = True
                tg.rtold_at = time.monotonic()
                return True
            except (MooncakeError, ValueError) as e:
                logger.info("MooncakeConnector push: layer read to %s: announcements through "
                            "the outbox from now on (the engine's gate: %s)", tg.name, e)
                if tg.rgate:
                    self.w.push_outbox.send(tg.name, self._src_msg(job, tg, tg.garr))
                tg.rgate = False
        if qev is not None:
            return False
        self.w.push_outbox.send(tg.name, msg)
        return True

    def _reannounce(self, job, tg, now):
        """Layer read: "src" and the layers computed and told (not those
        the engine's gate still holds for their CUDA event) again, both
        through the outbox, "src" first (a "layer" note before it makes the
        decode take this side as a writer; it ignores duplicates).  "src"
        only while none sent so was delivered and none is on its way (its
        receipt: the decode's engine took it, so the decode has it); the
        "layer" note every time (the decode's stall bound counts from its
        last one).  poll(): no "rdone" READ_REANNOUNCE_S after the last
        announcement the gate took; _repeat: the decode sent its target
        again."""
        tg.rtold_at = now
        lis = sorted(tg.layers_sent & job.ready) if not job.unsynced else []
        key = ("rsrc", job.tid, tg.name)
        if tg.rsrc_sent == "sent":
            res = self.w.push_outbox.take(key)
            if res != "pending":
                tg.rsrc_sent = "ok" if res is None else None
        if tg.rsrc_sent is None:
            tg.rsrc_sent = "sent"
            self.w.push_outbox.send(tg.name, self._src_msg(job, tg, tg.garr), key=key)
        if lis:
            self.w.push_outbox.send(tg.name, encode({"t": "layer", "tid": job.tid, "l": lis,
                                                     "rd": True}))
        if trace.ON:
            trace.event("layer_reannounced", job.tid, l=lis)

    def _write_telling_done(self, job, tg, src, dst, lens, done_note):
        """The whole prompt's writes, submitted with the "done" note the
        engine's notifier sends at their completion: the batch id, or None
        when only the note cannot be carried (the engine's notifier thread
        could not start: out of memory or threads), for a plain write in its
        place.  Any other error (the target gone, a bad address) is the
        write's own and is raised as it is, not tried a second time."""
        try:
            return self.w.engine.batch_transfer_async_write_gated(
                tg.name, src, dst, lens, notify=done_note,
                notify_timeout=tg.notify_timeout())
        except MemoryError as e:
            logger.info("MooncakeConnector push: %s -> %s: the engine cannot send \"done\" "
                        "itself (%s); sent when the writes are seen over", job.rid, tg.name,
                        e or "its notifier thread did not start")
            return None

    def _poll_batches(self, tg, job=None):
        """True once no batch of this target is in flight; failures noted;
        a target with lnotify is told the layers that landed."""
        left = []
        for bid in tg.batches:
            r = self.w.engine.transfer_check_status(bid)
            layers = tg.blayers.pop(bid, ()) if r != 0 else ()
            if r == 0:
                left.append(bid)
            elif r < 0 and not tg.stop:
                tg.stop = "a write to the decode side failed" + (" (timed out)" if r == -2
                                                                  else "")
            elif r > 0:
                tg.landed.update(layers)
                # (layers the engine told itself: seen here only at a later
                # check, not when they landed; the decode's c_recv says that)
                if trace.ON and job is not None and not tg.told.issuperset(layers):
                    trace.event("write_seen_landed", job.tid, l=list(layers))
        tg.batches = left
        if tg.lnotify and job is not None and not tg.stop and not tg.landed <= tg.told:
            tg.told |= tg.landed
            self._reply(tg.name, job.tid, "layer", l=sorted(tg.landed))
        return not left

    def _cancel_batches(self, tg):
        """Cancels this target's writes; returns once no I/O thread of this
        engine can touch them (the engine's batch wait with timeout 0)."""
        if tg.batches:
            try:
                self.w.engine.get_batch_transfer_status(tg.batches, timeout=0)
            except Exception:  # noqa: BLE001 - a canceled batch raises; that is the point
                pass
            tg.batches = []
            tg.blayers.clear()

    def _count_engine_paths(self):
        """Which path the writes took (the engine's counters since the last
        call, added when a target ends): bytes written through the same-host
        CPU path (push_bytes_same_host_cpu; only pushes WRITE from a producer)
        and the layer batches the engine's gate thread submitted on it
        (push_gate_host_batches)."""
        try:
            st = self.w.engine.get_stats()
        except Exception:  # noqa: BLE001 - no engine (closed, a stand-in): nothing to count
            return
        for key, stat in (("push_bytes_same_host_cpu", "same_host_cpu_bytes_written"),
                          ("push_gate_host_batches", "gate_host_batches")):
            now = int(st.get(stat, 0) or 0)
            last, self._eng_seen[stat] = self._eng_seen.get(stat, 0), now
            if now > last:
                self.w.stats.add(key, now - last)

    def _end(self, job, tg, state, why=None):
        tg.state, tg.why = state, why
        self._forget_rsrc(job, tg)
        until = tg.lease_until + PUSH_GRACE_S
        self._count_engine_paths()
        if state == "done":
            self._reply(tg.name, job.tid, "done", ntok=tg.ntok, retry_until=until)
            self.w.stats.add("push_sends")
            self.w.stats.add("push_bytes", tg.nblocks * self.w.layout.bytes_per_block())
        else:
            if state == "nokv":
                logger.warning("MooncakeConnector push: request %s -> %s: nothing more is "
                               "written (%s)", job.rid, tg.name, why)
                self.w.stats.add("push_failed")
            self._reply(tg.name, job.tid, state, why, retry_until=until)

    def _forget_rsrc(self, job, tg):
        """A re-sent "src" still on its way: nobody takes its receipt."""
        if getattr(tg, "rsrc_sent", None) == "sent":
            tg.rsrc_sent = None
            self.w.push_outbox.forget(("rsrc", job.tid, tg.name))

    def _ended_due(self, now=None):
        """The oldest ended transfer id is to be forgotten (ENDED_KEEP_S), or
        too many are kept.  Ended ones are kept in the order they ended."""
        ended = self.ended
        if not ended:
            return False
        if len(ended) > 65536:
            return True
        at = ended[next(iter(ended))]
        return (time.monotonic() if now is None else now) - at > ENDED_KEEP_S

    def _end_tid(self, tid, now):
        """tid is over: kept (answered "nokv" to a late target) ENDED_KEEP_S,
        in the order they ended."""
        self.ended.pop(tid, None)
        self.ended[tid] = now

    @_locked
    def poll(self):
        """Advance every job; returns the req ids whose push is over (their
        blocks may be freed once vLLM finished them)."""
        over = set()
        now, wall = time.monotonic(), time.time()
        nl = len(self._layer_off)
        for tid, job in list(self.jobs.items()):
            timed_out = now - job.t0 > self.w.s.hold_timeout_s
            for tg in job.targets.values():
                if tg.state in ("done", "nokv", "cancelled"):
                    continue
                if getattr(tg, "read", False) and not tg.batches:
                    # Layer read: our blocks are lent (nothing is written by us)
                    # until the decode read them all, cancels, or keep_until.
                    if tg.cancel:
                        self._end(job, tg, "cancelled")
                    elif tg.rdone:
                        self._end(job, tg, "done")
                    elif tg.stop:
                        self._end(job, tg, "nokv", tg.stop)
                    elif now >= tg.keep_until:
                        self._end(job, tg, "nokv", tg.keep_why)
                    elif tg.rgate and tg.garr is not None and \
                            now - tg.rtold_at > READ_REANNOUNCE_S and \
                            now < tg.keep_until - PUSH_MARGIN_S:
                        self._reannounce(job, tg, now)
                    continue
                if tg.batches and (tg.cancel or timed_out or
                                   wall > tg.lease_until - PUSH_MARGIN_S / 2):
                    if not tg.cancel and not tg.stop:
                        tg.stop = ("hold_timeout_s passed" if timed_out else
                                   "the decode side's lease expired while writing")
                    self._cancel_batches(tg)
                if not self._poll_batches(tg, job):
                    continue
                if tg.stop:
                    self._end(job, tg, "nokv", tg.stop)
                elif tg.cancel:
                    self._end(job, tg, "cancelled")
                elif job.all_ready and len(tg.layers_sent) == nl:
                    self._end(job, tg, "done")
                elif timed_out or wall > tg.lease_until - PUSH_MARGIN_S:
                    self._end(job, tg, "nokv", "hold_timeout_s passed" if timed_out else
                              "the decode side's lease expired before the KV was computed")
            if job.optional and not job.targets:
                continue  # a pull may take it: the lookup buffer's hold rules
            served = sum(1 for tg in job.targets.values()
                         if tg.state in ("done", "nokv", "cancelled"))
            if served >= job.expected or (timed_out and served == len(job.targets)):
                del self.jobs[tid]
                self.by_rid.pop(job.rid, None)
                self._end_tid(tid, now)
                over.add(job.rid)
        # early targets whose lease ran out: forget (the consumer gives up itself)
        if self.early:
            for tid in [t for t, d in self.early.items()
                        if all(wall > tg.lease_until for tg in d.values())]:
                for tg in self.early.pop(tid).values():
                    self._early_bytes -= 24 * len(tg.dest) // 3
        # the oldest first (kept in the order they ended): no scan of them all per step
        while self._ended_due(now):
            self.ended.pop(next(iter(self.ended)))
        if self.canceled:
            for tid in [t for t, (at, _) in self.canceled.items() if now - at > ENDED_KEEP_S]:
                del self.canceled[tid]
        return over

    @_locked
    def busy(self):
        return bool(self.jobs)

    @_locked
    def holds(self, rid):
        """The request's blocks are held for a push (not only for a pull)."""
        tid = self.by_rid.get(rid)
        job = self.jobs.get(tid)
        if job is None:
            return False
        if not job.optional or job.targets:
            return True
        # Published for a pull on another request's blocks (Publishes:
        # none of its own is referenced by the lookup buffer): its end is
        # not its entries' end, so it waits for a target, or a pull that
        # may take any entry of its prompt, until hold_timeout_s.
        return job.shared and time.monotonic() - job.t0 <= self.w.s.hold_timeout_s

    @_locked
    def shared(self, tid):
        """The optional job's lookup entry counts on another held request's
        blocks (the same prompt published before it): see holds()."""
        job = self.jobs.get(tid)
        if job is not None and job.optional:
            job.shared = True

    @_locked
    def has_targets(self, tid):
        job = self.jobs.get(tid)
        return job is not None and bool(job.targets)

    @_locked
    def forget(self, rid):
        """The worker freed the request's blocks (pulled, expired)."""
        tid = self.by_rid.pop(rid, None)
        job = self.jobs.pop(tid, None) if tid is not None else None
        if job is not None:
            for tg in job.targets.values():
                self._forget_rsrc(job, tg)
            self._end_tid(tid, time.monotonic())

    def close(self):
        if self._waiter is not None:
            self._waiter.close()  # before the lock: it may be handing a layer over
            self._waiter = None
        if self._landing is not None:
            self._landing.close()  # before the lock: it may be checking writes
            self._landing = None
        with self.lock:
            self._gplan = None
            for job in self.jobs.values():
                for tg in job.targets.values():
                    self._cancel_batches(tg)
            self.jobs.clear()
