"""The engine pool: the one owner of the local engines (one llama-server each).

It makes them (`resize`), says which is idle, which has a slot free beside its running tasks
and which holds a model, lends a slot of one to a task (`lease`, by task id, until `release`)
and lets a model go (`unload`, `unload_idle`). An engine serves up to `parallel` tasks at once
(the setting); a change reaches each engine once no task runs on it (its next load uses it).
The scheduler and the core ask it; nobody else keeps a list of engines.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from app.engine.parent.engine import Engine
from app.engine.parent.modes import EngineModes
from app.engine.registry.models import Registered

log = logging.getLogger(__name__)
# Makes an engine: (name, modes, n_threads=...) -> Engine. A test passes a scripted one.
EngineFactory = Callable[..., Engine]


class EnginePool:
    def __init__(self, modes: EngineModes, factory: EngineFactory = Engine) -> None:
        self.modes = modes
        self.factory = factory
        self._engines: list[Engine] = []
        self._leases: dict[str, tuple[Engine, int]] = {}  # task id -> the engine it runs on, and its slot there
        self.capacity = 0  # how many engines are in use (max_concurrent_tasks)
        self.parallel = 1  # tasks an engine serves at once (parallel)
        # Model files an app asked to keep loaded until a time (time.monotonic(); inf: for good),
        # whatever the idle setting says (Ollama's `keep_alive`).
        self._kept: dict[str, float] = {}
        self._apps: dict[str, str] = {}  # task id -> the app whose task it is (`Client.app`), while it holds a slot
        # Model file loaded -> each app that used it -> when last (time.monotonic()): what an app
        # without `models:write` may not unload from under the others (`others_use`).
        self._users: dict[str, dict[str, float]] = {}

    @property
    def engines(self) -> Sequence[Engine]:
        """Every engine made, those beyond `capacity` included (they rest once their task ends)."""
        return tuple(self._engines)

    def resize(self, capacity: int) -> None:
        """Change how many tasks run at once; engines beyond it finish their task and then rest."""
        # Engines share the cores but one, which is left to the desktop and the programs beside
        # it: llama.cpp's threads wait for each other at every step, and one of them that a busy
        # program keeps off a core stalls all the others (on two cores, both threads beside one
        # busy program decoded a token every two seconds; one thread kept its speed). Several
        # llama.cpp processes on the same cores would all run slower than one. An engine keeps its
        # share until it is restarted.
        threads = max(1, ((os.cpu_count() or 1) - 1) // capacity)
        while len(self._engines) < capacity:
            engine = self.factory(f"engine{len(self._engines)}", self.modes, n_threads=threads)
            engine.parallel = self.parallel
            self._engines.append(engine)
        self.capacity = capacity

    def set_parallel(self, parallel: int) -> None:
        self.parallel = parallel
        for engine in self._engines:
            if not self.busy(engine):
                engine.parallel = parallel

    def holders(self, engine: Engine) -> list[str]:
        """The tasks that hold a slot of this engine."""
        return [task_id for task_id, (leased, _) in self._leases.items() if leased is engine]

    def running(self, engine: Engine) -> int:
        """How many tasks hold a slot of this engine."""
        return len(self.holders(engine))

    def busy(self, engine: Engine) -> bool:
        return self.running(engine) > 0

    def idle(self) -> Engine | None:
        """The first engine in use that no task holds."""
        return next((e for e in self._engines[:self.capacity] if not self.busy(e)), None)

    def vacant(self) -> Engine | None:
        """The first engine in use with neither a task nor a model: a model loaded there evicts none."""
        return next((e for e in self._engines[:self.capacity] if not self.busy(e) and e.model_path is None), None)

    def shared(self) -> Engine | None:
        """An engine in use with tasks running and a slot free: a task of the model it holds ready joins them."""
        return next((e for e in self._engines[:self.capacity]
                     if 0 < self.running(e) < e.parallel and e.ready() is not None), None)

    def lease(self, task_id: str, engine: Engine, app: str) -> None:
        """Give the task (of `app`) the engine's lowest free slot."""
        taken = {slot for leased, slot in self._leases.values() if leased is engine}
        self._leases[task_id] = engine, min(set(range(engine.parallel)) - taken)
        self._apps[task_id] = app

    def release(self, task_id: str) -> None:
        """The task no longer uses its engine (again is fine: a task hands its engine over first)."""
        engine, _ = self._leases.pop(task_id, (None, 0))
        app = self._apps.pop(task_id, None)
        if engine is not None and engine.model_path and app is not None:
            self.used(engine.model_path, app)
        if engine is not None and not self.busy(engine):
            engine.parallel = self.parallel

    def used(self, path: str, app: str) -> None:
        """`app` used the model file just now (a task on it ended, an embedding, a load)."""
        for gone in self._users.keys() - self.loaded_paths():  # replaced by another model since
            del self._users[gone]
        self._users.setdefault(path, {})[app] = time.monotonic()

    def _forget_users(self, path: str | None) -> None:
        """Once no engine holds the model file, its next load starts with no one having used it."""
        if not self.holding(path):
            self._users.pop(path or "", None)

    def others_use(self, path: str, app: str, within: float) -> bool:
        """Whether apps other than `app` need the model file loaded: one keeps it so (`keep`),
        runs a task on it, or used it less than `within` seconds ago (0: since it was loaded)."""
        now = time.monotonic()
        if self._kept.get(path, 0.0) > now:
            return True
        if any(engine.model_path == path and self._apps.get(task_id) != app
               for task_id, (engine, _) in self._leases.items()):
            return True
        return any(who != app and (not within or now - when <= within)
                   for who, when in self._users.get(path, {}).items())

    def slot_of(self, task_id: str) -> dict[str, Any] | None:
        """Where a task runs: `{"engine", "index", "of"}` (its slot, from 0, of the engine's), if it holds one."""
        if task_id not in self._leases:
            return None
        engine, slot = self._leases[task_id]
        return {"engine": engine.name, "index": slot, "of": engine.parallel}

    def slots(self) -> dict[str, tuple[int, int]]:
        """Per model file loaded: (slots busy, slots in all) of the engines holding it."""
        counts: dict[str, tuple[int, int]] = {}
        for engine in self._engines:
            if engine.model_path and engine.alive:
                busy, total = counts.get(engine.model_path, (0, 0))
                counts[engine.model_path] = busy + self.running(engine), total + engine.slots
        return counts

    def holding(self, path: str | None) -> list[Engine]:
        """The engines that have this model file loaded (none for a remote model: it has no path)."""
        return [e for e in self._engines if e.model_path is not None and e.model_path == path]

    def loaded_paths(self) -> set[str]:
        return {e.model_path for e in self._engines if e.model_path and e.alive}

    def refused(self, file: Registered) -> bool:
        """Whether an engine found other bytes in this file than were registered."""
        return any(file in e.refused for e in self._engines)

    def for_embedding(self, path: str) -> Engine:
        """An engine without a task, the model's own first; else one with the model (it waits its turn)."""
        engines = self._engines[:self.capacity]
        candidates = [e for e in engines if not self.busy(e)] or engines
        return min(candidates, key=lambda e: e.model_path != path)

    async def unload(self, path: str | None, when: Callable[[Engine], bool] = lambda _: True) -> bool:
        """Unload the idle engines holding `path` (those `when` picks). True when a busy one holds it."""
        busy = False
        self._kept.pop(path or "", None)
        for engine in self.holding(path):
            if self.busy(engine):
                busy = True
            elif when(engine):
                await engine.unload()
        self._forget_users(path)
        return busy

    def keep(self, path: str, seconds: float) -> None:
        """Keep the model file loaded `seconds` from now (-1: for good), then let it go once idle."""
        self._kept[path] = math.inf if seconds < 0 else time.monotonic() + seconds

    def kept_for(self, path: str) -> float | None:
        """Seconds the model file is still kept loaded (inf: for good); None when the idle setting decides."""
        until = self._kept.get(path)
        return None if until is None else max(0.0, until - time.monotonic())

    def _expired(self, engine: Engine, ttl: float) -> bool:
        path = engine.model_path or (engine.embeds.path if engine.embeds else None)  # an embedding server's, alone
        if path is None or self.busy(engine):
            return False
        if path in self._kept:
            return time.monotonic() > self._kept[path]
        return bool(ttl) and engine.idle_for() > ttl

    async def unload_idle(self, ttl: float) -> int:
        """Unload the models no task has used for `ttl` seconds (0: never), or kept until a time now
        past. How many engines let one go."""
        unloaded = 0
        for engine in self._engines:
            if self._expired(engine, ttl):
                path = engine.model_path
                self._kept.pop(path or "", None)
                log.info("%s: unloading %s, idle", engine.name, path)
                await engine.unload()
                self._forget_users(path)
                unloaded += 1
        return unloaded

    async def stop(self) -> None:
        await asyncio.gather(*(engine.stop() for engine in self._engines))
