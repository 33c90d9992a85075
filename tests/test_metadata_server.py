"""The embedded metadata server (mooncake_connector.metadata_server) and the C
metadata client (mooncake_connector.MetadataClient) against each other and
against misbehaving servers."""
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import mooncake_connector as mc
from mooncake_connector.metadata_server import MetadataServer, MetadataStore, StoreFull
from mooncake_connector.serving import free_port
from conftest import (drip_header, has_ipv6_loopback, http, in_threads, recv_head,
                      send_head_only)

pytestmark = pytest.mark.timeout(60)

URL_LINE = re.compile(r"^metadata server listening on (http://\S+)$")


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    # An http_proxy in the environment must not capture loopback requests.
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


@pytest.fixture(scope="module")
def server():
    with MetadataServer() as srv:
        yield srv


@pytest.fixture
def client(server):
    with mc.MetadataClient(server.url) as c:
        yield c


# ---- in-process server + C client ----

def test_url_and_port(server):
    assert server.port > 0
    assert server.url == f"http://127.0.0.1:{server.port}/metadata"
    assert server.running


def test_round_trip(client, server):
    key = "mooncake/ram/10.0.0.1:15123"
    value = b'{"name":"10.0.0.1:15123","protocol":"tcp","buffers":[]}'
    client.put(key, value)
    assert client.get(key) == value
    assert server.store.get(key) == value
    client.put(key, '{"v":2}')  # str is sent as UTF-8
    assert client.get(key) == b'{"v":2}'
    client.delete(key)
    assert client.get(key) is None
    assert key not in server.store


def test_missing_key_is_none_and_delete_is_idempotent(client):
    assert client.get("mooncake/ram/never-written") is None
    client.delete("mooncake/ram/never-written")  # 404 from the server: fine


def test_awkward_keys_survive_escaping(client, server):
    keys = ["mooncake/rpc_meta/a b:c", "k&x=1?y#z%20", "mooncake/ram/ünï/cödé"]
    for i, key in enumerate(keys):
        client.put(key, f'{{"i":{i}}}')
    for i, key in enumerate(keys):
        assert client.get(key) == f'{{"i":{i}}}'.encode()
        assert key in server.store  # stored under the decoded key
        client.delete(key)


def test_value_at_cap_round_trips(client):
    value = b'"' + b"x" * ((16 << 20) - 2) + b'"'
    client.put("big", value)
    assert client.get("big") == value
    client.delete("big")


def test_value_over_cap_rejected_by_server(client):
    with pytest.raises(mc.MetadataError, match=r"HTTP 413 to PUT key \"big\""):
        client.put("big", b"x" * ((16 << 20) + 1))
    assert client.get("big") is None


def test_client_argument_errors(server):
    c = mc.MetadataClient(url=server.url)
    assert c.url == server.url
    assert "MetadataClient" in repr(c)
    with pytest.raises(TypeError):
        c.put("k", 123)
    with pytest.raises(ValueError):
        c.get("")  # MC_EINVAL -> ConfigError, a ValueError
    with pytest.raises(ValueError):
        c.get("a\0b")
    c.close()
    c.close()  # idempotent
    assert c.closed
    with pytest.raises(mc.MooncakeError, match="closed"):
        c.get("k")


def test_open_other_backends():
    # etcd and Redis clients open without touching the network (issue 3;
    # tests/test_metadata_backends.py runs them against real servers).
    for url in ("etcd://127.0.0.1:2379", "redis://127.0.0.1:6379", "127.0.0.1:2379"):
        mc.MetadataClient(url).close()
    with pytest.raises(mc.ConfigError, match="P2P"):
        mc.MetadataClient("P2PHANDSHAKE")
    with pytest.raises(mc.ConfigError, match="unknown scheme"):
        mc.MetadataClient("gopher://x/metadata")


def test_threads_share_one_client(client):
    errors = []

    def work(n):
        try:
            for i in range(20):
                key = f"t{n}/{i}"
                client.put(key, f'"{n}-{i}"')
                assert client.get(key) == f'"{n}-{i}"'.encode()
                client.delete(key)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    in_threads(work, 8)
    assert errors == []


def test_close_while_other_thread_waits(monkeypatch):
    """close() during a call in flight must neither crash nor free early."""
    monkeypatch.setenv("MC_METADATA_TIMEOUT_MS", "800")
    with SilentServer() as silent:
        c = mc.MetadataClient(silent.url)
        result = {}

        def call():
            try:
                c.get("k")
            except mc.MetadataError as e:
                result["err"] = e

        t = threading.Thread(target=call)
        t.start()
        time.sleep(0.2)
        c.close()
        t.join(5)
        assert not t.is_alive()
        assert "did not answer" in str(result["err"])
        assert c.closed


# ---- raw HTTP against the server ----

def test_http_errors(server):
    base = f"http://127.0.0.1:{server.port}"
    status, body = http("GET", base + "/metadata")
    assert status == 400 and b"key" in body
    status, body = http("GET", base + "/metadata?key=")
    assert status == 400
    status, body = http("GET", base + "/nope?key=a")
    assert status == 404 and b"/metadata" in body
    status, body = http("PUT", base + "/metadata?key=a", data=b"")
    assert status == 400 and b"empty" in body
    status, body = http("POST", base + "/metadata?key=a", data=b"{}")
    assert status == 405
    assert http("GET", base + "/health") == (200, b"ok")
    status, _ = http("GET", base + "/metadata?key=absent")
    assert status == 404
    status, _ = http("DELETE", base + "/metadata?key=absent")
    assert status == 404


def test_http_put_get_and_413():
    with MetadataServer(path="/md", max_value_size=1024) as srv:
        assert srv.url.endswith("/md")
        assert http("PUT", srv.url + "?key=a%2Fb", data=b"{}")[0] == 200
        assert http("GET", srv.url + "?key=a%2Fb") == (200, b"{}")
        assert srv.store.get("a/b") == b"{}"
        status, body = http("PUT", srv.url + "?key=a", data=b"x" * 1025)
        assert status == 413 and b"1024" in body
        assert http("PUT", srv.url + "?key=a", data=b"x" * 1024)[0] == 200
        # The server stays healthy after refusing a body.
        assert http("GET", f"http://127.0.0.1:{srv.port}/health") == (200, b"ok")


def test_server_restart_and_bad_config():
    srv = MetadataServer(port=free_port())
    srv.start()
    port = srv.port
    with pytest.raises(RuntimeError):
        srv.start()
    srv.stop()
    srv.stop()  # idempotent
    with pytest.raises(ValueError):
        MetadataServer(path="metadata")
    # A taken port fails start() with the OSError, not a hang.
    with MetadataServer(port=port):
        with pytest.raises(OSError):
            MetadataServer(port=port).start()


def test_store_expiry():
    now = [100.0]
    store = MetadataStore(clock=lambda: now[0])
    store.put("a", b"1", ttl=5)
    store.put("b", b"2")
    assert store.get("a") == b"1" and len(store) == 2
    now[0] += 5
    assert store.get("a") is None
    assert store.keys() == ["b"]
    store.put("c", b"3", ttl=1)
    now[0] += 2
    assert store.purge_expired() == 1
    assert not store.delete("c")
    with pytest.raises(ValueError):
        store.put("d", b"4", ttl=0)


# ---- the CLI as a subprocess ----

class CliServer:
    def __init__(self, *args, preexec_fn=None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mooncake_connector.metadata_server",
             "--host", "127.0.0.1", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)
        line = self._readline(15)
        m = URL_LINE.match(line.strip())
        if not m:
            self.proc.kill()
            raise AssertionError(f"unexpected first line {line!r}; stderr: "
                                 f"{self.proc.stderr.read()}")
        self.url = m.group(1)

    def _readline(self, timeout):
        out = []
        t = threading.Thread(target=lambda: out.append(self.proc.stdout.readline()))
        t.daemon = True
        t.start()
        t.join(timeout)
        if not out:
            self.proc.kill()
            raise AssertionError("metadata server printed no URL in time")
        return out[0]

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.proc.stdout.close()
        self.proc.stderr.close()


@pytest.fixture
def cli_server():
    srv = CliServer()
    yield srv
    srv.close()


def test_cli_round_trip_and_sigterm(cli_server):
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metadata", cli_server.url)
    with mc.MetadataClient(cli_server.url) as c:
        c.put("mooncake/rpc_meta/n", b'{"ip_or_host_name":"h","rpc_port":1}')
        assert c.get("mooncake/rpc_meta/n") == b'{"ip_or_host_name":"h","rpc_port":1}'
        c.delete("mooncake/rpc_meta/n")
        assert c.get("mooncake/rpc_meta/n") is None
        # Keep a live keep-alive connection: shutdown must not wait on it.
        c.put("k", b"{}")
        t0 = time.monotonic()
        cli_server.proc.send_signal(signal.SIGTERM)
        assert cli_server.proc.wait(10) == 0
        assert time.monotonic() - t0 < 5


def test_cli_sigint_and_custom_path():
    srv = CliServer("--path", "/custom/md")
    try:
        assert srv.url.endswith("/custom/md")
        with mc.MetadataClient(srv.url) as c:
            c.put("x", b"1")
            assert c.get("x") == b"1"
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(10) == 0
    finally:
        srv.close()


def test_cli_bad_port_in_use():
    with MetadataServer() as taken:
        r = subprocess.run(
            [sys.executable, "-m", "mooncake_connector.metadata_server",
             "--host", "127.0.0.1", "--port", str(taken.port)],
            capture_output=True, text=True, timeout=30)
    assert r.returncode != 0
    assert "cannot listen" in r.stderr


def test_killed_server_gives_metadata_error_quickly(cli_server):
    c = mc.MetadataClient(cli_server.url)
    c.put("k", b"{}")
    cli_server.proc.kill()
    cli_server.proc.wait(10)
    t0 = time.monotonic()
    with pytest.raises(mc.MetadataError) as ei:
        c.get("k")
    assert time.monotonic() - t0 < 5
    assert cli_server.url in str(ei.value)
    assert '"k"' in str(ei.value)
    assert ei.value.code_name == "MC_EMETADATA"
    with pytest.raises(mc.MetadataError, match="unreachable"):
        c.put("k", b"{}")
    c.close()


# ---- misbehaving servers ----

class SocketServer:
    """Accepts connections; `behave(conn)` decides what happens on each."""

    def __init__(self, behave):
        self.behave = behave
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/metadata"
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    conn.recv(65536)  # the request
                    self.behave(conn, self.stopping)
                except OSError:
                    pass

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        self.thread.join(5)
        self.sock.close()


def SilentServer():
    return SocketServer(lambda conn, stopping: stopping.wait(10))


@pytest.mark.parametrize("seed", range(8))
def test_garbage_server_raises_metadata_error(seed):
    rng = random.Random(seed)
    payload = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 4096)))
    with SocketServer(lambda conn, stopping: conn.sendall(payload)) as srv:
        with mc.MetadataClient(srv.url) as c:
            with pytest.raises(mc.MetadataError) as ei:
                c.get("mooncake/ram/x")
            assert srv.url in str(ei.value)
            with pytest.raises(mc.MetadataError):
                c.put("mooncake/ram/x", b"{}")


def test_garbage_after_status_line():
    def behave(conn, stopping):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: zz\r\n\x00\xff\r\n\r\n")

    with SocketServer(behave) as srv, mc.MetadataClient(srv.url) as c:
        with pytest.raises(mc.MetadataError):
            c.get("k")


def test_endless_body_is_cut_off():
    def behave(conn, stopping):
        conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
        chunk = b"x" * 65536
        while not stopping.is_set():
            conn.sendall(chunk)

    with SocketServer(behave) as srv, mc.MetadataClient(srv.url) as c:
        t0 = time.monotonic()
        with pytest.raises(mc.MooncakeError, match="larger than 16 MiB") as ei:
            c.get("k")
        assert ei.value.code_name == "MC_ETOOBIG"
        assert time.monotonic() - t0 < 3.5


def test_silent_server_times_out(monkeypatch):
    monkeypatch.setenv("MC_METADATA_TIMEOUT_MS", "500")
    with SilentServer() as srv, mc.MetadataClient(srv.url) as c:
        t0 = time.monotonic()
        with pytest.raises(mc.MetadataError, match="within 500 ms"):
            c.get("k")
        assert time.monotonic() - t0 < 2


def test_default_timeout_is_bounded(monkeypatch):
    monkeypatch.delenv("MC_METADATA_TIMEOUT_MS", raising=False)
    with SilentServer() as srv, mc.MetadataClient(srv.url) as c:
        t0 = time.monotonic()
        with pytest.raises(mc.MetadataError, match="within 3000 ms"):
            c.get("k")
        assert time.monotonic() - t0 < 3.5


def _burst(url, n):
    """n clients at once, each on its own new connection: PUT its key, then
    GET it back.  Returns the failures (client index, what went wrong)."""
    import asyncio
    import urllib.parse

    u = urllib.parse.urlsplit(url)
    host, port, path = u.hostname, u.port, u.path

    async def connect(i):
        try:
            return await asyncio.wait_for(asyncio.open_connection(host, port), 60)
        except (OSError, asyncio.TimeoutError) as e:
            return e

    async def one(i, conn):
        if isinstance(conn, BaseException):
            return (i, f"connect: {conn!r}")
        r, w = conn
        key, val = f"burst/{i}", b'{"i":%d}' % i
        try:
            req = (f"PUT {path}?key={key} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(val)}\r\n"
                   f"\r\n").encode() + val
            req += f"GET {path}?key={key} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
            w.write(req)
            data = await asyncio.wait_for(r.read(), 60)
        except (OSError, asyncio.TimeoutError) as e:
            return (i, repr(e))
        finally:
            w.close()
        if data.count(b"HTTP/1.1 200") != 2 or not data.endswith(val):
            return (i, data[-200:])
        return None

    async def run():
        # Every connection open at once (held by the server together), then
        # every request sent at once.
        conns = await asyncio.gather(*(connect(i) for i in range(n)))
        return [x for x in await asyncio.gather(*(one(i, c) for i, c in enumerate(conns)))
                if x is not None]

    return asyncio.run(run())


def test_burst_of_4096_new_connections_all_answered():
    """Many engines starting together: 4096 clients each open a connection
    and PUT+GET at once; every one is answered (none reset or dropped).
    The server starts with the usual default soft limit of 1024 open files
    (a user's shell): it must raise its own limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4096 + 512
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {want}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    def low_nofile():
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))

    srv = CliServer(preexec_fn=low_nofile)
    try:
        failures = _burst(srv.url, 4096)
        assert not failures, f"{len(failures)} of 4096 failed, e.g. {failures[:3]}"
    finally:
        srv.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_http_edges_match_mooncakes_server(server):
    """JSON error bodies, blank key refused, keys stripped (as Mooncake's
    mooncake_http_metadata_server)."""
    import json
    import urllib.request
    base = f"http://127.0.0.1:{server.port}/metadata"
    for q in ("", "?key=", "?key=%20%20", "?key=%09"):
        status, body = http("GET", base + q)
        err = json.loads(body)
        assert status == 400 and err["status"] == 400 and "key is required" in err["error"], q
    assert http("PUT", base + "?key=%20blank%20", data=b"{}")[0] == 200
    assert server.store.get("blank") == b"{}" and server.store.get(" blank ") is None
    assert http("GET", base + "?key=blank") == (200, b"{}")
    status, body = http("GET", base + "?key=absent")
    assert status == 404 and json.loads(body)["error"].startswith("metadata not found")
    with urllib.request.urlopen(base + "?key=blank") as r:
        assert r.headers["Content-Type"].startswith("application/json")
    assert http("DELETE", base + "?key=%20blank")[0] == 200
    assert server.store.get("blank") is None


def test_repeated_query_parameter_is_a_400_naming_it(server):
    """?key=a&key=b was served as key a (the second silently dropped); a
    repeated key or ttl is now a 400 naming the parameter, and nothing is
    stored or deleted."""
    import json
    base = f"http://127.0.0.1:{server.port}/metadata"
    assert http("PUT", base + "?key=a", data=b"{}")[0] == 200
    for method, q, name in (("GET", "?key=a&key=b", "key"), ("DELETE", "?key=a&key=a", "key"),
                            ("PUT", "?key=b&key=c", "key"), ("PUT", "?key=b&ttl=5&ttl=9", "ttl"),
                            ("GET", "?key=&key=a", "key")):
        status, body = http(method, base + q, data=b"{}" if method == "PUT" else None)
        err = json.loads(body)
        assert status == 400 and err["status"] == 400, (q, body)
        assert f"query parameter '{name}' is repeated (2 times)" in err["error"], err
        assert "/metadata?key=" in err["error"], err
    assert server.store.keys() == ["a"]
    assert http("GET", base + "?key=a") == (200, b"{}")


def test_put_over_the_cap_is_answered_413_and_closed_at_once():
    """A PUT announcing a body over the cap (Content-Length), or a chunked
    one passing it, was answered 413 at once but then kept open while
    aiohttp read and dropped up to 10 s more of the body; now the
    connection closes with the answer.  The server keeps serving."""
    with MetadataServer(max_value_size=1024) as srv:
        head = b"PUT /metadata?key=k HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        for rest, says in ((b"Content-Length: 1000000000\r\n\r\n{\"a", b"(1000000000 bytes)"),
                           (b"Transfer-Encoding: chunked\r\n\r\n800\r\n" + b"x" * 2048,
                            b"(more)")):
            data, took = send_head_only(srv.port, head + rest)
            assert data.startswith(b"HTTP/1.1 413"), data[:300]
            assert says in data and b"the limit is 1024 bytes" in data, data
            assert took < 3, took  # was 10 s
        assert srv.store.get("k") is None
        assert http("PUT", srv.url + "?key=k", data=b"{}")[0] == 200
        assert http("GET", srv.url + "?key=k") == (200, b"{}")


def test_expect_100_continue_is_not_answered_before_a_413():
    """A PUT with "Expect: 100-continue" whose Content-Length is over the
    cap was told "100 Continue" (aiohttp's default, before the handler)
    and only then 413: the client was invited to send the body the server
    refused (seen failing).  Now the 413 is the first answer; a PUT the
    server takes gets "100 Continue" and then 200."""
    with MetadataServer(max_value_size=1024) as srv:
        head = (b"PUT /metadata?key=k HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n")
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as c:
            c.sendall(head % 1000000)
            first = recv_head(c)
        assert first.startswith(b"HTTP/1.1 413"), first
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as c:
            c.sendall(head % 2)
            assert recv_head(c) == b"HTTP/1.1 100 Continue\r\n\r\n"
            c.sendall(b"{}")
            assert recv_head(c).startswith(b"HTTP/1.1 200")
        assert srv.store.get("k") == b"{}"


def test_slow_header_client_is_disconnected(monkeypatch):
    """A client dripping a request header (slow-loris) held a connection
    forever; now it is closed after the header deadline, while the server
    keeps answering others."""
    from mooncake_connector import http_guard
    monkeypatch.setattr(http_guard, "HEADER_TIMEOUT_S", 1.0)
    with MetadataServer(port=0) as srv:
        closed = drip_header(srv.port, b"GET /metadata?key=a HTTP/1.1\r\nHost: x\r\n")
        assert closed is not None and 0.8 <= closed <= 4, closed
        mc_client = mc.MetadataClient(srv.url)
        mc_client.put("k", b"v")
        assert mc_client.get("k") == b"v"


def test_stalled_put_body_is_answered_408_and_closed(monkeypatch):
    """A PUT whose body stops coming after a complete header held its
    connection and handler forever (the header deadline did not cover the
    body): now it is answered 408 naming the stall and the key, and
    disconnected, while the server keeps answering others."""
    from mooncake_connector import http_guard
    monkeypatch.setattr(http_guard, "HEADER_TIMEOUT_S", 1.0)
    with MetadataServer(port=0) as srv:
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(b"PUT /metadata?key=k HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        s.settimeout(10)
        t = time.monotonic()
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        s.close()
        assert data.startswith(b"HTTP/1.1 408"), data[:300]
        assert 0.8 <= time.monotonic() - t <= 6
        assert b"body stalled" in data and b"'k'" in data, data
        assert srv.store.get("k") is None
        mc_client = mc.MetadataClient(srv.url)
        mc_client.put("k", b"v")
        assert mc_client.get("k") == b"v"


def test_trickled_put_body_is_cut_at_the_body_deadline(monkeypatch):
    """A PUT whose body comes a byte at a time, each inside the stall
    deadline (chunked, or short of its Content-Length), held its connection
    and handler for as long as the client went on.  Now the whole body must
    arrive within http_guard.BODY_TIMEOUT_S: 408 naming it and the key,
    closed; the server keeps answering others."""
    from mooncake_connector import http_guard
    monkeypatch.setattr(http_guard, "HEADER_TIMEOUT_S", 1.0)
    monkeypatch.setattr(http_guard, "BODY_TIMEOUT_S", 2.0, raising=False)
    with MetadataServer(port=0) as srv:
        for rest, piece in ((b"Transfer-Encoding: chunked\r\n\r\n", b"1\r\n \r\n"),
                            (b"Content-Length: 100000\r\n\r\n{", b" ")):
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.sendall(b"PUT /metadata?key=k HTTP/1.1\r\nHost: x\r\n" + rest)
            s.settimeout(0.4)
            t = time.monotonic()
            data, took = b"", None
            while time.monotonic() - t < 15:
                try:
                    chunk = s.recv(65536)
                except socket.timeout:
                    try:
                        s.sendall(piece)
                    except OSError:
                        pass
                    continue
                except ConnectionResetError:
                    chunk = b""
                if not chunk:
                    took = time.monotonic() - t
                    break
                data += chunk
            s.close()
            assert took is not None, "still connected after 15 s: " + repr(data[:300])
            assert 1.5 <= took <= 6, took
            assert data.startswith(b"HTTP/1.1 408"), data[:300]
            assert b"did not arrive in full within 2 s" in data and b"'k'" in data, data
        assert srv.store.get("k") is None
        mc_client = mc.MetadataClient(srv.url)
        mc_client.put("k", b"v")
        assert mc_client.get("k") == b"v"


BAD_SERVER_ARGS = [
    (["--path", "/a{"], {}, "--path '/a{'"),          # was a traceback from aiohttp
    (["--path", "/{x}"], {}, "--path '/{x}'"),        # was a route matching any path
    (["--path", "/a%20b"], {}, "--path '/a%20b'"),    # was a server no URL reached
    (["--path", "/a?b"], {}, "--path '/a?b'"),        # clients append ?key=
    (["--path", "/a b"], {}, "--path '/a b'"),
    ([], {"MC_METADATA_STORE_MB": "lots"}, "MC_METADATA_STORE_MB='lots'"),  # was a traceback
    ([], {"MC_METADATA_STORE_MB": "0"}, "MC_METADATA_STORE_MB='0'"),
    # were taken: listened on every address, "listening on http://:PORT/metadata"
    # ("' '": "cannot listen on  :0: Name or service not known", exit 1)
    (["--host", ""], {}, "--host '' is empty"),
    (["--host", " "], {}, "--host ' ' is empty"),
]


@pytest.mark.parametrize("args,env,expect", BAD_SERVER_ARGS,
                         ids=[" ".join(a) or next(iter(e.items()))[1] for a, e, _ in
                              BAD_SERVER_ARGS])
def test_cli_bad_path_or_store_size_is_a_usage_error(args, env, expect):
    """One line naming the argument or variable and what it must be, exit
    2, no traceback, nothing listening."""
    import os
    r = subprocess.run([sys.executable, "-m", "mooncake_connector.metadata_server",
                        "--host", "127.0.0.1", "--port", "0", *args],
                       capture_output=True, text=True, timeout=30,
                       env=dict(os.environ, **env))
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert expect in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "listening" not in r.stdout


def test_api_path_with_characters_clients_cannot_send_is_refused():
    for path in ("/a{", "/{x}", "/a%20b", "/a?b", "/a#b", "/a b"):
        with pytest.raises(ValueError, match="metadata path"):
            MetadataServer(path=path)
    MetadataServer(path="/x-y_z.1~/md").start().stop()


def test_put_body_that_does_not_decode_is_a_400(server):
    """A PUT body that does not match its Content-Encoding was a 500 and a
    traceback in the server's log; now a 400 naming the encoding."""
    import urllib.error
    import urllib.request
    req = urllib.request.Request(server.url + "?key=k", data=b"{}", method="PUT",
                                 headers={"Content-Encoding": "gzip"})
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(req, timeout=20)
    body = ei.value.read().decode()
    assert ei.value.code == 400 and "content-encoding: gzip" in body.lower(), body
    assert server.store.get("k") is None


def test_api_arguments_of_the_wrong_type_or_range_name_the_argument():
    """MetadataServer / MetadataStore arguments: before, port="80" started a
    server on port 80 (asyncio took the string as a service name), port -1
    or 70000 was OverflowError "bind(): port must be 0-65535." at start(),
    token=5 "object of type 'int' has no len()", path=5 an AttributeError,
    max_value_size="x" a TypeError from a comparison, MetadataStore
    max_bytes=-1 or "x" was accepted (every later PUT failing or raising),
    and put(ttl=nan) stored an entry that never expired."""
    for kw, msg in (({"port": "80"}, "port must be an int"),
                    ({"port": -1}, "port -1 is out of range 0..65535"),
                    ({"port": 70000}, "port 70000 is out of range 0..65535"),
                    ({"port": True}, "port must be an int"),
                    ({"token": 5}, "metadata token must be a str"),
                    ({"path": 5}, "metadata path must be a str"),
                    ({"max_value_size": "x"}, "max_value_size must be an int"),
                    ({"max_value_size": 0}, "max_value_size must be >= 1")):
        with pytest.raises((TypeError, ValueError), match=msg):
            MetadataServer(**kw)
    for mb, msg in ((-1, "max_bytes must be >= 1"), ("x", "max_bytes must be an int")):
        with pytest.raises((TypeError, ValueError), match=msg):
            MetadataStore(max_bytes=mb)
    s = MetadataStore()
    for ttl in (float("nan"), float("inf"), "5"):
        with pytest.raises((TypeError, ValueError), match="ttl"):
            s.put("k", b"v", ttl)
    assert s.get("k") is None


def test_many_tiny_entries_stay_within_the_store_budget():
    """The store's byte budget bounds its memory however small the entries:
    each entry is charged its bookkeeping (the key object, the entry, its
    dict slot: about 180 bytes beyond the key's and value's bytes) besides
    them.  Before, only len(key) + len(value) was counted, so a client
    PUTting one-byte values under short keys (about 7 bytes each) filled a
    1 MiB budget with 150000 entries and 27 MiB of memory (the default
    256 MiB budget: about 7 GiB)."""
    import tracemalloc
    budget = 1 << 20
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        store = MetadataStore(max_bytes=budget)
        n = 0
        with pytest.raises(StoreFull):
            while n < 10 ** 6:
                store.put(f"{n:x}", b"1", ttl=60)
                n += 1
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held <= budget * 1.25, (n, held)
    assert store.bytes_used <= budget
    # Over HTTP: a small budget is full after a few hundred tiny PUTs (507
    # naming the budget); deleting makes room again.
    store = MetadataStore(max_bytes=64 << 10)
    with MetadataServer(store=store) as srv:
        codes = []
        while len(codes) < 5000:
            status, body = http("PUT", f"{srv.url}?key=k{len(codes)}", b"1")
            codes.append(status)
            if status != 200:
                break
        assert codes[-1] == 507 and b"MC_METADATA_STORE_MB" in body, codes[-3:]
        assert len(codes) < (64 << 10) // 150, len(codes)
        assert http("DELETE", f"{srv.url}?key=k0")[0] == 200
        assert http("PUT", f"{srv.url}?key=again", b"1")[0] == 200
        for i in range(1, len(codes)):
            http("DELETE", f"{srv.url}?key=k{i}")
        http("DELETE", f"{srv.url}?key=again")
        assert store.bytes_used == 0


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback (::1) here")
def test_cli_ipv6_host_in_brackets_listens_and_a_taken_port_is_named_in_brackets():
    """--host [::1] (as a URL writes it) listens on ::1 (was "cannot listen
    on [::1]:0: Name or service not known"); a port taken on ::1 is named
    [::1]:PORT (was "::1:PORT")."""
    srv = CliServer("--host", "[::1]")
    try:
        assert srv.url.startswith("http://[::1]:") and srv.url.endswith("/metadata"), srv.url
        port = int(srv.url.rsplit(":", 1)[1].split("/")[0])
        r = subprocess.run([sys.executable, "-m", "mooncake_connector.metadata_server",
                            "--host", "::1", "--port", str(port)],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 1 and f"cannot listen on [::1]:{port}: " in r.stderr, r.stderr
    finally:
        srv.close()
