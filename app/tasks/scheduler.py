"""The scheduler: one queue (the tasks table) for every kind of task, one claim, one cancel, one
recovery pass, one stop. What each kind does is its own module (app/tasks/kinds/).

A claim is a transaction on the writer that takes the next task into the room the kinds have
(`offer`): the kinds are asked in their registry order, the first that finds a task takes the
room. Besides the scheduler's own loop, a claim also runs in the transaction that creates a
response (app/core/service.py: a task arriving at a free engine starts without a commit of its
own) and in the one that ends a generation (`end_and_claim`: the next task takes the engine).
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from app.events import EventBus
from app.store.store import Store
from app.tasks import machine
from app.tasks.kinds.base import WRITE_ERRORS, Backoff, Claimed, Kind, Recovered, Room

log = logging.getLogger(__name__)
K = TypeVar("K", bound=Kind)


@dataclass
class Offer:
    """Room for one more task, held by the claims (`claim`) in flight: each kind with room, in
    the order a claim tries them. The claims run one after another on the writer; the first that
    finds a task takes the room."""
    rooms: list[tuple[Kind, Room]]
    holders: int = 1     # claims yet to settle (counted on the loop)
    taken: bool = False  # a claim took a task with it (set on the writer)

    def has(self, name: str) -> bool:
        """Whether a kind has room of this name (a model's format: `gguf`, `remote`)."""
        return any(name in room.names for _, room in self.rooms)


class Scheduler:
    def __init__(self, store: Store, bus: EventBus, kinds: list[Kind]) -> None:
        self.store = store
        self.bus = bus
        self.kinds = {kind.name: kind for kind in kinds}
        for kind in kinds:
            kind.attach(self)
        self.paused = False  # "pause new tasks": the kinds that it holds take none
        self._wake = asyncio.Event()
        self._offer: Offer | None = None  # held by a claim in flight: one at a time
        self._after_offer = False  # the scheduler found the offer taken and waits for it to settle
        self._stopping = False
        self._main: asyncio.Task[None] | None = None
        self._workers: set[asyncio.Task[None]] = set()

    def kind(self, cls: type[K]) -> K:
        found = next(kind for kind in self.kinds.values() if isinstance(kind, cls))
        assert isinstance(found, cls)
        return found

    async def recover(self) -> dict[str, int]:
        """At start, before anything runs: every kind moves its unfinished tasks, in one
        transaction. Returns the counts of the moves, for /metrics."""
        done: list[Recovered] = await self.store.write(_recover, list(self.kinds.values()))
        for recovered in done:
            self.bus.publish(recovered.events)
            if recovered.cleanup is not None:
                await asyncio.to_thread(recovered.cleanup)
        return {move: n for recovered in done for move, n in recovered.counts.items()}

    def start(self) -> None:
        self._main = asyncio.create_task(self._schedule(), name="lmsp-scheduler")

    def wake(self) -> None:
        self._wake.set()

    def make_way(self) -> None:
        """A task waits and no claim took it: each kind may free room by its share rules
        (`Kind.make_way`), but not for kinds that "pause new tasks" holds: none would start."""
        for kind in self.kinds.values():
            if not (self.paused and kind.holds_on_pause):
                kind.make_way()

    def set_paused(self, paused: bool) -> None:
        self.paused = paused
        self.wake()

    def offer(self) -> Offer | None:
        """Room for the next task, held until `settle`; None while stopping, or full. While a
        claim is in flight, its offer is shared, not made again: two offers at once would both
        count on the same free engine, and could both take the same resumed task. Shared, a
        request that arrives while the scheduler looks for work is still taken in its own commit."""
        if self._stopping:
            return None
        if self._offer is not None:
            if self._offer.taken:
                return None  # the next offer comes once it is settled
            if self.paused and any(kind.holds_on_pause for kind, _ in self._offer.rooms):
                return None  # made before a pause: its room for generations is no longer offered
            self._offer.holders += 1
            return self._offer
        rooms = [(kind, room) for kind in self.kinds.values()
                 if not (self.paused and kind.holds_on_pause) and (room := kind.room()) is not None]
        if not rooms:
            return None
        self._offer = Offer(rooms)
        return self._offer

    def settle(self, offer: Offer, claimed: Claimed | None) -> None:
        """After a claim on `offer` committed (or failed: `claimed` None): start the task it took,
        publish the events taking it wrote, and, with the last holder, let the next offer be made
        (whoever settles an offer the scheduler did not make wakes it, unless no room is left
        that the scheduler could use: one more claim finding nothing costs the writer a
        transaction)."""
        assert self._offer is offer
        offer.holders -= 1
        if offer.holders == 0:
            self._offer = None
            if self._after_offer:  # a claim sharing it took the room: the next offer is the scheduler's
                self._after_offer = False
                self.wake()
        if claimed is None:
            return
        self.bus.publish(claimed.events)
        if self._stopping:
            return  # taken as the service stops: the next start's recovery settles it
        worker = asyncio.create_task(self._work(claimed.kind.start(claimed)),
                                     name=f"{claimed.kind.worker}-{claimed.task_id}")
        self._workers.add(worker)
        worker.add_done_callback(self._workers.discard)

    async def _work(self, run: Coroutine[Any, Any, None]) -> None:
        try:
            await run
        finally:  # its room is free
            self.wake()

    async def end_and_claim(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run transaction `fn(conn, *args)` and, in the same commit, let the next task take the
        room the caller freed (an engine, once its generation ended): a queued task then starts
        without a commit of its own before it. The events `fn` returns are published first."""
        offer, claimed = self.offer(), None
        try:
            events, claimed = await self.store.write(_then_claim, offer, fn, *args)
            if events:
                self.bus.publish(events)
            return events
        finally:
            if offer is not None:
                self.settle(offer, claimed)

    async def cancel(self, kind: str, task_id: str) -> list[machine.Event] | None:
        """Commit a cancel (by the task's kind's rules), publish it, then stop the work. None when
        the task has already ended."""
        events = await self.kinds[kind].accept_cancel(task_id)
        if events is not None:
            self.bus.publish(events)
            self.kinds[kind].cancel(task_id)
        return events

    async def _schedule(self) -> None:
        backoff = Backoff()
        while not self._stopping:
            self._wake.clear()
            offer = self.offer()
            if offer is None:
                self._after_offer = self._offer is not None
                self.make_way()
                await self._wake.wait()
                continue
            claimed, failure = None, None
            try:
                claimed = await self.store.write(claim, offer)
            except WRITE_ERRORS as exc:  # a full disk: no task can start until a write succeeds
                failure = exc
            finally:
                self.settle(offer, claimed)  # whatever the write raised: a held offer would stop every claim
            if failure is not None:
                await backoff.wait(f"cannot take the next task ({failure})")
                continue
            backoff.reset()
            if claimed is None:
                self.make_way()
                await self._wake.wait()

    async def stop(self, grace: float = 5.0) -> None:
        """Stop taking tasks; running work stops where it is (a generation at a token, its snapshot
        committed; a download with its bytes on disk)."""
        self._stopping = True
        self.wake()
        for kind in self.kinds.values():
            kind.halt()
        if self._workers:
            await asyncio.wait(list(self._workers), timeout=grace)
        for worker in list(self._workers) + ([self._main] if self._main else []):
            worker.cancel()
        for kind in self.kinds.values():
            kind.close()


# Transactions: each runs on the writer thread.

def claim(conn: sqlite3.Connection, offer: Offer) -> Claimed | None:
    """The next task to run in the room offered, by the first kind that has one. None when
    nothing waits, or another claim on the offer took the room."""
    if offer.taken:
        return None
    for kind, room in offer.rooms:
        claimed = kind.claim(conn, room)
        if claimed is not None:
            offer.taken = True
            return claimed
    return None


def _then_claim(conn: sqlite3.Connection, offer: Offer | None, fn: Callable[..., Any],
                *args: Any) -> tuple[Any, Claimed | None]:
    return fn(conn, *args), claim(conn, offer) if offer is not None else None


def _recover(conn: sqlite3.Connection, kinds: list[Kind]) -> list[Recovered]:
    return [kind.recover(conn) for kind in kinds]
