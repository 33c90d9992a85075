"""The proxy's push flow (--flow push) against fake upstreams: both legs at
once, joined by one transfer_id; the decode answer is the client's."""
import asyncio
import json
import subprocess
import sys
import time

from aiohttp import web

from app_thread import AppThread
from conftest import wait_until
from test_proxy import get_stats, post, proxy, upstreams  # noqa: F401

from mooncake_connector.serving import free_port


class SlowPrefill(AppThread):
    """Answers after `delay` seconds (a long prefill)."""

    def __init__(self, delay, status=200):
        self.seen = []

        async def complete(request):
            self.seen.append((time.monotonic(), await request.json()))
            await asyncio.sleep(delay)
            if status != 200:
                return web.json_response({"error": {"message": "prefill says no"}},
                                         status=status)
            return web.json_response({"choices": [{"text": "x"}]})

        async def health(request):
            return web.Response(text="ok")

        super().__init__([("POST", "/v1/completions", complete),
                          ("POST", "/v1/chat/completions", complete),
                          ("GET", "/health", health)])


def test_push_sends_both_legs_at_once(upstreams, proxy):  # noqa: F811
    p, d = SlowPrefill(1.5), upstreams("decode")
    try:
        url = proxy([p.url], [d.url], flow="push",
                    extra=("--prefill-engine", "127.0.0.1:17001"))
        body = {"model": "m", "prompt": "San Francisco is a", "max_tokens": 50}
        t0 = time.monotonic()
        status, out = post(url + "/v1/completions", body, {"X-Request-Id": "r-1"})
        took = time.monotonic() - t0
        assert status == 200 and out["by"] == "decode"
        # The decode answer did not wait for the 1.5 s prefill.
        assert took < 1.2, took
        for _ in range(100):  # the prefill leg is its own task: on a loaded
            if p.seen:        # host it may reach the prefill after the answer
                break
            time.sleep(0.02)
        pre = p.seen[0][1]
        dec = d.seen[0]["body"]
        assert pre["max_tokens"] == 1 and pre["stream"] is False
        tid = pre["kv_transfer_params"]["transfer_id"]
        assert tid.startswith("push-r-1-")
        assert pre["kv_transfer_params"] == {"do_remote_decode": True,
                                             "do_remote_prefill": False, "push": True,
                                             "transfer_id": tid}
        assert dec["kv_transfer_params"] == {"do_remote_decode": False,
                                             "do_remote_prefill": True, "push": True,
                                             "transfer_id": tid,
                                             "remote_engine_id": "127.0.0.1:17001"}
        assert {k: v for k, v in dec.items() if k != "kv_transfer_params"} == body
    finally:
        p.close()


def test_push_failed_prefill_leg_is_counted_not_fatal(upstreams, proxy):  # noqa: F811
    p, d = SlowPrefill(0.0, status=500), upstreams("decode")
    try:
        url = proxy([p.url], [d.url], flow="push", extra=("--push-layerwise", "on",
                                                             "--push-layer-load", "on",
                                                             "--push-layer-watch", "off",
                                                             "--push-layer-read", "on"))
        status, out = post(url + "/v1/completions", {"model": "m", "prompt": "hi",
                                                     "max_tokens": 4})
        assert status == 200 and out["by"] == "decode"
        assert "remote_engine_id" not in d.seen[0]["body"]["kv_transfer_params"]
        assert d.seen[0]["body"]["kv_transfer_params"]["push_layer_load"] is True
        assert d.seen[0]["body"]["kv_transfer_params"]["push_layer_read"] is True  # decode's
        for _ in range(50):
            import urllib.request
            stats = json.loads(urllib.request.urlopen(url + "/stats", timeout=5).read())
            if stats["prefill_errors"]:
                break
            time.sleep(0.05)
        assert stats["prefill_errors"] == 1
        # The prefill leg runs beside the decode's: it may reach the prefill
        # after the decode answered (a loaded host), so it is looked at now.
        assert p.seen[0][1]["kv_transfer_params"]["push_layerwise"] is True
        assert "push_layer_load" not in p.seen[0][1]["kv_transfer_params"]
        assert "push_layer_read" not in p.seen[0][1]["kv_transfer_params"]
        assert p.seen[0][1]["kv_transfer_params"]["push_layer_watch"] is False  # prefill's
        assert "push_layer_watch" not in d.seen[0]["body"]["kv_transfer_params"]
    finally:
        p.close()


def test_push_engine_names_are_checked():
    base = [sys.executable, "-m", "mooncake_connector.proxy", "--prefill", "http://p:1",
            "--decode", "http://d:2"]
    r = subprocess.run(base + ["--flow", "push", "--prefill-engine", "a:1", "b:2"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "one per URL" in r.stderr
    r = subprocess.run(base + ["--flow", "push", "--prefill-engine", "nohostport"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "is not host:port" in r.stderr
    r = subprocess.run(base + ["--flow", "b", "--prefill-engine", "a:1"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "for --flow push" in r.stderr


def test_push_timings_per_request(upstreams, proxy):  # noqa: F811
    """/stats?raw=1 keeps flow push's own timings per request: the prefill
    leg's answer, the decode's first chunk, and their difference (here the
    decode streams at once while the prefill leg takes 0.4 s)."""
    import urllib.request
    p, d = SlowPrefill(0.4), upstreams("decode")
    try:
        url = proxy([p.url], [d.url], flow="push")
        status, _ = post(url + "/v1/completions", {"model": "m", "prompt": "hi",
                                                   "max_tokens": 4, "stream": True}, raw=True)
        assert status == 200
        for _ in range(50):  # the prefill leg ends after the decode's answer
            lat = json.loads(urllib.request.urlopen(url + "/stats?raw=1", timeout=5)
                             .read())["latency_ms"]
            if "push_first_chunk_after_prefill_answer_ms" in lat:
                break
            time.sleep(0.05)
        pre, first = lat["push_to_prefill_answer_ms"], lat["push_to_first_chunk_ms"]
        diff = lat["push_first_chunk_after_prefill_answer_ms"]
        assert pre["total"] == first["total"] == diff["total"] == 1
        assert pre["values"][0] >= 400 and first["values"][0] < 300
        assert abs(diff["values"][0] - (first["values"][0] - pre["values"][0])) < 0.01
        plain = json.loads(urllib.request.urlopen(url + "/stats", timeout=5).read())
        assert "values" not in plain["latency_ms"]["push_to_first_chunk_ms"]
    finally:
        p.close()


def test_push_dead_prefill_is_tried_after_the_others(upstreams, proxy):  # noqa: F811
    """Flow push: a prefill leg that cannot connect marks that instance down
    (as flows a and b do), so the next requests' both legs go to a live
    prefill: its engine named to the decode, its prefill leg run there."""
    import urllib.request
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    live, d = upstreams("p-live"), upstreams("decode")
    url = proxy([dead, live.url], [d.url], flow="push",
                extra=("--prefill-engine", "127.0.0.1:17001", "127.0.0.1:17002",
                       "--prefill-down-s", "30"))
    for i in range(4):
        status, out = post(url + "/v1/completions", {"model": "m", "prompt": "hi",
                                                     "max_tokens": 4})
        assert status == 200 and out["by"] == "decode"
        for _ in range(100):  # the prefill leg runs beside the answer
            stats = json.loads(urllib.request.urlopen(url + "/stats", timeout=5).read())
            if len(live.seen) + stats["prefill_errors"] == i + 1:
                break
            time.sleep(0.05)
    engines = [x["body"]["kv_transfer_params"]["remote_engine_id"] for x in d.seen]
    # Only the first request went to the dead one; the round robin's next
    # turn at it (the third request) went to the live one.
    assert engines == ["127.0.0.1:17001"] + ["127.0.0.1:17002"] * 3, engines
    assert len(live.seen) == 3 and stats["prefill_errors"] == 1, stats


def test_push_prefill_leg_is_sent_before_the_decode_leg(upstreams, proxy, tmp_path):  # noqa: F811
    """The prefill's forward is the critical path of a push request (the
    decode's attention waits for its layers): the proxy starts the prefill
    leg's POST before the decode leg's (the decode's target may reach the
    prefill during its forward).  Checked in the proxy's own trace (one
    event loop: the file's line order is the order the legs were started),
    not by arrival times at two servers, which the OS schedules.  Before:
    the decode leg was started first, every time."""
    import os

    class Rec(AppThread):
        def __init__(self, role):
            async def complete(request):
                await request.json()
                if role == "prefill":
                    return web.json_response({"choices": [{"text": "x"}]})
                return web.json_response({"by": "decode", "choices": [{"text": "y"}]})

            async def health(request):
                return web.Response(text="ok")

            async def models(request):
                return web.json_response({"data": [role]})

            super().__init__([("POST", "/v1/completions", complete),
                              ("GET", "/health", health), ("GET", "/v1/models", models)])

    p, d = Rec("prefill"), Rec("decode")
    path = tmp_path / "proxy-trace.jsonl"
    try:
        url = proxy([p.url], [d.url], flow="push", env={**os.environ, "MC_TRACE": str(path)})
        n = 12
        for i in range(n):
            status, _ = post(url + "/v1/completions", {"model": "m", "prompt": f"hi {i}",
                                                       "max_tokens": 2})
            assert status == 200
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        pre = {e["rid"]: i for i, e in enumerate(lines) if e["ev"] == "proxy_prefill_post"}
        dec = {e["k"]: i for i, e in enumerate(lines)
               if e["ev"] == "proxy_post" and e.get("role") == "decode"}
        assert len(pre) == n and set(pre) == set(dec), (pre, dec)
        late = [rid for rid in pre if pre[rid] > dec[rid]]
        assert not late, f"decode leg started first for {len(late)} of {n}: {late}"
    finally:
        p.close()
        d.close()


class DPPrefill(AppThread):
    """A prefill server with `engines` vLLM data-parallel engines: records
    each leg's X-data-parallel-rank and refuses a rank past the last, as
    vLLM's API server does."""

    def __init__(self, engines):
        self.engines, self.ranks = engines, []

        async def complete(request):
            body = await request.json()
            r = int(request.headers.get("X-data-parallel-rank") or 0)
            self.ranks.append((r, body["kv_transfer_params"]["transfer_id"]))
            if r >= self.engines:
                return web.json_response({"error": {"message": f"data_parallel_rank {r} is "
                                                    "out of range"}}, status=400)
            return web.json_response(self._answer(r, body))

        super().__init__([("POST", "/v1/completions", complete)])

    def _answer(self, rank, body):
        return {"choices": [{"text": "x"}]}


def _bootstrap(engines):
    """The real bootstrap server of a producer with `engines` DP engines
    (TP 1, PP 1) at 127.0.0.1:13003..., counting its /query answers."""
    from mooncake_connector.connector import bootstrap
    from mooncake_connector.connector.settings import shift_port
    table = bootstrap.query_table("127.0.0.1:13003", 0, 1, 1,
                                  lambda t, p: shift_port("127.0.0.1:13003", t), engines)
    srv = bootstrap.BootstrapServer("127.0.0.1", 0, table)
    srv.queries = 0
    body = srv.body

    def counted():
        srv.queries += 1
        return body()
    srv.body = counted
    return srv


def _push_legs(url, p, d, n):
    """n push requests, one after another, each prefill leg waited for:
    [(the prefill leg's rank, the decode leg's remote_engine_id)]."""
    out, first = [], len(p.ranks)
    for i in range(first, first + n):
        status, _ = post(url + "/v1/completions", {"model": "m", "prompt": "hi",
                                                   "max_tokens": 4})
        assert status == 200
        for _ in range(200):
            if len(p.ranks) > i:
                break
            time.sleep(0.02)
        rank, tid = p.ranks[i]
        dec = next(x["body"]["kv_transfer_params"] for x in d.seen
                   if x["body"]["kv_transfer_params"]["transfer_id"] == tid)
        out.append((rank, dec.get("remote_engine_id")))
    return out


def test_push_prefills_are_spread_over_a_data_parallel_prefills_engines(upstreams,  # noqa: F811
                                                                         proxy):
    """With --prefill-bootstrap the proxy learns a data-parallel prefill's
    engines from its bootstrap server (/query, in the background: the first
    request goes to rank 0 as before) and spreads push prefills over them:
    each prefill leg pinned to a rank (X-data-parallel-rank), its decode leg
    naming that rank's engine.  The table is cached, not asked per request."""
    p, d, boot = DPPrefill(2), upstreams("decode"), _bootstrap(2)
    try:
        url = proxy([p.url], [d.url], flow="push",
                    extra=("--prefill-bootstrap", boot.url))
        assert _push_legs(url, p, d, 1) == [(0, None)]  # the table is not known yet
        assert wait_until(lambda: get_stats(url)["prefill_table_lookups"] == 1)
        legs = _push_legs(url, p, d, 6)
        names = {0: "127.0.0.1:13003", 1: "127.0.0.1:13004"}
        assert all(e == names[r] for r, e in legs), legs
        assert sorted(r for r, _ in legs) == [0, 0, 0, 1, 1, 1], legs  # taking turns
        assert boot.queries == 1
    finally:
        p.close()
        boot.close()


def test_push_over_a_prefill_with_one_engine_is_as_before(upstreams, proxy):  # noqa: F811
    """A prefill without data parallelism (one engine in its table): every
    push prefill to rank 0, the decode leg naming no engine (the decode's
    prefill_url), one table lookup for all requests."""
    p, d, boot = DPPrefill(1), upstreams("decode"), _bootstrap(1)
    try:
        url = proxy([p.url], [d.url], flow="push",
                    extra=("--prefill-bootstrap", boot.url))
        assert _push_legs(url, p, d, 4) == [(0, None)] * 4
        assert boot.queries == 1
    finally:
        p.close()
        boot.close()


def test_a_failed_push_prefill_looks_the_table_up_again(upstreams, proxy):  # noqa: F811
    """The prefill came back with one engine (vLLM refuses rank 1): the
    failed leg makes the proxy look its table up again at once, and the
    next requests go to rank 0 only."""
    p, d, boot = DPPrefill(2), upstreams("decode"), _bootstrap(2)
    try:
        url = proxy([p.url], [d.url], flow="push",
                    extra=("--prefill-bootstrap", boot.url))
        _push_legs(url, p, d, 1)
        assert wait_until(lambda: get_stats(url)["prefill_table_lookups"] == 1)
        one = _bootstrap(1)
        boot._body, p.engines = one._body, 1  # restarted with one engine
        one.close()
        legs = _push_legs(url, p, d, 2)  # one of them on rank 1: refused
        assert sorted(r for r, _ in legs) == [0, 1], legs
        assert wait_until(lambda: get_stats(url)["prefill_table_lookups"] == 2)
        assert _push_legs(url, p, d, 4) == [(0, None)] * 4
        assert boot.queries == 2 and get_stats(url)["prefill_table_lookup_failures"] == 0
    finally:
        p.close()
        boot.close()


class AnsweringDPPrefill(DPPrefill):
    """A DPPrefill whose answers carry what our producer's push answer does
    (scheduler.request_finished): the answering engine's name (`engines`,
    by rank) and its server's bootstrap port."""

    def __init__(self, names, bootstrap_port):
        self.names = names
        super().__init__(len(names))
        self.bootstrap_port = bootstrap_port

    def _answer(self, rank, body):
        p = body["kv_transfer_params"]
        return {"choices": [{"text": "x"}],
                "kv_transfer_params": {"push": True, "transfer_id": p["transfer_id"],
                                       "num_tokens": 32, "remote_engine_id": self.names[rank],
                                       "bootstrap_port": self.bootstrap_port}}


def test_push_finds_a_data_parallel_prefills_bootstrap_from_its_answers(upstreams,  # noqa: F811
                                                                        proxy):
    """No --prefill-bootstrap: the prefill's push answer names its engine and
    its bootstrap port; the proxy asks http://<--prefill host>:<port>/query
    (in the background), finds the answering engine in that table and from
    then on spreads push prefills over the engines, each decode leg naming
    its leg's engine."""
    boot = _bootstrap(2)
    names = {0: "127.0.0.1:13003", 1: "127.0.0.1:13004"}
    p, d = AnsweringDPPrefill(names, boot.port), upstreams("decode")
    try:
        url = proxy([p.url], [d.url], flow="push")
        assert _push_legs(url, p, d, 1) == [(0, None)]  # nothing known yet: rank 0
        assert wait_until(lambda: get_stats(url)["prefill_table_lookups"] == 1)
        legs = _push_legs(url, p, d, 6)
        assert all(e == names[r] for r, e in legs), legs
        assert sorted(r for r, _ in legs) == [0, 0, 0, 1, 1, 1], legs
        assert boot.queries == 1 and get_stats(url)["prefill_table_lookup_failures"] == 0
    finally:
        p.close()
        boot.close()


def test_push_does_not_take_another_servers_bootstrap(upstreams, proxy):  # noqa: F811
    """The port a prefill's answer names is served by another server (its
    table names other engines: e.g. the default port taken by another
    prefill on that host): not taken, every push prefill stays on rank 0
    and the decode leg names no engine; it is not asked again per request."""
    boot = _bootstrap(2)  # engines 127.0.0.1:13003, :13004
    names = {0: "127.0.0.1:23003", 1: "127.0.0.1:23004"}
    p, d = AnsweringDPPrefill(names, boot.port), upstreams("decode")
    try:
        url = proxy([p.url], [d.url], flow="push")
        _push_legs(url, p, d, 1)
        assert wait_until(lambda: get_stats(url)["prefill_table_lookup_failures"] == 1)
        assert _push_legs(url, p, d, 5) == [(0, None)] * 5
        assert boot.queries == 1
    finally:
        p.close()
        boot.close()


def test_prefill_bootstrap_is_checked():
    base = [sys.executable, "-m", "mooncake_connector.proxy", "--prefill", "http://p:1",
            "--decode", "http://d:2"]
    for extra, why in ((["--flow", "push", "--prefill-bootstrap", "http://a:1", "http://b:2"],
                        "one per URL"),
                       (["--flow", "push", "--prefill-bootstrap", "a:1"], "is not a URL"),
                       (["--flow", "a", "--prefill-bootstrap", "http://a:1"],
                        "for --flow push")):
        r = subprocess.run(base + extra, capture_output=True, text=True)
        assert r.returncode == 2 and why in r.stderr, (extra, r.stderr)
