"""The one event bus: the core publishes, SSE streams and the GUI bridge listen.

Loop-only: publish and listen from the event-loop thread. Events are published after the
transaction that wrote them has committed, so a listener never sees an event the database
could still lose.

The bus also knows which tasks someone follows live (an SSE stream, the dashboard showing the
task): the runner commits their output token by token, and everyone else's less often.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger(__name__)
Event = dict[str, Any]
Listener = Callable[[Event], None]


class EventBus:
    def __init__(self) -> None:
        self._listeners: list[Listener] = []
        self._watchers: Counter[str] = Counter()  # live readers, by task id
        self._on_watch: list[Callable[[str], None]] = []

    def listen(self, listener: Listener) -> Callable[[], None]:
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def publish(self, events: Iterable[Event]) -> None:
        for event in events:
            for listener in list(self._listeners):
                try:
                    listener(event)
                except Exception:  # a broken listener must not break a task
                    log.exception("event listener failed")

    async def commit(self, store: Any, fn: Any, *args: Any) -> Any:
        """Run the transaction fn(conn, *args) on `store` and publish the events it returns once
        it has committed."""
        result = await store.write(fn, *args)
        if result:
            self.publish(result)
        return result

    def feed(self, task_id: str, watch: bool) -> Feed:
        """`watch`: the reader shows the output as it comes; one that only waits for the end (a
        plain request) does not, and does not make the task commit more often."""
        return Feed(self, task_id, watch)

    def watch(self, task_id: str) -> Callable[[], None]:
        """Someone follows this task's output live until the returned function is called."""
        self._watchers[task_id] += 1
        for started in self._on_watch:
            started(task_id)
        released = False

        def release() -> None:  # once: a second call must not end another reader's watch
            nonlocal released
            if not released:
                released = True
                self._watchers[task_id] -= 1
                if not self._watchers[task_id]:
                    del self._watchers[task_id]
        return release

    def watched(self, task_id: str) -> bool:
        return task_id in self._watchers

    def on_watch(self, started: Callable[[str], None]) -> None:
        """Call `started(task_id)` whenever a live reader arrives (the runner then writes at once
        what it holds back)."""
        self._on_watch.append(started)


FEED_BYTES = 1024 * 1024  # of live events queued for one reader (an event's size: its stored text)


def _size(event: Event) -> int:
    return len(getattr(event, "text", ""))


class Feed:
    """The live events of one task, queued for one reader; a slow reader only delays itself.
    One that falls FEED_BYTES behind finds only the newest event queued: the gap in sequence
    numbers tells it to read what it missed from the log (`sse.follow`), so a reader that does
    not read holds at most FEED_BYTES here, however long the task."""

    def __init__(self, bus: EventBus, task_id: str, watch: bool) -> None:
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self._bytes = 0
        self._task_id = task_id
        self._stop = bus.listen(self._on_event)
        self._unwatch = bus.watch(task_id) if watch else None

    def _on_event(self, event: Event) -> None:
        if event.get("task_id") == self._task_id or event["type"] == "service.stopping":
            if self._bytes + _size(event) > FEED_BYTES:
                while not self.queue.empty():
                    self.queue.get_nowait()
                self._bytes = 0
            self.queue.put_nowait(event)
            self._bytes += _size(event)

    async def get(self) -> Event:
        event = await self.queue.get()
        self._bytes -= _size(event)
        return event

    def close(self) -> None:
        self._stop()
        if self._unwatch is not None:
            self._unwatch()

    def __enter__(self) -> Feed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
