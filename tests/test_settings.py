"""Settings (LMSP §2b): defaults, validation that changes nothing on any error, persistence
across restarts, and changes that take effect at once (allowed origins, concurrency)."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

import pytest

from app.store.config import DEFAULTS
from tests.helpers import ALL_BUT_ADMIN, COUNT, SAY_HI, bearer, expect_error, pair, poll, raw

pytestmark = pytest.mark.scripted  # the machine around inference, not inference: tests/scripted.py's engines


async def settings(api: Any) -> dict[str, Any]:
    resp = await api.get("/v1/settings")
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def stored_config(service: Any) -> dict[str, str]:
    return await service.store.read(lambda c: {r["key"]: r["value"] for r in
                                               c.execute("SELECT key, value FROM service_config")})


async def test_defaults(api):
    got = await settings(api)
    for name, value in DEFAULTS.items():  # every one: the app's own table, not a copy of it
        assert got[name] == value, name
    # Where apps look for the service, whatever else changes (LMSP §2b).
    assert (got["host"], got["port"]) == ("127.0.0.1", 11535)


async def test_patch_changes_and_answers_with_all_settings(api, service):
    resp = await api.patch("/v1/settings", json={"retention_seconds": 3600, "default_on_restart": "resume"})
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["retention_seconds"] == 3600 and body["default_on_restart"] == "resume"
    assert body["max_concurrent_tasks"] == 1  # the others are still there
    assert body == await settings(api)
    # An empty change is fine and changes nothing.
    resp = await api.patch("/v1/settings", json={})
    assert resp.status == 200 and (await resp.json()) == body
    # The new default applies to the next background task.
    service.tasks.set_paused(True)
    resp = await api.post("/v1/responses", json={**SAY_HI, "background": True})
    assert (await resp.json())["task"]["on_restart"] == "resume"


def test_changes_persist_across_a_restart(headless):
    headless.start()
    change = {"retention_seconds": 7200, "default_on_restart": "retry", "allowed_origins": ["http://localhost:5173"],
              "idempotency_ttl_seconds": 600, "model_idle_ttl_seconds": 300, "max_concurrent_tasks": 2}
    status, body = headless.request("PATCH", "/v1/settings", change)
    assert status == 200, body
    assert headless.terminate() == 0
    headless.start()
    status, body = headless.get("/v1/settings")
    assert status == 200, body
    for name, value in change.items():
        assert body[name] == value, name
    assert body["port"] == DEFAULTS["port"]  # --port 0 for this run does not change the setting


def test_a_stored_host_this_computer_cannot_listen_on_gives_way_to_the_default(headless):
    # An older version saved any host; the service must still start, on the default one.
    headless.start()
    assert headless.terminate() == 0
    with sqlite3.connect(headless.data_dir / "lmsp.sqlite3") as db:
        db.execute("INSERT INTO service_config(key, value) VALUES ('host', '\"example.com\"') "
                   "ON CONFLICT(key) DO UPDATE SET value = excluded.value")
    headless.start()
    assert headless.url.startswith("http://127.0.0.1:")
    assert headless.get("/v1/settings")[1]["host"] == "127.0.0.1"
    assert "setting host: the stored value 'example.com' is not usable now" in headless.log.read_text()


async def test_unknown_key_is_400_and_nothing_changes(api, service):
    before, stored = await settings(api), await stored_config(service)
    for body, param in [({"retention_seconds": 3600, "colour": "blue"}, "colour"),
                        ({"max_concurrent_tasks": 2, "allowed_origins": ["http://a.example"], "Port": 80}, "Port"),
                        ({"restart_required_for": []}, "restart_required_for"),
                        ({"service_id": "svc_mine"}, "service_id")]:
        resp = await api.patch("/v1/settings", json=body)
        err = await expect_error(resp, 400, "invalid_request", param)
        assert param in err["message"]
        assert await settings(api) == before
        assert await stored_config(service) == stored
        assert service.pool.capacity == 1


BAD_VALUES = [
    ("host", ""), ("host", 5), ("host", None), ("host", "h" * 256), ("host", ["127.0.0.1"]),
    # Not an address this computer can listen on: saved, the next start would fail.
    ("host", "not a host!"), ("host", "example.com"), ("host", "192.0.2.1"), ("host", "[::1]"),
    ("host", "127.0.0.1:80"),
    ("port", -1), ("port", 65536), ("port", "8080"), ("port", True), ("port", 8080.5), ("port", None),
    ("retention_seconds", 59), ("retention_seconds", 0), ("retention_seconds", "3600"), ("retention_seconds", True),
    ("retention_seconds", 10 * 365 * 86400 + 1), ("retention_seconds", 3600.0),
    ("default_on_restart", "sometimes"), ("default_on_restart", "FAIL"), ("default_on_restart", None),
    ("default_on_restart", 1),
    ("max_concurrent_tasks", 0), ("max_concurrent_tasks", 17), ("max_concurrent_tasks", "2"),
    ("max_concurrent_tasks", True), ("max_concurrent_tasks", 2.0), ("max_concurrent_tasks", -1),
    ("allowed_origins", "http://localhost:3000"), ("allowed_origins", [1]), ("allowed_origins", [""]),
    ("allowed_origins", None), ("allowed_origins", {"http://localhost:3000": True}),
    ("idempotency_ttl_seconds", 59), ("idempotency_ttl_seconds", -1), ("idempotency_ttl_seconds", "86400"),
    ("idempotency_ttl_seconds", False),
    ("model_idle_ttl_seconds", -1), ("model_idle_ttl_seconds", "10"), ("model_idle_ttl_seconds", 1.5),
    ("model_idle_ttl_seconds", True), ("model_idle_ttl_seconds", None),
]


async def test_bad_values_are_400_naming_the_key_and_change_nothing(api, service):
    before, stored = await settings(api), await stored_config(service)
    for name, value in BAD_VALUES:
        # A valid change alongside, listed first: it must not be saved either.
        resp = await api.patch("/v1/settings", json={"retention_seconds": 3600, name: value}
                               if name != "retention_seconds" else {"max_concurrent_tasks": 2, name: value})
        await expect_error(resp, 400, "invalid_request", name)
    assert await settings(api) == before
    assert await stored_config(service) == stored
    assert service.pool.capacity == 1


async def test_host_is_an_address_this_computer_listens_on(api):
    for host in ["localhost", "0.0.0.0", "127.0.0.2", "127.0.0.1"]:
        resp = await api.patch("/v1/settings", json={"host": host})
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["host"] == host
    err = await expect_error(await api.patch("/v1/settings", json={"host": "example.com"}), 400,
                             "invalid_request", "host")
    assert "IP address of this computer" in err["message"]


@pytest.mark.parametrize("body", [[], ["retention_seconds"], "x", 5, None])
async def test_body_must_be_an_object(api, body):
    resp = await api.patch("/v1/settings", data=json.dumps(body), headers={"Content-Type": "application/json"})
    await expect_error(resp, 400, "invalid_request")


async def test_allowed_origins_take_effect_on_the_next_request(api, service):
    origin = "http://localhost:5173"
    resp = await api.get("/v1/tasks", headers={"Origin": origin})
    await expect_error(resp, 403, "origin_not_allowed")
    assert "Access-Control-Allow-Origin" not in resp.headers

    resp = await api.patch("/v1/settings", json={"allowed_origins": [origin]})
    assert resp.status == 200
    resp = await api.get("/v1/tasks", headers={"Origin": origin})
    assert resp.status == 200, await resp.text()
    assert resp.headers["Access-Control-Allow-Origin"] == origin
    assert not any("*" in v for v in resp.headers.values()), dict(resp.headers)
    # Preflight too, without a token.
    resp, _ = await raw(api, "OPTIONS", "/v1/responses", headers={"Origin": origin,
                                                                   "Access-Control-Request-Method": "POST"})
    assert resp.status in (200, 204) and resp.headers["Access-Control-Allow-Origin"] == origin
    assert not any("*" in v for v in resp.headers.values()), dict(resp.headers)
    # Other origins are still refused, and there is no wildcard: "*" (or a path) is not an origin.
    resp = await api.get("/v1/tasks", headers={"Origin": "http://localhost:5174"})
    await expect_error(resp, 403, "origin_not_allowed")
    for bad in (["*"], ["https://*.example"], ["https://app.example/path"], ["app.example"]):
        resp = await api.patch("/v1/settings", json={"allowed_origins": bad})
        await expect_error(resp, 400, "invalid_request", param="allowed_origins")
    assert service.settings["allowed_origins"] == [origin]
    # And removing the origin takes effect at once as well.
    resp = await api.patch("/v1/settings", json={"allowed_origins": []})
    assert resp.status == 200
    resp = await api.get("/v1/tasks", headers={"Origin": origin})
    await expect_error(resp, 403, "origin_not_allowed")


async def test_max_concurrent_tasks_two_runs_two_tasks_at_once(api, service):
    resp = await api.patch("/v1/settings", json={"max_concurrent_tasks": 2})
    assert resp.status == 200 and (await resp.json())["max_concurrent_tasks"] == 2
    long = {"input": COUNT, "max_output_tokens": 300, "temperature": 0, "background": True}
    ids = []
    for _ in range(2):
        resp = await api.post("/v1/responses", json=long)
        assert resp.status == 202, await resp.text()
        ids.append((await resp.json())["task"]["id"])

    async def both_running() -> bool:
        listed = (await (await api.get("/v1/tasks?status=running")).json())["data"]
        running = {t["id"] for t in listed}
        if not running:
            states = [(await (await api.get(f"/v1/tasks/{i}")).json())["status"] for i in ids]
            assert states != ["completed", "completed"], "both tasks finished without ever running together"
        return running == set(ids)
    await poll(both_running, timeout=120, interval=0.1, what="two tasks running at the same time")
    for task_id in ids:
        resp = await api.post(f"/v1/tasks/{task_id}/cancel")
        assert resp.status in (200, 409), await resp.text()


async def test_settings_need_admin(api):
    _, token = await pair(api, ALL_BUT_ADMIN)
    resp, text = await raw(api, "GET", "/v1/settings", headers=bearer(token))
    assert resp.status == 403 and json.loads(text)["error"]["code"] == "insufficient_scope", text
    resp, text = await raw(api, "PATCH", "/v1/settings", headers=bearer(token), json={"max_concurrent_tasks": 4})
    assert resp.status == 403 and json.loads(text)["error"]["code"] == "insufficient_scope", text
    resp, text = await raw(api, "PATCH", "/v1/settings", json={"max_concurrent_tasks": 4})
    assert resp.status == 401, text
    assert (await settings(api))["max_concurrent_tasks"] == 1


async def test_what_get_returns_can_be_patched_back(api):
    current = await (await api.get("/v1/settings")).json()
    changed = {**current, "retention_seconds": 3600}
    resp = await api.patch("/v1/settings", json=changed)
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["retention_seconds"] == 3600
