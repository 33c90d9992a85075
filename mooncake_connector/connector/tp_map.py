"""Which producer TP rank(s) each consumer TP rank reads its KV heads from.

vLLM shards attention KV heads over tensor-parallel ranks (QKVParallelLinear):
with H total KV heads and TP size t,
  * H >= t (H divisible by t): rank r holds heads [r*H/t, (r+1)*H/t);
  * H < t (t divisible by H): every head is replicated on t/H ranks; rank r
    holds the one head r // (t/H).
MLA models keep one latent KV per token that is the same on every rank.

A plan says, for every consumer (decode) rank d, which producer (prefill)
ranks it pulls from and which heads of theirs land where in its own block:
`reads[d]` = [Read(p_rank, p_head, d_head, nheads)], heads counted from the
start of each rank's own slice.  Each read is one pull from that producer
rank (one contiguous run of heads).  `fanout[p]` = how many pulls producer
rank p serves per published prompt (its lookup buffer keeps that many
copies of the entry; a rank nobody reads publishes nothing).

Byte level: a block of one layer (one K/V outer slice) is `extent_bytes`
long on each side.  With the KV heads outermost within that extent (vLLM's
CPU layout (num_blocks, heads, block_size, 2*head_size), or any HND one) a
run of heads is one contiguous byte range, so a read is one producer extent
into part of a consumer extent (merge, consumer TP < producer TP) or part of
a producer extent into a whole consumer extent (split, the engine's slice
read).  With tokens outermost (NHD) the heads of a block are strided: only
reads that move whole extents work, i.e. equal head counts per rank.

Pure Python, no vLLM or extension import: unit-tested over many shapes.
"""
from dataclasses import dataclass, field

HEADS_OUTER = "heads_outer"   # heads outermost within a block extent (contiguous per head)
TOKENS_OUTER = "tokens_outer"  # tokens outermost (heads strided within a token)
UNKNOWN = "unknown"           # could not tell: only whole-extent reads
LAYOUTS = (HEADS_OUTER, TOKENS_OUTER, UNKNOWN)

# The engine's pull reads `len` bytes from byte `offset` of the producer's
# extent when a dest extent's tag is SLICE | offset (MC_KV_DEST_SLICE in
# csrc/kv/kv_transfer.h).
SLICE = 1 << 63


class TPMapError(ValueError):
    """The two sides' parallel settings cannot be mapped; says both."""


@dataclass(frozen=True)
class Read:
    p_rank: int   # producer TP rank to pull from
    p_head: int   # first head, counted within the producer rank's heads
    d_head: int   # where it lands, counted within this consumer rank's heads
    nheads: int


@dataclass
class Plan:
    p_tp: int
    d_tp: int
    kv_heads: int          # total KV heads of the model (1 for MLA)
    mla: bool
    p_heads: int           # heads per producer rank
    d_heads: int           # heads per consumer rank
    reads: list = field(default_factory=list)   # reads[d] = [Read, ...]
    fanout: list = field(default_factory=list)  # fanout[p] = pulls served per prompt

    @property
    def identity(self):
        """Every consumer rank d reads exactly producer rank d, whole."""
        return all(len(rs) == 1 and rs[0] == Read(d, 0, 0, self.p_heads) and
                   self.p_heads == self.d_heads for d, rs in enumerate(self.reads))


def _sides(p_tp, d_tp, kv_heads, mla):
    return (f"prefill --tensor-parallel-size {p_tp}, decode --tensor-parallel-size {d_tp}, "
            f"{'MLA (latent KV)' if mla else f'{kv_heads} KV heads'}")


def heads_per_rank(kv_heads, tp):
    return max(1, kv_heads // tp)


def rank_heads(rank, tp, kv_heads):
    """Global KV heads [lo, hi) that TP rank `rank` of `tp` holds."""
    if kv_heads >= tp:
        n = kv_heads // tp
        return rank * n, (rank + 1) * n
    h = rank // (tp // kv_heads)
    return h, h + 1


def _check_side(what, tp, kv_heads, mla):
    if not isinstance(tp, int) or tp < 1:
        raise TPMapError(f"{what} tensor-parallel size must be an integer >= 1, not {tp!r}")
    if mla:
        return
    if kv_heads >= tp and kv_heads % tp:
        raise TPMapError(f"{kv_heads} KV heads do not divide over {what} "
                         f"--tensor-parallel-size {tp} (vLLM needs one to divide the other)")
    if kv_heads < tp and tp % kv_heads:
        raise TPMapError(f"{what} --tensor-parallel-size {tp} is not a multiple of the "
                         f"{kv_heads} KV heads (vLLM needs one to divide the other)")


def plan(p_tp, d_tp, kv_heads, mla=False):
    """The read plan for consumer TP `d_tp` from producer TP `p_tp`."""
    if not mla and (not isinstance(kv_heads, int) or kv_heads < 1):
        raise TPMapError(f"the model's number of KV heads must be >= 1, not {kv_heads!r}")
    kv_heads = 1 if mla else kv_heads
    _check_side("prefill", p_tp, kv_heads, mla)
    _check_side("decode", d_tp, kv_heads, mla)
    pl = Plan(p_tp=p_tp, d_tp=d_tp, kv_heads=kv_heads, mla=mla,
              p_heads=1 if mla else heads_per_rank(kv_heads, p_tp),
              d_heads=1 if mla else heads_per_rank(kv_heads, d_tp),
              fanout=[0] * p_tp)
    for d in range(d_tp):
        if mla:  # the same latent KV everywhere: spread the consumer ranks
            rs = [Read(d % p_tp, 0, 0, 1)]
        else:
            rs = _reads_for(d, pl)
        for r in rs:
            pl.fanout[r.p_rank] += 1
        pl.reads.append(rs)
    return pl


def _reads_for(d, pl):
    lo, hi = rank_heads(d, pl.d_tp, pl.kv_heads)
    reps_p = max(1, pl.p_tp // pl.kv_heads)   # producer ranks holding each head
    reps_d = max(1, pl.d_tp // pl.kv_heads)
    pick = d % reps_d % reps_p  # consumer replicas of a head spread over producer replicas
    out = []
    h = lo
    while h < hi:
        if pl.kv_heads >= pl.p_tp:
            p = h // pl.p_heads
            p_lo = p * pl.p_heads
            n = min(hi, p_lo + pl.p_heads) - h
        else:
            p = h * reps_p + pick
            p_lo, n = h, 1
        out.append(Read(p, h - p_lo, h - lo, n))
        h += n
    return out


@dataclass(frozen=True)
class Piece:
    """One dest extent of a pull, relative to one block extent on each side."""
    dst_off: int     # byte offset within the consumer's extent
    length: int
    src_off: int     # byte offset within the producer's extent
    whole: bool      # length is the producer's whole extent (no slice read)

    def dest(self, dst_base):
        """The (addr, len[, tag]) tuple the engine's pull takes."""
        if self.whole:
            return (dst_base + self.dst_off, self.length)
        return (dst_base + self.dst_off, self.length, SLICE | self.src_off)


def pieces(pl, d_rank, p_extent, d_extent, layout):
    """[(p_rank, Piece)] for consumer rank `d_rank`: per block and per
    (layer, K/V) extent, what each of its pulls moves.  p_extent/d_extent:
    bytes of one such extent on each side (the same layer).  Raises
    TPMapError when the byte layout cannot express the plan."""
    if layout not in LAYOUTS:
        raise TPMapError(f"unknown KV layout {layout!r}; one of {LAYOUTS}")
    sides = _sides(pl.p_tp, pl.d_tp, pl.kv_heads, pl.mla)
    if p_extent <= 0 or d_extent <= 0 or p_extent % pl.p_heads or \
            p_extent * pl.d_heads != d_extent * pl.p_heads:
        raise TPMapError(f"a KV block extent is {p_extent} bytes for {pl.p_heads} head(s) on "
                         f"the prefill side but {d_extent} bytes for {pl.d_heads} on the decode "
                         f"side ({sides}): serve the same model, dtype and --block-size on "
                         f"both sides")
    head = p_extent // pl.p_heads
    out = []
    for r in pl.reads[d_rank]:
        whole_src = r.p_head == 0 and r.nheads == pl.p_heads
        whole_dst = r.d_head == 0 and r.nheads == pl.d_heads
        if layout != HEADS_OUTER and not (whole_src and whole_dst):
            what = "tokens" if layout == TOKENS_OUTER else "an unknown dimension"
            raise TPMapError(
                f"cannot map KV heads between {sides}: the KV cache layout has {what} "
                f"outermost within a block, so a rank's share of the heads is not one byte "
                f"range; use the same --tensor-parallel-size on both sides (or a backend with "
                f"heads outermost, e.g. the CPU backend or VLLM_KV_CACHE_LAYOUT=HND)")
        out.append((r.p_rank, Piece(dst_off=r.d_head * head, length=r.nheads * head,
                                    src_off=r.p_head * head, whole=whole_src)))
    return out


def describe(pl):
    """One line for the log: who reads what from whom."""
    if pl.identity:
        return f"TP {pl.p_tp} -> {pl.d_tp}: rank r reads rank r"
    parts = []
    for d, rs in enumerate(pl.reads):
        parts.append(f"decode rank {d} <- " + ", ".join(
            f"prefill rank {r.p_rank} heads {r.p_head}..{r.p_head + r.nheads - 1}" for r in rs))
    return f"TP {pl.p_tp} -> {pl.d_tp}: " + "; ".join(parts)
