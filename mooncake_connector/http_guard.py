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
the same deadline between its pieces and raises BodyStalled.

A request aiohttp's parser refuses (answered 400 and closed by aiohttp) is
logged as one WARNING line naming what was wrong, not aiohttp's ERROR with
a traceback (a client could fill the log ten lines a request)."""
import asyncio
import logging

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

logger = logging.getLogger("mooncake_connector.http_guard")

HEADER_TIMEOUT_S = 30.0

_STATE = {}  # handler -> [partial since, timer, seconds, loop, counts]


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
        if st is not None and st[1] is not None:
            st[1].cancel()
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


def guarded(server, loop, seconds=None, counts=None):
    """A protocol factory for loop.create_server: server's, with the deadline
    (seconds; None: HEADER_TIMEOUT_S when a connection is made); aiohttp's
    log of a request its parser refuses made one line."""
    logging.getLogger("aiohttp.server").addFilter(_ONE_LINE)  # added once (a set)
    usable = all(hasattr(RequestHandler, a) for a in ("_request_count", "_current_request"))

    def factory():
        proto = server()
        if usable and type(proto) is RequestHandler:
            proto.__class__ = _Guarded
            _STATE[proto] = [None, None, seconds or HEADER_TIMEOUT_S, loop, counts]
        return proto

    return factory


class BodyStalled(Exception):
    """The client sent no byte of its request's body for `seconds`;
    str(e) says how much of it came."""

    def __init__(self, seconds, got, length):
        self.seconds = seconds
        of = f" of {length}" if length is not None else ""
        super().__init__(f"the request's body stalled: no byte for {seconds:g} s after "
                         f"{got}{of} bytes; send the whole body at once")


class OverBudget(Exception):
    """A body that would take the server past its budget for request bodies
    held at once (raised by read_body's take); str(e) says which."""


class BodyUnreadable(Exception):
    """The request's body does not decode as its headers say (a
    Content-Encoding it is not in, a broken chunked encoding); str(e) says
    what aiohttp found."""


async def read_body(request, max_size, seconds=None, take=None):
    """request.read() that gives up on a client sending nothing of its body
    for `seconds` (None: HEADER_TIMEOUT_S when called): BodyStalled.  A body
    over max_size bytes raises aiohttp's HTTPRequestEntityTooLarge, as
    request.read() does with client_max_size (at once when the announced
    length is over it); one that does not decode, BodyUnreadable.  Answer a
    body too large, stalled or unreadable with answer_and_close().  take(n):
    called with the announced length before reading, and with each n bytes
    read beyond what was announced (a chunked body); it raises OverBudget to
    refuse the body (the caller gives back what it took)."""
    seconds = seconds or HEADER_TIMEOUT_S
    length = request.content_length
    if length is not None and length > max_size:  # refused before reading it
        raise web.HTTPRequestEntityTooLarge(max_size=max_size, actual_size=length)
    taken = 0
    if take is not None and length:
        take(length)
        taken = length
    body = bytearray()
    while True:
        try:
            chunk = await asyncio.wait_for(request.content.readany(), seconds)
        except asyncio.TimeoutError:
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
