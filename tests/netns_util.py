"""Two network namespaces joined by a veth pair, for the tests whose bytes
must cross a real (virtual) link: tests/test_netns.py, tests/test_fence.py."""
import contextlib
import os
import subprocess

import pytest

from conftest import have_netns


def sh(*args):
    subprocess.run(args, check=True, capture_output=True)


def _del(*args):
    subprocess.run(args, capture_output=True)


@contextlib.contextmanager
def veth_pair(prefix, subnet, what="network namespaces", setup=None):
    """Namespaces `<prefix><pid>a` and `...b`, joined by a veth whose ends
    (`...va` in a, `...vb` in b) hold `<subnet>.1/24` and `<subnet>.2/24`.

    Each namespace also gets a blackhole route to the /24 behind the link's
    own route: when a test cuts the link (`ip link set ... down`), which
    takes that route with it, the other side stays unreachable instead of
    following some other route.  `setup(pair)` runs once the link is up
    (a qdisc, a sysctl).  Skips the test when this is not root or `ip netns`
    is missing, and when a set-up command fails (naming `what` and the
    command's error), deleting whatever it made; the namespaces go on exit.

    Yields {"a": (ns, ip), "b": (ns, ip), "veth": a's device, "veth_b": b's}.
    """
    if not have_netns():
        pytest.skip("needs root and `ip netns` (iproute2) to create network namespaces")
    tag = f"{prefix}{os.getpid() % 100000}"
    a, b = f"{tag}a", f"{tag}b"
    va, vb = f"{tag}va", f"{tag}vb"
    pair = {"a": (a, f"{subnet}.1"), "b": (b, f"{subnet}.2"), "veth": va, "veth_b": vb}
    try:
        try:
            sh("ip", "netns", "add", a)
            sh("ip", "netns", "add", b)
            sh("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
            for ns, dev in ((a, va), (b, vb)):
                sh("ip", "link", "set", dev, "netns", ns)
            for side, dev in (("a", va), ("b", vb)):
                ns, ip = pair[side]
                sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                sh("ip", "-n", ns, "link", "set", dev, "up")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
                sh("ip", "-n", ns, "route", "add", "blackhole", f"{subnet}.0/24",
                   "metric", "4242")
            if setup is not None:
                setup(pair)
        except subprocess.CalledProcessError as e:
            pytest.skip(f"cannot create {what} here: {e.stderr.decode().strip()}")
        yield pair
    finally:
        for ns in (a, b):
            _del("ip", "netns", "del", ns)
        _del("ip", "link", "del", va)  # still on the host if moving it failed
