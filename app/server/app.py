"""The aiohttp application: the route table with the scope each route needs, and startup."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections import Counter
from collections.abc import Awaitable, Callable

from aiohttp import web

from app.core.metrics import LatencyHistogram
from app.core.service import AppService
from app.errors import Conflict
from app.server import admin as a
from app.server import handlers as h
from app.server import ollama
from app.server.chat import chat_completions
from app.server.gate import Gate, cap, fair_share
from app.server.keys import BUSY, HOSTS, IN_FLIGHT, IN_FLIGHT_PARTIES, LATENCY, SCOPES, SERVICE, TOKENLESS
from app.server.middleware import (
    LOCAL_HOSTS,
    authorize,
    boundary,
    cors_headers,
    errors,
    keyed,
    ollama_surface,
    timing,
    working,
)

log = logging.getLogger(__name__)

MAX_BODY = 8 * 1024 * 1024
# asyncio accepts up to `backlog` connections at each wake-up, a descriptor each at once, and asks
# the kernel for a queue of the same length. The batch stays short (1,024 at once used up a 1,024
# descriptor limit), the queue is made longer: when one app opened 300 connections at once, a
# queue of 128 overflowed and the next /health waited a second for TCP to retry. The gate, not the
# kernel, is where connections are refused.
ACCEPT_BATCH, QUEUE = 128, 1024
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# One table: every route, and the scope it needs (None: open to any local caller). A POST by a
# client takes an `Idempotency-Key` (LMSP §7): `keyed` for most; the routes that create a response
# claim theirs in the transaction that creates its task (app/core/answers.py). Without a client
# (pairing requests) a key is ignored: it would be shared by every local program, and a replay
# would hand one app's pairing to another.
ROUTES: list[tuple[str, str, Handler, str | None]] = [
    ("GET", "/lmsp", h.discovery, None),
    ("GET", "/health", h.health, None),
    ("POST", "/v1/responses", h.create_response, "responses:write"),
    ("GET", "/v1/responses/{response_id}", h.get_response, "responses:read"),
    ("GET", "/v1/responses/{response_id}/input_items", h.input_items, "responses:read"),
    ("POST", "/v1/responses/{response_id}/cancel", keyed(h.cancel_response), "responses:write"),
    ("GET", "/v1/tasks/{task_id}", h.get_task, "tasks:read"),
    ("GET", "/v1/tasks/{task_id}/events", h.task_events, "tasks:read"),
    ("POST", "/v1/tasks/{task_id}/cancel", keyed(h.cancel_task), "tasks:cancel"),
    ("GET", "/v1/tasks", h.list_tasks, "tasks:read"),
    ("GET", "/v1/usage", h.usage, "tasks:read"),
    ("DELETE", "/v1/responses/{response_id}", h.delete_response, "responses:write"),
    ("POST", "/v1/chat/completions", chat_completions, "responses:write"),
    ("POST", "/v1/embeddings", keyed(h.embeddings, kept=False), "responses:write"),
    ("POST", "/v1/pairings", a.request_pairing, None),
    ("GET", "/v1/pairings", a.list_pairings, "admin"),
    ("GET", "/v1/pairings/{pairing_id}", a.pairing_status, None),
    ("POST", "/v1/pairings/{pairing_id}/approve", keyed(a.approve_pairing), "admin"),
    ("POST", "/v1/pairings/{pairing_id}/deny", keyed(a.deny_pairing), "admin"),
    ("GET", "/v1/clients", a.list_clients, "admin"),
    ("DELETE", "/v1/clients/{client_id}", a.revoke_client, "admin"),
    ("GET", "/v1/models", a.list_models, "models:read"),
    ("POST", "/v1/models", keyed(a.register_model), "models:write"),
    ("POST", "/v1/models/downloads", keyed(a.create_download), "models:write"),
    ("POST", "/v1/models/remote/test", keyed(a.test_endpoint), "admin"),
    ("GET", "/v1/models/downloads/files", a.hub_files, "models:read"),
    ("GET", "/v1/models/{model_id}", a.get_model, "models:read"),
    ("PATCH", "/v1/models/{model_id}", a.update_model, "admin"),
    ("DELETE", "/v1/models/{model_id}", a.delete_model, "models:write"),
    ("POST", "/v1/models/{model_id}/load", keyed(a.load_model), "models:write"),
    ("POST", "/v1/models/{model_id}/unload", keyed(a.unload_model), "models:write"),
    ("DELETE", "/v1/models/{model_id}/engine-mode", a.forget_engine_mode, "admin"),
    ("GET", "/v1/settings", a.get_settings, "admin"),
    ("PATCH", "/v1/settings", a.patch_settings, "admin"),
    ("GET", "/metrics", a.get_metrics, "metrics:read"),
    ("GET", "/openapi.json", h.openapi, None),
    *ollama.ROUTES,  # LMSP §15: off unless the setting ollama_api says otherwise
]


def make_app(service: AppService, main: web.Application | None = None) -> web.Application:
    """The application on LMSP's port; or, given the `main` one, the Ollama listener's (LMSP §15):
    Ollama's routes only, a request without a token acting as the built-in client, each client's
    requests counted with those it makes on the main port."""
    app = web.Application(middlewares=[working, timing, errors, boundary, ollama_surface, authorize, fair_share],
                          client_max_size=MAX_BODY)
    app[SERVICE] = service
    app[LATENCY] = LatencyHistogram() if main is None else main[LATENCY]
    app[SCOPES] = {}
    app[BUSY] = set()
    app[HOSTS] = set(LOCAL_HOSTS)
    app[IN_FLIGHT] = Counter() if main is None else main[IN_FLIGHT]
    app[IN_FLIGHT_PARTIES] = Counter() if main is None else main[IN_FLIGHT_PARTIES]
    if main is not None:
        app[TOKENLESS] = service.access.tokenless
    app.on_response_prepare.append(cors_headers)
    for method, path, handler, scope in ROUTES if main is None else ollama.ROUTES:
        app.router.add_route(method, path, handler)
        app[SCOPES][(method, path)] = scope
    return app


def advertised(host: str) -> str:
    """The host part of the URL that reaches a service bound to `host`: bound to every address
    (0.0.0.0, ::, ""), the service is reached on loopback; an IPv6 address goes in brackets."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _lengthen_queue(fd: int) -> None:
    """listen() once more on a listening socket (asyncio hides the socket's own listen()), with the
    longer QUEUE: through a socket object over its descriptor, detached again rather than closed
    (a duplicate, os.dup, is no socket on Windows)."""
    again = socket.socket(fileno=fd)
    try:
        again.listen(QUEUE)
    finally:
        again.detach()


class Server:
    """The app on a TCP port, embedded in whatever loop runs (asyncio or Qt's via qasync), and
    the Ollama listener beside it when the settings want one."""

    def __init__(self, service: AppService, app: web.Application | None = None) -> None:
        self.service = service
        self.app = app or make_app(service)
        self.runner = web.AppRunner(self.app, shutdown_timeout=2.0)
        self.listener: asyncio.AbstractServer | None = None
        self.url = ""
        self.ollama = OllamaListener(service, self.app) if app is None else None

    async def start(self, host: str, port: int) -> str:
        await self.runner.setup()
        assert self.runner.server is not None
        gate = Gate(self.runner.server, lambda: cap(self.service.settings), self.app[BUSY])
        self.listener = await asyncio.get_running_loop().create_server(gate, host, port, backlog=ACCEPT_BATCH)
        for listening in self.listener.sockets:
            _lengthen_queue(listening.fileno())
        bound = self.listener.sockets[0].getsockname()[1]  # the real port when port=0
        shown = advertised(host)
        self.app[HOSTS].add(shown.lower())  # a request to the URL in service.json is answered
        self.url = f"http://{shown}:{bound}"
        if self.ollama is not None:
            await self.ollama.start()
        return self.url

    async def stop_accepting(self) -> None:
        if self.listener is not None:
            self.listener.close()
        if self.ollama is not None:
            await self.ollama.stop_accepting()

    async def stop(self) -> None:
        await self.runner.cleanup()
        if self.ollama is not None:
            await self.ollama.stop()


def port_free(port: int) -> bool:
    """Whether a listener could open 127.0.0.1:`port` now (asyncio's own options: SO_REUSEADDR)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class OllamaListener:
    """127.0.0.1:`ollama_port` while `ollama_api` is `open` (LMSP §15). Once the main server runs,
    a settings change opens or closes it before it is saved: a port already taken (Ollama itself
    running) refuses the change with 409 `port_in_use`, and an app may connect as soon as the
    change is answered. At start, a taken port is said in the log and the service runs without it."""

    def __init__(self, service: AppService, main: web.Application) -> None:
        self.service, self.main = service, main
        self.server: Server | None = None
        self.port: int | None = None
        self.active = False  # the main server runs: settings changes apply
        self._closing: set[asyncio.Task[None]] = set()
        service.settings.checks.append(self.check)

    def wanted(self, changes: dict[str, object]) -> int | None:
        settings = {**self.service.settings, **changes}
        return int(str(settings["ollama_port"])) if settings["ollama_api"] == "open" else None

    async def check(self, changes: dict[str, object]) -> None:
        """A settings check that acts: the listener as the change wants it, or the change refused."""
        port = self.wanted(changes)
        if self.active:
            await self.apply(port)
        elif port is not None and not port_free(port):
            raise self._taken(port)

    def _taken(self, port: int) -> Conflict:
        refused = Conflict("port_in_use", f"Port {port} on 127.0.0.1 is taken, by Ollama itself perhaps: quit it, "
                           "or choose another `ollama_port`.")
        refused.param = "ollama_port"  # the Settings tab shows it beside that field
        return refused

    async def start(self) -> None:
        self.active = True
        try:
            await self.apply(self.wanted({}))
        except Conflict as exc:
            log.warning("the Ollama API listener is not open: %s", exc.message)

    async def apply(self, port: int | None) -> None:
        if port == self.port:
            return
        old, self.server, self.port = self.server, None, None
        if old is not None:  # closed now; its streams end in the background
            await old.stop_accepting()
            closing = asyncio.create_task(old.stop())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        if port is None:
            return
        server = Server(self.service, make_app(self.service, self.main))
        try:
            await server.start("127.0.0.1", port)
        except OSError as exc:
            await server.stop()
            raise self._taken(port) if exc.errno == errno.EADDRINUSE else Conflict(
                "cannot_listen", f"Cannot listen on 127.0.0.1:{port}: {exc.strerror or exc}.") from None
        self.server, self.port = server, port
        log.info("serving Ollama's API on %s", server.url)

    async def stop_accepting(self) -> None:
        if self.server is not None:
            await self.server.stop_accepting()

    async def stop(self) -> None:
        server, self.server, self.port = self.server, None, None
        if server is not None:
            await server.stop()
        await asyncio.gather(*self._closing)
