"""tests/forked.py's ForkServer, which forks fresh-process jobs from one slow
import (test_doctor's and test_connector_vllm's plugin checks, test_push's
and test_push_layer_load's producer processes use it): each job sees the
preamble's imports and none of another job's state, gets its own
environment, directory, streams and exit status, and can be read, signalled
and killed while it runs."""
import pytest

from forked import ForkServer

PREAMBLE = "import json\nSHARED = {'n': 0}\nimport sys; sys.modules['json'].seen_by_preamble = 1\n"
JOB = r'''
import json, os, sys
import email.message                      # imported by the job, not the preamble
state = sys.modules.setdefault("job_state", type(sys)("job_state"))
state.count = getattr(state, "count", 0) + 1
os.environ["LEAK"] = "set by a job"
print(json.dumps({"argv": sys.argv[1:], "var": os.environ.get("VAR"), "count": state.count,
                  "preamble": getattr(json, "seen_by_preamble", 0)}))
print("to stderr", sys.argv[1], file=sys.stderr)
code = int(sys.argv[2])
if code == 99:
    raise RuntimeError("boom")
sys.exit(code)
'''


def test_jobs_are_isolated_and_each_has_its_own_result():
    import json

    srv = ForkServer(PREAMBLE, env={"VAR": "parent", "LEAK": "parent", "PATH": "/usr/bin:/bin"})
    try:
        parent = {"VAR": "parent", "LEAK": "parent", "PATH": "/usr/bin:/bin"}
        runs = [srv.run(JOB, ["a", "0"], env=dict(parent, VAR="1")),
                srv.run(JOB, ["b", "3"], env={k: v for k, v in parent.items() if k != "VAR"}),
                srv.run(JOB, ["c", "99"], env={"VAR": "3", "PATH": "/usr/bin:/bin"})]
    finally:
        srv.close()
    got = [json.loads(r.stdout.splitlines()[0]) for r in runs]
    assert [g["argv"] for g in got] == [["a", "0"], ["b", "3"], ["c", "99"]]
    assert [g["var"] for g in got] == ["1", None, "3"]
    assert [g["count"] for g in got] == [1, 1, 1]          # no job saw another's module state
    assert all(g["preamble"] == 1 for g in got)           # every job saw the preamble's
    assert [r.returncode for r in runs] == [0, 3, 1]
    assert runs[0].stderr.strip() == "to stderr a" and "RuntimeError: boom" in runs[2].stderr
    assert "to stderr c" in runs[2].stderr and "to stderr a" not in runs[1].stderr


def test_a_preamble_that_imports_a_fresh_package_is_refused(capfd):
    with pytest.raises(RuntimeError, match="fork server exited"):
        ForkServer("import email.message", fresh=("email",))
    assert "the preamble imported ['email" in capfd.readouterr().err
    srv = ForkServer("import json", fresh=("email",))
    try:
        ok = srv.run("import email")
    finally:
        srv.close()
    assert ok.returncode == 0, ok.stderr


LIVE = r'''
import json, os, sys, time
import email.message
state = sys.modules.setdefault("job_state", type(sys)("job_state"))
state.count = getattr(state, "count", 0) + 1
os.environ["LEAK"] = "set by a child"
print(json.dumps({"argv": sys.argv, "var": os.environ.get("VAR"), "leak": os.environ.get("LEAK"),
                  "count": state.count, "preamble": getattr(json, "seen_by_preamble", 0),
                  "stdin": sys.stdin.read()}), flush=True)
print("to stderr", sys.argv[1], file=sys.stderr, flush=True)
if sys.argv[2] == "wait":
    assert sys.stdin.read() == ""
    print("ready", flush=True)
    while True:
        time.sleep(1)
if sys.argv[2] == "raise":
    raise RuntimeError("boom")
sys.exit(int(sys.argv[2]))
'''


def test_fork_server_children_run_live_each_fresh(capfd):
    import json
    import os
    import signal
    import subprocess

    srv = ForkServer(PREAMBLE, env={"VAR": "server", "PATH": "/usr/bin:/bin"}, fresh=("email",))
    try:
        a = srv.start(LIVE, ["a", "wait"], env={"VAR": "1", "LEAK": "parent"})
        got = json.loads(a.stdout.readline())
        assert got == {"argv": ["-c", "a", "wait"], "var": "1", "leak": "set by a child",
                       "count": 1, "preamble": 1, "stdin": ""}
        assert a.stdout.readline() == "ready\n"  # read while it runs
        assert a.poll() is None and a.pid not in (os.getpid(), srv.proc.pid)
        with pytest.raises(subprocess.TimeoutExpired):
            a.wait(0.2)
        b = srv.start(LIVE, ["b", "3"], env={})
        c = srv.start(LIVE, ["c", "raise"], env={"VAR": "3"})
        assert b.wait(30) == 3 and c.wait(30) == 1
        assert [json.loads(x.stdout.readline())["var"] for x in (b, c)] == [None, "3"]
        assert json.loads(b.stdout.readline() or "{}") == {}  # its stdout closed at its exit
        os.kill(a.pid, signal.SIGSTOP)
        a.kill()  # stopped or not
        assert a.wait(30) == -signal.SIGKILL and a.poll() == -signal.SIGKILL
        a.kill()  # gone: nothing happens
        err = capfd.readouterr().err
        assert "to stderr a" in err and "to stderr b" in err and "RuntimeError: boom" in err
        d = srv.start(LIVE, ["d", "wait"])
        assert json.loads(d.stdout.readline())["var"] == os.environ.get("VAR")  # ours, at start
        assert d.stdout.readline() == "ready\n"
    finally:
        srv.close()
    assert srv.proc.returncode == 0
    assert d.stdout.read() == ""  # killed with the server
    for x in (a, b, c, d):
        x.stdout.close()
    with pytest.raises(ProcessLookupError):
        os.kill(d.pid, 0)


def test_fork_server_run_gives_both_streams_the_status_and_honours_cwd_and_timeout(tmp_path):
    import os
    import subprocess
    import time

    code = ("import os, sys; print(os.getcwd(), sys.argv[1]); "
            "print('x' * 200000, file=sys.stderr); sys.exit(int(sys.argv[2]))")
    srv = ForkServer("import json")
    try:
        r = srv.run(code, ["a", "4"], cwd=str(tmp_path))
        assert r.returncode == 4 and r.stdout == f"{tmp_path} a\n", r
        assert r.stderr == "x" * 200000 + "\n"  # more than a pipe holds: read as it came
        assert srv.run(code, ["b", "0"]).stdout == f"{os.getcwd()} b\n"  # ours by default
        t0 = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired):
            srv.run("import time; print('started', flush=True); time.sleep(60)", timeout=1)
        assert time.monotonic() - t0 < 10
    finally:
        srv.close()


SESSION_JOB = r'''
import os, subprocess, sys, time
kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("leader", os.getpid(), os.getsid(0), os.getpgrp(), "kid", kid.pid, flush=True)
print("to stderr", flush=True, file=sys.stderr)
time.sleep(600)
'''


def test_session_child_writes_to_given_fds_and_its_group_goes_with_the_server(tmp_path):
    """start(fds=, session=True), as serving's vLLM servers are forked
    (tests/e2e_fixtures.py): the child leads a session and group of its own
    (what serving's stop() signals), writes stdout and stderr to the fds
    given, and the server's close() kills its whole group (its children
    too), as a SIGKILLed test run's would be."""
    import os
    import time

    from conftest import wait_until

    log = tmp_path / "log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    srv = ForkServer("import json")
    try:
        child = srv.start(SESSION_JOB, env=dict(os.environ), fds=(fd, fd), session=True)
        assert child.stdout is None
        assert wait_until(lambda: "to stderr" in log.read_text(), timeout=30)
        words = log.read_text().split()
        leader, sid, pgrp, kid = (int(words[i]) for i in (1, 2, 3, 5))
        assert leader == sid == pgrp == child.pid != os.getpgrp()
        os.killpg(child.pid, 0)  # its group exists
        assert child.poll() is None
    finally:
        os.close(fd)
        srv.close()

    def gone(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    assert wait_until(lambda: gone(kid), timeout=30), "the child's own child outlived the server"
    t0 = time.monotonic()
    assert wait_until(lambda: gone(child.pid), timeout=10) and time.monotonic() - t0 < 10


def test_a_server_started_without_waiting_imports_in_the_background(tmp_path):
    """wait=False: the constructor returns while the preamble still runs
    (here it waits for a file the test writes only afterwards: a server
    that waited would never return); the first start() waits for it.  A
    preamble that fails raises at ready()."""
    gate = tmp_path / "go"
    pre = (f"import json, os, time\nwhile not os.path.exists({str(gate)!r}):\n"
           "    time.sleep(0.01)\njson.X = 7\n")
    srv = ForkServer(pre, wait=False)
    try:
        gate.write_text("")
        got = srv.run("import json\nprint(json.X)")
    finally:
        srv.close()
    assert (got.returncode, got.stdout) == (0, "7\n"), got.stderr
    bad = ForkServer("raise SystemExit('no such module')", wait=False)
    with pytest.raises(RuntimeError, match="fork server exited"):
        bad.ready()


def test_the_e2e_fork_server_prestarts_and_is_replaced_if_the_environment_changed(
        monkeypatch, tmp_path):
    """tests/e2e_fixtures.py: prestart_vllm_forks() starts the vLLM fork
    server before the first server (conftest.py: at collection); the first
    vLLM server forks from it, or, if this process's environment changed
    since in a key its imports may read, from a fresh one; a key read only
    at run time (TORCHINDUCTOR_CACHE_DIR: torch sets it itself) changes
    nothing.  Stand-in preamble and job (not vLLM's)."""
    import os
    import sys
    import e2e_fixtures as ef
    from mooncake_connector import serving

    monkeypatch.setattr(ef, "VLLM_FORK_PREAMBLE", "import os\nPID = os.getpid()\n")
    monkeypatch.setattr(ef, "VLLM_FORK_JOB", "import os, sys\nprint(os.getppid(), sys.argv[1:])\n")
    monkeypatch.setattr(ef, "have_vllm", lambda: True)
    monkeypatch.delenv("MC_E2E_FORK_SERVER", raising=False)
    monkeypatch.setattr(ef, "_VLLM_FORKS",
                        dict(ef._VLLM_FORKS, server=None, env=None, failed=None, waited=None))
    cmd = [sys.executable, "-m", serving.VLLM_MAIN]

    def launch(tag):
        log = tmp_path / f"{tag}.log"
        fd = os.open(log, os.O_WRONLY | os.O_CREAT)
        try:
            child = ef.launch_vllm(cmd + [tag], ef._fork_env(), str(tmp_path), fd)
        finally:
            os.close(fd)
        assert child is not None and child.wait(30) == 0
        return int(log.read_text().splitlines()[-1].split()[0])

    try:
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        ef.prestart_vllm_forks()
        first = ef._VLLM_FORKS["server"]
        assert first is not None and not first.used
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
        assert launch("one") == first.proc.pid            # the prestarted one
        ef.close_vllm_forks()
        ef.prestart_vllm_forks()
        second = ef._VLLM_FORKS["server"]
        monkeypatch.setenv("PYTHONWARNINGS_TEST_KEY", "changed")
        pid = launch("two")
        assert ef._VLLM_FORKS["server"] is not second and pid == ef._VLLM_FORKS["server"].proc.pid
        assert second.proc.poll() is not None             # closed
    finally:
        ef.close_vllm_forks()


def test_closing_with_an_exit_report_unread_prints_no_traceback(capfd):
    """The test side closes its socket while the server's report of a
    child's exit is still unread there: the server reads a connection reset,
    not an end of file (was: a ConnectionResetError traceback from recv_fds
    in the middle of pytest's output, in most CI runs); it ends its children
    and exits 0 as on a clean close."""
    import time

    srv = ForkServer("")
    child = srv.start("import sys; sys.exit(3)")
    child.stdout.read()  # the child is gone; its exit report is on its way to us
    time.sleep(0.5)      # ... and arrives in our socket, unread
    srv.close()
    assert srv.proc.returncode == 0
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ConnectionResetError" not in err, err
