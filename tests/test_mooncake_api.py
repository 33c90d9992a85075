"""The rest of Mooncake's Python TransferEngine API (mooncake_api.py): ours
raises, compat returns Mooncake's codes.  Each method is exercised for real
(engines on loopback, our metadata server)."""
import json

import pytest

import mooncake_connector as mc
from mooncake_connector import compat
from mooncake_connector.mooncake_api import TransferNotify, TransferOpcode


def _pair(metadata="P2PHANDSHAKE", cls=mc.TransferEngine):
    a, b = cls(), cls()
    a.initialize("127.0.0.1", metadata, "tcp", "")
    b.initialize("127.0.0.1", metadata, "tcp", "")
    return a, b


def test_opcode_notify_and_transport_hint():
    assert (int(TransferOpcode.Read), int(TransferOpcode.Write)) == (0, 1)
    a, b = _pair()
    try:
        src, dst = a.allocate_managed_buffer(4096), b.allocate_managed_buffer(4096)
        a.write_bytes_to_buffer(src, b"abcd" * 1024)
        seg = b.get_segment_name()
        assert a.transfer_sync(seg, src, dst, 4096, TransferOpcode.Write,
                               TransferNotify("req-1", "done"), transport_hint="tcp") == 0
        assert b.read_bytes_from_buffer(dst, 4) == b"abcd"
        got = b.get_notifies()
        # Mooncake's meaning: the receiver sees notify.name as the sender set
        # it; ours adds the sending segment as .sender.
        assert len(got) == 1 and got[0].msg == b"done" and got[0].name == "req-1"
        assert got[0].sender == a.get_segment_name()
        name, msg = got[0]  # still a (name, message) tuple
        assert (name, msg) == ("req-1", b"done")
        assert a.batch_transfer_sync(seg, [src], [dst], [8], TransferOpcode.Read,
                                     notify=TransferNotify("x", "read")) == 0
        assert [(n.name, n.msg) for n in b.get_notifies()] == [("x", b"read")]
        # A plain send_notify is named by its sender; a body that merely
        # starts with the envelope's magic but is not one arrives as is.
        a.send_notify(seg, b"plain")
        a.send_notify(seg, b"MKNT\x01\x00\xff\x00short")
        a.send_notify(seg, b"MKNT\x01\x00\x00\x00")  # empty name, empty msg
        got = b.get_notifies()
        assert [(n.name, n.msg) for n in got] == [
            (a.get_segment_name(), b"plain"),
            (a.get_segment_name(), b"MKNT\x01\x00\xff\x00short"), ("", b"")]
        assert all(n.sender == a.get_segment_name() for n in got)
        with pytest.raises(TypeError, match="msg must be a str or bytes"):
            a.transfer_sync(seg, src, dst, 8, TransferOpcode.Write, TransferNotify("n", 5))
        assert a.batch_transfer_sync_write(seg, [src], [dst], [8], transport_hint="rdma") == 0
        bid = a.batch_transfer_async(seg, [src], [dst], [8], TransferOpcode.Write,
                                     transport_hint="")
        assert a.get_batch_transfer_status([bid]) == 0
        # P2P: the peer's own descriptor, asked from the peer.
        assert a.get_first_buffer_address(seg) == dst
        assert json.loads(a.describe_segment(seg))["name"] == seg
        with pytest.raises(ValueError, match="unknown transport_hint 'warp'"):
            a.transfer_sync_write(seg, src, dst, 8, transport_hint="warp")
        with pytest.raises(TypeError, match="TransferNotify"):
            a.transfer_sync(seg, src, dst, 8, TransferOpcode.Write, notify="no")
    finally:
        a.close()
        b.close()


def test_first_buffer_probe_topology_engine(metadata_server):
    a, b = _pair(metadata_server.url)
    try:
        dst = b.allocate_managed_buffer(1 << 16)
        seg = b.get_segment_name()
        assert a.get_first_buffer_address(seg) == dst
        assert b.get_first_buffer_address(seg) == dst  # own segment
        with pytest.raises(mc.MetadataError, match="not registered"):
            a.get_first_buffer_address("127.0.0.1:1")
        assert a.send_probe(seg) == 0
        with pytest.raises(mc.TransferError, match="not registered"):
            a.send_probe("127.0.0.1:1")
        topo = json.loads(a.get_local_topology())
        assert topo and all(k.startswith("cpu:") and len(v) == 2 for k, v in topo.items())
        assert a.get_engine() is a
        with pytest.raises(mc.UnavailableError, match="C\\+\\+"):
            a.get_engine_ptr()
        assert a.warmup_efa_segment(seg) == 0
    finally:
        a.close()
        b.close()


def test_probe_and_topology_arguments_are_checked():
    """Arguments of the wrong type or range name the argument: before,
    get_local_topology(5) was AttributeError 'int' object has no attribute
    'split', send_probe's timeout -1 / nan were socket's "Timeout value out
    of range" / "Invalid value NaN", and a port over 65535 an
    OverflowError from getsockaddrarg."""
    e = mc.TransferEngine()
    try:
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        with pytest.raises(TypeError, match="device_name"):
            e.get_local_topology(5)
        for t in (-1, 0, float("nan"), float("inf"), "2", True):
            with pytest.raises((TypeError, ValueError), match="timeout"):
                e.send_probe("127.0.0.1:1", timeout=t)
        for name in ("127.0.0.1:99999", "127.0.0.1:0"):
            with pytest.raises(ValueError, match="1..65535"):
                e.send_probe(name)
    finally:
        e.close()


@pytest.mark.parametrize("record", [b"not json", b"[1]", b'{"rpc_port": 1}',
                                    b'{"ip_or_host_name": "h", "rpc_port": "x"}'])
def test_probe_of_a_peer_with_a_malformed_metadata_record_names_it(metadata_server, record):
    """send_probe reads the peer's rpc_meta record from the metadata server:
    one that is not JSON, not an object or lacks a field was a bare
    JSONDecodeError / KeyError / AttributeError / ValueError."""
    from mooncake_connector.mooncake_api import _key_prefix
    e = mc.TransferEngine()
    try:
        assert e.initialize("127.0.0.1", metadata_server.url, "tcp", "") == 0
        metadata_server.store.put(_key_prefix() + "rpc_meta/bad:1", record)
        with pytest.raises(mc.MetadataError, match="bad:1.*rpc_meta record"):
            e.send_probe("bad:1")
    finally:
        e.close()


def test_initialize_ext_and_on_cuda(metadata_server):
    e = mc.TransferEngine()
    try:
        host = metadata_server.url.split("://", 1)[1]
        assert e.initialize_ext("127.0.0.1", host, "tcp", "", "http") == 0
        src = e.allocate_managed_buffer(4096)
        assert e.get_first_buffer_address(e.get_segment_name()) == src
        with pytest.raises(mc.UnavailableError, match="CUDA"):
            e.transfer_write_on_cuda(e.get_segment_name(), src, src, 8)
        with pytest.raises(mc.UnavailableError, match="CUDA"):
            e.batch_transfer_read_on_cuda(e.get_segment_name(), [src], [src], [8], 0)
    finally:
        e.close()
    with pytest.raises(mc.ConfigError, match="metadata_type"):
        mc.TransferEngine().initialize_ext("127.0.0.1", "127.0.0.1:1", "tcp", "", "")


def test_compat_codes_for_the_new_methods():
    with compat.TransferEngine() as c:
        assert c.initialize_ext("127.0.0.1", "P2PHANDSHAKE", "tcp", "", "") == 0
        assert c.send_probe("127.0.0.1:1") == -1 and "refused" in str(c.last_error)
        assert c.get_first_buffer_address("127.0.0.1:1") == 0
        assert isinstance(c.last_error, mc.TransferError)
        own = c.get_segment_name()
        assert c.get_first_buffer_address(own) == 0  # no buffer yet: Mooncake's 0
        src = c.allocate_managed_buffer(4096)
        assert c.get_first_buffer_address(own) == src
        assert c.send_probe(own) == 0
        assert c.transfer_sync(own, src, src + 8, 8, compat.TransferOpcode.Write,
                               compat.TransferNotify("n", "hi")) == 0
        items = c.get_notifies()
        assert [(type(i).__name__, i.name, i.msg, i.sender) for i in items] == [
            ("TransferNotify", "n", "hi", own)]
        assert c.transfer_sync_write(own, src, src, 8, transport_hint="bogus") == -1
        assert c.get_engine() is c


def test_mc_force_tcp_as_mooncake(monkeypatch, caplog):
    """MC_FORCE_TCP (Mooncake's switch, set by its CI and documented by SGLang
    for hosts without RDMA NICs) makes any protocol TCP; unset, "rdma" means
    RDMA (no fallback)."""
    import os
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    if not os.path.isdir("/sys/class/infiniband"):
        with pytest.raises(mc.UnavailableError, match="no RDMA device"):
            mc.TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "")
    monkeypatch.setenv("MC_FORCE_TCP", "true")
    a, b = _pair()
    c = compat.TransferEngine()
    try:
        with caplog.at_level("INFO", logger="mooncake_connector"):
            assert c.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
        assert "MC_FORCE_TCP=true: protocol 'rdma' replaced by \"tcp\"" in caplog.text
        src, dst = c.allocate_managed_buffer(4096), b.allocate_managed_buffer(4096)
        c.write_bytes_to_buffer(src, b"tcp!" * 1024)
        assert c.transfer_sync_write(b.get_segment_name(), src, dst, 4096) == 0
        assert b.read_bytes_from_buffer(dst, 4) == b"tcp!"
    finally:
        for e in (a, b, c):
            e.close()


def test_notify_envelope_parser_takes_any_bytes(caplog):
    """get_notifies() parses bodies a peer chose: any bytes give a Notify,
    never an exception; round trip of the envelope."""
    import random
    from mooncake_connector import mooncake_api as m
    env = m._notify_envelope(TransferNotify("név", "msg"))
    n = m._notify_unwrap("peer:1", env)
    assert (n.name, n.msg, n.sender) == ("név", b"msg", "peer:1")
    rnd = random.Random(26)
    for i in range(3000):
        body = bytes(rnd.randrange(256) for _ in range(rnd.randrange(12)))
        if i % 2:
            body = m.NOTIFY_MAGIC + body
        n = m._notify_unwrap("peer:1", body)
        assert isinstance(n, m.Notify) and n.sender == "peer:1"
        assert n.msg == body or body.startswith(m.NOTIFY_MAGIC)
    with pytest.raises(ValueError, match="at most 65535"):
        m._notify_envelope(TransferNotify("x" * 65536, ""))


def test_an_opcode_or_a_write_length_that_is_wrong_names_it():
    """opcode went through int(): 1.9 and "1" were a WRITE, "write" raised
    "invalid literal for int() with base 10".  write_bytes_to_buffer with a
    length past its data copied len(data) bytes without a word (Mooncake's
    memcpy reads past the end).  Both now raise naming the argument; nothing
    is moved."""
    a, b = _pair()
    try:
        src, dst = a.allocate_managed_buffer(4096), b.allocate_managed_buffer(4096)
        seg = b.get_segment_name()
        b.write_bytes_to_buffer(dst, b"\0" * 16)
        a.write_bytes_to_buffer(src, b"abcd" * 4)
        for bad, exc in ((1.9, TypeError), ("1", TypeError), ("write", TypeError),
                         (True, TypeError), (None, TypeError), (2, ValueError),
                         (-1, ValueError)):
            for call in (lambda: a.transfer_sync(seg, src, dst, 16, bad),
                         lambda: a.batch_transfer_sync(seg, [src], [dst], [16], bad),
                         lambda: a.batch_transfer_async(seg, [src], [dst], [16], bad)):
                with pytest.raises(exc, match=r"opcode must be TransferOpcode.Read \(0\) or "
                                              r"TransferOpcode.Write \(1\), not " +
                                              repr(bad).replace(".", r"\.")):
                    call()
        assert b.read_bytes_from_buffer(dst, 16) == b"\0" * 16  # nothing was written
        assert a.transfer_sync(seg, src, dst, 16, TransferOpcode.Write) == 0
        assert a.transfer_sync(seg, src, dst, 16, 1) == 0
        with pytest.raises(ValueError, match=r"length 1000 is more than the 3 bytes of data"):
            a.write_bytes_to_buffer(src, b"xyz", 1000)
        assert a.read_bytes_from_buffer(src, 4) == b"abcd"
        assert a.write_bytes_to_buffer(src, b"xyz", 2) == 0
        assert a.read_bytes_from_buffer(src, 4) == b"xycd"
    finally:
        a.close()
        b.close()


def test_a_failed_probe_of_an_ipv6_peer_names_it_in_brackets():
    """P2P send_probe of "[::1]:1" (nothing listens): the message names the
    address it tried as [::1]:1 (was "::1:1")."""
    from conftest import has_ipv6_loopback
    if not has_ipv6_loopback():
        pytest.skip("no IPv6 loopback (::1) here")
    e = mc.TransferEngine()
    try:
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        with pytest.raises(mc.TransferError, match=r"probe of \[::1\]:1 \(\[::1\]:1\) failed"):
            e.send_probe("[::1]:1")
    finally:
        e.close()
