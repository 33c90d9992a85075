"""MooncakeConnector: the class vLLM instantiates (once with role SCHEDULER in
the engine-core process, once with role WORKER in every worker).  It checks
the configuration, then delegates to scheduler.SchedulerSide or
worker.WorkerSide.

    --kv-transfer-config '{"kv_connector":"MooncakeConnector",
                           "kv_connector_module_path":"mooncake_connector",
                           "kv_role":"kv_producer"}'
with MOONCAKE_CONFIG_PATH=/path/to/mooncake.json.  With this package
installed, the module path may be left out (see plugin.py).
"""
import logging
import sys

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorRole)

try:  # hybrid KV-cache groups (full attention + sliding window, ...)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # a vLLM without HMA: a plain mixin
    class SupportsHMA:  # type: ignore[no-redef]
        pass

from mooncake_connector import hook_times
from mooncake_connector.connector import settings as settings_mod
from mooncake_connector.connector.metadata import MooncakeConnectorMetadata
from mooncake_connector.connector.stats import MooncakeKVConnectorStats

logger = logging.getLogger("vllm.mooncake_connector")
_logged = set()


def _log_once(key, msg, *args):
    if key not in _logged:
        _logged.add(key)
        logger.info(msg, *args)


def _parallel(vllm_config, size_attr, rank_of):
    """(rank, size) of this worker along one parallel dimension: the size
    from parallel_config.<size_attr>, the rank from rank_of() (0 where vLLM's
    groups are not initialized: the scheduler process)."""
    pc = getattr(vllm_config, "parallel_config", None)
    size = getattr(pc, size_attr, 1) or 1
    rank = 0
    if size > 1:
        try:
            rank = rank_of()
        except Exception:  # not initialized (scheduler process)
            rank = 0
    return rank, size


def _tp(vllm_config):
    """(tensor-parallel rank, size) of this worker."""
    def rank_of():
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        return get_tensor_model_parallel_rank()
    return _parallel(vllm_config, "tensor_parallel_size", rank_of)


def _early_key(vllm_config):
    """early.py: the key under which this instance's worker and scheduler
    side meet in one process, or None where a load's end cannot be told
    early (more than one worker: vLLM aggregates their reports)."""
    pc = getattr(vllm_config, "parallel_config", None)
    for attr in ("tensor_parallel_size", "pipeline_parallel_size",
                 "decode_context_parallel_size", "prefill_context_parallel_size"):
        n = getattr(pc, attr, 1)
        if isinstance(n, int) and n > 1:
            return None
    ws = getattr(pc, "world_size", 1)
    if isinstance(ws, int) and ws > 1:
        return None
    eid = getattr(getattr(vllm_config, "kv_transfer_config", None), "engine_id", None)
    if not isinstance(eid, str) or not eid:
        return None
    return eid, _dp(vllm_config)


def layer_groups(kv_cache_config):
    """{layer name: KV-cache group index} ({} with no config: one group)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return {name: gi for gi, g in enumerate(groups) for name in g.layer_names}


def model_facts(vllm_config, kv_cache_config=None):
    """What the fingerprint (peer_record) says about the model and the
    parallel setup; missing pieces are None (checked only when both know)."""
    mc = getattr(vllm_config, "model_config", None)
    pc = getattr(vllm_config, "parallel_config", None)
    cc = getattr(vllm_config, "cache_config", None)
    facts = {"pp_size": getattr(pc, "pipeline_parallel_size", 1) or 1}
    try:
        from importlib.metadata import version
        facts["connector"] = version("mooncake-connector")
    except Exception:  # noqa: BLE001 - not installed as a distribution (source tree)
        facts["connector"] = None
    if mc is None:
        return facts
    for key, fn in (("kv_heads", lambda: mc.get_total_num_kv_heads()),
                    ("head_size", lambda: mc.get_head_size()),
                    ("mla", lambda: bool(mc.use_mla)),
                    ("model", lambda: str(mc.model))):
        try:
            facts[key] = fn()
        except Exception:  # noqa: BLE001 - a config without it
            facts[key] = None
    kcc = kv_cache_config
    if kcc is not None:  # the KV-cache groups: kind, layers, window
        facts["groups"] = [[type(g.kv_cache_spec).__name__, len(g.layer_names),
                            getattr(g.kv_cache_spec, "sliding_window", None)]
                           for g in getattr(kcc, "kv_cache_groups", None) or ()] or None
    cache_dtype = getattr(cc, "cache_dtype", "auto") or "auto"
    facts["kv_dtype"] = str(getattr(mc, "dtype", "")) if cache_dtype == "auto" else \
        str(cache_dtype)
    return facts


def _check_groups(kv_cache_config):
    """Attention KV-cache groups only (full, sliding window, MLA, ...): an
    SSM group's state is not paged by token blocks, so it cannot be looked
    up by a prompt's token hashes."""
    try:
        from vllm.v1.kv_cache_interface import AttentionSpec
    except ImportError:
        return
    for gi, g in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or ()):
        if not isinstance(g.kv_cache_spec, AttentionSpec):
            raise settings_mod.SettingsError(
                f"KV-cache group {gi} ({type(g.kv_cache_spec).__name__}, layers "
                f"{list(g.layer_names)[:3]}...) is not attention KV: MooncakeConnector moves "
                "paged attention KV by token blocks and cannot move SSM state; serve this "
                "hybrid attention/SSM model without a KV connector")


def _pp(vllm_config):
    """(pipeline-parallel rank, size) of this worker."""
    def rank_of():
        from vllm.distributed.parallel_state import get_pp_group
        return get_pp_group().rank_in_group
    return _parallel(vllm_config, "pipeline_parallel_size", rank_of)


def _dp(vllm_config):
    """This engine's global data-parallel rank (the bootstrap server's key).
    vLLM runs a dense model's DP engines as independent DP=1 engines
    (data_parallel_rank 0) but keeps the rank in data_parallel_index."""
    pc = getattr(vllm_config, "parallel_config", None)
    rank = getattr(pc, "data_parallel_index", None)
    if not isinstance(rank, int) or rank < 0:
        rank = getattr(pc, "data_parallel_rank", 0)
    return rank if isinstance(rank, int) and rank >= 0 else 0


def dp_local(vllm_config):
    """This engine's index among the data-parallel engines one vLLM server
    starts (vLLM's data_parallel_rank_local: 0..--data-parallel-size-local - 1);
    0 without data parallelism, and 0 in external load-balancing mode
    (--data-parallel-rank: each server one engine with its own config).  The
    engine's names move by this index times tp_size * pp_size
    (settings.dp_base)."""
    pc = getattr(vllm_config, "parallel_config", None)
    idx = getattr(pc, "data_parallel_rank_local", None)
    return idx if isinstance(idx, int) and idx > 0 else 0


def dp_count(vllm_config):
    """The data-parallel engines this server starts, where vLLM still says
    (data_parallel_size_local: MoE models); 1 where it does not (a dense
    model's engines are reset to DP 1 each): then the bootstrap server names
    its own engine only."""
    pc = getattr(vllm_config, "parallel_config", None)
    size, local = (getattr(pc, "data_parallel_size", 1), getattr(pc, "data_parallel_size_local", 1))
    if isinstance(size, int) and isinstance(local, int) and size > 1 and local > 1:
        return min(size, local)
    return 1


def _dp_size(vllm_config):
    """More than 1 where this engine may have data-parallel siblings behind
    the same API server (vLLM's internal or hybrid load balancing).  vLLM
    resets a dense model's engines to data_parallel_size 1
    (reconfigure_for_independent_dp_rank; data_parallel_rank_local is 0
    without data parallelism too), but keeps the global rank in
    data_parallel_index and names the engine's process EngineCore_DP<rank>."""
    pc = getattr(vllm_config, "parallel_config", None)
    if getattr(pc, "data_parallel_external_lb", False) is True:
        return 1  # one engine per server: the server's forget reaches its leg's engine
    size = getattr(pc, "data_parallel_size", 1)
    size = size if isinstance(size, int) and size > 0 else 1
    local = getattr(pc, "data_parallel_size_local", 1)
    if size > 1:
        return max(min(size, local) if isinstance(local, int) and local >= 1 else size, 1)
    index = getattr(pc, "data_parallel_index", 0)
    if isinstance(index, int) and index > 0:
        return 2  # a dense model's DP engine: the sibling count is gone, more than one
    import multiprocessing
    if multiprocessing.current_process().name.startswith("EngineCore_DP"):
        return 2  # engine 0 of a dense model's DP server
    return 1


def async_scheduling_on(vllm_config):
    """Whether vLLM schedules this instance's steps asynchronously (the next
    step scheduled before this one's output is back: vLLM >= 0.2x's default on
    GPUs; its CPU backend turns it off).  vLLM cannot recover a failed
    in-step load then: its scheduler truncates the request's computed tokens
    while the next step, already scheduled, still counts them, and the
    engine dies (seen on an H100: a device-side assert in the gather of the
    next step; vLLM issue #34484).  So such a consumer loads in the background
    only (scheduler.py)."""
    sc = getattr(vllm_config, "scheduler_config", None)
    return getattr(sc, "async_scheduling", False) is True


def stale_recompute_runner(vllm_config):
    """Where vLLM recomputes a failed in-step load wrongly: its V2 model
    runner on a GPU (vLLM 0.2x's default for most models on a GPU, 0.34's
    only one), or None.  After an in-step load fails, vLLM's scheduler
    truncates the request's computed tokens to its first failed block; the
    V2 runner writes that count into its CPU mirror only, while the copy on
    the GPU -- from which the next step gathers the recompute's tokens and
    positions -- keeps the count the failed step advanced it to.  The
    recompute then runs the wrong tokens at the wrong positions and the
    request's answer is wrong (vLLM issue #49250, read in vLLM 0.26's and
    0.34's gpu/model_runner.py update_requests; fixes proposed in PRs #49252
    and #53298, neither in 0.34).  vLLM's V1 runner sends the count with every step and its CPU
    backend's V2 runner keeps both in one memory: they recompute correctly.
    The answer names what runs here, for the log."""
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    if device is None:
        try:
            from vllm.platforms import current_platform
            device = current_platform.device_type
        except Exception:  # noqa: BLE001  no platform: nothing runs a GPU runner here
            device = None
    if not device or str(device) == "cpu" or not _v2_model_runner(vllm_config):
        return None
    return f"vLLM's V2 model runner on {device}"


def _v2_model_runner(vllm_config):
    """Whether vLLM runs its V2 model runner: the config's own answer where
    vLLM has both runners (0.2x-0.33: the property use_v2_model_runner),
    else whether only the V2 runner's module is there (0.34 removed V1)."""
    try:
        v2 = vllm_config.use_v2_model_runner
    except AttributeError:
        v2 = None
    except Exception:  # noqa: BLE001  the property refused its own config: say V2 (the safe side)
        return True
    if isinstance(v2, bool):
        return v2
    import importlib.util
    try:
        return (importlib.util.find_spec("vllm.v1.worker.gpu.model_runner") is not None
                and importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is None)
    except (ImportError, ValueError):
        return False


def cudagraph_facts(vllm_config):
    """How vLLM will run this instance's forwards, as far as the connector's
    per-layer hooks care (docs/connector.md, "CUDA graphs"): (mixed batches
    replay FULL graphs, uniform decode batches replay FULL graphs, the
    uniform decode query length).  A FULL replay runs no Python, so
    wait_for_layer_load / save_kv_layer are not called in it.  --enforce-eager,
    the CPU backend, PIECEWISE or a vLLM without cudagraph_mode: (False, False, 1)."""
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    if mode is None or getattr(getattr(vllm_config, "model_config", None), "enforce_eager",
                               False):
        return False, False, 1
    try:
        full = type(mode).FULL
        mixed, decode = mode.mixed_mode() == full, mode.decode_mode() == full
    except (AttributeError, TypeError, ValueError):
        return False, False, 1
    spec = getattr(vllm_config, "speculative_config", None)
    n = getattr(spec, "num_speculative_tokens", None)
    return mixed, decode, 1 + (n if isinstance(n, int) and n > 0 else 0)


from mooncake_connector.connector import access as access_mod  # noqa: E402
from mooncake_connector.connector.access import kv_cache_access_for  # noqa: E402,F401


def declared_kv_cache_access(mode="auto"):
    """(flags, reason) on this host's vLLM, or (None, reason) where vLLM has no
    KVCacheAccess (< 0.34).  For doctor and kv_cache_access(); mode is
    kv_connector_extra_config's "kv_cache_access"."""
    try:
        from vllm.config.kv_transfer import KVCacheAccess
    except ImportError:
        return None, "this vLLM has no KVCacheAccess (< 0.34): it allocates classically"
    try:
        from vllm.platforms import current_platform
        is_cuda = bool(current_platform.is_cuda())
    except Exception:  # noqa: BLE001  platform detection failing means not CUDA here
        is_cuda = False
    return access_mod.kv_cache_access_for(KVCacheAccess, is_cuda, mode)


class MooncakeConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        except TypeError:  # a vLLM whose base takes (vllm_config, role)
            super().__init__(vllm_config, role)
            self._kv_cache_config = kv_cache_config
        ktc = vllm_config.kv_transfer_config
        self.settings = settings_mod.resolve(ktc)
        s = self.settings
        # Failed loads fall back to local compute unless asked otherwise.
        if getattr(ktc, "kv_load_failure_policy", None) is not None:
            ktc.kv_load_failure_policy = s.load_failure_policy
        self.block_size = vllm_config.cache_config.block_size
        self.tp_rank, self.tp_size = _tp(vllm_config)
        _log_once(("cfg", role), "MooncakeConnector (%s, %s): effective config %s",
                  s.role, "scheduler" if role == KVConnectorRole.SCHEDULER else "worker",
                  s.summary())
        self._scheduler = self._worker = None
        self._kv_cache_manager_unbound = role == KVConnectorRole.SCHEDULER
        _check_groups(kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            from mooncake_connector.connector.scheduler import SchedulerSide, bytes_per_block
            probe = None
            if s.role == "kv_consumer" and s.flow_a:
                from mooncake_connector.connector.probe import ProducerProbe
                probe = ProducerProbe(s)
                # Its engine and the first contact with prefill_url start now,
                # in the background, before any request needs an answer.
                probe.warm()
            early = None
            key = _early_key(vllm_config) if s.early_recv else None
            if key is not None and s.is_consumer and async_scheduling_on(vllm_config):
                from mooncake_connector.connector.early import SchedulerEarly
                early = SchedulerEarly(key)
            self._scheduler = SchedulerSide(s, self.block_size, self.tp_size,
                                            lambda: getattr(self, "_kv_cache_manager", None),
                                            block_bytes=bytes_per_block(kv_cache_config),
                                            probe=probe,
                                            groups=len(getattr(kv_cache_config,
                                                               "kv_cache_groups", None) or [0]),
                                            graphs=cudagraph_facts(vllm_config),
                                            async_scheduling=async_scheduling_on(vllm_config),
                                            stale_recompute=stale_recompute_runner(vllm_config)
                                            if s.is_consumer
                                            and s.load_failure_policy == "recompute" else None,
                                            early=early, dp_size=_dp_size(vllm_config),
                                            dp_local=dp_local(vllm_config),
                                            pp_size=_pp(vllm_config)[1])
        else:
            from mooncake_connector.connector.worker import WorkerSide
            nb = getattr(kv_cache_config, "num_blocks", None) if kv_cache_config else None
            self._worker = WorkerSide(s, self.block_size, self.tp_rank, self.tp_size, nb,
                                      facts=model_facts(vllm_config, kv_cache_config),
                                      layer_groups=layer_groups(kv_cache_config),
                                      pp_rank=_pp(vllm_config)[0], dp_rank=_dp(vllm_config),
                                      dp_local=dp_local(vllm_config),
                                      dp_count=dp_count(vllm_config),
                                      early_key=_early_key(vllm_config) if s.early_recv
                                      else None,
                                      async_scheduling=async_scheduling_on(vllm_config))
        if hook_times.ON:  # MC_HOOK_TIMES: every hook timed (issue 31)
            hook_times.install(self, "scheduler" if self._scheduler is not None else "worker",
                               s.role)

    # ---------------- scheduler side ----------------

    def on_new_request(self, request):
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if self._kv_cache_manager_unbound:
            self._bind_callers_kv_cache_manager(hook_times.caller(sys._getframe(1)))
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def _bind_callers_kv_cache_manager(self, frame):
        """vLLM before bind_kv_cache_manager (0.26): the scheduler calling us
        holds the KV-cache manager the scheduler side needs (the prefix-cache
        eviction of a failed in-step load, SchedulerSide.on_load_errors, and
        the requests' block ids).  Taken from the caller, once: only an
        object with the manager's own methods is accepted; without one the
        scheduler side keeps its fallbacks and says so."""
        self._kv_cache_manager_unbound = False
        if getattr(self, "_kv_cache_manager", None) is not None:
            return
        kvm = getattr(frame.f_locals.get("self"), "kv_cache_manager", None)
        if callable(getattr(kvm, "evict_blocks", None)) and callable(
                getattr(kvm, "get_block_ids", None)):
            self._kv_cache_manager = kvm
            _log_once("kvm_from_caller", "MooncakeConnector: this vLLM does not bind the KV-cache "
                      "manager to connectors; using its scheduler's (%s)", type(kvm).__name__)
        else:
            logger.warning("MooncakeConnector: this vLLM gives the connector no KV-cache manager "
                           "(no bind_kv_cache_manager, none on the scheduler calling it): a "
                           "failed in-step load's blocks cannot be taken out of the prefix "
                           "cache; use a vLLM whose connectors have bind_kv_cache_manager, or "
                           "turn prefix caching off on the decode (--no-enable-prefix-caching)")

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        if self._kv_cache_manager_unbound:
            self._bind_callers_kv_cache_manager(hook_times.caller(sys._getframe(1)))
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids):
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output):
        """The workers' step output: a failed load's blocks leave vLLM's
        prefix cache (SchedulerSide.on_load_errors); blocks a same-host
        producer may still copy into are held or let go (holds.py; before
        vLLM frees this step's finished loads)."""
        if self._scheduler is not None:
            meta = getattr(connector_output, "kv_connector_worker_meta", None)
            if meta is not None:
                self._scheduler.holds.on_events(meta)
            if self._scheduler.early is not None:
                # async scheduling, one worker: loads the worker reported over
                # after this output was made, told now (early.py)
                self._scheduler.early.on_output(connector_output)
            if self._scheduler._traced_bg:
                self._scheduler.trace_recv_seen(getattr(connector_output, "finished_recving",
                                                        None))
            self._scheduler.on_load_errors(getattr(connector_output, "invalid_block_ids",
                                                   None))

    def has_pending_push_work(self):
        """vLLM keeps stepping while blocks are held for a same-host producer
        that has not answered, so the workers see its answer or its exit."""
        return self._scheduler is not None and len(self._scheduler.holds) > 0

    def build_connector_worker_meta(self):
        """Worker -> scheduler: this step's hold events (holds.py), or None."""
        if self._worker is None:
            return None
        ev = self._worker.take_hold_events()
        if not ev:
            if self._worker.early_watched():
                # no events, but an output: vLLM calls update_connector_output
                # only for a step whose connector output is not empty, and a
                # load this worker reports over in the next step is told to
                # the scheduler with this step's output (early.py)
                from mooncake_connector.connector.holds import HoldEvents
                return HoldEvents([])
            return None
        from mooncake_connector.connector.holds import HoldEvents
        name = self._worker.name
        return HoldEvents([(name, *e) for e in ev])

    def request_finished_all_groups(self, request, block_ids):
        """SupportsHMA: block_ids has one list per KV-cache group; every
        group's blocks stay with vLLM until get_finished reports the request."""
        return self._scheduler.request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request):
        """A load moves the request's own blocks of every transfer group
        (sliding-window ones inside the window), not only prefix-cacheable ones."""
        kcc = getattr(self, "_kv_cache_config", None)
        ids = getattr(kcc, "transfer_group_ids", None)
        if ids is None:
            ids = tuple(range(len(getattr(kcc, "kv_cache_groups", None) or [0])))
        return tuple(ids)

    # ---------------- worker side ----------------

    def register_kv_caches(self, kv_caches):
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata):
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata,
                                                   MooncakeConnectorMetadata):
            self._worker.on_metadata(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata):
        if self._worker is not None and isinstance(kv_connector_metadata,
                                                   MooncakeConnectorMetadata):
            self._worker.unpublish(kv_connector_metadata)

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._connector_metadata
        if isinstance(meta, MooncakeConnectorMetadata):
            self._worker.start_load(meta)

    def wait_for_layer_load(self, layer_name):
        # Pulls in the step are done when start_load_kv returns; a push layer
        # load (push_layer_load) waits here until this layer's KV landed.
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        # Flow a/b publish once per prompt (wait_for_save); push with
        # push_layerwise writes this layer to the decode side now.
        if self._worker is not None:
            self._worker.save_kv_layer(layer_name)

    def wait_for_save(self):
        meta = self._connector_metadata
        if isinstance(meta, MooncakeConnectorMetadata):
            self._worker.publish(meta)

    def get_finished(self, finished_req_ids):
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self):
        return self._worker.take_invalid_blocks() if self._worker else set()

    def get_kv_connector_stats(self):
        if self._worker is not None:
            return self._worker.take_stats()
        return self._scheduler.take_stats() if self._scheduler is not None else None

    def unregister_kv_caches(self):
        """vLLM >= 0.33, before sleep frees the KV cache (worker.py)."""
        if self._worker is not None:
            self._worker.unregister_kv_caches()

    def restore_kv_caches(self):
        """vLLM >= 0.33, after wake-up remapped the KV cache (worker.py)."""
        if self._worker is not None:
            self._worker.restore_kv_caches()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config):
        """vLLM skips wait_for_layer_load and save_kv_layer in a FULL CUDA-graph
        replay.  Where kv_connector_extra_config turns per-layer work on for
        every request (push_layer_load on a decode, push_layerwise on a
        prefill), ask vLLM for PIECEWISE graphs (attention, and so the hooks,
        run between the pieces).  Otherwise FULL decode graphs stay: a layer
        load a request asks for per request is shaped so its step is never a
        FULL replay, or taken as a whole-prompt push (scheduler.py
        _layer_load_claim); a producer's layers a replay skipped are written
        after the forward (push.py prompt_done)."""
        return settings_mod.layerwise_in_forward(extra_config)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config):
        """vLLM >= 0.33: yes; the two hooks above drop the registrations and
        register the remapped KV cache under a new engine (peers reconnect,
        so they learn the new regions before their first transfer)."""
        return True

    @classmethod
    def kv_cache_access(cls, kv_transfer_config):
        """vLLM >= 0.34: how the workers reach the KV cache (kv_cache_access_for)."""
        extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
        mode = extra.get("kv_cache_access", "auto") if isinstance(extra, dict) else "auto"
        flags, why = declared_kv_cache_access(mode)
        if flags is not None and flags.LEGACY_IPC in flags:
            _log_once("kv_cache_access", "MooncakeConnector: declares %s: %s", flags, why)
        return flags

    def may_load_async(self, request):
        """vLLM >= 0.34 (--max-num-inflight-kv-loads): True for a request this
        consumer will try to load, flow A (no kv_transfer_params) as well as B."""
        return self._scheduler is not None and self._scheduler.may_load_async(request)

    @property
    def requires_kv_delivery(self):
        """vLLM >= 0.34: a producer (kv_producer, kv_both) holds a finished
        request's blocks until the consumer has read them (request_finished
        returns delay_free): a request preempted before that hand-off must be
        recomputed, not finished on blocks the preemption freed."""
        return bool(self.settings.is_producer)

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return MooncakeKVConnectorStats(data=data) if data is not None else \
            MooncakeKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        """The connector's counters, gauges and load-latency histogram in
        vLLM's /metrics (vllm:mooncake_*; stats.py)."""
        from mooncake_connector.connector.stats import build_prom_metrics
        return build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self):
        if getattr(self, "_hook_times", None) is not None:
            self._hook_times.dump()
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
