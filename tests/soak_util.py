"""benchmarks/soak.py loaded as a module for the soak's tests (it is a
script, not part of the package)."""
import importlib.util
import os

SOAK_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "benchmarks", "soak.py")


def load_soak(name="soak_mod"):
    """A fresh module object of benchmarks/soak.py under name."""
    spec = importlib.util.spec_from_file_location(name, SOAK_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
