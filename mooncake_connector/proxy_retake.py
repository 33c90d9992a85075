"""A decode leg that failed before its first token, taken again.

Under vLLM's ``kv_load_failure_policy`` "fail" (the connector's
``load_failure_policy``), a request whose KV load failed (a stopped or dead
prefill, a lease run out) ends in the decode's engine with finish reason
"error" and no token.  vLLM's API server then answers 500 ("Internal server
error", type InternalServerError) to a non-streamed request, and a streamed
one gets status 200 and one error event (after a chat stream's role-only
first chunk) before ``[DONE]`` (vLLM 0.32); vLLM 0.26 skips that output as
an empty chunk, so its stream is ``[DONE]`` alone (after the role chunk, or
a usage-only chunk when asked for): a stream that ends before any choice
chunk.  Nothing a client could continue from either way (a decode leg asks
for at least one token, and vLLM ends every answer that has one with a
chunk carrying its finish reason).

The proxy recognises such an answer before anything of it reached the
client and sends the request to the same decode instance once more without
``kv_transfer_params`` (the seed's path: the decode finds the prompt's KV by
its tokens at its configured prefill, flow_a, or computes the prompt), so
the client gets its answer; counted (``decode_retakes``) and logged.  A
second failure is the client's answer.

This module only reads answers: ``failed_answer`` for a non-streamed
answer, ``StreamHead`` for a stream's first events (held until one carries
output -- a token, a reasoning or tool-call delta -- or decides otherwise,
at most HOLD_MAX bytes; what it cannot read as server-sent events is
relayed as sent).
"""

from mooncake_connector import json_in

#: Bytes of a stream's first events held while it is not yet known whether
#: the decode failed before its first token; past it the stream is relayed.
HOLD_MAX = 64 << 10

#: StreamHead.feed verdicts.
FAILED, RELAY = "failed", "relay"


def engine_error(err):
    """vLLM's GenerationError ("Internal server error", code 500,
    type InternalServerError): a request its engine ended with an error."""
    if not isinstance(err, dict):
        return False
    return err.get("code") == 500 or err.get("type") == "InternalServerError"


def failure_message(where, retaken):
    """The client's error for a decode leg that failed before its first
    token and is not taken (again)."""
    return (f"{where} failed the request before its first token"
            + (" again after it was sent once more without kv_transfer_params"
               if retaken else "")
            + " (vLLM ends a request so when its KV load failed under "
              "kv_load_failure_policy 'fail'; see the decode's log)")


def _carries_output(c):
    """A choice (a stream's chunk's or an answer's) that carries anything of
    an answer: text, token ids, logprobs, or any field of its delta or
    message but the role (content, vLLM 0.32's "reasoning", 0.26's
    "reasoning_content", tool_calls, whatever a later vLLM adds)."""
    if c.get("text") or c.get("token_ids") or c.get("logprobs"):
        return True
    return any(isinstance(m, dict) and any(v for k, v in m.items() if k != "role")
               for m in (c.get("delta"), c.get("message")))


def _choice_failed(c):
    """A choice that ended with finish reason "error" and nothing else."""
    return (isinstance(c, dict) and c.get("finish_reason") == "error"
            and not _carries_output(c))


def _role_only(c):
    """A chat stream's first chunk: the role, nothing else, no finish.  (A
    reasoning model's reasoning deltas carry no "content": they are output,
    relayed as they come.)"""
    return (isinstance(c, dict) and c.get("finish_reason") is None
            and isinstance(c.get("delta"), dict) and not _carries_output(c))


def failed_answer(status, raw):
    """True for a non-streamed decode answer of a request its engine ended
    with an error before any token: vLLM's 500 GenerationError, or a 200
    whose every choice ended with finish reason "error" and no text."""
    if status not in (200, 500):
        return False
    try:
        body = json_in.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return False
    if not isinstance(body, dict):
        return False
    if status == 500:
        return engine_error(body.get("error"))
    choices = body.get("choices")
    return (isinstance(choices, list) and bool(choices)
            and all(_choice_failed(c) for c in choices))


def event_failed(ev):
    """A stream's event (parsed) saying the decode failed the request before
    its first token: vLLM's engine error, or a choice that ended with
    finish reason "error" and nothing else."""
    if "error" in ev:
        return engine_error(ev["error"])
    choices = ev.get("choices")
    return isinstance(choices, list) and any(_choice_failed(c) for c in choices)


def _event_verdict(payload):
    """None (undecided: hold it, read on), FAILED or RELAY for one SSE
    event's data."""
    if payload == b"[DONE]":
        return FAILED  # ended before any token or finish reason (vLLM 0.26's error)
    try:
        ev = json_in.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return RELAY  # not ours to judge: the client sees it as sent
    if not isinstance(ev, dict):
        return RELAY
    if event_failed(ev):
        return FAILED
    choices = ev.get("choices")
    if "error" in ev or not isinstance(choices, list):
        return RELAY
    if not choices:
        return None  # a usage-only event: no token either way
    if all(_role_only(c) for c in choices):
        return None
    return RELAY


#: The fields of a server-sent event (a line naming another is no SSE).
_SSE_FIELDS = (b"data", b"event", b"id", b"retry")

#: _event_payload's answer for an event that is no SSE (a JSON body, a page).
_NOT_SSE = object()


def _event_payload(event):
    """The data of one event (its lines, "\n"-ended ones joined): None where
    it has none (comments, other fields, blank), _NOT_SSE where a line is no
    SSE field."""
    payloads = []
    for ln in event.split(b"\n"):
        if not ln or ln.startswith(b":"):
            continue
        name, _, value = ln.partition(b":")
        if name not in _SSE_FIELDS:
            return _NOT_SSE
        if name == b"data":
            payloads.append(value.strip())
    return b"\n".join(payloads) if payloads else None


def _verdict_of(event):
    payload = _event_payload(event)
    if payload is _NOT_SSE:
        return RELAY  # not ours to judge: the client gets it as sent
    return None if payload is None else _event_verdict(payload)


class LineEnds:
    """SSE's line ends ("\r\n", "\r", "\n") made "\n", piece by piece (a
    "\r\n" may be cut between two pieces)."""

    def __init__(self):
        self._cr = False  # the last piece ended in "\r": a "\n" next ends the same line

    def feed(self, data):
        if not data:
            return data
        if self._cr and data[:1] == b"\n":
            data = data[1:]
        self._cr = data[-1:] == b"\r"
        return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")


class StreamHead:
    """A decode stream's first events, held until it is known whether the
    decode failed before its first token.  feed(data) -> None (undecided),
    FAILED (drop what is held, take the request again) or RELAY (send
    held() on, then relay the rest as it comes).  Lines may end in "\r\n"
    or "\r" too (SSE's); each byte is searched for an event's end once."""

    def __init__(self):
        self._buf = bytearray()  # every byte fed
        self._text = bytearray()  # the same, each line's end made "\n"
        self._ends = LineEnds()
        self._scanned = 0  # self._text[:_scanned] holds only whole, undecided events
        self._searched = 0  # no event ends in self._text[:_searched + 1] past _scanned

    def feed(self, data):
        if not data:
            return None
        self._buf += data
        self._text += self._ends.feed(data)
        while True:
            end = self._text.find(b"\n\n", max(self._scanned, self._searched))
            if end < 0:
                self._searched = max(len(self._text) - 1, 0)
                break
            event = bytes(self._text[self._scanned:end])
            self._scanned = end + 2
            verdict = _verdict_of(event)
            if verdict is not None:
                return verdict
        if len(self._buf) > HOLD_MAX:
            return RELAY
        return None

    def ended(self):
        """The verdict when the stream ended (EOF) while undecided: its last
        event without the blank line after it is judged as one (a token, or
        no SSE at all: RELAY); else nothing but a role or usage chunk came,
        or nothing: FAILED."""
        rest = bytes(self._text[self._scanned:])
        verdict = _verdict_of(rest) if rest.strip() else None
        return FAILED if verdict is None else verdict

    def held(self):
        """Every byte fed so far (what the client gets on RELAY)."""
        return bytes(self._buf)
