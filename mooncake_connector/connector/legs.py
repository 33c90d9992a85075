"""Which decode legs (flows a, b) this consumer has accounted for.

A prefill that published a prompt holds it (vLLM's blocks under it) for
one pull.  The decode leg's request pays that debt: its pull consumes the
producer's entry, or a release does (a pull of no blocks: a local prefix
hit, or the request aborted before its pull).  A decode leg that never
reaches this connector (its client left while it was on its way and the
decode's vLLM dropped it first; the decode's API server refused it) pays
nothing, and the prompt stays held until hold_timeout_s.

The proxy cannot tell those apart (a response's headers leave the decode's
API server before its engine sees the request), so it asks this side: a
one-token request carrying kv_transfer_params {"mc_forget": {"x_request_id":
X}} (the X-Request-Id both legs were sent with, from which vLLM made its
request id: carries() matches vLLM's whole forms of it, never a part).
This ledger answers "seen" (a request of that leg is here or has paid:
nothing to do) or "unseen" (nothing has paid: the proxy releases the prompt
at the prefill).  After "unseen" a request of that leg arriving
late neither loads nor releases; after "seen" about a request still here
(its flow-a probe not answered yet, say), that request pays at its end: by
its pull or release, or, if it ends with neither, by the release it sends
then (finished() says so; the proxy releases nothing after "seen").  So
each published prompt is paid for once: never twice (which would take
another request's entry of the same prompt), and not never.

Bounded: records older than MEMORY_S, or past MAX_RECORDS, are dropped
(a forget comes within seconds of its leg).
"""
import os
import re
import time
from collections import OrderedDict

#: How long a leg's record is kept (a forget follows its leg by seconds).
MEMORY_S = 120.0
#: At most this many records (~10 MB); the oldest go first.
MAX_RECORDS = 65536

#: a request of the leg is here (it pays at its end), the same after the
#: proxy was told "seen" about it (it must pay at its end: its own release
#: if it pulled nothing), it paid (pulled or released), it ended without
#: paying, or it came after its leg was forgotten (the proxy's release
#: paid: it neither loads nor releases)
LIVE, ASKED, PAID, UNPAID, LATE = "live", "asked", "paid", "unpaid", "late"
HERE = (LIVE, ASKED)


_RANDOM = "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"
_randomized = []  # [True / False / None], found once


def randomized():
    """Whether this vLLM adds "-<8 random hex>" to each request id (vLLM
    0.32's InputProcessor.assign_request_id): True; False where the
    variable turns that off (VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1); None
    where not known (a vLLM that does not know the variable: an older one
    adds nothing, a later one may always add it): both forms are taken."""
    if not _randomized:
        try:
            from vllm import envs
            known = _RANDOM in getattr(envs, "environment_variables", {})
        except Exception:  # noqa: BLE001 - no vLLM here: not known
            known = False
        if not known:
            _randomized.append(None)
        else:
            try:
                off = bool(int(os.environ.get(_RANDOM, "0")))
            except ValueError:
                off = None  # vLLM itself refuses such a value
            _randomized.append(None if off is None else not off)
    return _randomized[0]


_HEX8 = r"-[0-9a-f]{8}"
#: vLLM's request ids made from X-Request-Id X: completions "cmpl-X-<prompt
#: index>", chat "chatcmpl-X", each then "-<8 random hex>" where vLLM
#: randomizes; a parallel-sampling child's "<i>_" before it.
_FORMS = {True: (r"cmpl-(.+)-\d+" + _HEX8, r"chatcmpl-(.+)" + _HEX8),
          False: (r"cmpl-(.+)-\d+", r"chatcmpl-(.+)")}
_FORMS[None] = _FORMS[True] + _FORMS[False]
_COMPILED = {k: [re.compile(r"(?:\d+_)?" + f, re.S) for f in v] for k, v in _FORMS.items()}


def x_request_ids(rid, mode=...):
    """The X-Request-Ids vLLM could have made its request id `rid` from, by
    vLLM's forms of the whole id (mode: randomized(), or True / False /
    None)."""
    mode = randomized() if mode is ... else mode
    out = set()
    if isinstance(rid, str):
        for form in _COMPILED[mode]:
            m = form.fullmatch(rid)
            if m:
                out.add(m.group(1))
    return out


def carries(rid, xid, mode=...):
    """Whether vLLM's request id `rid` was made from the X-Request-Id `xid`
    ("cmpl-<xid>-0-<random>", "chatcmpl-<xid>-<random>", ...; where vLLM
    keeps ids as made, "cmpl-<xid>-0", "chatcmpl-<xid>"): the whole id, not
    a part of it.  A substring test let a client's X-Request-Id name another
    client's request: "0" is in every "cmpl-<id>-0-<random>"."""
    if not isinstance(xid, str) or not xid or not isinstance(rid, str) or xid not in rid:
        return False
    return xid in x_request_ids(rid, mode)


class LegLedger:
    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._legs = OrderedDict()       # vLLM request id -> [state, monotonic time]
        self._forgotten = OrderedDict()  # X-Request-Id -> monotonic time
        # (X-Request-Id, the proxy's ask id) -> [verdict, monotonic time]: a
        # forget the proxy sends again (it never got the answer: timed out,
        # the connection reset) gets the answer it missed, not "seen"
        self._answers = OrderedDict()

    def __len__(self):
        return len(self._legs) + len(self._forgotten) + len(self._answers)

    def _prune(self, now):
        legs, gone = self._legs, self._forgotten
        while len(legs) >= MAX_RECORDS:  # room for the one being added
            legs.popitem(last=False)
        for _ in range(len(legs)):
            rid, rec = next(iter(legs.items()))
            if now - rec[1] <= MEMORY_S:
                break
            if rec[0] in HERE:  # still running: it pays at its end
                rec[1] = now
                legs.move_to_end(rid)
            else:
                legs.popitem(last=False)
        while gone and (len(gone) >= MAX_RECORDS or now - next(iter(gone.values())) > MEMORY_S):
            gone.popitem(last=False)
        ans = self._answers
        while ans and (len(ans) >= MAX_RECORDS or now - next(iter(ans.values()))[1] > MEMORY_S):
            ans.popitem(last=False)

    def arrived(self, rid):
        """A decode leg's request reached this connector (called once or
        more).  False when its leg was forgotten first: it must neither
        load nor release (the proxy's release paid for it)."""
        rec = self._legs.get(rid)
        if rec is not None:
            return rec[0] != LATE
        now = self._clock()
        self._prune(now)
        for xid in x_request_ids(rid):
            if xid in self._forgotten:
                del self._forgotten[xid]
                self._legs[rid] = [LATE, now]
                return False
        self._legs[rid] = [LIVE, now]
        return True

    def finished(self, rid, paid):
        """The request ended; paid: it pulled or released its prompt.  True
        when it must release its prompt now: the proxy was told "seen"
        about it (so the proxy releases nothing) and it did not pay."""
        rec = self._legs.get(rid)
        if rec is None or rec[0] not in HERE:
            return False
        owes = rec[0] == ASKED and not paid
        rec[0] = PAID if paid or owes else UNPAID  # owes: paid by the caller's release
        rec[1] = self._clock()
        self._legs.move_to_end(rid)
        return owes

    def forget(self, xid, ask=None):
        """The proxy's question about the leg sent with X-Request-Id xid:
        "seen" (a request of it is here: it pays at its end, finished(); or
        it paid) or "unseen" (nothing paid: the proxy releases the prompt at
        the prefill; a request of that leg arriving later is told by
        arrived()).  ask: the proxy's id of this question, the same when it
        asks again because the answer never reached it (a stopped or
        overloaded decode, a reset): that gets the first answer again --
        "unseen" stays "unseen", so the prompt is still released, once (the
        proxy releases once per question)."""
        now = self._clock()
        self._prune(now)
        key = (xid, ask) if isinstance(ask, str) and ask else None
        if key is not None and key in self._answers:
            return self._answers[key][0]
        verdict = self._verdict(xid, now)
        if key is not None:
            self._answers[key] = [verdict, now]
        return verdict

    def _verdict(self, xid, now):
        if xid in self._forgotten:
            return "seen"  # asked twice: paid by the first answer
        for rid in reversed(self._legs):  # the newest request of that id
            if carries(rid, xid):
                rec = self._legs[rid]
                if rec[0] == UNPAID:
                    rec[0] = PAID  # by the proxy's release, once
                    return "unseen"
                if rec[0] == LIVE:
                    rec[0] = ASKED  # the proxy releases nothing: it pays at its end
                return "seen"
        self._forgotten[xid] = now
        return "unseen"
