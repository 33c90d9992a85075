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
    # The part of one block after the block dimension must be contiguous.
    expect = 1
    for k in range(len(shape) - 1, d, -1):
        if shape[k] > 1 and strides[k] != expect:
            raise LayoutError(f"KV cache tensor {name!r} (shape {tuple(shape)}, strides "
                              f"{tuple(strides)}) is not contiguous within a block")
        expect *= shape[k]
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
                       block_bytes=inner * esize)


class KVLayout:
    def __init__(self, kv_caches, num_blocks=None):
        if not kv_caches:
            raise LayoutError("no KV cache tensors to register")
        items = list(kv_caches.items())
        if num_blocks is None:
            num_blocks = _guess_num_blocks([t for _, t in items])
        self.num_blocks = num_blocks
        self.layers = [_layer(n, t, num_blocks) for n, t in items]
        self.extents_per_block = sum(len(L.outer) for L in self.layers)
        self.devices = sorted({L.device for L in self.layers})

    def regions(self):
        """(addr, length, device) to register: each storage once."""
        seen, out = set(), []
        for L in self.layers:
            if L.reg_base not in seen:
                seen.add(L.reg_base)
                out.append((L.reg_base, L.nbytes, L.device))
        return out

    def block_extents(self, block_id, tag=0):
        """The extents of one block, layer-major: [(addr, len, tag), ...]."""
        if not 0 <= block_id < self.num_blocks:
            raise LayoutError(f"block id {block_id} is outside 0..{self.num_blocks - 1}")
        out = []
        for L in self.layers:
            off = L.base + block_id * L.block_stride
            for o in L.outer:
                out.append((off + o, L.block_bytes, tag))
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
