"""Mooncake-return-code compatibility.

``mooncake_connector.TransferEngine`` raises an exception that says what went
wrong.  Code written for Mooncake's ``mooncake.engine.TransferEngine`` instead
checks integer results (``0`` ok, ``-1`` failed; batch ids ``0`` on failure).
This subclass keeps that contract for such code — every failure is logged with
its full reason and kept in ``last_error`` — so it can switch engines with one
import:

    from mooncake_connector.compat import TransferEngine
"""
import functools
import logging

from mooncake_connector import MooncakeError
from mooncake_connector import mooncake_api
from mooncake_connector.mooncake_api import TransferNotify, TransferOpcode  # noqa: F401

logger = logging.getLogger("mooncake_connector")

# Methods whose failure value in Mooncake's API is -1 ...
_MINUS_ONE = (
    "initialize", "register_memory", "unregister_memory", "batch_register_memory",
    "batch_unregister_memory", "transfer_sync_write", "transfer_sync_read", "transfer_sync",
    "batch_transfer_sync_write", "batch_transfer_sync_read", "batch_transfer_sync",
    "get_batch_transfer_status", "free_managed_buffer", "send_notify",
    "initialize_ext", "send_probe", "transfer_check_status",
)
# ... and those whose failure value is 0 (an invalid batch id / address).
_ZERO = (
    "batch_transfer_async_write", "batch_transfer_async_read", "batch_transfer_async",
    "transfer_submit_write", "allocate_managed_buffer", "get_first_buffer_address",
)


def _wrap(name, failure):
    method = getattr(mooncake_api.TransferEngine, name)

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            self.last_error = None
            return method(self._engine, *args, **kwargs)
        except (MooncakeError, ValueError, TypeError) as e:
            self.last_error = e
            logger.error("TransferEngine.%s failed: %s", name, e)
            return failure

    return call


class TransferEngine:
    """TransferEngine returning Mooncake's integer codes instead of raising.

    Every other method (get_rpc_port, get_notifies, close, ...) is the
    engine's own."""

    def __init__(self):
        self._engine = mooncake_api.TransferEngine()
        self.last_error = None

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def get_engine(self):
        return self

    def get_notifies(self):
        """Mooncake's items: TransferNotify with .name and .msg (a str) as
        the sender's TransferNotify gave them (.sender: the sending
        segment)."""
        return [TransferNotify(n.name, n.msg.decode("utf-8", "replace")
                               if isinstance(n.msg, bytes) else n.msg, n.sender)
                for n in self._engine.get_notifies()]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._engine.close()
        return False


for _name in _MINUS_ONE:
    setattr(TransferEngine, _name, _wrap(_name, -1))
for _name in _ZERO:
    setattr(TransferEngine, _name, _wrap(_name, 0))
del _name

__all__ = ["TransferEngine", "TransferOpcode", "TransferNotify"]
