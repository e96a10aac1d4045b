"""Responses (LMSP §5, OpenAI's Responses API): create one as a durable task, read, delete, and
the idempotency keys of requests that create things."""

from __future__ import annotations

import asyncio
import functools
import json
import sqlite3
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from app.core import conversation, idempotency, requests, templates
from app.core.auth import Client
from app.core.ids import new_id
from app.core.tasks import Tasks
from app.engine.constraints.grammar_worker import GrammarWorker
from app.engine.registry import models
from app.engine.registry.gguf import GgufInfo
from app.engine.request import Request
from app.errors import Conflict, LmspError, NotFound
from app.events import EventBus
from app.store.store import Store
from app.tasks import limits, machine, records
from app.tasks.kinds.base import Claimed
from app.tasks.scheduler import Offer, Scheduler, claim
from app.tasks.states import TERMINAL

# A new response: the stored answer (an idempotent repeat), or the response as queued and its
# task's events; and what the scheduler's claim in the same transaction took.
Inserted = tuple[idempotency.Stored | None, dict[str, Any] | None, list[machine.Event], Claimed | None]


@dataclass(frozen=True)
class Created:
    status: int                # 200 foreground, 202 background
    body: dict[str, Any]       # the response object (or the replayed body)
    replayed: bool             # answered from an idempotency key


class Responses:
    def __init__(self, store: Store, bus: EventBus, settings: Mapping[str, Any], scheduler: Scheduler, tasks: Tasks,
                 grammars: GrammarWorker, off_loop: Callable[..., Any],
                 examined: Callable[[sqlite3.Row], Awaitable[GgufInfo | None]]) -> None:
        self.store = store
        self.bus = bus
        self.settings = settings
        self.scheduler = scheduler
        self.tasks = tasks
        self.grammars = grammars
        self.off_loop = off_loop  # reading a request, whose cost grows with it: on a reader thread
        self.examined = examined  # a local model's header (app/core/models.py)

    async def create_response(self, client: Client, body: Any, idempotency_key: str | None = None,
                              path: str = "/v1/responses", sent: Any = None) -> Created:
        """Validate, then commit the response and its queued task before returning (rule 11.2); with
        an engine free, the same commit takes the task to `loading`. The answer shows the response
        as it was queued. With an idempotency key, a repeat gets the first request's answer instead.
        `sent`: the body as the client sent it, when `body` was translated from it (chat
        completions): the key is bound to what was sent."""
        req = await self.off_loop(requests.parse, body, functools.partial(self.grammars.convert, app=client.id))
        model_id = req.model or models.DEFAULT_MODEL_ID
        read = await self._check_template(client.id, model_id, req.request)
        if read is not None:
            req = replace(req, request=replace(req.request, reasoning=read.reasoning, tool_form=read.tool_form))
        on_restart = req.on_restart or (self.settings["default_on_restart"] if req.background else "fail")
        key = None
        if idempotency_key is not None:
            checked = idempotency.check_key(idempotency_key)
            digest = await self.off_loop(idempotency.digest, "POST", path, client.id, body if sent is None else sent)
            key = (checked, digest, self.settings["idempotency_ttl_seconds"])
        offer = self.scheduler.offer()  # room on an engine: the task is taken in the same commit
        # Shielded: a request given up while its write is on its way still starts what it committed.
        stored, response = await asyncio.shield(asyncio.ensure_future(self._insert(
            offer, dict(self.settings), client.id, client.party, model_id, req, on_restart, key)))
        if stored is not None:
            return Created(stored.status, stored.body, True)
        assert response is not None
        return Created(202 if req.background else 200, response, False)

    async def _check_template(self, client_id: str, model_id: str, request: Request) -> Request | None:
        """Refuse a conversation the model's chat template refuses, before it is stored and
        whatever engine would run it (app/core/templates.py); else the request (with its earlier
        turns) as the template reads it: how the answer holds the model's reasoning, the form of
        its calls. None where there is no template to read (a remote model)."""
        found = await self.store.read(templates.subject, client_id, model_id, request)
        if found is not None and (info := await self.examined(found[0])) is not None:
            read: Request = await self.off_loop(templates.check, info, found[1])
            return read
        return None

    async def _insert(self, offer: Offer | None, *args: Any) -> tuple[idempotency.Stored | None, dict[str, Any] | None]:
        """Commit a new response with its task, publish its events, then start what the claim in the
        same transaction took. Awaiting the writer as the scheduler does keeps events in commit order."""
        claimed = None
        try:
            stored, response, events, claimed = await self.store.write(_insert_response, *args, offer)
            self.bus.publish(events)
            return stored, response
        finally:
            if offer is not None:
                self.scheduler.settle(offer, claimed)
            # Not when the room offered was for other kinds of model than this task's: whatever
            # frees room for it wakes the scheduler then (a share of an engine that one app fills
            # is freed for it now). Nor when a claim sharing the offer took the room first: that
            # one wakes it.
            if offer is None or claimed is not None:
                self.scheduler.wake()
            else:
                self.scheduler.make_way()

    async def claim_key(self, owner: str, idempotency_key: str, method: str, path: str,
                        body: Any) -> idempotency.Stored | None:
        """For requests other than `POST /v1/responses` (which claims its key in the same
        transaction as its task): None means go ahead, else the stored answer to replay."""
        digest = await self.off_loop(idempotency.digest, method, path, owner, body)
        return await self.store.write(idempotency.claim, owner, idempotency.check_key(idempotency_key), digest,
                                      self.settings["idempotency_ttl_seconds"])

    async def remember(self, owner: str, idempotency_key: str, status: int, body: dict[str, Any],
                       response_id: str | None = None) -> None:
        """Store the final answer of a request made with an idempotency key (about `response_id`)."""
        await self.store.write(idempotency.finish, owner, idempotency_key, status, body, response_id)

    async def forget(self, owner: str, idempotency_key: str) -> None:
        await self.store.write(idempotency.release, owner, idempotency_key)

    async def response(self, client: Client, response_id: str) -> dict[str, Any]:
        return records.response_object(await self.tasks.owned(client, "response", response_id, whole=True))

    async def input_items(self, client: Client, response_id: str, order: str = "desc", after: str | None = None,
                          limit: int = 20) -> dict[str, Any]:
        """The input a response's model saw (earlier turns included, instructions not), OpenAI's list shape."""
        row = await self.tasks.owned(client, "response", response_id, whole=True)
        items = conversation.input_items(response_id, Request.from_json(row["request"]))
        return conversation.page(items, order, after, limit)

    async def delete_response(self, client: Client, response_id: str) -> None:
        row = await self.tasks.owned(client, "response", response_id)
        if row["status"] not in TERMINAL:
            raise Conflict("response_not_finished", "The response is still being generated; cancel it first.")
        await self.store.write(_delete_response, response_id)


def _delete_response(conn: sqlite3.Connection, response_id: str) -> None:
    conn.execute("DELETE FROM responses WHERE id = ?", (response_id,))  # its task and events cascade
    idempotency.forget_response(conn, response_id)


def _insert_response(conn: sqlite3.Connection, settings: dict[str, Any], client_id: str, party: str | None,
                     model_id: str, req: requests.ResponseRequest, on_restart: str, key: tuple[str, str, int] | None,
                     offer: Offer | None) -> Inserted:
    """The response and its queued task (what the answer shows), then, with room `offer`ed, the
    scheduler's claim: this task, or one that was there first. `party`: which of the apps sharing
    the client asked (app/core/auth.py `Client.party`), for the limits."""
    if key is not None:
        stored = idempotency.claim(conn, client_id, key[0], key[1], key[2])
        if stored is not None:
            return stored, None, [], None
    try:
        model = models.usable(conn, model_id)
    except NotFound as exc:
        raise LmspError("model_not_found", f"The model {model_id!r} does not exist.", param="model",
                        status=404) from exc
    request, previous = req.request, req.request.previous_response_id
    if previous is not None:
        request = conversation.continued(request, conversation.history(conn, client_id, previous))
    response_id, task_id = new_id("resp"), new_id("task")
    limits.store_request(conn, settings, response_id, client_id, model_id, request.to_json(), req.background,
                         json.dumps(req.metadata), time.time(), party=party, previous_response_id=previous,
                         store=int(req.store))
    events = machine.create(conn, task_id, response_id, on_restart, req.max_output_tokens)
    # `queued` carries the response as it now stands, but for what it echoes of the request
    response = {**events[-1]["response"], **records.echoed(request)}
    if key is not None and req.background:  # the key and the task it created commit together
        idempotency.finish(conn, client_id, key[0], 202, response, response_id)
    # Only room this task's kind of model can use is worth a claim here: other queued tasks are
    # the scheduler's (and the claim's reads grow with the queue).
    return None, response, events, claim(conn, offer) if offer and offer.has(model["format"]) else None
