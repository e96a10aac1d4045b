"""Following a task, for any surface (SSE, NDJSON...): its events from a sequence number on, the
stored ones then the live ones, and waiting for its end.

The feed is subscribed *before* the replay is read, so an event committed in between is in
one or the other (or both: duplicates are dropped by sequence number). No gap, no duplicate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator
from typing import Any

from app.core.tasks import TERMINAL_EVENTS, Tasks
from app.errors import InvalidRequest
from app.tasks import records

# Also the surfaces' names for task statuses (a filter, the GUI's "active"): they import no app.tasks.
from app.tasks.states import TERMINAL as TERMINAL
from app.tasks.states import UNFINISHED as UNFINISHED

Events = AsyncGenerator[dict[str, Any] | None, None]  # a task's events; None: a silence of `heartbeat` seconds
HEARTBEAT_SECONDS = 15.0
PAGE_BYTES = 256 * 1024  # of stored events a follower reads at a time


def event_text(event: dict[str, Any]) -> str:
    """The event as JSON text: a stored one as it was written, not encoded again for each reader."""
    return event.text if isinstance(event, records.Stored) else json.dumps(event, ensure_ascii=False)


def check_status(status: str | None) -> str | None:
    """A task status to filter by, or a 400."""
    if status is not None and status not in (*UNFINISHED, *TERMINAL):
        raise InvalidRequest(f"Unknown status {status!r}.", param="status")
    return status


async def _logged(tasks: Tasks, task_id: str, after: int) -> AsyncGenerator[dict[str, Any], None]:
    """The stored events after `after`, read PAGE_BYTES at a time: a reader that stops reading
    holds one page, not the task's whole log."""
    while page := await tasks.events_after(task_id, after, PAGE_BYTES):
        for event in page:
            yield event
        after = page[-1]["sequence_number"]


async def follow(tasks: Tasks, task_id: str, after: int, heartbeat: float = HEARTBEAT_SECONDS) -> Events:
    """A task's events after `after`: the stored ones, then live ones, ending with the terminal
    event (or when the service stops). Yields None when `heartbeat` seconds pass in silence."""
    with tasks.feed(task_id, watch=True) as feed:
        last = after
        async with contextlib.aclosing(_logged(tasks, task_id, after)) as replay:
            async for event in replay:
                yield event
                last = event["sequence_number"]
                if event["type"] in TERMINAL_EVENTS:
                    return
        if last == after and await tasks.status(task_id) in (*TERMINAL, None):
            # Nothing replayed: asked for events after the terminal one (e.g. a reconnect with its
            # Last-Event-ID), or the task is gone: nothing more will ever come, so end instead of
            # sending heartbeats forever. (A replay without the terminal event shows the task was
            # not over: its status and last event commit together.) Whatever came after the replay
            # is here now.
            async with contextlib.aclosing(_logged(tasks, task_id, last)) as rest:
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
            missed = _logged(tasks, task_id, last) if event["sequence_number"] > last + 1 else _just(event)
            async with contextlib.aclosing(missed):
                async for event in missed:
                    yield event
                    last = event["sequence_number"]
                    if event["type"] in TERMINAL_EVENTS:
                        return


async def _just(event: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
    yield event


# What a task says before its output: held back by `opening` (the first delta, a function
# call's item, the end, or a silence ends it).
OPENING_EVENTS = ("response.created", "response.queued", "response.loading", "response.in_progress",
                  "response.content_part.added")


async def opening(events: Events) -> list[dict[str, Any] | None]:
    """The events of `follow` up to the first that is not the task's opening: a foreground
    stream reads them before it answers, so that a task that fails before any output (an input
    too long for the model, a model that does not load) is answered with an error, as OpenAI's
    are, and not with a stream. A silence (a task queued behind others) ends the wait: the
    stream then starts with its heartbeat."""
    held: list[dict[str, Any] | None] = []
    async for event in events:
        held.append(event)
        if event is None or not (event["type"] in OPENING_EVENTS or (
                event["type"] == "response.output_item.added" and event["item"]["type"] == "message")):
            break
    return held


async def resumed(held: list[dict[str, Any] | None], events: Events) -> Events:
    """`held` (from `opening`), then the rest of `events`."""
    async with contextlib.aclosing(events):
        for event in held:
            yield event
        async for event in events:
            yield event


async def final_response(tasks: Tasks, task_id: str) -> dict[str, Any]:
    """The response of a task once it has ended (or as it stands when the service stops)."""
    return records.response_object(await tasks.wait(task_id))
