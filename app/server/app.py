"""The aiohttp application: the route table with the scope each route needs, and startup."""

from __future__ import annotations

import asyncio
import os
import socket
from collections import Counter
from collections.abc import Awaitable, Callable

from aiohttp import web

from app.core.metrics import LatencyHistogram
from app.core.service import AppService
from app.server import admin as a
from app.server import handlers as h
from app.server.chat import chat_completions
from app.server.gate import Gate, cap, fair_share
from app.server.keys import BUSY, HOSTS, IN_FLIGHT, LATENCY, SCOPES, SERVICE
from app.server.middleware import LOCAL_HOSTS, authorize, boundary, cors_headers, errors, keyed, timing, working

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
]


def make_app(service: AppService) -> web.Application:
    app = web.Application(middlewares=[working, timing, errors, boundary, authorize, fair_share],
                          client_max_size=MAX_BODY)
    app[SERVICE] = service
    app[LATENCY] = LatencyHistogram()
    app[SCOPES] = {}
    app[BUSY] = set()
    app[HOSTS] = set(LOCAL_HOSTS)
    app[IN_FLIGHT] = Counter()
    app.on_response_prepare.append(cors_headers)
    for method, path, handler, scope in ROUTES:
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
    """listen() once more on a listening socket, through a duplicate of its descriptor (asyncio
    hides the socket's own listen()), with the longer QUEUE."""
    with socket.socket(fileno=os.dup(fd)) as again:
        again.listen(QUEUE)


class Server:
    """The app on a TCP port, embedded in whatever loop runs (asyncio or Qt's via qasync)."""

    def __init__(self, service: AppService) -> None:
        self.service = service
        self.app = make_app(service)
        self.runner = web.AppRunner(self.app, shutdown_timeout=2.0)
        self.listener: asyncio.AbstractServer | None = None
        self.url = ""

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
        return self.url

    async def stop_accepting(self) -> None:
        if self.listener is not None:
            self.listener.close()

    async def stop(self) -> None:
        await self.runner.cleanup()
