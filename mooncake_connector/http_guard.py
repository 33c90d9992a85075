"""A deadline on a request's header for aiohttp servers (the proxy).

aiohttp closes a connection that sends nothing (keepalive_timeout), but a
client that drips a request's header a byte at a time (slow-loris) cancels
that timer with its first byte and then holds the connection, and its
file descriptor, for as long as it likes.  guarded(server) wraps the
server's protocol factory: a connection that has sent part of a request
but no complete header for `seconds`, and is serving no request, is
closed.  It reads two attributes of aiohttp's RequestHandler
(_request_count, _current_request); if an aiohttp version lacks them the
guard does nothing.

The same hold through a request's body (a complete header, then a body
that never comes or comes a byte now and then): read_body() reads it with
the same deadline between its pieces and raises BodyStalled, and with a
deadline on the whole body (BODY_TIMEOUT_S: a client trickling a byte just
inside the first deadline, chunked or not, held its connection for as
long as it liked) and raises BodyTooSlow.

Open files: raise_nofile_limit() raises the soft RLIMIT_NOFILE to the hard
one; guarded(max_conns=...) answers a connection past max_conns with a 503
and closes it (the count of connections a server keeps below its open-file
limit, so that accept() and its own upstream connections do not fail with
EMFILE); out_of_fds(e) tells an OSError that is EMFILE / ENFILE; and
quiet_fd_errors(loop) makes asyncio's "socket.accept() out of system
resource" (a traceback per pending connection, each time it retries) one
WARNING line every 10 s.

A request with "Expect: 100-continue": aiohttp's default answers "100
Continue" before the handler runs, so a body the handler then refuses on
its headers alone (413 too large, 415 not JSON, 503 over a budget) was
invited first.  expect_later, a route's expect_handler, leaves the "100
Continue" to read_body(), once the body is read after all.

A request aiohttp's parser refuses (answered 400 and closed by aiohttp) is
logged as one WARNING line naming what was wrong, not aiohttp's ERROR with
a traceback (a client could fill the log ten lines a request)."""
import asyncio
import errno
import json
import logging
import time

from aiohttp import hdrs, web
from aiohttp.http import HttpVersion11
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

logger = logging.getLogger("mooncake_connector.http_guard")

HEADER_TIMEOUT_S = 30.0
#: The most a request's whole body may take to arrive, seconds (read_body):
#: 120 s is 64 MiB at 0.55 MB/s.
BODY_TIMEOUT_S = 120.0

_STATE = {}  # handler -> [partial since, timer, seconds, loop, counts, open connections]


class _Guarded(RequestHandler):
    """RequestHandler with the deadline (no slots of its own: an aiohttp
    handler is made by the server, then given this class)."""
    __slots__ = ()

    def data_received(self, data):
        before = self._request_count
        super().data_received(data)
        st = _STATE.get(self)
        if st is None:
            return
        if self._request_count != before or self._current_request is not None:
            st[0] = None
        elif st[0] is None:
            st[0] = st[3].time()
            if st[1] is None:
                st[1] = st[3].call_later(st[2], _check, self)

    def connection_lost(self, exc):
        st = _STATE.pop(self, None)
        if st is not None:
            if st[1] is not None:
                st[1].cancel()
            st[5][0] -= 1
        super().connection_lost(exc)


def _check(h):
    st = _STATE.get(h)
    if st is None:
        return
    st[1] = None
    if h._current_request is not None:
        st[0] = None  # serving a request: its own timeouts apply
    if st[0] is None:
        return
    left = st[0] + st[2] - st[3].time()
    if left > 0:
        st[1] = st[3].call_later(left, _check, h)
        return
    if st[4] is not None:
        st[4]["slow_header_closes"] += 1
    logger.warning("closing a connection that sent no complete request header in %.0f s "
                   "(a slow or stalled client)", st[2])
    if h.transport is not None:
        h.transport.abort()


class _MalformedOneLine(logging.Filter):
    """aiohttp.server's "Error handling request" record for a request its
    parser refused, as one WARNING line without the traceback."""

    def filter(self, record):
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            why = " ".join(str(exc.message or type(exc).__name__).split())[:300]
            record.args = (record.getMessage(), exc.code, why)
            record.msg = "%s: a malformed HTTP request, answered %s and closed: %s"
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_ONE_LINE = _MalformedOneLine()


class _Refuse(asyncio.Protocol):
    """A connection past guarded()'s max_conns: answered 503 at once, its
    side shut; what the client sends is dropped until it closes (at most 1
    s: closing with its request unread would reset the connection, and the
    client might not see the answer)."""

    def __init__(self, answer, loop):
        self.answer, self.loop, self.timer = answer, loop, None

    def connection_made(self, transport):
        transport.write(self.answer)
        if transport.can_write_eof():
            transport.write_eof()
        self.timer = self.loop.call_later(1.0, transport.close)

    def data_received(self, data):
        pass

    def eof_received(self):
        return False  # the transport closes

    def connection_lost(self, exc):
        if self.timer is not None:
            self.timer.cancel()


class Throttled:
    """A WARNING at most once per `seconds`, saying how many were not logged."""

    def __init__(self, seconds=10.0):
        self.seconds, self.next, self.quiet = seconds, 0.0, 0

    def warn(self, msg, *args):
        now = time.monotonic()
        if now < self.next:
            self.quiet += 1
            return
        more = f" ({self.quiet} more like it not logged)" if self.quiet else ""
        self.next, self.quiet = now + self.seconds, 0
        logger.warning(msg + "%s", *args, more)


def guarded(server, loop, seconds=None, counts=None, max_conns=None, limit_name=None):
    """A protocol factory for loop.create_server: server's, with the deadline
    (seconds; None: HEADER_TIMEOUT_S when a connection is made); aiohttp's
    log of a request its parser refuses made one line.  max_conns: a
    connection made while that many are open is answered 503 (JSON, naming
    limit_name, the limit it keeps under) and closed, counted in
    counts["fd_limit_refusals"] and logged at most once per 10 s."""
    logging.getLogger("aiohttp.server").addFilter(_ONE_LINE)  # added once (a set)
    usable = all(hasattr(RequestHandler, a) for a in ("_request_count", "_current_request"))
    open_conns = [0]
    warn = Throttled()
    answer = None
    if max_conns is not None:
        msg = (f"the server has {max_conns} connections open, as many as "
               f"{limit_name or 'its limit'} allows: retry later")
        data = json.dumps({"error": {"message": msg, "type": "overloaded", "code": 503}}).encode()
        answer = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(data), data))

    def factory():
        if usable and max_conns is not None and open_conns[0] >= max_conns:
            if counts is not None:
                counts["fd_limit_refusals"] = counts.get("fd_limit_refusals", 0) + 1
            warn.warn("a connection refused (503): %d connections open, as many as %s allows "
                      "(raise the hard open-file limit: ulimit -Hn, systemd LimitNOFILE=, "
                      "docker --ulimit nofile=)", open_conns[0], limit_name or "the limit")
            return _Refuse(answer, loop)
        proto = server()
        if usable and type(proto) is RequestHandler:
            proto.__class__ = _Guarded
            open_conns[0] += 1
            _STATE[proto] = [None, None, seconds or HEADER_TIMEOUT_S, loop, counts, open_conns]
        return proto

    factory.open_conns = open_conns  # [connections open now]
    return factory


def raise_nofile_limit():
    """Raises this process's soft RLIMIT_NOFILE to its hard limit: (soft
    before, soft now), None for no limit; (None, None) where it cannot be
    read (no resource module)."""
    try:
        import resource
    except ImportError:
        return None, None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    inf = resource.RLIM_INFINITY
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # a hard limit over the kernel's nr_open (macOS too)
            pass
    now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return (None if soft == inf else soft), (None if now == inf else now)


def out_of_fds(exc):
    """Whether exc (an OSError, aiohttp's ClientConnectorError included, or
    one that caused it) is EMFILE / ENFILE: this process (or the system) is
    out of file descriptors."""
    for e in (exc, getattr(exc, "os_error", None), exc.__cause__):
        if isinstance(e, OSError) and e.errno in (errno.EMFILE, errno.ENFILE):
            return True
    return False


def quiet_fd_errors(loop, what="the server"):
    """loop's exception handler, with an accept() that failed for lack of
    file descriptors (asyncio: a traceback per pending connection, every
    second until it accepts again) logged as one WARNING line at most every
    10 s; everything else as before."""
    warn = Throttled()
    before = loop.get_exception_handler()

    def handler(lp, ctx):
        exc = ctx.get("exception")
        if exc is not None and out_of_fds(exc):
            warn.warn("%s cannot accept connections: out of file descriptors (%s); they wait "
                      "(or are dropped) until some close: raise the hard open-file limit "
                      "(ulimit -Hn, systemd LimitNOFILE=, docker --ulimit nofile=)", what,
                      exc.strerror or exc)
            return
        if before is not None:
            before(lp, ctx)
        else:
            lp.default_exception_handler(ctx)

    loop.set_exception_handler(handler)


class BodyStalled(Exception):
    """The client sent no byte of its request's body for `seconds`;
    str(e) says how much of it came."""

    def __init__(self, seconds, got, length):
        self.seconds = seconds
        of = f" of {length}" if length is not None else ""
        super().__init__(f"the request's body stalled: no byte for {seconds:g} s after "
                         f"{got}{of} bytes; send the whole body at once")


class BodyTooSlow(BodyStalled):
    """The request's body did not arrive in full within `seconds` (bytes
    trickling in, each piece inside the stall deadline); str(e) says how
    much of it came."""

    def __init__(self, seconds, got, length):
        self.seconds = seconds
        of = f" of {length}" if length is not None else ""
        Exception.__init__(self, f"the request's body did not arrive in full within {seconds:g} s "
                           f"({got}{of} bytes came); send the whole body at once")


class OverBudget(Exception):
    """A body that would take the server past its budget for request bodies
    held at once (raised by read_body's take); str(e) says which."""


class BodyUnreadable(Exception):
    """The request's body does not decode as its headers say (a
    Content-Encoding it is not in, a broken chunked encoding); str(e) says
    what aiohttp found."""


def _wants_continue(request):
    return (request.version == HttpVersion11 and
            request.headers.get(hdrs.EXPECT, "").strip().lower() == "100-continue")


async def expect_later(request):
    """An aiohttp route's expect_handler (add_route(..., expect_handler=)):
    "Expect: 100-continue" is answered by read_body(), when the handler
    reads the body, not before the handler ran (aiohttp's default), so a
    request refused on its headers is answered without inviting its body.
    Any other expectation is refused (417) naming the header and the fix,
    as aiohttp's default refuses it."""
    expect = request.headers.get(hdrs.EXPECT, "")
    if request.version == HttpVersion11 and not _wants_continue(request):
        raise web.HTTPExpectationFailed(
            text=f"Expect: {expect[:100]!r} is not supported: send no Expect header, or "
                 "'Expect: 100-continue'")


async def read_body(request, max_size, seconds=None, take=None, total=None):
    """request.read() that gives up on a client sending nothing of its body
    for `seconds` (None: HEADER_TIMEOUT_S when called): BodyStalled; or
    whose whole body has not come `total` seconds after this call (None:
    BODY_TIMEOUT_S when called): BodyTooSlow (a BodyStalled).  A body
    over max_size bytes raises aiohttp's HTTPRequestEntityTooLarge, as
    request.read() does with client_max_size (at once when the announced
    length is over it); one that does not decode, BodyUnreadable.  Answer a
    body too large, stalled or unreadable with answer_and_close().  take(n):
    called with the announced length before reading, and with each n bytes
    read beyond what was announced (a chunked body); it raises OverBudget to
    refuse the body (the caller gives back what it took).  A client that
    sent "Expect: 100-continue" (the route's expect_handler expect_later)
    is told "100 Continue" once the announced length and take passed."""
    seconds = seconds or HEADER_TIMEOUT_S
    total = total or BODY_TIMEOUT_S
    loop = asyncio.get_running_loop()
    deadline = loop.time() + total
    length = request.content_length
    if length is not None and length > max_size:  # refused before reading it
        raise web.HTTPRequestEntityTooLarge(max_size=max_size, actual_size=length)
    taken = 0
    if take is not None and length:
        take(length)
        taken = length
    if _wants_continue(request) and length != 0:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the answer's own bytes start after it
    body = bytearray()
    while True:
        left = deadline - loop.time()
        try:
            if left <= 0:
                raise asyncio.TimeoutError
            chunk = await asyncio.wait_for(request.content.readany(), min(seconds, left))
        except asyncio.TimeoutError:
            if left < seconds:  # waited until the whole body's deadline
                raise BodyTooSlow(total, len(body), request.content_length) from None
            raise BodyStalled(seconds, len(body), request.content_length) from None
        except web.RequestPayloadError as e:
            why = " ".join(str(getattr(e.__cause__, "message", None) or e).split())
            raise BodyUnreadable(f"the request's body could not be read: {why}; send a body "
                                 "that matches its Content-Encoding and Transfer-Encoding "
                                 "headers") from None
        if not chunk:
            return bytes(body)
        body += chunk
        if len(body) > max_size:
            raise web.HTTPRequestEntityTooLarge(max_size=max_size, actual_size=len(body))
        if take is not None and len(body) > taken:
            take(len(body) - taken)
            taken = len(body)


async def answer_and_close(request, resp):
    """Sends resp and closes the connection: the answer to a request whose
    body was not read to its end (aiohttp would otherwise go on reading what
    is left of it for up to 10 s before closing)."""
    resp.force_close()
    try:
        await resp.prepare(request)
        await resp.write_eof()
    except (ConnectionError, RuntimeError):
        pass  # the client left
    if request.protocol is not None:
        request.protocol.force_close()
    return resp
