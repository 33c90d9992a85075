"""Start, health-check and stop the processes of a disaggregated deployment.

Shared by the end-to-end tests, the serving demo and the serving benchmark:
vLLM OpenAI servers (`python -m vllm.entrypoints.openai.api_server`), the
embedded metadata server and our proxy, each as its own process group with
its output in a log file.  Waits have timeouts and fail with the log's tail;
stop() kills the whole process group (vLLM's API server, engine core and
worker processes) and waits for it.
"""
import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from mooncake_connector.hostport import url_of

#: vLLM flags every server here gets (docs/vllm-cpu.md): fp32 (exact
#: comparisons), eager mode (30-100 s start-up instead of minutes), KV block
#: size 32 (the CPU backend needs a multiple of 32), an explicit KV cache size,
#: no prefix caching (every prompt token is either computed or transferred:
#: the stats then say which), per-request cached-token counts, and the worker
#: inside the engine-core process (uni executor; see VLLM_ENV).
BASE_VLLM_ARGS = ("--dtype", "float32", "--enforce-eager", "--block-size", "32",
                  "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
                  "--disable-uvicorn-access-log", "--distributed-executor-backend", "uni")

#: Offline, CPU, no telemetry.  OpenMP: vLLM's default ("auto") pins each
#: server's worker to the same core (core 0, the others "reserved"), so three
#: servers on one host would share one core; "nobind" and one thread each
#: lets the kernel spread them (the tiny model gains nothing from more).
#: VLLM_ENABLE_V1_MULTIPROCESSING=0: otherwise the CPU platform turns the uni
#: executor back into mp, and each server is three processes (API server,
#: engine core, worker) instead of two, each importing torch and vLLM.
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


class StartError(RuntimeError):
    """A server did not become healthy; the message has its log's tail."""


def ephemeral_low():
    """The lowest port the kernel hands out to unbound sockets (connect(),
    bind to 0): /proc/sys/net/ipv4/ip_local_port_range, else Linux's 32768."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def default_port_range(eph=None):
    """(LO, HI): the range free_port() picks from without MC_PORT_RANGE, the
    11,800 ports just below the kernel's ephemeral range that starts at
    `eph` (default: ephemeral_low()).  tests/conftest.py splits it among
    pytest-xdist workers."""
    if eph is None:
        eph = ephemeral_low()
    return max(1024, eph - 12000), eph - 200


#: mooncake.json's rule for two engine ports on one host: at least this far
#: apart (csrc/config/config.c, apply_port_rules).
PORT_DISTANCE = 50


def free_port(span=1, away=()):
    """A port free now on every local address, for a server started later:
    with MC_PORT_RANGE (`LO-HI`, e.g. 43000-45999: several people sharing
    one host) a random free one in that range; else a random free one just
    below the kernel's ephemeral range, so that no outgoing connection or
    bind(0) of another process (gloo, zmq, our own clients) takes it
    between now and the server's listen; the kernel's pick as a last
    resort.  Never one this process has handed out before.

    span: the first of `span` consecutive free ports, all handed out (a TP
    or PP side listens at port + rank).  away: ports or "host:port"s the
    result must be at least PORT_DISTANCE from (two engines on one host)."""
    if span < 1:
        raise ValueError(f"span={span!r}: expected 1 or more")
    away = [int(str(a).rsplit(":", 1)[-1]) for a in away]
    rng = os.environ.get("MC_PORT_RANGE")
    if rng:
        try:
            lo, hi = (int(x) for x in rng.split("-"))
            if not 0 < lo <= hi < 65536:
                raise ValueError
        except ValueError:
            raise ValueError(f"MC_PORT_RANGE={rng!r}: expected LO-HI, e.g. 43000-45999") from None
        port = _free_in(lo, hi, span, away)
        if port is None:
            raise RuntimeError(f"MC_PORT_RANGE={rng}: no free port in it"
                               + (f" (a run of {span})" if span > 1 else "")
                               + (f" {PORT_DISTANCE} away from {away}" if away else ""))
        return port
    eph = ephemeral_low()
    if eph > 3000:
        port = _free_in(*default_port_range(eph), span, away)
        if port is not None:
            return port
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("0.0.0.0", 0))
            port = s.getsockname()[1]
        if _usable(port, span, away):
            claim_ports(range(port, port + span))
            return port
    raise RuntimeError(f"no run of {span} free port(s) found"
                       + (f" {PORT_DISTANCE} away from {away}" if away else ""))


# Ports this process has handed out for servers not listening yet: never
# handed out twice (a deployment picks all its ports before it starts any
# server, so a bind test alone would give the metadata server's port to an
# engine too).
_CLAIMED = set()


def claim_ports(ports):
    _CLAIMED.update(ports)


def port_claimed(port):
    return port in _CLAIMED


def _usable(port, span, away):
    """port .. port+span-1 all below 65536, not handed out, bindable on
    0.0.0.0 (as the engine binds: a listener on any local address blocks
    it), and port at least PORT_DISTANCE from each of `away`."""
    if port + span > 65536 or any(abs(port - a) < PORT_DISTANCE for a in away):
        return False
    for q in range(port, port + span):
        if q in _CLAIMED:
            return False
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", q))
            except OSError:
                return False
    return True


def _free_in(lo, hi, span=1, away=()):
    top = hi - span + 1
    if top < lo:
        return None
    for port in random.sample(range(lo, top + 1), min(top - lo + 1, 2000)):
        if _usable(port, span, away):
            claim_ports(range(port, port + span))
            return port
    return None


def log_tail(path, lines=40):
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(text.splitlines()[-lines:])


def http_get(url, timeout=5.0):
    """(status, body text); status 0 with the reason when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as e:
        return 0, str(e)


#: vLLM API servers' module (vllm_server's command: python -m VLLM_MAIN ...).
VLLM_MAIN = "vllm.entrypoints.openai.api_server"

#: None, or launch(cmd, env, cwd, log_fd) that Process.start() asks first for
#: a vLLM server (vllm_server's): a handle like subprocess.Popen's (pid,
#: poll, wait, returncode) of a process running cmd in a session of its own
#: (its group is the one stop() signals), stdout and stderr on log_fd; or
#: None, and Popen starts it.  The tests set it (tests/e2e_fixtures.py: a
#: fork server that has imported vLLM once for all their servers).
vllm_launcher = None


class Process:
    """One server process (and its children) with a log file."""

    def __init__(self, name, cmd, log_path, env=None, health_url=None, cwd=None,
                 stop_grace=15.0):
        """stop_grace: stop()'s default seconds between SIGTERM and SIGKILL."""
        self.name, self.cmd, self.log_path = name, list(cmd), log_path
        self.stop_grace = stop_grace
        self.health_url = health_url
        self.env = dict(os.environ, **(env or {}))
        self.env.setdefault("PYTHONSAFEPATH", "1")
        # Never the caller's directory: from a source checkout `python -m ...`
        # would import ./mooncake_connector (no compiled _core) instead of the
        # installed package.
        self.cwd = cwd or os.path.dirname(os.path.abspath(log_path))
        self.proc = None
        self.started_at = None
        self.ready_s = None
        self.vllm = False  # a vLLM server (vllm_server): vllm_launcher may start it

    def start(self):
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self.name} is already running (pid {self.proc.pid})")
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        log = open(self.log_path, "ab")
        log.write(f"\n===== {time.strftime('%H:%M:%S')} start {self.name}: "
                  f"{' '.join(self.cmd)}\n".encode())
        log.flush()
        try:
            launch = vllm_launcher if self.vllm else None
            self.proc = launch(self.cmd, self.env, self.cwd, log.fileno()) if launch else None
            if self.proc is None:
                self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=self.env,
                                             cwd=self.cwd, start_new_session=True,
                                             preexec_fn=_die_with_parent)
        finally:
            log.close()
        self.started_at = time.monotonic()
        self.ready_s = None
        return self

    @property
    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout):
        """Polls health_url until it answers 200; raises StartError if the
        process exits or timeout (s) passes."""
        deadline = time.monotonic() + timeout
        last = ""
        while True:
            if not self.alive:
                rc = None if self.proc is None else self.proc.returncode
                raise StartError(f"{self.name} exited (status {rc}) before it was ready; "
                                 f"last lines of {self.log_path}:\n{log_tail(self.log_path)}")
            status, body = http_get(self.health_url, timeout=3)
            if status == 200:
                self.ready_s = time.monotonic() - self.started_at
                return self
            last = f"{status} {body[:200]}"
            if time.monotonic() >= deadline:
                self.stop()
                raise StartError(f"{self.name} not healthy at {self.health_url} after "
                                 f"{timeout:.0f} s (last answer: {last}); last lines of "
                                 f"{self.log_path}:\n{log_tail(self.log_path)}")
            time.sleep(0.5)

    def stop(self, grace=None, sig=signal.SIGTERM):
        """Signals the process group, waits up to grace s (None: stop_grace)
        for every member to exit, then SIGKILLs what is left and waits for
        that too."""
        if self.proc is None:
            return
        if grace is None:
            grace = self.stop_grace
        pgid = self.proc.pid  # start_new_session: the group id is the pid
        deadline = time.monotonic() + grace
        _killpg(pgid, sig)
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        if self.proc.poll() is None or _group_alive(pgid, deadline - time.monotonic()):
            _killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            if _group_alive(pgid, 10.0):
                print(f"warning: process group {pgid} of {self.name} survived SIGKILL",
                      file=sys.stderr)

    def kill(self):
        """SIGKILL to the whole group at once (a crash, for fault tests)."""
        self.stop(grace=0.0, sig=signal.SIGKILL)


try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def _die_with_parent():
    """In the child before exec: SIGTERM it when the process that started it
    dies (Linux PR_SET_PDEATHSIG), so a killed test run or demo leaves no
    servers behind although each server has its own session (vLLM's engine
    processes follow their API server).  Nothing here may import or lock."""
    if _prctl is not None:
        _prctl(1, signal.SIGTERM, 0, 0, 0)


def _killpg(pgid, sig):
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid, timeout):
    """Whether the group still has members after up to timeout s."""
    deadline = time.monotonic() + max(0.0, timeout)
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.1)


def vllm_server(name, model, port, log_path, kv_transfer_config=None, env=None,
                max_model_len=2048, kv_cache_bytes=64 << 20, extra_args=(), python=None,
                prefix_caching=False, host="127.0.0.1"):
    """A vLLM OpenAI API server on the CPU backend (not started yet).
    prefix_caching: vLLM's default (on) instead of BASE_VLLM_ARGS's
    --no-enable-prefix-caching, as users run the seed's commands.
    host: the address it listens on (e.g. "::1")."""
    base = [a for a in BASE_VLLM_ARGS if not (prefix_caching and
                                               a == "--no-enable-prefix-caching")]
    cmd = [python or sys.executable, "-m", VLLM_MAIN,
           "--model", model, "--served-model-name", "tiny", "--host", host,
           "--port", str(port), "--max-model-len", str(max_model_len),
           "--kv-cache-memory-bytes", str(kv_cache_bytes), *base, *extra_args]
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    p = Process(name, cmd, log_path, env=dict(VLLM_ENV, **(env or {})),
                health_url=f"{url_of(host, port)}/health")
    p.url = url_of(host, port)
    p.vllm = True
    return p


def metadata_server(port, log_path, python=None, host="127.0.0.1"):
    p = Process("metadata server", [python or sys.executable, "-m",
                                    "mooncake_connector.metadata_server", "--host", host,
                                    "--port", str(port)],
                log_path, health_url=f"{url_of(host, port)}/health")
    p.url = f"{url_of(host, port)}/metadata"
    return p


def proxy(prefill_urls, decode_urls, port, log_path, flow="a", timeout_s=600, python=None,
          first_token="prefill", passthrough=None, name=None, extra_args=(), host="127.0.0.1"):
    """Our proxy in front of prefill/decode servers, or (passthrough: a list
    of URLs) in front of one upstream with no prefill step; listening on
    host."""
    if passthrough:
        args, name = ["--passthrough", *passthrough], name or "proxy (pass-through)"
    else:
        args = ["--flow", flow, "--first-token", first_token, "--prefill", *prefill_urls,
                "--decode", *decode_urls, *extra_args]
        name = name or f"proxy (flow {flow})"
    p = Process(name, [python or sys.executable, "-m", "mooncake_connector.proxy", "--host",
                       host, "--port", str(port), "--timeout", str(timeout_s), *args],
                log_path, health_url=f"{url_of(host, port)}/health")
    p.url = url_of(host, port)
    return p


def start_all(processes, timeout):
    """Starts every process, then waits for each (they start in parallel).
    On a failure the ones already started are stopped before raising."""
    try:
        for p in processes:
            if not p.alive:
                p.start()
        deadline = time.monotonic() + timeout
        for p in processes:
            p.wait_ready(max(1.0, deadline - time.monotonic()))
    except BaseException:
        stop_all(processes)
        raise
    return processes


def stop_all(processes):
    """SIGTERM to every group first (they shut down in parallel), then each
    is waited for (and SIGKILLed after its grace period)."""
    processes = [p for p in processes if p.proc is not None]
    for p in processes:
        if p.proc.poll() is None:
            _killpg(p.proc.pid, signal.SIGTERM)
    for p in reversed(processes):
        try:
            p.stop()
        except Exception as e:  # keep stopping the others
            print(f"stopping {p.name}: {e!r}", file=sys.stderr)
