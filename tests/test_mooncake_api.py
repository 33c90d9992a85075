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
        assert len(got) == 1 and got[0].msg == b"done" and got[0].name == a.get_segment_name()
        name, msg = got[0]  # still a (name, message) tuple
        assert a.batch_transfer_sync(seg, [src], [dst], [8], TransferOpcode.Read,
                                     notify=TransferNotify("x", "read")) == 0
        assert [n.msg for n in b.get_notifies()] == [b"read"]
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
        assert [(type(i).__name__, i.msg) for i in items] == [("TransferNotify", "hi")]
        assert c.transfer_sync_write(own, src, src, 8, transport_hint="bogus") == -1
        assert c.get_engine() is c
