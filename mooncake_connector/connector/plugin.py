"""vLLM general plugin (entry point ``vllm.general_plugins``).

Makes the seed's command line work unchanged once this package is installed:
  * ``"kv_connector": "MooncakeConnector"`` without ``kv_connector_module_path``
    resolves to this package's connector instead of vLLM's in-tree one;
  * the seed's ``kv_rank``, ``kv_parallel_size`` and ``kv_buffer_size`` (which
    vLLM's KVTransferConfig does not accept) are moved into
    ``kv_connector_extra_config`` when the connector is ours.
Set MOONCAKE_CONNECTOR_DISABLE_PLUGIN=1 to keep vLLM's in-tree connector.
The plugin never raises: vLLM's start-up must not fail because of it.
"""
import json
import logging
import os

logger = logging.getLogger("vllm.mooncake_connector")
SEED_FIELDS = ("kv_rank", "kv_parallel_size", "kv_buffer_size")
_done = False


def _ours():
    from mooncake_connector.connector.connector import MooncakeConnector
    _announce()
    return MooncakeConnector


def _announce():
    """Once per deployment: the first process that resolves the name logs it
    (vLLM's logging is set up by then); the processes it starts inherit the
    marker and stay quiet."""
    if os.environ.get("_MOONCAKE_CONNECTOR_ANNOUNCED"):
        return
    os.environ["_MOONCAKE_CONNECTOR_ANNOUNCED"] = "1"
    msg = ("mooncake-connector: \"MooncakeConnector\" resolves to "
           "mooncake_connector.MooncakeConnector (set MOONCAKE_CONNECTOR_DISABLE_PLUGIN=1 for "
           "vLLM's in-tree one)")
    if logger.hasHandlers():
        logger.info(msg)
    else:
        import sys
        print(msg, file=sys.stderr)


def _move_seed_fields(text):
    """JSON text of --kv-transfer-config -> the same with the seed's extra
    fields moved into kv_connector_extra_config (only for our connector)."""
    try:
        d = json.loads(text)
    except (TypeError, ValueError):
        return text
    if not isinstance(d, dict) or d.get("kv_connector") != "MooncakeConnector":
        return text
    if d.get("kv_connector_module_path") not in (None, "mooncake_connector",
                                                 "mooncake_connector.connector.connector"):
        return text
    moved = {k: d.pop(k) for k in SEED_FIELDS if k in d}
    if not moved:
        return text
    extra = d.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        return text
    d["kv_connector_extra_config"] = {**moved, **extra}
    return json.dumps(d)


def register():
    global _done
    if _done:
        return
    _done = True
    if os.environ.get("MOONCAKE_CONNECTOR_DISABLE_PLUGIN", "") not in ("", "0"):
        logger.info("mooncake-connector: plugin disabled (MOONCAKE_CONNECTOR_DISABLE_PLUGIN); "
                    "\"MooncakeConnector\" is vLLM's in-tree connector")
        return
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        KVConnectorFactory._registry["MooncakeConnector"] = _ours
    except Exception as e:  # never break vLLM's start-up
        logger.warning("mooncake-connector: could not register MooncakeConnector with vLLM "
                       "(%s); use \"kv_connector_module_path\": \"mooncake_connector\"", e)
        return
    try:
        import vllm.engine.arg_utils as au
        orig = getattr(au, "_expand_json_human_readable_numbers", None)
        if orig is not None and not getattr(orig, "_mooncake", False):
            def expand(val, _orig=orig):
                return _orig(_move_seed_fields(val))
            expand._mooncake = True
            au._expand_json_human_readable_numbers = expand
    except Exception as e:
        logger.warning("mooncake-connector: seed fields kv_rank/kv_parallel_size/kv_buffer_size "
                       "will not be accepted on the command line (%s); put them in "
                       "kv_connector_extra_config", e)
