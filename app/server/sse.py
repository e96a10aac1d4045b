"""Server-sent events for a task: replay from the database, then follow the bus live.

The feed is subscribed *before* the replay is read, so an event committed in between is in
one or the other (or both: duplicates are dropped by sequence number). No gap, no duplicate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator

from aiohttp import web

from app.core.service import AppService
from app.core.tasks import TERMINAL_EVENTS
from app.tasks import machine, records
from app.tasks.states import TERMINAL

HEARTBEAT_SECONDS = 15.0
PAGE_BYTES = 256 * 1024  # of stored events a stream reads at a time


def frame(event: dict[str, Any]) -> bytes:
    data = event.text if isinstance(event, records.Stored) else json.dumps(event, ensure_ascii=False)
    return f"id: {event['sequence_number']}\nevent: {event['type']}\ndata: {data}\n\n".encode()


async def _logged(service: AppService, task_id: str, after: int) -> AsyncIterator[dict[str, Any]]:
    """The stored events after `after`, read PAGE_BYTES at a time: a reader that stops reading
    holds one page, not the task's whole log."""
    while page := await service.tasks.events_after(task_id, after, PAGE_BYTES):
        for event in page:
            yield event
        after = page[-1]["sequence_number"]


async def follow(service: AppService, task_id: str, after: int,
                 heartbeat: float = HEARTBEAT_SECONDS) -> AsyncIterator[dict[str, Any] | None]:
    """A task's events after `after`: the stored ones, then live ones, ending with the terminal
    event (or when the service stops). Yields None when `heartbeat` seconds pass in silence."""
    with service.tasks.feed(task_id, watch=True) as feed:
        last = after
        async with contextlib.aclosing(_logged(service, task_id, after)) as replay:
            async for event in replay:
                yield event
                last = event["sequence_number"]
                if event["type"] in TERMINAL_EVENTS:
                    return
        if last == after and await service.store.read(machine.status_of, task_id) in (*TERMINAL, None):
            # Nothing replayed: asked for events after the terminal one (e.g. a reconnect with its
            # Last-Event-ID), or the task is gone: nothing more will ever come, so end instead of
            # sending heartbeats forever. (A replay without the terminal event shows the task was
            # not over: its status and last event commit together.) Whatever came after the replay
            # is here now.
            async with contextlib.aclosing(_logged(service, task_id, last)) as rest:
                async for event in rest:
                    yield event
            return
        while True:  # live
            try:
                # asyncio.timeout, not wait_for: no task is made for each event.
                async with asyncio.timeout(heartbeat):
                    event = await feed.get()
            except TimeoutError:
                yield None
                continue
            if event["type"] == "service.stopping":
                return
            if event["sequence_number"] <= last:
                continue
            # A reader behind its feed (which then keeps only the newest event) reads the rest from the log.
            missed = _logged(service, task_id, last) if event["sequence_number"] > last + 1 else _just(event)
            async with contextlib.aclosing(missed):
                async for event in missed:
                    yield event
                    last = event["sequence_number"]
                    if event["type"] in TERMINAL_EVENTS:
                        return


async def _just(event: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    yield event


async def stream_task(request: web.Request, service: AppService, task_id: str, after: int, *,
                      heartbeat: float = HEARTBEAT_SECONDS) -> web.StreamResponse:
    return await send(request, follow(service, task_id, after, heartbeat))


async def start(request: web.Request, status: int = 200, headers: dict[str, str] | None = None) -> web.StreamResponse:
    """An SSE response, its headers sent (X-Accel-Buffering: a proxy in front must not hold events back)."""
    response = web.StreamResponse(status=status, headers={
        "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no", **(headers or {})})
    await response.prepare(request)
    return response


async def send(request: web.Request, events: AsyncIterator[dict[str, Any] | None], status: int = 200,
               headers: dict[str, str] | None = None) -> web.StreamResponse:
    """`events` (from `follow`) as an SSE stream."""
    response = await start(request, status, headers)
    async with contextlib.aclosing(events):
        async for event in events:
            # A heartbeat is a lone comment line, no blank line after it: see LMSP §6 on the openai SDK.
            await response.write(frame(event) if event is not None else b": keep-alive\n")
    return response


# What a task says before its output: held back by `opening` (the first delta, a function
# call's item, the end, or a silence ends it).
OPENING_EVENTS = ("response.created", "response.queued", "response.loading", "response.in_progress",
                  "response.content_part.added")


async def opening(events: AsyncIterator[dict[str, Any] | None]) -> list[dict[str, Any] | None]:
    """The events of `follow` up to the first that is not the task's opening: a foreground
    stream reads them before it answers, so that a task that fails before any output (an input
    too long for the model, a model that does not load) is answered with an HTTP error, as
    OpenAI's are, and not with a stream. A silence (a task queued behind others) ends the
    wait: the stream then starts with its heartbeat."""
    held: list[dict[str, Any] | None] = []
    async for event in events:
        held.append(event)
        if event is None or not (event["type"] in OPENING_EVENTS or (
                event["type"] == "response.output_item.added" and event["item"]["type"] == "message")):
            break
    return held


async def resumed(held: list[dict[str, Any] | None],
                  events: AsyncIterator[dict[str, Any] | None]) -> AsyncIterator[dict[str, Any] | None]:
    """`held` (from `opening`), then the rest of `events`."""
    async with contextlib.aclosing(events):
        for event in held:
            yield event
        async for event in events:
            yield event
