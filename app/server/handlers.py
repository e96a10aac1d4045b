"""Route handlers: translate HTTP to facade calls and back. No business rules live here."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from aiohttp import web

from app import paths
from app.core.auth import Client
from app.errors import InvalidRequest
from app.server import sse
from app.server.keys import CLIENT, SERVICE
from app.server.middleware import read_json
from app.tasks import records
from app.tasks.states import TERMINAL, UNFINISHED



MAX_SEQUENCE = 2**63 - 1  # SQLite's INTEGER


def _client(request: web.Request) -> Client:
    return request[CLIENT]


def _after(request: web.Request) -> int:
    raw = request.query.get("after", request.query.get("starting_after", request.headers.get("Last-Event-ID", "-1")))
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequest("`after` must be an integer sequence number.", param="after") from None
    if not -1 <= value <= MAX_SEQUENCE:
        raise InvalidRequest(f"`after` must be from -1 to {MAX_SEQUENCE}.", param="after")
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
    client = _client(request)
    body: Any = await read_json(request)
    key = request.headers.get("Idempotency-Key")
    created = await service.create_response(client, body, key)
    if created.replayed:
        replayed = {"Idempotent-Replayed": "true"}
        if created.status == 202 and isinstance(created.body.get("task"), dict):  # the same 202: Location too
            replayed["Location"] = f"/v1/tasks/{created.body['task']['id']}"
        return web.json_response(created.body, status=created.status, headers=replayed)
    task_id = created.body["task"]["id"]
    location = {"Location": f"/v1/tasks/{task_id}"}
    if created.status == 202:
        if body.get("stream"):
            return await sse.stream_task(request, service, task_id, -1, status=202, headers=location)
        return web.json_response(created.body, status=202, headers=location)
    # In the foreground the caller's connection is the only reader: if it goes, so does the work.
    try:
        if body.get("stream"):
            answer: web.StreamResponse = await sse.stream_task(request, service, task_id, -1)
            final = await service.response(client, created.body["id"])
        else:
            final = records.response_object(await unless_client_leaves(request, service.wait(task_id)))
            answer = web.json_response(final)
    except (ConnectionResetError, asyncio.CancelledError):
        await cancel_quietly(service, client, task_id)
        if key:
            await asyncio.shield(service.forget(client.id, key))
        raise
    if key:
        await service.remember(client.id, key, 200, final)
    return answer


async def unless_client_leaves(request: web.Request, work: Any) -> Any:
    """Await `work`, unless the client disconnects first. aiohttp does not cancel a handler when
    its client goes away (`handler_cancellation` is off in `Server`), so the connection is watched."""
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


async def cancel_quietly(service: Any, client: Client, task_id: str) -> None:
    try:
        await asyncio.shield(service.cancel(client, "task", task_id))
    except Exception:  # already finished: nothing to stop
        pass


async def get_response(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    response_id = request.match_info["response_id"]
    if request.query.get("stream") == "true":
        row = await service.owned(_client(request), "response", response_id)
        return await sse.stream_task(request, service, row["id"], _after(request))
    return web.json_response(await service.response(_client(request), response_id))


async def input_items(request: web.Request) -> web.Response:
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("`order` must be asc or desc.", param="order")
    return web.json_response(await request.app[SERVICE].input_items(
        _client(request), request.match_info["response_id"], order, request.query.get("after"), _limit(request)))


async def embeddings(request: web.Request) -> web.Response:
    return web.json_response(await request.app[SERVICE].embed(await read_json(request)))


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
        await service.owned(_client(request), "task", task_id)
        return await sse.stream_task(request, service, task_id, after)
    return web.json_response({"object": "list", "data": await service.events(_client(request), task_id, after)})


async def cancel_task(request: web.Request) -> web.Response:
    return web.json_response(await request.app[SERVICE].cancel(_client(request), "task", request.match_info["task_id"]))


async def list_tasks(request: web.Request) -> web.Response:
    status = request.query.get("status")
    if status is not None and status not in (*UNFINISHED, *TERMINAL):
        raise InvalidRequest(f"Unknown status {status!r}.", param="status")
    tasks, more = await request.app[SERVICE].list_tasks(_client(request), status, _limit(request),
                                                       request.query.get("after"))
    return web.json_response({"object": "list", "data": tasks, "has_more": more})


def _limit(request: web.Request) -> int:
    try:
        limit = int(request.query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise InvalidRequest("`limit` must be an integer from 1 to 100.", param="limit")
    return limit


async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    await request.app[SERVICE].delete_response(_client(request), response_id)
    return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(load_openapi())


@functools.cache
def load_openapi() -> dict[str, Any]:
    import yaml

    return yaml.safe_load(paths.resource("openapi.yaml").read_text(encoding="utf-8"))
