"""mooncake_connector.compat.TransferEngine keeps Mooncake's return codes."""
import logging

import pytest

import mooncake_connector as mc
from mooncake_connector.compat import TransferEngine
from mooncake_connector.serving import free_port


def test_failures_become_codes_with_the_reason_logged(caplog):
    e = TransferEngine()
    with caplog.at_level(logging.ERROR, logger="mooncake_connector"):
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "udp", "") == -1
        assert isinstance(e.last_error, mc.ConfigError)
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert e.last_error is None
        assert e.transfer_sync_write("127.0.0.1:1", 4096, 4096, 10) == -1
        assert "not inside any memory region registered" in str(e.last_error)
        src = e.allocate_managed_buffer(4096)
        assert e.transfer_sync_write("127.0.0.1:1", src, 4096, 10) == -1
        assert "refused" in str(e.last_error)
        assert e.batch_transfer_async_write("nonsense", [1], [2], [3]) == 0
        assert e.get_batch_transfer_status([999]) == -1
    assert "transfer_sync_write failed" in caplog.text and "127.0.0.1:1" in caplog.text
    assert isinstance(e.get_rpc_port(), int)  # delegated as is
    e.close()


def test_success_paths_return_mooncake_values():
    with TransferEngine() as a, TransferEngine() as b:
        assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        src = a.allocate_managed_buffer(4096)
        dst = b.allocate_managed_buffer(4096)
        assert src != 0 and dst != 0
        a.write_bytes_to_buffer(src, b"x" * 4096)
        seg = b.get_segment_name()
        assert a.batch_transfer_sync_write(seg, [src], [dst], [4096]) == 0
        bid = a.batch_transfer_async_read(seg, [src], [dst], [4096])
        assert bid > 0 and a.get_batch_transfer_status([bid]) == 0
        assert b.read_bytes_from_buffer(dst, 4) == b"xxxx"


def test_p2p_async_submit_to_unknown_peer_fails_at_submit():
    """Mooncake's P2P mode fails the submit (batch id 0) for a peer that does
    not answer the handshake; ours raises there, not at the status."""
    seg = f"127.0.0.1:{free_port()}"  # nothing listens there
    with TransferEngine() as c, mc.TransferEngine() as e:
        assert c.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        src = c.allocate_managed_buffer(4096)
        assert c.batch_transfer_async_write(seg, [src], [4096], [64]) == 0
        assert "P2P handshake with segment" in str(c.last_error)
        assert c.transfer_submit_write(seg, src, 4096, 64) == 0
        s2 = e.allocate_managed_buffer(4096)
        with pytest.raises(mc.MooncakeError, match="P2P handshake.*" + seg):
            e.batch_transfer_async_write(seg, [s2], [4096], [64])
        # A live peer still takes async submits.
        ok = c.batch_transfer_async_write(e.get_segment_name(), [src], [s2], [64])
        assert ok > 0 and c.get_batch_transfer_status([ok]) == 0
