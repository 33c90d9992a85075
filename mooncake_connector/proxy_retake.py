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
a token or decides otherwise, at most HOLD_MAX bytes).
"""
import json

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


def _choice_failed(c):
    """A choice that ended with finish reason "error" and no text."""
    if not isinstance(c, dict) or c.get("finish_reason") != "error":
        return False
    delta = c.get("delta") if isinstance(c.get("delta"), dict) else {}
    msg = c.get("message") if isinstance(c.get("message"), dict) else {}
    return not (c.get("text") or delta.get("content") or msg.get("content")
                or c.get("token_ids"))


def _role_only(c):
    """A chat stream's first chunk: the role, no content, no finish."""
    if not isinstance(c, dict) or c.get("finish_reason") is not None:
        return False
    delta = c.get("delta")
    return (isinstance(delta, dict) and not delta.get("content")
            and not delta.get("tool_calls") and not delta.get("reasoning_content")
            and not c.get("token_ids"))


def failed_answer(status, raw):
    """True for a non-streamed decode answer of a request its engine ended
    with an error before any token: vLLM's 500 GenerationError, or a 200
    whose every choice ended with finish reason "error" and no text."""
    if status not in (200, 500):
        return False
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return False
    if not isinstance(body, dict):
        return False
    if status == 500:
        return engine_error(body.get("error"))
    choices = body.get("choices")
    return (isinstance(choices, list) and bool(choices)
            and all(_choice_failed(c) for c in choices))


def _event_verdict(payload):
    """None (undecided: hold it, read on), FAILED or RELAY for one SSE
    event's data."""
    if payload == b"[DONE]":
        return FAILED  # ended before any token or finish reason (vLLM 0.26's error)
    try:
        ev = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return RELAY  # not ours to judge: the client sees it as sent
    if not isinstance(ev, dict):
        return RELAY
    if "error" in ev:
        return FAILED if engine_error(ev["error"]) else RELAY
    choices = ev.get("choices")
    if not isinstance(choices, list):
        return RELAY
    if not choices:
        return None  # a usage-only event: no token either way
    if any(_choice_failed(c) for c in choices):
        return FAILED
    if all(_role_only(c) for c in choices):
        return None
    return RELAY


class StreamHead:
    """A decode stream's first events, held until it is known whether the
    decode failed before its first token.  feed(data) -> None (undecided),
    FAILED (drop what is held, take the request again) or RELAY (send
    held() on, then relay the rest as it comes)."""

    def __init__(self):
        self._buf = bytearray()
        self._scanned = 0  # self._buf[:_scanned] holds only whole, undecided events

    def feed(self, data):
        self._buf += data
        while True:
            end = self._buf.find(b"\n\n", self._scanned)
            if end < 0:
                break
            event = bytes(self._buf[self._scanned:end])
            self._scanned = end + 2
            payloads = [ln[5:].strip() for ln in event.replace(b"\r", b"").split(b"\n")
                        if ln.startswith(b"data:")]
            if not payloads:
                continue  # a comment or another field: nothing to judge
            verdict = _event_verdict(b"\n".join(payloads))
            if verdict is not None:
                return verdict
        if len(self._buf) > HOLD_MAX:
            return RELAY
        return None

    def ended(self):
        """The verdict when the stream ended (EOF) while undecided: nothing
        but a role or usage chunk came, or nothing: FAILED."""
        return FAILED

    def held(self):
        """Every byte fed so far (what the client gets on RELAY)."""
        return bytes(self._buf)
