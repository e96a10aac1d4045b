"""What a task kind is to the scheduler (app/tasks/scheduler.py), and what they share.

A kind says what room it has for one more task (`room`), finds its next task in that room in
the claim's transaction (`claim`), runs a claimed task (`start`), accepts and carries out a
cancel (`accept_cancel`, `cancel`), moves its tasks left unfinished at start (`recover`), and
stops what runs when the service stops (`halt`, then `close`).
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

from app.engine.net.remote import Upstreams
from app.engine.parent.pool import EnginePool
from app.errors import StoreError
from app.events import EventBus
from app.store.store import Store
from app.tasks import machine

log = logging.getLogger(__name__)
BACKOFF_FIRST, BACKOFF_LAST = 0.5, 30.0  # seconds between tries of a write the database refuses
WRITE_ERRORS = (StoreError, sqlite3.Error)  # what a write may raise when the disk refuses it


@dataclass(frozen=True)
class Needs:
    """What the kinds are built from: each takes the parts it uses."""
    store: Store
    bus: EventBus
    pool: EnginePool
    upstreams: Upstreams
    hub_token: Callable[[], str | None]  # blocking: a keyring read


@dataclass(frozen=True)
class Room:
    """Room a kind has for one more task: the names of what is free (a local engine `gguf`, a
    remote slot, a download slot), and its tasks that run now (one left `running` by a stop is
    not taken twice). A kind's own room adds what its claim must know of that moment."""
    names: tuple[str, ...]
    busy: tuple[str, ...]


@dataclass(frozen=True)
class Claimed:
    """A task a claim took: its kind, the room it took (and which of its names), the events
    taking it wrote, and what its kind needs to start it."""
    kind: Kind
    task_id: str
    room: Room
    name: str
    events: list[machine.Event]
    detail: Any = None


@dataclass(frozen=True)
class Recovered:
    """What a kind's recovery did: counts like {"running->failed": 2} (for /metrics), events to
    publish once committed, and blocking cleanup to run then (off the loop)."""
    counts: dict[str, int] = field(default_factory=dict)
    events: list[machine.Event] = field(default_factory=list)
    cleanup: Callable[[], None] | None = None


class Host(Protocol):
    """The scheduler, as a kind sees it."""

    def wake(self) -> None:
        """Look for work again: room was freed, or work may have come."""

    async def end_and_claim(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run transaction `fn(conn, *args)`, publish the events it returns and, in its commit, let
        the next task take the room freed."""


class Kind(ABC):
    name: str                          # tasks.kind
    worker: str                        # its workers' task name prefix
    terminal_events: tuple[str, ...]   # the events that end one of its tasks
    holds_on_pause: bool = False       # "pause new tasks" holds it
    host: Host

    @abstractmethod
    def __init__(self, needs: Needs) -> None:
        """Take from `needs` the parts this kind uses."""

    def attach(self, host: Host) -> None:
        self.host = host

    @abstractmethod
    def room(self) -> Room | None:
        """Room for one more task now, on the loop; None when it has none (or nothing to look for)."""

    @abstractmethod
    def claim(self, conn: sqlite3.Connection, room: Room) -> Claimed | None:
        """On the writer, in the claim's transaction: take the next task that fits `room`, if any."""

    @abstractmethod
    def start(self, claimed: Claimed) -> Coroutine[Any, Any, None]:
        """On the loop, once the claim committed: what runs the task (the scheduler makes it a
        worker). What the next `room` must know (the task is busy) is set here, at once."""

    @abstractmethod
    async def accept_cancel(self, task_id: str) -> list[machine.Event] | None:
        """Commit a cancel; None when the task has already ended."""

    @abstractmethod
    def cancel(self, task_id: str) -> None:
        """The cancel is committed: stop the work."""

    @abstractmethod
    def recover(self, conn: sqlite3.Connection) -> Recovered:
        """On the writer, at start, before anything runs: move this kind's unfinished tasks."""

    @abstractmethod
    def halt(self) -> None:
        """The service stops: stop what runs, keeping what the next start's recovery needs."""

    def make_way(self) -> None:  # noqa: B027 - only generations share out their room: not abstract
        """On the loop, when a task waits and no claim took it: free room by the kind's own share
        rules, if they say so (Generations: one app holding every slot of an engine)."""

    def close(self) -> None:  # noqa: B027 - most kinds have nothing to close: not abstract
        """After the workers have ended (or were given up on)."""


class Backoff:
    """Waits that double from half a second to half a minute, each logged once: a write that
    keeps failing (a full disk) is retried without spinning or flooding the log."""

    def __init__(self) -> None:
        self.delay = BACKOFF_FIRST

    async def wait(self, what: str) -> None:
        log.warning("%s; trying again in %.1f s", what, self.delay)
        await asyncio.sleep(self.delay)
        self.delay = min(self.delay * 2, BACKOFF_LAST)

    def reset(self) -> None:
        self.delay = BACKOFF_FIRST
