"""The service's settings (LMSP §2b): read like a dict by every part, changed only here.

A change is validated whole, saved, then handed to whoever acts on it (`on_change`, wired in
the composition root): a bad value changes nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

from app.events import EventBus
from app.store import config
from app.store.store import Store

RESTART_KEY, RESTART_REQUIRED = "restart_required_for", ["host", "port"]  # settings read at start only


class Settings(Mapping[str, Any]):
    def __init__(self, store: Store, bus: EventBus) -> None:
        self.store = store
        self.bus = bus
        self.current: dict[str, Any] = dict(config.DEFAULTS)
        self.on_change: list[Callable[[dict[str, Any]], None]] = []  # told each saved change
        # Asked before a change is saved, each may refuse it (raise): checks that need more than the
        # value, as whether a `parallel` fits the models in memory (Models.check_parallel).
        self.checks: list[Callable[[dict[str, Any]], Awaitable[None]]] = []

    def __getitem__(self, key: str) -> Any:
        return self.current[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.current)

    def __len__(self) -> int:
        return len(self.current)

    async def load(self) -> None:
        """The stored settings, handed to `on_change` as one change: the start applies them all."""
        self.current = await self.store.read(config.load)
        self._apply(self.current)

    async def update(self, changes: Any) -> dict[str, Any]:
        """Validate all, then save all. The read-only part of `GET /v1/settings` may come back
        unchanged, so a client can PATCH what it read."""
        if isinstance(changes, dict) and changes.get(RESTART_KEY) == RESTART_REQUIRED:
            changes = {k: v for k, v in changes.items() if k != RESTART_KEY}
        changes = config.validate(changes)
        for check in self.checks:
            await check(changes)
        await self.store.write(config.save, changes)
        self.current = {**self.current, **changes}
        self._apply(changes)
        # `engine_mode` and `gpu` change how every local model runs and `parallel` the memory it
        # takes, as GET /v1/models and the Models tab show.
        self.bus.publish([{"type": "settings.changed", "changed": sorted(changes)}]
                         + [{"type": "models.changed"}] * bool({"engine_mode", "gpu", "parallel"} & set(changes)))
        return self.view()

    def _apply(self, changes: dict[str, Any]) -> None:
        for listener in self.on_change:
            listener(changes)

    def view(self) -> dict[str, Any]:
        return {**self.current, RESTART_KEY: RESTART_REQUIRED}

    async def preference(self, key: str) -> Any:
        """A front end's own remembered choice (keys "gui.*"), kept in service_config; None if unset."""
        return await self.store.read(lambda c: config.get_value(c, key))

    async def set_preference(self, key: str, value: Any) -> None:
        await self.store.write(config.save, {key: value})
