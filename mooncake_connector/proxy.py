"""The disaggregated-serving proxy: prefill first, then decode.

    python -m mooncake_connector.proxy --prefill http://P1:8100 [http://P2:8100 ...] \\
        --decode http://D1:8200 [...] --port 8000 [--flow a|b] [--first-token prefill|decode]
    python -m mooncake_connector.proxy --passthrough http://C:8300 [...] --port 8001

Serves POST /v1/completions and /v1/chat/completions (streaming or not),
GET /v1/models, GET /health, GET /stats (the proxy's counters) and GET
/metrics (the same in Prometheus text format, plus answers by status and a
request-duration histogram).  Each request goes to one prefill instance
and then one decode instance, each picked round-robin.  /health probes
the upstreams once for the calls of a second (HEALTH_CACHE_S).

Hostile or many clients: a request header must arrive within
--header-timeout, a body must not stall as long and must arrive in full
within --body-timeout (408); the soft open-file limit is raised to the hard
one, client connections are kept to half of it (503 past that) and
upstream connections in use to the other half less 64 (more requests wait).

Flow a (the seed's): the prefill instance gets the request with
max_tokens=1 (not streamed); the decode instance then gets the original
request and finds the prompt's KV by its tokens.
Flow b (vLLM's kv_transfer_params): the prefill request carries
kv_transfer_params {"do_remote_decode": true, ...}; the kv_transfer_params of
its answer are passed to the decode request.

Unlike the seed's proxy, errors reach the client: a prefill or decode answer
other than 200 is returned with its status and body, an unreachable instance
gives 502 naming it, and a client's Authorization header is passed through
(else $OPENAI_API_KEY, if set).

Prefill failover: a prefill instance that cannot be connected to (refused,
or no connection within 10 s; nothing was sent, so nothing is held there)
is marked down for --prefill-down-s seconds and the request goes to the
next instance, each instance tried at most once per request; instances
marked down are tried last.  So does one whose kept-alive connection was
reset twice (sent once more after the first reset: prefill_retries).
Counted in /stats and /metrics (prefill_failovers).  In flow a, with as many decode as prefill instances,
the decode instance follows the prefill's index (the round robins pair
them: each decode's mooncake.json names its prefill), so the KV is found.

Flows a, b: a decode leg whose answer ended before any output (the client
left, an error) leaves the prefill holding the prompt unless the decode's
connector says it never saw the leg ("mc_forget"); a decode that does not
answer (stopped, overloaded, restarting, gone: a timeout, a 5xx, a reset,
a refused connection) is asked again, 0.5 s then doubling to 8 s, until
--forget-retry-s after the prefill's answer, at most --forget-max such
forgets at once (docs/connector.md, "Holds and releases").

Every flow: a decode leg that failed before its first token (a decode on
load_failure_policy "fail" whose KV load failed) is sent once more without
kv_transfer_params, once per request (mooncake_connector.proxy_retake;
counted decode_retakes; --decode-retake off).

First token from prefill (default for streamed requests; --first-token
decode turns it off): the client gets the prefill's token as the first
chunk at once and the decode instance continues from it
(mooncake_connector.proxy_first_token).  Non-streamed requests, and streamed
ones that path cannot represent faithfully, take the path above.

Flow push (--flow push): both legs at once.  The decode instance admits
the request (blocks allocated, waiting for remote KV) and tells the prefill
instance where its blocks are; the prefill instance WRITEs the prompt's KV
into them (docs/connector.md, "Push flow").  The legs are joined by a
transfer_id; the decode leg names the prefill engine (--prefill-engine,
else the decode's configured prefill_url; with a data-parallel prefill's
bootstrap table, from --prefill-bootstrap or found from its push answers,
that prefill's engine per request, the prefill leg pinned to it:
proxy_engines).  The first token comes from the
decode instance; the prefill's answer is discarded (errors counted).

Pass-through mode (--passthrough URL ...): no prefill step, every request
goes to one upstream (round-robin) and its answer is relayed as is: the same
proxy code in front of a colocated server, a reference for benchmarks.
"""
import argparse
import asyncio
import collections
import copy
import ipaddress
import itertools
import logging
import math
import os
import signal
import socket
import sys
import time
import urllib.parse
import uuid

import aiohttp
from aiohttp import web

from mooncake_connector import json_in
from mooncake_connector import http_guard
from mooncake_connector.hostport import join_hostport
from mooncake_connector.proxy_engines import PrefillEngines
from mooncake_connector import proxy_first_token as ft
from mooncake_connector import proxy_retake
from mooncake_connector import trace
from mooncake_connector import request_check

logger = logging.getLogger("mooncake_connector.proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
MAX_BODY = 64 << 20  # a client request's body, bytes
#: Request bodies held at once, bytes (--body-budget-mb): a parsed request
#: and its legs take up to ~9x its body (a 60 MiB prompt of token ids:
#: 550 MiB), so many large bodies at once could take the proxy's memory.
BODY_BUDGET = 1 << 30
KEEPALIVE_S = 4.0


# aiohttp's sock_read timeout (--idle-timeout); before aiohttp 3.10 a
# ServerTimeoutError
_SOCK_READ_TIMEOUT = getattr(aiohttp, "SocketTimeoutError", aiohttp.ServerTimeoutError)


def _content_type_problem(value):
    """Why a request with this Content-Type header is refused (None: taken):
    as vLLM's API server, only application/json, in any case, with any
    parameters (charset=utf-8); no header at all is refused there too."""
    if value is None:
        return ("no Content-Type header: the request body must be JSON sent with "
                "'Content-Type: application/json' (vLLM's API server refuses it without)")
    if value.split(";", 1)[0].strip().lower() == "application/json":
        return None
    shown = ascii(value[:100]) + ("..." if len(value) > 100 else "")
    return (f"Content-Type {shown} is not application/json: send the JSON body with "
            "'Content-Type: application/json' (vLLM's API server refuses any other)")


def _error(status, message, kind="proxy_error"):
    return web.json_response({"error": {"message": message, "type": kind, "code": status}},
                             status=status)


#: A forget asks at most this many engines of a decode with vLLM data parallelism.
MAX_DP_FORGET = 64
PAST_LAST_ENGINE = object()  # _ask_forget: the decode has no engine of that DP rank
NO_ANSWER = object()  # _ask_forget: the decode did not answer (timeout, 5xx, reset, refused)
#: A forget the decode did not answer is asked again this long after, the
#: gap doubling up to FORGET_RETRY_MAX_GAP_S (proxy: --forget-retry-s).
FORGET_RETRY_FIRST_S = 0.5
FORGET_RETRY_MAX_GAP_S = 8.0
#: Defaults of --forget-retry-s (how long after the prefill's answer a
#: decode is asked again: below the prefill's default hold_timeout_s, 120 s,
#: by more than a release takes to reach it), --forget-timeout-s (one
#: question) and --forget-max (forgets in flight at once).
FORGET_RETRY_S = 90.0
FORGET_TIMEOUT_S = 10.0
FORGET_MAX = 2048
#: The most of a release's / forget's answer read (a one-token completion:
#: ~1 KB); a longer one is not read further (memory bounded against a
#: decode or prefill answering with anything else).
CONTROL_ANSWER_MAX = 64 << 10


def _leg_ok(task):
    """A push prefill leg's task (_push_prefill) did not fail (cancelled: the
    client left, not the prefill's fault)."""
    return task.cancelled() or (task.exception() is None and task.result() is not False)


def forget_retry_for(hold_timeout_s):
    """A --forget-retry-s for prefills that hold prompts hold_timeout_s: a
    quarter of it, at least 10 s, below it (the prefill's answer, the
    release's way there and its wait for a step); 90 for the default 120;
    0 (never asked again) from 10 s down."""
    return max(0.0, hold_timeout_s - max(10.0, hold_timeout_s / 4))


def _forget_keeps(got):
    """An engine's forget answer (_ask_forget's) that keeps the prompt held
    whatever the others say: not known (None, NO_ANSWER), or a verdict other
    than "unseen"."""
    return got is None or got is NO_ANSWER or (got is not PAST_LAST_ENGINE and
                                               got[0] != "unseen")


def _forget_engines(answers, first_rank):
    """The decode's engine count once `answers` (ranks first_rank on, in
    order, none of them _forget_keeps) end the list: the first rank vLLM
    refused, or the rank after one answering without mc_dp (no data
    parallelism); False where rank 0 is refused (no verdict); None where
    every rank asked was an engine that said "unseen" (ask further)."""
    for rank, got in enumerate(answers, first_rank):
        if got is PAST_LAST_ENGINE:
            return rank if rank > 0 else False
        if not got[1]:
            return rank + 1
    return None


async def _read_capped(resp, cap):
    """resp's body up to cap + 1 bytes (more than cap: not read further)."""
    buf = bytearray()
    while len(buf) <= cap:
        chunk = await resp.content.read(cap + 1 - len(buf))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def _prompt_ids(pre):
    """The prompt's token ids in a prefill answer (pre: its JSON), or None."""
    if not isinstance(pre, dict):
        return None
    choices = pre.get("choices") or [{}]
    ids = pre.get("prompt_token_ids") or (choices[0].get("prompt_token_ids")
                                          if isinstance(choices[0], dict) else None)
    if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
        return ids
    return None


def _error_message(resp):
    """The message of an error answer made by _error or _upstream_error."""
    try:
        return str(json_in.loads(resp.body)["error"]["message"])
    except (ValueError, KeyError, TypeError, IndexError):
        return f"upstream answered {resp.status}"


def _upstream_error(role, url, status, raw, content_type):
    """An upstream's non-200 answer for the client: passed through when it is
    an OpenAI-style JSON error with a message, else (an empty body, HTML, a
    router's or another proxy's page) our own JSON error naming the upstream,
    its status and the start of what it sent, with the same status."""
    try:
        msg = json_in.loads(raw)["error"]["message"]
        if isinstance(msg, str) and msg.strip():
            return web.Response(status=status, body=raw,
                                content_type=content_type or "application/json")
    except (ValueError, KeyError, TypeError, IndexError):
        pass
    text = raw[:300].decode("utf-8", "replace").strip()
    return _error(status, f"{role} {url} answered {status} with "
                  + (f"no OpenAI error message: {text!r}" if text else "an empty body")
                  + " (is that URL a vLLM server of this deployment?)", "upstream_error")


class Proxy:
    def __init__(self, prefill=(), decode=(), flow="a", timeout=6 * 3600, api_key=None,
                 first_token="prefill", passthrough=(), idle_timeout=300.0,
                 prefill_down_s=5.0, prefill_engines=(), push_layerwise=None,
                 push_layer_load=None, push_layer_watch=None,
                 header_timeout=http_guard.HEADER_TIMEOUT_S, body_budget=BODY_BUDGET,
                 body_timeout=http_guard.BODY_TIMEOUT_S, push_layer_read=None,
                 prefill_bootstraps=(), forget_retry_s=FORGET_RETRY_S,
                 forget_timeout_s=FORGET_TIMEOUT_S, forget_max=FORGET_MAX, decode_retake=True):
        self.passthrough = [u.rstrip("/") for u in passthrough]
        if self.passthrough and (prefill or decode):
            raise ValueError("--passthrough takes no --prefill/--decode")
        if not self.passthrough and (not prefill or not decode):
            raise ValueError("need at least one --prefill and one --decode URL "
                             "(or --passthrough URL)")
        if first_token not in ("prefill", "decode"):
            raise ValueError(f"first_token={first_token!r}: expected 'prefill' or 'decode'")
        self.prefill = [u.rstrip("/") for u in prefill]
        if flow not in ("a", "b", "push"):
            raise ValueError(f"flow={flow!r}: expected 'a', 'b' or 'push'")
        self.prefill_engines = list(prefill_engines or ())
        if self.prefill_engines and len(self.prefill_engines) != len(self.prefill):
            raise ValueError(f"--prefill-engine names {len(self.prefill_engines)} engines for "
                             f"{len(self.prefill)} --prefill URLs: give one per URL, same order")
        if prefill_bootstraps and len(prefill_bootstraps) != len(self.prefill):
            raise ValueError(f"--prefill-bootstrap names {len(prefill_bootstraps)} servers for "
                             f"{len(self.prefill)} --prefill URLs: give one per URL, same order")
        self.push_layerwise = push_layerwise
        self.push_layer_load = push_layer_load
        self.push_layer_watch = push_layer_watch
        self.push_layer_read = push_layer_read
        self.decode = [u.rstrip("/") for u in decode] or self.passthrough
        self.flow = flow
        self.first_token = first_token
        # A decode leg that fails before its first token (vLLM's
        # kv_load_failure_policy "fail": its KV load failed) is sent once
        # more without kv_transfer_params (proxy_retake)
        self.decode_retake = bool(decode_retake)
        self.api_key = api_key
        # Flows a, b: a decode that does not answer a forget (_post_forget)
        # is asked again until forget_retry_s after the prefill's answer (0:
        # never); one question waits forget_timeout_s; at most forget_max
        # forgets in flight (asked or waiting to be asked again), a forget
        # past them is not sent (counted decode_forgets_dropped).
        if not 0 <= forget_retry_s < float("inf"):
            raise ValueError(f"forget_retry_s={forget_retry_s!r}: expected seconds >= 0")
        if not 0 < forget_timeout_s < float("inf"):
            raise ValueError(f"forget_timeout_s={forget_timeout_s!r}: expected seconds > 0")
        if not (isinstance(forget_max, int) and forget_max >= 1):
            raise ValueError(f"forget_max={forget_max!r}: expected an integer >= 1")
        self.forget_retry_s, self.forget_timeout_s = float(forget_retry_s), float(forget_timeout_s)
        self.forget_max, self._forgets_out = forget_max, 0
        self._forget_warn = http_guard.Throttled()
        # A client that sends nothing of its request's body for this long is
        # answered 408 and disconnected (as a stalled header: http_guard).
        self.header_timeout = header_timeout
        # ... and one whose whole body has not come this long after its
        # header (a few bytes at a time, each inside header_timeout).
        self.body_timeout = body_timeout
        # The soft open-file limit while serving (None: none or unknown), for
        # messages; and how often running out of descriptors is logged.
        self.nofile = None
        # Upstream connections in use at once (0: no limit; set by _serve
        # from the open-file limit): more requests wait for one.
        self.upstream_limit = 0
        self._open_conns = None  # [client connections open] (_serve's http_guard.guarded)
        self._reading = set()  # handlers reading a request's body (stop_reading)
        self._fd_warn = http_guard.Throttled()
        # GET /health: (monotonic time started, task) of the last probe of
        # the upstreams, whose answer serves the calls of HEALTH_CACHE_S.
        self._health = None
        # Bytes of request bodies held by requests in flight, and the most
        # allowed: a body past it is answered 503 (counted).
        self.body_budget, self._body_bytes = body_budget, 0
        self._p = itertools.cycle(range(len(self.prefill)))
        self.prefill_down_s = float(prefill_down_s)
        self._down_until = {}  # prefill URL -> time.monotonic() it is tried first again
        self._d = itertools.cycle(self.decode)
        # idle_timeout: a streamed upstream answer that sends nothing for this
        # long (a stalled stream, a request stuck in a queue) fails the
        # request (0 = never).  Not for non-streamed answers: they send
        # nothing until the whole generation is done.
        self.idle_timeout = idle_timeout or None
        self._timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=10)
        self.stream_timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=10,
                                                    sock_read=self.idle_timeout)
        self.session = None
        self.log = logger
        self._max_model_len = {}  # decode URL -> max_model_len from its /v1/models
        self._mml_asking = {}  # decode URL -> the one lookup in flight (a task)
        self._mml_retry_at = {}  # decode URL -> monotonic time a failed lookup may be retried
        self._ids_in_flight = collections.Counter()  # client request id -> requests in flight
        self.counts = {"requests": 0, "bad_requests": 0, "slow_header_closes": 0,
                       "slow_body_closes": 0, "body_budget_refusals": 0,
                       "fd_limit_refusals": 0, "fd_limit_errors": 0,
                       "request_ids_replaced": 0, "request_ids_suffixed": 0,
                       "prefill_errors": 0, "prefill_failovers": 0,
                       "prefill_retries": 0, "decode_retries": 0, "decode_errors": 0,
                       "decode_retakes": 0,
                       "first_token_from_prefill": 0, "first_token_partial": 0,
                       "first_token_partial_unsettled": 0,
                       "finished_at_prefill": 0,
                       "clients_gone_in_prefill": 0, "clients_gone_before_decode": 0,
                       "prefill_releases_sent": 0, "clients_gone_before_decode_answer": 0,
                       "decode_forgets_sent": 0, "decode_forgets_unseen": 0,
                       "decode_forgets_retried": 0, "decode_forgets_unseen_late": 0,
                       "decode_forgets_seen_late": 0, "decode_forgets_gave_up": 0,
                       "decode_forgets_dropped": 0,
                       "stream_errors_after_first_token": 0,
                       "first_token_fallbacks": collections.Counter()}
        # decode instances where a partial first token's text was settled
        # (proxy_first_token: later ones are released before the decode's text)
        self.partial_settled = set()
        # The proxy's own timings of recent fast-path requests (/stats):
        # client request in -> prefill answer parsed (mostly the prefill
        # server), and prefill answer parsed -> first chunk written (the
        # proxy's own step).  Flow push: client request in -> the prefill
        # leg's answer read, -> the decode leg's first chunk, and per request
        # the first chunk's time minus the prefill answer's (negative: the
        # decode answered before the prefill leg's HTTP answer came back).
        self._lat = {k: collections.deque(maxlen=1000)
                     for k in ("to_prefill_answer_ms", "prefill_answer_to_first_chunk_ms",
                               "push_to_prefill_answer_ms", "push_to_first_chunk_ms",
                               "push_first_chunk_after_prefill_answer_ms")}
        self._lat_total = collections.Counter()
        self._bg = set()  # background tasks (releases at the prefill)
        # decode URL -> its engines (vLLM data parallelism) as its last
        # forget's answers counted them (_forget_round)
        self._decode_engines = {}
        # flow push: a data-parallel prefill's engines, from its bootstrap server
        # (without --prefill-bootstrap: found from the prefill's push answers)
        self.prefill_dp = (PrefillEngines(list(prefill_bootstraps) or [None] * len(self.prefill),
                                          self.counts)
                           if flow == "push" and self.prefill else None)
        self.prom = PromCounters()

    async def start(self, app):
        # Idle upstream connections are dropped after 4 s, before vLLM's
        # uvicorn closes its side (5 s, VLLM_HTTP_TIMEOUT_KEEP_ALIVE): else a
        # request sent on a connection the server is closing gets a reset.
        self.session = aiohttp.ClientSession(
            timeout=self._timeout,
            connector=aiohttp.TCPConnector(limit=self.upstream_limit,
                                           keepalive_timeout=KEEPALIVE_S))

    async def stop(self, app):
        await self.session.close()

    def _headers(self, request, rid):
        h = {"Content-Type": "application/json", "X-Request-Id": rid}
        auth = request.headers.get("Authorization")
        if auth:
            h["Authorization"] = auth
        elif self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def _prefill_body(self, body, chat):
        p = copy.deepcopy(body)
        p["max_tokens"] = 1
        if chat and "max_completion_tokens" in p:
            p["max_completion_tokens"] = 1
        p["stream"] = False
        p.pop("stream_options", None)
        if self.flow == "b":
            p["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                       "remote_engine_id": None, "remote_block_ids": None,
                                       "remote_host": None, "remote_port": None}
        return p

    #: A decode instance's /v1/models: how long one lookup may take, and how
    #: long after a failed one its requests take the seed's path without
    #: asking again (a hanging /v1/models must not add the wait to each).
    MML_TIMEOUT_S = 5.0
    MML_RETRY_S = 30.0

    async def max_model_len(self, url, headers):
        """The instance's context length (its /v1/models), cached; None if
        unknown.  Concurrent requests share one lookup; after a failed one
        the next is tried only MML_RETRY_S later."""
        if url in self._max_model_len:
            return self._max_model_len[url]
        if time.monotonic() < self._mml_retry_at.get(url, 0.0):
            return None
        task = self._mml_asking.get(url)
        if task is None:
            task = self._mml_asking[url] = asyncio.ensure_future(self._ask_mml(url, headers))
            task.add_done_callback(lambda _t: self._mml_asking.pop(url, None))
        return await asyncio.shield(task)

    async def _ask_mml(self, url, headers):
        try:
            async with self.session.get(url + "/v1/models", headers=headers,
                                        timeout=aiohttp.ClientTimeout(
                                            total=self.MML_TIMEOUT_S)) as r:
                data = (await r.json(content_type=None))["data"]
                self._max_model_len[url] = int(data[0]["max_model_len"])
                return self._max_model_len[url]
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError,
                IndexError, TypeError) as e:
            self._mml_retry_at[url] = time.monotonic() + self.MML_RETRY_S
            logger.warning("max_model_len of %s unknown (%r): first token from decode; "
                           "asked again in %g s", url, e, self.MML_RETRY_S)
            return None

    def _prefill_order(self):
        """This request's prefill instance indexes in the order to try: the
        round robin's pick, then the others in turn; those marked down go
        last (still tried: all may be back)."""
        first = next(self._p)
        n = len(self.prefill)
        order = [(first + k) % n for k in range(n)]
        now = time.monotonic()
        up = [i for i in order if self._down_until.get(self.prefill[i], 0.0) <= now]
        return up + [i for i in order if i not in up]

    async def post_once_more(self, url, rid, counter, **kw):
        """self.session.post (awaited: the answer's head is in), sent once
        more when the instance drops or resets the connection before
        answering: a kept-alive connection it was closing (an idle timeout,
        a SIGSTOPped server resuming).  counter: the count of such resends."""
        try:
            return await self.session.post(url, **kw)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
            if isinstance(e, aiohttp.ClientConnectorError):
                raise
            self.counts[counter] += 1
            logger.warning("%s dropped the connection for %s (%r): once more", url, rid, e)
        return await self.session.post(url, **kw)

    def _fallback(self, reason, rid):
        # Counted by kind: an unknown field's name and an upstream answer's
        # error are the client's / upstream's text (unbounded: /stats and
        # /metrics would grow a reason per name); the log names them.
        kind = ("unknown field" if reason.startswith("field ") else
                "prefill answer not understood"
                if reason.startswith("prefill answer not understood") else reason)
        self.counts["first_token_fallbacks"][kind] += 1
        logger.info("request %s: first token from decode: %s", rid, reason[:300])

    def _request_id(self, request):
        """The client's X-Request-Id, or a new one when there is none or it
        cannot be used (request_check.request_id_problem: too long, a space,
        non-ASCII): replaced, logged and counted, not refused -- vLLM itself
        takes any id, and the id only names the request.  The answer carries
        the id used in its X-Request-Id header."""
        rid = request.headers.get("X-Request-Id")
        if rid:
            why = request_check.request_id_problem(rid)
            if why is None:
                return rid
        new = f"mc-{uuid.uuid4().hex}"
        if rid:
            self.counts["request_ids_replaced"] += 1
            shown = ascii(rid[:64]) + ("..." if len(rid) > 64 else "")
            logger.warning("X-Request-Id %s %s: this request's id is %s instead", shown, why,
                           new)
        return new

    def _upstream_id(self, rid):
        """The id the vLLM servers get for this request: the client's, unless
        a request with that id is in flight through this proxy already (a
        client with a fixed id, a retry sent while the first try runs); then
        the id plus "-" and 8 hex digits, logged and counted.  vLLM takes
        the header into its request id: vLLM 0.32 adds a random part of its
        own, but with VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1 (or a vLLM
        without that) a second request with a running request's id kills
        the engine ("duplicate request id").  Held until _release_id."""
        n = self._ids_in_flight[rid]
        self._ids_in_flight[rid] += 1
        if not n:
            return rid
        up = f"{rid}-{uuid.uuid4().hex[:8]}"
        self.counts["request_ids_suffixed"] += 1
        logger.info("X-Request-Id %s is in flight already: the vLLM servers get %s for this "
                    "request (the client's answer keeps %s)", rid, up, rid)
        return up

    def _release_id(self, rid):
        self._ids_in_flight[rid] -= 1
        if self._ids_in_flight[rid] <= 0:
            del self._ids_in_flight[rid]

    async def handle(self, request):
        self.counts["requests"] += 1
        held = [0]  # this request's bytes of self.body_budget

        def take(n):
            if self._body_bytes + n > self.body_budget:
                raise http_guard.OverBudget(
                    f"the proxy holds {self._body_bytes} bytes of request bodies in flight; "
                    f"{n} more for this one would pass its budget of {self.body_budget} "
                    "bytes (--body-budget-mb): retry later, or send a smaller request")
            self._body_bytes += n
            held[0] += n
        try:
            return await self._handle(request, take)
        finally:
            self._body_bytes -= held[0]

    async def _read_body(self, request, take):
        me = asyncio.current_task()
        self._reading.add(me)
        try:
            return await http_guard.read_body(request, MAX_BODY, self.header_timeout, take,
                                              self.body_timeout)
        finally:
            self._reading.discard(me)

    def stop_reading(self):
        """SIGTERM/SIGINT: requests whose body has not come in full are
        dropped (their connections closed), not waited for: a client that
        stalls its upload held the proxy's stop for --header-timeout (30 s),
        or aiohttp's 60 s shutdown bound with a longer one.  Requests being
        answered are still waited for."""
        for task in list(self._reading):
            task.cancel()
        return len(self._reading)

    async def _handle(self, request, take):
        t_in = time.perf_counter()
        chat = request.path.endswith("/chat/completions")
        why = _content_type_problem(request.headers.get("Content-Type"))
        if why is not None:
            # vLLM's API server takes only application/json (its
            # validate_json_request: a 400); the proxy refuses the same
            # requests, as a 415 naming the header, before reading the body
            # (closed after the answer).
            self.counts["bad_requests"] += 1
            return await http_guard.answer_and_close(request, _error(
                415, why, "invalid_request_error"))
        try:
            body = request_check.parse(await self._read_body(request, take))
            request_check.check(body, chat)
        except http_guard.OverBudget as e:
            self.counts["body_budget_refusals"] += 1
            logger.warning("request refused: %s", e)
            return await http_guard.answer_and_close(request, _error(503, str(e)))
        except request_check.BadRequest as e:
            self.counts["bad_requests"] += 1
            return _error(400, str(e), "invalid_request_error")
        except http_guard.BodyStalled as e:
            # BodyTooSlow included: trickled, each piece inside the stall deadline
            self.counts["slow_body_closes"] += 1
            slow = isinstance(e, http_guard.BodyTooSlow)
            logger.warning("closing a connection whose request body %s (%s)",
                           "came too slowly" if slow else "stalled", e)
            return await http_guard.answer_and_close(request, _error(
                408, f"{e} (the proxy's {'--body-timeout' if slow else '--header-timeout'})",
                "invalid_request_error"))
        except http_guard.BodyUnreadable as e:
            self.counts["bad_requests"] += 1
            return await http_guard.answer_and_close(request, _error(
                400, str(e), "invalid_request_error"))
        except web.HTTPRequestEntityTooLarge:
            # Refused on its Content-Length before a byte of it was read, or
            # once a chunked body passed the cap: closed after the answer, as
            # aiohttp would otherwise read and drop up to 10 s more of it.
            self.counts["bad_requests"] += 1
            return await http_guard.answer_and_close(request, _error(
                413, f"request body is over {MAX_BODY} bytes, the proxy's limit",
                "invalid_request_error"))
        rid = self._request_id(request)
        headers = self._headers(request, self._upstream_id(rid))
        try:
            return await self._route(request, body, chat, headers, rid, t_in)
        except asyncio.CancelledError:
            # The client left (handler cancellation): in the prefill leg, or
            # after the prefill answered and before the decode leg was sent
            # (flows a, b: the prefill holds the prompt's KV for a pull that
            # will not come, until hold_timeout_s).
            leg = request.get("mc_leg")
            if leg == "prefill":
                self.counts["clients_gone_in_prefill"] += 1
                self._release_at_prefill(request)
            elif leg == "answered":
                self.counts["clients_gone_before_decode"] += 1
                self._release_at_prefill(request)
            elif leg == "decode":
                # The decode leg was sent (or was being sent) but had not
                # answered: whether its vLLM took the request is not known
                # here (_forget_at_decode asks).
                self.counts["clients_gone_before_decode_answer"] += 1
            raise
        finally:
            if request.get("mc_leg") in ("decode", "decode_answered") and \
                    not request.get("mc_dec_data"):
                self._forget_at_decode(request)
            if not request.get("mc_release_id_later"):
                self._release_id(rid)

    async def _route(self, request, body, chat, headers, rid, t_in):
        """The request, checked, through its flow: headers carry the
        upstream X-Request-Id; rid is the client's, for its answer and the
        log."""
        if trace.ON:
            trace.event("proxy_in", rid, t_in=time.monotonic() - (time.perf_counter() - t_in))
        if self.passthrough:
            return await self._relay(request, next(self._d), body, headers, rid)
        order, dec_url = self._prefill_order(), next(self._d)
        if self.flow == "push":
            return await self._push(request, body, chat, headers, rid, order[0], dec_url,
                                    t_in)
        pre_url = self.prefill[order[0]]
        fast = None
        if body.get("stream") and self.first_token == "prefill":
            fast = ft.refusal(body, chat)
            if fast is not None:
                self._fallback(fast, rid)
            fast = fast is None

        # 1. prefill
        pre_body = (ft.prefill_body(body, chat, self.flow == "b") if fast
                    else self._prefill_body(body, chat))
        retried = False
        attempt = 0
        request["mc_leg"] = "prefill"
        while attempt < len(order):
            idx = order[attempt]
            pre_url = self.prefill[idx]
            if trace.ON:
                trace.event("proxy_pre_post", rid, up=headers["X-Request-Id"])
            # A client leaving now may leave the prompt computed and held
            # there (its answer lost): released by this leg's request id.
            request["mc_prefill"] = (pre_url, body.get("model"), None, None, headers)
            try:
                async with self.session.post(pre_url + request.path, json=pre_body,
                                             headers=headers) as r:
                    if trace.ON:
                        trace.event("proxy_pre_head", rid)
                    pre_text = await r.read()
                    if trace.ON:
                        trace.event("proxy_pre_body", rid)
                    if r.status != 200:
                        self.counts["prefill_errors"] += 1
                        logger.warning("prefill %s answered %d for %s", pre_url, r.status, rid)
                        return _upstream_error("prefill", pre_url, r.status, pre_text,
                                               r.content_type)
                self._down_until.pop(pre_url, None)
                break
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
                if http_guard.out_of_fds(e):  # the proxy's own limit, not the instance's
                    return self.no_fds(f"prefill instance {pre_url}", e, rid)
                # Not connected: nothing was sent, the next instance may take it.
                self.counts["prefill_errors"] += 1
                self._down_until[pre_url] = time.monotonic() + self.prefill_down_s
                if attempt + 1 == len(order):
                    tried = ", ".join(self.prefill[i] for i in order)
                    return _error(502, f"prefill instance {pre_url} unreachable: {e!r} (tried "
                                  f"every prefill instance: {tried})", "upstream_error")
                self.counts["prefill_failovers"] += 1
                logger.warning("prefill %s unreachable for %s (%r): trying %s", pre_url, rid, e,
                               self.prefill[order[attempt + 1]])
                attempt += 1
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
                # A kept-alive connection the instance closed or reset (an
                # idle timeout, a restart, a SIGSTOPped server resuming):
                # sent once more, once per request (the prefill leg computes
                # one token; at worst it runs twice, and in flow b the first
                # run's KV is held until hold_timeout_s).  Reset again (the
                # pool's other stale connections to an instance that just
                # died): that instance is taken as down, the next one tried.
                self.counts["prefill_errors"] += 1
                if retried:
                    self._down_until[pre_url] = time.monotonic() + self.prefill_down_s
                    if attempt + 1 == len(order):
                        return _error(502, f"prefill instance {pre_url} unreachable: {e!r}",
                                      "upstream_error")
                    self.counts["prefill_failovers"] += 1
                    logger.warning("prefill %s reset the connection twice for %s (%r): trying "
                                   "%s", pre_url, rid, e, self.prefill[order[attempt + 1]])
                    attempt, retried = attempt + 1, False  # that one may be sent once more too
                    continue
                retried = True
                self.counts["prefill_retries"] += 1
                logger.warning("prefill %s dropped the connection for %s (%r): once more",
                               pre_url, rid, e)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                self.counts["prefill_errors"] += 1
                return _error(502, self.upstream_failure(f"prefill instance {pre_url}", e,
                                                         "unreachable"), "upstream_error")
        if self.flow == "a" and len(self.decode) == len(self.prefill):
            # Flow a: the decode paired with this prefill by index (what the two
            # round robins give anyway, and after a failover still the pair).
            dec_url = self.decode[idx]
        request["mc_leg"] = "answered"
        try:
            pre = json_in.loads(pre_text)
        except ValueError:
            pre = None
        params = pre.get("kv_transfer_params") if isinstance(pre, dict) else None
        request["mc_prefill"] = (pre_url, body.get("model"), pre, params, headers)
        request["mc_pre_t"] = time.monotonic()  # the prefill holds the prompt from about now
        if self.flow == "b" and not isinstance(pre, dict):
            self.counts["prefill_errors"] += 1
            text = pre_text[:200].decode("utf-8", "replace")
            return _error(502, f"prefill instance {pre_url} answered 200 with a body that is "
                          f"not a JSON object: {text!r} (is that URL a vLLM server of this "
                          "deployment?)", "upstream_error")
        if self.flow == "b" and params is None:
            self.counts["prefill_errors"] += 1
            return _error(502, f"prefill instance {pre_url} returned no kv_transfer_params "
                          "(is it started with --kv-transfer-config kv_role kv_producer?)",
                          "upstream_error")

        # 2a. first token from prefill, then decode continues from it
        if fast:
            plan, why = None, None
            mml = await self.max_model_len(dec_url, headers)
            if mml is None:
                why = "decode instance's max_model_len unknown"
            else:
                try:
                    plan = ft.Plan(body, chat, pre, mml)
                    why = plan.unusable()
                except (KeyError, IndexError, TypeError, AttributeError) as e:
                    why = f"prefill answer not understood ({e!r})"
            if why is None:
                t_pre = time.perf_counter()
                self.note_latency("to_prefill_answer_ms", t_pre - t_in)
                resp = await ft.stream(self, request, plan, dec_url, headers, rid, t_pre)
                if resp is not None:
                    if request.get("mc_leg") == "answered":
                        if not plan.done:
                            self.counts["clients_gone_before_decode"] += 1
                        self._release_at_prefill(request)
                    return resp
                # A partial first token whose text could not be settled:
                # nothing was sent; the decode leg used the prefill's KV
                # (flow b: its kv_transfer_params are spent), which the
                # decode instance's prefix cache now holds.
                why, params = plan.unsettled, None
            self._fallback(why, rid)

        # 2b. decode answers the original request, streamed through as it comes
        dec_body = (body if self.flow != "b" or params is None
                    else dict(body, kv_transfer_params=params))
        request["mc_leg"] = "decode"
        request["mc_dec_url"] = dec_url
        return await self._relay(request, dec_url, dec_body, headers, rid, "decode",
                                 retake=self._retake_body(body))

    def _release_at_prefill(self, request):
        """Flows a, b: the prefill answered but no decode leg follows (the
        client left, or the first token from the prefill ended the request):
        the prefill holds the prompt's KV for a pull that will not come, until
        hold_timeout_s.  Tells it now, in the background: a one-token request
        whose kv_transfer_params {"mc_release": ...} name the prefill leg (the
        X-Request-Id it was sent with, which vLLM's request id contains; flow
        b: its request id; the prompt's token ids where the answer has them,
        as the first-token path's does), which the prefill's connector turns
        into a release of that prompt's entries (docs/connector.md, "Holds
        and releases").  Also for a client that left during the prefill leg:
        its prompt may have been computed, its answer lost.  Counted
        prefill_releases_sent."""
        got = request.get("mc_prefill")
        if not got:
            return
        request["mc_prefill"] = None  # once
        pre_url, model, pre, params, headers = got
        rel = {}
        if headers.get("X-Request-Id"):
            rel["x_request_id"] = headers["X-Request-Id"]
        if isinstance(params, dict) and isinstance(params.get("remote_request_id"), str):
            rel["request_id"] = params["remote_request_id"]
        ids = _prompt_ids(pre)
        if ids:
            rel["prompt_token_ids"] = ids
        if not rel:
            return
        first = rel.get("prompt_token_ids", [0])[0]
        body = {"model": model, "prompt": [first], "max_tokens": 1,
                "kv_transfer_params": {"mc_release": rel}}
        h = dict(headers, **{"X-Request-Id": f"{headers.get('X-Request-Id', 'mc')}-release"})
        task = asyncio.ensure_future(self._post_release(pre_url, body, h))
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    def _forget_at_decode(self, request):
        """Flows a, b: the decode leg was sent, but its answer ended (the
        client left, an error) before any of its output came: whether the
        decode's connector saw the request (and pulled or released the
        prompt) is not known here; if it did not, the prefill holds the
        prompt until hold_timeout_s.  Asks that decode instance, in the
        background, with a one-token request whose kv_transfer_params
        {"mc_forget": {"x_request_id", "ask"}} name the leg (connector/legs.py;
        ask: this forget's id, the same when asked again); its answer
        "unseen" (never there, or ended owing its pull; a request of it
        arriving later will neither load nor release) sends the prefill its
        release (_release_at_prefill).  A decode that does not answer is
        asked again (_post_forget).  Counted decode_forgets_sent /
        decode_forgets_unseen; at most forget_max at once (else
        decode_forgets_dropped)."""
        got, dec_url = request.get("mc_prefill"), request.get("mc_dec_url")
        if not got or not dec_url or self.flow not in ("a", "b"):
            return
        xid = got[4].get("X-Request-Id")
        if not xid:
            return
        if self._forgets_out >= self.forget_max:
            self.counts["decode_forgets_dropped"] += 1
            self._forget_warn.warn(
                "%d forgets in flight (--forget-max): decode %s is not asked about leg %s; "
                "the prefill %s holds its prompt until its hold_timeout_s", self._forgets_out,
                dec_url, xid, got[0])
            return
        # What the questions and the release need, not the request (a
        # forget may outlive it by --forget-retry-s): the prefill answer
        # only as the prompt's ids.
        pre_url, model, pre, params, headers = got
        ids = _prompt_ids(pre)
        leg = {"mc_prefill": (pre_url, model, {"prompt_token_ids": ids} if ids else None,
                              params, headers),
               "t": request.get("mc_pre_t") or time.monotonic(), "ask": uuid.uuid4().hex}
        self._forgets_out += 1
        task = asyncio.ensure_future(self._post_forget(leg, dec_url, xid))
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def _post_forget(self, leg, dec_url, xid):
        """_forget_round, asked again while the decode does not answer (a
        timeout, a 5xx, a reset, a refused connection: stopped, overloaded,
        restarting or gone), FORGET_RETRY_FIRST_S after, the gap doubling up
        to FORGET_RETRY_MAX_GAP_S, until forget_retry_s after the prefill's
        answer (leg["t"]): past that the prefill's hold may have ended
        (hold_timeout_s), and a release then could take another request's
        entry of the prompt.  Every question of one forget carries the same
        ask id, so an "unseen" whose answer was lost is "unseen" again
        (legs.LegLedger.forget).  A refused connection is asked again too,
        never taken for "gone, release": docs/architecture.md, "The proxy"."""
        try:
            got = await self._forget_round(leg, dec_url, xid)
            if got != "retry":
                return
            pre_url = leg["mc_prefill"][0]
            if self.forget_retry_s <= 0:
                logger.info("decode %s did not answer a forget about leg %s: the prefill %s "
                            "holds the prompt until its hold_timeout_s (--forget-retry-s 0)",
                            dec_url, xid, pre_url)
                return
            until = leg["t"] + self.forget_retry_s
            logger.info("decode %s did not answer a forget about leg %s: asked again (%g s, "
                        "doubling) for %.0f s more; the prefill %s holds the prompt meanwhile",
                        dec_url, xid, FORGET_RETRY_FIRST_S, until - time.monotonic(), pre_url)
            gap, tries = FORGET_RETRY_FIRST_S, 0
            while got == "retry":
                if time.monotonic() + gap > until:
                    self.counts["decode_forgets_gave_up"] += 1
                    logger.info("decode %s did not answer %d forgets about leg %s: given up "
                                "(--forget-retry-s %g); the prefill %s holds the prompt until "
                                "its hold_timeout_s", dec_url, tries + 1, xid,
                                self.forget_retry_s, pre_url)
                    return
                await asyncio.sleep(gap)
                gap = min(2 * gap, FORGET_RETRY_MAX_GAP_S)
                tries += 1
                self.counts["decode_forgets_retried"] += 1
                got = await self._forget_round(leg, dec_url, xid)
            if got == "released":
                self.counts["decode_forgets_unseen_late"] += 1
                logger.info("decode %s answered the forget about leg %s after %d more tries: "
                            "'unseen'; the prefill %s releases the prompt now", dec_url, xid,
                            tries, pre_url)
            else:
                self.counts["decode_forgets_seen_late"] += 1
                logger.info("decode %s answered the forget about leg %s after %d more tries: "
                            "the prompt stays held at the prefill %s (its decode request pays "
                            "for it, or hold_timeout_s)", dec_url, xid, tries, pre_url)
        finally:
            self._forgets_out -= 1

    async def _forget_round(self, leg, dec_url, xid):
        """Asks the decode about the leg, engine by engine (X-data-parallel-
        rank, vLLM's DP rank; every server has rank 0).  A decode with vLLM
        data parallelism says so (mc_dp) and answers for the asked engine
        only, so every rank is asked, until one says "seen" (nothing to
        release) or the server refuses the rank (past its last engine); the
        prefill releases the prompt only when every engine said "unseen".
        The ranks are asked at once, in waves: rank 0 alone first (a server
        without data parallelism: one question), then twice as many each
        wave; a decode whose engines were counted before (_decode_engines)
        gets all of them and the first rank past them in one wave.
        "released", "kept" (seen, or no verdict: not asked again) or
        "retry" (an engine did not answer)."""
        known = self._decode_engines.get(dec_url, 1)
        lo, hi = 0, (known + 1 if known > 1 else 1)  # this wave's ranks: lo .. hi - 1
        while lo < MAX_DP_FORGET:
            answers = await self._ask_forgets(leg, dec_url, xid,
                                              range(lo, min(hi, MAX_DP_FORGET)))
            if answers is NO_ANSWER:
                return "retry"
            engines = None if answers is None else _forget_engines(answers, lo)
            if answers is None or engines is False:
                return "kept"  # seen, or not known: the prefill frees it at hold_timeout_s
            if engines is not None:
                self._decode_engines[dec_url] = engines
                break
            lo, hi = hi, hi + 2 * (hi - lo)
        else:
            logger.info("decode %s: a forget asked %d engines, all 'unseen', and found no "
                        "last one: the prefill frees the prompt at hold_timeout_s", dec_url,
                        MAX_DP_FORGET)
            return "kept"
        self.counts["decode_forgets_unseen"] += 1
        self._release_at_prefill(leg)
        return "released"

    async def _ask_forgets(self, leg, dec_url, xid, ranks):
        """_ask_forget's answers from `ranks`, asked at once, in rank order;
        None as soon as one says the prompt stays (_forget_keeps), NO_ANSWER
        as soon as one did not answer: the questions still out are
        cancelled."""
        tasks = [asyncio.ensure_future(self._ask_forget(leg, dec_url, xid, r))
                 for r in ranks]
        try:
            for done in asyncio.as_completed(tasks):
                got = await done
                if got is NO_ANSWER:
                    return NO_ANSWER
                if _forget_keeps(got):
                    return None
            return [t.result() for t in tasks]
        finally:
            for t in tasks:
                t.cancel()  # those done: no-op

    async def _ask_forget(self, leg, dec_url, xid, rank):
        """(verdict, the decode has data-parallel engines) from DP rank
        `rank`; PAST_LAST_ENGINE where vLLM has no engine of that rank;
        NO_ANSWER where the question got no answer (not connected, reset,
        timed out, a 5xx: asked again); None (an answer that is no verdict:
        not asked again)."""
        _pre_url, model, pre, _params, headers = leg["mc_prefill"]
        ids = _prompt_ids(pre)
        body = {"model": model, "prompt": [ids[0] if ids else 0], "max_tokens": 1,
                "kv_transfer_params": {"mc_forget": {"x_request_id": xid, "dp_rank": rank,
                                                     "ask": leg["ask"]}}}
        # A fresh id: one holding xid would be taken for a request of that leg.
        h = dict(headers, **{"X-Request-Id": f"mc-forget-{uuid.uuid4().hex}",
                             "X-data-parallel-rank": str(rank)})
        self.counts["decode_forgets_sent"] += 1
        try:
            async with self.session.post(dec_url + "/v1/completions", json=body, headers=h,
                                         timeout=aiohttp.ClientTimeout(
                                             total=self.forget_timeout_s)) as r:
                got = await _read_capped(r, CONTROL_ANSWER_MAX)
                if r.status == 400 and b"out of range" in got:
                    return PAST_LAST_ENGINE  # vLLM: "data_parallel_rank N is out of range"
                if r.status != 200 or len(got) > CONTROL_ANSWER_MAX:
                    logger.info("decode %s answered %d (%s bytes) to a forget", dec_url,
                                r.status, len(got) if len(got) <= CONTROL_ANSWER_MAX else
                                f"over {CONTROL_ANSWER_MAX}")
                    # A 5xx: overloaded, starting, a gateway without its
                    # upstream: no verdict yet
                    return NO_ANSWER if r.status >= 500 and len(got) <= CONTROL_ANSWER_MAX \
                        else None
            params = (json_in.loads(got) or {}).get("kv_transfer_params") or {}
            return params.get("mc_forget"), params.get("mc_dp") is True
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            logger.debug("decode %s: a forget got no answer (%r)", dec_url, e)
            return NO_ANSWER
        except (ValueError, AttributeError) as e:
            logger.info("decode %s: a forget's answer is no verdict (%r); the prefill frees "
                        "the prompt at hold_timeout_s", dec_url, e)
            return None

    async def _post_release(self, pre_url, body, headers):
        self.counts["prefill_releases_sent"] += 1
        try:
            async with self.session.post(pre_url + "/v1/completions", json=body,
                                         headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=30)) as r:
                await _read_capped(r, CONTROL_ANSWER_MAX)  # the rest is dropped with it
                if r.status != 200:
                    logger.info("prefill %s answered %d to a release", pre_url, r.status)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            logger.info("prefill %s: a release failed (%r); it frees the prompt at "
                        "hold_timeout_s", pre_url, e)

    async def _push(self, request, body, chat, headers, rid, idx, dec_url, t_in):
        """Flow push: the prefill leg runs beside the decode leg, whose answer
        is the client's.  A failed prefill leg only costs speed: the decode
        side is told (nokv) or its lease runs out, and it computes the prompt."""
        tid = f"push-{rid}-{uuid.uuid4().hex[:12]}"  # unique even if clients reuse ids
        pre_url = self.prefill[idx]
        pre_body = self._prefill_body(body, chat)
        pp = {"do_remote_decode": True, "do_remote_prefill": False, "push": True,
              "transfer_id": tid}
        if self.push_layerwise is not None:
            pp["push_layerwise"] = self.push_layerwise
        if self.push_layer_watch is not None:
            pp["push_layer_watch"] = self.push_layer_watch
        pre_body["kv_transfer_params"] = pp
        dp = {"do_remote_decode": False, "do_remote_prefill": True, "push": True,
              "transfer_id": tid}
        picked = self.prefill_dp.pick(idx, self.session) if self.prefill_dp else None
        if picked:
            dp["remote_engine_id"] = picked[1]
        elif self.prefill_engines:
            dp["remote_engine_id"] = self.prefill_engines[idx]
        if self.push_layer_load is not None:
            dp["push_layer_load"] = self.push_layer_load
        if self.push_layer_read is not None:
            dp["push_layer_read"] = self.push_layer_read
        dec_body = dict(body, kv_transfer_params=dp)
        marks = {"in": t_in}
        trace.event("proxy_dispatch", tid, rid=rid)
        # The decode leg names the prefill engine that runs the prefill leg:
        # vLLM's API server routes a request with X-data-parallel-rank to
        # that engine, not to the one its load balancer picks, whose push
        # job the decode's target would never reach (docs/connector.md).  A
        # data-parallel prefill's rank is picked from its engine table
        # (proxy_engines); else its first engine (the named one, or the
        # decode's prefill_url; rank 0 is valid on every server).
        pre_headers = dict(headers, **{"X-data-parallel-rank": picked[0] if picked else "0"})
        task = asyncio.ensure_future(self._push_prefill(request.path, pre_url, pre_body,
                                                        pre_headers, rid, marks))
        if picked:
            task.add_done_callback(lambda t: self.prefill_dp.done(idx, picked[0], _leg_ok(t)))
        # The prefill's forward is the request's critical path (the decode
        # waits for its layers; its target may reach the prefill during the
        # forward, which then sends the layers computed so far at once): let
        # the prefill leg's POST reach its socket before the decode leg's
        # (~1 ms earlier on the 2-vCPU VM, issue 31's TTFT timeline).
        await asyncio.sleep(0)
        try:
            return await self._relay(request, dec_url, dec_body, headers, rid, "decode",
                                     marks, retake=self._retake_body(body))
        finally:
            if not task.done():
                # The decode answer is complete (or the client left): the
                # prefill leg may finish on its own, unless the client left.
                if request.transport is None or request.transport.is_closing():
                    task.cancel()
                # Its id stays in use at the prefill server until it ends.
                request["mc_release_id_later"] = True
                task.add_done_callback(lambda _t: self._release_id(rid))

    def _bootstrap_hint(self, url, raw):
        """A push prefill's answer may name its bootstrap server's port
        (proxy_engines.PrefillEngines.hint), read while none is known."""
        dp = self.prefill_dp
        try:
            idx = self.prefill.index(url)
        except ValueError:
            return
        if dp is None or not dp.wants_hint(idx):
            return
        try:
            params = json_in.loads(raw).get("kv_transfer_params")
        except (ValueError, AttributeError):
            return
        dp.hint(idx, url, params)

    def _push_mark(self, marks, key):
        """Flow push's timings: key "prefill" (its answer read) or "first"
        (the decode's first chunk written), each noted once per request."""
        if marks is None or key in marks:
            return
        marks[key] = time.perf_counter()
        self.note_latency("push_to_prefill_answer_ms" if key == "prefill"
                          else "push_to_first_chunk_ms", marks[key] - marks["in"])
        if "prefill" in marks and "first" in marks:
            self.note_latency("push_first_chunk_after_prefill_answer_ms",
                              marks["first"] - marks["prefill"])

    async def _push_prefill(self, path, url, body, headers, rid, marks=None):
        """Flow push's prefill leg; False where it failed (a non-200 answer,
        unreachable)."""
        try:
            tid = (body.get("kv_transfer_params") or {}).get("transfer_id")
            trace.event("proxy_prefill_post", tid, rid=rid)
            async with self.session.post(url + path, json=body, headers=headers) as r:
                raw = await r.read()
                trace.event("proxy_prefill_answer", tid, rid=rid)
                if r.status == 200:
                    self._bootstrap_hint(url, raw)
                if r.status == 200:
                    self._push_mark(marks, "prefill")
                if r.status != 200:
                    self.counts["prefill_errors"] += 1
                    logger.warning("prefill %s answered %d for %s (push: the decode side "
                                   "computes the prompt)", url, r.status, rid)
                    return False
            self._down_until.pop(url, None)
            return True
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            if http_guard.out_of_fds(e):  # the proxy's own limit: the instance is not down
                self.no_fds(f"prefill instance {url}", e, rid)
                return None
            # Both legs are already sent (the decode side computes this
            # prompt), but the next requests pick the other instances first,
            # as in flows a and b: a prefill restarting for minutes would
            # otherwise cost every other push request its KV.
            self.counts["prefill_errors"] += 1
            self._down_until[url] = time.monotonic() + self.prefill_down_s
            logger.warning("prefill %s unreachable for %s (%r; push: the decode side computes "
                           "the prompt; tried after the others for %g s)", url, rid, e,
                           self.prefill_down_s)
            return False
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.counts["prefill_errors"] += 1
            logger.warning("prefill %s unreachable for %s (%r; push: the decode side computes "
                           "the prompt)", url, rid, e)
            return False

    async def _relay(self, request, url, body, headers, rid, role="upstream", marks=None,
                     retake=None):
        """Sends body to url and relays its answer (streamed through when
        the request streams); marks: flow push's timings (_push_mark);
        retake: the body sent once more when the decode fails the request
        before its first token (proxy_retake), None: never."""
        trace.event("proxy_post", rid, role=role)
        resp = None  # the client's stream, once started
        retaken = failed = False
        try:
            while True:
                r = await self.post_once_more(
                    url + request.path, rid, "decode_retries", json=body, headers=headers,
                    timeout=self.stream_timeout if body.get("stream") else self._timeout)
                if role == "decode":
                    request["mc_leg"] = "decode_answered"
                async with r:
                    if r.status != 200 or not body.get("stream"):
                        raw = await r.read()
                        if role == "decode" and r.status == 200:
                            request["mc_dec_data"] = True
                        if role == "decode" and proxy_retake.failed_answer(r.status, raw):
                            failed = True
                        if retake is not None and failed:
                            request["mc_dec_data"] = True  # its engine had it
                            body, retake = self._retake(url, rid, retake), None
                            retaken = True
                            continue
                        if r.status != 200:
                            self.counts["decode_errors"] += 1
                            logger.warning("%s %s answered %d for %s", role, url, r.status, rid)
                            err = _upstream_error(role, url, r.status, raw, r.content_type)
                            if resp is None:
                                return err
                            # A retaken stream (its status 200 is out):
                            # the error as an event.
                            await self._end_stream(resp, ft.error_event(
                                _error_message(err), r.status))
                            return resp
                        return web.Response(status=200, body=raw,
                                            content_type=r.content_type or "application/json",
                                            headers={"X-Request-Id": rid})
                    if resp is None:
                        resp = web.StreamResponse(status=200, headers={
                            "Content-Type": r.headers.get("Content-Type",
                                                          "text/event-stream"),
                            "Cache-Control": "no-cache", "X-Request-Id": rid})
                        try:
                            await resp.prepare(request)
                        except (ConnectionResetError, aiohttp.ClientConnectionError):
                            return resp  # the client left before its first byte
                    got = await self._pump(request, resp, r, url, rid, role, marks,
                                           role == "decode")
                if got != proxy_retake.FAILED:
                    return resp
                failed = True
                if retake is None:
                    # Not taken (again): the client's error, never an empty
                    # answer (vLLM 0.26's stream is [DONE] alone).
                    self.counts["decode_errors"] += 1
                    msg = proxy_retake.failure_message(f"{role} instance {url}", retaken)
                    logger.warning("%s (request %s)", msg, rid)
                    await self._end_stream(resp, ft.error_event(msg, 500))
                    return resp
                body, retake = self._retake(url, rid, retake), None
                retaken = True
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            if http_guard.out_of_fds(e):
                err = self.no_fds(f"{role} instance {url}", e, rid)
            else:
                self.counts["decode_errors"] += 1
                err = _error(502, self.upstream_failure(f"{role} instance {url}", e,
                                                        "unreachable"), "upstream_error")
            if resp is None:
                return err
            await self._end_stream(resp, ft.error_event(_error_message(err), err.status))
            return resp
        finally:
            if failed:
                self._release_after_failed_load(request)

    def _release_after_failed_load(self, request):
        """Flows a, b: the decode failed the leg before its first token (its
        KV load failed under kv_load_failure_policy 'fail'), so the pull the
        prefill holds the prompt for will not come; once that leg and any
        retake are over (a retake computes its prompt, but a decode that
        predates {"mc_retake": true} may find it at that prefill by its tokens
        and pull it), the prefill is told to release it (_release_at_prefill)
        instead of holding it to hold_timeout_s."""
        if self.flow in ("a", "b"):
            self._release_at_prefill(request)

    def _retake_body(self, body):
        """The decode leg taken again (proxy_retake): the client's request
        with kv_transfer_params {"mc_retake": true} in place of the leg's,
        or None with --decode-retake off.  The decode's connector computes a
        retake's prompt instead of loading it once more (a load that failed
        may fail again, a flow-a probe of a stalled prefill costs its
        timeout first); a decode that does not know the key takes it as a
        request without kv_transfer_params."""
        if not self.decode_retake:
            return None
        return dict({k: v for k, v in body.items() if k != "kv_transfer_params"},
                    kv_transfer_params={"mc_retake": True})

    def _retake(self, url, rid, retake):
        """A decode leg that failed before its first token (proxy_retake):
        counted, logged; returns the body to send once more."""
        self.counts["decode_retakes"] += 1
        logger.warning("decode %s failed request %s before its first token (under vLLM's "
                       "kv_load_failure_policy 'fail': its KV load failed): sent once more, "
                       "its prompt to be computed there, not loaded", url, rid)
        return retake

    async def _end_stream(self, resp, data):
        try:
            await resp.write(data)
            await resp.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionError):
            pass  # the client left

    async def _pump(self, request, resp, r, url, rid, role, marks, judge):
        """Relays upstream answer r's stream into resp.  judge: its first
        events are held until they show a token (proxy_retake.StreamHead);
        returns proxy_retake.FAILED, nothing written, where they show the
        decode failed the request before its first token, else None."""
        head = proxy_retake.StreamHead() if judge else None
        try:
            first = trace.ON
            async for chunk in r.content.iter_any():
                if role == "decode":
                    request["mc_dec_data"] = True  # its engine had it (legs.py)
                if first:
                    trace.event("proxy_chunk_in", rid, role=role)
                if head is not None:
                    verdict = head.feed(chunk)
                    if verdict is None:
                        continue
                    if verdict == proxy_retake.FAILED:
                        return verdict
                    chunk, head = head.held(), None
                await ft._write(resp, chunk)
                self._push_mark(marks, "first")
                if first:
                    first = False
                    trace.event("proxy_chunk_out", rid, role=role)
            if head is not None:
                if head.ended() == proxy_retake.FAILED:
                    return proxy_retake.FAILED  # ended before any token
                # its last event without the blank line after it, or no SSE
                await ft._write(resp, head.held())
                self._push_mark(marks, "first")
        except ft.ClientGone:
            return None  # the client left: not the decode instance's failure
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            # Status 200 is out: end the stream with an error event.
            self.counts["decode_errors"] += 1
            msg = self.upstream_failure(f"{role} instance {url}", e, "mid-stream")
            logger.warning("%s (request %s)", msg, rid)
            try:
                await resp.write(ft.error_event(msg))
            except (ConnectionResetError, aiohttp.ClientConnectionError):
                return None  # the client left too
        try:
            await resp.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionError):
            pass
        return None

    def _fds_message(self, where, exc):
        limit = f"open-file limit {self.nofile}" if self.nofile else "open-file limit"
        return (f"the proxy is out of file descriptors ({getattr(exc, 'strerror', None) or exc}; "
                f"its {limit}) and could not connect to {where}: retry later (the operator "
                "raises the hard open-file limit: ulimit -Hn, systemd LimitNOFILE=, docker "
                "--ulimit nofile=)")

    def no_fds(self, where, exc, rid):
        """A 503 for a request whose upstream connect failed with EMFILE /
        ENFILE (the proxy's limit, not the upstream's failure: it is not
        marked down), counted; logged at most once per 10 s."""
        self.counts["fd_limit_errors"] += 1
        msg = self._fds_message(where, exc)
        self._fd_warn.warn("request %s: %s", rid, msg)
        return _error(503, msg, "overloaded")

    def upstream_failure(self, where, exc, what):
        """The message for an upstream that failed: a stall names the idle
        timeout; running out of file descriptors says so."""
        if http_guard.out_of_fds(exc):
            return self._fds_message(where, exc)
        if isinstance(exc, _SOCK_READ_TIMEOUT) and self.idle_timeout:
            return (f"{where} sent nothing for {self.idle_timeout:g} s (the proxy's "
                    "--idle-timeout; raise it if requests queue that long)")
        if isinstance(exc, asyncio.TimeoutError) and \
                not isinstance(exc, aiohttp.ServerTimeoutError):
            # aiohttp's whole-request deadline (was told as the idle timeout,
            # or as "unreachable: TimeoutError()")
            return (f"{where} did not answer in full within {self._timeout.total:g} s (the "
                    "proxy's --timeout, per upstream request; raise it for longer requests)")
        return f"{where} {what}: {exc!r}"

    async def models(self, request):
        url = self.decode[0] + "/v1/models"
        try:
            async with self.session.get(url, headers=self._headers(request, "models")) as r:
                return web.Response(status=r.status, body=await r.read(),
                                    content_type=r.content_type or "application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return _error(502, f"decode instance {self.decode[0]} unreachable: {e!r}",
                          "upstream_error")

    #: GET /health: a probe of the upstreams answers the calls that come
    #: within this many seconds of its start (and those waiting for it), so
    #: a client calling /health in a loop, or many at once, costs the
    #: upstreams one probe a second; a change of state shows within it.
    HEALTH_CACHE_S = 1.0

    async def _probe_upstreams(self):
        async def probe(url):
            try:
                async with self.session.get(url + "/health",
                                            timeout=aiohttp.ClientTimeout(total=3)) as r:
                    return r.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return False
        urls = self.prefill + self.decode
        ok = await asyncio.gather(*(probe(u) for u in urls))
        return dict(zip(urls, ok))

    async def health(self, request):
        now = time.monotonic()
        if self._health is None or now - self._health[0] >= self.HEALTH_CACHE_S:
            self._health = (now, asyncio.ensure_future(self._probe_upstreams()))
        # shielded: a caller that leaves does not cancel the others' probe
        state = dict(await asyncio.shield(self._health[1]))
        healthy = (not self.prefill or any(state[u] for u in self.prefill)) and any(
            state[u] for u in self.decode)
        return web.json_response({"status": "ok" if healthy else "degraded",
                                  "instances": state, "counts": self.counts},
                                 status=200 if healthy else 503)

    def note_latency(self, key, seconds):
        self._lat[key].append(seconds * 1e3)
        self._lat_total[key] += 1

    def latency_summary(self, raw=False):
        """p50/p99 of each timing kept (the last 1000); raw: with the values
        in arrival order ("values") and how many were ever noted ("total"),
        for a caller that slices them per phase (serving_bench.py)."""
        out = {}
        for k, v in self._lat.items():
            xs = sorted(v)
            if xs:
                out[k] = {"n": len(xs), "p50": round(xs[len(xs) // 2], 3),
                          "p99": round(xs[min(len(xs) - 1, int(0.99 * len(xs)))], 3)}
                if raw:
                    out[k].update(values=[round(x, 3) for x in v], total=self._lat_total[k])
        return out

    async def stats(self, request):
        # request_ids_in_flight: client X-Request-Ids held now (a flow push
        # request's until its prefill leg ended, after the client's answer)
        # connections_open: client connections open now (None: not counted)
        # partial_settled_decodes: decode instances whose partial first tokens
        # are released before the decode's text (proxy_first_token)
        # decode_forgets_in_flight: forgets asked or waiting to be asked again
        return web.json_response(dict(self.counts, request_ids_in_flight=len(self._ids_in_flight),
                                      decode_forgets_in_flight=self._forgets_out,
                                      partial_settled_decodes=len(self.partial_settled),
                                      connections_open=self._open_conns and self._open_conns[0],
                                      body_bytes_in_flight=self._body_bytes,
                                      latency_ms=self.latency_summary(
                                          request.query.get("raw") == "1")))

    async def metrics(self, request):
        return web.Response(text=self.prom.render(self.counts),
                            content_type="text/plain", charset="utf-8",
                            headers={"X-Prometheus-Format": "0.0.4"})

    SERVED = ("POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, "
              "GET /stats, GET /metrics")

    @web.middleware
    async def _routes(self, request, handler):
        """aiohttp's plain-text 404 / 405 as JSON errors naming what is served."""
        try:
            return await handler(request)
        except web.HTTPNotFound:
            return _error(404, f"no such path {request.path[:200]!r}; this proxy serves "
                          f"{self.SERVED} (is the client's base URL http://host:port/v1?)",
                          "invalid_request_error")
        except web.HTTPMethodNotAllowed as e:
            allowed = ", ".join(sorted(e.allowed_methods - {"HEAD"}))
            resp = _error(405, f"{request.method} is not allowed on {request.path}; use "
                          f"{allowed}", "invalid_request_error")
            resp.headers["Allow"] = ", ".join(sorted(e.allowed_methods))
            return resp

    @web.middleware
    async def _observe(self, request, handler):
        """Counts every answer to a completion route by status (a streamed
        one once it has ended) and its duration."""
        if request.path not in ROUTES:
            return await handler(request)
        self.prom.in_flight += 1
        t0 = time.perf_counter()
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as e:
            status = e.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away (nginx's convention)
            raise
        finally:
            self.prom.in_flight -= 1
            self.prom.observe(request.path, status, time.perf_counter() - t0)

    def app(self):
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self._routes, self._observe])
        for route in ROUTES:
            app.router.add_post(route, self.handle, expect_handler=http_guard.expect_later)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/stats", self.stats)
        app.router.add_get("/metrics", self.metrics)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app


class PromCounters:
    """The proxy's /metrics in Prometheus text format (no client library)."""
    BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

    def __init__(self):
        self.answers = collections.Counter()    # (route, status) -> n
        self.hist = {}                          # route -> [bucket counts..., +Inf], sum
        self.in_flight = 0

    def observe(self, route, status, secs):
        self.answers[(route, int(status))] += 1
        counts, total = self.hist.get(route, ([0] * (len(self.BUCKETS) + 1), 0.0))
        for i, b in enumerate(self.BUCKETS):
            if secs <= b:
                counts[i] += 1
        counts[-1] += 1
        self.hist[route] = (counts, total + secs)

    def render(self, counts):
        out = []

        def metric(name, kind, doc, samples):
            out.append(f"# HELP {name} {doc}")
            out.append(f"# TYPE {name} {kind}")
            for labels, v in samples:
                lab = ",".join(f'{k}="{_esc(x)}"' for k, x in labels)
                out.append(f"{name}{{{lab}}} {v}" if lab else f"{name} {v}")

        metric("mooncake_proxy_requests_total", "counter", "Completion requests received",
               [((), counts["requests"])])
        metric("mooncake_proxy_responses_total", "counter",
               "Completion answers by route and HTTP status (499: the client left)",
               [((("route", r), ("status", str(st))), n)
                for (r, st), n in sorted(self.answers.items())])
        for key, doc in (("prefill_errors", "Prefill instances that failed or were unreachable"),
                         ("prefill_failovers", "Requests sent on to the next prefill instance "
                          "because one could not be connected to or reset the connection "
                          "twice"),
                         ("prefill_retries", "Prefill legs sent once more after the instance "
                          "dropped or reset the connection"),
                         ("decode_retries", "Decode legs sent once more after the instance "
                          "dropped or reset the connection before answering"),
                         ("bad_requests", "Requests refused as malformed (400)"),
                         ("slow_header_closes", "Connections closed because their request "
                          "header stalled"),
                         ("slow_body_closes", "Requests answered 408 and closed because their "
                          "body stalled or took longer than --body-timeout"),
                         ("body_budget_refusals", "Requests answered 503 because their body "
                          "would pass the proxy's budget for bodies in flight"),
                         ("fd_limit_refusals", "Client connections answered 503 and closed "
                          "because as many as the open-file limit leaves room for were open"),
                         ("fd_limit_errors", "Requests answered 503 because an upstream "
                          "connection found the proxy out of file descriptors"),
                         ("request_ids_replaced", "Requests whose X-Request-Id could not be "
                          "used (too long, a space, non-ASCII) and got a new id"),
                         ("request_ids_suffixed", "Requests whose X-Request-Id was in flight "
                          "already: the vLLM servers got it with a unique suffix"),
                         ("decode_errors", "Decode instances that failed or were unreachable"),
                         ("decode_retakes", "Decode legs that failed before their first token "
                          "(a failed KV load under load_failure_policy 'fail'), sent once more "
                          "without kv_transfer_params"),
                         ("stream_errors_after_first_token",
                          "Streams that failed after their first token"),
                         ("first_token_from_prefill", "Streams whose first token came from the "
                          "prefill instance"),
                         ("first_token_partial", "Of those, streams whose first token ends "
                          "inside a UTF-8 character (its text settled at the decode's first "
                          "text)"),
                         ("first_token_partial_unsettled", "Of those, streams ended with an "
                          "error because the decode's text did not match the first token's "
                          "(after the first chunk was sent)"),
                         ("finished_at_prefill", "Requests the prefill instance finished")):
            metric(f"mooncake_proxy_{key}_total", "counter", doc, [((), counts.get(key, 0))])
        metric("mooncake_proxy_first_token_fallbacks_total", "counter",
               "Streams whose first token came from decode, by reason",
               [((("reason", r),), n) for r, n in sorted(counts["first_token_fallbacks"].items())])
        metric("mooncake_proxy_requests_in_flight", "gauge", "Completion requests not answered "
               "yet", [((), self.in_flight)])
        out.append("# HELP mooncake_proxy_request_seconds Time from a request to the end of its "
                   "answer")
        out.append("# TYPE mooncake_proxy_request_seconds histogram")
        for r, (hc, total) in sorted(self.hist.items()):
            for b, n in zip((*map(str, self.BUCKETS), "+Inf"), hc):
                out.append(f'mooncake_proxy_request_seconds_bucket{{route="{r}",le="{b}"}} {n}')
            out.append(f'mooncake_proxy_request_seconds_sum{{route="{r}"}} {total}')
            out.append(f'mooncake_proxy_request_seconds_count{{route="{r}"}} {hc[-1]}')
        return "\n".join(out) + "\n"


def _esc(v):
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _bad_upstream(u):
    """Why the upstream URL u cannot be used (None if it can)."""
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in u):
        # "http://h:8100/ " (a stray space in a shell variable) was taken:
        # every request then went to "http://h:8100/%20/v1/completions" (a 404)
        return f"{u!r} has a space or control character; write http://host:port"
    if not u.startswith(("http://", "https://")):
        return f"{u!r} is not a URL; write http://host:port"
    scheme, _, rest = u.partition("://")
    authority = rest.partition("/")[0].rpartition("@")[2]
    if authority.count(":") > 1 and "[" not in authority:
        host, _, port = authority.rpartition(":")
        return f"{u!r}: an IPv6 address goes in brackets: {scheme}://[{host}]:{port}"
    if authority.startswith("[") and "%25" in authority.partition("]")[0]:
        # RFC 6874's form; the proxy's HTTP client looks the host up with
        # "%25" in it: every request failed, "Name or service not known"
        return (f"{u!r}: write the IPv6 zone after a bare %: "
                f"{u.replace(authority, authority.replace('%25', '%', 1), 1)}")
    try:
        parts = urllib.parse.urlsplit(u)
        port = parts.port
    except ValueError as e:
        return f"{u!r} is not a valid URL ({e}); write http://host:port"
    if not parts.hostname:
        return f"{u!r} names no host; write http://host:port"
    if parts.username is not None or parts.password is not None:
        return (f"{parts.scheme}://...@{parts.hostname}: the URL has credentials (user:password@); "
                "give http://host:port without them: the proxy passes the client's "
                "Authorization header (else $OPENAI_API_KEY) to the vLLM servers (--api-key)")
    if port == 0:
        return f"{u!r}: port 0 is not a server's port; write http://host:port with a port in " \
               "1..65535"
    if parts.path.rstrip("/").endswith("/v1"):
        return f"{u!r} ends with /v1; give the server's base URL without it (the proxy " \
               "adds /v1/completions, /v1/chat/completions, ...)"
    if parts.query or parts.fragment:
        return f"{u!r} has a query or fragment; give the server's base URL http://host:port"
    return None


def _norm(u):
    p = urllib.parse.urlsplit(u)
    return (p.scheme, (p.hostname or "").lower(), p.port or (443 if p.scheme == "https" else 80),
            p.path.rstrip("/"))


def _server(u):
    """u's scheme, host (loopback names as one), port and path."""
    s, h, p, path = _norm(u)
    return s, "loopback" if _local(h) else h, p, path


def _local(h):
    return h in ("localhost", "::1") or h.startswith("127.")


def _resolved(host, port):
    """getaddrinfo's socket addresses for host (TCP), [] if it does not
    resolve (then the proxy says so at the first request)."""
    try:
        return [ai[4] for ai in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                if ai[0] in (socket.AF_INET, socket.AF_INET6)]
    except (socket.gaierror, UnicodeError):
        return []


def _delivered_here(sa):
    """Whether a connection to the socket address sa reaches this host (its
    network namespace): a loopback or unspecified address, or one a socket
    can bind to (a UDP bind: nothing is sent).  With net.ipv4 / net.ipv6
    ip_nonlocal_bind on, any address binds: then only loopback counts."""
    ip = ipaddress.ip_address(sa[0].partition("%")[0])
    if ip.is_loopback or ip.is_unspecified:
        return True
    fam = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with open(f"/proc/sys/net/ipv{ip.version}/ip_nonlocal_bind") as f:
            if f.read().strip() != "0":
                return False
    except OSError:
        return False  # cannot tell whether the bind test means anything
    try:
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.bind((sa[0], 0, *sa[2:]))
        return True
    except OSError:  # EADDRNOTAVAIL: not an address of this host
        return False


def _is_self(u, host, port):
    """Why the upstream u is this proxy itself (None if it is not): its
    port, and its bound address or (bound to a wildcard or loopback
    address) a loopback name; or u's host resolves to an address the proxy
    listens on: bound to a wildcard (0.0.0.0: IPv4; "::": IPv6, both event
    loops set IPV6_V6ONLY; "": both), any address of this host; bound to a
    name or address, one of its addresses.  A host that does not resolve is
    not checked."""
    if port == 0:
        return None
    _, h, p, _ = _norm(u)
    host = host.lower()
    if p != port:
        return None
    if h == host or _local(h) and (host in ("0.0.0.0", "::", "") or _local(host)):
        return "the same host and port"
    wild = {"": (4, 6), "0.0.0.0": (4,), "::": (6,)}.get(host)
    mine = set() if wild else {sa[0] for sa in _resolved(host, port)}
    for sa in _resolved(h, p):
        ip = ipaddress.ip_address(sa[0].partition("%")[0])
        name = f"{h} is" if h == sa[0] else f"{h} resolves to {sa[0]},"
        if wild and ip.version in wild and _delivered_here(sa):
            return f"{name} an address of this host"
        if not wild and sa[0] in mine:
            return f"{name} where the proxy listens"
    return None


def _event_loop(kind):
    """(runner for asyncio.run-like use, name): uvloop when importable
    (--loop auto) or asked for, else asyncio's own loop."""
    if kind in ("auto", "uvloop"):
        try:
            import uvloop
            return uvloop.run, "uvloop"
        except ImportError:
            if kind == "uvloop":
                raise SystemExit("--loop uvloop: uvloop is not installed (pip install uvloop)")
    return asyncio.run, "asyncio"


# Flow push's per-request switches, each given as --push-... server|on|off:
# "server" sends no field (the instance's own setting), on/off send True/False.
_PUSH_SWITCHES = ("push_layerwise", "push_layer_load", "push_layer_read", "push_layer_watch")
_SWITCH = {"server": None, "on": True, "off": False}


def _parser():
    """The proxy's command line."""
    ap = argparse.ArgumentParser(prog="python -m mooncake_connector.proxy",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", nargs="+", default=[], metavar="URL")
    ap.add_argument("--decode", nargs="+", default=[], metavar="URL")
    ap.add_argument("--passthrough", nargs="+", default=[], metavar="URL",
                    help="no prefill step: relay every request to one of these (a colocated "
                         "server behind the same proxy code; a benchmark reference)")
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--flow", choices=["a", "b", "push"], default="a",
                    help="a: max_tokens=1 prefill then decode (the seed's); "
                         "b: kv_transfer_params relayed from prefill to decode; "
                         "push: both at once, the prefill writes the KV into the decode's "
                         "blocks (first token from decode)")
    ap.add_argument("--prefill-bootstrap", nargs="+", default=[], metavar="URL",
                    help="flow push: each --prefill instance's bootstrap server "
                         "(http://HOST:PORT, its VLLM_MOONCAKE_BOOTSTRAP_PORT or "
                         "bootstrap_port), same order: push prefills are spread over a "
                         "data-parallel prefill's engines (default: found from each "
                         "prefill's push answers, which name its engine and bootstrap port; "
                         "a table not naming the answering engine is not taken)")
    ap.add_argument("--prefill-engine", nargs="+", default=[], metavar="HOST:PORT",
                    help="flow push: the transfer-engine name (prefill_url / local_hostname) "
                         "of each --prefill instance, same order (default: the decode's "
                         "configured prefill_url)")

    def switch(flag, help):  # one of _PUSH_SWITCHES: "server" sends no field
        ap.add_argument(flag, choices=list(_SWITCH), default="server", help=help)

    switch("--push-layerwise",
           "flow push: write the KV layer by layer as the prefill computes it "
           "(on), after the forward (off), or the prefill server's "
           "push_layerwise setting (server)")
    switch("--push-layer-load",
           "flow push: the decode schedules the request at once and each "
           "attention layer waits for that layer's pushed KV (on; every other "
           "request of the decode's step waits with it), waits for the whole "
           "prompt before scheduling it (off), or the decode server's "
           "push_layer_load setting (server); docs/connector.md, Layer load")
    switch("--push-layer-read",
           "flow push with layer load: the decode reads each layer from the "
           "prefill's blocks itself once told it is computed (on; a silent "
           "prefill is given up after the decode's push_layer_read_stall_s), "
           "the prefill writes it (off), or the decode server's "
           "push_layer_read setting (server); docs/connector.md, Layer read")
    switch("--push-layer-watch",
           "flow push with layer load: the prefill tells the decode each layer "
           "as its writes land, from a thread (on), or from vLLM's forward "
           "thread only, the last layer after the rest of the forward (off), "
           "or the prefill server's push_layer_watch setting (server)")
    ap.add_argument("--decode-retake", choices=["on", "off"], default="on",
                    help="a decode leg that fails before its first token (a decode server "
                         "with load_failure_policy 'fail' whose KV load failed) is sent once "
                         "more without kv_transfer_params, counted decode_retakes (on), or "
                         "its error is the client's answer (off)")
    ap.add_argument("--first-token", choices=["prefill", "decode"], default="prefill",
                    help="streamed requests: prefill (default) streams the prefill's token at "
                         "once and decode continues from it; decode waits for the decode "
                         "instance's stream (the seed's way)")
    ap.add_argument("--loop", choices=["auto", "uvloop", "asyncio"], default="auto",
                    help="event loop (auto: uvloop when importable)")
    ap.add_argument("--timeout", type=float, default=6 * 3600, help="per upstream request, s")
    ap.add_argument("--idle-timeout", type=float, default=300.0,
                    help="end a streamed request whose upstream sends nothing for this long, s "
                         "(a stalled stream ends with an error event; 0 = never)")
    ap.add_argument("--prefill-down-s", type=float, default=5.0,
                    help="a prefill instance that could not be connected to is tried after "
                         "the others for this long, s (each request still tries every one)")
    ap.add_argument("--header-timeout", type=float, default=http_guard.HEADER_TIMEOUT_S,
                    help="close a client connection that has sent part of a request but no "
                         "complete header for this long, s, or no byte of its body for this "
                         "long (answered 408) (slow or stalled clients)")
    ap.add_argument("--body-timeout", type=float, default=http_guard.BODY_TIMEOUT_S,
                    help="answer 408 and close a request whose whole body has not arrived this "
                         "long after its header, s (a client sending it a few bytes at a time)")
    ap.add_argument("--forget-retry-s", type=float, default=FORGET_RETRY_S,
                    help="flows a, b: a decode that does not answer the proxy's question about "
                         "a leg it may not have seen (stopped, overloaded, restarting, gone) "
                         "is asked again (0.5 s, doubling to 8 s) until this long after the "
                         "prefill's answer, s; keep it below the prefill's hold_timeout_s "
                         "(default 120) by more than a release takes to reach the prefill; 0: "
                         "never asked again (the prefill frees such a prompt at its "
                         "hold_timeout_s)")
    ap.add_argument("--forget-timeout-s", type=float, default=FORGET_TIMEOUT_S,
                    help="flows a, b: how long one such question waits for the decode's "
                         "answer, s (then it is asked again)")
    ap.add_argument("--forget-max", type=int, default=FORGET_MAX,
                    help="flows a, b: such questions in flight at once (asked, or waiting to "
                         "be asked again); one past it is not sent (counted "
                         "decode_forgets_dropped: the prefill frees its prompt at its "
                         "hold_timeout_s)")
    ap.add_argument("--body-budget-mb", type=float, default=BODY_BUDGET >> 20,
                    help="request bodies held at once by requests in flight, MiB; a request "
                         "whose body would pass it is answered 503 (a parsed request takes "
                         "several times its body's bytes)")
    return ap


def _check_bootstraps(ap, args):
    """--prefill-bootstrap: flow push only, one well-formed URL per --prefill."""
    if not args.prefill_bootstrap:
        return
    if args.flow != "push":
        ap.error("--prefill-bootstrap is for --flow push (flows a and b leave the prefill "
                 "leg to vLLM's own data-parallel balancing)")
    if len(args.prefill_bootstrap) != len(args.prefill):
        ap.error(f"--prefill-bootstrap names {len(args.prefill_bootstrap)} servers for "
                 f"{len(args.prefill)} --prefill URLs: give one per URL, in the same order")
    for u in args.prefill_bootstrap:
        why = _bad_upstream(u)
        if why:
            ap.error(f"--prefill-bootstrap: {why}")


def _check_upstreams(ap, args):
    """The --prefill/--decode/--passthrough set, their push options, --port and
    each upstream URL (well formed, no instance in both roles, not this proxy
    itself): ap.error on the first that does not hold."""
    if args.passthrough and (args.prefill or args.decode):
        ap.error("--passthrough relays to one upstream; it takes no --prefill/--decode")
    pushed = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in _PUSH_SWITCHES
              if getattr(args, k) != "server"]
    if args.passthrough:
        given = [f"--{k.replace('_', '-')} {v}" for k, v, d in (
            ("flow", args.flow, "a"), ("first_token", args.first_token, "prefill"))
            if v != d] + pushed
        if given:
            ap.error(f"{', '.join(given)}: --passthrough has no prefill step, so these "
                     "prefill/decode options would do nothing; drop them (or use --prefill "
                     "and --decode instead of --passthrough)")
    if not args.passthrough and not (args.prefill and args.decode):
        ap.error("give --prefill URL... and --decode URL... (or --passthrough URL...)")
    if args.prefill_engine and len(args.prefill_engine) != len(args.prefill):
        ap.error(f"--prefill-engine names {len(args.prefill_engine)} engines for "
                 f"{len(args.prefill)} --prefill URLs: give one per URL, in the same order")
    for e in args.prefill_engine:
        host, sep, port = e.rpartition(":")
        if not sep or not host or not (port.isascii() and port.isdigit()) or "/" in e or \
                not 0 < int(port) < 65536:
            ap.error(f"--prefill-engine {e!r} is not host:port with a port in 1..65535 (the "
                     "prefill's transfer-engine name: its mooncake.json prefill_url)")
        if ":" in host and not (host.startswith("[") and host.endswith("]")):
            ap.error(f"--prefill-engine {e!r}: an IPv6 address goes in brackets, as the "
                     f"prefill's engine is named: --prefill-engine [{host}]:{port}")
    if args.prefill_engine and args.flow != "push":
        ap.error("--prefill-engine is for --flow push")
    _check_bootstraps(ap, args)
    if pushed and args.flow != "push" and not args.passthrough:
        ap.error(f"{', '.join(pushed)}: for --flow push only (flow {args.flow} sends no push "
                 "legs); add --flow push or drop them")
    if args.push_layer_load == "off":
        # per request push_layer_load false wins at the decode: no layer
        # load, so reading (or watching) its layers would never happen
        moot = [f"--push-layer-{k} on" for k in ("read", "watch")
                if getattr(args, f"push_layer_{k}") == "on"]
        if moot:
            ap.error(f"{' and '.join(moot)} with --push-layer-load off: reading or watching "
                     "a request's layers is part of a layer load, which --push-layer-load off "
                     f"turns off for every request; drop {' and '.join(moot)}, or give "
                     "--push-layer-load on (or server)")
    if args.host.startswith("[") and args.host.endswith("]"):
        args.host = args.host[1:-1]  # "[::1]", as in a URL: the address is ::1
    if not args.host.strip():  # the event loop takes "" as every address
        ap.error(f"--host {args.host!r} is empty, which would listen on every address of this "
                 "host; give one: 0.0.0.0 (every IPv4 address, said as such) or 127.0.0.1 "
                 "(this host only)")
    if not 0 <= args.port <= 65535:
        ap.error(f"--port {args.port} is out of range 0..65535 (0: any free port)")
    for u in args.prefill + args.decode + args.passthrough:
        why = _bad_upstream(u)
        if why:
            ap.error(why)
    same = [u for u in dict.fromkeys(args.prefill)
            if _server(u) in set(map(_server, args.decode))]
    if same:
        ap.error(f"{same[0]!r} is given as both --prefill and --decode: a prefill and a decode "
                 "instance are two vLLM servers (kv_producer and kv_consumer) on two ports")
    for u in args.prefill + args.decode + args.passthrough:
        why = _is_self(u, args.host, args.port)
        if why:
            ap.error(f"{u!r} is this proxy's own address (--host {args.host} --port "
                     f"{args.port}; {why}): it would send requests to itself; give the vLLM "
                     "server's URL, or another --port for the proxy")


def _check_times(ap, args):
    """The timeouts (finite where they must be, none negative) and
    $OPENAI_API_KEY (no control character): ap.error on the first that does not
    hold.  Returns the key (None: not set)."""
    if not 1 <= args.body_budget_mb < float("inf"):
        ap.error(f"--body-budget-mb must be a number of MiB >= 1, not {args.body_budget_mb}")
    if not 0 < args.header_timeout < float("inf"):
        ap.error(f"--header-timeout must be a number of seconds > 0, not {args.header_timeout}")
    if not 0 < args.body_timeout < float("inf"):
        ap.error(f"--body-timeout must be a number of seconds > 0, not {args.body_timeout}")
    if not 0 <= args.forget_retry_s < float("inf"):
        ap.error(f"--forget-retry-s must be a number of seconds >= 0 (0: never ask a decode "
                 f"again), not {args.forget_retry_s}")
    if not 0 < args.forget_timeout_s < float("inf"):
        ap.error(f"--forget-timeout-s must be a number of seconds > 0, not "
                 f"{args.forget_timeout_s}")
    if args.forget_max < 1:
        ap.error(f"--forget-max must be an integer >= 1 (forgets in flight), not "
                 f"{args.forget_max}")
    for name in ("timeout", "idle_timeout", "prefill_down_s"):
        if math.isnan(getattr(args, name)):
            ap.error(f"--{name.replace('_', '-')} nan is not a number of seconds")
    if math.isinf(args.timeout):
        ap.error("--timeout inf is not a number of seconds aiohttp can wait; give a finite "
                 f"one (default {6 * 3600})")
    if args.idle_timeout < 0 or args.timeout <= 0 or args.prefill_down_s < 0:
        ap.error("--timeout must be > 0, --idle-timeout and --prefill-down-s >= 0 (seconds)")
    api_key = os.environ.get("OPENAI_API_KEY")
    bad = next((i for i, ch in enumerate(api_key or "") if ord(ch) < 32 or ord(ch) == 127), None)
    if bad is not None:
        ap.error(f"$OPENAI_API_KEY has a control character ({ascii(api_key[bad])} at position "
                 f"{bad} of {len(api_key)}); no HTTP header can carry it: strip it (a key file "
                 "with Windows line ends?)")
    return api_key


async def _serve(proxy, args, prog, loop_name):
    """Listens on --host:--port (SystemExit naming the address when it cannot)
    and serves until SIGINT or SIGTERM."""
    # handler_cancellation: a client that disconnects before its answer
    # cancels its handler, which closes the upstream requests it started
    # (vLLM aborts a request whose connection closes); else the proxy
    # waited for whole answers nobody would read.
    # The shell's soft open-file limit (often 1024) ran out under many
    # clients: accept() and upstream connects failed with EMFILE.  Raised
    # to the hard limit; client connections are kept to half of it (those
    # past it answered 503), upstream connections in use to the other half
    # less 64 for the process's own files and idle kept-alive connections
    # (more requests wait for one).
    before, limit = http_guard.raise_nofile_limit()
    proxy.nofile = limit
    max_conns = max(16, limit // 2) if limit else None
    proxy.upstream_limit = max(8, limit // 2 - 64) if limit else 0
    if limit:
        logger.info("open-file limit %s%d (the hard limit): up to %d client connections and %d "
                    "upstream connections in use at once",
                    f"raised from {before} to " if before != limit else "", limit, max_conns,
                    proxy.upstream_limit)
    if proxy.upstream_limit and proxy.forget_max > proxy.upstream_limit // 4:
        # Each forget in flight may hold an upstream connection (to a
        # stopped decode: up to --forget-timeout-s): forgets never take
        # more than a quarter of them from the requests.
        proxy.forget_max = max(1, proxy.upstream_limit // 4)
        logger.info("--forget-max %d: a quarter of the upstream connections (%d)",
                    proxy.forget_max, proxy.upstream_limit)
    runner = web.AppRunner(proxy.app(), handler_cancellation=True)
    await runner.setup()
    loop = asyncio.get_running_loop()
    http_guard.quiet_fd_errors(loop, "the proxy")
    factory = http_guard.guarded(runner.server, loop, args.header_timeout, proxy.counts,
                                 max_conns, f"half its open-file limit {limit}")
    proxy._open_conns = factory.open_conns
    try:
        server = await loop.create_server(factory, args.host, args.port, reuse_address=True)
    except OSError as e:  # gaierror included: a --host that does not resolve
        await runner.cleanup()
        raise SystemExit(f"{prog}: cannot listen on {join_hostport(args.host, args.port)}: "
                         f"{e.strerror or e}; pick another --port (or --host)") from None
    port = server.sockets[0].getsockname()[1]
    if proxy.passthrough:
        what = f"pass-through to {' '.join(proxy.passthrough)}"
    else:
        what = (f"flow {args.flow}; first token from {args.first_token}; prefill "
                f"{' '.join(proxy.prefill)}; decode {' '.join(proxy.decode)}")
    print(f"proxy listening on http://{join_hostport(args.host, port)} ({what}; {loop_name})",
          flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()
    if proxy.stop_reading():
        logger.info("stopping: closed the connections of requests whose body had not come "
                    "in full")
    await runner.cleanup()


def main(argv=None):
    ap = _parser()
    args = ap.parse_args(argv)
    _check_upstreams(ap, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    api_key = _check_times(ap, args)
    proxy = Proxy(args.prefill, args.decode, args.flow, args.timeout,
                  api_key, args.first_token, args.passthrough,
                  args.idle_timeout, args.prefill_down_s, args.prefill_engine,
                  header_timeout=args.header_timeout,
                  body_budget=int(args.body_budget_mb * (1 << 20)),
                  body_timeout=args.body_timeout, prefill_bootstraps=args.prefill_bootstrap,
                  forget_retry_s=args.forget_retry_s, forget_timeout_s=args.forget_timeout_s,
                  forget_max=args.forget_max, decode_retake=args.decode_retake == "on",
                  **{k: _SWITCH[getattr(args, k)] for k in _PUSH_SWITCHES})
    run_loop, loop_name = _event_loop(args.loop)
    run_loop(_serve(proxy, args, ap.prog, loop_name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
