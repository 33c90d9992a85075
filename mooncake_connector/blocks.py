"""Address helpers for paged KV caches: from a tensor and block ids to the
(addr, length) extents the engine and send_kv/recv_kv take.

Works on torch tensors (CPU or CUDA: only data_ptr(), stride() and
element_size() are used; torch is not imported here) and on numpy arrays.
The block dimension is dimension `dim` (0 by default, as in vLLM's per-layer
KV tensors); each block must be contiguous in memory.
"""
from math import prod

__all__ = ["block_bytes", "block_extents", "coalesce"]


def _layout(t, dim):
    if hasattr(t, "data_ptr"):  # torch
        base, item = t.data_ptr(), t.element_size()
        shape, strides = tuple(t.shape), tuple(s * item for s in t.stride())
    elif hasattr(t, "__array_interface__"):  # numpy and friends
        ai = t.__array_interface__
        base, item, shape = ai["data"][0], t.itemsize, tuple(t.shape)
        strides = tuple(t.strides)
    else:
        raise TypeError(f"expected a torch tensor or numpy array, not {type(t).__name__}")
    if not shape:
        raise ValueError("a 0-dimensional tensor has no blocks")
    if not -len(shape) <= dim < len(shape):
        raise ValueError(f"dim {dim} is out of range for a {len(shape)}-d tensor")
    dim %= len(shape)
    inner = [(s, st) for i, (s, st) in enumerate(zip(shape, strides)) if i != dim and s != 1]
    # Each block must be one contiguous run: the other dims, in order, dense.
    expect = item
    for s, st in sorted(inner, key=lambda x: x[1]):
        if st != expect:
            raise ValueError("each block must be contiguous in memory (the non-block "
                             "dimensions must be dense)")
        expect *= s
    nbytes = prod(s for i, s in enumerate(shape) if i != dim) * item
    return base, shape[dim], strides[dim], nbytes


def block_bytes(t, dim=0):
    """Bytes in one block of `t`."""
    return _layout(t, dim)[3]


def block_extents(t, block_ids, dim=0):
    """[(addr, length), ...] of the given blocks of `t`, in order."""
    base, nblocks, stride, nbytes = _layout(t, dim)
    out = []
    for b in block_ids:
        b = int(b)
        if not 0 <= b < nblocks:
            raise IndexError(f"block id {b} is out of range (tensor has {nblocks} blocks)")
        out.append((base + b * stride, nbytes))
    return out


def coalesce(*extent_lists):
    """Merges runs that are contiguous on every side at once.

    coalesce(src, dst) takes parallel lists of (addr, length) extents and
    returns parallel lists where consecutive pairs that continue each other
    on both sides (e.g. consecutive block ids on both sides) are joined:
    fewer, larger transfer requests for the same bytes."""
    if not extent_lists:
        return []
    n = len(extent_lists[0])
    if any(len(x) != n for x in extent_lists):
        raise ValueError("extent lists must have the same length")
    if any(x[i][1] != extent_lists[0][i][1] for x in extent_lists for i in range(n)):
        raise ValueError("paired extents must have the same lengths")
    out = [[] for _ in extent_lists]
    for i in range(n):
        cont = bool(out[0]) and all(
            o[-1][0] + o[-1][1] == x[i][0] for o, x in zip(out, extent_lists))
        for o, x in zip(out, extent_lists):
            if cont:
                o[-1] = (o[-1][0], o[-1][1] + x[i][1])
            else:
                o.append((x[i][0], x[i][1]))
    return out
