"""Parallel and model-coverage cells with real vLLM servers (pytest -m e2e).

Each cell is a prefill and a decode server (our connector, both proxy flows)
with its own parallel config; its outputs must be greedy token-identical to a
colocated server with the decode side's config, and decode's /metrics must
show the prompts' KV loaded remotely.  The cells:

  tp2-tp1   prefill --tensor-parallel-size 2, decode 1  (KV heads merged)   CI
  tp1-tp2   prefill 1, decode 2                        (KV heads split)    opt-in
  tp2-tp2   both 2                                     (rank r -> rank r)  opt-in
  hma-sw    a tiny Llama whose layer 0 is sliding-window attention (64
            tokens) and layer 1 full: vLLM's hybrid KV-cache manager stays on
            (SupportsHMA), two KV-cache groups move                        CI
  tp1-tp1   is tests/test_e2e_serving.py's session deployment.

A TP 2 server is four processes on this 2-core machine (API server, engine
core, two workers) and needs ~90-300 s to start, so CI runs one
different-TP cell (its reference is the session's colocated TP 1 server);
MC_E2E_PARALLEL=all (or a comma-separated list of cells) runs more:
  MC_E2E_PARALLEL=all MC_E2E_OWN_REFERENCE=1 .venv/bin/python -P -m pytest \
      -q tests/test_e2e_parallel.py
"""
import os
import tempfile

import pytest

from mooncake_connector.demo import _prompt
from mooncake_connector.deployment import connector_log_stats, prompt_tokens_by_source
from mooncake_connector.openai_client import request

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

BLOCK = 32
REQ_TIMEOUT = 180
TP2 = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]
SW = 64  # the hybrid model's sliding window (tokens): 2 blocks of 32
CELLS = {"tp2-tp1": {"prefill": TP2},
         "hma-sw": {"model": {"sliding_window": SW}, "colocated": []},
         "tp1-tp2": {"decode": TP2, "colocated": TP2},
         "tp2-tp2": {"prefill": TP2, "decode": TP2, "colocated": TP2}}
CI_CELLS = ("tp2-tp1", "hma-sw")


def _selected():
    want = os.environ.get("MC_E2E_PARALLEL", "")
    if want == "all":
        return list(CELLS)
    if want:
        return [c.strip() for c in want.split(",") if c.strip()]
    return list(CI_CELLS)


PROMPTS = [("short", "hello world, here we go again"), ("medium", _prompt(60, 21)),
           ("long", _prompt(400, 22)), ("long2", _prompt(250, 23))]


def _body(prompt, stream=False):
    b = {"model": "tiny", "prompt": prompt, "temperature": 0.0, "max_tokens": 8,
         "ignore_eos": True, "return_token_ids": True, "stream": stream}
    if stream:
        b["stream_options"] = {"include_usage": True}
    return b


@pytest.fixture(scope="module", params=_selected())
def cell(request, tiny_model_dir):
    from mooncake_connector.deployment import Deployment
    from e2e_fixtures import START_TIMEOUT_S

    name = request.param
    if name not in CELLS:
        pytest.fail(f"MC_E2E_PARALLEL names unknown cell {name!r}; cells: {', '.join(CELLS)}")
    args = dict(CELLS[name])
    model = tiny_model_dir
    if "model" in args:  # a tiny model of its own (e.g. with sliding-window layers)
        from mooncake_connector import tiny_model
        model = tiny_model.build(**args.pop("model"))
    # MC_E2E_OWN_REFERENCE=1: a colocated server of the cell's own even when
    # decode is TP 1 (running this file alone: cheaper than the session's
    # three servers).
    own_reference = "colocated" in args or os.environ.get("MC_E2E_OWN_REFERENCE") == "1"
    workdir = tempfile.mkdtemp(prefix=f"mc-e2e-{name}-")
    dep = Deployment(workdir, model, flows=("a", "b"), colocated=own_reference,
                     side_args=args)
    try:
        dep.start(timeout=START_TIMEOUT_S)
    except Exception:
        dep.stop()
        raise
    print("\n" + dep.describe())
    # A decode side with TP 1 compares with the session's colocated server.
    ref = dep.colocated.url if own_reference else request.getfixturevalue("deployment") \
        .colocated.url
    yield name, dep, ref
    dep.stop()


@pytest.mark.parametrize("flow", ["a", "b"])
def test_cell_matches_colocated_and_loads_remotely(cell, flow):
    name, dep, ref_url = cell
    mismatches, not_loaded = [], []
    before = prompt_tokens_by_source(dep.decode.url)
    for pid, prompt in PROMPTS:
        for stream in (False, True):
            ref = request(ref_url, "/v1/completions", _body(prompt), timeout=REQ_TIMEOUT)
            assert ref.status == 200 and ref.token_ids, (pid, ref.error)
            r = request(dep.proxies[flow].url, "/v1/completions", _body(prompt, stream),
                        timeout=REQ_TIMEOUT)
            assert r.status == 200 and r.error is None, (name, flow, pid, r.status, r.error)
            if r.token_ids != ref.token_ids:
                mismatches.append(f"{pid} stream={stream}: colocated {ref.token_ids} vs "
                                  f"{r.token_ids}")
            after = prompt_tokens_by_source(dep.decode.url)
            ext = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
            before = after
            n = r.usage["prompt_tokens"]
            need = (n - 1) // BLOCK * BLOCK
            if ext < need:
                not_loaded.append(f"{pid} stream={stream}: {n} prompt tokens, {ext} loaded "
                                  f"remotely (expected >= {need})")
    assert not mismatches, f"{name} flow {flow}: output differs from colocated:\n" + \
        "\n".join(mismatches)
    assert not not_loaded, f"{name} flow {flow}: prompt KV not loaded remotely:\n" + \
        "\n".join(not_loaded)


def test_cell_logs_its_tp_map_and_no_load_failures(cell):
    """The decode log names the mapping it uses; the connector's own counters
    (vLLM's stat logger lines) show loads and no failed one."""
    name, dep, _ = cell
    with open(dep.decode.log_path, encoding="utf-8", errors="replace") as f:
        log = f.read()
    if name.startswith("tp"):
        p_tp, d_tp = (int(x[2:]) for x in name.split("-"))
        assert f"TP {p_tp} -> {d_tp}" in log, f"no TP map line in {dep.decode.log_path}"
    if name == "hma-sw":  # SupportsHMA: vLLM keeps its hybrid KV-cache manager
        assert "Turning off hybrid kv cache manager" not in log
        assert "SlidingWindowSpec" in log and "FullAttentionSpec" in log, \
            "the decode worker did not log two KV-cache groups"
    stats = connector_log_stats(dep.decode.log_path)
    if stats:  # the stat logger writes every ~10 s; a fast cell may have none yet
        assert stats.get("loads", 0) > 0 and stats.get("loads_failed", 0) == 0, stats
