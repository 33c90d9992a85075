"""tp_map: consumer TP ranks find their KV heads at the right producer ranks,
checked by moving bytes: every (prefill TP, decode TP, KV heads, layout)
shape builds the ranks' block extents the way vLLM shards heads, applies the
plan's pieces, and compares with what the decode rank would hold had it
computed the prompt itself."""
import itertools

import pytest

from mooncake_connector.connector import tp_map
from mooncake_connector.connector.tp_map import TPMapError

HEAD = 24  # bytes of one head in one block extent (block_size x head_size x dtype, tiny)


def vllm_heads(rank, tp, total):
    """vLLM's QKVParallelLinear: rank r holds shard r // replicas."""
    if total >= tp:
        n = total // tp
        return list(range(rank * n, (rank + 1) * n))
    return [rank // (tp // total)]


def extent(heads, layout, block_tokens=3):
    """One block extent holding `heads`: per head HEAD bytes; heads-outer
    is [head][token] bytes, tokens-outer [token][head]."""
    per_tok = HEAD // block_tokens
    if layout == tp_map.HEADS_OUTER:
        return bytes(b for h in heads for t in range(block_tokens)
                     for b in [(h * 31 + t * 7 + i) % 251 for i in range(per_tok)])
    return bytes(b for t in range(block_tokens) for h in heads
                 for b in [(h * 31 + t * 7 + i) % 251 for i in range(per_tok)])


def shapes():
    for p_tp, d_tp in itertools.product([1, 2, 4, 8], repeat=2):
        for heads in [1, 2, 4, 8, 16]:
            if all((heads % t == 0) if heads >= t else (t % heads == 0) for t in (p_tp, d_tp)):
                yield p_tp, d_tp, heads


@pytest.mark.parametrize("layout", [tp_map.HEADS_OUTER, tp_map.TOKENS_OUTER])
@pytest.mark.parametrize("p_tp,d_tp,heads", list(shapes()))
def test_every_decode_rank_gets_exactly_its_heads(p_tp, d_tp, heads, layout):
    pl = tp_map.plan(p_tp, d_tp, heads)
    prod = [extent(vllm_heads(p, p_tp, heads), layout) for p in range(p_tp)]
    pulls = [0] * p_tp
    for d in range(d_tp):
        want = extent(vllm_heads(d, d_tp, heads), layout)
        try:
            got = tp_map.pieces(pl, d, len(prod[0]), len(want), layout)
        except TPMapError as e:
            # Only a strided layout with unequal shares may refuse, and it says why.
            assert layout == tp_map.TOKENS_OUTER and pl.p_heads != pl.d_heads
            assert f"--tensor-parallel-size {p_tp}" in str(e) and \
                f"--tensor-parallel-size {d_tp}" in str(e)
            return
        buf = bytearray(len(want))
        seen = set()
        for p_rank, pc in got:
            assert p_rank not in seen  # one pull per producer rank
            seen.add(p_rank)
            pulls[p_rank] += 1
            src = prod[p_rank]
            assert pc.src_off + pc.length <= len(src)
            assert pc.whole == (pc.src_off == 0 and pc.length == len(src))
            buf[pc.dst_off:pc.dst_off + pc.length] = src[pc.src_off:pc.src_off + pc.length]
        covered = sorted((pc.dst_off, pc.dst_off + pc.length) for _, pc in got)
        assert covered[0][0] == 0 and covered[-1][1] == len(want)
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))  # no gap, no overlap
        assert bytes(buf) == want, (d, got)
    assert pulls == pl.fanout  # a producer keeps one copy of an entry per pull it serves


def test_equal_tp_is_rank_to_rank():
    for tp, heads in [(1, 1), (2, 2), (2, 8), (4, 2), (8, 1)]:
        pl = tp_map.plan(tp, tp, heads)
        assert pl.identity and pl.fanout == [1] * tp
        for d in range(tp):
            (p, pc), = tp_map.pieces(pl, d, 96, 96, tp_map.TOKENS_OUTER)
            assert p == d and pc.whole and pc.dest(1000) == (1000, 96)


def test_replicated_heads_spread_over_producer_replicas():
    # 2 KV heads, prefill TP 8 (4 replicas each), decode TP 4 (2 replicas each).
    pl = tp_map.plan(8, 4, 2)
    assert [[r.p_rank for r in rs] for rs in pl.reads] == [[0], [1], [4], [5]]
    assert pl.fanout == [1, 1, 0, 0, 1, 1, 0, 0]  # ranks 2, 3, 6, 7 publish nothing


def test_split_reads_are_slices_with_the_engine_tag():
    pl = tp_map.plan(1, 2, 4)
    (p, pc), = tp_map.pieces(pl, 1, 400, 200, tp_map.HEADS_OUTER)
    assert p == 0 and not pc.whole
    assert pc.dest(5000) == (5000, 200, tp_map.SLICE | 200)


def test_mla_every_decode_rank_reads_one_whole_block():
    pl = tp_map.plan(2, 4, 0, mla=True)
    assert [[r.p_rank for r in rs] for rs in pl.reads] == [[0], [1], [0], [1]]
    assert pl.fanout == [2, 2]
    for d in range(4):
        (_, pc), = tp_map.pieces(pl, d, 64, 64, tp_map.UNKNOWN)
        assert pc.whole


@pytest.mark.parametrize("args,frag", [
    ((3, 1, 4), "4 KV heads do not divide over prefill --tensor-parallel-size 3"),
    ((1, 3, 2), "decode --tensor-parallel-size 3 is not a multiple of the 2 KV heads"),
    ((0, 1, 2), "prefill tensor-parallel size must be an integer >= 1"),
    ((1, 1, 0), "number of KV heads must be >= 1"),
])
def test_impossible_shapes_name_the_setting(args, frag):
    with pytest.raises(TPMapError, match=frag):
        tp_map.plan(*args)


def test_extent_size_mismatch_names_both_sides():
    pl = tp_map.plan(2, 1, 2)
    with pytest.raises(TPMapError) as ei:
        tp_map.pieces(pl, 0, 100, 300, tp_map.HEADS_OUTER)
    msg = str(ei.value)
    assert "prefill --tensor-parallel-size 2, decode --tensor-parallel-size 1" in msg
    assert "same model, dtype and --block-size" in msg


def test_unknown_layout_refuses_unequal_shares_and_says_how():
    pl = tp_map.plan(2, 1, 2)
    with pytest.raises(TPMapError, match="same --tensor-parallel-size on both sides"):
        tp_map.pieces(pl, 0, 48, 96, tp_map.UNKNOWN)
    with pytest.raises(TPMapError, match="unknown KV layout"):
        tp_map.pieces(pl, 0, 48, 96, "diagonal")
