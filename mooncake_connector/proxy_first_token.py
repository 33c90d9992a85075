"""First token from prefill: the proxy's fast path for streamed requests.

The prefill instance computes the prompt and samples the first token anyway
(the proxy asks it for max_tokens=1).  Instead of throwing that token away
and waiting for the decode instance to produce it again, the proxy streams it
to the client at once and asks the decode instance to continue FROM it:

* prefill: the client's request with max_tokens=1, not streamed, with
  return_token_ids=true (vLLM >= 0.10: the answer carries the prompt's token
  ids, after the chat template, and the sampled token's id);
* client: the first chunk(s), built from that answer, in vLLM's own chunk
  format (chat: the role chunk and the first content chunk);
* decode: a /v1/completions request whose prompt is the token ids
  prompt_token_ids + [first token] (no re-tokenisation, no chat template),
  max_tokens one less, the same sampling parameters (seed included), streamed;
  its chunks are re-stamped with the first chunk's id, wrapped into
  chat.completion.chunk objects for chat requests, and its usage is counted
  as the client's request (prompt_tokens - 1, completion_tokens + 1).

The decode prompt starts with the same token ids as the prefill prompt, so
the decode instance finds the prompt's KV by token-block hashes (flow a) or
through the relayed kv_transfer_params (flow b) exactly as before; it
computes the first token's KV itself (one more token in its last step).

If the prefill already ended the answer (EOS or a stop token: finish_reason
"stop"; max_tokens 1; or the model's context is full) the decode instance is
never asked.  If the decode leg fails after the first chunk went out (the
response already has status 200), the stream ends with an SSE error event
naming the decode instance, then [DONE].

A first token that ends inside a UTF-8 character (vLLM shows "" for it):
the decode prompt then ends inside that character, and vLLM's detokenizer
(tokenizers' DecodeStream primed with the prompt) emits the prompt's whole
text with the character at the step that completes it.  Such a stream is held
(nothing sent, not even the response's status) until the decode leg's first
text; that text is replaced by decode(prompt + held-back tokens) minus
decode(prompt), both from the decode instance's POST /detokenize, where the
check in `_settle()` shows it is what a colocated server streams (a ""
token that is whole, a special token vLLM skips, leaves the text as it
comes).  Where it cannot, the decode leg is closed and the request takes the
seed's path, counted as "partial first token: ...".

Requests the fast path cannot represent faithfully take the seed's path
(decode gets the original request): see `refusal()`.
"""
import asyncio
import copy
import json
import time

import aiohttp
from aiohttp import web

from mooncake_connector import json_in
from mooncake_connector import proxy_retake
from mooncake_connector import trace

#: Fields the fast path carries over, unchanged, to the decode leg.
SAMPLING = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
            "stop_token_ids", "ignore_eos", "skip_special_tokens",
            "spaces_between_special_tokens", "logit_bias", "allowed_token_ids", "user",
            "priority", "cache_salt", "return_token_ids", "include_stop_str_in_output",
            "stream_interval", "request_id")
#: Fields that only shape the prefill's prompt (tokenisation, chat template).
PROMPT_ONLY = {"prompt", "messages", "add_special_tokens", "add_generation_prompt",
               "continue_final_message", "chat_template", "chat_template_kwargs", "documents"}
HANDLED = {"max_tokens", "max_completion_tokens", "min_tokens", "stream", "stream_options"}
KNOWN = set(SAMPLING) | PROMPT_ONLY | HANDLED
#: Fields fine at these (default) values; any other value takes the seed's path.
DEFAULTS = {
    "n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (False,),
    "top_logprobs": (0,), "prompt_logprobs": (), "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0), "stop": ([], ""), "suffix": ("",),
    "use_beam_search": (False,), "length_penalty": (1, 1.0), "tools": ([],),
    "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "parallel_tool_calls": (True, False), "response_format": ({"type": "text"},),
    "structured_outputs": (), "guided_json": (), "guided_regex": (), "guided_choice": (),
    "guided_grammar": (), "truncate_prompt_tokens": (), "truncation_side": (),
    "bad_words": ([],), "kv_transfer_params": (), "vllm_xargs": ({},),
    "include_reasoning": (True,), "reasoning_effort": (), "thinking_token_budget": (),
    "return_tokens_as_token_ids": (False, True), "return_prompt_text": (False,),
    "return_token_offsets": (False,), "logprob_token_ids": ([],), "prompt_embeds": (),
    "mm_processor_kwargs": ({},), "media_io_kwargs": ({},), "session_id": (),
}

WHY = {  # why a field's non-default value keeps the seed's path
    "n": "several choices", "best_of": "several candidates", "echo": "echo",
    "logprobs": "logprobs", "top_logprobs": "logprobs", "prompt_logprobs": "prompt logprobs",
    "frequency_penalty": "frequency/presence penalties count the first token as output",
    "presence_penalty": "frequency/presence penalties count the first token as output",
    "stop": "stop strings may span the first token and the next",
    "bad_words": "bad_words match across the first token",
    "tools": "tool calls", "tool_choice": "tool calls", "response_format": "structured output",
    "structured_outputs": "structured output", "kv_transfer_params": "client's own "
    "kv_transfer_params", "truncate_prompt_tokens": "prompt truncation",
    "include_reasoning": "reasoning output", "reasoning_effort": "reasoning output",
}


def refusal(body, chat):
    """None if the fast path can serve this (streamed) request faithfully,
    else a short reason.  Unknown fields are refused too (vLLM may give them
    a meaning the proxy does not know)."""
    for key, value in body.items():
        if value is None or key in KNOWN:
            continue
        if key not in DEFAULTS:
            return f"field {key!r}"
        if not any(type(value) is type(d) and value == d for d in DEFAULTS[key]):
            return f"{key} ({WHY.get(key, 'not representable')})"
    if chat:
        for m in body.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list) and any(
                    not isinstance(p, dict) or p.get("type") != "text" for p in content):
                return "non-text message content"
    else:
        p = body.get("prompt")
        if not (isinstance(p, str) or (isinstance(p, list) and p
                                       and all(isinstance(t, int) for t in p))):
            return "batched or non-text prompt"
    if body.get("min_tokens") is not None and not isinstance(body["min_tokens"], int):
        return "min_tokens"
    # Budgets vLLM refuses (its own 400 from the decode instance): the fast
    # path would answer the prefill's one token (max_tokens 0 or -1) or
    # send the decode a budget changed into one it accepts.
    mt, mn = max_tokens_of(body, chat), body.get("min_tokens")
    if mt is not None and mt < 1:
        return "max_tokens below 1"
    if mn is not None and (mn < 0 or mt is not None and mn > mt):
        return "min_tokens below 0 or above max_tokens"
    return None


def max_tokens_of(body, chat):
    """The client's output budget; None = up to the context length."""
    if chat:
        mt = body.get("max_completion_tokens")
        return mt if mt is not None else body.get("max_tokens")
    if "max_tokens" not in body:
        return 16  # vLLM's CompletionRequest default
    return body["max_tokens"]


def prefill_body(body, chat, flow_b):
    p = copy.deepcopy(body)
    p["max_tokens"] = 1
    if chat and "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    if p.get("min_tokens"):
        p["min_tokens"] = 1
    p["stream"] = False
    p.pop("stream_options", None)
    p["return_token_ids"] = True
    if flow_b:
        p["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                   "remote_engine_id": None, "remote_block_ids": None,
                                   "remote_host": None, "remote_port": None}
    return p


class Plan:
    """What the prefill answered, and the decode request that continues it."""

    def __init__(self, body, chat, pre, max_model_len):
        c = pre["choices"][0]
        self.chat = chat
        self.id, self.created, self.model = pre.get("id"), pre.get("created"), pre.get("model")
        self.prompt_ids = pre.get("prompt_token_ids") or c.get("prompt_token_ids")
        self.first_ids = c.get("token_ids") or []
        if chat:
            msg = c.get("message") or {}
            self.text, self.role = msg.get("content") or "", msg.get("role") or "assistant"
            self.parsed = bool(msg.get("reasoning") or msg.get("reasoning_content")
                               or msg.get("tool_calls"))
        else:
            self.text, self.role, self.parsed = c.get("text") or "", None, False
        self.finish, self.stop_reason = c.get("finish_reason"), c.get("stop_reason")
        self.usage = pre.get("usage") or {}
        if not isinstance(self.usage, dict):
            raise TypeError(f"usage is {type(self.usage).__name__}, not an object")
        self.want_ids = bool(body.get("return_token_ids"))
        so = body.get("stream_options") or {}
        self.include_usage = bool(so.get("include_usage"))
        self.continuous = self.include_usage and bool(so.get("continuous_usage_stats"))
        n = len(self.prompt_ids or [])
        mt = max_tokens_of(body, chat)
        self.remaining = (max_model_len - n) if mt is None else min(mt, max_model_len - n)
        self.done = self.finish not in (None, "length") or self.remaining <= 1
        if self.done and self.finish is None:
            self.finish = "length"
        # A first token that ends inside a UTF-8 character: vLLM shows ""
        # for it (see unusable() and _settle()).
        self.partial = not self.text and not self.done
        self.toks = list(self.first_ids)  # partial: the tokens whose text is held back
        self.unsettled = None  # partial: why its text could not be settled
        self.settling = self.partial  # partial: the decode's first text not settled yet
        self.pre_texts = None  # partial: (decode(prompt), decode(prompt + first)), checked
        self.decode = None
        if not self.done:
            d = {k: body[k] for k in SAMPLING if body.get(k) is not None}
            d.update(prompt=list(self.prompt_ids) + list(self.first_ids),
                     max_tokens=self.remaining - 1, stream=True)
            if body.get("min_tokens"):
                d["min_tokens"] = max(0, body["min_tokens"] - 1)
            if so:
                d["stream_options"] = so
            if pre.get("kv_transfer_params") is not None:
                d["kv_transfer_params"] = pre["kv_transfer_params"]
            if self.partial:
                d["return_token_ids"] = True  # _settle() needs the held-back tokens
            self.decode = d

    def unusable(self):
        """Why this answer cannot start a fast-path stream (None if it can)."""
        if not self.prompt_ids or len(self.first_ids) != 1:
            return ("prefill answer has no prompt_token_ids/token_ids (return_token_ids: "
                    "vLLM >= 0.10)")
        if self.parsed:
            return "prefill answer has reasoning or tool calls (a server-side parser)"
        if "\ufffd" in self.text and not self.done:
            # A token whose text vLLM shows as U+FFFD (an invalid byte
            # sequence; a partial character shows "": self.partial) leaves
            # the decode's detokenizer in a state the proxy does not model.
            return "first token's text has U+FFFD"
        return None

    # ---- chunks sent to the client ----

    def _chunk(self, choices, **extra):
        ev = {"id": self.id, "object": "chat.completion.chunk" if self.chat
              else "text_completion", "created": self.created, "model": self.model,
              "choices": choices}
        ev.update(extra)
        return sse(ev)

    def _usage(self, prompt_tokens, completion_tokens, base=None):
        u = dict(base or {})
        u.update(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)
        return u

    def first_chunks(self):
        n = len(self.prompt_ids)
        ids = list(self.first_ids) if self.want_ids else None
        prompt_ids = list(self.prompt_ids) if self.want_ids else None
        fin = self.finish if self.done else None
        extra = {"usage": self._usage(n, 1)} if self.continuous else {}
        if self.chat:
            out = self._chunk([{"index": 0, "delta": {"role": self.role, "content": ""},
                                "logprobs": None, "finish_reason": None}],
                              prompt_token_ids=prompt_ids, prompt_text=None,
                              **({"usage": self._usage(n, 0)} if self.continuous else {}))
            choice = {"index": 0, "delta": {"content": self.text}, "logprobs": None,
                      "finish_reason": fin, "token_ids": ids}
        else:
            out = b""
            choice = {"index": 0, "text": self.text, "logprobs": None, "finish_reason": fin,
                      "stop_reason": None, "prompt_token_ids": prompt_ids, "token_ids": ids}
        if fin is not None:
            choice["stop_reason"] = self.stop_reason
        out += self._chunk([choice], **extra)
        if self.done:
            if self.include_usage:
                out += self._chunk([], usage=self._usage(n, 1, self.usage))
            out += b"data: [DONE]\n\n"
        return out

    def rewrite(self, ev):
        """A decode-leg chunk (a completions chunk) as the client's chunk."""
        if "error" in ev:
            return None
        u = ev.get("usage")
        if u:
            n = max(0, u.get("prompt_tokens", 1) - 1)
            u = self._usage(n, u.get("completion_tokens", 0) + 1, u)
            details = u.get("prompt_tokens_details")
            if isinstance(details, dict) and (details.get("cached_tokens") or 0) > n:
                # never report more cached tokens than the client's prompt
                # has (decode's prompt is one token longer)
                u["prompt_tokens_details"] = dict(details, cached_tokens=n)
        choices = []
        for c in ev.get("choices") or []:
            if self.chat:
                nc = {"index": c.get("index", 0), "delta": {"content": c.get("text") or ""},
                      "logprobs": None, "finish_reason": c.get("finish_reason")}
                if c.get("finish_reason") is not None:
                    nc["stop_reason"] = c.get("stop_reason")
                nc["token_ids"] = c.get("token_ids")
            else:
                nc = dict(c)
                if "prompt_token_ids" in nc:
                    nc["prompt_token_ids"] = None  # the client got the prompt's ids first
            if not self.want_ids and nc.get("token_ids") is not None:
                nc["token_ids"] = None  # asked for by the proxy (partial), not the client
            choices.append(nc)
        extra = {k: ev[k] for k in ("system_fingerprint",) if k in ev}
        if u:
            extra["usage"] = u
        return self._chunk(choices, **extra)


#: Longest wait for the decode instance's /detokenize (partial first tokens).
DETOKENIZE_TIMEOUT = aiohttp.ClientTimeout(total=30)

#: Largest decode-leg event read (a first chunk carries the prompt's token
#: ids: a few MiB at the longest contexts); more without an event's end is
#: no SSE stream, and is not buffered further.
MAX_EVENT = 64 << 20


class ClientGone(Exception):
    """Writing to the client failed: it disconnected."""


async def _write(resp, data):
    try:
        await resp.write(data)
    except (ConnectionResetError, aiohttp.ClientConnectionError) as e:
        raise ClientGone() from e


def sse(obj):
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def error_event(message, code=502):
    return sse({"error": {"message": message, "type": "upstream_error", "param": None,
                          "code": code}}) + b"data: [DONE]\n\n"


class _Out:
    """The client's stream.  While `hold` (a partial first token not settled
    yet), chunks are kept and the response is not even started, so that the
    request can still take the seed's path; the first write after that
    starts it and sends what was kept first."""

    def __init__(self, request, resp, hold, rid=None):
        self.request, self.resp, self.hold, self.kept = request, resp, hold, []
        self.rid = rid  # MC_TRACE: the first bytes written are traced
        self.started = resp.prepared
        # the relay and the early release (_release_when_checked) both write
        self.lock = asyncio.Lock()

    async def write(self, data, release=False):
        async with self.lock:
            if release:
                self.hold = False
            if self.hold:
                self.kept.append(data)
                return
            if not self.started:
                self.started = True
                try:
                    await self.resp.prepare(self.request)
                except (ConnectionResetError, aiohttp.ClientConnectionError) as e:
                    raise ClientGone() from e
            data, self.kept = b"".join(self.kept) + data, []
            if data:
                await _write(self.resp, data)
                if self.rid is not None and trace.ON:
                    trace.event("proxy_first_out", self.rid)
                    self.rid = None


class Unsettled(Exception):
    """A partial first token's text could not be settled byte-exactly;
    nothing was sent to the client (the request may take the seed's path)."""


async def stream(proxy, request, plan, dec_url, headers, rid, t_pre=None):
    """Sends the first chunk(s) now, then relays the decode leg.  Always
    returns a finished StreamResponse (an error event ends a failed one),
    except for a partial first token whose text could not be settled: then
    None, nothing was sent, and plan.unsettled says why.
    t_pre: when the prefill answer was in (perf_counter), for /stats."""
    resp = web.StreamResponse(status=200, headers={
        "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
        "X-Request-Id": rid})
    counts = proxy.counts
    if not plan.partial:
        try:
            await resp.prepare(request)
        except (ConnectionResetError, aiohttp.ClientConnectionError):
            return resp  # the client left before its first byte
        counts["first_token_from_prefill"] += 1
    out = _Out(request, resp, plan.partial, rid)
    if trace.ON:
        trace.event("proxy_plan", rid, partial=plan.partial, done=plan.done)
    try:
        await out.write(plan.first_chunks())
    except ClientGone:
        return resp
    if t_pre is not None and not plan.partial:
        proxy.note_latency("prefill_answer_to_first_chunk_ms", time.perf_counter() - t_pre)
    if plan.done:
        counts["finished_at_prefill"] += 1
        return await _eof(resp)
    where = f"decode instance {dec_url}"
    # Released before the decode's first text only where this decode
    # instance already settled one (its tokenizer shown to behave): a first
    # request per instance, or one after a failure, stays held until its text
    # is settled, so a mismatch there still takes the seed's path.
    early = (asyncio.ensure_future(_release_when_checked(proxy, out, plan, dec_url, headers))
             if plan.partial and dec_url in proxy.partial_settled else None)
    request["mc_leg"] = "decode"
    request["mc_dec_url"] = dec_url
    code = 502  # the error event's code: the decode leg failed as an upstream
    failed = False
    try:
        err = await _relay_decode(proxy, out, plan, dec_url, headers)
        failed = err is RETAKE  # the decode's load failed: it will not pull
        retaken = failed and proxy.decode_retake
        if retaken:
            # The decode failed before its first token (proxy_retake): once
            # more, its prompt computed there, its error then the client's.
            plan.decode = proxy._retake(dec_url, rid, proxy._retake_body(plan.decode))
            err = await _relay_decode(proxy, out, plan, dec_url, headers)
        if err is RETAKE:
            # vLLM's own code for a request its engine ended with an error,
            # as the seed's path sends this failure (Proxy._relay): the
            # client's error does not depend on where its first token came from
            err, code = proxy_retake.failure_message(where, retaken), 500
    except Unsettled as e:
        proxy.partial_settled.discard(dec_url)
        if trace.ON:
            trace.event("proxy_unsettled", rid, dec=dec_url)
        if out.hold:  # nothing sent: the request can take the seed's path
            plan.unsettled = str(e)
            return None
        # Sent already (the boundary check passed, the decode's text did not
        # match): never wrong bytes; the stream ends with an error.
        proxy.counts["first_token_partial_unsettled"] += 1
        err = (f"{where}: the first token ends inside a UTF-8 character and the decode's "
               f"text could not be matched to it ({e}); the stream ends here rather than "
               "send wrong text")
    except ClientGone:
        return resp  # the client left (leaving the block closed the decode request)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        err = proxy.upstream_failure(where, e, "failed after the first token was sent")
    finally:
        if early is not None and not early.done():
            early.cancel()
        if failed:  # once the retake is over, whatever its end
            proxy._release_after_failed_load(request)
    if plan.partial and out.hold:
        # The decode leg failed before the partial token's text was settled:
        # the client gets the first chunk(s) (text "", as vLLM's) and the error.
        counts["first_token_from_prefill"] += 1
        counts["first_token_partial"] += 1
    if err:
        counts["decode_errors"] += 1
        counts["stream_errors_after_first_token"] += 1
        proxy.log.warning("%s (request %s)", err, rid)
        try:
            await out.write(error_event(err, code), release=True)
        except ClientGone:
            return resp
    return await _eof(resp)


async def _detokenize(proxy, dec_url, headers, model, ids):
    """The decode instance's text for token ids (vLLM's POST /detokenize:
    its tokenizer's decode, special tokens kept)."""
    try:
        async with proxy.session.post(dec_url + "/detokenize",
                                      json={"model": model, "tokens": ids}, headers=headers,
                                      timeout=DETOKENIZE_TIMEOUT) as r:
            if r.status != 200:
                raise Unsettled(f"partial first token: /detokenize answered {r.status}")
            answer = json_in.loads(await r.read())
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
        raise Unsettled(f"partial first token: /detokenize failed ({type(e).__name__})") from e
    text = answer.get("prompt") if isinstance(answer, dict) else None
    if not isinstance(text, str):
        raise Unsettled("partial first token: /detokenize answer has no text")
    return text


async def _boundary(proxy, plan, dec_url, headers):
    """(decode(prompt), decode(prompt + first token)) from the decode
    instance's tokenizer, once; raises Unsettled where the prompt ends
    inside a character or its text is not a prefix of the longer one."""
    if plan.pre_texts is None:
        model, ids = plan.decode.get("model"), list(plan.prompt_ids)
        prompt, first = await asyncio.gather(
            _detokenize(proxy, dec_url, headers, model, ids),
            _detokenize(proxy, dec_url, headers, model, ids + plan.toks[:1]))
        if prompt.endswith("\ufffd"):
            # vLLM's stream then shows the prompt's text too, colocated or not;
            # not modelled here.
            raise Unsettled("partial first token: the prompt ends inside a UTF-8 character")
        if not first.startswith(prompt):
            raise Unsettled("partial first token: the tokenizer's text of the prompt is "
                            "not a prefix of its text with the first token")
        plan.pre_texts = (prompt, first)
    return plan.pre_texts


async def _release_when_checked(proxy, out, plan, dec_url, headers):
    """A partial first token, on a decode instance that settled one before:
    send the client its first chunk(s) (text "", as a colocated vLLM streams
    them at once) as soon as the decode instance's tokenizer shows the
    prompt's boundary behaves (`_boundary`), rather than at the decode's
    first text; the text is still settled there (a mismatch then ends the
    stream with an error, counted, never wrong text).  Where the check fails
    the stream stays held (the seed's path remains)."""
    try:
        if trace.ON:
            trace.event("proxy_boundary_ask", out.rid)
        await _boundary(proxy, plan, dec_url, headers)
        if trace.ON:
            trace.event("proxy_boundary_ok", out.rid)
        if out.hold and plan.settling:
            await _release(proxy, out, plan, b"")
    except (Unsettled, ClientGone):
        pass  # held as before; the relay settles it or takes the seed's path


async def _settle(proxy, plan, ev, dec_url, headers):
    """A partial first token: the decode leg's prompt ends inside a UTF-8
    character, so vLLM's detokenizer (tokenizers' DecodeStream primed with
    that prompt) emits the prompt's whole text with the character that
    completes it.  While the event's text is "" its tokens are noted; at the
    first text, that text is replaced by the text of the held-back tokens
    alone, as a colocated server streams it: decode(prompt + tokens) minus
    decode(prompt), asked of the decode instance's own tokenizer, accepted
    only if the event's text ends with it and what precedes it is the
    prompt's text (special tokens left out).  Returns True once settled;
    raises Unsettled where that cannot be shown."""
    choices = ev.get("choices") or []
    if "error" in ev:
        return False  # the relay reports it
    if not choices:
        # a usage-only event (stream_options): no text to settle; every
        # token so far shows "" on both sides (a stream that ends inside a
        # character shows "" for it colocated too)
        return False
    if len(choices) != 1 or not isinstance(choices[0], dict):
        raise Unsettled("partial first token: decode chunk without one choice")
    c = choices[0]
    ids, text = c.get("token_ids"), c.get("text")
    if not (isinstance(ids, list) and all(isinstance(i, int) for i in ids)) or (
            text is not None and not isinstance(text, str)):
        raise Unsettled("partial first token: decode chunk without token_ids or text")
    plan.toks += ids
    if not text:
        return False
    model = plan.decode.get("model")
    ids = list(plan.prompt_ids)
    (prompt, first), whole = await asyncio.gather(
        _boundary(proxy, plan, dec_url, headers),
        _detokenize(proxy, dec_url, headers, model, ids + plan.toks))
    if not first.endswith("\ufffd"):
        # Not inside a character: a token vLLM shows as "" (a special token
        # it skips, e.g. <unk>).  The decode prompt ends on a whole
        # character, so its stream is the colocated one as it comes.
        return True
    own = whole[len(prompt):]
    n = len(plan.toks)
    while own.endswith("\ufffd") and n > 1 and whole.startswith(prompt):
        # The chunk's last tokens start another character (vLLM grouped
        # several tokens into this chunk): its text stops where the last
        # whole character does, as DecodeStream emits it.
        n -= 1
        whole = await _detokenize(proxy, dec_url, headers, model,
                                  list(plan.prompt_ids) + plan.toks[:n])
        own = whole[len(prompt):]
    rest = iter(prompt)
    if not (whole.startswith(prompt) and own and text.endswith(own)
            and all(ch in rest for ch in text[:len(text) - len(own)])):
        proxy.log.info("partial first token not settled: decode text %r, tokens %s, their "
                       "text %r, prompt's text ends %r", text[-200:], plan.toks, own[-200:],
                       prompt[-100:])
        raise Unsettled("partial first token: decode text is not prompt text + the "
                        "tokens' text")
    c["text"] = own
    return True


async def _eof(resp):
    try:
        await resp.write_eof()
    except (ConnectionResetError, aiohttp.ClientConnectionError):
        pass  # the client left after the last event
    return resp


async def _relay_decode(proxy, out, plan, dec_url, headers):
    """Relays the decode leg's SSE events; returns an error message, None,
    or RETAKE: the decode failed the request before its first token
    (proxy_retake; nothing of its answer sent)."""
    where = f"decode instance {dec_url}"
    judge = True  # until a token of this leg is out
    r = await proxy.post_once_more(dec_url + "/v1/completions", headers.get("X-Request-Id"),
                                   "decode_retries", json=plan.decode, headers=headers,
                                   timeout=proxy.stream_timeout)
    out.request["mc_leg"] = "decode_answered"
    async with r:
        if r.status != 200:
            raw = await r.read()
            if judge and proxy_retake.failed_answer(r.status, raw):
                return RETAKE
            text = raw.decode("utf-8", "replace")
            try:
                text = json_in.loads(text)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            return f"{where} answered {r.status} after the first token was sent: {text[:500]}"
        # One pass over the bytes: each piece is appended, and only it (and
        # the byte before it) is searched for an event's end.  (Re-joining
        # and re-scanning the whole buffer per piece is quadratic: 4.5 s of
        # the event loop's CPU for an event that never ends, up to the cap.)
        buf = bytearray()
        usage = []  # usage-only events held while judging (dropped by a retake)
        ends = proxy_retake.LineEnds()  # SSE lets lines end in "\r\n" or "\r" too
        async for data in r.content.iter_any():
            out.request["mc_dec_data"] = True  # its engine had it (connector/legs.py)
            scanned = max(len(buf) - 1, 0)  # buf holds no event's end before this
            buf += ends.feed(data)
            chunks = []
            start = 0
            while True:
                end = buf.find(b"\n\n", max(start, scanned))
                if end < 0:
                    break
                line = bytes(buf[start:end]).strip()
                start = end + 2
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    if judge:
                        # no token before the end: vLLM 0.26's failed request
                        # (its error output skipped as an empty chunk)
                        return RETAKE
                    chunks.append(b"data: [DONE]\n\n")
                    await _release(proxy, out, plan, b"".join(chunks))
                    return None
                try:
                    ev = json_in.loads(payload)
                except ValueError:
                    return f"{where} sent an event that is not JSON: {payload[:200]!r}"
                if judge and isinstance(ev, dict) and proxy_retake.event_failed(ev):
                    return RETAKE  # nothing of this leg sent yet (judge)
                settled = (plan.settling and isinstance(ev, dict)
                           and await _settle(proxy, plan, ev, dec_url, headers))
                if settled:
                    plan.settling = False
                    proxy.partial_settled.add(dec_url)
                    if trace.ON:
                        trace.event("proxy_settled", headers.get("X-Request-Id"), dec=dec_url)
                try:
                    chunk = plan.rewrite(ev) if isinstance(ev, dict) else False
                except (AttributeError, TypeError, KeyError, ValueError):
                    chunk = False
                if chunk is False:
                    return (f"{where} sent an event that is not a completion chunk: "
                            f"{payload[:200]!r}")
                if chunk is None:
                    e = ev.get("error") or {}
                    msg = e.get("message") if isinstance(e, dict) else e
                    return f"{where} failed after the first token was sent: {msg}"
                if judge and isinstance(ev, dict) and ev.get("choices") == []:
                    usage.append(chunk)  # a usage-only event: no token yet
                    continue
                chunks += usage + [chunk]
                usage, judge = [], False  # a token of this leg is out or on its way
                if settled:
                    await _release(proxy, out, plan, b"".join(chunks))
                    chunks = []
            del buf[:start]
            if chunks:
                await out.write(b"".join(chunks))
            if len(buf) > MAX_EVENT:
                return (f"{where} sent over {MAX_EVENT >> 20} MiB without an event's end "
                        "(a blank line): not a server-sent event stream")
        if judge:
            return RETAKE  # closed before any token of this leg
        return f"{where} closed the stream before [DONE] (after the first token was sent)"


#: _relay_decode's answer for a decode leg that failed before its first token.
RETAKE = object()


async def _release(proxy, out, plan, data):
    """Writes data, first releasing a held (partial) stream: it is the
    client's from here on."""
    if out.hold:
        proxy.counts["first_token_from_prefill"] += 1
        proxy.counts["first_token_partial"] += 1
    await out.write(data, release=True)
