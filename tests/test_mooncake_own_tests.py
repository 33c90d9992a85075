"""Mooncake's own transfer-engine test programs, run unmodified on our engine.

The programs (tests/third_party/mooncake/, vendored byte for byte, sha256 in
SHA256SUMS, checked here first) do ``from mooncake.engine import
TransferEngine``; they run as subprocesses with ``MC_MOONCAKE_SHIM=1`` so that
import is served by our package (docs/compat.md): not even the import is
changed.  Everything they need comes through the environment variables they
read (ports, ``MC_METADATA_SERVER``, and ``MC_FORCE_TCP=1`` as Mooncake's own
CI sets it).

* mooncake-wheel/tests: the target/initiator pair (6 unittest checks) on our
  metadata server, on Mooncake's real metadata server program (from Mooncake's
  wheel, tests/mooncake_wheel.py; skipped with the reason offline) and with
  P2PHANDSHAKE (also on the same-host CPU path); the import test.
* mooncake-transfer-engine/tests/fault-tolerant: server_test.py and
  client_test.py, orchestrated as their fault_test.py describes (it cannot run
  unattended: see docs/compat.md).

Results, and how real Mooncake does on the same programs: docs/compat.md,
"Mooncake's own tests"."""
import glob
import hashlib
import os
import re
import socket
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mooncake_wheel import find_server  # noqa: E402
from mooncake_shim_env import no_real_mooncake, shim_env  # noqa: E402

from mooncake_connector.serving import free_port  # noqa: E402

TP = os.path.join(HERE, "third_party", "mooncake")
WHEEL_TESTS = os.path.join(TP, "mooncake-wheel", "tests")
FAULT = os.path.join(TP, "mooncake-transfer-engine", "tests", "fault-tolerant")
INITIATOR_TESTS = ("test_async_batch_write_read", "test_async_submit_to_unknown_peer_returns_zero",
                   "test_batch_write_read", "test_random_write_circle_times",
                   "test_send_probe_reachable_peer", "test_send_probe_unknown_peer")


def test_vendored_programs_are_unmodified():
    with open(os.path.join(TP, "SHA256SUMS")) as f:
        sums = dict(reversed(ln.split(None, 1)) for ln in f.read().splitlines() if ln.strip())
    sums = {k.strip(): v for k, v in sums.items()}
    present = {os.path.relpath(p, TP) for p in glob.glob(os.path.join(TP, "**", "*"),
                                                          recursive=True)
               if os.path.isfile(p) and "__pycache__" not in p}
    assert present - {"SHA256SUMS", "README.md"} == set(sums), "files differ from SHA256SUMS"
    for rel, want in sums.items():
        with open(os.path.join(TP, rel), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == want, f"{rel} was modified"


@pytest.fixture(scope="module", autouse=True)
def _no_real_mooncake():
    no_real_mooncake()


def _unittest_results(err):
    """{test name: ok|FAIL|ERROR} from the stderr of `python prog.py -v`
    (log lines of the engine may come between a test's name and its
    verdict)."""
    err = err.split("\n" + "=" * 70, 1)[0].split("\n" + "-" * 70, 1)[0]
    heads = list(re.finditer(r"^(test_\w+) \(", err, re.M))
    res = {}
    for i, h in enumerate(heads):
        seg = err[h.end():heads[i + 1].start() if i + 1 < len(heads) else len(err)]
        m = re.search(r"(?:\.\.\. |^)(ok|FAIL|ERROR)$", seg, re.M)
        res[h.group(1)] = m.group(1) if m else "?"
    return res


@pytest.fixture
def mooncake_metadata_server(tmp_path):
    path, why = find_server()
    if not path:
        pytest.skip(why)
    port = free_port()
    log = open(tmp_path / "mooncake-metadata.log", "w")
    p = subprocess.Popen([sys.executable, path, "--host", "127.0.0.1", "--port", str(port)],
                         stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/metadata"
    end = time.time() + 20
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            assert p.poll() is None and time.time() < end, "Mooncake's metadata server did not start"
            time.sleep(0.05)
    yield url
    p.terminate()
    p.wait(10)
    log.close()


def _run_pair(tmp_path, metadata, extra=None):
    tname, iname = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    env = shim_env(tmp_path, TARGET_SERVER_NAME=tname, INITIATOR_SERVER_NAME=iname,
                    MC_METADATA_SERVER=metadata, PROTOCOL="tcp", **(extra or {}))
    tlog = open(tmp_path / "target.log", "w+")
    # The target ends in `while True: pass` (it spins a core): killed as soon
    # as the initiator is done.
    target = subprocess.Popen([sys.executable, "transfer_engine_target.py"], cwd=WHEEL_TESTS,
                              env=env, stdout=tlog, stderr=subprocess.STDOUT)
    try:
        end = time.time() + 30
        while True:
            tlog.seek(0)
            out = tlog.read()
            if f"Target server ready at {tname}" in out:
                break
            assert target.poll() is None, f"the target exited:\n{out}"
            assert time.time() < end, f"the target did not get ready:\n{out}"
            time.sleep(0.05)
        r = subprocess.run([sys.executable, "transfer_engine_initiator_test.py", "-v"],
                           cwd=WHEEL_TESTS, env=env, capture_output=True, text=True, timeout=120)
    finally:
        target.kill()
        target.wait(10)
        tlog.close()
    return r, out


@pytest.mark.parametrize("mode", ["ours", "mooncake", "p2p", "p2p-same-host-cpu"])
def test_transfer_engine_target_and_initiator(mode, tmp_path, request):
    """Mooncake's CI runs this pair (scripts/run_tests.sh) with its HTTP metadata
    server and MC_FORCE_TCP=true; here also on ours and with P2PHANDSHAKE."""
    extra = {}
    if mode == "ours":
        metadata = request.getfixturevalue("metadata_server").url
    elif mode == "mooncake":
        metadata = request.getfixturevalue("mooncake_metadata_server")
    else:
        metadata = "P2PHANDSHAKE"
        if mode == "p2p-same-host-cpu":
            extra = {"MC_SAME_HOST_CPU": "1"}
    r, target_out = _run_pair(tmp_path, metadata, extra)
    out = r.stdout + r.stderr
    assert "mooncake.engine is provided by mooncake_connector" in target_out + out
    results = _unittest_results(r.stderr)
    assert results == {t: "ok" for t in INITIATOR_TESTS}, out
    assert r.returncode == 0 and re.search(r"^Ran 6 tests in .*\n\nOK$", out, re.M), out
    # Mooncake's default CIRCLE (1000 write/read round trips) ran.
    assert "[✓] 1000 iterations of random write-read passed successfully." in out, out


def test_import_structure(tmp_path):
    """2 of its 3 checks: mooncake.engine's names, and Mooncake's top-level
    BufferPool alias (None without Mooncake Store, as in a Mooncake built
    without its store).  The third imports mooncake.store (Mooncake Store's
    distributed object store), which our package does not provide."""
    r = subprocess.run([sys.executable, "test_import_structure.py", "-v"], cwd=WHEEL_TESTS,
                       env=shim_env(tmp_path), capture_output=True, text=True, timeout=60)
    out = r.stdout + r.stderr
    assert _unittest_results(r.stderr) == {"test_direct_import": "ok",
                                      "test_top_level_buffer_pool_alias": "ok",
                                      "test_new_import_structure": "ERROR"}, out
    assert "ModuleNotFoundError: No module named 'mooncake.store'" in out, out
    assert "Ran 3 tests" in out and "FAILED (errors=1)" in out, out


def _port_free(port):
    for host in ("0.0.0.0", "127.0.0.1"):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def test_fault_tolerant_server_and_client(tmp_path):
    """server_test.py + client_test.py as fault_test.py runs them (server
    first, client, then the server killed).  Their wrapper names the server
    "localhost:10010:<rpc port>" (its hostname already has a port), which is
    not host:port: the client's first transfer fails with -1 and the wrapper
    raises, on our engine exactly as on Mooncake's (docs/compat.md).  What is
    checked: both start on our engine (protocol "rdma" with MC_FORCE_TCP=1,
    P2PHANDSHAKE), the buffer info crosses, the bad segment name gets a clear
    error, no crash or hang, the server outlives the client and stops on
    SIGTERM."""
    for port in (5555, 10010, 10011):  # fixed in the programs
        if not _port_free(port):
            pytest.skip(f"port {port}, fixed in Mooncake's fault-tolerant tests, is in use")
    env = shim_env(tmp_path)
    slog = open(tmp_path / "server.log", "w+")
    server = subprocess.Popen([sys.executable, "server_test.py"], cwd=FAULT, env=env,
                              stdin=subprocess.PIPE, stdout=slog, stderr=subprocess.STDOUT)
    try:
        end = time.time() + 30
        while True:  # its engine up (then it waits for the client on port 5555)
            slog.seek(0)
            sout = slog.read()
            if "Server initialized with session ID" in sout:
                break
            assert server.poll() is None, f"the server exited:\n{sout}"
            assert time.time() < end, f"the server did not start:\n{sout}"
            time.sleep(0.05)
        client = subprocess.run([sys.executable, "client_test.py"], cwd=FAULT, env=env,
                                capture_output=True, text=True, timeout=60)
        cout = client.stdout + client.stderr
        assert server.poll() is None, "the server exited with the client"
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
            pytest.fail("the server did not stop on SIGTERM")
        slog.seek(0)
        sout = slog.read()
        slog.close()
    assert "Server initialized with session ID: localhost:10010:10010" in sout, sout
    assert "Buffer information sent to client" in sout, sout
    assert "Received server info - Session ID: localhost:10010:10010" in cout, cout
    assert "Client initialized with session ID: localhost:10011:10011" in cout, cout
    assert ('segment "localhost:10010:10010" is not "host:port"' in cout
            and "RuntimeError: Mooncake Transfer Engine Return Error." in cout), cout
    assert client.returncode == 1 and "Transfer successful!" not in cout, cout
