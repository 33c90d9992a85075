import json
import os
import shutil
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "peer.py")


class Peer:
    """A tests/peer.py process (optionally inside a network namespace)."""

    def __init__(self, hostname="127.0.0.1", metadata="P2PHANDSHAKE", size=64 << 20,
                 netns=None, env=None):
        cmd = [sys.executable, PEER, "--hostname", hostname, "--metadata", metadata,
               "--size", str(size)]
        if netns:
            cmd = ["ip", "netns", "exec", netns] + cmd
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("peer failed to start: " + self.proc.stderr.read())
        info = json.loads(line)
        self.segment, self.addr, self.size = info["segment"], info["addr"], info["size"]
        self.pid = info["pid"]
        self.stderr_text = None

    def call(self, **req):
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("peer exited: " + self.proc.stderr.read())
        return json.loads(line)

    def send(self, **req):
        """Sends a command without waiting for its answer."""
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"cmd":"exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        try:
            self.stderr_text = self.proc.stderr.read()
        except Exception:
            self.stderr_text = ""
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except Exception:
                pass


@pytest.fixture
def peers():
    made = []

    def make(**kw):
        p = Peer(**kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


@pytest.fixture
def metadata_server():
    from mooncake_connector.metadata_server import MetadataServer

    srv = MetadataServer()
    srv.start()
    yield srv
    srv.stop()


def wait_until(pred, timeout=5.0, step=0.02):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(step)
    return False


def have_netns():
    return (os.geteuid() == 0 and shutil.which("ip") is not None
            and subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0)


# Session fixtures of the end-to-end serving tests (tests/test_e2e_*.py).
from e2e_fixtures import deployment, tiny_model_dir  # noqa: E402,F401
