"""mooncake_connector.serving: start, health wait, clear failures, group kill.

Plain Python servers stand in for vLLM here (cheap); the real servers run in
tests/test_e2e_serving.py.
"""
import os
import signal
import sys
import time

import pytest

from mooncake_connector import serving

# Serves /health after `delay` s; with a child process that ignores SIGTERM.
SERVER = r"""
import http.server, subprocess, sys, time, signal
delay = float(sys.argv[2])
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print("child", child.pid, flush=True)
time.sleep(delay)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _server(tmp_path, delay=0.0, script=SERVER):
    """A toy server whose stop() (its own, start_all's, wait_ready's on a
    timeout) waits 1 s for SIGTERM before its SIGKILL, not 15 s: the child
    ignores SIGTERM, so the whole grace passed (~15 s of CI in each of two
    tests)."""
    port = serving.free_port()
    path = tmp_path / "srv.py"
    path.write_text(script)
    return serving.Process("toy", [sys.executable, str(path), str(port), str(delay)],
                           str(tmp_path / "toy.log"), health_url=f"http://127.0.0.1:{port}/health",
                           stop_grace=1.0)


def _child_pid(log):
    for _ in range(100):
        for line in open(log).read().splitlines():
            if line.startswith("child "):
                return int(line.split()[1])
        time.sleep(0.05)
    raise AssertionError("no child pid in the log")


def _gone(pid, timeout=5.0):
    end = time.time() + timeout
    while time.time() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_ready_then_stop_kills_the_whole_group(tmp_path):
    p = _server(tmp_path, delay=0.5).start()
    p.wait_ready(30)
    assert p.ready_s is not None and p.ready_s >= 0.5
    child = _child_pid(p.log_path)
    t0 = time.monotonic()
    p.stop(grace=1.0)  # the child ignores SIGTERM: SIGKILL after the grace period
    assert time.monotonic() - t0 < 10
    assert not p.alive and _gone(child), "a child of the server survived stop()"


def test_exit_before_ready_is_a_clear_error_with_the_log(tmp_path):
    p = _server(tmp_path, script="import sys; print('boom: bad flag', flush=True); "
                                 "sys.exit(3)\n").start()
    with pytest.raises(serving.StartError) as e:
        p.wait_ready(30)
    msg = str(e.value)
    assert "exited (status 3)" in msg and "boom: bad flag" in msg and p.log_path in msg


def test_timeout_is_a_clear_error_and_stops_it(tmp_path):
    p = _server(tmp_path, delay=60).start()
    child = _child_pid(p.log_path)
    t0 = time.monotonic()
    with pytest.raises(serving.StartError) as e:
        p.wait_ready(1.5)
    assert time.monotonic() - t0 < 30
    assert "not healthy" in str(e.value) and "after 2 s" in str(e.value)
    assert not p.alive and _gone(child)


def test_start_all_stops_the_others_when_one_fails(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    good = _server(tmp_path / "a")
    bad = _server(tmp_path / "b", script="raise SystemExit(7)\n")
    with pytest.raises(serving.StartError):
        serving.start_all([good, bad], 30)
    assert not good.alive and not bad.alive


def test_kill_is_immediate(tmp_path):
    p = _server(tmp_path).start()
    p.wait_ready(30)
    t0 = time.monotonic()
    p.kill()
    assert time.monotonic() - t0 < 5 and not p.alive
    assert p.proc.returncode == -signal.SIGKILL


def test_servers_die_with_their_parent(tmp_path):
    """A test run killed with SIGKILL must not leave servers behind."""
    code = (f"import sys; sys.path[:0] = {sys.path!r}\n"
            "from mooncake_connector import serving\n"
            f"p = serving.Process('toy', [sys.executable, {str(tmp_path / 'srv.py')!r}, "
            f"'{serving.free_port()}', '0'], {str(tmp_path / 'toy.log')!r})\n"
            "p.start(); print(p.proc.pid, flush=True)\n"
            "import time; time.sleep(600)\n")
    (tmp_path / "srv.py").write_text(SERVER)
    import subprocess
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(parent.stdout.readline())
        parent.kill()
        parent.wait(timeout=10)
        assert _gone(server_pid, 10), "the server outlived the process that started it"
    finally:
        if parent.poll() is None:
            parent.kill()
        try:
            os.kill(server_pid, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass
