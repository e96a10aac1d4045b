"""Route handlers: translate HTTP to facade calls and back. No business rules live here."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import orjson
from aiohttp import web

from app import paths
from app.core.auth import Client
from app.core.responses import Created
from app.core.tasks import TERMINAL_EVENTS
from app.errors import Failed, InvalidRequest, LmspError
from app.server import sse
from app.server.keys import CLIENT, SERVICE
from app.server.middleware import read_json
from app.tasks import records
from app.tasks.states import TERMINAL, UNFINISHED


Events = AsyncIterator[dict[str, Any] | None]  # a task's events, from `sse.follow`
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
    the start (`stream(request, response, status, headers, events)`, `events` from
    `sse.follow`), and its errors in its own terms (`rename(error)`, in place)."""
    json: Callable[[dict[str, Any]], dict[str, Any]]
    stream: Callable[[web.Request, dict[str, Any], int, dict[str, str], Events], Awaitable[web.StreamResponse]]
    rename: Callable[[LmspError], None]


def _stream_events(request: web.Request, response: dict[str, Any], status: int, headers: dict[str, str],
                   events: Events) -> Awaitable[web.StreamResponse]:
    return sse.send(request, events, status, headers)


RESPONSES = Shape(lambda response: response, _stream_events, lambda error: None)


async def create_response(request: web.Request) -> web.StreamResponse:
    body: Any = await read_json(request)
    key = request.headers.get("Idempotency-Key")
    created = await request.app[SERVICE].responses.create_response(_client(request), body, key)
    return await answer(request, created, key, bool(body.get("stream")), RESPONSES)


async def answer(request: web.Request, created: Created, key: str | None, stream: bool,
                 shape: Shape) -> web.StreamResponse:
    """The answer to a response just created, or to a retry with its idempotency key: a replay
    gives the stored answer in the shape asked, a stream of its events if `stream` (what the
    first request saw), never an empty body. A foreground answer is stored once it is final."""
    service, client = request.app[SERVICE], _client(request)
    response, status = created.body, created.status
    if created.replayed and status >= 400:  # a failure is answered as it was: an error is not a stream
        return web.json_response(response, status=status, headers={"Idempotent-Replayed": "true"})
    task_id = response["task"]["id"]
    headers = {"Location": f"/v1/tasks/{task_id}"} if status == 202 else {}
    if created.replayed:
        headers["Idempotent-Replayed"] = "true"
    if created.replayed or status == 202:
        if stream:
            return await shape.stream(request, response, status, headers, sse.follow(service, task_id, -1))
        return web.json_response(shape.json(response), status=status, headers=headers)
    # In the foreground the caller's connection is the only reader: if it goes, so does the work.
    streamed = None
    at_end: dict[str, Any] | None = None  # a stream's final response, from its end event

    async def storing(events: Events) -> Events:
        """`events`, the answer stored under the key before the task's end event goes out: a client
        that retries the moment its stream ends (the openai SDK stops reading at that event, before
        the connection closes) must find it stored, not its key still in flight."""
        nonlocal at_end
        async with contextlib.aclosing(events):
            async for event in events:
                if event is not None and event["type"] in TERMINAL_EVENTS:
                    at_end = {**event["response"], **{k: response[k] for k in records.ECHOED}}  # the whole response
                    if key:
                        await service.responses.remember(client.id, key, 200, at_end, response["id"])
                yield event

    try:
        if stream:
            events = sse.follow(service, task_id, -1)
            async with contextlib.aclosing(events):
                held = await unless_client_leaves(request, sse.opening(events))
                if held and held[-1] is not None and held[-1]["type"] == "response.failed":
                    final = held[-1]["response"]  # failed before any output: an error, not a stream
                else:
                    streamed = await shape.stream(request, response, 200, {}, storing(sse.resumed(held, events)))
                    final = at_end or await service.responses.response(client, response["id"])  # or the service stopped
        else:
            final = records.response_object(await unless_client_leaves(request, service.tasks.wait(task_id)))
    except BaseException:  # the client left, or we failed: stop the work, free the key for a retry
        await cancel_quietly(service, client, task_id)
        if key:
            await asyncio.shield(service.responses.forget(client.id, key))
        raise
    failure = Failed(**final["error"]) if final["status"] == "failed" and streamed is None else None
    if failure is not None:
        shape.rename(failure)
    if key and at_end is None:
        await service.responses.remember(client.id, key, *((failure.status, failure.body()) if failure else (200, final)),
                               response["id"])
    if failure is not None:
        raise failure
    return streamed if streamed is not None else web.json_response(shape.json(final))


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
        await asyncio.shield(service.tasks.cancel(client, "task", task_id))
    except Exception:  # already finished: nothing to stop
        pass


async def get_response(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    response_id = request.match_info["response_id"]
    if request.query.get("stream") == "true":
        row = await service.tasks.owned(_client(request), "response", response_id)
        return await sse.stream_task(request, service, row["id"], _after(request))
    return web.json_response(await service.responses.response(_client(request), response_id))


async def input_items(request: web.Request) -> web.Response:
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("`order` must be asc or desc.", param="order")
    return web.json_response(await request.app[SERVICE].responses.input_items(
        _client(request), request.match_info["response_id"], order, request.query.get("after"), _limit(request)))


async def embeddings(request: web.Request) -> web.Response:
    body = await read_json(request)
    answer = await unless_client_leaves(request, request.app[SERVICE].embeddings.embed(body))
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
        return await sse.stream_task(request, service, task_id, after)
    return web.json_response({"object": "list", "data": await service.tasks.events(_client(request), task_id, after)})


async def cancel_task(request: web.Request) -> web.Response:
    return web.json_response(await request.app[SERVICE].tasks.cancel(_client(request), "task", request.match_info["task_id"]))


async def list_tasks(request: web.Request) -> web.Response:
    status = request.query.get("status")
    if status is not None and status not in (*UNFINISHED, *TERMINAL):
        raise InvalidRequest(f"Unknown status {status!r}.", param="status")
    tasks, more = await request.app[SERVICE].tasks.list_tasks(_client(request), status, _limit(request),
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
    await request.app[SERVICE].responses.delete_response(_client(request), response_id)
    return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(load_openapi())


@functools.cache
def load_openapi() -> dict[str, Any]:
    import yaml

    return yaml.safe_load(paths.resource("openapi.yaml").read_text(encoding="utf-8"))
