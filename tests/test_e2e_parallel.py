"""Parallel and model-coverage cells with real vLLM servers (pytest -m e2e).

Each cell is a prefill and a decode server (our connector, proxy flows a, b,
push, and push_ll: push with push_layer_load, the same servers, the proxy
asking for it per request)
with its own parallel config; its outputs must be greedy token-identical to
a server with the decode side's parallel config computing the prompt
itself, and decode's /metrics must show the prompts' KV loaded remotely.
The cells:

  tp2-tp1   prefill --tensor-parallel-size 2, decode 1  (KV heads merged)   CI
  tp1-tp2   prefill 1, decode 2                        (KV heads split)    opt-in
  tp2-tp2   both 2                                     (rank r -> rank r)  opt-in
  hma-sw    a tiny Llama whose layer 0 is sliding-window attention (64
            tokens) and layer 1 full: vLLM's hybrid KV-cache manager stays on
            (SupportsHMA), two KV-cache groups move                        CI
  mla       a tiny DeepSeek-V2-style model (MLA: one 576-wide latent per
            token and layer; vLLM's CPU MLA backend forces 16-token blocks)  opt-in
  mla-tp1-tp2  the same, decode TP 2 (each decode rank reads whole latent
            blocks from prefill rank 0)                                  opt-in
  dp2-dp2   prefill and decode each --data-parallel-size 2 (vLLM's internal
            load balancing: one API server, two engines, each with its own
            transfer-engine names); both engines of each side must serve  CI
  dp2-dp1   prefill --data-parallel-size 2, decode 1 (for the vllm-router
            tests and the by-hand in-tree legs below)                    opt-in
  tp1-tp1   is tests/test_e2e_serving.py's session deployment.

The reference is the cell's own decode server: before any request goes
through a proxy, each prompt is sent to it directly (no kv_transfer_params;
flow A's probe finds nothing at the producer, so decode computes the prompt
itself with its own parallel config; prefix caching is off, so nothing of it
is reused later), and the test checks that these requests loaded nothing.
That costs no server of its own.  MC_E2E_OWN_REFERENCE=1 adds independent
colocated servers instead, one per (model, decode config), shared by the
cells that have that decode config.

Every selected cell's servers start at once (vLLM's start-up waits on much
besides the CPU), and the cells share nothing else: a producer serves one
consumer TP size, and flow A's consumer asks the one producer its
configuration names.  A TP 2 server is four processes on this 2-core
machine and needs ~90-350 s to start, so CI runs one different-TP cell;
MC_E2E_PARALLEL=all (or a comma-separated list of cells) runs more:
  MC_E2E_PARALLEL=all .venv/bin/python -P -m pytest -q tests/test_e2e_parallel.py
"""
import os
import tempfile
import time

import pytest

from mooncake_connector.demo import _prompt
from mooncake_connector.deployment import (connector_log_stats, metric_value,
                                           prompt_tokens_by_source)
from mooncake_connector.openai_client import request
from mooncake_connector.token_match import TIE_EPS, judge

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

BLOCK = 32
# Generous: a TP 2 server's first requests took minutes when the shared host had
# a load average of 80-150 (2026-12-01: a 180 s limit timed out).
REQ_TIMEOUT = float(os.environ.get("MC_E2E_REQ_TIMEOUT", "900"))
TP2 = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]
SW = 64  # the hybrid model's sliding window (tokens): 2 blocks of 32
# vLLM's CPU MLA backend packs its absorbed weights with a kernel that takes
# bf16/fp16/int8 only where the CPU has AMX ("expect weight to be bfloat16,
# float16, int8 ..." at start-up with --dtype float32): the MLA cells run in
# bfloat16 on every host (the reference is the cell's own decode server).
BF16 = ["--dtype", "bfloat16"]
DP2 = ["--data-parallel-size", "2"]
CELLS = {"tp2-tp1": {"prefill": TP2},
         "dp2-dp2": {"prefill": DP2, "decode": DP2},
         "dp2-dp1": {"prefill": DP2},
         "hma-sw": {"model": {"sliding_window": SW}},
         "tp1-tp2": {"decode": TP2},
         "tp2-tp2": {"prefill": TP2, "decode": TP2},
         "mla": {"model": {"attention": "mla"}, "prefill": BF16, "decode": BF16},
         "mla-tp1-tp2": {"model": {"attention": "mla"}, "prefill": BF16, "decode": TP2 + BF16}}
CI_CELLS = ("tp2-tp1", "hma-sw", "dp2-dp2")


def _selected():
    want = os.environ.get("MC_E2E_PARALLEL", "")
    if want == "all":
        return list(CELLS)
    if want:
        return [c.strip() for c in want.split(",") if c.strip()]
    return list(CI_CELLS)


PROMPTS = [("short", "hello world, here we go again"), ("medium", _prompt(60, 21)),
           ("long", _prompt(400, 22)), ("long2", _prompt(250, 23))]


def _many_prompts(n, max_words=1800):
    """n prompts of 5 to 1,800 words (one word is one or two tokens of the
    tiny model's tokenizer: the longest stay under its 2,048-token context
    with the 8 generated), every third one extending an earlier one (shared
    prefixes: prefix-cache hits on both sides): the opt-in wide run,
    MC_E2E_PROMPTS=N."""
    out = []
    for i in range(n):
        length = 5 + (i * 797) % (max_words - 5)
        if i % 3 == 2 and out:
            base = out[i // 2][1].split()
            ext = _prompt(max(5, length // 4), 1000 + i).split()
            words = (base + ext)[:max_words]
            out.append((f"p{i}", " ".join(words)))
        else:
            out.append((f"p{i}", _prompt(length, 1000 + i)))
    return out


if os.environ.get("MC_E2E_PROMPTS"):
    PROMPTS = _many_prompts(int(os.environ["MC_E2E_PROMPTS"]))


def _body(prompt, stream=False, logprobs=False):
    b = {"model": "tiny", "prompt": prompt, "temperature": 0.0, "max_tokens": 8,
         "ignore_eos": True, "return_token_ids": True, "stream": stream}
    if logprobs:
        b["logprobs"] = 2  # top-2 per token: token_match judges ties with them
    if stream:
        b["stream_options"] = {"include_usage": True}
    return b


def _references(url, decode_url=None):
    """Greedy token ids of every prompt from `url`; with decode_url (the
    reference is the decode server itself) also checks none was loaded."""
    before = prompt_tokens_by_source(decode_url) if decode_url else None
    refs = {}
    for pid, prompt in PROMPTS:
        r = request(url, "/v1/completions", _body(prompt, logprobs=True), timeout=REQ_TIMEOUT)
        assert r.status == 200 and r.token_ids, (url, pid, r.status, r.error)
        refs[pid] = (r.token_ids, r.top_logprobs)
    if decode_url:
        after = prompt_tokens_by_source(decode_url)
        ext = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
        assert ext == 0, (f"the reference requests sent to decode directly loaded {ext} "
                          "prompt tokens remotely: they are no local reference")
    return refs


@pytest.fixture(scope="module")
def cells(tiny_model_dir):
    """{name: (Deployment, {prompt id: reference token ids})} for every
    selected cell, all started together."""
    from mooncake_connector import serving, tiny_model
    from mooncake_connector.deployment import Deployment
    from e2e_fixtures import START_TIMEOUT_S

    names = _selected()
    unknown = [n for n in names if n not in CELLS]
    if unknown:
        pytest.fail(f"MC_E2E_PARALLEL names unknown cell(s) {unknown}; cells: {', '.join(CELLS)}")
    own_reference = os.environ.get("MC_E2E_OWN_REFERENCE") == "1"
    deps, colocated = {}, {}  # colocated: (model, decode args) -> server
    for name in names:
        args = dict(CELLS[name])
        model = tiny_model.build(**args.pop("model")) if "model" in args else tiny_model_dir
        workdir = tempfile.mkdtemp(prefix=f"mc-e2e-{name}-")
        extra = {"push_ll": PUSH_LL}
        if name.startswith("dp"):
            extra["push_auto"] = PUSH_AUTO
        deps[name] = Deployment(workdir, model, flows=("a", "b", "push"), colocated=False,
                                side_args=args, extra_proxies=extra)
        key = (model, tuple(args.get("decode", ())))
        if own_reference and key not in colocated:
            colocated[key] = serving.vllm_server(
                f"colocated {name}", model, serving.free_port(),
                os.path.join(workdir, "logs", "colocated.log"), extra_args=list(key[1]))
    procs = [p for d in deps.values() for p in d.processes] + list(colocated.values())
    t0 = time.monotonic()
    try:
        serving.start_all([d.metadata for d in deps.values() if d.metadata is not None], 60.0)
        serving.start_all(procs, START_TIMEOUT_S)
    except BaseException:
        serving.stop_all(procs)
        raise
    print(f"\n{len(deps)} cell(s) up in {time.monotonic() - t0:.0f} s "
          f"(+{len(colocated)} colocated reference(s))")
    try:
        out = {}
        for name, dep in deps.items():
            print(dep.describe())
            args = CELLS[name]
            model = dep.model
            key = (model, tuple(args.get("decode", ())))
            if own_reference:
                out[name] = (dep, _references(colocated[key].url))
            else:
                out[name] = (dep, _references(dep.decode.url, dep.decode.url))
        yield out
    finally:
        for dep in deps.values():
            dep.stop()
        serving.stop_all(list(colocated.values()))


# Push with push_layer_load (the decode's attention waits per layer), asked for
# per request by the proxy: no server of its own.
PUSH_LL = {"flow": "push", "extra_args": ("--push-layerwise", "on", "--push-layer-load", "on")}
# A push proxy without --prefill-bootstrap (data-parallel cells): it finds the
# prefill's bootstrap server from the prefill's push answers.
PUSH_AUTO = {"flow": "push", "prefill_bootstrap": False}


@pytest.mark.parametrize("flow", ["a", "b", "push", "push_ll"])
@pytest.mark.parametrize("name", _selected())
def test_cell_matches_reference_and_loads_remotely(cells, name, flow):
    dep, refs = cells[name]
    mismatches, not_loaded, ties = [], [], []
    before = prompt_tokens_by_source(dep.decode.url)
    in_step0 = metric_value(dep.decode.url, "vllm:mooncake_push_layer_loads_total")
    for pid, prompt in PROMPTS:
        for stream in (False, True):
            r = request(dep.proxies[flow].url, "/v1/completions", _body(prompt, stream),
                        timeout=REQ_TIMEOUT)
            assert r.status == 200 and r.error is None, (name, flow, pid, r.status, r.error)
            verdict, note = judge(refs[pid][0], refs[pid][1], r.token_ids)
            if verdict == "tie":
                ties.append(f"{pid} stream={stream}: {note}")
            elif verdict != "identical":
                mismatches.append(f"{pid} stream={stream}: {note}; reference {refs[pid][0]} "
                                  f"vs {r.token_ids}")
            n = r.usage["prompt_tokens"]
            need = (n - 1) // BLOCK * BLOCK
            # vLLM counts a request's prompt tokens by source when its engine
            # core's stats reach the API server's logger, which can trail the
            # last streamed chunk: give the counter time to catch up (3 s was
            # too short once on a loaded CI host: a load the decode made, no
            # recompute logged, counted after the check).  A prompt computed
            # locally never reaches `need`: it waits the whole bound.
            end = time.monotonic() + 15
            while True:
                after = prompt_tokens_by_source(dep.decode.url)
                ext = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
                if ext >= need or time.monotonic() > end:
                    break
                time.sleep(0.05)
            before = after
            if ext < need:
                not_loaded.append(f"{pid} stream={stream}: {n} prompt tokens, {ext} loaded "
                                  f"remotely (expected >= {need})")
    print(f"{name} flow {flow}: {2 * len(PROMPTS) - len(mismatches) - len(ties)} of "
          f"{2 * len(PROMPTS)} token-identical, {len(ties)} parted at a rounding tie "
          f"(top-2 logprob gap <= {TIE_EPS:g}), {len(mismatches)} differ")
    for t in ties:
        print("  tie:", t)
    assert not mismatches, f"{name} flow {flow}: output differs from the reference:\n" + \
        "\n".join(mismatches)
    assert not not_loaded, f"{name} flow {flow}: prompt KV not loaded remotely:\n" + \
        "\n".join(not_loaded)
    in_step = metric_value(dep.decode.url, "vllm:mooncake_push_layer_loads_total") - in_step0
    if flow == "push_ll" and name != "hma-sw":  # HMA (two KV-cache groups): the async push
        assert in_step > 0, f"{name}: no request was taken as a layer load"
    elif flow != "push_ll":
        assert in_step == 0, (name, flow, in_step)


@pytest.mark.parametrize("name", _selected())
def test_cell_logs_its_tp_map_and_no_load_failures(cells, name):
    """The decode log names the mapping it uses; the connector's own counters
    (vLLM's stat logger lines) show loads and no failed one."""
    dep, _ = cells[name]
    with open(dep.decode.log_path, encoding="utf-8", errors="replace") as f:
        log = f.read()
    if "tp" in name:
        p_tp, d_tp = (int(x[2:]) for x in name.split("-")[-2:])
        assert f"TP {p_tp} -> {d_tp}" in log, f"no TP map line in {dep.decode.log_path}"
    if name == "hma-sw":  # SupportsHMA: vLLM keeps its hybrid KV-cache manager
        assert "Turning off hybrid kv cache manager" not in log
        assert "SlidingWindowSpec" in log and "FullAttentionSpec" in log, \
            "the decode worker did not log two KV-cache groups"
    # The stat logger writes a line per ~10 s interval.  The decode server
    # answered the reference requests (no loads) before the proxied ones, so
    # the lines written so far may all predate the loads: wait for the
    # interval that holds them.
    stats = connector_log_stats(dep.decode.log_path)
    end = time.monotonic() + 30
    while stats and not stats.get("loads") and time.monotonic() < end:
        time.sleep(1)
        stats = connector_log_stats(dep.decode.log_path)
    if stats:  # a fast cell may have no line at all yet
        assert stats.get("loads", 0) > 0 and stats.get("loads_failed", 0) == 0, stats


def _per_engine(url, metric):
    """{engine label: value} of a counter in a server's /metrics."""
    from mooncake_connector import serving
    from mooncake_connector.deployment import parse_metrics
    status, body = serving.http_get(url + "/metrics", timeout=10)
    assert status == 200, (url, status)
    out = {}
    for (name, labels), v in parse_metrics(body).items():
        if name == metric:
            eng = dict(labels).get("engine")
            out[eng] = out.get(eng, 0) + v
    return out


def _dp_decode(name):
    return CELLS.get(name, {}).get("decode") == DP2


@pytest.mark.parametrize("name", [n for n in _selected() if n.startswith("dp") and _dp_decode(n)])
def test_dp_cell_both_engines_of_each_side_served(cells, name):
    """vLLM data parallelism: every engine of the prefill published prompts
    and every engine of the decode loaded some (vLLM's load balancer spread
    the requests; a prompt published on the prefill's engine 1 was found
    there by flow A's probe and pulled from that engine's names), every
    engine of the prefill pushed some (the push proxy spreads its prefill
    legs over the engines of the prefill's bootstrap table), and no prompt
    was computed on the decode for want of its KV."""
    dep, _ = cells[name]
    # (its reference requests, sent to the decode directly, were computed there)
    recomputed0 = metric_value(dep.decode.url, "vllm:mooncake_recomputes_total")
    for flow in ("a", "b", "push"):  # requests of its own: not ordered after the cell's flows
        for i in range(4):
            prompt = _prompt(80, 300 + i) + f" {flow}"
            r = request(dep.proxies[flow].url, "/v1/completions", _body(prompt),
                        timeout=REQ_TIMEOUT)
            assert r.status == 200 and r.error is None, (name, flow, r.status, r.error)
    pub = _per_engine(dep.prefill.url, "vllm:mooncake_publishes_total")
    loads = _per_engine(dep.decode.url, "vllm:mooncake_loads_total")
    assert len(pub) == 2 and all(v > 0 for v in pub.values()), f"prefill publishes {pub}"
    assert len(loads) == 2 and all(v > 0 for v in loads.values()), f"decode loads {loads}"
    pushed = _per_engine(dep.prefill.url, "vllm:mooncake_push_sends_total")
    assert len(pushed) == 2 and all(v > 0 for v in pushed.values()), f"prefill pushes {pushed}"
    # Without --prefill-bootstrap: the proxy found the table from the
    # prefill's push answers (its first request on rank 0, the rest spread).
    for i in range(6):
        r = request(dep.proxies["push_auto"].url, "/v1/completions",
                    _body(_prompt(80, 400 + i) + " auto"), timeout=REQ_TIMEOUT)
        assert r.status == 200 and r.error is None, (name, "push_auto", r.status, r.error)
    auto = {e: v - pushed.get(e, 0) for e, v in
            _per_engine(dep.prefill.url, "vllm:mooncake_push_sends_total").items()}
    assert len(auto) == 2 and all(v > 0 for v in auto.values()), \
        f"prefill pushes through the proxy without --prefill-bootstrap {auto}"
    recomputed = metric_value(dep.decode.url, "vllm:mooncake_recomputes_total") - recomputed0
    assert recomputed == 0, f"{recomputed} prompt(s) computed on the decode instead of loaded"
    with open(dep.decode.log_path, encoding="utf-8", errors="replace") as f:
        log = f.read()
    assert "the producer has 2 data-parallel engine(s)" in log
    # The bootstrap server (vLLM's in-tree contract) names both engines by DP rank.
    from mooncake_connector import serving
    import json
    status, body = serving.http_get(f"http://127.0.0.1:{dep.bootstrap_port}/query", timeout=10)
    table = json.loads(body)
    assert status == 200 and sorted(table) == ["0", "1"], table
    assert table["0"]["engine_id"] != table["1"]["engine_id"], table


@pytest.mark.parametrize("name", [n for n in _selected() if n.startswith("dp") and _dp_decode(n)])
def test_dp_cell_decode_answers_a_forget_per_engine(cells, name):
    """The proxy's forget asks each engine of a data-parallel decode
    (proxy._forget_round): vLLM's API server routes X-data-parallel-rank r to
    engine r, which answers for itself (a leg it never saw: "unseen") and
    says it has siblings (mc_dp); a rank past the last is refused with
    vLLM's "out of range"."""
    import json
    import urllib.error
    import urllib.request
    dep, _ = cells[name]

    def ask(rank):
        body = {"model": "tiny", "prompt": [1], "max_tokens": 1,
                "kv_transfer_params": {"mc_forget": {"x_request_id": f"never-{name}",
                                                     "dp_rank": rank}}}
        req = urllib.request.Request(dep.decode.url + "/v1/completions",
                                     json.dumps(body).encode(),
                                     {"Content-Type": "application/json",
                                      "X-data-parallel-rank": str(rank)})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read()).get("kv_transfer_params")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    # Each engine its own ledger: the first ask of each is "unseen", the
    # second "seen" (asked twice), so each ask reached the engine it named.
    for rank, want in ((0, "unseen"), (1, "unseen"), (0, "seen"), (1, "seen")):
        status, params = ask(rank)
        assert status == 200 and params["mc_dp"] is True, (rank, status, params)
        assert params["mc_forget"] == want, (rank, params)
    status, text = ask(2)
    assert status == 400 and "out of range" in text, (status, text)


def _start_router(dep, name, extra):
    """vLLM's Rust router (--kv-connector mooncake, tests/vllm_router_pkg.py)
    in front of a cell's prefill (its bootstrap port) and decode; skips,
    saying why, when it cannot be had."""
    import sys
    from mooncake_connector import serving
    sys.path.insert(0, os.path.dirname(__file__))
    import vllm_router_pkg
    site, why = vllm_router_pkg.find_router()
    if site is None:
        pytest.skip(f"vllm-router unavailable: {why}")
    port = serving.free_port()
    argv, env = vllm_router_pkg.router_cmd(
        site, [(dep.prefill.url, dep.bootstrap_port)], [dep.decode.url], port, extra=extra)
    tag = "dp-aware" if extra else "plain"
    proc = serving.Process(f"vllm-router {name} {tag}", argv,
                           os.path.join(dep.workdir, "logs", f"vllm-router-{tag}.log"), env=env,
                           health_url=f"http://127.0.0.1:{port}/health")
    proc.url = f"http://127.0.0.1:{port}"
    serving.start_all([proc], 240)
    return proc


@pytest.mark.parametrize("dp_aware", [False, True], ids=["plain", "dp-aware"])
@pytest.mark.parametrize("name", [n for n in _selected() if n.startswith("dp")])
def test_dp_cell_vllm_router(cells, name, dp_aware):
    """vllm-router --kv-connector mooncake in front of a data-parallel
    prefill: at start-up it reads the prefill's bootstrap table (an engine id
    per DP rank) and asks each server how many engines it has; per request
    it pins the prefill leg to a rank (X-data-parallel-rank) and names that
    rank's engine in the decode leg.  Plain: the engine counts the servers
    report; dp-aware: --intra-node-data-parallel-size 2.  Either way: token-identical to the reference, the
    prompt's KV pushed by the prefill's engines (both serve), none computed
    on the decode for want of it."""
    import concurrent.futures
    from mooncake_connector import serving
    dep, refs = cells[name]
    extra = ("--intra-node-data-parallel-size", "2") if dp_aware else ()
    router = _start_router(dep, name, extra)
    try:
        with open(router.log_path, encoding="utf-8", errors="replace") as f:
            log = f.read()
        assert "Got Mooncake engine_ids" in log, log[-2000:]
        status, body = serving.http_get(f"http://127.0.0.1:{dep.bootstrap_port}/query", timeout=10)
        import json
        table = json.loads(body)
        assert sorted(table) == ["0", "1"], table
        recomputed0 = metric_value(dep.decode.url, "vllm:mooncake_recomputes_total")
        pushed0 = _per_engine(dep.prefill.url, "vllm:mooncake_push_sends_total")
        failed0 = _per_engine(dep.prefill.url, "vllm:mooncake_push_failures_total")
        pub0 = _per_engine(dep.prefill.url, "vllm:mooncake_publishes_total")
        mark = os.path.getsize(dep.decode.log_path)
        before = prompt_tokens_by_source(dep.decode.url)
        mismatches, need = [], 0

        def one(pid, stream):
            r = request(router.url, "/v1/completions", _body(dict(PROMPTS)[pid], stream),
                        timeout=REQ_TIMEOUT)
            assert r.status == 200 and r.error is None, (name, pid, r.status, r.error,
                                                        str(r.body)[:300])
            verdict, note = judge(refs[pid][0], refs[pid][1], r.token_ids)
            if verdict not in ("identical", "tie"):
                mismatches.append(f"{pid} stream={stream}: {note}")
            return (r.usage["prompt_tokens"] - 1) // BLOCK * BLOCK, verdict

        jobs = [(pid, s) for pid, _ in PROMPTS for s in (False, True)]
        verdicts = []
        for pid, s in jobs:  # one at a time
            n, v = one(pid, s)
            need += n
            verdicts.append(v)
        # and four at once, twice (four different prompts in flight: two
        # identical prompts at once on one prefill engine are another matter)
        for stream in (False, True):
            with concurrent.futures.ThreadPoolExecutor(4) as ex:
                for n, v in ex.map(lambda pid: one(pid, stream), [p for p, _ in PROMPTS]):
                    need += n
                    verdicts.append(v)
        end = time.monotonic() + 10
        while True:
            after = prompt_tokens_by_source(dep.decode.url)
            ext = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
            if ext >= need or time.monotonic() > end:
                break
            time.sleep(0.2)
        pushed = _per_engine(dep.prefill.url, "vllm:mooncake_push_sends_total")
        failed = _per_engine(dep.prefill.url, "vllm:mooncake_push_failures_total")
        per_rank = {e: pushed.get(e, 0) - pushed0.get(e, 0) for e in pushed}
        fails = {e: failed.get(e, 0) - failed0.get(e, 0) for e in failed}
        recomputed = metric_value(dep.decode.url, "vllm:mooncake_recomputes_total") - recomputed0
        pub = {e: v - pub0.get(e, 0) for e, v in
               _per_engine(dep.prefill.url, "vllm:mooncake_publishes_total").items()}
        with open(dep.decode.log_path, "rb") as f:
            f.seek(mark)
            located = f.read().count(b"its push leg names producer engine")
        print(f"{name} vllm-router {'dp-aware' if dp_aware else 'plain'}: "
              f"{verdicts.count('identical')} of {len(verdicts)} token-identical "
              f"({verdicts.count('tie')} ties), prompts per prefill engine {pub}, "
              f"{located} target(s) sent to another engine than the leg named, "
              f"pushes per prefill engine {per_rank}, "
              f"push failures {fails}, {ext} of >= {need} prompt tokens loaded remotely, "
              f"{recomputed:g} recomputed")
        assert not mismatches, "router output differs from the reference:\n" + \
            "\n".join(mismatches)
        assert recomputed == 0, f"{recomputed} prompt(s) computed on the decode, not loaded"
        assert ext >= need, f"{ext} prompt tokens loaded remotely, expected >= {need}"
        assert not any(fails.values()), fails
        assert len(per_rank) == 2 and all(v > 0 for v in per_rank.values()), \
            f"pushes per prefill engine {per_rank}: both engines should serve"
    finally:
        serving.stop_all([router])


@pytest.mark.parametrize("name", [n for n in _selected() if n.startswith("dp")])
def test_dp_cell_intree_legs_naming_another_engine(cells, name):
    """The legs of a router that does not pin a data-parallel prefill's
    legs to ranks but names rank 0's engine (vllm-router 0.1.17 pins them
    itself where the server reports its engine count): the prefill leg may
    run on engine 1 while the decode leg names the engine of rank 0.  Sent here by hand, the prefill leg pinned to rank 1:
    the output must still be the reference's and the prompt's KV loaded
    through the connector."""
    import json
    import urllib.request
    from mooncake_connector import serving
    from mooncake_connector.connector.bootstrap import intree_legs
    dep, refs = cells[name]
    status, body = serving.http_get(f"http://127.0.0.1:{dep.bootstrap_port}/query", timeout=10)
    table = json.loads(body)
    boot = f"http://127.0.0.1:{dep.bootstrap_port}"
    recomputed0 = metric_value(dep.decode.url, "vllm:mooncake_recomputes_total")
    pushed0 = _per_engine(dep.prefill.url, "vllm:mooncake_push_sends_total")
    results = []
    for pid in ("long", "long2"):
        before = prompt_tokens_by_source(dep.decode.url)
        _, pre, dec = intree_legs(_body(dict(PROMPTS)[pid]), boot, table["0"]["engine_id"])
        req = urllib.request.Request(dep.prefill.url + "/v1/completions", json.dumps(pre).encode(),
                                     {"Content-Type": "application/json",
                                      "X-data-parallel-rank": "1"})
        with urllib.request.urlopen(req, timeout=REQ_TIMEOUT) as r:
            assert r.status == 200
        t0 = time.monotonic()
        r = request(dep.decode.url, "/v1/completions", dec, timeout=REQ_TIMEOUT)
        took = time.monotonic() - t0
        assert r.status == 200 and r.error is None, (pid, r.status, r.error)
        verdict, note = judge(refs[pid][0], refs[pid][1], r.token_ids)
        after = prompt_tokens_by_source(dep.decode.url)
        ext = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
        results.append((pid, verdict, ext, (r.usage["prompt_tokens"] - 1) // BLOCK * BLOCK,
                        round(took, 2)))
    pushed = _per_engine(dep.prefill.url, "vllm:mooncake_push_sends_total")
    recomputed = metric_value(dep.decode.url, "vllm:mooncake_recomputes_total") - recomputed0
    print(f"{name} in-tree legs, prefill on rank 1, decode naming rank 0's engine: "
          f"(prompt, verdict, loaded, expected, decode s) {results}; pushes per prefill engine "
          f"{ {e: v - pushed0.get(e, 0) for e, v in pushed.items()} }, {recomputed:g} recomputed")
    assert all(v in ("identical", "tie") for _, v, _, _, _ in results), results
    assert all(ext >= need for _, _, ext, need, _ in results), results
    assert recomputed == 0, results
