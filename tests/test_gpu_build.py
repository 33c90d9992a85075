"""The GPU code paths are compiled here even without a GPU: the C side is
always built (CUDA is loaded at run time); the copy kernel's PTX is committed,
and this checks it is what nvcc makes from copy_kernel.cu today."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc"
                                if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


@pytest.mark.skipif(NVCC is None, reason="no nvcc on this machine")
def test_committed_ptx_matches_the_kernel_source(tmp_path):
    out = tmp_path / "ptx.h"
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gen_ptx.py"), NVCC,
                    os.path.join(ROOT, "csrc", "gpu", "copy_kernel.cu"), str(out)],
                   check=True, timeout=300)
    with open(os.path.join(ROOT, "csrc", "gpu", "copy_kernel_ptx.h")) as f:
        committed = f.read()
    assert out.read_text() == committed, "run `make ptx` and commit csrc/gpu/copy_kernel_ptx.h"
