"""GPU memory through the engine and send_kv/recv_kv, between processes (one
per GPU where two are visible): KV-cache-shaped tensors (layers x blocks x
64 KiB), byte-exact (per-block checksums on the GPU).  Run with
`pytest -m gpu`; skipped with the reason where torch or a GPU is missing."""
import ctypes
import json
import os
import re
import sys

import pytest
from conftest import cuda_torch
from line_peer import LinePeer

pytestmark = pytest.mark.gpu

torch = cuda_torch()

import mooncake_connector as mc  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
NGPU = torch.cuda.device_count()
DEV_A = "cuda:0"
DEV_B = "cuda:1" if NGPU > 1 else "cuda:0"


class GpuPeer(LinePeer):
    def __init__(self, device, layers=32, blocks=1000, block_bytes=65536, env=None):
        self.layers, self.blocks, self.bb = layers, blocks, block_bytes
        super().__init__(os.path.join(HERE, "gpu_peer.py"),
                         ["--device", device, "--layers", str(layers), "--blocks", str(blocks),
                          "--block-bytes", str(block_bytes)], env, "gpu peer")
        self.segment, self.addrs = self.info["segment"], self.info["addrs"]


@pytest.fixture
def gpu_peers():
    made = []

    def make(device, **kw):
        p = GpuPeer(device, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        sys.stderr.write(p.close())


def check_moved(a, b, mult, add):
    """b's block (i*mult+add) % blocks equals a's block i, every layer."""
    sa, sb = a.call(cmd="sums")["sums"], b.call(cmd="sums")["sums"]
    n = a.blocks
    bad = [(li, i) for li in range(a.layers) for i in range(n)
           if sb[li][(i * mult + add) % n] != sa[li][i]]
    assert not bad, f"{len(bad)} blocks differ, first {bad[:5]}"


def roundtrip(a, b):
    a.call(cmd="fill", seed=11)
    b.call(cmd="zero")
    r = a.call(cmd="xfer", op="write", target=b.segment, raddrs=b.addrs, mult=7, add=3)
    check_moved(a, b, 7, 3)
    before = a.call(cmd="sums")["sums"]
    a.call(cmd="zero")
    a.call(cmd="xfer", op="read", target=b.segment, raddrs=b.addrs, mult=7, add=3)
    assert a.call(cmd="sums")["sums"] == before
    return r["bytes"] / r["secs"][0] / 1e9


def test_same_host_gpu_to_gpu_32x1000x64k(gpu_peers):
    a, b = gpu_peers(DEV_A), gpu_peers(DEV_B)
    gbps = roundtrip(a, b)
    sys.stderr.write(f"same-host GPU->GPU write: {gbps:.1f} GB/s\n")


def test_same_host_gpu_write_to_a_dead_peer_fails(gpu_peers):
    """The descriptor cached and kept current by the peer's regions version
    page: after the peer is SIGKILLed (its page outlives it in our mapping,
    unchanged) the next write must fail, not complete into memory nobody
    owns any more."""
    a = gpu_peers(DEV_A, layers=2, blocks=64)
    b = gpu_peers(DEV_B, layers=2, blocks=64)
    a.call(cmd="fill", seed=5)
    for _ in range(3):  # the first call describes; later ones use the page
        r = a.call(cmd="xfer", op="write", target=b.segment, raddrs=b.addrs, mult=3, add=1)
        assert "error" not in r, r
    check_moved(a, b, 3, 1)
    b.proc.kill()
    b.proc.wait()
    # LinePeer.call raises on an {"error": ...} answer: the write must fail,
    # naming the peer (on the H200: "P2P handshake with segment H:P failed:
    # ... Connection refused", the RPC check the dead peer's pidfd forces).
    with pytest.raises(AssertionError, match=re.escape(b.segment)):
        a.call(cmd="xfer", op="write", target=b.segment, raddrs=b.addrs, mult=3, add=1)


def test_tcp_gpu_both_sides(gpu_peers):
    off = {"MC_GPU_IPC": "0"}  # force TCP with pinned staging on both ends
    a = gpu_peers(DEV_A, blocks=250, env=off)
    b = gpu_peers(DEV_B, blocks=250, env=off)
    gbps = roundtrip(a, b)
    sys.stderr.write(f"TCP GPU->GPU write: {gbps:.2f} GB/s\n")


@pytest.mark.parametrize("shc", ["0", "1"])
@pytest.mark.parametrize("da,db", [(DEV_A, "cpu"), ("cpu", DEV_B)])
def test_gpu_cpu_mixed(gpu_peers, da, db, shc):
    """shc=1: the same-host CPU path is on; a host buffer to the peer's GPU
    region (and back) must still work: that path declines GPU regions and
    the engine sends those requests over TCP (which stages them)."""
    env = {"MC_SAME_HOST_CPU": shc}
    a, b = gpu_peers(da, blocks=200, env=env), gpu_peers(db, blocks=200, env=env)
    roundtrip(a, b)


@pytest.mark.parametrize("ipc,pull", [("1", False), ("0", False), ("1", True), ("0", True)])
def test_send_recv_kv_gpu(gpu_peers, ipc, pull):
    """Push (the producer WRITEs) and pull (the consumer READs), each over the
    same-host path and over TCP with staging."""
    env = {"MC_GPU_IPC": ipc}
    nb = 1000 if ipc == "1" else 200
    prod = gpu_peers(DEV_A, blocks=nb, env=env)
    cons = gpu_peers(DEV_B, blocks=nb, env=env)
    prod.call(cmd="fill", seed=5)
    cons.call(cmd="zero")
    prod.call(cmd="kv_init", producer=True)
    cons.call(cmd="kv_init", producer=False)
    import random
    rng = random.Random(1)
    tokens = [rng.randrange(50000) for _ in range(nb * 16)]
    src = list(range(nb))
    rng.shuffle(src)
    dst = [(i * 7 + 3) % nb for i in range(nb)]
    assert prod.call(cmd="send_kv", tokens=tokens, blocks=src)["stored"] == nb * 16
    r = cons.call(cmd="recv_kv", producer=prod.segment, tokens=tokens, blocks=dst, pull=pull)
    assert r["matched"] == nb * 16
    sys.stderr.write(f"recv_kv of {nb} blocks x 32 layers (ipc={ipc}, pull={pull}): "
                     f"{nb * 32 * 65536 / r['secs'] / 1e9:.1f} GB/s\n")
    sp, sc = prod.call(cmd="sums")["sums"], cons.call(cmd="sums")["sums"]
    bad = [(li, i) for li in range(32) for i in range(nb) if sc[li][dst[i]] != sp[li][src[i]]]
    assert not bad, f"{len(bad)} blocks differ"


def test_wrong_location_claims_and_tensors():
    eng = mc.TransferEngine()
    eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    try:
        g = torch.zeros(1 << 20, dtype=torch.uint8, device=DEV_A)
        h = torch.zeros(1 << 20, dtype=torch.uint8)
        with pytest.raises(mc.MooncakeError, match="GPU memory on cuda:0"):
            eng.register_memory(g.data_ptr(), g.numel(), "cpu")
        with pytest.raises(mc.MooncakeError, match="host memory"):
            eng.register_memory(h.data_ptr(), h.numel(), "cuda:0")
        if NGPU > 1:
            with pytest.raises(mc.MooncakeError, match='"cuda:0"'):
                eng.register_memory(g.data_ptr(), g.numel(), "cuda:1")
        # Tensors stand for their addresses; "*" detects the location.
        assert eng.register_memory(g, g.numel(), "*") == 0
        meta = json.loads(eng.get_metadata())
        assert any(b["name"] == "cuda:0" for b in meta["buffers"])
        # Raw helpers reach GPU memory too.
        eng.write_bytes_to_buffer(g.data_ptr() + 10, b"hello")
        assert eng.read_bytes_from_buffer(g.data_ptr() + 10, 5) == b"hello"
        assert bytes(g[10:15].cpu().tolist()) == b"hello"
        # Same-segment transfer from host memory into the GPU region (local
        # buffers must be registered too).
        h[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        assert eng.register_memory(h.data_ptr(), h.numel(), "cpu") == 0
        eng.transfer_sync_write(eng.get_segment_name(), h.data_ptr(), g.data_ptr() + 100, 4)
        assert g[100:104].cpu().tolist() == [1, 2, 3, 4]
        eng.unregister_memory(g.data_ptr())
    finally:
        eng.close()


def test_cuda_tensors_as_tokens_and_extents():
    lb = mc.LookupBuffer(1 << 30, block_size=4)
    kv = torch.arange(4 * 1024, dtype=torch.int32, device=DEV_A).view(4, 1024)
    toks = torch.arange(16, dtype=torch.int64, device=DEV_A)
    assert lb.insert(toks, [kv[i] for i in range(4)]) == 16
    r = lb.lookup(toks.cpu())
    assert r.matched_tokens == 16
    assert [e[0] for e in r.extents] == [kv[i].data_ptr() for i in range(4)]
    assert all(e[1] == 4096 for e in r.extents)
    # copy=True stages GPU extents into host memory the buffer owns.
    lb2 = mc.LookupBuffer(1 << 30, block_size=4)
    assert lb2.insert(toks, [kv[i] for i in range(4)], copy=True) == 16
    r2 = lb2.lookup(toks)
    # The staged copy is plain host memory the buffer owns (no engine here:
    # read_bytes_from_buffer reads only memory registered with its engine).
    got = ctypes.string_at(r2.extents[1][0], 4096)
    assert got == kv[1].cpu().numpy().tobytes()
