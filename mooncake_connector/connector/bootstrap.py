"""The producer's bootstrap server: vLLM's in-tree MooncakeConnector contract.

vLLM's in-tree MooncakeConnector runs an HTTP "bootstrap server" on each
prefill engine (port ``VLLM_MOONCAKE_BOOTSTRAP_PORT``, default 8998).  Routers
that speak that contract (``vllm-router --vllm-pd-disaggregation
--kv-connector mooncake``, vLLM's mooncake proxy example) ask it at start-up,
``GET /query``, for the engine id of every data-parallel rank, and then send
the decode leg ``kv_transfer_params`` {"do_remote_prefill": true,
"transfer_id", "remote_bootstrap_addr": "http://P:8998", "remote_engine_id"}.

Ours answers /query in the same shape::

    {"0": {"engine_id": "10.0.0.1:13003",
           "worker_addr": {"0": {"0": "10.0.0.1:13003"}, "1": {"0": "10.0.0.1:13004"}}}}

The engine id is the producer's transfer-engine base name (host:port, TP
rank 0 of PP stage 0), so a consumer of ours maps ``remote_engine_id``
straight onto the producer it loads from (scheduler.py); ``worker_addr``
names each TP rank's (and PP stage's) engine.  The table is filled by the
producer's own worker (TP rank 0, PP rank 0), which knows every rank's name
(base port + pp * tp_size + tp): unlike the in-tree server, nobody registers
over the network, so ``POST /register`` is refused (403) and the server is
read-only.  Pure Python (stdlib http.server on a daemon thread); at most
MAX_CONNECTIONS connections (threads) at once, each request due within
REQUEST_DEADLINE_S.
"""
import errno
import json
import logging
import selectors
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from mooncake_connector.hostport import join_hostport

logger = logging.getLogger("vllm.mooncake_connector")

#: vLLM's default (envs.VLLM_MOONCAKE_BOOTSTRAP_PORT).
DEFAULT_PORT = 8998

#: Each connection is served by a thread of the prefill's vLLM process: at
#: most this many at once; a new one beyond them closes the oldest (a flood
#: of idle sockets cannot keep a router out: its request takes milliseconds).
MAX_CONNECTIONS = 64
#: A request must arrive whole within this many seconds of its connection
#: (or of the previous request on it): the socket timeout (10 s) is per
#: read, and a client dripping its header a byte at a time held its
#: connection and thread for ever.
REQUEST_DEADLINE_S = 10.0


def default_port(env):
    """VLLM_MOONCAKE_BOOTSTRAP_PORT (as vLLM's in-tree connector reads it), else 8998."""
    raw = env.get("VLLM_MOONCAKE_BOOTSTRAP_PORT")
    if raw is None or raw == "":
        return DEFAULT_PORT
    try:
        port = int(raw)
    except ValueError:
        raise ValueError(f"VLLM_MOONCAKE_BOOTSTRAP_PORT={raw!r} is not a port number") from None
    if not 0 <= port < 65536:
        raise ValueError(f"VLLM_MOONCAKE_BOOTSTRAP_PORT={raw!r} is not a port number (0-65535)")
    return port


def query_table(engine_id, dp_rank, tp_size, pp_size, name_of, dp_count=1):
    """The /query answer: {dp_rank: {"engine_id", "worker_addr": {tp: {pp: name}}}}
    (JSON object keys are strings, as the in-tree server's are).  name_of(tp,
    pp) gives a rank's engine name.  dp_count: the data-parallel engines of
    this server, from dp_rank on; engine k's names are engine 0's moved by
    k * tp_size * pp_size (settings.dp_base)."""
    from mooncake_connector.connector.settings import shift_port
    out = {}
    for k in range(max(1, dp_count)):
        d = k * tp_size * pp_size
        out[str(dp_rank + k)] = {
            "engine_id": shift_port(engine_id, d),
            "worker_addr": {str(t): {str(p): shift_port(name_of(t, p), d)
                                     for p in range(pp_size)} for t in range(tp_size)}}
    return out


#: A /query looks up the server's data-parallel engines again at most this often.
REFRESH_S = 5.0


class BootstrapServer:
    """GET /query (the table), GET /health; anything else 403/404/405."""

    def __init__(self, host, port, table, refresh=None):
        """refresh: None, or () -> the table now (vLLM data parallelism: the
        server's engines found in the metadata server), called at most every
        REFRESH_S by a /query; a failing one keeps the table it had."""
        self.table = table
        self._body = json.dumps(table, sort_keys=True).encode()
        self._refresh = refresh
        self._refreshed = time.monotonic() if refresh is None else float("-inf")
        self._refresh_lock = threading.Lock()
        outer = self

        def body():
            return outer.body()

        class Handler(BaseHTTPRequestHandler):
            server_version = "mooncake-connector-bootstrap"
            protocol_version = "HTTP/1.1"
            timeout = 10  # a silent client holds its thread at most this long

            def log_message(self, fmt, *args):  # no access log on stderr
                return

            def handle_one_request(self):
                super().handle_one_request()
                self.server.renew(self.request)  # the next request's deadline

            def _send(self, status, payload, ctype="application/json"):
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def do_GET(self):
                path = self.path.split("?", 1)[0]
                if path == "/query":
                    self._send(200, body())
                elif path == "/health":
                    self._send(200, {"status": "ok"})
                else:
                    self._send(404, {"detail": f"no such path {path[:100]!r}: this is "
                                     "mooncake-connector's bootstrap server (GET /query, "
                                     "GET /health)"})

            do_HEAD = do_GET

            def do_POST(self):
                path = self.path.split("?", 1)[0]
                # Read (a bounded amount of) the body so the connection stays in sync.
                try:
                    n = min(int(self.headers.get("Content-Length") or 0), 1 << 16)
                except ValueError:
                    n = 0
                if n > 0:
                    self.rfile.read(n)
                self.close_connection = True
                if path == "/register":
                    self._send(403, {"detail": "mooncake-connector's bootstrap server is "
                                     "read-only: its table comes from its own prefill workers "
                                     "(an in-tree MooncakeConnector worker must register with "
                                     "an in-tree bootstrap server)"})
                else:
                    self._send(405, {"detail": f"POST {path[:100]!r} is not served here "
                                     "(GET /query, GET /health)"})

            def do_PUT(self):
                self.close_connection = True
                self._send(405, {"detail": "read-only (GET /query, GET /health)"})

            do_DELETE = do_PATCH = do_PUT

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True
            request_queue_size = 128

            def __init__(srv, *a):
                srv.lock = threading.Lock()
                srv.conns = {}  # socket -> [accepted at, deadline] (monotonic)
                srv.evicted = srv.expired = 0
                super().__init__(*a)

            def process_request(srv, request, client_address):
                now = time.monotonic()
                with srv.lock:
                    while len(srv.conns) >= MAX_CONNECTIONS:
                        oldest = min(srv.conns, key=lambda c: srv.conns[c][0])
                        del srv.conns[oldest]
                        srv.evicted += 1
                        _shut(oldest)
                    srv.conns[request] = [now, now + REQUEST_DEADLINE_S]
                super().process_request(request, client_address)

            def renew(srv, request):
                with srv.lock:
                    if request in srv.conns:
                        srv.conns[request][1] = time.monotonic() + REQUEST_DEADLINE_S

            def reap(srv):
                """Shuts the connections past their deadline; the seconds
                until the next deadline (None: no connection)."""
                now = time.monotonic()
                with srv.lock:
                    for c in [c for c, (_, end) in srv.conns.items() if end <= now]:
                        del srv.conns[c]
                        srv.expired += 1
                        _shut(c)
                    if not srv.conns:
                        return None
                    return max(0.05, min(end for _, end in srv.conns.values()) - now)

            def handle_error(srv, request, client_address):
                # socketserver's own prints a traceback to stderr (the
                # prefill vLLM's log): for a client that left before its
                # answer, at will.
                exc = sys.exc_info()[1]
                if isinstance(exc, OSError):
                    logger.debug("bootstrap server: %s left before its answer (%r)",
                                 client_address, exc)
                else:
                    logger.warning("bootstrap server: a request from %s failed: %r",
                                   client_address, exc)

            def shutdown_request(srv, request):
                with srv.lock:
                    srv.conns.pop(request, None)
                super().shutdown_request(request)

            def server_bind(srv):
                if srv.address_family == socket.AF_INET6:  # "::" takes IPv4 clients too
                    srv.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                super().server_bind()

        class Server6(Server):
            address_family = socket.AF_INET6

        if not host:  # the default: every address, IPv6 (where this host has it) and IPv4
            try:
                self.httpd = Server6(("::", port), Handler)
                host = "::"
            except OSError as e:
                if e.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT):
                    raise
                host = "0.0.0.0"
                self.httpd = Server((host, port), Handler)
        else:
            if host.startswith("[") and host.endswith("]"):
                host = host[1:-1]
            family, addr = _listen_addr(host, port)
            self.httpd = (Server6 if family == socket.AF_INET6 else Server)(addr, Handler)
        self.host, self.port = host, self.httpd.server_address[1]
        # serve_forever polls its stop flag every poll_interval: close() then
        # waited up to that long (0.5 s per producer worker's shutdown).  Our
        # loop sleeps in select until a connection or close()'s wake-up byte.
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._serve, name="mooncake_bootstrap_server",
                                        daemon=True)
        self._thread.start()

    def _serve(self):
        httpd = self.httpd
        with selectors.DefaultSelector() as sel:
            sel.register(httpd, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while True:
                ready = sel.select(httpd.reap())
                if any(key.fileobj is self._wake_r for key, _ in ready):
                    return
                if ready:
                    httpd._handle_request_noblock()  # serve_forever's own step
                httpd.service_actions()

    @property
    def evicted(self):
        """Connections closed to make room for newer ones (MAX_CONNECTIONS)."""
        return self.httpd.evicted

    @property
    def url(self):
        host = {"0.0.0.0": "127.0.0.1", "::": "127.0.0.1"}.get(self.host, self.host)
        return f"http://{join_hostport(host, self.port)}"

    def body(self):
        """The /query answer's bytes, the table looked up again where due."""
        if self._refresh is not None and time.monotonic() - self._refreshed >= REFRESH_S:
            with self._refresh_lock:
                if time.monotonic() - self._refreshed >= REFRESH_S:
                    try:
                        table = self._refresh()
                        if table:
                            self.table = table
                            self._body = json.dumps(table, sort_keys=True).encode()
                    except Exception as e:  # noqa: BLE001 - keep the table it had
                        logger.debug("MooncakeConnector: bootstrap table not refreshed: %s", e)
                    self._refreshed = time.monotonic()
        return self._body

    def close(self):
        if self.httpd is None:
            return
        self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        self.httpd.server_close()
        self._wake_r.close()
        self._wake_w.close()
        self.httpd = None


def _listen_addr(host, port):
    """(family, socket address) of host to listen on: its IPv4 address where
    it has one, else its IPv6 one, zone (scope id) included: a name with
    IPv6 addresses only, a link-local "fe80::1%eth0" (a (host, port) pair
    loses the zone: EINVAL).  OSError where host is no address or name."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (UnicodeError, ValueError, TypeError) as e:  # "a\0b", a lone surrogate
        raise OSError(errno.EINVAL, f"not a host name ({e})") from None
    ai = min(infos, key=lambda ai: ai[0] != socket.AF_INET)
    return ai[0], ai[4]


def _shut(sock):
    """Ends a connection whose thread may be blocked reading it (the read
    returns end-of-file; the thread then closes the socket)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def start(settings, engine_id, dp_rank, tp_size, pp_size, name_of, env, dp_count=1,
          dp_found=None):
    """Starts the producer's bootstrap server as settings say (None if off).

    settings.bootstrap_port: None = the default (VLLM_MOONCAKE_BOOTSTRAP_PORT,
    else 8998), 0 = no server.  An explicitly set port that cannot be bound
    raises (the operator asked for it); the default port taken (another
    producer on this host already serves it) is one WARNING naming the knob,
    and the server is not started.
    """
    explicit = settings.bootstrap_port is not None
    port = settings.bootstrap_port if explicit else default_port(env)
    if port == 0:
        return None
    table = query_table(engine_id, dp_rank, tp_size, pp_size, name_of, dp_count)
    host = settings.bootstrap_host  # "": every address (IPv6 and IPv4)
    try:
        srv = BootstrapServer(host, port, table, None if dp_found is None else (
            lambda: query_table(engine_id, dp_rank, tp_size, pp_size, name_of,
                                max(dp_count, dp_found()))))
    except OSError as e:
        from mooncake_connector.connector.settings import SettingsError
        msg = (f"bootstrap server (vLLM's in-tree MooncakeConnector contract, for vllm-router "
               f"--kv-connector mooncake) cannot listen on {join_hostport(host or '::', port)}: "
               f"{e.strerror or e}")
        if host and e.errno != errno.EADDRINUSE:  # the address given is not one of this host's
            raise SettingsError(msg + f"; kv_connector_extra_config.bootstrap_host {host!r} must "
                                "be an address of this host (IPv6 as ::1 or [::1]), or leave it "
                                "unset: every address") from None
        if explicit:
            raise SettingsError(msg + "; choose another kv_connector_extra_config.bootstrap_port "
                                "(0 = no bootstrap server)") from None
        logger.warning("MooncakeConnector: %s; not serving one (set "
                       "kv_connector_extra_config.bootstrap_port to a free port, or 0 to "
                       "silence this)", msg)
        return None
    logger.info("MooncakeConnector: bootstrap server on %s (GET /query: engine %s, dp rank %d, "
                "TP %d, PP %d, %d DP engine(s)%s)", join_hostport(srv.host, srv.port), engine_id,
                dp_rank, tp_size, pp_size, max(1, dp_count), "" if dp_found is None else
                "; more as the metadata server names them")
    return srv


def intree_legs(body, bootstrap_addr, engine_id):
    """One request the in-tree connector's way (vLLM's toy_proxy_server.py):
    (request id, prefill leg body, decode leg body), both legs joined by one
    transfer_id, to be sent at once.  Used by benchmarks/intree_proxy.py and
    tests/test_e2e_intree.py."""
    import uuid

    rid = str(uuid.uuid4())
    xfer = f"xfer-{rid}"
    pre = dict(body, stream=False, max_tokens=1,
               kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                   "transfer_id": xfer})
    pre.pop("stream_options", None)
    pre.pop("max_completion_tokens", None)
    dec = dict(body, kv_transfer_params={
        "do_remote_decode": False, "do_remote_prefill": True,
        "remote_bootstrap_addr": bootstrap_addr, "remote_engine_id": engine_id,
        "transfer_id": xfer})
    return rid, pre, dec
