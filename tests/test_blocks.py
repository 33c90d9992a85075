"""Block extents of paged KV tensors, and coalescing of contiguous runs."""
import numpy as np
import pytest

from mooncake_connector.blocks import block_bytes, block_extents, coalesce


def test_extents_of_a_paged_cache():
    kv = np.zeros((10, 2, 16, 8), dtype=np.float32)  # blocks, k/v-heads, tokens, dim
    base = kv.__array_interface__["data"][0]
    bb = 2 * 16 * 8 * 4
    assert block_bytes(kv) == bb
    assert block_extents(kv, [3, 0, 9]) == [(base + 3 * bb, bb), (base, bb), (base + 9 * bb, bb)]
    with pytest.raises(IndexError, match="out of range"):
        block_extents(kv, [10])


def test_block_dimension_other_than_first():
    kv = np.zeros((2, 10, 64), dtype=np.float16)  # K/V first, then blocks
    base = kv.__array_interface__["data"][0]
    ext = block_extents(kv[0], [1, 2])
    assert ext == [(base + 128, 128), (base + 256, 128)]
    with pytest.raises(ValueError, match="contiguous"):
        block_extents(kv, [1], dim=1)  # a block spans both K and V halves: not contiguous


def test_coalesce_joins_runs_contiguous_on_both_sides():
    src = [(1000, 10), (1010, 10), (1020, 10), (2000, 10), (2010, 10)]
    dst = [(5000, 10), (5010, 10), (7000, 10), (7010, 10), (7020, 10)]
    s, d = coalesce(src, dst)
    assert s == [(1000, 20), (1020, 10), (2000, 20)]
    assert d == [(5000, 20), (7000, 10), (7010, 20)]
    assert sum(x[1] for x in s) == 50
    with pytest.raises(ValueError):
        coalesce(src, dst[:2])


def test_torch_tensors_if_available():
    torch = pytest.importorskip("torch")
    kv = torch.zeros((4, 16, 8), dtype=torch.float16)
    assert block_extents(kv, [2]) == [(kv.data_ptr() + 2 * 256, 256)]
    assert block_bytes(kv[:, :8, :]) == 128  # first 8 tokens of each block: still dense
    with pytest.raises(ValueError, match="contiguous"):
        block_extents(kv[:, ::2, :], [0])
