"""Tasks (LMSP §5-§7): reading them and their events, following them, cancelling, waiting."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Mapping
from typing import Any

from app.core.auth import Client
from app.errors import Conflict, InvalidRequest, NotFound
from app.events import EventBus, Feed
from app.store.store import Store
from app.tasks import kinds, machine, records, usage
from app.tasks.kinds.generation import Generations
from app.tasks.scheduler import Scheduler
from app.tasks.states import TERMINAL

TERMINAL_EVENTS = kinds.TERMINAL_EVENTS


class Tasks:
    def __init__(self, store: Store, bus: EventBus, scheduler: Scheduler) -> None:
        self.store = store
        self.bus = bus
        self.scheduler = scheduler
        self.generations = scheduler.kind(Generations)

    async def task(self, client: Client, task_id: str) -> dict[str, Any]:
        return (await self._placed([records.task_object(await self.owned(client, "task", task_id))]))[0]

    async def _placed(self, tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The task objects with where each stands (LMSP §14): its place in the queue while
        queued (read only when one is), its slot while it runs, and what it waits for."""
        queued = any(t["kind"] == "response" and t["status"] == "queued" for t in tasks)
        places = await self.generations.places([t["id"] for t in tasks], queued)
        # The model files, read only when a generation waits: a loaded one has slots to wait for.
        paths = await self.store.read(_model_paths) if queued else {}
        slots = self.generations.pool.slots()
        for task in tasks:
            task.update(places[task["id"]])
            task["waiting_for"] = waiting_for(task, paths, slots, self.scheduler.paused)
        return tasks

    async def owned(self, client: Client, kind: str, ident: str, whole: bool = False) -> dict[str, Any]:
        """The task row (with its response) of a task or response `client` may see; else 404.
        Only what a task object shows, unless `whole`: the request and the output text are
        megabytes, and every stream and cancel would load them again."""
        row: Mapping[str, Any] | None
        if whole:
            row = await self.store.read(records.one_task if kind == "task" else records.one_response, ident)
        else:
            row = await self.store.read(records.one_listed, "t.id" if kind == "task" else "t.response_id", ident)
        if row is None or (kind == "response" and row["kind"] != "response") or not (
                client.is_admin or row["client_id"] == client.id):
            raise NotFound(kind, ident)  # another client's id looks exactly like a missing one
        return row

    async def status(self, task_id: str) -> str | None:
        """The task's status; None if there is no such task."""
        return await self.store.read(machine.status_of, task_id)

    async def events(self, client: Client, task_id: str, after: int) -> list[records.Stored]:
        await self.owned(client, "task", task_id)
        return await self.events_after(task_id, after)

    async def events_after(self, task_id: str, after: int, max_bytes: int | None = None) -> list[records.Stored]:
        return await self.store.read(records.events_after, task_id, after, 1000, max_bytes)

    def feed(self, task_id: str, watch: bool) -> Feed:
        return self.bus.feed(task_id, watch)

    def watch(self, task_id: str) -> Callable[[], None]:
        """Show this task's output live (the dashboard): until the returned function is called, its
        output is committed, and published, token by token."""
        return self.bus.watch(task_id)

    async def cancel(self, client: Client, kind: str, ident: str) -> dict[str, Any]:
        row = await self.owned(client, kind, ident)
        if await self.scheduler.cancel(row["kind"], row["id"]) is None:
            raise Conflict("task_not_cancellable", f"Task {row['id']} has already ended.")
        cancelled = await self.store.read(records.one_listed, "t.id", row["id"])
        assert cancelled is not None  # a task is deleted only once it has ended, long after
        return (await self._placed([records.task_object(cancelled)]))[0]

    async def wait(self, task_id: str) -> dict[str, Any]:
        """Wait until the task is finished; returns its final row."""
        with self.feed(task_id, watch=False) as feed:
            row = await self.store.read(records.one_task, task_id)
            while row is not None and row["status"] not in TERMINAL:
                event = await feed.get()
                if event["type"] in TERMINAL_EVENTS or event["type"] == "service.stopping":
                    row = await self.store.read(records.one_task, task_id)
                    if event["type"] == "service.stopping":
                        break
        assert row is not None
        return row

    async def list_tasks(self, client: Client, status: str | None = None, limit: int = 20,
                         after: str | None = None) -> tuple[list[dict[str, Any]], bool]:
        """Newest first; `after` is the id of the last task of the previous page."""
        rows = await self.store.read(_list_tasks, None if client.is_admin else client.id, status, limit + 1, after)
        return await self._placed([records.task_object(r) for r in rows[:limit]]), len(rows) > limit

    async def usage(self, client: Client, start: str | None = None, end: str | None = None,
                    group_by: str | None = None) -> list[dict[str, Any]]:
        """What the clients used (LMSP §17): an admin sees every client's, any other its own."""
        query = usage.parse(start, end, group_by)
        return await self.store.read(usage.report, query, None if client.is_admin else client.id)

    def set_paused(self, paused: bool) -> None:
        self.scheduler.set_paused(paused)
        self.bus.publish([{"type": "service.paused", "paused": paused}])


def waiting_for(task: dict[str, Any], paths: Mapping[str, str | None], slots: Mapping[str, tuple[int, int]],
                paused: bool) -> str | None:
    """What a task that has not started yet waits for (issue 40): `paused` (new tasks are held),
    `download` (the downloads ahead of it), `model_load` (its model is being loaded, or is not
    loaded and waits for an engine to load it on), `slot` (its model is loaded, or remote, and
    every seat is taken); None once it runs or has ended."""
    if task["kind"] == "download":
        return "download" if task["status"] == "queued" else None
    if task["status"] == "loading":
        return "model_load"
    if task["status"] != "queued":
        return None
    if paused:
        return "paused"
    path = paths.get(task["model"])
    return "model_load" if path is not None and path not in slots else "slot"


def _model_paths(conn: sqlite3.Connection) -> dict[str, str | None]:
    return {row["id"]: row["path"] for row in conn.execute("SELECT id, path FROM models")}


def _list_tasks(conn: sqlite3.Connection, client_id: str | None, status: str | None, limit: int,
                after: str | None) -> list[sqlite3.Row]:
    where, params = ["1"], []
    if client_id is not None:
        where.append("r.client_id = ?")
        params.append(client_id)
    if after is not None:
        # Looked up among the tasks this client may see: another's looks exactly like an unknown id.
        anchor = conn.execute(f"{records.LISTED} WHERE {' AND '.join(where)} AND t.id = ?", (*params, after)).fetchone()
        if anchor is None:
            raise InvalidRequest(f"No task {after!r} to page after.", param="after")
        where.append("(t.created_at, t.id) < (?, ?)")
        params.extend([anchor["created_at"], anchor["id"]])
    if status is not None:
        where.append("t.status = ?")
        params.append(status)
    return conn.execute(f"{records.LISTED} WHERE {' AND '.join(where)} ORDER BY t.created_at DESC, t.id DESC LIMIT ?",
                        (*params, limit)).fetchall()
