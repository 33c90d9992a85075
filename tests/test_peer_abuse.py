"""Hostile peers and careless callers, second round (issue 28): a relayed
same-host hello, undecodable peer bytes, log floods, pre-handshake floods,
malformed KV extents, index memory outside the lookup buffer's budget."""
import pytest

import mooncake_connector as mc


@pytest.fixture
def pair():
    a, b = mc.TransferEngine(), mc.TransferEngine()
    a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    yield a, b
    a.close()
    b.close()


def test_send_kv_refuses_zero_length_and_short_extents(pair):
    a, _ = pair
    buf = a.allocate_managed_buffer(1 << 16)
    lb = mc.LookupBuffer(1 << 20, block_size=4, extents_per_block=2)
    kv = mc.KVTransfer(a, lb)
    try:
        with pytest.raises(mc.MooncakeError, match=r"KV extent 0 \(block 0.*length 0"):
            kv.send_kv(list(range(16)), [(buf, 0)] * 8)
        # one extent of block 2 shorter than the layout (block 0's) says
        ext = [(buf + 1024 * i, 512) for i in range(8)]
        ext[5] = (buf + 1024 * 5, 100)
        with pytest.raises(mc.MooncakeError, match=r"KV extent 5 \(block 2, extent 1.*100"):
            kv.send_kv(list(range(16)), ext)
        assert lb.stats()["entries"] == 0
        assert kv.send_kv(list(range(16)), [(buf + 1024 * i, 512) for i in range(8)]) == 16
    finally:
        kv.close()
