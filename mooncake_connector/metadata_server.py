"""Embedded metadata server speaking Mooncake's HTTP metadata protocol.

Protocol (what Mooncake's ``HTTPStoragePlugin`` and our C client send)::

    GET    <path>?key=<urlencoded key>   200 + value | 404 when missing
    PUT    <path>?key=<urlencoded key>   body = JSON value; 200
    PUT    <path>?key=<k>&ttl=<seconds>  same, and the entry expires after ttl
                                         seconds unless PUT again (liveness)
    DELETE <path>?key=<urlencoded key>   200 | 404 when missing
    GET    /health                       200 "ok"

Keys are stripped of surrounding whitespace and a blank key is refused (400),
as Mooncake's ``mooncake_http_metadata_server`` does; so is a repeated
``key`` or ``ttl`` parameter (``?key=a&key=b``: 400 naming it, where it
was read as its first value); every answer is
``application/json``, errors a JSON object ``{"error": "<why>", "status": N}``.
PUT answers "metadata created" when the key did not exist (or had expired)
and "metadata updated" otherwise; a client refreshing a TTL uses that to
notice it re-created an entry the server had lost.  ``request_counts``
(per HTTP method) lets tests and benchmarks count metadata traffic.

Authentication (optional, docs/security.md): with a token (``token=`` /
``--token-file`` / env ``MC_METADATA_TOKEN``) every request on the metadata
path must carry ``Authorization: Bearer <token>``; others get 401 with a
message naming the fix.  ``/health`` stays open (it reveals nothing).

Values live in memory only.  Run it standalone::

    python -m mooncake_connector.metadata_server --host 0.0.0.0 --port 8080
    mooncake-metadata-server --port 0        # picks a free port and prints it

or in-process (tests, single-node setups)::

    with MetadataServer() as srv:
        client = MetadataClient(srv.url)
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from aiohttp import web

from mooncake_connector import http_guard

__all__ = [
    "DEFAULT_MAX_STORE_BYTES",
    "DEFAULT_MAX_VALUE_SIZE",
    "DEFAULT_PATH",
    "StoreFull",
    "MetadataServer",
    "MetadataStore",
    "build_app",
    "main",
]

log = logging.getLogger("mooncake_connector.metadata_server")

DEFAULT_PATH = "/metadata"
DEFAULT_PORT = 8080  # Mooncake's servers default to 8080 too
#: Largest PUT body accepted; equals the C client's GET cap (MC_META_MAX_VALUE).
DEFAULT_MAX_VALUE_SIZE = 16 << 20
#: Budget for all keys and values held (MC_METADATA_STORE_MB overrides it).
DEFAULT_MAX_STORE_BYTES = 256 << 20
HEALTH_PATH = "/health"


@dataclass
class _Entry:
    value: bytes
    expires_at: Optional[float] = None  # store clock deadline; None = never


#: What an entry costs beyond its value's bytes and its key object
#: (sys.getsizeof): the _Entry and its attributes, the bytes object's header,
#: the dict's slot (about 130 bytes measured on CPython 3.11, with a TTL).
#: Charged to the budget so that many tiny entries cannot hold many times it.
ENTRY_OVERHEAD = 160


def _cost(key: str, value_len: int) -> int:
    return sys.getsizeof(key) + value_len + ENTRY_OVERHEAD


class StoreFull(Exception):
    """A PUT would take the store past its byte budget (HTTP 507)."""


def _default_max_bytes() -> int:
    mb = os.environ.get("MC_METADATA_STORE_MB")
    if mb:
        try:
            if int(mb) >= 1:
                return int(mb) << 20
        except ValueError:
            pass
        raise ValueError(f"MC_METADATA_STORE_MB={mb!r} is not a whole number of MiB >= 1")
    return DEFAULT_MAX_STORE_BYTES


class MetadataStore:
    """Thread-safe in-memory key -> bytes map whose entries may expire.

    The HTTP handlers use it from the server's event loop; tests and
    embedding code may inspect it from other threads, hence the lock.
    Expiry is lazy (checked on access) plus :meth:`purge_expired`.
    Keys and values together hold at most ``max_bytes`` (a budget: a PUT
    past it raises :class:`StoreFull`; :attr:`bytes_used` is the current use),
    each entry charged its bookkeeping too (:data:`ENTRY_OVERHEAD`).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 max_bytes: Optional[int] = None) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: Dict[str, _Entry] = {}
        if max_bytes is not None:
            if isinstance(max_bytes, bool) or not isinstance(max_bytes, int):
                raise TypeError(f"max_bytes must be an int (bytes), got "
                                f"{type(max_bytes).__name__}")
            if max_bytes < 1:
                raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_bytes = _default_max_bytes() if max_bytes is None else max_bytes
        self._bytes = 0

    @property
    def bytes_used(self) -> int:
        with self._lock:
            return self._bytes

    def _pop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= _cost(key, len(entry.value))

    def _live(self, key: str) -> Optional[_Entry]:
        entry = self._entries.get(key)
        if entry is not None and entry.expires_at is not None:
            if self._clock() >= entry.expires_at:
                self._pop(key)
                return None
        return entry

    def get(self, key: str) -> Optional[bytes]:
        with self._lock:
            entry = self._live(key)
            return None if entry is None else entry.value

    def put(self, key: str, value: bytes, ttl: Optional[float] = None) -> bool:
        """Stores value; with ttl (seconds) the entry vanishes afterwards.
        Returns whether the key was new (absent or expired)."""
        if ttl is not None:
            if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
                raise TypeError(f"ttl must be a number of seconds or None, got "
                                f"{type(ttl).__name__}")
            if not 0 < ttl < float("inf"):  # nan too: it would never expire
                raise ValueError(f"ttl must be positive and finite, got {ttl!r}")
        expires = None if ttl is None else self._clock() + ttl
        with self._lock:
            old = self._live(key)
            created = old is None
            grow = len(value) - len(old.value) if old else _cost(key, len(value))
            if self._bytes + grow > self.max_bytes:
                raise StoreFull(f"the store holds {self._bytes} bytes; storing {len(value)} "
                                f"more for key {key!r} would pass its budget of "
                                f"{self.max_bytes} bytes (MC_METADATA_STORE_MB)")
            self._entries[key] = _Entry(bytes(value), expires)
            self._bytes += grow
            return created

    def delete(self, key: str) -> bool:
        """Removes key; returns whether it existed (and had not expired)."""
        with self._lock:
            existed = self._live(key) is not None
            self._pop(key)
            return existed

    def purge_expired(self) -> int:
        with self._lock:
            now = self._clock()
            dead = [k for k, e in self._entries.items()
                    if e.expires_at is not None and now >= e.expires_at]
            for k in dead:
                self._pop(k)
            return len(dead)

    def keys(self) -> List[str]:
        with self._lock:
            return [k for k in list(self._entries) if self._live(k) is not None]

    def __len__(self) -> int:
        return len(self.keys())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key) is not None


#: What a metadata path may contain: RFC 3986 path characters as the C
#: client accepts them in metadata_server, less '%' (the server matches the
#: decoded path: a %-escape in it matches no request).
_PATH_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
                        "-._~!$&'()*+,;=:@/")


def _check_path(path: str) -> str:
    if not isinstance(path, str):
        raise TypeError(f"metadata path must be a str like '/metadata', got "
                        f"{type(path).__name__}")
    if not path.startswith("/"):
        raise ValueError(f"metadata path must start with '/', got {path!r}")
    bad = next((ch for ch in path if ch not in _PATH_CHARS), None)
    if bad is not None:
        raise ValueError(f"metadata path {path!r} contains {bad!r}; use a URL path of "
                         "letters, digits and -._~!$&'()*+,;=:@/ (no query, fragment, "
                         "braces, spaces or %-escapes), e.g. /metadata")
    if path == HEALTH_PATH:
        raise ValueError(f"metadata path {HEALTH_PATH!r} is reserved for health checks")
    return path


#: Largest accepted ``ttl`` query parameter (one day, as the C client).
MAX_TTL = 86400


def _check_token(token: Optional[str]) -> Optional[str]:
    """'' and None mean no authentication; a token is printable ASCII."""
    if token is None:
        return None
    if not isinstance(token, str):
        raise TypeError(f"metadata token must be a str (or None: no authentication), got "
                        f"{type(token).__name__}")
    if not token:
        return None
    if len(token) > 4096 or any(not 0x21 <= ord(ch) <= 0x7e for ch in token):
        raise ValueError("metadata token must be 1..4096 printable ASCII characters "
                         "without spaces")
    return token


def build_app(store: MetadataStore, path: str = DEFAULT_PATH,
              max_value_size: int = DEFAULT_MAX_VALUE_SIZE,
              request_counts: Optional[Dict[str, int]] = None,
              token: Optional[str] = None) -> web.Application:
    """The aiohttp application: the metadata route, /health, and a 404 for
    anything else that says which path is served.  With ``token`` the
    metadata route requires ``Authorization: Bearer <token>``."""
    _check_path(path)
    token = _check_token(token)
    want = f"Bearer {token}".encode() if token else b""
    if max_value_size < 1:
        raise ValueError(f"max_value_size must be >= 1, got {max_value_size}")
    usage = f"{path}?key=<urlencoded key>"

    def text(status: int, msg: str, **kw) -> web.Response:
        # As Mooncake's server: every answer is application/json; errors
        # carry a JSON object {"error": <message>, "status": <code>}.
        if status >= 400:
            return web.json_response({"error": msg, "status": status}, status=status, **kw)
        return web.Response(status=status, text=msg, content_type="application/json", **kw)

    counts = request_counts if request_counts is not None else {}

    async def metadata(request: web.Request) -> web.StreamResponse:
        counts[request.method] = counts.get(request.method, 0) + 1
        if token:
            got = request.headers.get("Authorization", "").encode("utf-8", "replace")
            if not hmac.compare_digest(got, want):
                why = "wrong bearer token" if got else "missing bearer token"
                log.warning("metadata request from %s refused: %s", request.remote, why)
                return text(401, f"{why}: this metadata server requires "
                                 "'Authorization: Bearer <token>'; set MC_METADATA_TOKEN on the "
                                 "client to the server's token",
                            headers={"WWW-Authenticate": "Bearer"})
        # One key (and at most one ttl) per request, as every client sends
        # (Mooncake's HTTPStoragePlugin: <url>?key=<escaped key>): a repeated
        # one is refused, not silently read as its first value.
        for name in ("key", "ttl"):
            n = len(request.query.getall(name, ()))
            if n > 1:
                return text(400, f"query parameter {name!r} is repeated ({n} times); send it "
                                 f"once: {usage}[&ttl=<seconds>] (a client appends its own "
                                 f"{name}= to the metadata URL: give the URL without one)")
        # Keys are stripped of surrounding whitespace, as Mooncake's server
        # does; a missing, empty or blank key is refused.
        raw = request.query.get("key")
        key = raw.strip() if raw is not None else ""
        if not key:
            what = "missing" if raw is None else "empty" if raw == "" else "blank"
            return text(400, f"metadata key is required: {what} query parameter 'key'; "
                             f"expected {usage}")
        if request.method == "GET":
            value = store.get(key)
            if value is None:
                return text(404, f"metadata not found: {key}")
            return web.Response(body=value, content_type="application/json")
        if request.method == "PUT":
            # Refused on the announced length before a byte of the body is
            # read, or once a chunked body passes the cap; either way the
            # connection is closed after the answer: aiohttp would otherwise
            # read and drop up to 10 s more of the body first.
            length = request.content_length
            if length is not None and length > max_value_size:
                return await http_guard.answer_and_close(
                    request, _too_big(key, length, max_value_size))
            try:
                body = await http_guard.read_body(request, max_value_size)
            except web.HTTPRequestEntityTooLarge:
                return await http_guard.answer_and_close(
                    request, _too_big(key, None, max_value_size))
            except http_guard.BodyUnreadable as e:
                return await http_guard.answer_and_close(request, text(400, f"{e} (key {key!r})"))
            except http_guard.BodyStalled as e:
                log.warning("PUT of %r from %s: %s; connection closed", key, request.remote, e)
                return await http_guard.answer_and_close(request, text(408, f"{e} (key {key!r})"))
            if not body:
                return text(400, f"empty value for key {key!r}; PUT needs a JSON body")
            ttl = None
            ttl_s = request.query.get("ttl")
            if ttl_s is not None:
                try:
                    ttl = float(ttl_s)
                except ValueError:
                    ttl = -1.0
                if not 0 < ttl <= MAX_TTL:
                    return text(400, f"ttl={ttl_s!r} for key {key!r} is not a number of "
                                     f"seconds in (0, {MAX_TTL}]")
            try:
                created = store.put(key, body, ttl)
            except StoreFull as e:
                return text(507, str(e))
            return text(200, "metadata created" if created else "metadata updated")
        if request.method == "DELETE":
            if store.delete(key):
                return text(200, "metadata deleted")
            return text(404, f"metadata not found: {key}")
        return text(405, f"method {request.method} not allowed on {path}; "
                         "use GET, PUT or DELETE", headers={"Allow": "GET, PUT, DELETE"})

    def _too_big(key: str, length: Optional[int], cap: int) -> web.Response:
        got = f"{length} bytes" if length is not None else "more"
        return text(413, f"value for key {key!r} is too large ({got}); "
                         f"the limit is {cap} bytes")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def unknown(request: web.Request) -> web.Response:
        return text(404, f"no such path {request.path!r}; this server serves "
                         f"{usage} (and {HEALTH_PATH})")

    # client_max_size bounds request.read() even without a Content-Length
    # (chunked uploads); +1 so a body of exactly the cap still fits.
    app = web.Application(client_max_size=max_value_size + 1)
    # "Expect: 100-continue" answered only once a PUT's body is read
    # (http_guard.expect_later): a value too large is refused uninvited
    app.router.add_route("*", path, metadata, expect_handler=http_guard.expect_later)
    app.router.add_get(HEALTH_PATH, health)
    app.router.add_route("*", "/{tail:.*}", unknown, expect_handler=http_guard.expect_later)
    return app


def _format_url(host: str, port: int, path: str) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}{path}"


class _Running:
    """A started aiohttp runner and the port it actually bound."""

    def __init__(self, runner: web.AppRunner, port: int, server=None) -> None:
        self.runner = runner
        self.port = port
        self.server = server  # the listening asyncio server

    async def cleanup(self) -> None:
        if self.server is not None:
            self.server.close()
        await self.runner.cleanup()


# A cluster of engines starting together opens this many connections at
# once (each engine's PUTs and GETs); the listen queue and the open-file
# limit are sized for it.  The kernel caps the queue at net.core.somaxconn.
BURST_CONNECTIONS = 4096


def _raise_nofile_limit(want: int) -> None:
    """Raises this process's soft limit of open files towards want (up to
    the hard limit): a shell's usual 1024 would make accept() fail with
    EMFILE under a burst, and connections would hang unanswered."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            log.debug("open-file limit raised from %d to %d", soft, target)
        if hard != resource.RLIM_INFINITY and hard < want:
            log.warning("open-file hard limit is %d: fewer than %d clients can connect at "
                        "once (raise it: ulimit -Hn / LimitNOFILE=)", hard, want)
    except (ImportError, ValueError, OSError) as e:
        log.warning("could not raise the open-file limit (%s)", e)


def _somaxconn() -> Optional[int]:
    try:
        with open("/proc/sys/net/core/somaxconn") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


async def _start(app: web.Application, host: str, port: int,
                 access_log: bool) -> _Running:
    _raise_nofile_limit(2 * BURST_CONNECTIONS + 256)
    cap = _somaxconn()
    if cap is not None and cap < BURST_CONNECTIONS:
        log.warning("net.core.somaxconn is %d: the listen queue holds fewer than %d "
                    "connections; under a burst some clients retry their connect "
                    "(sysctl -w net.core.somaxconn=%d)", cap, BURST_CONNECTIONS,
                    BURST_CONNECTIONS)
    runner = web.AppRunner(app, handle_signals=False,
                           access_log=log if access_log else None)
    await runner.setup()
    loop = asyncio.get_running_loop()
    try:
        # A client that drips a request header is disconnected (http_guard).
        server = await loop.create_server(http_guard.guarded(runner.server, loop),
                                          host, port, backlog=BURST_CONNECTIONS,
                                          reuse_address=True)
    except BaseException:
        await runner.cleanup()
        raise
    bound = port
    for sock in server.sockets:
        addr = sock.getsockname()
        if isinstance(addr, tuple) and len(addr) >= 2:
            bound = addr[1]
            break
    return _Running(runner, bound, server)


class MetadataServer:
    """An in-process metadata server on its own event loop thread.

    ``start()`` returns once the socket listens (port 0 picks a free port,
    see ``.port`` / ``.url``); ``stop()`` shuts it down.  Usable as a
    context manager.  ``.store`` is the live :class:`MetadataStore`.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 path: str = DEFAULT_PATH, *,
                 max_value_size: int = DEFAULT_MAX_VALUE_SIZE,
                 store: Optional[MetadataStore] = None,
                 access_log: bool = False, token: Optional[str] = None) -> None:
        self.host = host
        if isinstance(port, bool) or not isinstance(port, int):
            raise TypeError(f"port must be an int (0: any free port), got {type(port).__name__}")
        if not 0 <= port <= 65535:
            raise ValueError(f"port {port} is out of range 0..65535 (0: any free port)")
        if isinstance(max_value_size, bool) or not isinstance(max_value_size, int):
            raise TypeError(f"max_value_size must be an int (bytes), got "
                            f"{type(max_value_size).__name__}")
        if max_value_size < 1:
            raise ValueError(f"max_value_size must be >= 1, got {max_value_size}")
        #: Bearer token required on the metadata path (None: open).
        self.token = _check_token(token)
        self.path = _check_path(path)
        self.max_value_size = max_value_size
        self.store = store if store is not None else MetadataStore()
        self._requested_port = port
        self._access_log = access_log
        self._port: Optional[int] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._stop_event: Optional[asyncio.Event] = None
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        #: Requests served on the metadata path, per HTTP method.
        self.request_counts: Dict[str, int] = {}

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("MetadataServer is not started")
        return self._port

    @property
    def url(self) -> str:
        return _format_url(self.host, self.port, self.path)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, timeout: float = 10.0) -> "MetadataServer":
        if self._thread is not None:
            raise RuntimeError("MetadataServer already started")
        app = build_app(self.store, self.path, self.max_value_size,
                        self.request_counts, token=self.token)
        self._ready.clear()
        self._error = None
        self._thread = threading.Thread(target=self._run, args=(app,),
                                        name="mc-metadata-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"metadata server did not start within {timeout} s")
        if self._error is not None:
            self._thread.join()
            self._thread = None
            raise self._error
        log.info("metadata server listening on %s", self.url)
        return self

    def _run(self, app: web.Application) -> None:
        # asyncio.run also cancels handler tasks of still-open keep-alive
        # connections before closing the loop (no "Task was destroyed").
        try:
            asyncio.run(self._serve(app))
        except BaseException as e:  # startup errors are re-raised in start()
            if not self._ready.is_set():
                self._error = e
                self._ready.set()
            else:
                log.exception("metadata server crashed")

    async def _serve(self, app: web.Application) -> None:
        self._stop_event = asyncio.Event()
        running = await _start(app, self.host, self._requested_port,
                               self._access_log)
        self._loop = asyncio.get_running_loop()
        self._port = running.port
        self._ready.set()
        try:
            await self._stop_event.wait()
        finally:
            await running.cleanup()

    def stop(self, timeout: float = 10.0) -> None:
        """Stops serving and joins the thread; idempotent."""
        thread, loop, ev = self._thread, self._loop, self._stop_event
        if thread is None:
            return
        if loop is not None and ev is not None and thread.is_alive():
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # loop already closed
                pass
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"metadata server did not stop within {timeout} s")
        self._thread = None
        self._loop = None
        self._stop_event = None

    def __enter__(self) -> "MetadataServer":
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.url if self._port is not None and self.running else "stopped"
        return f"<MetadataServer {where}>"


# ---- command line ----

def _parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="mooncake-metadata-server",
        description="In-memory metadata server speaking Mooncake's HTTP "
                    "metadata protocol (GET/PUT/DELETE <path>?key=...).")
    p.add_argument("--host", default="0.0.0.0",
                   help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help="TCP port; 0 picks a free one (default: %(default)s)")
    p.add_argument("--path", default=DEFAULT_PATH,
                   help="URL path of the metadata endpoint (default: %(default)s)")
    p.add_argument("--max-value-size", type=int, default=DEFAULT_MAX_VALUE_SIZE,
                   metavar="BYTES",
                   help="largest PUT body accepted (default: %(default)s)")
    p.add_argument("--token-file", metavar="PATH",
                   help="require 'Authorization: Bearer <token>' with the token read from "
                        "PATH (default: env MC_METADATA_TOKEN; unset = no authentication)")
    p.add_argument("--access-log", action="store_true",
                   help="log every request")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"])
    args = p.parse_args(argv)
    if args.host.startswith("[") and args.host.endswith("]"):
        args.host = args.host[1:-1]  # "[::1]", as in a URL: the address is ::1
    if not args.host.strip():  # the event loop takes "" as every address
        p.error(f"--host {args.host!r} is empty, which would listen on every address of this "
                "host (and print the URL http://:PORT); give one: 0.0.0.0 (every IPv4 "
                "address, said as such) or 127.0.0.1 (this host only)")
    if not 0 <= args.port <= 65535:
        p.error(f"--port {args.port} is out of range 0..65535")
    if args.max_value_size < 1:
        p.error("--max-value-size must be at least 1")
    try:
        _check_path(args.path)
    except ValueError as e:
        p.error(f"--path {args.path!r}: {e}")
    try:
        _default_max_bytes()  # the store's budget: checked before anything starts
    except ValueError as e:
        p.error(str(e))
    try:
        if args.token_file:
            with open(args.token_file, encoding="utf-8") as f:
                args.token = _check_token(f.read().strip())
            if not args.token:
                p.error(f"--token-file {args.token_file} is empty")
        else:
            args.token = _check_token(os.environ.get("MC_METADATA_TOKEN"))
    except (OSError, ValueError) as e:
        p.error(f"token: {e}")
    return args


async def _serve_cli(args: argparse.Namespace) -> int:
    store = MetadataStore()
    app = build_app(store, args.path, args.max_value_size, token=args.token)
    try:
        running = await _start(app, args.host, args.port, args.access_log)
    except OSError as e:
        print(f"mooncake-metadata-server: cannot listen on "
              f"{_format_url(args.host, args.port, '')[len('http://'):]}: {e}", file=sys.stderr,
              flush=True)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    url = _format_url(args.host, running.port, args.path)
    print(f"metadata server listening on {url}"
          f"{' (bearer token required)' if args.token else ''}", flush=True)
    if args.host in ("0.0.0.0", "::", ""):
        log.info("clients on other hosts use http://<this host's IP>:%d%s",
                 running.port, args.path)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await running.cleanup()
    log.info("metadata server stopped (%d keys dropped)", len(store))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``mooncake-metadata-server``."""
    args = _parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(_serve_cli(args))
    except KeyboardInterrupt:  # SIGINT before the handler was installed
        return 0


if __name__ == "__main__":
    sys.exit(main())
