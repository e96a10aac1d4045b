"""What the service does on its own while it runs: retention, `store: false` answers, idle
models unloaded, remote endpoints probed."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Mapping
from typing import Any

from app.core.access import Access
from app.core.remotes import Remotes
from app.engine.parent.pool import EnginePool
from app.errors import LmspError
from app.events import EventBus
from app.store.store import Store
from app.tasks import retention

log = logging.getLogger(__name__)
UPSTREAM_CHECK_SECONDS = 30.0  # how often idle remote endpoints are probed, for the health shown
# How long emptying the WAL waits for a reader on an older snapshot (writes wait meanwhile) before
# it gives up until the next tick.
WAL_WAIT_SECONDS = 0.5


class Housekeeping:
    def __init__(self, store: Store, bus: EventBus, settings: Mapping[str, Any], access: Access, remotes: Remotes,
                 pool: EnginePool) -> None:
        self.store = store
        self.bus = bus
        self.settings = settings
        self.access = access
        self.remotes = remotes
        self.pool = pool
        self._loop: asyncio.Task[None] | None = None
        self._wal_owed = False  # rows were deleted whose old copies the WAL may still hold

    def start(self) -> None:
        self._loop = asyncio.create_task(self._run(), name="lmsp-housekeeping")

    def stop(self) -> None:
        if self._loop:
            self._loop.cancel()

    async def purge(self, now: float | None = None) -> dict[str, int]:
        """Retention: finished tasks, idempotency keys, and approved tokens never collected."""
        now = time.time() if now is None else now
        counts = await self.store.write(retention.purge, self.settings["retention_seconds"],
                                        self.settings["idempotency_ttl_seconds"], now)
        self._wal_owed |= counts["responses"] + counts["unstored"] > 0
        await self._empty_wal()
        return {**counts, "uncollected_tokens": self.access.forget_uncollected(now)}

    async def forget_unstored(self) -> None:
        """Every `store: false` response that has ended, now: at start (their callers went with the
        last run) and at stop (a quit must not leave them on the disk until the next start; the
        store's close empties the WAL after it)."""
        await self.store.write(retention.purge_unstored, None, 0)

    async def _empty_wal(self) -> None:
        """Empty the WAL once a purge committed deletes: their rows' old copies stay in it until
        then, readable in the file (`secure_delete` overwrites them only in the database). A reader
        holding an older snapshot longer than WAL_WAIT_SECONDS leaves it for the next tick."""
        if not self._wal_owed:
            return
        try:
            self._wal_owed = not await self.store.checkpoint(WAL_WAIT_SECONDS)
        except sqlite3.Error as exc:
            log.warning("emptying the database's WAL failed (trying again): %s", exc)

    async def _run(self, tick: float = 5.0) -> None:
        """Retention every ten minutes, `store: false` responses every half minute, the WAL emptied
        after either deleted something; idle models unloaded after `model_idle_ttl_seconds`;
        remote endpoints no task uses probed every half minute."""
        last_purge = last_unstored = time.monotonic()
        last_upstreams = -UPSTREAM_CHECK_SECONDS  # the first tick checks them: health for the Models tab
        while True:
            await asyncio.sleep(tick)
            if time.monotonic() - last_upstreams > UPSTREAM_CHECK_SECONDS and self.remotes.upstreams.models:
                last_upstreams = time.monotonic()
                await self.remotes.check_upstreams()
            if time.monotonic() - last_unstored > retention.UNSTORED_EVERY_SECONDS:  # gone within a minute and a half
                last_unstored = time.monotonic()
                try:
                    self._wal_owed |= await self.store.write(retention.purge_unstored) > 0
                except LmspError as exc:
                    log.warning("purging store: false responses failed: %s", exc.message)
            await self._empty_wal()
            unloaded = await self.pool.unload_idle(self.settings["model_idle_ttl_seconds"])
            if unloaded:
                self.bus.publish([{"type": "models.changed"}] * unloaded)
            if time.monotonic() - last_purge > 600:
                last_purge = time.monotonic()
                try:
                    await self.purge()
                except LmspError as exc:
                    log.warning("retention cleanup failed: %s", exc.message)
