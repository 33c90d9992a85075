"""``mooncake.engine`` from our package, for code written for Mooncake
(vLLM's in-tree MooncakeConnector, SGLang's Mooncake backend) when no Mooncake
package is installed.

Opt-in: set ``MC_MOONCAKE_SHIM=1`` in the environment (the
``mooncake_connector_shim.pth`` file our wheel installs then calls
``install()`` at interpreter start, also in vLLM's worker processes), or call
``mooncake_connector.mooncake_shim.install()`` before importing Mooncake.

``install()`` appends an import finder to the END of ``sys.meta_path``: it is
asked only after every other finder found no ``mooncake``, so a real Mooncake
install always wins and is never shadowed.  It provides exactly two modules:
``mooncake`` (a package whose ``BufferPool`` / ``RegisteredBufferPool`` are
``None``, as in a Mooncake without its store) and ``mooncake.engine`` with ``TransferEngine``
(``mooncake_connector.compat.TransferEngine``: Mooncake's return codes),
``TransferOpcode``, ``TransferNotify`` and the ``SUPPORT_*`` flags.  When
``mooncake.engine`` is first imported from here, one warning is logged (logger
``mooncake_connector``) saying so.  docs/compat.md.

``MC_MOONCAKE_SHIM_STATS=1`` in addition logs one line (logger
``mooncake_connector.shim``, INFO, to stderr when nothing else handles it) per
successful synchronous transfer of the engines served here: the bytes, and
the engine's own counters (``get_stats()``), so a deployment of code written
for Mooncake can show that the bytes went through this engine.
"""
import importlib.abc
import importlib.machinery
import logging
import os
import sys

log = logging.getLogger("mooncake_connector")
ENV = "MC_MOONCAKE_SHIM"
STATS_ENV = "MC_MOONCAKE_SHIM_STATS"
_MARK = "__mooncake_connector_shim__"


_SYNC_TRANSFERS = ("transfer_sync_write", "transfer_sync_read", "transfer_sync",
                   "batch_transfer_sync_write", "batch_transfer_sync_read", "batch_transfer_sync")


def _stats_engine_class(base):
    """``base`` (compat.TransferEngine) whose successful synchronous
    transfers each log a line with the bytes and the engine's counters."""
    slog = logging.getLogger("mooncake_connector.shim")
    if not slog.handlers and not logging.getLogger().handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        slog.addHandler(h)
    if slog.level == logging.NOTSET:
        slog.setLevel(logging.INFO)

    def counted(name):
        method = getattr(base, name)

        def call(self, target, *args, **kwargs):
            rc = method(self, target, *args, **kwargs)
            if rc == 0:
                length = args[2] if len(args) > 2 else kwargs.get("length", kwargs.get("lengths"))
                nbytes = sum(length) if isinstance(length, (list, tuple)) else int(length or 0)
                self._shim_calls = getattr(self, "_shim_calls", 0) + 1
                self._shim_bytes = getattr(self, "_shim_bytes", 0) + nbytes
                try:
                    st, seg = self._engine.get_stats(), self._engine.get_segment_name()
                except Exception as e:  # never fail a transfer for a log line
                    st, seg = {"stats_error": str(e)}, "?"
                slog.info("engine %s (mooncake_connector, served as mooncake.engine): %s to %s "
                          "ok, %d bytes; this engine so far %d transfers, %d bytes; counters "
                          "same_host_cpu_bytes_written=%s same_host_cpu_bytes_read=%s "
                          "same_host_cpu_ops=%s", seg, name, target, nbytes, self._shim_calls,
                          self._shim_bytes, st.get("same_host_cpu_bytes_written"),
                          st.get("same_host_cpu_bytes_read"), st.get("same_host_cpu_ops"))
            return rc

        call.__name__ = call.__qualname__ = name
        call.__doc__ = method.__doc__
        return call

    return type("TransferEngine", (base,), {n: counted(n) for n in _SYNC_TRANSFERS})


def _fill_engine(mod) -> None:
    from mooncake_connector import compat
    from mooncake_connector.mooncake_api import TransferNotify, TransferOpcode
    mod.TransferEngine = compat.TransferEngine
    if os.environ.get(STATS_ENV) == "1":
        mod.TransferEngine = _stats_engine_class(compat.TransferEngine)
        mod.TransferEngine.__module__ = compat.__name__
    mod.TransferOpcode = TransferOpcode
    mod.TransferNotify = TransferNotify
    mod.Read, mod.Write = TransferOpcode.Read, TransferOpcode.Write
    for flag in ("SUPPORT_EFA", "SUPPORT_HIP", "SUPPORT_MNNVL", "SUPPORT_INTRA_NVLINK",
                 "SUPPORT_CUDA"):
        setattr(mod, flag, False)
    mod.__all__ = ["TransferEngine", "TransferOpcode", "TransferNotify"]
    log.warning("mooncake.engine is provided by mooncake_connector (%s; no Mooncake package "
                "is installed): TransferEngine is mooncake_connector.compat.TransferEngine",
                "MC_MOONCAKE_SHIM=1" if os.environ.get(ENV) == "1" else "mooncake_shim.install()")


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        setattr(module, _MARK, True)
        module.__doc__ = ("Provided by mooncake_connector (docs/compat.md); not Mooncake.")
        if module.__name__ == "mooncake.engine":
            _fill_engine(module)
        else:
            # Mooncake's top-level names: its buffer pools come from Mooncake
            # Store (mooncake.store), which is not provided, so they are None
            # exactly as in a Mooncake install without the store extension.
            module.BufferPool = module.RegisteredBufferPool = None
            module.__all__ = ["BufferPool", "RegisteredBufferPool"]


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "mooncake":
            spec = importlib.machinery.ModuleSpec("mooncake", _Loader(), is_package=True)
            spec.submodule_search_locations = []
            return spec
        if fullname == "mooncake.engine":
            # Only inside our own "mooncake", never inside a real one that
            # happens to lack an engine module.
            parent = sys.modules.get("mooncake")
            if parent is not None and getattr(parent, _MARK, False):
                return importlib.machinery.ModuleSpec("mooncake.engine", _Loader())
        return None


def installed() -> bool:
    return any(isinstance(f, _Finder) for f in sys.meta_path)


def install() -> None:
    """Makes ``import mooncake.engine`` work when no Mooncake is installed
    (idempotent; a real Mooncake still wins)."""
    if not installed():
        sys.meta_path.append(_Finder())
