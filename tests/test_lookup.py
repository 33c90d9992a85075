"""LookupBuffer / hash_token_blocks through the Python API (in process)."""
import array
import ctypes
import threading
import time

import pytest

import mooncake_connector as mc
from conftest import in_threads


def ext(n, base, size=100):
    return [(0x10000 + base * 0x1000 + i * 0x100, size, base * 1000 + i) for i in range(n)]


def test_hash_token_blocks_inputs_agree_and_chain():
    toks = list(range(40))
    h = mc.hash_token_blocks(toks)
    assert len(h) == 2 and all(isinstance(x, bytes) and len(x) == 16 for x in h)
    assert mc.hash_token_blocks(array.array("q", toks)) == h
    assert mc.hash_token_blocks(array.array("i", toks)) == h
    assert mc.hash_token_blocks(memoryview(array.array("l", toks))) == h
    assert mc.hash_token_blocks(toks, seed=1) != h
    assert mc.hash_token_blocks(toks, block_size=8)[1] != h[0]
    changed = list(toks)
    changed[0] = 99
    assert all(a != b for a, b in zip(mc.hash_token_blocks(changed), h))  # prefix chaining
    with pytest.raises(mc.ConfigError, match="index 3"):
        mc.hash_token_blocks([0, 1, 2, -5] + [0] * 12)
    with pytest.raises(TypeError, match="4- or 8-byte integers"):
        mc.hash_token_blocks(array.array("d", [1.0] * 16))


def test_numpy_tokens():
    np = pytest.importorskip("numpy")
    toks = np.arange(64, dtype=np.int64)
    assert mc.hash_token_blocks(toks) == mc.hash_token_blocks(toks.astype(np.int32))
    b = mc.LookupBuffer(1 << 20)
    b.insert(toks, ext(4, 1))
    assert b.lookup(toks[:40].astype(np.int32)).matched_tokens == 32


def test_prefix_partial_miss_and_remove():
    b = mc.LookupBuffer(1 << 20, block_size=16, seed=3)
    a = list(range(64))
    c = list(range(64))
    c[40] = 777
    assert b.insert(a, ext(4, 1)) == 64
    assert b.insert(c, ext(4, 2)) == 64
    s = b.stats()
    assert s["blocks"] == 6 and s["insert_reused_blocks"] == 2
    matched, extents = b.lookup(a[:50])
    assert matched == 48 and [e[2] for e in extents] == [1000, 1001, 1002]
    matched, extents = b.lookup(c)
    assert matched == 64 and [e[2] for e in extents] == [1000, 1001, 2002, 2003]
    assert b.lookup([5] * 64).matched_tokens == 0
    assert b.lookup(a[:15]) == (0, [])
    assert b.remove(a) == 1
    assert b.lookup(a).matched_tokens == 32


def test_consume_once_vs_keep_and_hold():
    keep = mc.LookupBuffer(1 << 20, mode="keep")
    cons = mc.LookupBuffer(1 << 20, mode="consume")
    t = list(range(32))
    keep.insert(t, ext(2, 1))
    cons.insert(t, ext(2, 1))
    assert keep.lookup(t)[0] == 32 and keep.lookup(t)[0] == 32
    r = cons.lookup(t, hold=True)
    assert r.matched_tokens == 32 and r.lease is not None
    assert cons.lookup(t)[0] == 0  # consumed
    assert cons.stats()["pinned_blocks"] == 2
    cons.release(r.lease)
    assert cons.stats()["used_bytes"] == 0
    with pytest.raises(ValueError, match="not a lease"):
        cons.release(r.lease)


def test_copy_into_staging_and_hidden():
    b = mc.LookupBuffer(1 << 20, mode="consume", extents_per_block=2)
    src = ctypes.create_string_buffer(b"K" * 64 + b"V" * 64)
    hid = ctypes.create_string_buffer(b"H" * 8)
    base = ctypes.addressof(src)
    kv = [(base, 32, 1), (base + 64, 32, 2)]
    b.insert(list(range(16)), kv, hidden=[(ctypes.addressof(hid), 8, 9)], copy=True)
    ctypes.memset(src, 0, 128)
    r = b.lookup(list(range(16)), hold=True)
    (a0, l0, g0), (a1, l1, g1) = r.extents
    assert (l0, g0, l1, g1) == (32, 1, 32, 2) and a0 != base
    assert ctypes.string_at(a0, 32) == b"K" * 32 and ctypes.string_at(a1, 32) == b"V" * 32
    assert ctypes.string_at(r.hidden[0][0], 8) == b"H" * 8
    b.release(r.lease)


def test_eviction_backpressure_and_errors():
    # Extents of 10 KB: large next to a block's index memory (which counts
    # against the capacity too), so the KV bytes decide here.
    ev = mc.LookupBuffer(100_000, policy="evict")
    for i in range(3):
        ev.insert([i * 1000 + j for j in range(64)], ext(4, i, 10_000))
    assert ev.stats()["evicted"] == 1 and ev.lookup(list(range(64)))[0] == 0
    with pytest.raises(mc.MooncakeError, match="holds only 100000") as e:
        ev.insert(list(range(176)), ext(11, 1, 10_000))
    assert e.value.code_name == "MC_ETOOBIG"
    bp = mc.LookupBuffer(70_000, policy="backpressure", mode="consume")
    a, c = list(range(64)), list(range(100, 164))
    bp.insert(a, ext(4, 1, 10_000))
    with pytest.raises(mc.MooncakeError, match="full") as e:
        bp.insert(c, ext(4, 2, 10_000))
    assert e.value.code_name == "MC_EBUSY"
    with pytest.raises(mc.TransferTimeout, match="after waiting"):
        bp.insert(c, ext(4, 2, 10_000), timeout=0.05)
    threading.Timer(0.1, lambda: bp.lookup(a)).start()
    assert bp.insert(c, ext(4, 2, 10_000), timeout=5) == 64  # the consumer made room
    with pytest.raises(ValueError, match="extents has 3 items"):
        bp.insert(a, ext(3, 1))
    with pytest.raises(mc.ConfigError, match="mode"):
        mc.LookupBuffer(100, mode="pop")
    with pytest.raises(mc.ConfigError, match="policy"):
        mc.LookupBuffer(100, policy="lru")


def test_expiry_and_freed_tags():
    b = mc.LookupBuffer(1 << 20, ttl_s=0.2, track_freed=True)
    b.insert(list(range(32)), ext(2, 4))
    assert b.lookup(list(range(32)))[0] == 32
    time.sleep(0.3)
    assert b.lookup(list(range(32)))[0] == 0
    assert b.stats()["expired"] == 1
    assert sorted(t for _, _, t in b.take_freed()) == [4000, 4001]
    assert b.take_freed() == []


def test_wait_freed_returns_on_expiry_or_timeout():
    b = mc.LookupBuffer(1 << 20, ttl_s=0.15, track_freed=True)
    t0 = time.monotonic()
    assert b.wait_freed(0.05) is False                 # nothing held: the timeout
    assert 0.04 < time.monotonic() - t0 < 2
    b.insert(list(range(32)), ext(2, 4))
    assert b.wait_freed(0.5) is True                   # the entry expired meanwhile
    assert sorted(t for _, _, t in b.take_freed()) == [4000, 4001]
    with pytest.raises(ValueError, match="timeout_s"):
        b.wait_freed(-1)


def test_collisions_with_weak_hash_never_return_wrong_kv():
    b = mc.LookupBuffer(1 << 24, _test_weak_hash_bits=3)
    seqs = []
    for i in range(100):
        t = list(range(48))
        t[(i % 3) * 16 + 2] = 10000 + i
        seqs.append(t)
        b.insert(t, ext(3, i + 1))
    assert b.stats()["collisions"] > 0
    for i, t in enumerate(seqs):
        matched, extents = b.lookup(t)
        assert matched == 48
        assert all(tag // 1000 == i + 1 for _, _, tag in extents[i % 3:])


def test_threads_share_one_buffer():
    b = mc.LookupBuffer(20000, mode="consume")
    errors = []

    def work(k):
        for i in range(300):
            key = (k * 7 + i) % 40
            t = [key * 100 + j for j in range(64)]
            try:
                b.insert(t, ext(4, key))
                m, e = b.lookup(t)
                if m and any(tag // 1000 != key for _, _, tag in e):
                    errors.append((key, e))
            except mc.MooncakeError as exc:  # pragma: no cover
                errors.append(exc)

    in_threads(work, 4)
    assert not errors
    assert b.stats()["pinned_blocks"] == 0


def test_torch_cpu_tensors_are_read_in_place():
    torch = pytest.importorskip("torch")
    import mooncake_connector as mc

    ids = list(range(100, 164))
    for dtype in (torch.int32, torch.int64):
        t = torch.tensor(ids, dtype=dtype)
        assert mc.hash_token_blocks(t) == mc.hash_token_blocks(ids)
    with pytest.raises(TypeError, match="torch.int32 or torch.int64"):
        mc.hash_token_blocks(torch.tensor(ids, dtype=torch.float32))
    with pytest.raises(TypeError, match="contiguous"):
        mc.hash_token_blocks(torch.tensor(ids + ids, dtype=torch.int64)[::2])



def test_remove_at_most_n_entries_of_exactly_that_prompt():
    """remove(tokens, max=n): n pulls' worth of one prompt's entries (each
    insert of the same prompt is its own entry in consume mode), never a
    longer prompt's through the same blocks."""
    b = mc.LookupBuffer(1 << 20, block_size=16, mode="consume")
    a = list(range(32))
    for _ in range(3):
        assert b.insert(a, ext(2, 1)) == 32
    assert b.insert(a + list(range(100, 116)), ext(3, 2)) == 48
    assert b.stats()["entries"] == 4
    assert b.remove(a, max=2) == 2 and b.stats()["entries"] == 2
    assert b.remove(a, max=5) == 1 and b.stats()["entries"] == 1
    assert b.remove(a, max=1) == 0 and b.stats()["entries"] == 1  # the longer one stays
    assert b.lookup(a + list(range(100, 116))).matched_tokens == 48
    with pytest.raises(ValueError):
        b.remove(a, max=-1)
