"""Answering a request, with its idempotency key (LMSP §7), the same way on every surface: a
response created and answered (/v1/responses, /v1/chat/completions, the next API), and any other
request made with a key. A surface parses its request, calls one of these, and sends the answer
in its own shape; the rules (remember, replay, forget on failure, cancel when the caller leaves)
are all here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from app.core.auth import Client
from app.core.caller import Left, unless_left
from app.core.follow import Events, final_response, follow, opening, resumed
from app.core.idempotency import Stored
from app.core.service import AppService
from app.core.tasks import TERMINAL_EVENTS
from app.errors import Failed, LmspError
from app.tasks import records

T = TypeVar("T")
Rename = Callable[[LmspError], None]


def _as_is(error: LmspError) -> None:
    """An error in LMSP's own terms: nothing to rename."""


@dataclass(frozen=True)
class Ask:
    """A request to create a response, as a surface hands it over."""
    client: Client
    body: Any                    # the Responses request
    key: str | None = None       # its Idempotency-Key
    stream: bool = False         # answered with the task's events, not with the final response
    path: str = "/v1/responses"  # the key is bound to the path and to what was sent
    sent: Any = None             # the body as the client sent it, when `body` was translated from it
    rename: Rename = _as_is      # an error in the surface's own terms (in place), the stored one too


@dataclass(frozen=True)
class Answer:
    """What to send. `status` >= 400 only for a replayed error: `body` is then its error body."""
    status: int                   # 200 foreground, 202 background, or the replayed answer's
    body: dict[str, Any]          # the response: as queued (background, a stream), final, or replayed
    replayed: bool                # answered from the idempotency key
    task_id: str | None = None    # the response's task
    events: Events | None = None  # when asked to stream: the task's events from its start


@contextlib.asynccontextmanager
async def respond(service: AppService, ask: Ask, left: Left) -> AsyncIterator[Answer]:
    """The answer to `ask`, sent by the surface inside the block. A replay gives the stored answer
    in the form asked, a stream of its events if `ask.stream` (what the first request saw), never
    an empty body; a stored failure is answered as it was (an error is not a stream). A foreground
    answer is stored once it is final; until then the caller is its only reader: if it leaves, or
    sending fails, the task is cancelled and the key freed for a retry. A foreground task that
    fails raises `Failed` (renamed), as does a stream that fails before any output."""
    try:
        created = await service.responses.create_response(ask.client, ask.body, ask.key, path=ask.path, sent=ask.sent)
    except LmspError as exc:
        ask.rename(exc)
        raise
    response, status = created.body, created.status
    if created.replayed and status >= 400:
        yield Answer(status, response, True)
    elif created.replayed or status == 202:
        task_id = response["task"]["id"]
        yield Answer(status, response, created.replayed, task_id,
                     follow(service.tasks, task_id, -1) if ask.stream else None)
    else:
        async with _foreground(service, ask, response, left) as answer:
            yield answer


@contextlib.asynccontextmanager
async def _foreground(service: AppService, ask: Ask, response: dict[str, Any], left: Left) -> AsyncIterator[Answer]:
    client, key, task_id = ask.client, ask.key, response["task"]["id"]
    streamed = False
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
        if ask.stream:
            events = follow(service.tasks, task_id, -1)
            async with contextlib.aclosing(events):
                held = await unless_left(left, opening(events))
                if held and held[-1] is not None and held[-1]["type"] == "response.failed":
                    final = held[-1]["response"]  # failed before any output: an error, not a stream
                else:
                    streamed = True
                    yield Answer(200, response, False, task_id, storing(resumed(held, events)))
                    final = at_end or await service.responses.response(client, response["id"])  # or the service stopped
        else:
            final = await unless_left(left, final_response(service.tasks, task_id))
    except BaseException:  # the caller left, or we failed: stop the work, free the key for a retry
        await _cancel_quietly(service, client, task_id)
        if key:
            await asyncio.shield(service.responses.forget(client.id, key))
        raise
    failure = Failed(**final["error"]) if final["status"] == "failed" and not streamed else None
    if failure is not None:
        ask.rename(failure)
    if key and at_end is None:
        status, body = (failure.status, failure.body()) if failure else (200, final)
        await service.responses.remember(client.id, key, status, body, response["id"])
    if failure is not None:
        raise failure
    if not streamed:
        yield Answer(200, final, False, task_id)


async def _cancel_quietly(service: AppService, client: Client, task_id: str) -> None:
    try:
        await asyncio.shield(service.tasks.cancel(client, "task", task_id))
    except Exception:  # already finished: nothing to stop
        pass


async def once(service: AppService, client: Client, key: str, method: str, path: str, body: Any,
               run: Callable[[], Awaitable[T]], kept: Callable[[T], tuple[int, dict[str, Any]] | None]) -> T | Stored:
    """Any other request made with an idempotency key: the key claimed before `run`, and the answer
    `kept` finds in its result (status, body) stored after; or, for a repeat, the stored answer
    to replay. An answer not kept (a stream, one cheaper to compute again than to keep), or a
    `run` that fails, frees the key: nothing was stored, and a retry runs again."""
    stored = await service.responses.claim_key(client.id, key, method, path, body)
    if stored is not None:
        return stored
    try:
        result = await run()
    except BaseException:
        await asyncio.shield(service.responses.forget(client.id, key))  # nothing done: a retry may run it
        raise
    answer = kept(result)
    if answer is not None:
        await service.responses.remember(client.id, key, *answer)
    else:
        await service.responses.forget(client.id, key)
    return result
