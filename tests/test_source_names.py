"""Every name the Python sources use is defined: pyflakes over the code
this machine cannot run (GPU-only tests and workers, device scripts,
benchmarks that need a GPU or real peers) as well as the rest.  A GPU test
that lost an import (test_gpu_worker's free_port, 2026-12-06: four GPU
tests failed with NameError on the GPU machine, none here) fails here
first.  Only undefined names are errors: unused imports (pytest fixtures
imported from another test module) and the like are pyflakes' style
warnings, not bugs."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREES = ["mooncake_connector", "tests", "benchmarks", "scripts"]
BUGS = ("undefined name", "undefined local variable", "may be undefined",
        "syntax error", "invalid syntax", "unexpected indent")


def _pyflakes(paths):
    pytest.importorskip("pyflakes", reason="pyflakes is not installed (scripts/env.sh installs it)")
    r = subprocess.run([sys.executable, "-m", "pyflakes", *paths], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    return [ln for ln in (r.stdout + r.stderr).splitlines() if any(b in ln for b in BUGS)]


def test_no_undefined_names_in_the_sources():
    bad = _pyflakes([t for t in TREES if os.path.isdir(os.path.join(ROOT, t))])
    assert not bad, "names used but never defined (a missing import?):\n" + "\n".join(bad)


def test_the_check_finds_an_undefined_name(tmp_path):
    """The check can fail: a file using a name it never imports."""
    f = tmp_path / "lost_import.py"
    f.write_text("def pair():\n    return free_port()\n")
    bad = _pyflakes([str(f)])
    assert len(bad) == 1 and "undefined name 'free_port'" in bad[0]
