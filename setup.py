"""Builds mooncake_connector._core from csrc/ (C11) against Debian's system
libraries (libcjson, libcurl). CUDA and RDMA libraries are never linked: they
are dlopen'ed at run time when first needed."""
import glob
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py


class ParallelBuildExt(build_ext):
    """Compiles the ~50 C files on every core (MC_BUILD_JOBS overrides), as
    `make -j` does; setuptools' default is one file at a time."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = int(os.environ.get("MC_BUILD_JOBS") or os.cpu_count() or 1)

class BuildPyWithShimPth(build_py):
    """Puts mooncake_connector_shim.pth at the top of the wheel (site-packages):
    with MC_MOONCAKE_SHIM=1 it makes `import mooncake.engine` work when no
    Mooncake is installed (mooncake_connector/mooncake_shim.py)."""

    def run(self):
        super().run()
        self.copy_file(os.path.join(HERE, "mooncake_connector_shim.pth"),
                       os.path.join(self.build_lib, "mooncake_connector_shim.pth"))


HERE = os.path.dirname(os.path.abspath(__file__))
sources = sorted(
    os.path.relpath(p, HERE)
    for p in glob.glob(os.path.join(HERE, "csrc", "**", "*.c"), recursive=True)
)

extra_compile_args = [
    "-std=gnu11",
    "-O2",
    "-Wall",
    "-Wextra",
    # Messages are cut to fixed buffers on purpose.
    "-Wno-format-truncation",
    "-fvisibility=hidden",
    "-D_GNU_SOURCE",
    "-pthread",
]
if os.environ.get("MC_WERROR") == "1":
    extra_compile_args.append("-Werror")

setup(
    cmdclass={"build_ext": ParallelBuildExt, "build_py": BuildPyWithShimPth},
    ext_modules=[
        Extension(
            "mooncake_connector._core",
            sources=sources,
            include_dirs=["csrc"],
            libraries=["cjson", "curl", "hiredis", "xxhash", "dl", "pthread"],
            extra_compile_args=extra_compile_args,
            extra_link_args=["-pthread"],
        )
    ],
)
