"""The binary wheel (scripts/build-wheel.sh) on a host with no compiler and no
-dev packages: a minimal Debian root made by debootstrap (--variant=minbase,
plus python3 and python3-venv only), cached in
~/.cache/mooncake-connector/debootstrap/ (outside the checkout, so CI's fresh
clones reuse it; MC_TEST_CACHE moves it).

One wheel build (about a minute) and, the first time, one debootstrap (a few
minutes, then cached). Inside the root, in a private mount namespace with
/dev and /proc bound: a fresh venv, `pip install --no-index` of the wheel (its
dependencies from a wheelhouse downloaded here), then the transfer-only demo
and `doctor`. Skipped, saying why, without root, debootstrap or unshare.
Also: the sdist carries every source and header the extension needs.
"""
import fcntl
import glob
import os
import shutil
import subprocess
import sys
import tarfile
import uuid

import pytest

from test_doctor import two_ports

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Outside the checkout, so CI's fresh clones reuse it: the root takes minutes
# to make and never changes (MC_TEST_CACHE moves it).
CACHE = os.environ.get("MC_TEST_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                         "mooncake-connector")
ROOT = os.path.join(CACHE, "debootstrap", "bookworm")
STAMP = os.path.join(ROOT, ".mc-complete")
DEBIAN_PY = (3, 11)  # bookworm's python3

pytestmark = pytest.mark.wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run(["bash", os.path.join(REPO, "scripts", "build-wheel.sh"),
                        "--python", sys.executable, "--out", str(out)],
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    path = r.stdout.strip().splitlines()[-1]
    assert os.path.isfile(path), r.stdout
    return path


def test_wheel_is_tagged_and_self_contained(wheel):
    name = os.path.basename(wheel)
    tag = "cp%d%d" % sys.version_info[:2]
    assert f"-{tag}-{tag}-manylinux_2_" in name, name
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    core = [n for n in names if n.startswith("mooncake_connector/_core.")]
    libs = [os.path.basename(n) for n in names if n.startswith("mooncake_connector.libs/")]
    assert core, names
    for want in ("libcjson", "libcurl", "libhiredis", "libxxhash"):
        assert any(lib.startswith(want) for lib in libs), (want, libs)
    # CUDA and ibverbs are dlopen'ed at run time, never grafted.
    assert not [lib for lib in libs if lib.startswith(("libcuda", "libibverbs", "libcudart"))]
    entry = [n for n in names if n.endswith("entry_points.txt")]
    assert entry


def _need_root():
    if os.geteuid() != 0:
        pytest.skip("needs root (debootstrap, chroot, mount)")
    for tool in ("debootstrap", "unshare", "chroot"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (scripts/env.sh installs debootstrap)")
    if sys.version_info[:2] != DEBIAN_PY:
        pytest.skip(f"the wheel is built for this Python {sys.version_info[:2]}; the Debian root "
                    f"has {DEBIAN_PY}")


@pytest.fixture(scope="module")
def debroot():
    """bookworm minbase + python3 + python3-venv, made once and cached."""
    _need_root()
    os.makedirs(os.path.dirname(ROOT), exist_ok=True)
    with open(ROOT + ".lock", "w") as lock:  # one maker at a time on this machine
        fcntl.flock(lock, fcntl.LOCK_EX)
        _make_root()
    return ROOT


def _make_root():
    if not os.path.exists(STAMP):
        tmp = ROOT + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.dirname(ROOT), exist_ok=True)
        debs = os.path.join(CACHE, "debootstrap", "debs")  # downloads kept for a remake
        os.makedirs(debs, exist_ok=True)
        r = subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv",
                            f"--cache-dir={debs}", "bookworm", tmp, os.environ.get("MC_DEBIAN_MIRROR",
                                                            "http://deb.debian.org/debian")],
                           capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            pytest.fail("debootstrap failed (network to the Debian mirror?):\n" + r.stdout[-3000:]
                        + r.stderr[-2000:])
        shutil.rmtree(ROOT, ignore_errors=True)
        os.rename(tmp, ROOT)
        with open(STAMP, "w") as f:
            f.write("debootstrap --variant=minbase --include=python3,python3-venv bookworm\n")


@pytest.fixture(scope="module")
def wheelhouse():
    """The wheel's dependencies (aiohttp and its own), for pip --no-index."""
    d = os.path.join(CACHE, "wheelhouse-cp%d%d" % sys.version_info[:2])
    if not glob.glob(os.path.join(d, "aiohttp-*.whl")):
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
                            "-d", d, "aiohttp>=3.8"], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
    return d


def in_root(root, script, timeout=600):
    """Runs a shell script chrooted into root, with /dev and /proc bound in a
    private mount namespace (gone when it exits)."""
    inner = (f"mount --rbind /dev {root}/dev && mount -t proc proc {root}/proc && "
             f"exec chroot {root} /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root "
             f"LANG=C.UTF-8 /bin/sh -ec \"$0\"")
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", inner,
                           script], capture_output=True, text=True, timeout=timeout)


def test_installs_and_runs_without_compiler_or_dev_packages(wheel, debroot, wheelhouse):
    job = f"mc-wheel-{uuid.uuid4().hex[:8]}"
    p, d = two_ports()
    stage = os.path.join(debroot, "tmp", job)
    os.makedirs(os.path.join(stage, "wheels"))
    try:
        shutil.copy(wheel, os.path.join(stage, "wheels"))
        for w in glob.glob(os.path.join(wheelhouse, "*.whl")):
            shutil.copy(w, os.path.join(stage, "wheels"))
        script = f"""
cd /tmp/{job}
# the host the wheel must work on: no compiler, no -dev package
for c in gcc cc clang ld; do if command -v $c; then echo "found compiler $c"; exit 3; fi; done
if dpkg-query -W -f '${{Package}}\\n' | grep -- '-dev$'; then echo 'found -dev packages'; exit 3; fi
python3 -m venv venv
venv/bin/pip install -q --no-index --find-links wheels mooncake-connector
venv/bin/python -c 'import mooncake_connector._core as c; print("imported", c.__file__)'
venv/bin/python -m mooncake_connector.transfer_demo --layers 2 --blocks 64 --block-kib 16
echo '{{"prefill_url": "127.0.0.1:{p}", "decode_url": "127.0.0.1:{d}", "metadata_server": "P2PHANDSHAKE"}}' > mc.json
venv/bin/mooncake-connector doctor --config mc.json
# RDMA stays a run-time dlopen: without libibverbs (none here) doctor says so
echo '{{"prefill_url": "127.0.0.1:{p}", "decode_url": "127.0.0.1:{d}", "metadata_server": "P2PHANDSHAKE", "protocol": "rdma", "device_name": "mlx5_0"}}' > rdma.json
if venv/bin/mooncake-connector doctor --config rdma.json > rdma.out; then echo 'doctor passed without libibverbs'; exit 4; fi
cat rdma.out
"""
        r = in_root(debroot, script)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-4000:]
        assert f"/tmp/{job}/venv/lib/python3.11/site-packages/mooncake_connector/_core" in out, out
        assert "GB/s" in out and "0 failed" in out, out[-3000:]
        assert "cannot load libibverbs.so.1" in out and "apt-get install libibverbs1" in out, out
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def test_sdist_has_every_source(tmp_path):
    """The sdist (what `pip install` compiles where no wheel matches) holds
    every C source and header of the extension."""
    r = subprocess.run([sys.executable, "-c",
                        "import sys; from setuptools import build_meta as b; "
                        "print(b.build_sdist(sys.argv[1]))", str(tmp_path)],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr
    sdist = os.path.join(str(tmp_path), r.stdout.strip().splitlines()[-1])
    with tarfile.open(sdist) as t:
        names = t.getnames()
    top = names[0].split("/")[0]
    for src in glob.glob(os.path.join(REPO, "csrc", "**", "*.[ch]"), recursive=True):
        rel = os.path.relpath(src, REPO)
        assert f"{top}/{rel}" in names, f"{rel} missing from the sdist"
