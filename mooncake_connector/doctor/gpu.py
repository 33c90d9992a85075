"""gpu: CUDA GPUs and their GPUDirect capability (DMA-BUF, nvidia_peermem)."""
from __future__ import annotations

import ctypes
import os

from .hosts import _sysfs
from .report import FAIL, OK, SKIP, WARN


def check_gpu(rep, cfg):
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError:
        rep.add("gpu", "-", SKIP, "no CUDA driver (libcuda.so.1): CPU KV caches only")
        return
    n = ctypes.c_int(0)
    rc = cu.cuInit(0)
    if rc != 0 or cu.cuDeviceGetCount(ctypes.byref(n)) != 0:
        rep.add("gpu", "-", FAIL if rc not in (100,) else SKIP,
                f"CUDA driver present but cuInit failed (CUresult {rc})",
                "check `nvidia-smi`; CUDA_VISIBLE_DEVICES may hide every GPU" if rc == 100 else
                "reload the NVIDIA driver / check `nvidia-smi` and dmesg")
        return
    peermem = os.path.isdir(os.path.join(_sysfs(), "module", "nvidia_peermem"))
    for i in range(n.value):
        dev, name, dmabuf, gdr = ctypes.c_int(), ctypes.create_string_buffer(128), ctypes.c_int(), \
            ctypes.c_int()
        cu.cuDeviceGet(ctypes.byref(dev), i)
        cu.cuDeviceGetName(name, 128, dev)
        cu.cuDeviceGetAttribute(ctypes.byref(dmabuf), 124, dev)  # DMA_BUF_SUPPORTED
        cu.cuDeviceGetAttribute(ctypes.byref(gdr), 116, dev)     # GPU_DIRECT_RDMA_SUPPORTED
        detail = (f"{name.value.decode(errors='replace')}: DMA-BUF {'yes' if dmabuf.value else 'no'},"
                  f" GPUDirect RDMA {'yes' if gdr.value else 'no'}, nvidia_peermem "
                  f"{'loaded' if peermem else 'not loaded'}")
        if cfg and cfg["protocol"] == "rdma" and not dmabuf.value and not peermem:
            rep.add("gpu", f"cuda:{i}", WARN, detail,
                    "RDMA cannot reach this GPU's memory directly (staged through host memory): "
                    "use the open NVIDIA kernel modules with Linux >= 5.12 for DMA-BUF, or "
                    "`modprobe nvidia_peermem`")
        else:
            rep.add("gpu", f"cuda:{i}", OK, detail)
    if n.value == 0:
        rep.add("gpu", "-", SKIP, "CUDA driver present, no GPU visible")
