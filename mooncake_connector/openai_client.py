"""A small synchronous OpenAI-API client that times what it receives.

Used by the end-to-end tests, the serving demo and the serving benchmark to
talk to vLLM servers and the proxy alike.  Standard library only; every call
has a timeout.

    r = request("http://127.0.0.1:8000", "/v1/completions",
                {"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True})
    r.status, r.token_ids, r.text, r.ttft_s, r.itl_s, r.usage

A stream that ends with an SSE error event (status 200 already sent) has
status 200 and r.error set to the event's message.
"""
import http.client
import json
import time
import urllib.parse


class Result:
    """One request's answer.  token_ids/text are the generated ones (first
    choice); ttft_s is the time to the first generated token (for streamed
    requests; the whole request otherwise); itl_s the gaps between later ones."""

    def __init__(self):
        self.status = 0
        self.error = None       # error body / message when status != 200, or the
                                # message of an SSE error event that ended a stream
        self.body = None        # parsed JSON (non-streamed)
        self.events = []        # parsed SSE events (streamed)
        self.text = ""
        self.token_ids = []
        # Per generated token, its top logprobs (largest first), when the
        # request asked for logprobs (completions: "logprobs": k; chat:
        # "logprobs": true, "top_logprobs": k).
        self.top_logprobs = []
        self.prompt_token_ids = None
        self.usage = None
        self.kv_transfer_params = None
        self.ttft_s = None
        self.itl_s = []
        self.total_s = None

    @property
    def cached_tokens(self):
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        return details.get("cached_tokens") or 0

    def __repr__(self):
        return (f"Result(status={self.status}, tokens={len(self.token_ids)}, "
                f"ttft_s={self.ttft_s}, error={self.error!r:.200})")


def _delta(choice):
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or choice.get("message") or {}
    return delta.get("content") or ""


def _top_logprobs(choice):
    """[[logprob, ...] largest first, per token] of one choice, [] if none."""
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        return []
    out = []
    if isinstance(lp.get("top_logprobs"), list):          # completions
        for d in lp["top_logprobs"]:
            out.append(sorted((v for v in (d or {}).values() if isinstance(v, (int, float))),
                              reverse=True))
    elif isinstance(lp.get("content"), list):             # chat
        for t in lp["content"]:
            out.append(sorted((x.get("logprob") for x in t.get("top_logprobs") or []
                               if isinstance(x.get("logprob"), (int, float))), reverse=True))
    return out


def request(base_url, path, body, timeout=120.0, headers=None):
    """POSTs body (a dict) to base_url + path; streams when body["stream"]."""
    u = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    res = Result()
    t0 = time.perf_counter()
    try:
        conn.request("POST", path, body=json.dumps(body),
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        res.status = resp.status
        if resp.status != 200:
            res.error = resp.read().decode("utf-8", "replace")
            return res
        if not body.get("stream"):
            res.body = json.loads(resp.read())
            res.ttft_s = res.total_s = time.perf_counter() - t0
            choice = res.body["choices"][0]
            res.text = _delta(choice)
            res.token_ids = list(choice.get("token_ids") or [])
            res.top_logprobs = _top_logprobs(choice)
            res.prompt_token_ids = res.body.get("prompt_token_ids") or choice.get(
                "prompt_token_ids")
            res.usage = res.body.get("usage")
            res.kv_transfer_params = res.body.get("kv_transfer_params")
            return res
        last = None
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            ev = json.loads(data)
            now = time.perf_counter()
            res.events.append(ev)
            if ev.get("error"):
                err = ev["error"]
                res.error = err.get("message") if isinstance(err, dict) else str(err)
                continue
            if ev.get("usage"):
                res.usage = ev["usage"]
            for choice in ev.get("choices") or []:
                if choice.get("index", 0) != 0:
                    continue
                ids = choice.get("token_ids") or []
                text = _delta(choice)
                if choice.get("prompt_token_ids"):
                    res.prompt_token_ids = choice["prompt_token_ids"]
                if ev.get("prompt_token_ids"):
                    res.prompt_token_ids = ev["prompt_token_ids"]
                if not ids and not text:
                    continue
                res.token_ids.extend(ids)
                res.top_logprobs.extend(_top_logprobs(choice))
                res.text += text
                if last is None:
                    res.ttft_s = now - t0
                else:
                    res.itl_s.append(now - last)
                last = now
        res.total_s = time.perf_counter() - t0
        return res
    except (OSError, http.client.HTTPException, ValueError) as e:
        res.status = res.status if res.status != 200 else 0
        res.error = f"{type(e).__name__}: {e}"
        return res
    finally:
        conn.close()
