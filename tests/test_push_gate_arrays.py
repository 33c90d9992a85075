"""push.py's per-layer arrays of a CUDA-gated target (_gate_arrays, one C
pass: _core.gate_arrays) give exactly the arrays of a Python loop over the
blocks and extents (the reference below, through push.py's _collect, what
the ungated path writes), in its order, each layer's bytes, and the same
first error, on the KV-cache shapes of test_layout.py (two outer slices per
layer, a permuted TRITON layout, MLA's one slice, HMA's two groups with
null blocks on the consumer)."""
import random
from array import array
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from mooncake_connector.connector.layout import KVLayout  # noqa: E402
from mooncake_connector.connector.push import PushProducer  # noqa: E402

NB, BS, H, D = 9, 16, 2, 8


def _triton_nhd():
    raw = torch.zeros(NB, BS, H, 2 * D)
    return raw.permute(0, 2, 1, 3)


def _layouts():
    flash = {f"l{i}": torch.zeros(2, NB, BS, H, D) for i in range(3)}
    yield "flash", KVLayout(flash, num_blocks=NB, heads=H, block_size=BS), None
    mixed = {"a": torch.zeros(2, NB, BS, H, D), "b": _triton_nhd(), "c": torch.zeros(NB, BS, D)}
    yield "mixed", KVLayout(mixed, num_blocks=NB, heads=H, block_size=BS), None
    hma = {"a": torch.zeros(2, NB, BS, H, D), "b": torch.zeros(2, NB, BS, H, D)}
    yield "hma", KVLayout(hma, num_blocks=NB, heads=H, block_size=BS,
                          layer_groups={"b": 1}), 1


def _producer(layout):
    return PushProducer(SimpleNamespace(layout=layout))


def _target(layout, rng, nblocks, skip, nulls=True):
    """A decode's target: per block and extent (dest address, bytes, source offset)."""
    dest = array("Q")
    for _ in range(nblocks):
        for L in layout.layers:
            for _o in L.outer:
                n = 0 if nulls and rng.random() < 0.15 else rng.randint(1, L.block_bytes)
                off = rng.randint(0, L.block_bytes - n)
                dest.extend((rng.randrange(1 << 40, 1 << 47), n, off))
    return SimpleNamespace(dest=dest, skip=skip, nblocks=nblocks, lnotify=False, garr=None,
                           stop=None)


def _rows(groups, rng, n):
    if groups is None:
        return rng.sample(range(NB), n), None
    return rng.sample(range(NB), n), [[rng.randrange(NB) for _ in range(n)]]


def _loop(p, rows, tg):
    """The reference: the arrays one block and extent at a time."""
    per = [(array("Q"), array("Q"), array("Q")) for _ in p._layer_off]
    if not p._collect(tg, rows, range(len(per)), per.__getitem__):
        return None
    return per


def _both(p, job, tg):
    """(C build through _gate_arrays, loop build), each on its own copy of
    the target: (arrays, stop), the C one's bytes per layer checked."""
    rows = job.spec.block_ids if not job.spec.more_groups else \
        list(zip(job.spec.block_ids, *job.spec.more_groups))
    rows = rows[tg.skip:tg.skip + tg.nblocks]
    t1, t2 = (SimpleNamespace(**vars(tg), gbytes=None) for _ in range(2))
    loop = _loop(p, rows, t2)
    c = p._gate_arrays(job, t1)
    if c is not None:
        assert all(isinstance(v, array) and v.typecode == "Q" for x in c for v in x)
        assert t1.gbytes == [sum(x[2]) for x in c] and t1.stop is None
        assert p._gate_arrays(job, t1) is c  # built once
    return (c, t1.stop), (loop, t2.stop)


@pytest.mark.parametrize("seed", range(4))
def test_c_build_equals_the_loop(seed):
    rng = random.Random(seed)
    for name, layout, groups in _layouts():
        p = _producer(layout)
        ids, more = _rows(groups, rng, 7)
        job = SimpleNamespace(tid="t", spec=SimpleNamespace(block_ids=ids, more_groups=more))
        for skip, nb in ((0, 7), (2, 4), (6, 1)):
            tg = _target(layout, rng, nb, skip)
            (a, stop_a), (b, stop_b) = _both(p, job, tg)
            assert stop_a is None and stop_b is None, (name, stop_a, stop_b)
            assert len(a) == len(b) == len(layout.layers)
            for li, (x, y) in enumerate(zip(a, b)):
                assert [v.tolist() for v in x] == [v.tolist() for v in y], (name, li)
            assert sum(len(x[0]) for x in a) > 0


def test_c_build_reports_the_loops_first_bad_extent():
    rng = random.Random(7)
    for name, layout, groups in _layouts():
        p = _producer(layout)
        ids, more = _rows(groups, rng, 6)
        job = SimpleNamespace(tid="t", spec=SimpleNamespace(block_ids=ids, more_groups=more))
        epb = layout.extents_per_block
        for bad in ((4, epb - 1), (1, 0), (1, epb - 1), (5, 0)):
            tg = _target(layout, rng, 6, 0, nulls=False)
            # two oversized extents: the loop's order (block, then layer, then
            # extent) decides which one is named
            for b, k in (bad, (bad[0] + 1 if bad[0] < 5 else bad[0], 0)):
                i = (b * epb + k) * 3
                tg.dest[i + 1], tg.dest[i + 2] = 3, (1 << 63)  # offset past any extent
            (a, stop_a), (b_, stop_b) = _both(p, job, tg)
            assert a is None and b_ is None
            assert stop_a == stop_b and "exceed this side's" in stop_a, (name, stop_a, stop_b)
        # bytes that do not fit from a valid offset, and a wrap-around attempt
        tg = _target(layout, rng, 6, 0, nulls=False)
        tg.dest[3 * 3 + 1], tg.dest[3 * 3 + 2] = (1 << 64) - 1, 1
        (a, stop_a), (b_, stop_b) = _both(p, job, tg)
        assert a is None and stop_a == stop_b and stop_a.startswith("extent 3 of block 0"), stop_a


def test_c_build_names_a_block_id_out_of_range_and_layer_notes_match_encode():
    from mooncake_connector import _core
    from mooncake_connector.connector.layout import LayoutError
    from mooncake_connector.connector.push import _layer_notes, encode
    _, layout, _ = next(_layouts())
    p = _producer(layout)
    tg = _target(layout, random.Random(1), 2, 0)
    job = SimpleNamespace(tid="t", spec=SimpleNamespace(block_ids=[0, 1], more_groups=None))
    assert p._gate_arrays(job, SimpleNamespace(**vars(tg), gbytes=None)) is not None
    layers = p._gate_spec
    with pytest.raises(ValueError, match=f"block id {NB} is outside 0..{NB - 1}"):
        _core.gate_arrays(array("Q", [0, NB]), tg.dest, layout.extents_per_block, 1, layers, NB)
    with pytest.raises(ValueError, match="not blocks x"):
        _core.gate_arrays(array("Q", [0]), tg.dest, layout.extents_per_block, 1, layers, NB)
    # ids the array cannot hold: named as the layout names them
    job = SimpleNamespace(tid="t", spec=SimpleNamespace(block_ids=[0, -1], more_groups=None))
    with pytest.raises(LayoutError, match="block id -1 is outside"):
        p._gate_arrays(job, SimpleNamespace(**vars(tg), gbytes=None))
    for tid in ("t", 'a"b\\c', "\u00e9x"):
        assert _layer_notes(tid, 3) == [encode({"t": "layer", "tid": tid, "l": [li]})
                                        for li in range(3)]


# ---- the consumer's target body (PushConsumer.start, the decode's start_load_kv)


def _pieces(layout, rng, slices):
    """One tp_map.Piece per layer: whole extents, or head slices (a TP map)."""
    from mooncake_connector.connector.tp_map import Piece
    out = []
    for L in layout.layers:
        if not slices:
            out.append(Piece(dst_off=0, length=L.block_bytes, src_off=0, whole=True))
            continue
        n = rng.randint(1, L.block_bytes)
        out.append(Piece(dst_off=rng.randint(0, L.block_bytes - n), length=n,
                         src_off=rng.randint(0, 4 * L.block_bytes), whole=False))
    return out


def _body_loop(layout, rows, pieces):
    """The reference: the body PushConsumer.start built block by block
    through layout.mapped_extents before the C pass."""
    from mooncake_connector.connector.tp_map import SLICE
    flat = array("Q")
    for t in layout.mapped_extents(rows, pieces):
        flat.extend((t[0], t[1], (t[2] & ~SLICE) if len(t) > 2 else 0))
    return flat.tobytes()


@pytest.mark.parametrize("seed", range(4))
def test_target_body_c_equals_the_mapped_extents_loop(seed):
    from mooncake_connector import _core
    from mooncake_connector.connector.push import _row_ids, _target_spec
    rng = random.Random(seed)
    for name, layout, groups in _layouts():
        for slices in (False, True):
            pieces = _pieces(layout, rng, slices)
            for n in (1, 5, NB):
                ids, more = _rows(groups, rng, n)
                rows = ids if more is None else list(zip(ids, *more))
                if more is not None:  # a null block (id 0) of the second group
                    rows[0] = (rows[0][0], 0)
                want = _body_loop(layout, rows, pieces)
                got = _core.target_extents(_row_ids(layout, rows), layout.num_groups,
                                           layout.num_blocks, _target_spec(layout, pieces))
                assert isinstance(got, bytes) and got == want, (name, slices, n)
                assert len(got) == 24 * n * layout.extents_per_block


def test_target_body_names_a_bad_block_id_as_the_layout_does():
    from mooncake_connector import _core
    from mooncake_connector.connector.layout import LayoutError
    from mooncake_connector.connector.push import _row_ids, _target_spec
    for name, layout, groups in _layouts():
        spec = _target_spec(layout, _pieces(layout, random.Random(3), False))
        with pytest.raises(ValueError, match=f"block id {NB} is outside 0..{NB - 1}"):
            _core.target_extents(array("Q", [1] * layout.num_groups + [NB] * layout.num_groups),
                                 layout.num_groups, NB, spec)
        with pytest.raises(LayoutError, match="block id -1 is outside"):
            _row_ids(layout, [1, -1] if groups is None else [(1, 1), (-1, 2)])
    _, layout, _ = next(_layouts())
    spec = _target_spec(layout, _pieces(layout, random.Random(3), False))
    with pytest.raises(ValueError, match="groups must be >= 1"):
        _core.target_extents(array("Q", [1]), 0, NB, spec)
    with pytest.raises(TypeError, match="bytes-like"):
        _core.target_extents([1, 2], 1, NB, spec)
    with pytest.raises(TypeError, match=r"target_extents: ids must be an array\('Q'\)"):
        _core.target_extents(array("i", [1, 2]), 1, NB, spec)
    with pytest.raises(ValueError, match="2 layer pieces for 3 layers"):
        _target_spec(layout, _pieces(layout, random.Random(3), False)[:2])


def _consumer(layout, sent):
    from mooncake_connector.connector.push import PushConsumer
    pieces = _pieces(layout, random.Random(5), True)
    w = SimpleNamespace(
        s=SimpleNamespace(push_layer_timeout_s=5.0, load_timeout_s=5.0), layout=layout,
        kv=object(), routes=SimpleNamespace(route=lambda base, producer_tp=None: [("p:1", pieces)]),
        default_producer="p:1", block_size=BS, tp_rank=0,
        push_outbox=SimpleNamespace(send=lambda name, msg, **kw: sent.append(msg),
                                    delivered_to=lambda name: True))
    return PushConsumer(w), pieces


def _start(layout, nblocks, tid):
    """PushConsumer.start of one layer load of nblocks blocks: (Python calls
    made, the target sent, the pieces)."""
    import sys
    sent = []
    c, pieces = _consumer(layout, sent)
    spec = SimpleNamespace(push_tid=tid, layer_load=True, producer=None, producer_tp=None,
                           skip_blocks=0, block_ids=list(range(1, nblocks + 1)),
                           more_groups=None, tokens=list(range(nblocks * BS)), req_id=tid)
    ld = SimpleNamespace(spec=spec)
    calls = [0]

    def prof(frame, event, arg):
        if event == "call":
            calls[0] += 1
    sys.setprofile(prof)
    try:
        c.start(ld)
    finally:
        sys.setprofile(None)
    assert ld.push.error is None and ld.push.ranks == {"p:1": "sending"}
    return calls[0], sent, pieces


def test_decode_target_costs_no_python_step_per_block():
    """The decode's start_load_kv builds the target's extents in one C pass:
    the Python calls it makes are the same for 2 and 8 blocks (the loop
    through layout.mapped_extents made a call per block and extent); the
    message is the loop's, byte for byte."""
    from mooncake_connector.connector.push import decode
    layout = KVLayout({f"l{i}": torch.zeros(2, 9, BS, H, D) for i in range(3)}, num_blocks=9,
                      heads=H, block_size=BS)
    _start(layout, 2, "w")  # imports and caches first
    few, sent_few, _ = _start(layout, 2, "a")
    many, sent, pieces = _start(layout, 8, "b")
    assert many == few, (few, many)
    head, body = decode(sent[0])
    assert head["n"] == 8 * layout.extents_per_block and head["lnotify"] is True
    assert body == _body_loop(layout, list(range(1, 9)), pieces)


def test_a_bad_layer_gives_back_the_earlier_layers_outer_arrays():
    """A layer refused after others were parsed: the earlier layers' outer
    offsets arrays are no longer exported (gate_arrays kept their views
    before: an array('Q') that then could not grow), as target_extents."""
    from mooncake_connector import _core
    ids, dest = array("Q", [1]), array("Q", [0, 8, 0])
    o1, o2 = array("Q", [0]), array("Q", [0])
    with pytest.raises(ValueError, match="layer 1's extents"):
        _core.gate_arrays(ids, dest, 1, 1, ((0, 1, 0, 0, 64, 64, o1), (0, 1, 0, 5, 64, 64, o2)), 4)
    with pytest.raises(ValueError, match="layer 1's group"):
        _core.target_extents(ids, 1, 4, ((0, 0, 64, o1, 0, 8, 0), (0, 5, 64, o2, 0, 8, 0)))
    o1.append(1)  # BufferError while a view is held
    o2.append(1)
