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

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorRole)

from mooncake_connector.connector import settings as settings_mod
from mooncake_connector.connector.metadata import MooncakeConnectorMetadata
from mooncake_connector.connector.stats import MooncakeKVConnectorStats

logger = logging.getLogger("vllm.mooncake_connector")
_logged = set()


def _log_once(key, msg, *args):
    if key not in _logged:
        _logged.add(key)
        logger.info(msg, *args)


def _tp(vllm_config):
    pc = getattr(vllm_config, "parallel_config", None)
    size = getattr(pc, "tensor_parallel_size", 1) or 1
    rank = 0
    if size > 1:
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            rank = get_tensor_model_parallel_rank()
        except Exception:  # not initialized (scheduler process)
            rank = 0
    return rank, size


class MooncakeConnector(KVConnectorBase_V1):
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
        if role == KVConnectorRole.SCHEDULER:
            from mooncake_connector.connector.scheduler import SchedulerSide, bytes_per_block
            probe = None
            if s.role == "kv_consumer" and s.flow_a:
                from mooncake_connector.connector.probe import ProducerProbe
                probe = ProducerProbe(s)  # starts its engine at the first probe
            self._scheduler = SchedulerSide(s, self.block_size, self.tp_size,
                                            lambda: getattr(self, "_kv_cache_manager", None),
                                            block_bytes=bytes_per_block(kv_cache_config),
                                            probe=probe)
        else:
            from mooncake_connector.connector.worker import WorkerSide
            nb = getattr(kv_cache_config, "num_blocks", None) if kv_cache_config else None
            self._worker = WorkerSide(s, self.block_size, self.tp_rank, self.tp_size, nb)

    # ---------------- scheduler side ----------------

    def on_new_request(self, request):
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids):
        return self._scheduler.request_finished(request, block_ids)

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
        return  # in-step loads are done when start_load_kv returns; others: get_finished

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return  # published once per prompt, in wait_for_save

    def wait_for_save(self):
        meta = self._connector_metadata
        if isinstance(meta, MooncakeConnectorMetadata):
            self._worker.publish(meta)

    def get_finished(self, finished_req_ids):
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self):
        return self._worker.take_invalid_blocks() if self._worker else set()

    def get_kv_connector_stats(self):
        return self._worker.take_stats() if self._worker else None

    def unregister_kv_caches(self):
        """vLLM >= 0.33, before sleep frees the KV cache (worker.py)."""
        if self._worker is not None:
            self._worker.unregister_kv_caches()

    def restore_kv_caches(self):
        """vLLM >= 0.33, after wake-up remapped the KV cache (worker.py)."""
        if self._worker is not None:
            self._worker.restore_kv_caches()

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config):
        """vLLM >= 0.33: yes; the two hooks above drop the registrations and
        register the remapped KV cache under a new engine (peers reconnect,
        so they learn the new regions before their first transfer)."""
        return True

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return MooncakeKVConnectorStats(data=data) if data is not None else \
            MooncakeKVConnectorStats()

    def shutdown(self):
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
