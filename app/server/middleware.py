"""What runs before any handler: errors as JSON, the Host and Origin checks, auth and scopes, and
idempotency keys on the routes that take them."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from app.core import answers, ollama
from app.core.idempotency import Stored
from app.errors import Forbidden, LmspError, Unauthorized
from app.server import peer
from app.server.keys import BUSY, CLIENT, HOSTS, LATENCY, SCOPES, SERVICE, TOKENLESS

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
LOCAL_HOSTS = {"localhost", "127.0.0.1", "[::1]"}
DECODE_ON_LOOP = 64 * 1024  # bytes of JSON decoded in a couple of milliseconds; larger ones on a reader thread
# A body must come at BODY_FLOOR bytes a second at least, counted from its headers, after a grace of
# BODY_GRACE_SECONDS: one that comes slower (or stops) holds its connection, and its sender's share
# of requests in progress, for nothing. Loopback sends 8 MiB in milliseconds; a slow link, 64 KiB/s.
BODY_GRACE_SECONDS = 2.0
BODY_FLOOR = 64 * 1024
CORS_ORIGIN = web.RequestKey("cors_origin", str)  # set once the Origin passed the check
# LMSP §16. The request headers a page may send: the ones the API reads or harmlessly ignores, as
# the official `openai` JavaScript SDK sends them (a `*` would not cover Authorization), and the
# SDK's X-Stainless-* ones (its version, platform, retry count), named back as the preflight asks.
CORS_REQUEST_HEADERS = ("Authorization", "Content-Type", "Accept", "Idempotency-Key", "Last-Event-ID", "OpenAI-Beta",
                        "X-Requested-With")
STAINLESS = re.compile(r"x-stainless-[a-z0-9-]+", re.IGNORECASE)
CORS_EXPOSED = "Location, Idempotent-Replayed, Retry-After, X-Request-Id, openai-poll-after-ms"  # readable by scripts
CORS_MAX_AGE = "600"  # seconds a browser may keep a preflight's answer
PAIRING = re.compile(r"/v1/pairings(/[^/]+)?")  # where a page not yet allowed asks to pair, and polls


def error_response(status: int, code: str, message: str, *, param: str | None = None,
                   etype: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"type": etype, "code": code, "message": message, "param": param}},
                             status=status)


HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large", 400: "invalid_request"}


@web.middleware
async def working(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Marks the connection busy while its request is handled: the gate (app/server/gate.py) makes
    room by closing idle connections only, never one being answered or streamed to."""
    busy = request.app[BUSY]
    busy.add(request.protocol)
    try:
        return await handler(request)
    finally:
        busy.discard(request.protocol)


@web.middleware
async def timing(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Request latency for /metrics: until the handler returns (for a stream, until it starts)."""
    started = time.perf_counter()
    try:
        return await handler(request)
    finally:
        request.app[LATENCY].observe(time.perf_counter() - started)


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves as the LMSP error body: never a stack trace, never an HTML page."""
    try:
        return await handler(request)
    except LmspError as exc:
        headers = {**exc.headers, **({"WWW-Authenticate": 'Bearer realm="lmsp"'} if exc.status == 401 else {})}
        return web.json_response(exc.body(), status=exc.status, headers=headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = HTTP_CODES.get(exc.status, "http_error")
        message = "The request body is larger than the limit." if exc.status == 413 else exc.reason
        response = error_response(exc.status, code, message)
        if "Allow" in exc.headers:  # a 405 must say which methods the route takes (RFC 9110)
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except ConnectionResetError:
        raise  # the client went away: nobody to answer
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return error_response(500, "internal_error", "Something went wrong inside the service.",
                              etype="server_error")


# RFC 9110 `Host`: a name, an IPv4 address or a bracketed IPv6 one, then at most ":port".
HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^\s:\[\]]+)(?::[0-9]{1,5})?")


def _host_name(host: str) -> str:
    """The name part of a well-formed Host value; "" for anything else (`[::1]evil`, `localhost:x`)."""
    match = HOST.fullmatch(host)
    return match.group(1) if match else ""


@web.middleware
async def boundary(request: web.Request, handler: Handler) -> web.StreamResponse:
    """DNS-rebinding defence (Host) and cross-site defence (Origin), before any work. An origin
    passes if the owner allowed it (`allowed_origins`), if some client was paired from it, or on
    the two pairing routes, where any page may ask (the person then sees its origin)."""
    settings = request.app[SERVICE].settings
    host = _host_name(request.headers.get("Host", "")).lower()
    if host not in request.app[HOSTS] and host not in settings["allowed_hosts"]:
        return error_response(421, "misdirected_request", "This service only answers requests addressed to localhost.")
    origin = request.headers.get("Origin")
    if origin is None:
        return await handler(request)
    # Some client's origin passes here; `authorize` then wants that client's token.
    known = _allowed_everywhere(request, origin) or request.app[SERVICE].access.origin_known(origin)
    if not (known or PAIRING.fullmatch(request.path)):
        return error_response(403, "origin_not_allowed", f"Requests from the origin {origin!r} are not allowed: "
                              "a page asks to pair first (POST /v1/pairings), or the owner adds its origin to "
                              "the setting allowed_origins.", etype="permission_error")
    request[CORS_ORIGIN] = origin  # `cors_headers` adds the headers to whatever answer this request gets
    if request.method == "OPTIONS":
        return _preflight(request)
    return await handler(request)


def _allowed_everywhere(request: web.Request, origin: str) -> bool:
    """Pages of `origin` may use any token (the owner listed it, or it is one of the origins Ollama
    allows, on Ollama's paths), not only their own client's."""
    return origin in request.app[SERVICE].settings["allowed_origins"] or ollama.default_origin(request.path, origin)


def _preflight(request: web.Request) -> web.Response:
    """A browser's question before a request it may not send unasked (LMSP §16): no token comes with it."""
    asked = (name.strip() for name in request.headers.get("Access-Control-Request-Headers", "").split(","))
    headers = [*CORS_REQUEST_HEADERS, *(name for name in asked if STAINLESS.fullmatch(name))]
    return web.Response(status=204, headers={"Access-Control-Allow-Methods": "GET, POST, PATCH, DELETE, OPTIONS",
                                             "Access-Control-Allow-Headers": ", ".join(headers),
                                             "Access-Control-Max-Age": CORS_MAX_AGE})


@web.middleware
async def ollama_surface(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Ollama's API (LMSP §15): not there while the setting `ollama_api` is `off`; its refusals (a
    token, a scope, a bad request) in Ollama's words, `{"error": "..."}`, which its clients show."""
    if not ollama.is_ollama_path(request.path):
        return await handler(request)
    if request.app[SERVICE].settings["ollama_api"] == "off":
        raise web.HTTPNotFound()
    try:
        return await handler(request)
    except LmspError as exc:
        headers = {**exc.headers, **({"WWW-Authenticate": 'Bearer realm="lmsp"'} if exc.status == 401 else {})}
        return web.json_response({"error": exc.message}, status=exc.status, headers=headers)


async def cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """On every response about to be sent to an allowed origin, errors and event streams included
    (a browser hides a response without them from the page). Hooked to `on_response_prepare`."""
    origin = request.get(CORS_ORIGIN)
    if origin is None:
        return
    response.headers["Access-Control-Allow-Origin"] = origin
    response.headers["Vary"] = "Origin"
    response.headers["Access-Control-Expose-Headers"] = CORS_EXPOSED


@web.middleware
async def authorize(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every route has a row in the scope table; routes with a scope need a token that has it."""
    route = request.match_info.route.resource
    key = (request.method, route.canonical if route is not None else "")
    scopes = request.app[SCOPES]
    if key not in scopes:
        return await handler(request)  # 404/405 from the router: nothing to guard
    scope = scopes[key]
    if scope is None:
        return await handler(request)
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():  # the scheme is case-insensitive (RFC 9110)
        tokenless = request.app.get(TOKENLESS)  # on the Ollama listener: its built-in client
        client = tokenless() if tokenless is not None else None
        if client is None:
            raise Unauthorized()
        # Every app without a token is this one client; each has its own share of its limits.
        client = dataclasses.replace(client, party=await peer.party(request))
    else:
        client = await request.app[SERVICE].access.authenticate(token.strip())
    if client is None:
        raise Unauthorized("The token is not valid (unknown or revoked).")
    if not client.allows(scope):
        raise Forbidden("insufficient_scope", f"This token lacks the scope {scope!r}.")
    origin = request.get(CORS_ORIGIN)
    if origin is not None and origin not in client.origins and not _allowed_everywhere(request, origin):
        # Another client's page: an origin allowed for one app's token is not allowed for the others'.
        raise Forbidden("origin_not_allowed", f"Pages from {origin!r} may not use this token: its app "
                        "was not paired from them.")
    request[CLIENT] = client
    return await handler(request)


async def read_json(request: web.Request) -> Any:
    """The body as JSON, or a 400 `invalid_json` / 413 `payload_too_large` / 408 `request_timeout`."""
    busy = request.app[BUSY]
    busy.discard(request.protocol)  # while its body is still coming, the gate may close it to make room
    try:
        raw = await _arrived(request)
    except web.HTTPRequestEntityTooLarge:
        raise LmspError("payload_too_large", "The request body is larger than the limit.", status=413) from None
    except TimeoutError:
        request.protocol.close()  # its unread rest must not be taken for the next request
        raise LmspError("request_timeout", f"The request body came slower than {BODY_FLOOR // 1024} KiB/s "
                        f"(after {BODY_GRACE_SECONDS:.0f} s): send it whole, at once.", status=408) from None
    except RuntimeError:
        # aiohttp's "Connection closed.": the gate closed this connection to make room (or the
        # client left) between two parts of the body. Nobody to answer, nothing to log.
        raise ConnectionResetError("the connection closed before its body arrived") from None
    finally:
        busy.add(request.protocol)
    if len(raw) < DECODE_ON_LOOP:
        return _decoded(raw)
    return await request.app[SERVICE].off_loop(_decoded, raw)


async def _arrived(request: web.Request) -> bytes:
    """The whole body, or TimeoutError as soon as it falls behind the floor: BODY_FLOOR bytes a
    second since the headers came, after BODY_GRACE_SECONDS. A body that never completes would
    otherwise hold its connection; one that trickles, as long as it likes."""
    reading = asyncio.ensure_future(request.read())
    started = time.monotonic()
    due = started + BODY_GRACE_SECONDS
    try:
        while True:
            done, _ = await asyncio.wait({reading}, timeout=due - time.monotonic())
            if done:
                return reading.result()
            due = started + BODY_GRACE_SECONDS + request.content.total_bytes / BODY_FLOOR
            if time.monotonic() >= due:
                raise TimeoutError
    finally:
        reading.cancel()


# Where a body can hold a UTF-16 surrogate: only as an escape, as valid UTF-8 cannot encode one.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _decoded(raw: bytes) -> Any:
    try:
        value = json.loads(raw or b"null")
        # `"\ud800"` parses into a str that is not text: it cannot be stored or hashed (I-JSON forbids it).
        # Encoding it all again to find out holds the GIL (and so /health) as long as parsing did:
        # only a body with such an escape can have one.
        if SURROGATE_ESCAPE.search(raw):
            json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise LmspError("invalid_json", "The body is not valid JSON text: it has a lone UTF-16 surrogate "
                        "(an unpaired \\ud800-\\udfff escape).", status=400) from None
    except (ValueError, RecursionError) as exc:  # also bad UTF-8, numbers over 4300 digits, deep nesting
        raise LmspError("invalid_json", f"The body is not valid JSON: {exc}", status=400) from None
    return value


def keyed(handler: Handler, *, kept: bool = True) -> Handler:
    """`handler` answering an `Idempotency-Key` (LMSP §7) as app/core/answers.py `once` says: the
    routes of the table that declare it (app/server/app.py). A JSON answer is stored for a retry
    to replay, unless not `kept`: then the key guards the request while it runs, and a retry
    computes it anew. A stream is never stored."""
    async def answering(request: web.Request) -> web.StreamResponse:
        key = request.headers.get("Idempotency-Key")
        if key is None:
            return await handler(request)
        body = await read_json(request)  # aiohttp keeps the body: the handler reads it again for free
        result = await answers.once(request.app[SERVICE], request[CLIENT], key, request.method, request.path, body,
                                    lambda: handler(request), _json if kept else lambda response: None)
        if isinstance(result, Stored):
            return web.json_response(result.body, status=result.status, headers={"Idempotent-Replayed": "true"})
        return result
    return answering


def _json(response: web.StreamResponse) -> tuple[int, dict[str, Any]] | None:
    """The status and JSON body of a whole JSON answer; None for a stream."""
    if isinstance(response, web.Response) and response.content_type == "application/json" and response.body:
        return response.status, json.loads(bytes(response.body))  # type: ignore[arg-type]
    return None
