"""Requests in flight together with one X-Request-Id, real vLLM servers (pytest -m e2e).

vLLM takes a request's X-Request-Id header into its own request id.  vLLM
0.32 adds a random part of its own (tests/test_e2e_serving.py's
test_concurrent_requests_sharing_one_x_request_id: the session servers),
but with VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1 a second request carrying
the id of a running one killed the engine (AssertionError: duplicate request
id, then EngineDeadError: 500s, later requests hung).  The proxy sends such
a request upstream as <id>-<8 hex> (proxy.py, _upstream_id).  Here: one
prefill and one decode server with that variable set, a proxy per flow.
The reference is the decode server itself, asked directly before any request
goes through a proxy (as tests/test_e2e_parallel.py: flow A's probe finds
nothing at the producer then, so decode computes the prompt; prefix caching
is off).
"""
import tempfile

import pytest

from mooncake_connector.deployment import proxy_stats
from mooncake_connector.openai_client import request
from mooncake_connector.serving import http_get
from test_e2e_serving import CASES, REQ_TIMEOUT, SHARED_ID_CASES, _body, one_id_batch

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def strict_ids(tiny_model_dir):
    """(deployment, {case id: reference answer}): vLLM servers that keep a
    request's id as given."""
    from e2e_fixtures import START_TIMEOUT_S
    from mooncake_connector.deployment import Deployment

    dep = Deployment(tempfile.mkdtemp(prefix="mc-e2e-ids-"), tiny_model_dir,
                     flows=("a", "b", "push"), colocated=False,
                     env={"VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1"})
    try:
        dep.start(timeout=START_TIMEOUT_S)
        print("\n" + dep.describe())
        cases = {cid: (path, base) for cid, path, base in CASES}
        refs = {}
        for cid in SHARED_ID_CASES:
            path, base = cases[cid]
            r = request(dep.decode.url, path, _body(dict(base, stream=False)), REQ_TIMEOUT)
            assert r.status == 200 and r.token_ids, (cid, r.status, r.error)
            refs[cid] = r
        yield dep, refs
    finally:
        dep.stop()


@pytest.mark.parametrize("flow", ["a", "b", "push"])
def test_one_id_in_flight_twice_keeps_vllm_up(strict_ids, flow):
    """Six different prompts at once with one X-Request-Id through the
    proxy: every answer is 200 and its own prompt's (token-identical to the
    decode server's), the proxy sent those that overlapped one in flight
    upstream with a suffixed id, and both servers still answer."""
    dep, refs = strict_ids
    url = dep.proxies[flow].url
    suffixed0 = proxy_stats(url).get("request_ids_suffixed", 0)
    one_id_batch(url, refs, f"one-id-for-all-{flow}")
    # Overlapping requests (vLLM's CPU servers take seconds for these):
    # at least one went with a suffix (the first in flight goes as it is).
    assert proxy_stats(url)["request_ids_suffixed"] - suffixed0 >= 1
    for side in (dep.prefill, dep.decode):
        assert http_get(side.url + "/health", timeout=10)[0] == 200, side.url
