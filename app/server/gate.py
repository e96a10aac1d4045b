"""The door every connection comes through, in front of aiohttp's own: a cap on open connections,
each app's share of them, and aiohttp's refusals of malformed requests answered in the LMSP error
shape.

aiohttp accepts every connection and keeps it as long as its keep-alive timeout allows; it leaves
limits to the application (aio-libs/aiohttp#675). Without one, idle or half-sent connections use up
the process's file descriptors, and then the engine's pipes and the database cannot be opened.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from app.errors import TooManyRequests
from app.server.keys import CLIENT, IN_FLIGHT, IN_FLIGHT_PARTIES, SERVICE
from app.server.middleware import Handler, error_response

log = logging.getLogger(__name__)
HEADER_SECONDS = 10.0  # to send a whole request line and headers, or between two requests
SHARE = 8  # one app may hold an eighth of the connections; all apps together, all but an eighth
RETRY_SECONDS = 10  # a connection frees when a request or a stream ends


@functools.cache  # read once: the limit is set (raised) at start, and getrlimit on every accept cost 4 %
def _descriptors() -> int:
    if sys.platform == "win32":  # sockets are not counted against a descriptor limit there
        return 1 << 30
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 30 if soft == resource.RLIM_INFINITY else soft


def cap(settings: Mapping[str, Any]) -> int:
    """Connections open at once: the setting, but never more than a quarter of the file descriptors
    this process may open (the rest are for the engine's pipes, the database and the logs)."""
    return min(settings["max_connections"], _descriptors() // 4)


@web.middleware
async def fair_share(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A paired app's requests being answered (an event stream, until it ends) are limited: 1/SHARE
    of the connection cap each, and all apps together leave 1/SHARE to the owner, /health and
    pairing. The gate makes room by closing idle connections only, so one app holding every
    connection with streams locked everyone out, the owner included; now its excess requests
    are answered 429 and their connections go idle. The apps without a token on the Ollama
    listener are one client, whose share each of them may only use a part of (`Client.share`):
    one holding 32 half-sent bodies locked all the others out."""
    client = request.get(CLIENT)
    if client is None or client.is_admin:
        return await handler(request)
    counts, parties = request.app[IN_FLIGHT], request.app[IN_FLIGHT_PARTIES]
    limit = max(1, cap(request.app[SERVICE].settings) // SHARE)
    party = (client.id, client.party) if client.party is not None else None
    if party is not None and parties[party] >= client.share(limit):
        raise TooManyRequests("too_many_connections", f"This app already has {parties[party]} requests in progress, "
                              "its limit (a part of the share of the apps without a token). Close some, or wait "
                              "until they end.", RETRY_SECONDS)
    if counts[client.id] >= limit:
        raise TooManyRequests("too_many_connections", f"This client already has {limit} requests in progress "
                              "(event streams included), its limit (an eighth of the setting max_connections). "
                              "Close some, or wait until they end.", RETRY_SECONDS)
    if sum(counts.values()) >= limit * (SHARE - 1):
        raise TooManyRequests("too_many_connections", "Paired apps together have all the requests in progress "
                              "the service keeps for them (the rest are for the owner, /health and pairing). "
                              "Try again when some have ended.", RETRY_SECONDS)
    counts[client.id] += 1
    if party is not None:
        parties[party] += 1
    try:
        return await handler(request)
    finally:
        _release(counts, client.id)
        if party is not None:
            _release(parties, party)


def _release(counts: Counter[Any], key: Any) -> None:
    counts[key] -= 1
    if not counts[key]:
        del counts[key]


class _Refused(asyncio.Protocol):
    """A connection over the cap with nothing idle to make room: closed as soon as it opens."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cast(asyncio.Transport, transport).abort()


class _Handler(RequestHandler):
    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's answer to a request its parser refused (a bad byte in a header, a line too
        long...): the LMSP error body and one log line. aiohttp's own logs a traceback at ERROR and
        answers plain text that echoes the raw header line back."""
        if isinstance(exc, ConnectionError):  # the client left (or the gate closed it): nobody to answer
            return web.Response(status=status)
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        first = (getattr(exc, "message", None) or message or "malformed request").splitlines()[0]
        reason = first.split(":")[0][:80]
        log.warning("refused a malformed request from %s: %s", request.remote, reason)  # throttled (app.logs)
        response = error_response(status, "invalid_request", f"The request is not valid HTTP ({reason}).")
        response.force_close()
        return response


class Gate:
    """A protocol factory for `loop.create_server`: at most `limit()` open connections. A new one
    past the cap first closes the oldest idle connection (between requests, or still sending its
    request line and headers), as nginx does with keep-alive connections; if every one is inside a
    handler, the newcomer is closed at once. So no client can hold more sockets than the cap, and
    a request that arrives whole is served while idle connections are being piled up."""

    def __init__(self, server: web.Server, limit: Callable[[], int], busy: set[RequestHandler]) -> None:
        self.server = server
        self.limit = limit
        self.busy = busy  # connections inside a handler: the `working` middleware keeps it
        self.loop = asyncio.get_running_loop()

    def __call__(self) -> asyncio.Protocol:
        limit, live = self.limit(), self.server.connections  # oldest first
        if len(live) >= limit:  # (below the cap, no walk over them: this runs on every accept)
            live = [h for h in live if h.transport is not None]
        if len(live) >= limit:
            idle = next((h for h in live if h not in self.busy), None)
            if idle is None:
                return _Refused()
            idle.force_close()
        # The keep-alive timeout also runs from the moment a connection opens: it closes one that
        # has not sent a whole request line and headers within HEADER_SECONDS (slowloris).
        # No TCP keep-alive probes (a system call each): they find a dead peer after two hours, and
        # the keep-alive timeout closes an idle connection long before.
        return _Handler(self.server, loop=self.loop, keepalive_timeout=HEADER_SECONDS, tcp_keepalive=False,
                        access_log=None)  # type: ignore[arg-type]  # None: no access log, as aiohttp's docs say

