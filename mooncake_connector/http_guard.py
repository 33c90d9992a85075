"""A deadline on a request's header for aiohttp servers (the proxy).

aiohttp closes a connection that sends nothing (keepalive_timeout), but a
client that drips a request's header a byte at a time (slow-loris) cancels
that timer with its first byte and then holds the connection, and its
file descriptor, for as long as it likes.  guarded(server) wraps the
server's protocol factory: a connection that has sent part of a request
but no complete header for `seconds`, and is serving no request, is
closed.  It reads two attributes of aiohttp's RequestHandler
(_request_count, _current_request); if an aiohttp version lacks them the
guard does nothing."""
import logging

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


def guarded(server, loop, seconds=None, counts=None):
    """A protocol factory for loop.create_server: server's, with the deadline
    (seconds; None: HEADER_TIMEOUT_S when a connection is made)."""
    usable = all(hasattr(RequestHandler, a) for a in ("_request_count", "_current_request"))

    def factory():
        proto = server()
        if usable and type(proto) is RequestHandler:
            proto.__class__ = _Guarded
            _STATE[proto] = [None, None, seconds or HEADER_TIMEOUT_S, loop, counts]
        return proto

    return factory
