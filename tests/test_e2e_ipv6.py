"""An IPv6 deployment (pytest -m e2e, real vLLM CPU servers): every server
listens on ::1 (vLLM's --host ::1, the proxies' --host ::1, the metadata
server at http://[::1]:port/metadata, the proxies' --prefill / --decode
http://[::1]:port), mooncake.json's prefill_url and decode_url are
"[::1]:port", as on a host or cluster that has only IPv6 addresses.  Before, the connector's start wrote its engine name from the
C parser's bare host ("::1:port", which the engine refuses) and no server
started: the workers' engine (connector/lifecycle._name), the producer's
consumer lookup (routes.consumer_base), the flow-a probe's engine and default
producer (probe._start) and a leg's remote_host (scheduler._source) each
built host:port without brackets; now hostport.join_hostport.

Checked through the proxy's flows a, b and push and the push proxy with
push_layer_load: every answer token-identical to the colocated server's, the
decode loaded each prompt's full blocks through the connector (its
vllm:prompt_tokens_by_source external_kv_transfer grew by them), both
sides' logs name their engine "[::1]:port", and the push proxies' table from
the prefill's bootstrap server (on its default address, now "::" taking IPv6
and IPv4 clients; was 0.0.0.0, which a push proxy given
--prefill-bootstrap http://[::1]:port could not reach) holds that name too.
"""
import json
import os

import pytest

from mooncake_connector.openai_client import request
from mooncake_connector.serving import http_get, url_of

from conftest import has_ipv6_loopback
from e2e_fixtures import start_deployment, tiny_model_dir  # noqa: F401

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

BLOCK = 32  # serving.BASE_VLLM_ARGS' --block-size
PROMPTS = ["an address with colons in it still names one engine " * 5,
           "every flow of the proxy over engines named in brackets " * 7]


def _body(prompt, stream):
    b = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
         "ignore_eos": True, "return_token_ids": True, "stream": stream}
    if stream:
        b["stream_options"] = {"include_usage": True}
    return b


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback (::1) here")
def test_ipv6_engine_addresses_serve_every_flow(tiny_model_dir):  # noqa: F811
    dep = start_deployment("mc-e2e-v6-", tiny_model_dir, host="::1")
    try:
        with open(os.path.join(dep.workdir, "mooncake.json")) as f:
            cfg = json.load(f)
        assert cfg["prefill_url"].startswith("[::1]:") and cfg["decode_url"].startswith("[::1]:")
        assert dep.metadata.url.startswith("http://[::1]:")
        assert all(p.url.startswith("http://[::1]:") for p in
                   [dep.prefill, dep.decode, dep.colocated, *dep.proxies.values()])
        refs = {}
        for p in PROMPTS:
            r = request(dep.colocated.url, "/v1/completions", _body(p, False), timeout=120)
            assert r.status == 200 and r.token_ids, r.error
            refs[p] = (r.token_ids, r.usage["prompt_tokens"])
        for name, proxy in dep.proxies.items():
            for i, p in enumerate(PROMPTS):
                stream = bool(i % 2)
                before = dep.external_kv_tokens()
                r = request(proxy.url, "/v1/completions", _body(p, stream), timeout=120)
                assert r.status == 200, (name, r.status, r.error)
                assert r.token_ids == refs[p][0], (name, stream, r.token_ids, refs[p][0])
                full = (refs[p][1] - 1) // BLOCK * BLOCK  # the last token is computed
                loaded = dep.external_kv_tokens() - before
                assert loaded >= full > 0, (name, p[:20], loaded, full)
        logs = {side: open(os.path.join(dep.logs, f"{side}.log"), errors="replace").read()
                for side in ("prefill", "decode")}
        for side, url in (("prefill", cfg["prefill_url"]), ("decode", cfg["decode_url"])):
            assert url in logs[side], f"{side}'s log does not name its engine {url}"
            assert "which the engine refuses" not in logs[side]
        # the push proxies find the prefill's engine by its bootstrap server
        code, body = http_get(url_of("::1", dep.bootstrap_port) + "/query", timeout=10)
        assert code == 200 and cfg["prefill_url"] in body, body
    finally:
        dep.stop()
