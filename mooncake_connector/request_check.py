"""Checks of a client's request body before the proxy reads it.

The proxy reads a handful of fields of an OpenAI-style request (prompt or
messages, max_tokens, stream, stream_options, kv_transfer_params, ...) and
copies the body for the prefill leg.  A body the proxy cannot handle is
answered 400 here, naming the field and what it must be, instead of an
exception deep in the proxy (a 500): JSON nested too deep (a RecursionError
in the parser or in copy.deepcopy), a field of the wrong type.

Only what the proxy itself depends on is checked; everything else is left
to the vLLM server, which answers its own 400s.
"""
import json

# Deeper than any real request (a chat message's content parts, a tool's
# JSON schema nest a few tens of levels at most), far below where Python's
# recursion in json/copy breaks.
MAX_DEPTH = 64


# A client's X-Request-Id becomes part of the upstream request ids, of flow
# push's transfer id ("push-<id>-<12 hex>", at most 256 characters, else the
# connectors ignore it and the decode computes the prompt) and of log lines.
MAX_REQUEST_ID = 128


def request_id_problem(rid: str):
    """Why the client's X-Request-Id value cannot be used as this request's
    id (None if it can): 1..MAX_REQUEST_ID characters, each printable ASCII
    other than a space (what UUIDs, hex, base64 and trace ids are made
    of).  aiohttp already refuses control characters and CR/LF in headers,
    but lets through spaces, tabs, non-ASCII text and bytes that are not
    UTF-8 (as lone surrogates), up to 8 KiB."""
    if len(rid) > MAX_REQUEST_ID:
        return f"is {len(rid)} characters long; at most {MAX_REQUEST_ID}"
    for c in rid:
        if not "!" <= c <= "~":
            return (f"contains {ascii(c)}; only printable ASCII characters other than space "
                    "are allowed")
    return None


class BadRequest(ValueError):
    """The request is malformed; str(e) says what and how to fix it."""


def _no_constant(name):
    # Python's parser takes NaN, Infinity and -Infinity; JSON has none of
    # them (RFC 8259), and relayed they reached vLLM as sampling values.
    raise BadRequest(f"request body is not valid JSON: {name} is not a JSON value (write a "
                     "number, or leave the field out)")


def parse(raw: bytes):
    """The request body as a JSON object, or BadRequest."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except BadRequest:
        raise
    except RecursionError:
        raise BadRequest(f"request body nests JSON too deeply (more than {MAX_DEPTH} levels "
                         "of arrays/objects)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object, got "
                         f"{_kind(body)}")
    where = _too_deep(body, MAX_DEPTH)
    if where is not None:
        raise BadRequest(f"request body nests JSON more than {MAX_DEPTH} levels deep "
                         f"(at {where}); flatten it")
    return body


def _kind(v):
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


def _too_deep(obj, limit):
    """The path of the first value nested deeper than limit, else None
    (iterative: no recursion however deep the input)."""
    stack = [(obj, 1, "")]
    while stack:
        v, depth, path = stack.pop()
        if depth > limit:
            return path or "the top"
        if isinstance(v, dict):
            stack.extend((x, depth + 1, f"{path}.{k}") for k, x in v.items()
                         if isinstance(x, (dict, list)))
        elif isinstance(v, list):
            stack.extend((x, depth + 1, f"{path}[{i}]") for i, x in enumerate(v)
                         if isinstance(x, (dict, list)))
    return None


def _check_kv_transfer_params(body):
    """kv_transfer_params tell the connectors where KV comes from and goes
    to (remote_engine_id / remote_host / remote_port, block ids, transfer
    ids): the proxy sets them for each leg.  A client's own would be relayed
    to the vLLM servers and could point the decode's connector at a host of
    the client's choice (whose bytes would land in the decode's KV cache,
    prefix-cached for other clients' requests): refused.  null or {} carry
    nothing and are dropped."""
    v = body.get("kv_transfer_params", None)
    if v is None or v == {}:
        body.pop("kv_transfer_params", None)
        return
    keys = ", ".join(sorted(str(k) for k in v)[:8])
    raise BadRequest("field 'kv_transfer_params' is set by the proxy for each leg, not by "
                     f"clients (got an object with {keys[:200]}); remove it from the request "
                     "(to drive the KV connector yourself, send requests to the vLLM servers "
                     "directly, not through the proxy)")


# The proxy's own kv_transfer_params fields (per leg: the release of a
# prefill leg, the question about a decode leg).  A client's copy at the top
# level reached vLLM, which ignores fields it does not know: the client
# thought it had released or forgotten something.
_PROXY_FIELDS = ("mc_release", "mc_forget")


def _check_proxy_fields(body):
    for key in _PROXY_FIELDS:
        if key in body:
            raise BadRequest(f"field {key!r} is the proxy's own (it sends it inside "
                             "kv_transfer_params, to release a leg's KV itself): clients do not "
                             "send it; remove it from the request")
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and "kv_transfer_params" in xargs:
        # vLLM puts vllm_xargs into the request's extra args, where its
        # kv_transfer_params are read from: the same hole as the top-level
        # field (a non-object there was a 500 from the decode's vLLM)
        raise BadRequest("field 'vllm_xargs.kv_transfer_params' is set by the proxy for each "
                         "leg, not by clients; remove it from vllm_xargs (to drive the KV "
                         "connector yourself, send requests to the vLLM servers directly, not "
                         "through the proxy)")


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _check_prompt(p):
    if isinstance(p, str):
        return
    if isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p) or all(_is_int(x) for x in p):
            return
        if all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in p):
            return
    raise BadRequest("field 'prompt' must be a string, an array of strings, an array of "
                     "token ids or an array of token-id arrays (non-empty), got "
                     f"{_kind(p) if not isinstance(p, list) or not p else 'an array of other values'}")


def _check_messages(msgs):
    if not isinstance(msgs, list):
        raise BadRequest("field 'messages' must be an array of message objects "
                         f"({{\"role\": ..., \"content\": ...}}), got {_kind(msgs)}")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object with 'role' and 'content', "
                             f"got {_kind(m)}")
        if not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}].role must be a string, got {_kind(m.get('role'))}")
        c = m.get("content")
        if c is not None and not isinstance(c, (str, list)):
            raise BadRequest(f"messages[{i}].content must be a string, an array of content "
                             f"parts or null, got {_kind(c)}")
        if isinstance(c, list):
            for j, part in enumerate(c):
                if not isinstance(part, dict):
                    raise BadRequest(f"messages[{i}].content[{j}] must be an object "
                                     f"(a content part), got {_kind(part)}")


# field -> (accepts, what it must be); null is accepted for each.
_FIELDS = {
    "max_tokens": (_is_int, "an integer"),
    "max_completion_tokens": (_is_int, "an integer"),
    "min_tokens": (_is_int, "an integer"),
    "n": (_is_int, "an integer"),
    "stream": (lambda v: isinstance(v, bool), "true or false"),
    "return_token_ids": (lambda v: isinstance(v, bool), "true or false"),
    "stream_options": (lambda v: isinstance(v, dict), "an object"),
    "kv_transfer_params": (lambda v: isinstance(v, dict), "an object"),
}


def check(body, chat):
    """BadRequest if a field the proxy reads has a type it cannot handle,
    or if the client sent kv_transfer_params (or the proxy's mc_release /
    mc_forget) of its own."""
    for key, (ok, what) in _FIELDS.items():
        v = body.get(key)
        if v is not None and not ok(v):
            raise BadRequest(f"field {key!r} must be {what} or null, got {_kind(v)}")
    _check_kv_transfer_params(body)
    _check_proxy_fields(body)
    if chat:
        _check_messages(body.get("messages"))
    else:
        if body.get("prompt") is None:
            if body.get("prompt_embeds") is not None:
                return
            raise BadRequest("field 'prompt' is required (a string or an array of token ids)")
        _check_prompt(body["prompt"])
