"""Fresh-process runs of Python code that all begin with the same slow
import, for the price of one import.

ForkServer(preamble) starts one Python, which runs `preamble` (e.g. `import
vllm...`: 10-15 s on the 2-core CI host) once; each start(code, argv) then
forks a child of it that sets its environment and directory, points its
stdout (and stderr, if asked) at pipes of the caller's, runs `code` as
__main__ (sys.argv = ["-c", *argv]) and exits; the next child forks from the
server again, so none sees another's state, only the preamble's imports.
start() returns a Popen-like handle of the child, running (a producer
process a test stops and kills); run() runs one to its end and gives a
CompletedProcess-like (returncode, stdout, stderr), as subprocess.run would
for `python -P -c code argv...` with that environment, less what the
preamble's imports printed (the server's streams: the caller's).

`fresh` names packages the preamble must not import (a test of what
importing them does needs them imported in the job): the server exits with
an error if it did.  A child that raises, or exits non-zero, gives its exit
status (1 for an exception, its traceback in its stderr); a signal's, as
Popen does (-9 for SIGKILL).
"""
import json
import os
import subprocess
import sys
import types

SERVER = r'''
import json, os, selectors, signal, socket, sys, traceback
ctl = socket.socket(fileno=int(sys.argv[1]))
spec = json.loads(ctl.recv(1 << 20))
exec(compile(spec["preamble"], "<preamble>", "exec"), {"__name__": "__preamble__"})
bad = sorted(m for m in sys.modules if m.split(".")[0] in spec["fresh"])
if bad:
    sys.exit(f"forked: the preamble imported {bad[:5]}; the jobs must import them themselves")
sel = selectors.DefaultSelector()
sel.register(ctl, selectors.EVENT_READ)
kids = {}  # pidfd -> pid
groups = set()  # pids of children that lead a session (job["session"])


# In a forked child: the job's environment, directory and streams, then its
# code as __main__; exits with its status, never returns.
def run_job(job, fds):
    code = 1
    try:
        sel.close()
        for pfd in kids:
            os.close(pfd)
        ctl.close()
        if job.get("session"):  # as Popen(start_new_session=True) and serving's
            os.setsid()         # PR_SET_PDEATHSIG: SIGTERM when the server dies
            import ctypes
            ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)
        os.environ.clear()
        os.environ.update(job["env"])
        os.chdir(job["cwd"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for fd, theirs in zip((1, 2), fds):
            if theirs != fd:
                os.dup2(theirs, fd)
                os.close(theirs)
        sys.argv = ["-c"] + job["argv"]
        try:
            exec(compile(job["code"], "<string>", "exec"), {"__name__": "__main__"})
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
    finally:
        try:
            sys.stdout.flush(); sys.stderr.flush()
        finally:
            os._exit(code)


def tell(obj):
    try:
        ctl.send(json.dumps(obj).encode())
    except (BrokenPipeError, ConnectionResetError):  # the test is gone: the next read ends us
        pass


tell({"ready": True})
while True:
    for key, _ in sel.select():
        if key.fileobj is ctl:
            try:
                msg, fds, _, _ = socket.recv_fds(ctl, 1 << 20, 2)
            except ConnectionResetError:  # the test closed its end with our answer unread
                msg, fds = b"", []
            if not msg:  # the test closed its end (or died): its children go too
                for pfd, pid in kids.items():
                    for sig in (signal.SIGCONT, signal.SIGKILL):
                        try:
                            if pid in groups:  # its whole group
                                os.killpg(pid, sig)
                        except ProcessLookupError:  # no longer its group's leader
                            pass
                        os.kill(pid, sig)  # not reaped yet: still ours to signal
                    os.waitpid(pid, 0)
                sys.stdout.flush(); sys.stderr.flush()
                os._exit(0)  # not the preamble's atexit work and teardown: seconds
            job = json.loads(msg)
            sys.stdout.flush(); sys.stderr.flush()  # nothing of ours doubles into a child's
            pid = os.fork()
            if pid == 0:
                run_job(job, fds)
            for fd in fds:
                os.close(fd)
            pfd = os.pidfd_open(pid)
            kids[pfd] = pid
            if job.get("session"):
                groups.add(pid)
            sel.register(pfd, selectors.EVENT_READ)
            tell({"pid": pid})
        else:  # a child exited
            pfd = key.fileobj
            pid = kids.pop(pfd)
            groups.discard(pid)
            sel.unregister(pfd)
            os.close(pfd)
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            tell({"exit": pid, "code": code})
'''


class ForkServer:
    """One Python that ran `preamble` once (the slow import); start() forks a
    child of it per call, at once, and returns a Popen-like handle (pid,
    stdout, poll, wait, kill, send_signal, returncode) of a process that
    runs `code` as __main__ with sys.argv = ["-c", *argv] in the
    environment `env` and directory `cwd` (default: this process's, as
    they are at the call), its stdin /dev/null, its stdout a pipe the
    handle reads (text), its stderr this process's or (stderr=True)
    another pipe: what subprocess.Popen([python, "-c", code, *argv],
    stdout=PIPE, text=True) gives, less the import.  run() runs one to its
    end, as subprocess.run(..., capture_output=True, text=True) would.
    Each child is forked from the server as it was after the preamble, so
    none sees another's state.  close() (or this process's exit: the
    server's control socket closes) kills the server and any child still
    running.  `fresh`: the module docstring's; `env`: the server's (the
    preamble's) environment."""

    def __init__(self, preamble, env=None, fresh=("mooncake_connector",), cwd=None,
                 timeout=600, wait=True):
        """wait=False: returns while the server still runs the preamble (it
        imports in the background); the first start() or ready() waits for
        it, up to `timeout` s from then."""
        import socket
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._exits = {}  # pid -> exit status, as the server reported them
        self._timeout, self._pending = timeout, True
        self.used = False  # a child was started
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-c", SERVER, str(theirs.fileno())],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, cwd=cwd,
            env=os.environ if env is None else env)
        theirs.close()
        try:
            self._sock.send(json.dumps({"preamble": preamble, "fresh": list(fresh)}).encode())
        except BaseException:
            self.close()
            raise
        if wait:
            self.ready()

    def ready(self, timeout=None):
        """Waits until the server ran its preamble (timeout: the
        constructor's); raises (the server closed) if it failed."""
        if not self._pending:
            return self
        try:
            got = self._read(self._timeout if timeout is None else timeout)
            if got != {"ready": True}:
                raise RuntimeError(f"fork server failed (exit {self.proc.poll()}; its "
                                   f"stderr is this process's): {got}")
        except BaseException:
            self.close()
            raise
        self._pending = False
        return self

    def _read(self, timeout):
        """The server's next message (None: none came in timeout s; 0:
        none waiting), an exit it reports noted in self._exits."""
        import socket
        self._sock.settimeout(timeout)
        try:
            msg = self._sock.recv(1 << 16)
        except (socket.timeout, BlockingIOError):
            return None
        if not msg:
            raise RuntimeError(f"the fork server exited ({self.proc.wait()})")
        got = json.loads(msg)
        if "exit" in got:
            self._exits[got["exit"]] = got["code"]
        return got

    def start(self, code, argv=(), env=None, cwd=None, stderr=False, timeout=60, fds=None,
              session=False):
        """fds: (stdout fd, stderr fd) of the caller's for the child's (a log
        file), no pipes then; session: the child leads a new session and
        process group (os.setsid, as Popen's start_new_session) and gets
        SIGTERM when the server dies (PR_SET_PDEATHSIG); at close() the
        server SIGKILLs its whole group."""
        import socket
        self.ready()
        self.used = True
        pipes = [] if fds else [os.pipe() for _ in range(2 if stderr else 1)]
        try:
            job = {"code": code, "argv": list(argv), "cwd": cwd or os.getcwd(),
                   "env": dict(os.environ if env is None else env), "session": session}
            socket.send_fds(self._sock, [json.dumps(job).encode()],
                            list(fds) if fds else [w for _, w in pipes])
        except BaseException:
            for r, _ in pipes:
                os.close(r)
            raise
        finally:
            for _, w in pipes:
                os.close(w)
        while True:
            got = self._read(timeout)
            if got is None:
                for r, _ in pipes:
                    os.close(r)
                raise subprocess.TimeoutExpired("fork server start", timeout)
            if "pid" in got:
                return ForkedChild(self, got["pid"], *(os.fdopen(r, "r") for r, _ in pipes))

    def run(self, code, argv=(), env=None, cwd=None, timeout=600):
        """start() with both streams piped, to the child's end: its
        (returncode, stdout, stderr); subprocess.TimeoutExpired (the child
        killed) past timeout s."""
        import threading
        child = self.start(code, argv, env, cwd, stderr=True)
        fired = []
        late = threading.Timer(timeout, lambda: (fired.append(1), child.kill()))  # no socket use
        err = []
        t = threading.Thread(target=lambda: err.append(child.stderr.read()), daemon=True)
        late.start()
        t.start()
        try:
            out = child.stdout.read()  # to its end: the child exited (or closed it)
            t.join()
            child.wait()
        except BaseException:
            child.kill()
            child.wait()
            raise
        finally:
            late.cancel()
            child.stdout.close()
            child.stderr.close()
        if fired:
            raise subprocess.TimeoutExpired("forked child", timeout, out, err[0])
        return types.SimpleNamespace(returncode=child.returncode, stdout=out, stderr=err[0])

    def _poll(self, pid, timeout):
        """pid's exit status, waiting up to timeout s (None: still running)."""
        import time
        end = None if timeout is None else time.monotonic() + timeout
        while pid not in self._exits:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                while self._read(0.0) is not None:  # what already came
                    pass
                break
            self._read(left)
        return self._exits.get(pid)

    def close(self):
        if self._sock.fileno() >= 0:
            self._sock.close()  # the server kills its children and exits
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ForkedChild:
    """A ForkServer child: the parts of subprocess.Popen tests use.  Its
    signals go through a pidfd opened at once, not its number (the server
    reaps it when it exits: the number may be another process's then)."""

    def __init__(self, server, pid, stdout=None, stderr=None):
        self._server, self.pid, self.returncode = server, pid, None
        self.stdout, self.stderr = stdout, stderr
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # exited and reaped already
            self._pidfd = -1

    def poll(self):
        if self.returncode is None:
            self.returncode = self._server._poll(self.pid, 0)
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            self.returncode = self._server._poll(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig):
        import signal
        if self._pidfd >= 0 and self.returncode is None:
            try:  # the pidfd names this process: once reaped, ProcessLookupError
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass

    def kill(self):
        import signal
        self.send_signal(signal.SIGKILL)

    def __del__(self):
        if getattr(self, "_pidfd", -1) >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
