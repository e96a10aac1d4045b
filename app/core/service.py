"""AppService: the one door into the core for the HTTP server, the GUI and the CLI, and the
composition root: `__init__` builds every part of the app and gives each what it needs; read it
top to bottom for the wiring. The surfaces call the feature services it holds (`service.models`,
`service.responses`, ...); it owns only the start and stop order: open the store (moving a
corrupt file aside), settings, owner token, default model, recovery (§11.3), retention, and only
then the scheduler. `ready` turns true at the end.
"""

from __future__ import annotations

import asyncio
import gc
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from app import paths
from app.core import idempotency, metrics
from app.core.access import Access
from app.core.downloads import Downloads
from app.core.embeddings import Embeddings
from app.core.housekeeping import Housekeeping
from app.core.ids import new_id
from app.core.models import Models
from app.core.remotes import Remotes
from app.core.responses import Responses
from app.core.settings import Settings
from app.core.tasks import Tasks
from app.engine.constraints.grammar_worker import GrammarWorker
from app.engine.net.remote import Upstreams
from app.engine.parent.engine import Engine
from app.engine.parent.modes import EngineModes
from app.engine.parent.pool import EngineFactory, EnginePool
from app.events import EventBus
from app.secrets import hub_token, make_private, owner_vault
from app.store import config
from app.store.store import Store
from app.tasks import kinds
from app.tasks.kinds.download import Downloads as Transfers
from app.tasks.kinds.generation import Generations
from app.tasks.scheduler import Scheduler

T = TypeVar("T")


class AppService:
    def __init__(self, data_dir: Path, engine_factory: EngineFactory = Engine) -> None:
        self.data_dir = data_dir
        self.ready = False
        self.service_id = ""
        self.recovery_counts: dict[str, int] = {}
        # The ground: the database, the bus every change is published on, the settings.
        self.store = Store(data_dir / paths.DB_NAME)
        self.bus = EventBus()
        self.settings = Settings(self.store, self.bus)
        # The engines and what runs on them: the pool of local engines (their modes remembered per
        # model), remote endpoints, the grammar worker, and the one scheduler, whose task kinds
        # (generations, downloads) hand tasks to them.
        self.modes = EngineModes(self.store, self.bus, lambda: str(self.settings["engine_mode"]),
                                 lambda: str(self.settings["gpu"]))
        self.pool = EnginePool(self.modes, engine_factory)
        self.upstreams = Upstreams()
        self.grammars = GrammarWorker()
        self.scheduler = Scheduler(self.store, self.bus, kinds.build(
            kinds.Needs(self.store, self.bus, self.pool, self.upstreams, hub_token)))
        self.generations = self.scheduler.kind(Generations)
        self.transfers = self.scheduler.kind(Transfers)
        # Reading requests, whose cost grows with their size: off the loop, on threads of their own
        # (a wait on the grammar worker must not hold a thread the default executor's users need).
        self._readers = ThreadPoolExecutor(2, thread_name_prefix="lmsp-requests")
        # The features the surfaces call.
        self.access = Access(self.store, self.bus, owner_vault(data_dir), self.settings)
        self.remotes = Remotes(data_dir, self.store, self.bus, self.upstreams, self.scheduler)
        self.models = Models(self.store, self.bus, self.pool, self.modes, self.remotes,
                             lambda: int(self.settings["parallel"]),
                             lambda: int(self.settings["model_idle_ttl_seconds"]))
        self.downloads = Downloads(self.store, self.settings, self.transfers)
        self.embeddings = Embeddings(self.store, self.bus, self.pool)
        self.tasks = Tasks(self.store, self.bus, self.scheduler)
        self.responses = Responses(self.store, self.bus, self.settings, self.scheduler, self.tasks, self.grammars,
                                   self.off_loop, self.models.examined)
        self.housekeeping = Housekeeping(self.store, self.bus, self.settings, self.access, self.remotes, self.pool)
        self._changes: set[asyncio.Task[None]] = set()  # settings applied with a write, until they are done
        self.settings.on_change.append(self._apply_settings)
        self.settings.checks.append(self.models.check_parallel)

    async def start(self) -> None:
        await asyncio.to_thread(make_private, self.data_dir)
        await self.store.open()
        await self.settings.load()
        self.service_id = await self.store.write(_service_id)
        await self.access.ensure_owner_token()
        await self.access.load_origins()
        await self.access.open_ollama()
        await self.models.ensure_default_model()
        await self.modes.open()
        self.recovery_counts = await self.scheduler.recover()
        await self.store.write(idempotency.forget_in_flight)
        await self.housekeeping.purge()
        await self.housekeeping.forget_unstored()
        # The WAL emptied, whether or not that purge found any: a crash leaves old copies there,
        # of those rows and of rows a start killed after its purge had deleted.
        await self.store.checkpoint()
        await self.remotes.open_upstreams()
        self.scheduler.start()
        # What start-up made (modules, the app's objects) lives as long as the process: out of the
        # collector's sight, a full collection no longer pauses the loop (and every thread) for tens
        # of milliseconds, 190 ms once a 640 KB request's 10,000 items were decoded. Collected first
        # (no garbage is kept), before the port opens: no request waits for that one collection.
        gc.collect()
        gc.freeze()
        self.housekeeping.start()
        self.ready = True

    async def stop(self) -> None:
        """Stop taking work, snapshot running work, close streams, close the store."""
        self.ready = False
        self.models.stop_examining()  # asyncio.run() waits for every thread at exit: they must end now
        self.housekeeping.stop()
        await self.scheduler.stop()
        self.bus.publish([{"type": "service.stopping"}])
        await asyncio.gather(self.pool.stop(), self.upstreams.close())
        self.grammars.stop()
        self._readers.shutdown(wait=False)
        await self.housekeeping.forget_unstored()
        await self.store.close()

    def _apply_settings(self, changes: dict[str, Any]) -> None:
        """Hand the settings the engine pool, the scheduler and routing read to them."""
        if "parallel" in changes:  # before a resize: engines it makes serve as many at once
            self.pool.set_parallel(changes["parallel"])
            self.scheduler.wake()
        if "max_concurrent_tasks" in changes:
            self.pool.resize(changes["max_concurrent_tasks"])
            self.scheduler.wake()
        if "max_concurrent_remote_tasks" in changes:
            self.generations.remote_capacity = changes["max_concurrent_remote_tasks"]
            self.scheduler.wake()
        if "remote_wait_seconds" in changes:
            self.upstreams.wait_seconds = changes["remote_wait_seconds"]
        if self.ready and {"ollama_api", "ollama_scopes"} & set(changes):
            # Its first step (the client in memory) runs before the next request is read.
            applying = asyncio.create_task(self.access.open_ollama())
            self._changes.add(applying)
            applying.add_done_callback(self._changes.discard)

    async def off_loop(self, read: Callable[..., T], *args: Any) -> T:
        """`read(*args)` on a request reader's thread: reading a request whose cost grows with it."""
        return await asyncio.get_running_loop().run_in_executor(self._readers, read, *args)

    async def metrics_text(self, latency: metrics.LatencyHistogram) -> str:
        """/metrics in Prometheus text, with the HTTP surface's own request `latency`."""
        return metrics.render(await self.store.read(metrics.task_counts), tokens=self.generations.tokens_generated,
                              tokens_per_second=self.generations.last_tokens_per_second,
                              load_seconds=self.models.model_load_seconds, recovery=self.recovery_counts,
                              latency=latency, commits=self.store.commits, transactions=self.store.transactions,
                              slots=metrics.slot_lines(self.pool.slots(), await self.store.read(metrics.model_ids)))

    def describe(self) -> dict[str, Any]:
        return {"protocol": "lmsp", "version": "1.0",
                "service": {"id": self.service_id, "name": "LMSP Tray"},
                "auth": {"pairing": "user_approval"}, "api_base": "/v1",
                "recovered_from_corruption": self.store.recovered_from_corruption}


def _service_id(conn: sqlite3.Connection) -> str:
    ident = config.get_value(conn, "service_id")
    if ident is None:
        ident = new_id("svc")
        config.save(conn, {"service_id": ident})
    return str(ident)
