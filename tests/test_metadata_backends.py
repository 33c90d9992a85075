"""Metadata backends against real servers: etcd (Debian etcd-server), Redis
(redis-server) and the embedded HTTP server run as its own process.

Each server is started on a free loopback port with a temporary data
directory and torn down afterwards.  Covered: a two-process transfer over
each backend; kill -9 of the metadata server and a restart with its data
gone (engines re-register, connected peers keep transferring); a killed
peer's entry expiring within MC_METADATA_TTL with a lookup saying so; and
bad input (URLs, passwords, error JSON, garbage, oversized or silent
servers, a value that is not a descriptor) giving clear errors.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from conftest import Peer, closing_maker, wait_until

from mooncake_connector.serving import free_port

mc = pytest.importorskip("mooncake_connector")

TTL = 2  # MC_METADATA_TTL for the peers of these tests (keep-alive every ~0.7 s)
BLK = 64 << 10
PEER_ENV = {"MC_METADATA_TTL": str(TTL)}
REDIS_PASSWORD = "s3cret pw"


class _Server:
    """A metadata server process that can be killed and restarted on the
    same port; every start uses a fresh data directory (data lost)."""

    kind = ""

    def __init__(self, tmp):
        self.tmp = str(tmp)
        self.port = free_port()
        self.proc = None
        self.starts = 0
        self.log = None

    def start(self, timeout=15.0):
        self.starts += 1
        data = os.path.join(self.tmp, f"{self.kind}-{self.starts}")
        os.makedirs(data, exist_ok=True)
        self.log = open(os.path.join(self.tmp, f"{self.kind}-{self.starts}.log"), "wb")
        self.proc = subprocess.Popen(self.cmd(data), stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=data)
        if not wait_until(lambda: self.proc.poll() is None and self.ready(), timeout, 0.05):
            self.kill()
            with open(self.log.name, "rb") as f:
                raise RuntimeError(f"{self.kind} did not start: {f.read()[-2000:]!r}")
        return self

    def kill(self):
        """kill -9, no clean shutdown."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
        if self.proc:
            self.proc.wait()
        if self.log:
            self.log.close()

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


class EtcdServer(_Server):
    kind = "etcd"

    def __init__(self, tmp):
        super().__init__(tmp)
        self.peer_port = free_port()

    def cmd(self, data):
        u = f"http://127.0.0.1:{self.port}"
        return ["etcd", "--name", "mc-test", "--data-dir", data,
                "--listen-client-urls", u, "--advertise-client-urls", u,
                "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port}",
                "--initial-cluster", f"mc-test=http://127.0.0.1:{self.peer_port}",
                "--log-level", "error"]

    def ready(self):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as r:
                return b"true" in r.read()
        except OSError:
            return False

    @property
    def url(self):
        return f"etcd://127.0.0.1:{self.port}"


class RedisServer(_Server):
    kind = "redis"

    def cmd(self, data):
        return ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", data,
                "--requirepass", REDIS_PASSWORD]

    def ready(self):
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    @property
    def url(self):
        return f"redis://:{REDIS_PASSWORD}@127.0.0.1:{self.port}/2"


class HttpServer(_Server):
    kind = "http"

    def cmd(self, data):
        return [sys.executable, "-m", "mooncake_connector.metadata_server",
                "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"]

    def ready(self):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as r:
                return r.read() == b"ok"
        except OSError:
            return False

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}/metadata"


SERVERS = {"etcd": (EtcdServer, "etcd"), "redis": (RedisServer, "redis-server"),
           "http": (HttpServer, None)}


def _make(kind, tmp):
    cls, binary = SERVERS[kind]
    if binary and shutil.which(binary) is None:
        pytest.skip(f"{binary} is not installed (Debian package "
                    f"{'etcd-server' if kind == 'etcd' else 'redis-server'})")
    return cls(tmp).start()


@pytest.fixture(params=["etcd", "redis", "http"])
def server(request, tmp_path):
    srv = _make(request.param, tmp_path)
    yield srv
    srv.stop()


@pytest.fixture
def etcd_server(tmp_path):
    srv = _make("etcd", tmp_path)
    yield srv
    srv.stop()


@pytest.fixture
def redis_server(tmp_path):
    srv = _make("redis", tmp_path)
    yield srv
    srv.stop()


@pytest.fixture
def mpeers():
    def make(url, **kw):
        return Peer(metadata=url, env={**PEER_ENV, **kw.pop("env", {})}, **kw)

    yield from closing_maker(make)


def seg_key(name):
    return "mooncake/ram/" + name


def write(a, b, n=64, seed=None):
    return a.call(cmd="write", target=b.segment,
                  blocks=[[i * BLK, b.addr + i * BLK, BLK] for i in range(n)], timeout=10)


# ---- transfers over each backend ----

def test_two_process_transfer(server, mpeers):
    a = mpeers(server.url, size=32 << 20)
    b = mpeers(server.url, size=32 << 20)
    client = mc.MetadataClient(server.url)
    desc = json.loads(client.get(seg_key(b.segment)))
    assert desc["name"] == b.segment and desc["rpc_port"] > 0
    seen = json.loads(client.get("mooncake/last_seen/" + b.segment))
    assert seen["ttl"] == TTL and abs(seen["last_seen"] - time.time()) < 5
    a.call(cmd="fill", seed=7, off=0, len=256 * BLK)
    assert a.call(cmd="write", target=b.segment,
                  blocks=[[i * BLK, b.addr + i * BLK, BLK] for i in range(256)]) == {"ok": True}
    assert (b.call(cmd="crc", off=0, len=256 * BLK)
            == a.call(cmd="crc", off=0, len=256 * BLK))
    # Clean shutdown removes every entry of the engine, last-seen included.
    b.close()
    assert client.get(seg_key(b.segment)) is None
    assert client.get("mooncake/rpc_meta/" + b.segment) is None
    assert client.get("mooncake/last_seen/" + b.segment) is None
    c = mpeers(server.url)  # a still has b cached; c looks it up
    r = c.call(cmd="write", target=b.segment, blocks=[[0, b.addr, 16]])
    assert f"segment {b.segment} is not registered (never registered" in r["error"], r
    client.close()


# ---- metadata server killed and restarted ----

def test_metadata_server_restart(server, mpeers):
    a = mpeers(server.url)
    b = mpeers(server.url)
    assert write(a, b) == {"ok": True}
    server.kill()
    t_kill = time.time()
    # Peers already connected keep transferring while the server is gone.
    for _ in range(3):
        assert write(a, b) == {"ok": True}
    time.sleep(max(0.0, TTL - (time.time() - t_kill)))  # keep-alives fail meanwhile
    assert write(a, b) == {"ok": True}
    server.start()  # empty: every entry is lost
    t0 = time.time()
    client = mc.MetadataClient(server.url)
    assert wait_until(lambda: client.get(seg_key(a.segment)) is not None
                      and client.get(seg_key(b.segment)) is not None, timeout=5, step=0.1), \
        "engines did not re-register within 5 s"
    took = time.time() - t0
    assert took < TTL + 1, took
    # The rpc entry is written right after the descriptor (same keep-alive pass).
    assert wait_until(lambda: client.get("mooncake/rpc_meta/" + b.segment) is not None,
                      timeout=2, step=0.05)
    # A new peer finds b through the restarted server.
    c = mpeers(server.url)
    assert write(c, b) == {"ok": True}
    assert write(a, b) == {"ok": True}
    client.close()


# ---- a killed peer expires ----

def test_killed_peer_expires(server, mpeers):
    a = mpeers(server.url)
    b = mpeers(server.url)
    client = mc.MetadataClient(server.url)
    assert client.get(seg_key(b.segment)) is not None
    b.proc.kill()
    b.proc.wait()
    t0 = time.time()
    assert wait_until(lambda: client.get(seg_key(b.segment)) is None, timeout=TTL + 2.5,
                      step=0.1), "entry of a killed peer did not expire"
    assert time.time() - t0 <= TTL + 2.0
    assert client.get("mooncake/rpc_meta/" + b.segment) is None
    time.sleep(1.1)  # make "N s ago" at least 1
    r = write(a, b, n=1)
    assert r.get("type") in ("MetadataError", "TransferError", "MooncakeError"), r
    assert f"segment {b.segment} is not registered (expired" in r["error"], r
    assert " s ago" in r["error"] and server.url.split("@")[-1].split("/")[0] in r["error"]
    client.close()


# ---- bad input ----

@pytest.mark.parametrize("url, needle", [
    ("", "empty metadata connection string"),
    ("ftp://127.0.0.1:21", "unknown scheme \"ftp\""),
    ("etcd://", "lists no endpoint"),
    ("etcd://127.0.0.1", "is not host:port"),
    ("etcd://127.0.0.1:2379,,127.0.0.1:2380", "empty endpoint"),
    ("127.0.0.1:notaport", "is not host:port"),
    ("redis://127.0.0.1", "is not host:port"),
    ("redis://:@127.0.0.1:6379", "empty password"),
    ("redis://127.0.0.1:6379/abc", "is not a number"),
    ("http://", "is not valid"),
])
def test_malformed_urls(url, needle):
    with pytest.raises(mc.MooncakeError) as ei:
        mc.MetadataClient(url)
    assert needle in str(ei.value)


def test_malformed_url_in_engine():
    e = mc.TransferEngine()
    with pytest.raises(mc.MooncakeError) as ei:
        e.initialize("127.0.0.1", "bogus://x:1", "tcp", "")
    assert "unknown scheme" in str(ei.value)


def test_redis_password_and_db(redis_server):
    base = f"127.0.0.1:{redis_server.port}"
    with pytest.raises(mc.MetadataError) as ei:
        mc.MetadataClient(f"redis://:wrong@{base}").get("k")
    msg = str(ei.value)
    assert "AUTH" in msg and "wrong" not in msg and "***" in msg, msg
    with pytest.raises(mc.MetadataError) as ei:
        mc.MetadataClient(f"redis://{base}").put("k", "{}")
    assert "NOAUTH" in str(ei.value) and '"k"' in str(ei.value)
    c2 = mc.MetadataClient(f"redis://:{REDIS_PASSWORD}@{base}/2")
    c5 = mc.MetadataClient(f"redis://:{REDIS_PASSWORD}@{base}/5")
    c2.put("k", '{"db":2}')
    assert c5.get("k") is None  # SELECT took effect
    assert c2.get("k") == b'{"db":2}'
    with pytest.raises(mc.MetadataError) as ei:
        mc.MetadataClient(f"redis://:{REDIS_PASSWORD}@{base}/99999").get("k")
    assert "SELECT" in str(ei.value)


def test_invalid_descriptor(server, mpeers):
    a = mpeers(server.url)
    client = mc.MetadataClient(server.url)
    client.put(seg_key("10.9.9.9:4242"), "this is not JSON")
    client.put(seg_key("10.9.9.9:4243"), '{"name":"10.9.9.9:4243","protocol":"tcp"}')
    for name in ("10.9.9.9:4242", "10.9.9.9:4243"):
        r = a.call(cmd="write", target=name, blocks=[[0, 4096, 16]])
        assert "error" in r and name in r["error"], r
    client.close()


class FakeServer:
    """A raw TCP server thread answering every connection with `handler`."""

    def __init__(self, handler):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.handler = handler
        self.stopped = False
        self.conns = []
        self.th = threading.Thread(target=self._run, daemon=True)
        self.th.start()

    def _run(self):
        while not self.stopped:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c):
        try:
            self.handler(c, self)
        except OSError:
            pass
        finally:
            try:
                c.close()
            except OSError:
                pass

    def close(self):
        self.stopped = True
        self.sock.close()
        for c in self.conns:
            try:
                c.close()
            except OSError:
                pass


def read_http(c):
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = c.recv(65536)
        if not chunk:
            return None, b""
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    n = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            n = int(line.split(b":")[1])
    while len(body) < n:
        body += c.recv(65536)
    return head.split(b"\r\n")[0].decode(), body


def http_answer(status, body, ctype="application/json"):
    return (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode() + body


@pytest.fixture
def fake():
    yield from closing_maker(FakeServer)


def test_etcd_error_json(fake):
    def h(c, srv):
        read_http(c)
        c.sendall(http_answer("400 Bad Request",
                              b'{"error":"etcdserver: boom","message":"etcdserver: boom","code":3}'))
    s = fake(h)
    with pytest.raises(mc.MetadataError) as ei:
        mc.MetadataClient(f"etcd://127.0.0.1:{s.port}").get("some/key")
    msg = str(ei.value)
    assert "etcdserver: boom" in msg and "some/key" in msg and str(s.port) in msg, msg


def test_etcd_v3beta_fallback(fake):
    paths = []

    def h(c, srv):
        line, _ = read_http(c)
        paths.append(line.split()[1])
        if line.split()[1].startswith("/v3/"):
            c.sendall(http_answer("404 Not Found", b"404 page not found\n", "text/plain"))
        else:
            c.sendall(http_answer("200 OK", b'{"header":{"revision":"1"}}'))
    s = fake(h)
    client = mc.MetadataClient(f"etcd://127.0.0.1:{s.port}")
    assert client.get("k") is None
    assert client.get("k2") is None
    assert paths == ["/v3/kv/range", "/v3beta/kv/range", "/v3beta/kv/range"]


def test_etcd_failover(etcd_server):
    server = etcd_server
    dead = free_port()
    c = mc.MetadataClient(f"etcd://127.0.0.1:{dead},127.0.0.1:{server.port}")
    c.put("fo", '"x"')
    assert c.get("fo") == b'"x"'
    with pytest.raises(mc.MetadataError) as ei:
        mc.MetadataClient(f"127.0.0.1:{dead},127.0.0.1:{free_port()}").get("fo")
    assert "all 2 endpoints failed" in str(ei.value)


@pytest.mark.parametrize("scheme", ["etcd", "redis", "http"])
def test_garbage_server(fake, scheme):
    def h(c, srv):
        c.recv(65536)
        c.sendall(b"\x00\xffgarbage \x01\x02 not a protocol at all\r\n" * 20)
    s = fake(h)
    url = {"etcd": f"etcd://127.0.0.1:{s.port}", "redis": f"redis://127.0.0.1:{s.port}",
           "http": f"http://127.0.0.1:{s.port}/metadata"}[scheme]
    with pytest.raises(mc.MetadataError) as ei:
        mc.MetadataClient(url).get("gk")
    assert '"gk"' in str(ei.value) and str(s.port) in str(ei.value)


@pytest.mark.parametrize("scheme", ["etcd", "redis"])
def test_oversized_body(fake, scheme):
    def h(c, srv):
        c.recv(65536)
        if scheme == "etcd":
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                      b"Transfer-Encoding: chunked\r\n\r\n")
            chunk = b"x" * (1 << 20)
            frame = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
        else:
            c.sendall(b"$900000000\r\n")
            frame = b"y" * (1 << 20)
        for _ in range(64):  # 64 MiB at most, then hang up
            if srv.stopped:
                return
            c.sendall(frame)
    s = fake(h)
    url = f"{scheme}://127.0.0.1:{s.port}"
    t0 = time.time()
    with pytest.raises(mc.MooncakeError) as ei:
        mc.MetadataClient(url).get("big")
    assert "MiB" in str(ei.value) and '"big"' in str(ei.value), str(ei.value)
    assert time.time() - t0 < 5


@pytest.mark.parametrize("scheme", ["etcd", "redis"])
def test_silent_server_times_out(fake, scheme, monkeypatch):
    monkeypatch.setenv("MC_METADATA_TIMEOUT_MS", "400")

    def h(c, srv):
        while not srv.stopped and c.recv(65536):
            pass
    s = fake(h)
    t0 = time.time()
    with pytest.raises(mc.MetadataError) as ei:
        mc.MetadataClient(f"{scheme}://127.0.0.1:{s.port}").get("slow")
    assert time.time() - t0 < 3
    assert '"slow"' in str(ei.value)


def test_http_ttl_parameter():
    from mooncake_connector.metadata_server import MetadataServer
    with MetadataServer() as srv:
        def put(q, body=b"{}"):
            req = urllib.request.Request(f"{srv.url}?key=k{q}", data=body, method="PUT")
            try:
                with urllib.request.urlopen(req) as r:
                    return r.status, r.read().decode().strip()
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode().strip()
        assert put("&ttl=0.3") == (200, "metadata created")
        assert put("&ttl=0.3") == (200, "metadata updated")
        assert "k" in srv.store
        time.sleep(0.4)
        assert "k" not in srv.store
        assert put("&ttl=abc")[0] == 400
        assert put("&ttl=-1")[0] == 400
        assert srv.request_counts["PUT"] == 4


def test_python_client_put_with_ttl_expires():
    """MetadataClient.put(..., ttl=N) against the embedded server."""
    import time as _time

    from mooncake_connector import MetadataClient
    from mooncake_connector.metadata_server import MetadataServer

    with MetadataServer() as srv:
        c = MetadataClient(srv.url)
        c.put("mooncake/test/ttl", b'{"a":1}', ttl=1)
        c.put("mooncake/test/forever", b'{"b":2}')
        assert c.get("mooncake/test/ttl") == b'{"a":1}'
        _time.sleep(1.5)
        assert c.get("mooncake/test/ttl") is None
        assert c.get("mooncake/test/forever") == b'{"b":2}'
        import pytest as _pytest
        with _pytest.raises(ValueError, match="ttl"):
            c.put("k", b"v", ttl=-1)
        c.close()
