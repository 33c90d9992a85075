"""mooncake-connector: KV-cache transfer for vLLM disaggregated prefill/decode.

The transfer engine, config parser and metadata client live in the C extension
``mooncake_connector._core``; this package re-exports them.
"""
from mooncake_connector._core import (  # noqa: F401
    ConfigError,
    MetadataError,
    MooncakeError,
    TransferError,
    TransferTimeout,
    UnavailableError,
)

from mooncake_connector import _core

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "MetadataError",
    "MooncakeError",
    "TransferError",
    "TransferTimeout",
    "UnavailableError",
]

for _name in ("TransferEngine", "load_config", "parse_config", "MetadataClient", "KVTransfer", "LookupBuffer", "hash_token_blocks"):
    if hasattr(_core, _name):
        globals()[_name] = getattr(_core, _name)
        __all__.append(_name)
del _name
