"""The rest of Mooncake's Python ``TransferEngine`` API on our engine.

``mooncake_connector.TransferEngine`` is this module's ``TransferEngine``: the
C engine (``_core.TransferEngine``) plus the methods of Mooncake's binding
(``mooncake.engine.TransferEngine``) that are not in C, each with Mooncake's
argument order and meaning, raising an exception that says what went wrong
(``mooncake_connector.compat`` turns these into Mooncake's return codes).
docs/compat.md has the table.
"""
import collections
import ctypes
import ctypes.util
import enum
import json
import logging
import operator
import os
import socket
import struct
from typing import Any, List, Optional, Sequence

from mooncake_connector import json_in
from mooncake_connector import _core
from mooncake_connector.hostport import join_hostport

P2PHANDSHAKE = "P2PHANDSHAKE"
_log = logging.getLogger("mooncake_connector")

# Transport names Mooncake's binding accepts as transport_hint (its TENT
# build; the classic build ignores the hint).  Ours: advisory, like the
# classic build; an unknown name is refused as Mooncake's TENT build does.
TRANSPORT_HINTS = frozenset({"", "unspec", "rdma", "mnnvl", "shm", "nvlink", "gds", "io_uring",
                             "tcp", "ascend", "sunrise_link"})


class TransferOpcode(enum.IntEnum):
    """Mooncake's ``TransferOpcode`` (Read = 0, Write = 1), usable wherever
    an opcode int is taken."""
    Read = _core.OPCODE_READ
    Write = _core.OPCODE_WRITE


Read = TransferOpcode.Read
Write = TransferOpcode.Write


class TransferNotify:
    """Mooncake's ``TransferNotify(name, msg)``: the ``notify`` argument of
    ``transfer_sync`` / ``batch_transfer_sync``, and compat's
    ``get_notifies()`` items.  ``sender`` (ours, not Mooncake's) is the
    segment the notification came from, as our engine authenticated it;
    ``name`` is what the sender put in its ``TransferNotify``."""
    __slots__ = ("name", "msg", "sender")

    def __init__(self, name: str = "", msg: Any = "", sender: Optional[str] = None):
        self.name = name
        self.msg = msg
        self.sender = sender

    def __repr__(self):
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"


class Notify(collections.namedtuple("Notify", ["name", "msg"])):
    """get_notifies() items: still (name, message) tuples, with .name /
    .msg; ``.sender`` is the sending segment (for a notification sent with
    Mooncake's ``notify=TransferNotify(name, msg)``, ``name`` is that name)."""

    def __new__(cls, name, msg, sender=None):
        self = super().__new__(cls, name, msg)
        self.sender = name if sender is None else sender
        return self


# Mooncake's notify carries (name, msg) as the sender chose them; ours names
# a notification's sender from the connection.  transfer_sync(notify=...)
# sends this envelope as the NOTIFY body (docs/protocol.md): u32 magic
# "MKNT", u8 version 1, u8 0, u16 name length (little-endian), the name
# (UTF-8), then the message.  get_notifies() unwraps it.
NOTIFY_MAGIC = b"MKNT"
_NOTIFY_HDR = struct.Struct("<4sBBH")


def _notify_envelope(notify: "TransferNotify") -> bytes:
    name, msg = notify.name, notify.msg
    if not isinstance(name, str):
        raise TypeError(f"TransferNotify.name must be a str, got {type(name).__name__}")
    if isinstance(msg, str):
        msg = msg.encode("utf-8")
    elif isinstance(msg, (bytes, bytearray, memoryview)):
        msg = bytes(msg)
    else:
        raise TypeError(f"TransferNotify.msg must be a str or bytes, got {type(msg).__name__}")
    raw = name.encode("utf-8")
    if len(raw) > 0xFFFF:
        raise ValueError(f"TransferNotify.name is {len(raw)} bytes; at most 65535")
    return _NOTIFY_HDR.pack(NOTIFY_MAGIC, 1, 0, len(raw)) + raw + msg


def _notify_unwrap(sender: str, body: bytes) -> "Notify":
    """A received NOTIFY body as a Notify: the envelope's (name, msg), or
    (sender, body) for a plain send_notify()."""
    if body[:4] != NOTIFY_MAGIC:
        return Notify(sender, body)
    if len(body) >= _NOTIFY_HDR.size:
        _, ver, _, n = _NOTIFY_HDR.unpack_from(body)
        if ver == 1 and len(body) >= _NOTIFY_HDR.size + n:
            try:
                name = body[_NOTIFY_HDR.size:_NOTIFY_HDR.size + n].decode("utf-8")
            except UnicodeDecodeError:
                name = None
            if name is not None:
                return Notify(name, body[_NOTIFY_HDR.size + n:], sender)
    _log.warning("notification from %s starts with the notify envelope's magic %r but is "
                 "not a valid envelope (version 1, name length within the body, UTF-8 "
                 "name); delivered as is, named by its sender", sender, NOTIFY_MAGIC)
    return Notify(sender, body)


def _check_hint(transport_hint) -> None:
    if transport_hint is None:
        return
    if not isinstance(transport_hint, str):
        raise TypeError(f"transport_hint must be a str, got {type(transport_hint).__name__}")
    if transport_hint not in TRANSPORT_HINTS:
        raise ValueError(f"unknown transport_hint {transport_hint!r} (valid: "
                         f"{', '.join(sorted(h for h in TRANSPORT_HINTS if h))}, or '' for none)")


def _hinted(method, base):
    """method (Mooncake's signature, a trailing transport_hint) named and
    documented as the base class's method it calls."""
    method.__name__ = base.__name__
    method.__qualname__ = "TransferEngine." + base.__name__
    method.__doc__ = base.__doc__
    return method


def _hinted_one(base):
    """A one-buffer transfer of _core.TransferEngine with Mooncake's trailing
    transport_hint: checked (_check_hint), not passed on."""
    def one(self, target_hostname, buffer, peer_buffer_address, length, transport_hint=""):
        _check_hint(transport_hint)
        return base(self, target_hostname, buffer, peer_buffer_address, length)
    return _hinted(one, base)


def _hinted_batch(base):
    """A batch transfer of _core.TransferEngine with Mooncake's trailing
    transport_hint: checked (_check_hint), not passed on."""
    def batch(self, target_hostname, buffers, peer_buffer_addresses, lengths,
              transport_hint=""):
        _check_hint(transport_hint)
        return base(self, target_hostname, buffers, peer_buffer_addresses, lengths)
    return _hinted(batch, base)


def _key_prefix() -> str:
    cid = os.environ.get("MC_METADATA_CLUSTER_ID", "")
    return f"mooncake/{cid.rstrip('/')}/" if cid else "mooncake/"


def _cuda():
    """libcuda (driver API) or None."""
    name = ctypes.util.find_library("cuda") or "libcuda.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    return lib if lib.cuInit(0) == 0 else None


def _opcode(opcode) -> int:
    """TransferOpcode.Read / .Write (0 / 1), or an integer 0 / 1, as an int;
    anything else is refused naming the argument (int() took 1.9 and "1" as
    WRITE, and answered "write" with "invalid literal for int()")."""
    try:
        v = None if isinstance(opcode, bool) else operator.index(opcode)
    except TypeError:
        v = None
    if v in (0, 1):
        return v
    raise (TypeError if v is None else ValueError)(
        f"opcode must be TransferOpcode.Read (0) or TransferOpcode.Write (1), not {opcode!r}")


def _check_notify(notify) -> Optional[bytes]:
    if notify is None:
        return None
    if not isinstance(notify, TransferNotify):
        raise TypeError("notify must be a TransferNotify(name, msg)")
    return _notify_envelope(notify)


class TransferEngine(_core.TransferEngine):
    """Our engine with Mooncake's whole Python API (exceptions on failure)."""

    _metadata_conn = None

    # ---- set-up ----
    def initialize(self, local_hostname, metadata_server, protocol="tcp", device_name="",
                   *args, **kwargs):
        """Mooncake's initialize.  ``MC_FORCE_TCP`` set (to anything non-empty)
        makes it use TCP whatever ``protocol`` says, as Mooncake's engine does
        (its switch for hosts without RDMA NICs, which SGLang documents)."""
        force = os.environ.get("MC_FORCE_TCP")
        if force and protocol != "tcp":
            _log.info("MC_FORCE_TCP=%s: protocol %r replaced by \"tcp\" (Mooncake's meaning: "
                      "TCP transport only)", force, protocol)
            protocol = "tcp"
        rc = super().initialize(local_hostname, metadata_server, protocol, device_name,
                                *args, **kwargs)
        self._metadata_conn = metadata_server
        return rc

    def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str,
                       device_name: str, metadata_type: str) -> int:
        """Mooncake's ``initialize_ext``: the metadata server given without a
        scheme plus its type ("etcd", "http", "redis"), e.g.
        ``initialize_ext(h, "127.0.0.1:2379", "tcp", "", "etcd")``."""
        if not isinstance(metadata_server, str) or not isinstance(metadata_type, str):
            raise TypeError("metadata_server and metadata_type must be str")
        conn = metadata_server
        if conn != P2PHANDSHAKE and "://" not in conn:
            if not metadata_type:
                raise _core.ConfigError(
                    f"initialize_ext: metadata server {metadata_server!r} has no scheme and "
                    "metadata_type is empty; give metadata_type \"etcd\", \"http\" or \"redis\"")
            conn = f"{metadata_type}://{metadata_server}"
        return self.initialize(local_hostname, conn, protocol, device_name)

    def get_engine(self) -> "TransferEngine":
        """Mooncake returns its C++ engine object; ours is this object."""
        return self

    def get_engine_ptr(self) -> int:
        raise _core.UnavailableError(
            "get_engine_ptr() gives C++ extensions (Mooncake's EP/PG buffers) a pointer to "
            "Mooncake's C++ TransferEngine; this engine is not that C++ class, so no such "
            "pointer exists. Use Mooncake itself for those extensions")

    def get_local_topology(self, device_name: Optional[str] = None) -> str:
        """Mooncake's topology JSON: ``{"cpu:<numa>": [[preferred NICs],
        [other NICs]], ...}``.  RDMA NICs are those in /sys/class/infiniband
        (filtered by the comma-separated device_name); GPUs are not listed
        (ours moves GPU memory through the TCP/same-host paths)."""
        if device_name is not None and not isinstance(device_name, str):
            raise TypeError("get_local_topology: device_name must be a str of comma-separated "
                            f"NIC names or None, got {type(device_name).__name__}")
        want = [d for d in (device_name or "").split(",") if d]
        try:
            nics = sorted(os.listdir("/sys/class/infiniband"))
        except OSError:
            nics = []
        if want:
            nics = [n for n in nics if n in want]
        try:
            nodes = sorted(int(n[4:]) for n in os.listdir("/sys/devices/system/node")
                           if n.startswith("node") and n[4:].isdigit())
        except OSError:
            nodes = []
        topo = {}
        for node in nodes or [0]:
            pref = []
            for n in nics:
                try:
                    with open(f"/sys/class/infiniband/{n}/device/numa_node") as f:
                        if int(f.read().strip()) in (node, -1):
                            pref.append(n)
                except (OSError, ValueError):
                    pref.append(n)
            topo[f"cpu:{node}"] = [pref, [n for n in nics if n not in pref]]
        return json.dumps(topo)

    def warmup_efa_segment(self, segment_name: str) -> int:
        """Mooncake: pre-connects EFA; a no-op returning 0 without EFA (ours
        has no EFA transport)."""
        if not isinstance(segment_name, str) or not segment_name:
            raise ValueError("warmup_efa_segment: segment_name must be a non-empty str")
        return 0

    # ---- segments ----
    def _segment_desc(self, segment_name: str) -> dict:
        if not isinstance(segment_name, str) or not segment_name:
            raise ValueError("segment_name must be a non-empty str")
        if segment_name == self.get_segment_name():
            return json.loads(self.get_metadata())
        conn = self._metadata_conn
        if not conn or conn == P2PHANDSHAKE:
            # P2P: asked from the peer itself over the control channel.
            raw = self.describe_segment(segment_name)
            try:
                return json_in.loads(raw)
            except ValueError as e:
                raise _core.TransferError(f"segment {segment_name!r} answered a descriptor "
                                          f"that is not JSON ({e})") from None
        key = _key_prefix() + (segment_name if "/" in segment_name else "ram/" + segment_name)
        with _core.MetadataClient(conn) as client:
            raw = client.get(key)
        if raw is None:
            raise _core.MetadataError(f"segment {segment_name!r} is not registered on metadata "
                                      f"server {conn} (no key {key!r})")
        try:
            return json_in.loads(raw)
        except ValueError as e:
            raise _core.MetadataError(f"segment {segment_name!r}: its descriptor on {conn} is "
                                      f"not JSON ({e})") from None

    def get_first_buffer_address(self, segment_name: str) -> int:
        """Address of the first buffer in the segment's published descriptor,
        0 when it has none (as Mooncake)."""
        bufs = self._segment_desc(segment_name).get("buffers") or []
        return int(bufs[0]["addr"]) if bufs else 0

    def send_probe(self, peer_server_name: str, timeout: float = 2.0) -> int:
        """Mooncake's liveness probe of a peer engine: 0 when the peer's rpc
        port accepts a connection; raises TransferError (compat: -1)."""
        if not isinstance(peer_server_name, str) or not peer_server_name:
            raise ValueError("send_probe: peer_server_name must be a non-empty str")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(f"send_probe: timeout must be a number of seconds, got "
                            f"{type(timeout).__name__}")
        if not 0 < timeout < float("inf"):
            raise ValueError(f"send_probe: timeout must be a finite number of seconds > 0, "
                             f"got {timeout}")
        host, port = self._peer_addr(peer_server_name)
        if not 1 <= port <= 65535:
            raise ValueError(f"send_probe: {peer_server_name!r} has port {port}; a peer's rpc "
                             "port is in 1..65535")
        try:
            with socket.create_connection((host, port), timeout=timeout):
                pass
        except OSError as e:
            raise _core.TransferError(f"probe of {peer_server_name} "
                                      f"({join_hostport(host, port)}) failed: "
                                      f"{e}; is its engine running?") from None
        return 0

    def _peer_addr(self, name: str):
        conn = self._metadata_conn
        if conn and conn != P2PHANDSHAKE:
            with _core.MetadataClient(conn) as client:
                raw = client.get(_key_prefix() + "rpc_meta/" + name)
            if raw is None:
                raise _core.TransferError(f"probe of {name}: not registered on metadata "
                                          f"server {conn}")
            try:
                d = json_in.loads(raw)
                return str(d["ip_or_host_name"]), int(d["rpc_port"])
            except (ValueError, KeyError, TypeError) as e:
                raise _core.MetadataError(
                    f"probe of {name}: its rpc_meta record on metadata server {conn} is not "
                    f"an object with ip_or_host_name and rpc_port ({type(e).__name__}: {e}): "
                    f"{raw[:120]!r}; was it written by something other than a transfer "
                    "engine?") from None
        host, sep, port = name.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"send_probe: {name!r} is not \"host:port\" (P2P mode names a "
                             "peer by its host and rpc port)")
        return host.strip("[]"), int(port)

    # ---- transfers with transport_hint / notify ----
    transfer_sync_write = _hinted_one(_core.TransferEngine.transfer_sync_write)
    transfer_sync_read = _hinted_one(_core.TransferEngine.transfer_sync_read)
    transfer_submit_write = _hinted_one(_core.TransferEngine.transfer_submit_write)
    batch_transfer_sync_write = _hinted_batch(_core.TransferEngine.batch_transfer_sync_write)
    batch_transfer_sync_read = _hinted_batch(_core.TransferEngine.batch_transfer_sync_read)
    batch_transfer_async_write = _hinted_batch(_core.TransferEngine.batch_transfer_async_write)
    batch_transfer_async_read = _hinted_batch(_core.TransferEngine.batch_transfer_async_read)

    def batch_transfer_async(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                             opcode, transport_hint=""):
        _check_hint(transport_hint)
        return super().batch_transfer_async(target_hostname, buffers, peer_buffer_addresses,
                                            lengths, _opcode(opcode))

    def _notify_after(self, target_hostname, envelope) -> None:
        if envelope is not None:
            self.send_notify(target_hostname, envelope)

    def transfer_sync(self, target_hostname, buffer, peer_buffer_address, length, opcode,
                      notify=None, transport_hint=""):
        """Mooncake's transfer_sync; with ``notify`` the peer gets
        (notify.name, notify.msg) from get_notifies() once the bytes have
        landed (its ``.sender``: this engine's segment)."""
        _check_hint(transport_hint)
        envelope = _check_notify(notify)
        rc = super().transfer_sync(target_hostname, buffer, peer_buffer_address, length,
                                   _opcode(opcode))
        self._notify_after(target_hostname, envelope)
        return rc

    def batch_transfer_sync(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                            opcode, notify=None, transport_hint=""):
        _check_hint(transport_hint)
        envelope = _check_notify(notify)
        rc = super().batch_transfer_sync(target_hostname, buffers, peer_buffer_addresses,
                                         lengths, _opcode(opcode))
        self._notify_after(target_hostname, envelope)
        return rc

    def get_notifies(self) -> List[Notify]:
        """(name, message) items that also have ``.name`` / ``.msg`` and
        ``.sender``: name and message as the sender's TransferNotify gave
        them, or (sending segment, message) for a plain send_notify()."""
        return [_notify_unwrap(n, m) for n, m in super().get_notifies()]

    # ---- CUDA-stream-ordered transfers ----
    def _on_cuda(self, what, target_hostname, buffers, peer_buffer_addresses, lengths,
                 opcode, stream_ptr, transport_hint):
        _check_hint(transport_hint)
        if not isinstance(stream_ptr, int) or stream_ptr < 0:
            raise ValueError(f"{what}: stream_ptr must be a cudaStream_t as an int (0: the "
                             "default stream)")
        cuda = _cuda()
        if cuda is None:
            raise _core.UnavailableError(
                f"{what} orders a transfer after the work queued on a CUDA stream; this host "
                "has no usable CUDA driver (libcuda). Use batch_transfer_sync_* instead")
        # Ours runs the transfer once the stream's queued work is done
        # (Mooncake enqueues a host callback; both order the bytes after it).
        rc = cuda.cuStreamSynchronize(ctypes.c_void_p(stream_ptr))
        if rc != 0:
            raise _core.TransferError(f"{what}: cuStreamSynchronize(0x{stream_ptr:x}) failed "
                                      f"with CUDA error {rc}")
        super().batch_transfer_sync(target_hostname, buffers, peer_buffer_addresses, lengths,
                                    _opcode(opcode))

    def transfer_write_on_cuda(self, target_hostname, buffer, peer_buffer_address, length,
                               stream_ptr=0, transport_hint="") -> None:
        self._on_cuda("transfer_write_on_cuda", target_hostname, [buffer],
                      [peer_buffer_address], [length], Write, stream_ptr, transport_hint)

    def transfer_read_on_cuda(self, target_hostname, buffer, peer_buffer_address, length,
                              stream_ptr=0, transport_hint="") -> None:
        self._on_cuda("transfer_read_on_cuda", target_hostname, [buffer],
                      [peer_buffer_address], [length], Read, stream_ptr, transport_hint)

    def batch_transfer_write_on_cuda(self, target_hostname, buffers: Sequence,
                                     peer_buffer_addresses: Sequence, lengths: Sequence,
                                     stream_ptr=0, transport_hint="") -> None:
        self._on_cuda("batch_transfer_write_on_cuda", target_hostname, buffers,
                      peer_buffer_addresses, lengths, Write, stream_ptr, transport_hint)

    def batch_transfer_read_on_cuda(self, target_hostname, buffers: Sequence,
                                    peer_buffer_addresses: Sequence, lengths: Sequence,
                                    stream_ptr=0, transport_hint="") -> None:
        self._on_cuda("batch_transfer_read_on_cuda", target_hostname, buffers,
                      peer_buffer_addresses, lengths, Read, stream_ptr, transport_hint)


__all__ = ["TransferEngine", "TransferOpcode", "TransferNotify", "Notify", "P2PHANDSHAKE"]
