"""Route handlers: translate HTTP to facade calls and back. No business rules live here."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from app import paths
from app.core import answers
from app.core.answers import Ask
from app.core.auth import Client
from app.core.caller import Left, unless_left
from app.core.follow import Events, check_status, follow
from app.errors import InvalidRequest
from app.server import sse
from app.server.keys import CLIENT, SERVICE
from app.server.middleware import read_json

MAX_SEQUENCE = 2**63 - 1  # SQLite's INTEGER


def _client(request: web.Request) -> Client:
    return request[CLIENT]


def _after(request: web.Request) -> int:
    """The sequence number to replay after, from whichever of its three names the client used
    (LMSP's `after`, the openai SDK's `starting_after`, an EventSource's `Last-Event-ID`)."""
    name, raw = next(((n, v) for n, v in (("after", request.query.get("after")),
                                          ("starting_after", request.query.get("starting_after")),
                                          ("Last-Event-ID", request.headers.get("Last-Event-ID")))
                      if v is not None), ("after", "-1"))
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequest(f"`{name}` must be an integer sequence number.", param=name) from None
    if not -1 <= value <= MAX_SEQUENCE:
        raise InvalidRequest(f"`{name}` must be from -1 to {MAX_SEQUENCE}.", param=name)
    return value


def _wants_stream(request: web.Request) -> bool:
    return request.query.get("stream") == "true" or "text/event-stream" in request.headers.get("Accept", "")


async def discovery(request: web.Request) -> web.Response:
    return web.json_response(request.app[SERVICE].describe())


async def health(request: web.Request) -> web.Response:
    if request.app[SERVICE].ready:
        return web.json_response({"status": "ok"})
    return web.json_response({"status": "starting"}, status=503)


@dataclass(frozen=True)
class Shape:
    """How a route answers with a response: as JSON, or as a stream of its task's events from
    the start (`stream(request, response, status, headers, events)`)."""
    json: Callable[[dict[str, Any]], dict[str, Any]]
    stream: Callable[[web.Request, dict[str, Any], int, dict[str, str], Events], Awaitable[web.StreamResponse]]


def _stream_events(request: web.Request, response: dict[str, Any], status: int, headers: dict[str, str],
                   events: Events) -> Awaitable[web.StreamResponse]:
    return sse.send(request, events, status, headers)


RESPONSES = Shape(lambda response: response, _stream_events)


async def create_response(request: web.Request) -> web.StreamResponse:
    body: Any = await read_json(request)
    stream = isinstance(body, dict) and bool(body.get("stream"))  # anything else is refused as it is created
    return await answer(request, Ask(_client(request), body, request.headers.get("Idempotency-Key"), stream),
                        RESPONSES)


async def answer(request: web.Request, ask: Ask, shape: Shape) -> web.StreamResponse:
    """`ask` answered (app/core/answers.py) in the route's `shape`."""
    async with answers.respond(request.app[SERVICE], ask, caller_left(request)) as answered:
        headers = {"Location": f"/v1/tasks/{answered.task_id}"} if answered.status == 202 else {}
        if answered.replayed:
            headers["Idempotent-Replayed"] = "true"
        if answered.status >= 400:  # a replayed failure: its error body as it was stored
            return web.json_response(answered.body, status=answered.status, headers=headers)
        if answered.events is not None:
            return await shape.stream(request, answered.body, answered.status, headers, answered.events)
        return web.json_response(shape.json(answered.body), status=answered.status, headers=headers)


def caller_left(request: web.Request) -> Left:
    """Whether the client of `request` has gone: its connection closing (aiohttp does not cancel a
    handler when its client goes away)."""
    def left() -> bool:
        transport = request.transport
        return transport is None or transport.is_closing()
    return left


async def get_response(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    response_id = request.match_info["response_id"]
    if request.query.get("stream") == "true":
        row = await service.tasks.owned(_client(request), "response", response_id)
        return await sse.send(request, follow(service.tasks, row["id"], _after(request)))
    return web.json_response(await service.responses.response(_client(request), response_id))


async def input_items(request: web.Request) -> web.Response:
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("`order` must be asc or desc.", param="order")
    return web.json_response(await request.app[SERVICE].responses.input_items(
        _client(request), request.match_info["response_id"], order, request.query.get("after"), _limit(request)))


async def embeddings(request: web.Request) -> web.Response:
    body = await read_json(request)
    answer = await unless_left(caller_left(request), request.app[SERVICE].embeddings.embed(body, request[CLIENT].app))
    return web.Response(body=await asyncio.to_thread(_json_by_item, answer, "data"), content_type="application/json")


def _json_by_item(answer: dict[str, Any], long: str) -> bytes:
    """`answer` as JSON (numpy arrays as lists), its list `long` one item at a time. Run on a
    thread, it lets the event loop have the interpreter between two items: one json.dumps of
    2,048 vectors as numbers (26 MB) held it for 1.3 s, and every client waited."""
    rest = orjson.dumps({key: value for key, value in answer.items() if key != long})[:-1]  # left open
    items = b",".join(orjson.dumps(item, option=orjson.OPT_SERIALIZE_NUMPY) for item in answer[long])
    return rest + (b"," if len(rest) > 1 else b"") + b'"%s":[' % long.encode() + items + b"]}"


async def cancel_response(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    response_id = request.match_info["response_id"]
    await service.tasks.cancel(_client(request), "response", response_id)
    return web.json_response(await service.responses.response(_client(request), response_id))


async def get_task(request: web.Request) -> web.Response:
    return web.json_response(await request.app[SERVICE].tasks.task(_client(request), request.match_info["task_id"]))


async def task_events(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    task_id = request.match_info["task_id"]
    after = _after(request)
    if _wants_stream(request):
        await service.tasks.owned(_client(request), "task", task_id)
        return await sse.send(request, follow(service.tasks, task_id, after))
    return web.json_response({"object": "list", "data": await service.tasks.events(_client(request), task_id, after)})


async def cancel_task(request: web.Request) -> web.Response:
    cancelled = await request.app[SERVICE].tasks.cancel(_client(request), "task", request.match_info["task_id"])
    return web.json_response(cancelled)


async def list_tasks(request: web.Request) -> web.Response:
    status = check_status(request.query.get("status"))
    tasks, more = await request.app[SERVICE].tasks.list_tasks(_client(request), status, _limit(request),
                                                       request.query.get("after"))
    return web.json_response({"object": "list", "data": tasks, "has_more": more})


async def usage(request: web.Request) -> web.Response:
    query = request.query
    data = await request.app[SERVICE].tasks.usage(_client(request), query.get("from"), query.get("to"),
                                                  query.get("group_by"))
    return web.json_response({"object": "list", "data": data})


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
    await request.app[SERVICE].responses.delete_response(_client(request), response_id)
    return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(load_openapi())


@functools.cache
def load_openapi() -> dict[str, Any]:
    import yaml

    return yaml.safe_load(paths.resource("openapi.yaml").read_text(encoding="utf-8"))
