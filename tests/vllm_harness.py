"""Drive vLLM's real scheduler and our worker-side connector in one process,
the way vLLM's engine core and model runner do, with a stand-in "forward"
that writes a deterministic KV pattern (a function of layer, token id and
position) into the request's blocks.  Two such sides (prefill and decode)
move real bytes between real engines.  No GPU, no model weights: the
scenarios of vLLM's GPU-free connector tests, ported to MooncakeConnector.
"""
import json
import os
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,  # noqa: E402
                         SchedulerConfig, VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec, SlidingWindowSpec)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from mooncake_connector.connector.connector import MooncakeConnector  # noqa: E402

# vLLM >= 0.34's CPU platform refuses a VllmConfig on x86 without triton-cpu
# (its CPU model runner needs it).  No model runner runs here (the stand-in
# forward below), and the .venv's torch has no triton-cpu: the scheduler and
# connector code under test do not use it, so that one platform check is
# told it is present (scripts/vllm_next.sh, vLLM 0.34.0 overlay).
try:
    import vllm.triton_utils as _triton_utils  # noqa: E402
    if not getattr(_triton_utils, "HAS_TRITON", True):
        from vllm.platforms.cpu import CpuPlatform  # noqa: E402
        import inspect as _inspect  # noqa: E402
        if "requires Triton" in _inspect.getsource(CpuPlatform.check_and_update_config):
            _triton_utils.HAS_TRITON = True
except (ImportError, OSError, TypeError):
    pass

# vLLM >= 0.34's ModelRunnerOutput dropped req_id_to_index (req_ids' order).
_MRO_NO_INDEX = "req_id_to_index" not in getattr(ModelRunnerOutput, "__dataclass_fields__",
                                                 {"req_id_to_index": None})

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
                max_batched=512, prefix_caching=False, long_prefill=0):
    mc = ModelConfig(model=model_dir, dtype="float32", seed=0, skip_tokenizer_init=True,
                     max_model_len=2048)
    sc = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_batched,
                         max_model_len=2048, is_encoder_decoder=False,
                         long_prefill_token_threshold=long_prefill)
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching)
    kt = KVTransferConfig(kv_connector="MooncakeConnector", kv_connector_module_path=module_path,
                          kv_role=role, kv_connector_extra_config=dict(extra))
    return VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc,
                      kv_transfer_config=kt, device_config=DeviceConfig("cpu"))


def make_request(rid, tokens, max_tokens=1, params=None, block_hasher=None):
    """block_hasher: a prefix-caching side's (Side.block_hasher): the
    request's block hashes, as vLLM's engine core gives every request."""
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sp.update_from_generation_config({}, EOS)
    req = Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=sp,
                  pooling_params=None, mm_features=None, block_hasher=block_hasher)
    req.kv_transfer_params = params
    return req


def kv_value(layer, token, pos, head=0):
    """head: the global KV head (a TP rank holds a share of them)."""
    return float((layer * 1000003 + token * 7919 + pos * 31) % 100003) + head * 0.25


def rank_heads(rank, tp, total=HEADS):
    """vLLM's sharding: contiguous shares, or one replicated head per rank."""
    if total >= tp:
        return list(range(rank * total // tp, (rank + 1) * total // tp))
    return [rank // (tp // total)]


class Side:
    """One vLLM instance: scheduler + one worker connector + a paged KV cache."""

    def __init__(self, model_dir, role, extra, num_blocks=64, block_size=16, tp=1,
                 sliding_window=None, pp=1, prefix_caching=False, max_batched=512,
                 long_prefill=0, cudagraph_mode=None, async_scheduling=False,
                 pipelined=False, v2_runner_on=None):
        """sliding_window: layer 1 is a sliding-window layer in its own
        KV-cache group (vLLM's hybrid KV-cache manager, SupportsHMA).
        pp: pipeline stages; stage s holds layer s (LAYERS == 2).
        prefix_caching: vLLM's prefix cache on (as a server has it by default).
        max_batched: max_num_batched_tokens (small: prompts computed in chunks).
        long_prefill: long_prefill_token_threshold (a prefill's chunk cap).
        cudagraph_mode: vLLM's CUDAGraphMode as a CUDA server's config has it
        (no --enforce-eager) when its connector starts; the stand-in forward
        is the same (the tests say which step a FULL replay would be).
        async_scheduling: vLLM's asynchronous scheduling on in the config the
        connector starts with, as on a GPU server (vLLM's CPU backend turns
        it off); the stand-in steps stay synchronous unless pipelined.
        pipelined (with async_scheduling): step() runs one iteration of
        vLLM's EngineCore.step_with_batch_queue with its two-deep batch
        queue and vLLM's AsyncScheduler, as a one-GPU server (UniProcExecutor)
        under async scheduling: schedule step k, run its worker hooks (the
        executor runs them inline), then hand the scheduler the output of
        step k-1 -- not k's; an output with nothing in it reaches the
        scheduler as vLLM's model runners give it (no KVConnectorOutput,
        ModelRunnerOutput.with_kv_conn_output_only).
        v2_runner_on: a device ("cuda", "cpu"): the config a server on that
        device starts its connector with where vLLM runs its V2 model runner
        (VLLM_USE_V2_MODEL_RUNNER=1 while the scheduler and the connectors
        are made; the stand-in forward is the same)."""
        self.cfg = make_config(model_dir, role, extra, block_size,
                               prefix_caching=prefix_caching, max_batched=max_batched,
                               long_prefill=long_prefill)
        if cudagraph_mode is not None:
            self.cfg.compilation_config.cudagraph_mode = cudagraph_mode
            self.cfg.model_config.enforce_eager = False
        if async_scheduling:
            self.cfg.scheduler_config.async_scheduling = True
        v2_env = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
        if v2_runner_on:
            self.cfg.device_config.device_type = v2_runner_on
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        try:
            self._make(model_dir, role, num_blocks, block_size, tp, pp, sliding_window,
                       prefix_caching, pipelined, async_scheduling)
        finally:
            if v2_runner_on:
                if v2_env is None:
                    os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
                else:
                    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = v2_env

    def _make(self, model_dir, role, num_blocks, block_size, tp, pp, sliding_window,
              prefix_caching, pipelined, async_scheduling):
        self.cfg.parallel_config.tensor_parallel_size = tp
        self.cfg.parallel_config.pipeline_parallel_size = pp
        self.tp = tp * pp  # workers that must all report a request finished
        self.block_hasher = None  # prefix caching: pass to make_request (block hashes)
        if prefix_caching:
            from vllm.utils.hashing import get_hash_fn_by_name
            from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
            fn = get_hash_fn_by_name(self.cfg.cache_config.prefix_caching_hash_algo)
            init_none_hash(fn)
            self.block_hasher = get_request_block_hasher(block_size, fn)
        self.block_size = block_size
        self.num_blocks = num_blocks
        spec = dict(block_size=block_size, num_kv_heads=HEADS, head_size=HEAD,
                    dtype=torch.float32)
        if sliding_window:
            groups = [KVCacheGroupSpec(["layer0"], FullAttentionSpec(**spec)),
                      KVCacheGroupSpec(["layer1"], SlidingWindowSpec(
                          **spec, sliding_window=sliding_window))]
        else:
            groups = [KVCacheGroupSpec([f"layer{i}" for i in range(LAYERS)],
                                       FullAttentionSpec(**spec))]
        self.layer_group = {n: gi for gi, g in enumerate(groups) for n in g.layer_names}
        kcc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        self.cfg.cache_config.num_gpu_blocks = num_blocks
        assert not pipelined or async_scheduling, "pipelined is vLLM's async scheduling"
        self.pipelined = pipelined
        self._queue = []  # pipelined: (SchedulerOutput, ModelRunnerOutput), oldest first
        sched_cls = Scheduler
        if pipelined:
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler
            sched_cls = AsyncScheduler
        self.sched = sched_cls(vllm_config=self.cfg, kv_cache_config=kcc, log_stats=True,
                               structured_output_manager=StructuredOutputManager(self.cfg),
                               block_size=block_size)
        # One worker connector per TP rank, each with its share of the KV heads
        # in the CPU backend's layout (num_blocks, kv_heads, block_size, 2 * head_size).
        from mooncake_connector.connector import connector as conn_mod
        self.workers, self.kvs, self.heads = [], [], []
        orig = conn_mod._tp, conn_mod._pp
        try:
            for st in range(pp):
                for r in range(tp):
                    conn_mod._tp = lambda _cfg, r=r: (r, tp)
                    conn_mod._pp = lambda _cfg, st=st: (st, pp)
                    self.workers.append(MooncakeConnector(self.cfg, KVConnectorRole.WORKER,
                                                          kcc))
                    self.heads.append(rank_heads(r, tp))
                    layers = range(LAYERS) if pp == 1 else [st]
                    self.kvs.append({f"layer{i}": torch.zeros(num_blocks, len(self.heads[-1]),
                                                              block_size, 2 * HEAD)
                                     for i in layers})
        finally:
            conn_mod._tp, conn_mod._pp = orig
        for w, kv in zip(self.workers, self.kvs):
            w.register_kv_caches(kv)
        self.worker, self.kv = self.workers[0], self.kvs[0]
        self._fin = {}  # (kind, req_id) -> TP ranks that reported it (vLLM aggregates)
        self.computed = {}     # req_id -> tokens computed locally (by the stand-in forward)
        self.stats = []
        self.sched_stats = []  # kv_connector_stats in the scheduler's stats (both halves)
        self.sent, self.recvd, self.invalid = set(), set(), set()
        self.last_params = {}  # req_id -> kv_transfer_params the engine returned
        self.finish_reasons = {}  # req_id -> vLLM FinishReason of its last output
        self.before_load = None  # called with the SchedulerOutput before start_load_kv

    def add(self, req, settle=True):
        """Add a request.  A flow-A consumer's scheduler starts probing the
        producer now, on its own thread; with settle (the default) this waits
        for the answer, so the next step() decides as if it had been quick
        (tests of the not-yet-answered path pass settle=False)."""
        assert self.block_hasher is None or req.block_hashes or \
            len(req.prompt_token_ids) < self.block_size, \
            "a prefix-caching side needs make_request(..., block_hasher=side.block_hasher)"
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

    def block_ids(self, rid, group=0):
        return list(self.sched.kv_cache_manager.get_block_ids(rid)[group])

    def _slots(self, gids, pos):
        """(slot of position pos's KV, layer index, head) for every head of
        every rank's every layer, the null block (outside a sliding window)
        left out; gids: the request's block ids per KV cache group."""
        j = pos % self.block_size
        for kv, heads in zip(self.kvs, self.heads):
            for name in kv:
                b = gids[self.layer_group[name]][pos // self.block_size]
                if b == 0:
                    continue
                li = int(name[len("layer"):])
                for hi, h in enumerate(heads):
                    yield kv[name][b, hi, j], li, h

    def _forward(self, so):
        for rid, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            start = req.num_computed_tokens - n
            toks = req.all_token_ids[start:start + n]
            gids = self.sched.kv_cache_manager.get_block_ids(rid)
            for k, tok in enumerate(toks):
                for x, li, h in self._slots(gids, start + k):
                    x[:] = kv_value(li, tok, start + k, h)
            self.computed[rid] = self.computed.get(rid, 0) + n

    def _all_ranks(self, kind, got):
        """vLLM reports a request finished once every TP rank has."""
        out = set()
        for rid in got or ():
            seen = self._fin.setdefault((kind, rid), set())
            seen.add(len(seen))
            if len(seen) == self.tp:
                out.add(rid)
                del self._fin[(kind, rid)]
        return out or None

    def step(self):
        if self.pipelined:
            return self._step_with_batch_queue()
        so = self.sched.schedule()
        self._update(so, self._execute(so))
        return so

    def _step_with_batch_queue(self):
        """One iteration of vLLM's EngineCore.step_with_batch_queue (batch
        queue size 2, async scheduling, V1 model runner): returns the step it
        scheduled (None if none)."""
        so = None
        if self.sched.has_requests():
            so = self.sched.schedule()
            mro = self._execute(so)
            self._queue.append((so, mro))
            if len(self._queue) < 2 and (so.total_num_scheduled_tokens > 0
                                         or self.sched.has_requests()):
                return so  # the queue is not full: no output is taken yet
        elif not self._queue:
            return None
        self._update(*self._queue.pop(0))
        return so

    def _execute(self, so):
        """The worker's part of a step (the executor's execute_model and
        sample_tokens): the connector's hooks around the stand-in forward;
        returns the ModelRunnerOutput."""
        meta = so.kv_connector_metadata
        for w in self.workers:
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
        if self.before_load is not None:
            self.before_load(so)
        for w in self.workers:
            w.start_load_kv(None)
        self._forward(so)
        sending, recving, invalid, stats, wmeta = set(), set(), set(), None, None
        for w in self.workers:
            w.wait_for_save()
            s_, r_ = w.get_finished(so.finished_req_ids)
            sending |= self._all_ranks("send", s_) or set()
            recving |= self._all_ranks("recv", r_) or set()
            invalid |= w.get_block_ids_with_load_errors()
            st = w.get_kv_connector_stats()
            if st is not None:
                stats = st if stats is None else stats.aggregate(st)
            wm = w.build_connector_worker_meta()  # as vLLM's model runner, after get_finished
            if wm is not None:
                wmeta = wm if wmeta is None else wmeta.aggregate(wm)
            w.clear_connector_metadata()
        sending, recving = sending or None, recving or None
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
        extra_out = {"kv_connector_worker_meta": wmeta} if wmeta is not None else {}
        out = KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                invalid_block_ids=invalid, kv_connector_stats=stats,
                                **extra_out)
        extra = {} if _MRO_NO_INDEX else {"req_id_to_index": {r: i for i, r in enumerate(ids)}}
        if self.pipelined and not ids and out.is_empty():
            out = None  # vLLM's runners: nothing scheduled, nothing to tell
        return ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, kv_connector_output=out,
                                 **extra)

    def _update(self, so, mro):
        """vLLM's scheduler takes a step's output (update_from_output)."""
        res = self.sched.update_from_output(so, mro)
        for eco in (res or {}).values():
            ss = getattr(eco, "scheduler_stats", None)
            if ss is not None and ss.kv_connector_stats:
                self.sched_stats.append(ss.kv_connector_stats)
            for o in getattr(eco, "outputs", None) or ():
                if getattr(o, "kv_transfer_params", None):
                    self.last_params[o.request_id] = o.kv_transfer_params
                if getattr(o, "finish_reason", None) is not None:
                    self.finish_reasons[o.request_id] = o.finish_reason

    def run_until(self, cond, steps=2000, sleep=0.002):
        import time
        for _ in range(steps):
            if cond():
                return True
            self.step()
            time.sleep(sleep)
        return cond()

    def block_matches_pattern(self, rid, tokens, nblocks):
        """Every block the request holds (null ones of a sliding window
        excepted) has the KV of its tokens, for every head of every rank."""
        gids = self.sched.kv_cache_manager.get_block_ids(rid)
        for pos in range(nblocks * self.block_size):
            for x, li, h in self._slots(gids, pos):
                if float(x.min()) != float(x.max()) or \
                        float(x[0]) != kv_value(li, tokens[pos], pos, h):
                    return False
        return True

    def is_empty(self):
        s = self.sched
        pool = s.kv_cache_manager.block_pool
        return (not s.requests and not s.running and len(s.waiting) == 0 and
                pool.get_num_free_blocks() == pool.num_gpu_blocks - 1)

    def close(self):
        for w in self.workers:
            w.shutdown()
        conn = getattr(self.sched, "connector", None)
        if conn is not None:
            conn.shutdown()  # the scheduler side's probe engine


def status(side, rid):
    r = side.sched.requests.get(rid)
    return None if r is None else r.status


def recomputes(side):
    """{reason: n} counted by both halves of the connector, as vLLM saw them."""
    out = {}
    for data in side.sched_stats:
        for k, v in data.items():
            if k.startswith("recompute_") and v:
                out[k[len("recompute_"):]] = out.get(k[len("recompute_"):], 0) + v
    return out


def counters(side):
    """A side's connector counters (the workers' int stats) summed over its
    steps."""
    out = {}
    for st in side.stats:
        for k, v in st.data.items():
            if isinstance(v, int):
                out[k] = out.get(k, 0) + v
    return out


def frees_at_once(side, limit_s=1.0):
    """The producer side gives every held block back within limit_s (not at
    hold_timeout_s): stepped until it holds none (5 s at most)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < max(5.0, limit_s) and not side.is_empty():
        side.step()
        time.sleep(0.001)
    return side.is_empty() and time.monotonic() - t0 < limit_s


__all__ = ["Side", "counters", "recomputes", "make_request", "tiny_model_dir", "status",
           "RequestStatus", "kv_value", "frees_at_once"]
