"""Careless callers (issue 14): each reproducer raises a clear Python
exception; none kills or bloats the process.  Crash reproducers run in a
subprocess so a regression fails one test instead of killing the suite."""
import math
import os
import subprocess
import sys
import textwrap

import pytest

import mooncake_connector as mc
from conftest import local_engines

PAIR = """
import mooncake_connector as mc, resource, sys
A, B = mc.TransferEngine(), mc.TransferEngine()
A.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
B.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
ab = A.allocate_managed_buffer(1 << 20)
bb = B.allocate_managed_buffer(1 << 20)
def expect(fn, *a, match, exc=mc.MooncakeError):
    try:
        fn(*a)
    except exc as e:
        assert match in str(e), (match, str(e))
        print("raised:", type(e).__name__, e, flush=True)
        return
    raise SystemExit("no exception from %s" % fn)
"""


def run_py(body, limit_gb=None, timeout=60):
    """Runs PAIR + body in a fresh interpreter (optionally with an address
    space limit); returns (rc, output)."""
    pre = ""
    if limit_gb:
        pre = ("import resource\nresource.setrlimit(resource.RLIMIT_AS, "
               f"({limit_gb} << 30, {limit_gb} << 30))\n")
    p = subprocess.run([sys.executable, "-P", "-c", pre + PAIR + textwrap.dedent(body)],
                       capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def ok(body, **kw):
    rc, out = run_py(body, **kw)
    assert rc == 0, f"exit status {rc}:\n{out[-3000:]}"
    return out


def test_every_method_raises_after_close():
    out = ok("""
        A.close()
        expect(A.write_bytes_to_buffer, ab, b"x", match="closed")
        expect(A.read_bytes_from_buffer, ab, 1, match="closed")
        expect(A.transfer_sync_write, B.get_segment_name(), ab, bb, 1, match="closed")
        expect(A.register_memory, ab, 4096, match="closed")
        expect(A.get_notifies, match="closed")
        expect(A.free_managed_buffer, ab, 1 << 20, match="closed")
        expect(A.get_segment_name, match="closed")
    """)
    assert out.count("raised:") == 7


def test_read_into_an_unregistered_local_address_raises():
    ok("""
        expect(A.transfer_sync_read, B.get_segment_name(), 4096, bb, 100,
               match="0x1000")
        expect(A.transfer_sync_read, B.get_segment_name(), 4096, bb, 100,
               match="not inside any memory region registered with this engine")
        # One byte past a registered buffer is refused too.
        expect(A.transfer_sync_read, B.get_segment_name(), ab + (1 << 20) - 50, bb, 100,
               match="local")
        expect(A.batch_transfer_sync_write, B.get_segment_name(), [ab, 8192], [bb, bb],
               [10, 10], match="request 1")
    """)


def test_same_segment_copy_from_an_unmapped_source_raises():
    ok("""
        expect(A.transfer_sync_write, A.get_segment_name(), 4096, ab, 100, match="0x1000")
        expect(A.transfer_sync_read, A.get_segment_name(), 4096, ab, 100, match="0x1000")
        # A legitimate same-segment copy still works.
        A.write_bytes_to_buffer(ab, b"abc")
        A.transfer_sync_write(A.get_segment_name(), ab, ab + 4096, 3)
        assert A.read_bytes_from_buffer(ab + 4096, 3) == b"abc"
    """)


def test_register_memory_refuses_unmapped_ranges():
    ok("""
        expect(A.register_memory, 1 << 44, 4096, match="not mapped")
        expect(A.register_memory, 1 << 44, 4096, match="0x100000000000")
        # Partly mapped: the range runs past the end of a 64 KiB mapping.
        import mmap, ctypes
        m = mmap.mmap(-1, 1 << 16)
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))
        expect(A.register_memory, base, 1 << 30, match="memory [")
        assert A.register_memory(base, 1 << 16) == 0
        B.write_bytes_to_buffer(bb, b"y" * 64)
        B.transfer_sync_write(A.get_segment_name(), bb, base, 64)
        assert m[:64] == b"y" * 64
    """)


def test_register_memory_refuses_read_only_memory():
    ok("""
        import mmap, ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        p = libc.mmap(None, 8192, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        expect(A.register_memory, p, 8192, match="not writable")
    """)


def test_huge_claimed_lengths_allocate_nothing():
    # 2**63 and 2**40: refused before anything is sliced or allocated.
    ok("""
        for n in (1 << 63, 1 << 40, (1 << 20) + 1):
            expect(A.transfer_sync_write, B.get_segment_name(), ab, bb, n, match="")
            expect(A.transfer_sync_read, B.get_segment_name(), ab, bb, n, match="")
        # This process's peak RSS (VmHWM, kB; getrusage's ru_maxrss would
        # carry the parent pytest's peak across fork+exec).
        hwm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")]
        assert hwm[0] < (1 << 20), ("bloated", hwm)
    """, limit_gb=4)


def test_opcode_is_checked():
    ok("""
        expect(A.transfer_sync, B.get_segment_name(), ab, bb, 100, 7,
               match="opcode", exc=ValueError)
        expect(A.transfer_sync, B.get_segment_name(), ab, bb, 100, -1,
               match="opcode", exc=ValueError)
        assert A.transfer_sync(B.get_segment_name(), ab, bb, 100, 1) == 0
    """)


@pytest.fixture
def pair():
    with local_engines(2) as engines:
        yield engines


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_and_inf_timeouts_raise(pair, bad):
    a, b = pair
    kv = mc.KVTransfer(a)
    buf = a.allocate_managed_buffer(1 << 16)
    try:
        with pytest.raises(ValueError, match="timeout"):
            kv.recv_kv(b.get_segment_name(), list(range(16)), [(buf, 4096)], timeout=bad)
        with pytest.raises(ValueError, match="timeout"):
            kv.probe(b.get_segment_name(), list(range(16)), timeout=bad)
        with pytest.raises(ValueError, match="timeout"):
            a.send_notify(b.get_segment_name(), b"x", timeout=bad)
        bid = a.transfer_submit_write(b.get_segment_name(), buf, buf, 1)
        with pytest.raises(ValueError, match="timeout"):
            a.get_batch_transfer_status([bid], bad)
    finally:
        kv.close()


def test_send_kv_refuses_unregistered_extents(pair):
    a, b = pair
    buf = a.allocate_managed_buffer(1 << 16)
    lb = mc.LookupBuffer(1 << 20, block_size=4)
    kv = mc.KVTransfer(a, lb)
    try:
        with pytest.raises(mc.MooncakeError, match="0x1000"):
            kv.send_kv([1, 2, 3, 4], [(4096, 4096, 0)])
        with pytest.raises(mc.MooncakeError, match="registered"):
            kv.send_kv([1, 2, 3, 4], [(buf + (1 << 16) - 100, 4096, 0)])
        assert kv.send_kv([1, 2, 3, 4], [(buf, 4096, 0)]) == 4
    finally:
        kv.close()


@pytest.mark.parametrize("field,value", [
    ("device_name", "mlx5\u0000_0"),
    ("prefill_url", "10.0.0.1:13003\u0000evil"),
    ("protocol", "tcp\u0000"),
    ("metadata_server", "P2PHANDSHAKE\u0000"),
])
def test_nul_in_config_strings_is_refused(field, value):
    import json
    cfg = {"prefill_url": "10.0.0.1:13003", "decode_url": "10.0.0.2:13003",
           "metadata_server": "P2PHANDSHAKE", "protocol": "rdma", "device_name": "mlx5_0"}
    cfg[field] = value
    with pytest.raises(mc.ConfigError, match=f"{field}.*NUL"):
        mc.parse_config(json.dumps(cfg))


@pytest.mark.parametrize("arg", [0, 1, 2, 3])
def test_nul_in_api_strings_is_refused(arg):
    args = ["127.0.0.1", "P2PHANDSHAKE", "tcp", ""]
    args[arg] = args[arg] + "\0x"
    e = mc.TransferEngine()
    with pytest.raises(ValueError, match="null|NUL"):
        e.initialize(*args)
