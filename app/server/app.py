"""The aiohttp application: the route table with the scope each route needs, and startup."""

from __future__ import annotations

from typing import Awaitable, Callable

from aiohttp import web

from app.core.service import AppService
from app.server import handlers as h
from app.server.keys import SCOPES, SERVICE
from app.server.middleware import authorize, boundary, cors_headers, errors

MAX_BODY = 8 * 1024 * 1024
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# One table: every route, and the scope it needs (None: open to any local caller).
ROUTES: list[tuple[str, str, Handler, str | None]] = [
    ("GET", "/lmsp", h.discovery, None),
    ("GET", "/health", h.health, None),
    ("POST", "/v1/responses", h.create_response, "responses:write"),
    ("GET", "/v1/responses/{response_id}", h.get_response, "responses:read"),
    ("POST", "/v1/responses/{response_id}/cancel", h.cancel_response, "responses:write"),
    ("GET", "/v1/tasks/{task_id}", h.get_task, "tasks:read"),
    ("GET", "/v1/tasks/{task_id}/events", h.task_events, "tasks:read"),
    ("POST", "/v1/tasks/{task_id}/cancel", h.cancel_task, "tasks:cancel"),
]


def make_app(service: AppService) -> web.Application:
    app = web.Application(middlewares=[errors, boundary, authorize], client_max_size=MAX_BODY)
    app[SERVICE] = service
    app[SCOPES] = {}
    app.on_response_prepare.append(cors_headers)
    for method, path, handler, scope in ROUTES:
        app.router.add_route(method, path, handler)
        app[SCOPES][(method, path)] = scope
    return app


class Server:
    """The app on a TCP port, embedded in whatever loop runs (asyncio or Qt's via qasync)."""

    def __init__(self, service: AppService) -> None:
        self.service = service
        self.runner = web.AppRunner(make_app(service), access_log=None, shutdown_timeout=2.0)
        self.url = ""

    async def start(self, host: str, port: int) -> str:
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        bound = self.runner.addresses[-1][1]  # the real port when port=0
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{bound}"
        return self.url

    async def stop_accepting(self) -> None:
        for site in list(self.runner.sites):
            await site.stop()

    async def stop(self) -> None:
        await self.runner.cleanup()
