"""The one event bus: the core publishes, SSE streams and the GUI bridge listen.

Loop-only: publish and listen from the event-loop thread. Events are published after the
transaction that wrote them has committed, so a listener never sees an event the database
could still lose.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Iterable

log = logging.getLogger(__name__)
Event = dict[str, Any]
Listener = Callable[[Event], None]


class EventBus:
    def __init__(self) -> None:
        self._listeners: list[Listener] = []

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

    def feed(self, task_id: str) -> "Feed":
        return Feed(self, task_id)


class Feed:
    """The live events of one task, queued for one reader; a slow reader only delays itself."""

    def __init__(self, bus: EventBus, task_id: str) -> None:
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self._task_id = task_id
        self._stop = bus.listen(self._on_event)

    def _on_event(self, event: Event) -> None:
        if event.get("task_id") == self._task_id or event["type"] == "service.stopping":
            self.queue.put_nowait(event)

    def close(self) -> None:
        self._stop()

    def __enter__(self) -> "Feed":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
