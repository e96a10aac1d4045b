"""Remote models (LMSP §11): register, edit, test, and their endpoints' health.

A remote model's endpoints are kept in `model_endpoints`; their API keys in the vault
(app/secrets.py), named by a `key_ref`. Every endpoint is probed before it is accepted.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path
from typing import Any

from app.core import model_details
from app.core.auth import Client
from app.core.ids import new_id
from app.engine.net.remote import Endpoint, RemoteError, Upstreams, check_url, probe
from app.engine.registry import models
from app.errors import Conflict, InvalidRequest
from app.events import EventBus
from app.secrets import api_key_vault
from app.store.store import Store
from app.tasks.scheduler import Scheduler

MAX_ENDPOINTS = 16
ENDPOINT_FIELDS = {"base_url", "model", "api_key"}


class Remotes:
    def __init__(self, data_dir: Path, store: Store, bus: EventBus, upstreams: Upstreams,
                 scheduler: Scheduler) -> None:
        self.data_dir = data_dir  # the vault of API keys is named after it
        self.store = store
        self.bus = bus
        self.upstreams = upstreams
        self.scheduler = scheduler

    async def open_upstreams(self) -> None:
        """Read every remote model's endpoints, and their keys, into routing."""
        rows = await self.store.read(lambda c: c.execute(
            "SELECT * FROM model_endpoints ORDER BY model_id, position").fetchall())
        by_model: dict[str, list[Endpoint]] = {}
        for row in rows:
            key = await asyncio.to_thread(api_key_vault(self.data_dir, row["key_ref"]).get) if row["key_ref"] else None
            by_model.setdefault(row["model_id"], []).append(
                Endpoint(row["base_url"], row["upstream_model"], key, row["key_ref"]))
        for model_id, endpoints in by_model.items():
            self.upstreams.set(model_id, endpoints)

    async def test_endpoint(self, body: Any) -> dict[str, Any]:
        """Probe one endpoint as registering would (the desktop's "Test connection"): the
        models it serves, or a 400 saying what is wrong."""
        endpoint = _endpoint(body, "endpoint", None)
        started = time.monotonic()
        names = await _probe(self.upstreams, endpoint, "endpoint")
        return {"ok": True, "models": names, "latency_ms": round((time.monotonic() - started) * 1000, 1)}

    async def register_remote_model(self, client: Client, body: dict[str, Any]) -> dict[str, Any]:
        if set(body) - {"id", "remote"}:
            unknown = sorted(set(body) - {"id", "remote"})[0]
            raise InvalidRequest(f"Unknown parameter {unknown!r}.", param=unknown)
        model_id = body.get("id")
        if not isinstance(model_id, str) or not models.ID_PATTERN.match(model_id):
            raise InvalidRequest("A remote model needs an `id`: 1-128 letters, digits and . _ : - (starting with a "
                                 "letter or digit).", param="id")
        if await self.store.read(lambda c: c.execute("SELECT 1 FROM models WHERE id = ?", (model_id,)).fetchone()):
            raise Conflict("model_exists", f"A model with id {model_id!r} is already registered.")
        endpoints = await self._checked_endpoints(body.get("remote"), [])
        await self._keep_keys(endpoints)
        try:
            await self.store.write(_insert, model_id, endpoints, client.id)
        except BaseException:
            await self._drop_keys(endpoints)
            raise
        self.upstreams.set(model_id, endpoints)
        self.scheduler.wake()  # remote room is offered once a remote model exists (Generations.room)
        self.bus.publish([{"type": "models.changed"}])
        return self.remote_object(await self.store.read(models.get, model_id))

    async def update_remote_model(self, model_id: str, body: Any) -> dict[str, Any]:
        """Replace a remote model's endpoints. An endpoint given without `api_key` keeps the key it
        had (same base URL and model); `"api_key": null` removes it."""
        row = await self.store.read(models.get, model_id)
        if row["format"] != "remote":
            raise InvalidRequest(f"{model_id!r} is a local model file; only a remote model's endpoints can be "
                                 "edited.", param="remote")
        if not isinstance(body, dict) or set(body) != {"remote"}:
            raise InvalidRequest("Send `remote`: {\"endpoints\": [...]}, and nothing else.", param="remote")
        before = self.upstreams.models.get(model_id, [])
        endpoints = await self._checked_endpoints(body["remote"], before)
        await self._keep_keys(endpoints)
        await self.store.write(_replace_endpoints, model_id, endpoints)
        kept = {e.key_ref for e in endpoints}
        await self._drop_keys([e for e in before if e.key_ref not in kept])
        self.upstreams.set(model_id, endpoints)
        self.bus.publish([{"type": "models.changed"}])
        return self.remote_object(row)

    async def forget_remote_model(self, model_id: str) -> None:
        await self._drop_keys(self.upstreams.models.get(model_id, []))
        self.upstreams.forget(model_id)

    def remote_object(self, row: sqlite3.Row) -> dict[str, Any]:
        endpoints = self.upstreams.describe(row["id"])
        reachable = any(e["status"] == "available" for e in endpoints)
        return {"id": row["id"], "object": "model", "created": int(row["created_at"]), "owned_by": "remote",
                "format": "remote", "status": "available" if reachable else "unreachable", "endpoints": endpoints,
                "details": model_details.unknown()}

    async def check_upstreams(self) -> None:
        """Probe the endpoints no task is using; tell the GUI when one's health changed."""
        before = {id(e): e.status for endpoints in self.upstreams.models.values() for e in endpoints}
        await self.upstreams.check()
        if any(before.get(id(e)) != e.status for endpoints in self.upstreams.models.values() for e in endpoints):
            self.bus.publish([{"type": "models.changed"}])

    async def _checked_endpoints(self, remote: Any, before: list[Endpoint]) -> list[Endpoint]:
        """The endpoints of a `remote` object, each valid and probed (unless kept from `before`); a 400
        naming the first that is not."""
        if not isinstance(remote, dict) or set(remote) != {"endpoints"}:
            raise InvalidRequest("`remote` must be {\"endpoints\": [{\"base_url\", \"model\", \"api_key\"}]}.",
                                 param="remote")
        given = remote["endpoints"]
        if not isinstance(given, list) or not 1 <= len(given) <= MAX_ENDPOINTS:
            raise InvalidRequest(f"`remote.endpoints` is a list of 1 to {MAX_ENDPOINTS} endpoints.",
                                 param="remote.endpoints")
        endpoints = [_endpoint(item, f"remote.endpoints[{i}]", before) for i, item in enumerate(given)]
        seen = set()
        for i, e in enumerate(endpoints):
            if (e.base_url, e.model) in seen:
                raise InvalidRequest(f"{e.base_url} with model {e.model!r} is listed twice.",
                                     param=f"remote.endpoints[{i}]")
            seen.add((e.base_url, e.model))
        # An endpoint kept as it was (URL, model and key) was accepted before: an edit that removes
        # a dead endpoint or adds one must not be refused because another is down right now.
        kept = {(e.base_url, e.model, e.api_key) for e in before}
        await asyncio.gather(*(_probe(self.upstreams, e, f"remote.endpoints[{i}]") for i, e in enumerate(endpoints)
                               if (e.base_url, e.model, e.api_key) not in kept))
        return endpoints

    async def _keep_keys(self, endpoints: list[Endpoint]) -> None:
        """Store each new key under a fresh name; a key kept from before keeps its name."""
        for e in endpoints:
            if e.api_key and e.key_ref is None:
                e.key_ref = new_id("key")
                await asyncio.to_thread(api_key_vault(self.data_dir, e.key_ref).put, e.api_key)

    async def _drop_keys(self, endpoints: list[Endpoint]) -> None:
        for e in endpoints:
            if e.key_ref:
                await asyncio.to_thread(api_key_vault(self.data_dir, e.key_ref).delete)


def _endpoint(item: Any, param: str, before: list[Endpoint] | None) -> Endpoint:
    """One endpoint from a request. Without `api_key`, an endpoint of `before` with the same URL
    and model lends its key (editing need not ask for the key again)."""
    if not isinstance(item, dict):
        raise InvalidRequest("An endpoint is an object: {\"base_url\", \"model\", \"api_key\"}.", param=param)
    unknown = set(item) - ENDPOINT_FIELDS
    if unknown:
        raise InvalidRequest(f"Unknown endpoint field {sorted(unknown)[0]!r}.", param=f"{param}.{sorted(unknown)[0]}")
    try:
        base_url = check_url(item.get("base_url"))
    except RemoteError as exc:
        raise InvalidRequest(exc.message, param=f"{param}.base_url", code=exc.code) from None
    name = item.get("model")
    if not isinstance(name, str) or not name.strip() or len(name) > 256:
        raise InvalidRequest("`model` is the model's name on that server (1-256 characters).", param=f"{param}.model")
    key = item.get("api_key")
    if key is not None and (not isinstance(key, str) or not 0 < len(key) <= 4096 or "\n" in key):
        raise InvalidRequest("`api_key` is a string of 1-4096 characters on one line, or null.",
                             param=f"{param}.api_key")
    endpoint = Endpoint(base_url, name.strip(), key)
    if "api_key" not in item and before:
        same = next((e for e in before if (e.base_url, e.model) == (base_url, endpoint.model)), None)
        if same is not None:
            endpoint.api_key, endpoint.key_ref = same.api_key, same.key_ref
    return endpoint


async def _probe(upstreams: Upstreams, endpoint: Endpoint, param: str) -> list[str]:
    try:
        names = await probe(upstreams.client, endpoint)
    except RemoteError as exc:
        raise InvalidRequest(exc.message, param=param, code=exc.code) from None
    endpoint.mark(None)
    return names


def _insert(conn: sqlite3.Connection, model_id: str, endpoints: list[Endpoint], created_by: str) -> None:
    if conn.execute("SELECT 1 FROM models WHERE id = ?", (model_id,)).fetchone():
        raise Conflict("model_exists", f"A model with id {model_id!r} is already registered.")
    conn.execute("INSERT INTO models(id, format, created_at, created_by) VALUES (?, 'remote', ?, ?)",
                 (model_id, time.time(), created_by))
    _replace_endpoints(conn, model_id, endpoints)


def _replace_endpoints(conn: sqlite3.Connection, model_id: str, endpoints: list[Endpoint]) -> None:
    conn.execute("DELETE FROM model_endpoints WHERE model_id = ?", (model_id,))
    conn.executemany("INSERT INTO model_endpoints(model_id, position, base_url, upstream_model, key_ref) "
                     "VALUES (?, ?, ?, ?, ?)",
                     [(model_id, i, e.base_url, e.model, e.key_ref) for i, e in enumerate(endpoints)])
