"""mooncake-connector: KV-cache transfer for vLLM disaggregated prefill/decode.

The transfer engine, config parser and metadata client live in the C extension
``mooncake_connector._core``; this package re-exports them.  Everything is
imported lazily, so ``import mooncake_connector`` (what vLLM does for
``kv_connector_module_path``) costs nothing and works where the extension is
not needed (vLLM's scheduler process).

``mooncake_connector.MooncakeConnector`` is the vLLM V1 KV connector.
"""
import importlib

__version__ = "0.1.0"

_CORE_NAMES = ("ConfigError", "MetadataError", "MooncakeError", "TransferError",
               "TransferTimeout", "UnavailableError", "load_config",
               "parse_config", "MetadataClient", "KVTransfer", "LookupBuffer",
               "hash_token_blocks")
_LAZY = {"MooncakeConnector": "mooncake_connector.connector.connector",
         # the C engine plus the rest of Mooncake's Python API (docs/compat.md)
         "TransferEngine": "mooncake_connector.mooncake_api"}

__all__ = list(_CORE_NAMES) + list(_LAZY)


def __getattr__(name):
    if name in _CORE_NAMES or name == "_core":
        core = importlib.import_module("mooncake_connector._core")
        value = core if name == "_core" else getattr(core, name)
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module 'mooncake_connector' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
