"""connector/layout.py on the KV-cache tensor shapes vLLM's attention
backends hand the connector (CPU tensors of the same shapes and strides)."""
import pytest

torch = pytest.importorskip("torch")

from mooncake_connector.connector import tp_map  # noqa: E402
from mooncake_connector.connector.layout import KVLayout, LayoutError  # noqa: E402

NB, BS, H, D = 6, 16, 2, 8


def _floats_at(flat, addr, n):
    """The float32 values in the n bytes at address addr of a contiguous tensor."""
    off = addr - flat.data_ptr()
    assert 0 <= off and off + n <= flat.numel() * 4 and off % 4 == 0
    return flat[off // 4:(off + n) // 4]


def _triton_nhd(nb=NB):
    """TRITON_ATTN with the NHD layout (vLLM 0.26): logical shape
    (blocks, heads, block_size, 2*head_size), stored (blocks, block_size,
    heads, 2*head_size): a permuted view, dense per block."""
    raw = torch.arange(nb * BS * H * 2 * D, dtype=torch.float32).view(nb, BS, H, 2 * D)
    return raw.permute(0, 2, 1, 3)


def test_flash_attention_layout_two_outer_slices():
    t = torch.zeros(2, NB, BS, H, D)
    L = KVLayout({"l0": t}, num_blocks=NB, heads=H, block_size=BS)
    assert L.extents_per_block == 2 and L.bytes_per_block() == 2 * BS * H * D * 4
    assert L.head_order == tp_map.TOKENS_OUTER


def test_a_permuted_but_dense_block_is_accepted_in_memory_order():
    t = _triton_nhd()
    assert not t.is_contiguous()
    L = KVLayout({"l0": t}, num_blocks=NB, heads=H, block_size=BS)
    (layer,) = L.layers
    assert layer.inner == (BS, H, 2 * D)  # memory order, not the logical one
    assert L.head_order == tp_map.TOKENS_OUTER
    assert L.extents_per_block == 1
    for b in range(NB):
        (addr, n, _), = L.block_extents(b)
        assert n == BS * H * 2 * D * 4
        # The extent is exactly block b's elements, whatever the view's order.
        got = _floats_at(t.permute(0, 2, 1, 3).reshape(-1), addr, n)
        assert torch.equal(got.sort().values, t[b].reshape(-1).sort().values)


def test_a_block_with_a_hole_is_refused():
    raw = torch.zeros(NB, BS, H, 2 * D + 4)
    t = raw[..., :2 * D].permute(0, 2, 1, 3)  # padded rows: not one dense run
    with pytest.raises(LayoutError, match="not contiguous within a block"):
        KVLayout({"l0": t}, num_blocks=NB)


def test_layer_extents_are_block_extents_one_layer_at_a_time():
    """layer_extents(row, li) (the push flow's per-layer writes) is
    block_extents(row)'s slice for layer li, in order, for one KV-cache
    group and for two (HMA rows), and checks the row the same way."""
    kv = {"a": torch.zeros(2, NB, BS, H, D), "b": _triton_nhd(), "c": torch.zeros(2, NB, BS, H, D)}
    for groups, rows in ((None, [0, 3, NB - 1]), ({"b": 1}, [(0, 2), (5, 1), (3, 0)])):
        L = KVLayout(kv, num_blocks=NB, heads=H, block_size=BS, layer_groups=groups)
        off = 0
        for li, lay in enumerate(L.layers):
            n = len(lay.outer)
            for row in rows:
                whole = L.block_extents(row)
                assert L.layer_extents(row, li) == [(a, ln) for a, ln, _ in whole[off:off + n]]
            off += n
        assert off == L.extents_per_block
        with pytest.raises(LayoutError):
            L.layer_extents(NB, 0)
