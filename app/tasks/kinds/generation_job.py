"""A generation's output on its way to the database: what the engine produced since the last
write (`Job`), taken in pieces (`Chunk`), and what a task needs to start (`Prepared`).
How it is written and when: app/tasks/kinds/generation.py."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from dataclasses import dataclass, field
from typing import Any

from app.engine.parent.engine import Engine
from app.engine.registry.models import Registered
from app.engine.request import Request
from app.engine.runs import Runs
from app.errors import LmspError
from app.tasks import calls, machine
from app.tasks.kinds.base import Room


@dataclass(frozen=True)
class EngineRoom(Room):
    """A generation's room: an engine no task holds and the model file it holds ready, if any;
    an engine with tasks running and a slot free beside them, and the model they run; whose task
    was taken last (the next queued one is another client's); the clients that hold all but one
    of the shared engine's slots (their turns come last). `gguf` is among the names when either
    engine is there."""
    engine: Engine | None
    ready: Registered | None
    shared: Engine | None
    holds: Registered | None
    last_app: str
    crowded: tuple[str, ...] = ()

    def engine_for(self, file: Registered | None) -> tuple[Engine | None, Registered | None]:
        """The engine a task of this model file runs on (beside the tasks of its model, if it can),
        and the file that engine holds ready."""
        if self.shared is not None and file is not None and file == self.holds:
            return self.shared, self.holds
        return self.engine, self.ready


@dataclass(frozen=True)
class Chunk:
    """Output produced since the last write, with the progress it brings the task to."""
    ids: list[int]
    text: str
    output_tokens: int
    tokens_per_second: float | None
    events: list[calls.Event]  # what the text adds to the stream


@dataclass(frozen=True)
class Prepared:
    """What a task needs to start, read in one go: its row and request, its output so far, and its
    model's row (or why the model cannot be used)."""
    row: dict[str, Any]
    request: Request  # read once, here: a start in the claim's commit needs it too
    ids: list[int]
    text: str
    model: sqlite3.Row | None
    refused: LmspError | None
    running: bool  # already `running`: resumed, or started by its claim (on an engine that holds its model)


@dataclass
class Job:
    """A task on an engine, with its output so far."""
    task_id: str
    engine: Runs
    app: str = ""           # whose task it is (`writes.APP`): the share of an engine's slots is counted by app
    tokens: int = 0         # output tokens produced, a resumed snapshot's included
    ids: list[int] = field(default_factory=list)  # produced, not yet written
    pending: str = ""       # text produced, not yet written
    started: float = field(default_factory=time.monotonic)
    new_tokens: int = 0
    out: calls.Stream | None = None  # the output's stream events: a message's, or a call's
    saving: asyncio.Task[bool] | None = None  # the write in flight, if any
    error: Exception | None = None  # a write of the task that failed (its output, `running`): it stops
    starting: asyncio.Future[list[machine.Event] | None] | None = None  # the write to `running`, in flight
    live: bool = True  # False once that write found a cancel first: nothing more is written
    # The engine sent its last output, or the task is ending: no more writes in the background,
    # what is left is written in the transaction that ends (or fails, or restarts) the task.
    ending: bool = False
    written_at: float = 0.0  # when the last write of its output began
    preempted: bool = False  # stopped to give its slot to another app's task: it goes back to the queue
    hurry: asyncio.Event = field(default_factory=asyncio.Event)  # the next write goes at once

    def add(self, ids: list[int], text: str, tokens: int) -> None:
        self.ids += ids
        self.tokens += tokens
        self.new_tokens += tokens
        self.pending += text

    def reset(self) -> None:
        """The output starts again from nothing (a remote task moved to another endpoint)."""
        self.tokens, self.ids, self.pending, self.ending = 0, [], "", False
        if self.out is not None:
            self.out = self.out.again()

    def unwritten(self) -> bool:
        return bool(self.ids or self.pending)

    async def stop_saving(self) -> None:
        """End the writes in the background, once the one in flight is done: the caller writes
        what is left, in its own transaction."""
        self.ending = True
        self.hurry.set()  # a write held back ends its wait
        if self.saving is not None:
            await self.saving

    def take(self) -> Chunk:
        events = self.out.feed(self.pending) if self.out is not None else []
        chunk = Chunk(self.ids, self.pending, self.tokens, tokens_per_second(self), events)
        self.ids, self.pending = [], ""
        return chunk



def tokens_per_second(job: Job) -> float | None:
    elapsed = time.monotonic() - job.started
    return round(job.new_tokens / elapsed, 2) if job.new_tokens and elapsed > 0 else None


def settle_start(job: Job) -> None:
    """Once the write to `running` is done (the first of its done callback and `until_running`
    to see it): unless it committed, nothing more of the task is written and the engine stops,
    at once, mid-prompt if need be: a cancel came first, while the model loaded, or it failed."""
    if job.starting is None or not job.starting.done():
        return
    try:
        job.live = job.starting.result() is not None
    except Exception as exc:  # raised once the generation has ended (a write error, or a bug)
        job.live, job.error = False, exc
    job.starting = None
    if not job.live:
        job.engine.cancel()  # a remote stream that opened is closed too


async def until_running(job: Job) -> bool:
    """Whether the task's output may be written: waits for the write to `running` if in flight."""
    if job.starting is not None:
        await asyncio.wait([job.starting])
        settle_start(job)
    return job.live
