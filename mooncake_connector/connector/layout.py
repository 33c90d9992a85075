"""Paged KV-cache tensors -> the memory extents of one block.

vLLM hands the worker one tensor per attention layer.  Somewhere in its shape
is the block dimension (size = number of blocks); dimensions before it (e.g.
the K/V split of FlashAttention's (2, num_blocks, ...)) each give a separate
extent per block; everything after it must be one contiguous run per block.
So one block of the whole model is `extents_per_block` = sum over layers of
the product of the outer dimensions, each `block_bytes` long, at
  base + outer_index * outer_stride + block_id * block_stride.
Tensors cross as addresses and sizes: nothing here needs torch beyond the
tensor's own attributes.
"""
from dataclasses import dataclass


class LayoutError(ValueError):
    pass


NULL_BLOCK = 0  # vLLM's block pool reserves block 0 as the null (placeholder) block


@dataclass
class LayerLayout:
    name: str
    base: int          # data_ptr
    reg_base: int      # the storage this view lives in (layers may share one)
    nbytes: int        # bytes of that storage, for registration
    device: str        # "cpu" or "cuda:N"
    outer: list        # byte offsets of each outer slice (K, V, ...)
    block_stride: int  # bytes between consecutive blocks
    block_bytes: int   # bytes of one block in one outer slice
    inner: tuple = ()  # the dimensions of one block after the block dimension
    group: int = 0     # KV-cache group (HMA): which of a block row's ids is this layer's


def _layer(name, t, num_blocks):
    shape, strides = list(t.shape), list(t.stride())
    esize = t.element_size()
    dims = [d for d, n in enumerate(shape) if n == num_blocks]
    if not dims:
        raise LayoutError(f"KV cache tensor {name!r} of shape {tuple(shape)} has no dimension "
                          f"of {num_blocks} blocks; this KV-cache layout is not supported")
    d = dims[0]
    inner = 1
    for n in shape[d + 1:]:
        inner *= n
    # The part of one block after the block dimension must be one dense run.
    # Its dimensions may be a permuted view (vLLM's TRITON_ATTN hands out its
    # (blocks, heads, block_size, 2*head_size) cache stored tokens-first:
    # get_kv_cache_stride_order), so they are checked, and described in
    # `inner`, in memory order (largest stride first).
    in_mem = sorted((k for k in range(d + 1, len(shape)) if shape[k] > 1),
                    key=lambda k: strides[k], reverse=True)
    expect = 1
    for k in reversed(in_mem):
        if strides[k] != expect:
            raise LayoutError(f"KV cache tensor {name!r} (shape {tuple(shape)}, strides "
                              f"{tuple(strides)}) is not contiguous within a block")
        expect *= shape[k]
    inner_dims = tuple(shape[d + 1:])
    if in_mem != [k for k in range(d + 1, len(shape)) if shape[k] > 1]:
        inner_dims = tuple(shape[k] for k in in_mem)
    if strides[d] < inner:
        raise LayoutError(f"KV cache tensor {name!r}: blocks overlap (stride {strides[d]} < "
                          f"{inner} elements per block)")
    outer = [0]
    for k in range(d):
        outer = [o + i * strides[k] * esize for o in outer for i in range(shape[k])]
    dev = t.device
    device = "cpu" if dev.type == "cpu" else f"{dev.type}:{dev.index or 0}"
    if hasattr(t, "untyped_storage"):
        st = t.untyped_storage()
        reg_base, nbytes = st.data_ptr(), st.nbytes()
    else:
        reg_base, nbytes = t.data_ptr(), t.numel() * esize
    return LayerLayout(name=name, base=t.data_ptr(), reg_base=reg_base, nbytes=nbytes,
                       device=device, outer=outer, block_stride=strides[d] * esize,
                       block_bytes=inner * esize, inner=inner_dims)


def head_order(layers, heads, block_size):
    """tp_map.HEADS_OUTER if each block extent holds its KV heads one after
    the other (vLLM's CPU layout (blocks, heads, block_size, 2*head_size)),
    TOKENS_OUTER if tokens come first (blocks, block_size, heads, head_size),
    else UNKNOWN (then only whole extents can move between TP sizes)."""
    from mooncake_connector.connector import tp_map

    if not heads or not block_size:
        return tp_map.UNKNOWN
    if heads == 1:
        return tp_map.HEADS_OUTER  # one head: the whole extent
    orders = set()
    for L in layers:
        dims = [n for n in L.inner if n > 1]
        if dims and dims[0] == heads and heads != block_size:
            orders.add(tp_map.HEADS_OUTER)
        elif dims and dims[0] == block_size and heads in dims[1:] and heads != block_size:
            orders.add(tp_map.TOKENS_OUTER)
        else:
            orders.add(tp_map.UNKNOWN)
    return orders.pop() if len(orders) == 1 else tp_map.UNKNOWN


class KVLayout:
    def __init__(self, kv_caches, num_blocks=None, heads=None, block_size=None,
                 layer_groups=None):
        if not kv_caches:
            raise LayoutError("no KV cache tensors to register")
        items = list(kv_caches.items())
        if num_blocks is None:
            num_blocks = _guess_num_blocks([t for _, t in items])
        self.num_blocks = num_blocks
        self.layers = [_layer(n, t, num_blocks) for n, t in items]
        for L in self.layers:
            L.group = (layer_groups or {}).get(L.name, 0)
        self.num_groups = 1 + max(L.group for L in self.layers)
        self.extents_per_block = sum(len(L.outer) for L in self.layers)
        self.devices = sorted({L.device for L in self.layers})
        self.head_order = head_order(self.layers, heads, block_size)
        self._index = {L.name: i for i, L in enumerate(self.layers)}

    def layer_index(self, name):
        """Position of a layer in this layout (the order extents and the push
        flow's layer indices use), or None."""
        return self._index.get(name)

    def regions(self):
        """(addr, length, device) to register: each storage once."""
        seen, out = set(), []
        for L in self.layers:
            if L.reg_base not in seen:
                seen.add(L.reg_base)
                out.append((L.reg_base, L.nbytes, L.device))
        return out

    def _row(self, block):
        """A block row: one id per KV-cache group (an int: the same for all)."""
        row = (block,) * self.num_groups if isinstance(block, int) else tuple(block)
        if len(row) < self.num_groups:
            raise LayoutError(f"block row {row} has {len(row)} ids for {self.num_groups} "
                              f"KV-cache groups")
        for b in row:
            if not 0 <= b < self.num_blocks:
                raise LayoutError(f"block id {b} is outside 0..{self.num_blocks - 1}")
        return row

    def block_extents(self, block_id, tag=0):
        """The extents of one block (row), layer-major: [(addr, len, tag), ...]."""
        row = self._row(block_id)
        out = []
        for L in self.layers:
            off = L.base + row[L.group] * L.block_stride
            for o in L.outer:
                out.append((off + o, L.block_bytes, tag))
        return out

    def layer_extents(self, block_id, li):
        """The extents of layer li of one block (row): block_extents(row)'s
        slice for that layer, [(addr, len), ...], without building the other
        layers' (the push flow writes one layer at a time)."""
        L = self.layers[li]
        off = L.base + self._row(block_id)[L.group] * L.block_stride
        return [(off + o, L.block_bytes) for o in L.outer]

    def mapped_extents(self, block_ids, per_layer):
        """Dest extents of one pull for these blocks: per_layer[i] is the
        tp_map.Piece of layer i (the same for each of its outer slices)."""
        from mooncake_connector.connector.tp_map import SLICE

        out = []
        for b in block_ids:
            row = self._row(b)
            for L, pc in zip(self.layers, per_layer):
                off = L.base + row[L.group] * L.block_stride
                # HMA: a group's null block (id 0, vLLM's placeholder for a
                # sliding-window block outside the window) is not moved.
                skip = self.num_groups > 1 and row[L.group] == NULL_BLOCK
                for o in L.outer:
                    out.append((off + o, 0, SLICE) if skip else pc.dest(off + o))
        return out

    def extents(self, block_ids, tags=None):
        out = []
        for i, b in enumerate(block_ids):
            out.extend(self.block_extents(b, 0 if tags is None else tags[i]))
        return out

    def bytes_per_block(self):
        return sum(L.block_bytes * len(L.outer) for L in self.layers)


def _guess_num_blocks(tensors):
    """CPU backends: (num_blocks, ...); FlashAttention-style: (2, num_blocks, ...)."""
    t = tensors[0]
    if t.dim() >= 3 and t.shape[0] == 2:
        return int(t.shape[1])
    return int(t.shape[0])
