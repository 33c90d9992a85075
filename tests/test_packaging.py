"""The extension links no GPU/RDMA/torch library and loads none at import."""
import subprocess
import sys

import pytest

import mooncake_connector as mc
from mooncake_connector import _core

FORBIDDEN = ("libibverbs", "librdmacm", "libcuda", "libcudart", "libtorch", "libc10")


def test_extension_does_not_link_optional_libraries():
    out = subprocess.run(["ldd", _core.__file__], capture_output=True, text=True).stdout
    assert "libcjson" in out and "libcurl" in out
    for lib in FORBIDDEN:
        assert lib not in out, f"{_core.__file__} links {lib}"


def test_import_loads_no_optional_library():
    code = ("import mooncake_connector, sys;"
            "maps = open('/proc/self/maps').read();"
            f"bad = [l for l in {FORBIDDEN!r} if l in maps];"
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_rdma_and_gpu_are_explicit_errors_not_fallbacks():
    e = mc.TransferEngine()
    with pytest.raises(mc.UnavailableError) as ei:
        e.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "mlx5_0")
    msg = str(ei.value)
    assert (("libibverbs.so.1" in msg and "install" in msg)
            or "no RDMA device on this host" in msg), msg
    e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    try:
        # Without a CUDA driver: the library is named.  With one (GPU hosts):
        # the claim is checked, and this address is not GPU memory.
        with pytest.raises((mc.UnavailableError, mc.ConfigError),
                           match="libcuda|is host memory, not GPU memory"):
            e.register_memory(1 << 40, 4096, "cuda:0")
    finally:
        e.close()


def test_public_names():
    for name in ("TransferEngine", "load_config", "parse_config", "MetadataClient",
                 "MooncakeError", "ConfigError", "TransferError", "MetadataError",
                 "TransferTimeout", "UnavailableError"):
        assert hasattr(mc, name), name
    assert issubclass(mc.ConfigError, ValueError)
    assert issubclass(mc.TransferTimeout, TimeoutError)


def test_type_stubs_match_the_extension():
    import ast
    import os

    stub = os.path.join(os.path.dirname(mc.__file__), "_core.pyi")
    tree = ast.parse(open(stub).read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            assert hasattr(_core, node.name), f"stub class {node.name} not in _core"
            cls = getattr(_core, node.name)
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and not f.name.startswith("__"):
                    assert hasattr(cls, f.name), f"{node.name}.{f.name} in stub, not in _core"
        elif isinstance(node, ast.FunctionDef):
            assert hasattr(_core, node.name), f"stub function {node.name} not in _core"
    # And the other way round for the engine: every public method is typed.
    typed = {f.name for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TransferEngine"
             for f in n.body if isinstance(f, ast.FunctionDef)}
    public = {m for m in dir(_core.TransferEngine) if not m.startswith("_")}
    assert public <= typed, public - typed
