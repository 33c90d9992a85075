"""Drive vLLM's real scheduler and our worker-side connector in one process,
the way vLLM's engine core and model runner do, with a stand-in "forward"
that writes a deterministic KV pattern (a function of layer, token id and
position) into the request's blocks.  Two such sides (prefill and decode)
move real bytes between real engines.  No GPU, no model weights: the
scenarios of vLLM's GPU-free connector tests, ported to MooncakeConnector.
"""
import json
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,  # noqa: E402
                         SchedulerConfig, VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from mooncake_connector.connector.connector import MooncakeConnector  # noqa: E402

EOS = 2
LAYERS = 2
HEADS = 2
HEAD = 8


def tiny_model_dir(path):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                   "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": LAYERS,
                   "num_attention_heads": 4, "num_key_value_heads": HEADS, "vocab_size": 50000,
                   "max_position_embeddings": 4096, "torch_dtype": "float32",
                   "bos_token_id": 1, "eos_token_id": EOS}, f)
    return path


def make_config(model_dir, role, extra, block_size=16, module_path="mooncake_connector",
                max_batched=512):
    mc = ModelConfig(model=model_dir, dtype="float32", seed=0, skip_tokenizer_init=True,
                     max_model_len=2048)
    sc = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_batched,
                         max_model_len=2048, is_encoder_decoder=False)
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=False)
    kt = KVTransferConfig(kv_connector="MooncakeConnector", kv_connector_module_path=module_path,
                          kv_role=role, kv_connector_extra_config=dict(extra))
    return VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc,
                      kv_transfer_config=kt, device_config=DeviceConfig("cpu"))


def make_request(rid, tokens, max_tokens=1, params=None):
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sp.update_from_generation_config({}, EOS)
    req = Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=sp,
                  pooling_params=None, mm_features=None)
    req.kv_transfer_params = params
    return req


def kv_value(layer, token, pos):
    return float((layer * 1000003 + token * 7919 + pos * 31) % 100003)


class Side:
    """One vLLM instance: scheduler + one worker connector + a paged KV cache."""

    def __init__(self, model_dir, role, extra, num_blocks=64, block_size=16):
        self.cfg = make_config(model_dir, role, extra, block_size)
        self.block_size = block_size
        self.num_blocks = num_blocks
        kcc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec([f"layer{i}" for i in range(LAYERS)],
                             FullAttentionSpec(block_size=block_size, num_kv_heads=HEADS,
                                               head_size=HEAD, dtype=torch.float32))])
        self.cfg.cache_config.num_gpu_blocks = num_blocks
        self.sched = Scheduler(vllm_config=self.cfg, kv_cache_config=kcc, log_stats=True,
                               structured_output_manager=StructuredOutputManager(self.cfg),
                               block_size=block_size)
        self.worker = MooncakeConnector(self.cfg, KVConnectorRole.WORKER, kcc)
        # The CPU backend's layout: (num_blocks, kv_heads, block_size, 2 * head_size).
        self.kv = {f"layer{i}": torch.zeros(num_blocks, HEADS, block_size, 2 * HEAD)
                   for i in range(LAYERS)}
        self.worker.register_kv_caches(self.kv)
        self.computed = {}     # req_id -> tokens computed locally (by the stand-in forward)
        self.stats = []
        self.sent, self.recvd, self.invalid = set(), set(), set()
        self.last_params = {}  # req_id -> kv_transfer_params the engine returned
        self.before_load = None  # called with the SchedulerOutput before start_load_kv

    def add(self, req, settle=True):
        """Add a request.  A flow-A consumer's scheduler starts probing the
        producer now, on its own thread; with settle (the default) this waits
        for the answer, so the next step() decides as if it had been quick
        (tests of the not-yet-answered path pass settle=False)."""
        self.sched.add_request(req)
        if settle:
            self.settle_probe(req.request_id)

    def probe(self):
        conn = getattr(self.sched, "connector", None)
        side = getattr(conn, "_scheduler", None)
        return getattr(side, "_probe", None)

    def settle_probe(self, rid, timeout=10.0):
        import time
        probe = self.probe()
        end = time.monotonic() + timeout
        while probe is not None and probe.pending(rid):
            assert time.monotonic() < end, f"the probe for {rid} never answered"
            time.sleep(0.001)

    def block_ids(self, rid):
        return list(self.sched.kv_cache_manager.get_block_ids(rid)[0])

    def _forward(self, so):
        for rid, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            start = req.num_computed_tokens - n
            toks = req.all_token_ids[start:start + n]
            ids = self.block_ids(rid)
            for k, tok in enumerate(toks):
                pos = start + k
                b, j = ids[pos // self.block_size], pos % self.block_size
                for li, name in enumerate(self.kv):
                    self.kv[name][b, :, j, :] = kv_value(li, tok, pos)
            self.computed[rid] = self.computed.get(rid, 0) + n

    def step(self):
        so = self.sched.schedule()
        w = self.worker
        meta = so.kv_connector_metadata
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        if self.before_load is not None:
            self.before_load(so)
        w.start_load_kv(None)
        self._forward(so)
        w.wait_for_save()
        sending, recving = w.get_finished(so.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        stats = w.get_kv_connector_stats()
        w.clear_connector_metadata()
        if stats is not None:
            self.stats.append(stats)
        self.sent |= sending or set()
        self.recvd |= recving or set()
        self.invalid |= invalid
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = self.sched.requests[rid]
            sampled.append([7] if req.num_computed_tokens >= req.num_tokens else [])
        out = KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                invalid_block_ids=invalid, kv_connector_stats=stats)
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled, kv_connector_output=out)
        res = self.sched.update_from_output(so, mro)
        for eco in (res or {}).values():
            for o in getattr(eco, "outputs", None) or ():
                if getattr(o, "kv_transfer_params", None):
                    self.last_params[o.request_id] = o.kv_transfer_params
        return so

    def run_until(self, cond, steps=2000, sleep=0.002):
        import time
        for _ in range(steps):
            if cond():
                return True
            self.step()
            time.sleep(sleep)
        return cond()

    def block_matches_pattern(self, rid, tokens, nblocks):
        ids = self.block_ids(rid)
        for pos in range(nblocks * self.block_size):
            b, j = ids[pos // self.block_size], pos % self.block_size
            for li, name in enumerate(self.kv):
                if float(self.kv[name][b, 0, j, 0]) != kv_value(li, tokens[pos], pos):
                    return False
        return True

    def is_empty(self):
        s = self.sched
        pool = s.kv_cache_manager.block_pool
        return (not s.requests and not s.running and len(s.waiting) == 0 and
                pool.get_num_free_blocks() == pool.num_gpu_blocks - 1)

    def close(self):
        self.worker.shutdown()
        conn = getattr(self.sched, "connector", None)
        if conn is not None:
            conn.shutdown()  # the scheduler side's probe engine


def status(side, rid):
    r = side.sched.requests.get(rid)
    return None if r is None else r.status


__all__ = ["Side", "make_request", "tiny_model_dir", "status", "RequestStatus", "kv_value"]
