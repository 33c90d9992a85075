"""How the end-to-end checks judge "token-identical".

Greedy decoding picks the largest logit.  Where the two largest are equal
or nearly so in the reference (a rounding tie), another computation of the
same math — a different tensor-parallel split, whose all-reduces add the
residual stream in another order, or another kernel — may pick the other
one, and from there on the outputs part.  That is not a connector fault:
two colocated servers without any connector, TP 1 and TP 2, part the same
way at such positions.

So a disaggregated output is accepted when it is identical to the
reference, or when it is identical up to the first position where they
part AND the reference's top-2 logprob gap at that position is at most
TIE_EPS (the outputs after that position are not compared: they continue
from different tokens).  Any other difference is a failure.  The reference
must be requested with top logprobs (completions: "logprobs": 2).

TIE_EPS is 0.01 nats by default (MC_E2E_TIE_EPS overrides): a gap that
small is within the rounding of float32 / bfloat16 logits across
reduction orders; a mapping fault (a wrong or shifted KV block) changes
the logits by far more, and at the first positions, where gaps are wide.
"""
import os

TIE_EPS = float(os.environ.get("MC_E2E_TIE_EPS", "0.01"))


def judge(ref_ids, ref_top, got_ids, eps=None):
    """(verdict, note): verdict "identical", "tie" (parted at a rounding
    tie of the reference: accepted) or "differs" (a failure); note says
    where and why, for the test's output."""
    eps = TIE_EPS if eps is None else eps
    ref_ids, got_ids = list(ref_ids), list(got_ids)
    if ref_ids == got_ids:
        return "identical", ""
    k = next((i for i, (a, b) in enumerate(zip(ref_ids, got_ids)) if a != b),
             min(len(ref_ids), len(got_ids)))
    if k >= min(len(ref_ids), len(got_ids)):
        return "differs", (f"lengths differ ({len(ref_ids)} vs {len(got_ids)} tokens) with "
                           f"the first {k} identical")
    top = ref_top[k] if k < len(ref_top) else None
    if not top or len(top) < 2:
        return "differs", (f"parted at token {k} (reference {ref_ids[k]}, got {got_ids[k]}); "
                           "the reference has no top-2 logprobs there to judge a tie")
    gap = top[0] - top[1]
    if gap <= eps:
        return "tie", (f"parted at token {k} (reference {ref_ids[k]}, got {got_ids[k]}) where "
                       f"the reference's top-2 logprob gap is {gap:.2e} <= {eps:g}: a rounding "
                       "tie, accepted")
    return "differs", (f"parted at token {k} (reference {ref_ids[k]}, got {got_ids[k]}) where "
                       f"the reference's top-2 logprob gap is {gap:.3g} > {eps:g}")
