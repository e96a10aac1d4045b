"""Route handlers: translate HTTP to facade calls and back. No business rules live here."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, TypeVar

from aiohttp import web

from app.core.auth import Client
from app.errors import InvalidRequest
from app.server import sse
from app.server.keys import SERVICE
from app.server.middleware import read_json
from app.tasks import records

T = TypeVar("T")


def _client(request: web.Request) -> Client:
    return request["client"]


def _after(request: web.Request) -> int:
    raw = request.query.get("after", request.query.get("starting_after", request.headers.get("Last-Event-ID", "-1")))
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequest("`after` must be an integer sequence number.", param="after") from None
    if value < -1:
        raise InvalidRequest("`after` must be -1 or more.", param="after")
    return value


def _wants_stream(request: web.Request) -> bool:
    return request.query.get("stream") == "true" or "text/event-stream" in request.headers.get("Accept", "")


async def discovery(request: web.Request) -> web.Response:
    return web.json_response(request.app[SERVICE].describe())


async def health(request: web.Request) -> web.Response:
    if request.app[SERVICE].ready:
        return web.json_response({"status": "ok"})
    return web.json_response({"status": "starting"}, status=503)


async def create_response(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    body: Any = await read_json(request)
    created = await service.create_response(_client(request), body)
    task_id = created["task"]["id"]
    location = {"Location": f"/v1/tasks/{task_id}"}
    if created["background"]:
        if body.get("stream"):
            return await sse.stream_task(request, service, task_id, -1, status=202, headers=location)
        return web.json_response(created, status=202, headers=location)
    # In the foreground the caller's connection is the only reader: if it goes, so does the work.
    try:
        if body.get("stream"):
            return await sse.stream_task(request, service, task_id, -1)
        row = await _unless_client_leaves(request, service.wait(task_id))
    except (ConnectionResetError, asyncio.CancelledError):
        await _cancel_quietly(service, _client(request), task_id)
        raise
    return web.json_response(records.response_object(row))


async def _unless_client_leaves(request: web.Request, work: Awaitable[T]) -> T:
    """Await `work`, unless the client disconnects first: aiohttp does not cancel a handler when
    its client goes away (`handler_cancellation` is off), so the connection is watched here."""
    waiter = asyncio.ensure_future(work)
    try:
        while not waiter.done():
            transport = request.transport
            if transport is None or transport.is_closing():
                raise asyncio.CancelledError("the client disconnected")
            await asyncio.wait([waiter], timeout=0.25)
        return waiter.result()
    finally:
        waiter.cancel()


async def _cancel_quietly(service: Any, client: Client, task_id: str) -> None:
    try:
        await asyncio.shield(service.cancel(client, "task", task_id))
    except Exception:  # already finished: nothing to stop
        pass


async def get_response(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    response_id = request.match_info["response_id"]
    if request.query.get("stream") == "true":
        row = await service.task_row(_client(request), "response", response_id)
        return await sse.stream_task(request, service, row["id"], _after(request))
    return web.json_response(await service.response(_client(request), response_id))


async def cancel_response(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    response_id = request.match_info["response_id"]
    await service.cancel(_client(request), "response", response_id)
    return web.json_response(await service.response(_client(request), response_id))


async def get_task(request: web.Request) -> web.Response:
    return web.json_response(await request.app[SERVICE].task(_client(request), request.match_info["task_id"]))


async def task_events(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    task_id = request.match_info["task_id"]
    after = _after(request)
    if _wants_stream(request):
        await service.task_row(_client(request), "task", task_id)
        return await sse.stream_task(request, service, task_id, after)
    return web.json_response({"object": "list", "data": await service.events(_client(request), task_id, after)})


async def cancel_task(request: web.Request) -> web.Response:
    return web.json_response(await request.app[SERVICE].cancel(_client(request), "task", request.match_info["task_id"]))
