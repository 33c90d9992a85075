"""Test-side start-up hook for the vLLM servers of tests/test_e2e_intree.py
(on PYTHONPATH only for them).  Two things, nothing else:

1. Processes this directory's copy of our wheel's mooncake_connector_shim.pth
   (site.addsitedir), so MC_MOONCAKE_SHIM=1 serves `mooncake.engine` from
   our package also where the installed package predates the .pth file; with
   the .pth installed, install() is idempotent.
2. vLLM's in-tree MooncakeConnectorWorker.__init__ starts with
   `self.device_id = torch.accelerator.current_device_index()`
   (vllm 0.32.0 mooncake/mooncake_connector.py:1186, 0.34.0 :1389).  On a host
   without an accelerator torch raises there ("Found no NVIDIA driver" with
   PyPI's CUDA torch; "no available accelerator" with a CPU torch), so the
   connector cannot start on vLLM's CPU backend at all.  The index is only
   handed to current_platform.set_device(), a no-op on the CPU platform, so
   when no accelerator is available it answers 0, as a CPU device would.
   Applied when vLLM imports that module (torch is loaded by then); every
   other torch call is left as it is.
"""
import importlib.abc
import os
import site
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_TARGET = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"

site.addsitedir(_HERE)


def patch_accelerator_index():
    import torch
    acc = getattr(torch, "accelerator", None)
    if acc is None or getattr(acc.current_device_index, "_intree_cpu", False):
        return
    orig = acc.current_device_index

    def current_device_index():
        if not acc.is_available():
            return 0
        return orig()

    current_device_index._intree_cpu = True
    acc.current_device_index = current_device_index
    print("tests/intree_cpu/sitecustomize.py: torch.accelerator.current_device_index() "
          "answers 0 without an accelerator (vLLM's in-tree MooncakeConnectorWorker on CPU)",
          file=sys.stderr)


class _OnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == _TARGET:
            patch_accelerator_index()
        return None


if os.environ.get("MC_INTREE_CPU_ACCEL_INDEX") == "1":
    sys.meta_path.insert(0, _OnImport())
