"""vLLM's Rust router in its Mooncake mode in front of our servers (pytest -m e2e).

`vllm-router --vllm-pd-disaggregation --kv-connector mooncake` (PyPI,
tests/vllm_router_pkg.py; skipped, saying why, when it cannot be had) speaks
vLLM's in-tree MooncakeConnector contract: at start-up it asks each prefill's
bootstrap server (GET http://P:PORT/query) for the engine id per DP rank and
refuses to start without it; per request it sends the prefill leg
{"do_remote_decode": true, "transfer_id"} and the decode leg
{"do_remote_prefill": true, "transfer_id", "remote_bootstrap_addr",
"remote_engine_id"}.  Our producer serves that bootstrap server
(connector/bootstrap.py), our consumer maps those params onto its loads.
Greedy output through the router must be token-identical to the colocated
server's, the decode server must have loaded the prompt's KV through the
connector, and that KV must have been pushed by our engine (the producer's
push_sends, the consumer's push_loads).  Uses the session deployment (tests/e2e_fixtures.py): only the
router is started here.
"""
import json
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import vllm_router_pkg  # noqa: E402

from mooncake_connector import serving  # noqa: E402
from mooncake_connector.demo import _prompt  # noqa: E402
from mooncake_connector.deployment import (connector_log_stats, log_size,  # noqa: E402
                                           prompt_tokens_by_source)
from mooncake_connector.openai_client import request  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

BLOCK = 32
SHARED = _prompt(300, 1)
CASES = [("short", "/v1/completions", {"prompt": "hello world"}),
         ("medium", "/v1/completions", {"prompt": _prompt(60, 2)}),
         ("long", "/v1/completions", {"prompt": _prompt(400, 3)}),
         ("verylong", "/v1/completions", {"prompt": _prompt(1200, 4)}),
         ("prefix1", "/v1/completions", {"prompt": SHARED + " and then the fox"}),
         ("prefix2", "/v1/completions", {"prompt": SHARED + _prompt(90, 5)}),
         ("chat", "/v1/chat/completions",
          {"messages": [{"role": "system", "content": SHARED},
                        {"role": "user", "content": _prompt(51, 6)}]})]


def _body(base, stream):
    b = dict(base, model="tiny", temperature=0.0, max_tokens=12, ignore_eos=True,
             return_token_ids=True, stream=stream)
    if stream:
        b["stream_options"] = {"include_usage": True}
    return b


@pytest.fixture(scope="module")
def router(deployment):
    if deployment.connector != "mooncake" or deployment.bootstrap_port is None:
        pytest.skip("needs our connector (MC_E2E_CONNECTOR=mooncake): the router's Mooncake "
                    "mode asks our producer's bootstrap server")
    site, why = vllm_router_pkg.find_router()
    if site is None:
        pytest.skip(f"vllm-router unavailable: {why}")
    port = serving.free_port()
    argv, env = vllm_router_pkg.router_cmd(
        site, [(deployment.prefill.url, deployment.bootstrap_port)], [deployment.decode.url],
        port)
    proc = serving.Process("vllm-router", argv,
                           os.path.join(deployment.logs, "vllm-router.log"), env=env,
                           health_url=f"http://127.0.0.1:{port}/health")
    proc.url = f"http://127.0.0.1:{port}"
    serving.start_all([proc], 240)
    yield proc
    serving.stop_all([proc])


def test_bootstrap_server_names_the_producer_engine(deployment):
    if deployment.connector != "mooncake":
        pytest.skip("our connector only")
    status, body = serving.http_get(f"http://127.0.0.1:{deployment.bootstrap_port}/query")
    assert status == 200, body
    table = json.loads(body)
    with open(os.path.join(deployment.workdir, "mooncake.json")) as f:
        prefill_engine = json.load(f)["prefill_url"]
    assert table == {"0": {"engine_id": prefill_engine,
                           "worker_addr": {"0": {"0": prefill_engine}}}}


def test_vllm_router_mooncake_mode_drives_our_servers(deployment, router):
    with open(router.log_path, "rb") as f:
        log = f.read().decode("utf-8", "replace")
    assert "Got Mooncake engine_ids" in log, log[-2000:]
    mismatches, not_loaded = [], []
    marks = {side: log_size(getattr(deployment, side).log_path) for side in ("prefill", "decode")}
    pushable = 0  # requests with a full block of prompt: their KV is pushed
    before = prompt_tokens_by_source(deployment.decode.url)
    for name, path, base in CASES:
        ref = request(deployment.colocated.url, path, _body(base, False), timeout=120)
        assert ref.status == 200 and ref.token_ids, f"colocated {name}: {ref.status} {ref.error}"
        for stream in (False, True):
            r = request(router.url, path, _body(base, stream), timeout=120)
            cid = f"{name}-{'stream' if stream else 'full'}"
            assert r.status == 200 and r.error is None, f"{cid} via vllm-router: {r.status} " \
                f"{r.error} {str(r.body)[:300]}"
            if r.token_ids != ref.token_ids:
                mismatches.append(f"{cid}: colocated {ref.token_ids} vs router {r.token_ids}")
            after = prompt_tokens_by_source(deployment.decode.url)
            ext = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
            seen = sum(after.values()) - sum(before.values())
            before = after
            n = ref.usage["prompt_tokens"]
            assert seen == n, f"{cid}: the decode server saw {seen} prompt tokens, not {n}"
            if ext < (n - 1) // BLOCK * BLOCK:
                not_loaded.append(f"{cid}: {n} prompt tokens, {ext} loaded remotely")
            pushable += n >= BLOCK
    assert not mismatches, "router output differs from colocated:\n" + "\n".join(mismatches)
    assert not not_loaded, "prompt KV not loaded through the connector:\n" + "\n".join(
        not_loaded)
    # The KV came by push: the router's legs are vLLM's in-tree contract
    # (transfer_id, no "push" key), which our producer offers both ways and
    # our consumer takes as push.  The connectors' own counters, from vLLM's
    # stats log lines (every 10 s).
    deadline = time.monotonic() + 30
    while True:
        pre = connector_log_stats(deployment.prefill.log_path, marks["prefill"])
        dec = connector_log_stats(deployment.decode.log_path, marks["decode"])
        if (pre.get("push_sends", 0) >= pushable and dec.get("push_loads", 0) >= pushable) or \
                time.monotonic() > deadline:
            break
        time.sleep(1)
    assert pre.get("push_sends", 0) == pushable and pre.get("push_bytes", 0) > 0, (pushable, pre)
    assert dec.get("push_loads", 0) == pushable and not dec.get("loads_failed"), (pushable, dec)
    assert not pre.get("push_failed"), pre
