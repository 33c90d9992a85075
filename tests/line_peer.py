"""A helper process driven by one JSON request per line on stdin, one JSON
answer per line on stdout (tests/peer.py, tests/gpu_peer.py,
tests/gpu_worker_peer.py).  Parent side: LinePeer; the first line the
helper prints describes it (.info); an answer with "error" fails the test;
close() asks it to exit and returns its stderr.  Helper side: requests()
and answer()."""
import json
import os
import subprocess
import sys


def answer(obj):
    """Helper side: one JSON answer line on stdout."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def requests():
    """Helper side: the requests read from stdin, one JSON object per line,
    until {"cmd": "exit"} or the end of input."""
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("cmd") == "exit":
            return
        yield req


class LinePeer:
    def __init__(self, script, args, env=None, what="peer"):
        self.what = what
        self.proc = subprocess.Popen(
            [sys.executable, script, *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})})
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{what} failed to start: " + self.proc.stderr.read())
        self.info = json.loads(line)

    def call(self, **req):
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.what} exited: " + self.proc.stderr.read())
        r = json.loads(line)
        assert "error" not in r, r
        return r

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"cmd":"exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        err = self.proc.stderr.read()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            f.close()
        return err
