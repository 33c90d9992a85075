import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from mooncake_connector.serving import default_port_range

# Third-party test programs (tests/third_party/), vendored unmodified: never
# collected in-process (Mooncake's test_import_structure.py would run here);
# tests/test_mooncake_own_tests.py runs them as subprocesses.  Declared here,
# not in a conftest.py of their own: a second module named conftest would
# shadow this one for the tests that import its helpers.
collect_ignore_glob = ["third_party/*"]


HERE = os.path.dirname(os.path.abspath(__file__))

# Transports a byte-moving test can run on (the `transport` fixture).  By
# default every test keeps the TCP path, so the TCP-specific tests (budgets,
# hostile peers, network faults) test TCP: engines on one host would
# otherwise take the same-host CPU path (docs/architecture.md).  Tests opt
# in with @pytest.mark.parametrize("transport", TRANSPORTS, indirect=True).
os.environ.setdefault("MC_SAME_HOST_CPU", "0")
TRANSPORTS = ["tcp", "same-host-cpu"]
TRANSPORT_ENV = {"tcp": {"MC_SAME_HOST_CPU": "0"}, "same-host-cpu": {"MC_SAME_HOST_CPU": "1"}}

# pytest-xdist (scripts/test.sh runs the suite on two workers, whole files
# each: --dist loadfile): each worker takes its own share of the free-port
# range (MC_PORT_RANGE: mooncake_connector/serving.py's free_port(), which
# every test server's port comes from), so two workers never pick one port
# between a probe and a listen.  The share of MC_PORT_RANGE when it is set
# (CI's parallel stages each have one), else of free_port()'s default range.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")


def _worker_port_share(worker, count, rng=None):
    """LO-HI: worker `worker` (0-based) of `count`'s equal share of `rng`
    (LO-HI) or of free_port()'s default range (the 11,800 ports just below
    the kernel's ephemeral range: serving.default_port_range())."""
    if rng:
        lo, hi = (int(x) for x in rng.split("-"))
    else:
        lo, hi = default_port_range()
    span = (hi - lo + 1) // count
    if span < 64:
        raise ValueError(f"port range {lo}-{hi} too small for {count} pytest-xdist workers")
    return f"{lo + worker * span}-{lo + (worker + 1) * span - 1}"


if XDIST_WORKER and XDIST_WORKER.startswith("gw"):
    os.environ["MC_PORT_RANGE"] = _worker_port_share(
        int(XDIST_WORKER[2:]), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")),
        os.environ.get("MC_PORT_RANGE"))


@pytest.fixture
def transport(request):
    """The transport the test's engines use: "tcp" unless parametrized."""
    return getattr(request, "param", "tcp")


@pytest.fixture
def transport_env(transport, monkeypatch):
    """Sets this process's environment for `transport` (engines started in
    the test, and children) and returns the variables."""
    env = TRANSPORT_ENV[transport]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def same_host_bytes(stats):
    return stats["same_host_cpu_bytes_written"] + stats["same_host_cpu_bytes_read"]
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
def peers(transport):
    """Peer processes on `transport`.  At the end, a same-host-cpu test's
    peers must have moved bytes on that path (and a tcp test's none)."""
    made = []

    def make(**kw):
        kw["env"] = {**TRANSPORT_ENV[transport], **(kw.get("env") or {})}
        p = Peer(**kw)
        made.append(p)
        return p

    yield make
    moved = 0
    # A peer the test killed took its counters with it: one that has exited,
    # or does not answer (a SIGKILLed process with a large mapping can still
    # be tearing down its memory, not yet reaped, under load).
    killed = False
    for p in made:
        if p.proc.poll() is not None:
            killed = True
            continue
        try:
            moved += same_host_bytes(p.call(cmd="engine_stats"))
        except Exception:
            killed = True
    for p in made:
        p.close()
    if transport == "tcp":
        assert moved == 0, "a tcp test moved bytes on the same-host CPU path"
    elif made and not killed:
        assert moved > 0, "a same-host-cpu test moved no bytes on the same-host CPU path"


@pytest.fixture
def metadata_server():
    from mooncake_connector.metadata_server import MetadataServer

    srv = MetadataServer()
    srv.start()
    yield srv
    srv.stop()


# What tests/vllm_harness.py imports of vLLM (the slow part of a producer
# child's start: ~9 s on the 2-core CI host), for the vllm_forks server; not
# mooncake_connector, which each child imports itself, in its own
# environment (MC_SAME_HOST_CPU and the like).
VLLM_PREAMBLE = """
import os
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # as vllm_harness does first
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
import vllm
import vllm.config
import vllm.distributed.kv_transfer.kv_connector.v1.base
import vllm.v1.core.sched.scheduler
import vllm.v1.kv_cache_interface
import vllm.v1.outputs
import vllm.v1.request
import vllm.v1.structured_output
"""
# What test_connector_vllm's and test_doctor's plugin checks import of vLLM
# before each check's fresh process registers the plugin (the plugin_forks
# server): vLLM's CLI parser and its connector factory, the plugin not
# registered yet.
PLUGIN_PREAMBLE = """
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
assert not getattr(KVConnectorFactory.get_connector_class, '_mooncake', False), \\
    'the plugin registered before the jobs ran'
"""
# Fork servers by fixture name: each started (in the background: its
# preamble's import runs beside the tests) when the module before its first
# user begins, or by its first user, and closed after its last one
# (pytest_runtest_teardown below), so that its ~1 GB is not held through the
# rest of the run.
_FORKS = {"vllm_forks": {"server": None, "users_left": 0},
          "plugin_forks": {"server": None, "users_left": 0}}


def _start_forks(name, preamble, env=None, wait=True):
    from forked import ForkServer

    f = _FORKS[name]
    if f["server"] is None:
        f["server"] = ForkServer(preamble, env=env() if env else None, cwd="/", timeout=600,
                                 wait=wait)
    return f["server"]


class _Forks:
    """A fixture's fork server, started at its first start() or run() if
    not before (its preamble in `env`, default this process's environment
    then)."""

    def __init__(self, name, preamble, env=None):
        self.name, self.preamble, self.env = name, preamble, env

    def server(self):
        return _start_forks(self.name, self.preamble, self.env)

    def start(self, *a, **kw):
        return self.server().start(*a, **kw)

    def run(self, *a, **kw):
        return self.server().run(*a, **kw)


@pytest.fixture(scope="session")
def vllm_forks():
    """forked.ForkServer's start(code, argv) and run(...) from a server that
    has imported VLLM_PREAMBLE: a fresh `python -c code argv...` child (a
    producer process the test stops, kills, reads) without a vLLM import of
    its own.  One server for every test that uses it (test_push's,
    test_push_layer_load's and test_push_layer_read's producer processes,
    test_push_gate's child pytest with the libcuda stand-in)."""
    pytest.importorskip("vllm")
    return _Forks("vllm_forks", VLLM_PREAMBLE)


def _plugin_env():
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}  # as vllm_harness sets it
    env.pop("_MOONCAKE_CONNECTOR_ANNOUNCED", None)
    return env


_FORK_SPECS = {"vllm_forks": (VLLM_PREAMBLE, None),
               "plugin_forks": (PLUGIN_PREAMBLE, _plugin_env)}
_HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="session")
def plugin_forks():
    """The same for the plugin checks' fresh processes (test_connector_vllm's
    and test_doctor's: one vLLM import for both), from a server that has
    imported PLUGIN_PREAMBLE (in this environment, VLLM_TARGET_DEVICE=cpu,
    no _MOONCAKE_CONNECTOR_ANNOUNCED)."""
    pytest.importorskip("vllm")
    return _Forks("plugin_forks", PLUGIN_PREAMBLE, _plugin_env)


# For each test module (in run order), the fork servers its tests use.
_MODULE_FORKS = []
# The same by module under pytest-xdist (run order unknown).
_XDIST_MODULE_FORKS = {}
_MODULES_BEGUN = set()


def pytest_collection_finish(session):
    if XDIST_WORKER:
        # A worker collects every test but runs the files the controller
        # hands it, in an order known only as they come: its fork servers
        # start at the first test of a module that uses them (in the
        # background, see pytest_runtest_setup) and end with the worker.
        for f in _FORKS.values():
            f["users_left"] = float("inf")
        for i in session.items:
            mod = i.nodeid.split("::")[0]
            names = {n for n in _FORKS if n in getattr(i, "fixturenames", ())}
            _XDIST_MODULE_FORKS.setdefault(mod, set()).update(names)
    else:
        for name, f in _FORKS.items():
            f["users_left"] = sum(name in getattr(i, "fixturenames", ()) for i in session.items)
        for i in session.items:
            names = {n for n in _FORKS if n in getattr(i, "fixturenames", ())}
            if not _MODULE_FORKS or _MODULE_FORKS[-1][0] != i.nodeid.split("::")[0]:
                _MODULE_FORKS.append((i.nodeid.split("::")[0], set()))
            _MODULE_FORKS[-1][1].update(names)
    # The e2e tests' vLLM fork server (tests/e2e_fixtures.py) imports in the
    # background from now on, beside the tests before the first e2e module.
    if any("tiny_model_dir" in getattr(i, "fixturenames", ()) for i in session.items):
        from e2e_fixtures import prestart_vllm_forks
        prestart_vllm_forks()


def pytest_runtest_setup(item):
    """At a module's first test: the fork servers this module or the next
    one uses start in the background (their ~10-30 s imports then overlap
    this module's tests instead of delaying the first user's)."""
    mod = item.nodeid.split("::")[0]
    if XDIST_WORKER:
        if mod in _MODULES_BEGUN:
            return
        _MODULES_BEGUN.add(mod)
        wanted = _XDIST_MODULE_FORKS.get(mod, set())
    else:
        mods = [m for m, _ in _MODULE_FORKS]
        if mod not in mods or mod in _MODULES_BEGUN:
            return
        _MODULES_BEGUN.add(mod)
        k = mods.index(mod)
        wanted = set().union(*(names for _, names in _MODULE_FORKS[k:k + 2]))
    for name in sorted(wanted):
        if _FORKS[name]["server"] is None and _FORKS[name]["users_left"] > 0 and _HAVE_VLLM:
            preamble, env = _FORK_SPECS[name]
            try:
                _start_forks(name, preamble, env, wait=False)
            except Exception:  # its first user starts it again, and says why
                pass


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    for name, f in _FORKS.items():
        if name in getattr(item, "fixturenames", ()):
            f["users_left"] -= 1
            if f["users_left"] <= 0:
                _close_fork_server(name)


# Seconds of set-up, call and tear-down per test file (in the process that
# reports: pytest-xdist's controller gets every worker's reports), for the
# run's summary: the files CI's time goes to.
_MODULE_SECONDS = {}


# pytest-xdist's controller: when each worker's last report came (seconds
# since the first report), to show how evenly the files were shared.
_WORKER_LAST = {}
_FIRST_REPORT = []


def pytest_runtest_logreport(report):
    mod = report.nodeid.split("::")[0]
    _MODULE_SECONDS[mod] = _MODULE_SECONDS.get(mod, 0.0) + (report.duration or 0.0)
    node = getattr(report, "node", None)
    gw = getattr(getattr(node, "gateway", None), "id", None)
    if gw:
        now = time.monotonic()
        if not _FIRST_REPORT:
            _FIRST_REPORT.append(now)
        _WORKER_LAST[gw] = now - _FIRST_REPORT[0]


def pytest_terminal_summary(terminalreporter):
    from e2e_fixtures import vllm_forks_summary
    line = vllm_forks_summary()
    if line:
        terminalreporter.write_line(line)
    for gw, line in sorted(_WORKER_FORK_LINES.items()):
        terminalreporter.write_line(f"{gw}: {line}")
    if _MODULE_SECONDS and not XDIST_WORKER:
        top = sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1])
        n = os.environ.get("MC_MODULE_TIMES", "30")
        n = int(n) if n.isdigit() else 30
        if n > 0:
            total = sum(_MODULE_SECONDS.values())
            terminalreporter.write_sep("=", f"slowest {min(n, len(top))} test files "
                                       f"(set-up + call + tear-down; all {len(top)}: "
                                       f"{total:.0f} s)")
            for mod, secs in top[:n]:
                terminalreporter.write_line(f"{secs:8.1f}s  {mod}")
        if _WORKER_LAST:
            terminalreporter.write_line(
                "pytest-xdist workers' last report (s after the first): " + ", ".join(
                    f"{gw} {t:.0f}" for gw, t in sorted(_WORKER_LAST.items())))


def pytest_sessionfinish(session):
    for name in _FORKS:
        _close_fork_server(name)
    from e2e_fixtures import close_vllm_forks, vllm_forks_summary
    close_vllm_forks()
    if XDIST_WORKER and hasattr(session.config, "workeroutput"):
        # for the controller's summary (pytest_testnodedown below)
        session.config.workeroutput["mc_vllm_forks"] = vllm_forks_summary() or ""


# pytest-xdist's controller: each worker's fork-server line, for the summary
# (a worker's own terminal summary is not shown).
_WORKER_FORK_LINES = {}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    line = getattr(node, "workeroutput", {}).get("mc_vllm_forks")
    if line:
        _WORKER_FORK_LINES[getattr(getattr(node, "gateway", None), "id", "?")] = line


def _close_fork_server(name):
    srv, _FORKS[name]["server"] = _FORKS[name]["server"], None
    if srv is not None:
        srv.close()


def closing_maker(new):
    """Generator for a fixture that makes things: yields make(*a, **kw),
    new(*a, **kw) kept, and closes every one made after the test."""
    made = []

    def make(*a, **kw):
        x = new(*a, **kw)
        made.append(x)
        return x

    yield make
    for x in made:
        x.close()


def wait_until(pred, timeout=5.0, step=0.02):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(step)
    return False


def sigstop(pid, timeout=5.0):
    """SIGSTOPs process pid and returns once every thread of it is stopped
    (/proc says "T"; a system call in progress, a long copy, ends first):
    it runs no more code until SIGCONT, though its kernel still takes and
    acknowledges TCP bytes."""
    import signal
    os.kill(pid, signal.SIGSTOP)

    def stopped():
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
                        return False
            except FileNotFoundError:  # a thread that ended meanwhile
                pass
        return True
    assert wait_until(stopped, timeout=timeout, step=0.001), f"process {pid} did not stop"


def stop_peer_mid_batch(waiter, victim, start, landed, finished, what, tries=5):
    """Stops peer `victim` while a background batch on peer `waiter` is
    under way: start() resets the landing area and starts the batch (bg=True),
    landed() says its first block landed; victim is then SIGSTOPped and can
    end the batch no more, only its death can.  Should the batch still have
    ended before the stop (it raced ahead; a fixed sleep did on loaded
    hosts), checks it ended as `finished` (waiter's bg_result), resumes
    victim and tries again, `tries` times in all; then fails the test, never
    skips it.  Returns with victim stopped and the batch running."""
    import signal
    for _ in range(tries):
        start()
        assert wait_until(landed, timeout=10, step=0.001), f"the {what}'s first block never landed"
        sigstop(victim.pid)
        r = waiter.call(cmd="bg_result", wait=0.3)
        if r.get("running"):
            return
        assert r == finished, r
        os.kill(victim.pid, signal.SIGCONT)
    pytest.fail(f"the {what} ended before its peer stopped, {tries} times")


def in_threads(fn, n):
    """fn(0) .. fn(n - 1), each in a thread of its own, all at once; returns
    when every one has ended."""
    import threading

    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def cuda_torch():
    """torch, where it sees a CUDA GPU; else the calling test module is
    skipped, saying which of the two is missing."""
    torch = pytest.importorskip("torch", reason="GPU tests need torch")
    if not torch.cuda.is_available():
        pytest.skip("GPU tests need a CUDA GPU (torch.cuda.is_available() is False)",
                    allow_module_level=True)
    return torch


def http(method, url, data=None, timeout=10):
    """(status, body) of one request, straight (no proxy from the
    environment), without raising on HTTP errors."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=data, method=method)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def recv_to_eof(sock):
    """Every byte sock receives until the other side closes."""
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def has_ipv6_loopback():
    """This host can listen on ::1 (IPv6 tests skip without it)."""
    import socket
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def drip_header(port, head, timeout=10.0, drip=b"X-a: b\r\n", every=0.3):
    """A slow-loris client: sends head (a request line and header lines,
    never the blank line that ends them) to 127.0.0.1:port, then `drip`
    every `every` s (one more header line; or a byte of an unfinished
    header value); the seconds until the server closed the connection (a
    read saw its end, or a read or send was reset or refused), or None when
    it had not after timeout."""
    import socket

    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(head)
        s.settimeout(every)
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            try:
                if s.recv(100) == b"":
                    return time.monotonic() - t0
            except socket.timeout:
                try:
                    s.sendall(drip)
                except ConnectionError:  # reset, or a broken pipe: closed
                    return time.monotonic() - t0
            except ConnectionError:
                return time.monotonic() - t0
    return None


def send_head_only(port, head, timeout=20.0):
    """A client announcing more body than it sends: sends head (a request's
    whole header, and the first few bytes of its body) to 127.0.0.1:port,
    then only reads.  Returns what came back until the server closed the
    connection, and the seconds that took (past timeout: socket.timeout)."""
    import socket

    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(head)
        s.settimeout(timeout)
        t0 = time.monotonic()
        try:
            data = recv_to_eof(s)
        except ConnectionResetError:
            data = b""
        return data, time.monotonic() - t0


def outward_addr():
    """This host's IPv4 address towards the outside (a UDP connect sends
    nothing), or None where that is loopback or there is no route."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.254", 9))
            a = s.getsockname()[0]
        except OSError:
            return None
    return None if a.startswith("127.") else a


@pytest.fixture
def engine():
    """One TransferEngine on 127.0.0.1 (P2P handshake, TCP), closed after
    the test."""
    import mooncake_connector as mc

    e = mc.TransferEngine()
    e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    yield e
    e.close()


@contextlib.contextmanager
def local_engines(n=2):
    """n TransferEngines on 127.0.0.1 (P2P handshake, TCP unless the test's
    environment picks the same-host CPU path), all closed on the way out,
    also when one of them fails to start."""
    import mooncake_connector as mc

    made = []
    try:
        for _ in range(n):
            made.append(mc.TransferEngine())
            made[-1].initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        yield made
    finally:
        for e in made:
            e.close()


def have_netns():
    return (os.geteuid() == 0 and shutil.which("ip") is not None
            and subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0)


# Session fixtures of the end-to-end serving tests (tests/test_e2e_*.py).
from e2e_fixtures import deployment, tiny_model_dir  # noqa: E402,F401


def recv_head(sock):
    """Bytes sock receives up to and including the first blank line (one
    response's status line and headers; an interim "100 Continue" is one)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(1)
        if not chunk:
            return data
        data += chunk
    return data
