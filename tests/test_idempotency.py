"""Idempotency keys on POST /v1/responses (LMSP §7): a retry is answered from what the first
request stored and never runs the model twice; keys are per client and expire."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from typing import Any

import pytest

from tests.helpers import COUNT, SAY_HI, bearer, expect_error, pair, poll, raw, wait_status

pytestmark = pytest.mark.scripted  # the machine around inference, not inference: tests/scripted.py's engines

BACKGROUND = {**SAY_HI, "background": True}


def key(name: str) -> dict[str, str]:
    return {"Idempotency-Key": name}


async def task_ids(service: Any) -> list[str]:
    return await service.store.read(lambda c: [r[0] for r in c.execute("SELECT id FROM tasks ORDER BY created_at")])


async def key_row(service: Any, client_id: str, name: str) -> Any:
    return await service.store.read(lambda c: c.execute(
        "SELECT * FROM idempotency_keys WHERE client_id = ? AND key = ?", (client_id, name)).fetchone())


async def test_background_retry_gets_the_same_202_and_task(api, service):
    first = await api.post("/v1/responses", json=BACKGROUND, headers=key("bg-1"))
    assert first.status == 202, await first.text()
    assert "Idempotent-Replayed" not in first.headers
    body1 = await first.json()
    second = await api.post("/v1/responses", json=BACKGROUND, headers=key("bg-1"))
    assert second.status == 202, await second.text()
    assert second.headers.get("Idempotent-Replayed") == "true"
    body2 = await second.json()
    assert body2 == body1
    assert body2["task"]["id"] == body1["task"]["id"]
    assert second.headers.get("Location") == first.headers["Location"] == f"/v1/tasks/{body1['task']['id']}"
    assert await task_ids(service) == [body1["task"]["id"]]

    # Still the same answer once the task has finished: the 202 as it was first given.
    await wait_status(api, body1["task"]["id"])
    third = await api.post("/v1/responses", json=BACKGROUND, headers=key("bg-1"))
    assert third.status == 202 and third.headers.get("Idempotent-Replayed") == "true"
    assert await third.json() == body1
    assert await task_ids(service) == [body1["task"]["id"]]


async def test_foreground_replay_returns_the_stored_200_and_runs_the_model_once(api, service):
    first = await api.post("/v1/responses", json=SAY_HI, headers=key("fg-1"))
    assert first.status == 200, await first.text()
    assert "Idempotent-Replayed" not in first.headers
    body1 = await first.json()
    assert body1["status"] in ("completed", "incomplete") and body1["output_text"]
    tokens = service.generations.tokens_generated
    for _ in range(2):
        again = await api.post("/v1/responses", json=SAY_HI, headers=key("fg-1"))
        assert again.status == 200, await again.text()
        assert again.headers.get("Idempotent-Replayed") == "true"
        assert await again.json() == body1
    assert await task_ids(service) == [body1["task"]["id"]]
    assert service.generations.tokens_generated == tokens  # nothing was generated for the replays
    row = await key_row(service, "client_owner", "fg-1")
    assert row["status_code"] == 200 and row["response_id"] == body1["id"]


async def test_same_key_different_body_is_422(api, service):
    resp = await api.post("/v1/responses", json=SAY_HI, headers=key("k-reuse"))
    assert resp.status == 200
    before = await task_ids(service)
    for body in ({**SAY_HI, "input": "Say bye"}, {**SAY_HI, "max_output_tokens": 9}, BACKGROUND):
        resp = await api.post("/v1/responses", json=body, headers=key("k-reuse"))
        await expect_error(resp, 422, "idempotency_key_reused")
    assert await task_ids(service) == before
    # The digest is over the JSON value, not its spelling: key order and spacing do not matter.
    reordered = json.dumps({"temperature": 0, "max_output_tokens": 8, "input": "Say hi"}, indent=2)
    resp = await api.post("/v1/responses", data=reordered, headers={**key("k-reuse"),
                                                                    "Content-Type": "application/json"})
    assert resp.status == 200 and resp.headers.get("Idempotent-Replayed") == "true"


async def test_same_key_while_the_first_is_running_is_409(api, service):
    long = {"input": COUNT, "max_output_tokens": 200, "temperature": 0}
    first = asyncio.create_task(api.post("/v1/responses", json=long, headers=key("slow")))

    async def in_flight() -> bool:
        row = await key_row(service, "client_owner", "slow")
        return row is not None and row["status_code"] is None
    await poll(in_flight, what="the first request to claim its key")
    resp = await api.post("/v1/responses", json=long, headers=key("slow"))
    await expect_error(resp, 409, "idempotency_key_in_use")
    resp = await api.post("/v1/responses", json=SAY_HI, headers=key("slow"))
    await expect_error(resp, 422, "idempotency_key_reused")
    assert not first.done(), "the first request finished too soon for this test to mean anything"

    # End the first request's work early (cancel is quick; waiting out 200 tokens on a busy
    # machine is not): its final answer, cancelled, is what the key stores.
    task_id = (await task_ids(service))[0]
    resp = await api.post(f"/v1/tasks/{task_id}/cancel")
    assert resp.status == 200, await resp.text()
    done = await asyncio.wait_for(first, 120)
    assert done.status == 200, await done.text()
    body = await done.json()
    assert body["status"] == "cancelled" and body["task"]["id"] == task_id
    again = await api.post("/v1/responses", json=long, headers=key("slow"))
    assert again.status == 200 and again.headers.get("Idempotent-Replayed") == "true"
    assert await again.json() == body
    assert await task_ids(service) == [body["task"]["id"]]


async def test_keys_are_per_client(api, service):
    service.tasks.set_paused(True)  # no generation needed: the tasks only have to exist
    _, token = await pair(api, ["responses:read", "responses:write"])
    owner = await api.post("/v1/responses", json=BACKGROUND, headers=key("shared-name"))
    assert owner.status == 202
    owner_body = await owner.json()
    resp, text = await raw(api, "POST", "/v1/responses", json=BACKGROUND,
                           headers={**bearer(token), **key("shared-name")})
    assert resp.status == 202, text
    assert "Idempotent-Replayed" not in resp.headers
    theirs = json.loads(text)
    assert theirs["task"]["id"] != owner_body["task"]["id"]
    # ...and each gets its own replay.
    resp, text = await raw(api, "POST", "/v1/responses", json=BACKGROUND,
                           headers={**bearer(token), **key("shared-name")})
    assert resp.headers.get("Idempotent-Replayed") == "true" and json.loads(text)["id"] == theirs["id"]
    # A different body under the same name is still fine for the other client (its own key space).
    resp, text = await raw(api, "POST", "/v1/responses", json={**BACKGROUND, "input": "Other"},
                           headers={**bearer(token), **key("owner-only")})
    assert resp.status == 202 and "Idempotent-Replayed" not in resp.headers, text
    assert len(await task_ids(service)) == 3


async def test_expired_key_can_be_reused(api, service):
    service.tasks.set_paused(True)
    resp = await api.post("/v1/responses", json=BACKGROUND, headers=key("old"))
    assert resp.status == 202
    first = await resp.json()
    ttl = service.settings["idempotency_ttl_seconds"]
    assert ttl == 86400
    await service.store.write(lambda c: c.execute(
        "UPDATE idempotency_keys SET created_at = ? WHERE key = 'old'", (time.time() - ttl - 10,)))
    resp = await api.post("/v1/responses", json={**BACKGROUND, "input": "Something else"}, headers=key("old"))
    assert resp.status == 202, await resp.text()
    assert "Idempotent-Replayed" not in resp.headers
    second = await resp.json()
    assert second["id"] != first["id"]
    assert len(await task_ids(service)) == 2
    # The key now belongs to the new request.
    resp = await api.post("/v1/responses", json={**BACKGROUND, "input": "Something else"}, headers=key("old"))
    assert resp.headers.get("Idempotent-Replayed") == "true" and (await resp.json())["id"] == second["id"]
    # The expired row was replaced, not duplicated.
    assert await service.store.read(lambda c: c.execute(
        "SELECT count(*) FROM idempotency_keys WHERE key = 'old'").fetchone()[0]) == 1


async def test_expiry_follows_the_setting(api, service):
    service.tasks.set_paused(True)
    resp = await api.patch("/v1/settings", json={"idempotency_ttl_seconds": 60})
    assert resp.status == 200
    resp = await api.post("/v1/responses", json=BACKGROUND, headers=key("short"))
    assert resp.status == 202
    await service.store.write(lambda c: c.execute(
        "UPDATE idempotency_keys SET created_at = created_at - 61 WHERE key = 'short'"))
    resp = await api.post("/v1/responses", json={**BACKGROUND, "input": "x"}, headers=key("short"))
    assert resp.status == 202 and "Idempotent-Replayed" not in resp.headers
    assert len(await task_ids(service)) == 2


async def test_bad_keys_and_failed_requests(api, service):
    for bad in ("x" * 256, "tab\there"):
        resp = await api.post("/v1/responses", json=SAY_HI, headers=key(bad))
        await expect_error(resp, 400, "invalid_request", "Idempotency-Key")
    # A request refused before any work (unknown model) does not use up its key.
    resp = await api.post("/v1/responses", json={**SAY_HI, "model": "nope"}, headers=key("k-fail"))
    await expect_error(resp, 404, "model_not_found")
    resp = await api.post("/v1/responses", json={**SAY_HI, "input": "fixed"}, headers=key("k-fail"))
    assert resp.status == 200 and "Idempotent-Replayed" not in resp.headers
    assert await task_ids(service) == [(await resp.json())["task"]["id"]]


async def test_fifty_concurrent_retries_create_one_task(api, service):
    service.tasks.set_paused(True)  # the task only has to exist
    results = await asyncio.gather(*(api.post("/v1/responses", json=BACKGROUND, headers=key("storm"))
                                     for _ in range(50)))
    bodies = []
    for resp in results:
        assert resp.status == 202, await resp.text()
        bodies.append(await resp.json())
    tasks = await task_ids(service)
    assert len(tasks) == 1
    assert {b["task"]["id"] for b in bodies} == set(tasks)
    assert {b["id"] for b in bodies} == {bodies[0]["id"]}
    assert sum("Idempotent-Replayed" not in r.headers for r in results) == 1
    responses = await service.store.read(lambda c: c.execute("SELECT count(*) FROM responses").fetchone()[0])
    assert responses == 1


async def test_other_posts_take_keys_too(api, service):
    """Chat completions and cancels replay as well."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    before = len(await task_ids(service))
    one = await api.post("/v1/chat/completions", json=chat, headers=key("chat-1"))
    two = await api.post("/v1/chat/completions", json=chat, headers=key("chat-1"))
    assert one.status == two.status == 200 and two.headers["Idempotent-Replayed"] == "true"
    assert await one.json() == await two.json()
    assert len(await task_ids(service)) == before + 1  # the model ran once

    refused = await api.post("/v1/tasks/task_nope/cancel", headers=key("cancel-1"))
    assert refused.status == 404 and await key_row(service, "client_owner", "cancel-1") is None  # errors not kept


def data_lines(text: str) -> list[Any]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


async def test_a_streamed_request_is_replayed_as_the_same_stream(api, service):
    """A retry of a streamed request gets a stream again (what the openai SDK, asking for one,
    can read), with the events the first one got, and nothing runs twice."""
    chat = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "temperature": 0, "stream": True}
    for path, body in (("/v1/responses", {**SAY_HI, "stream": True}), ("/v1/chat/completions", chat),
                       ("/v1/responses", {**SAY_HI, "stream": True, "background": True})):
        before = len(await task_ids(service))
        first = await api.post(path, json=body, headers=key(f"stream {path} {body.get('background')}"))
        assert first.content_type == "text/event-stream", await first.text()
        sent = data_lines(await first.text())
        assert len(sent) > 3
        tokens = service.generations.tokens_generated
        again = await api.post(path, json=body, headers=key(f"stream {path} {body.get('background')}"))
        assert again.status == first.status and again.headers.get("Idempotent-Replayed") == "true"
        assert again.content_type == "text/event-stream"
        assert [json.loads(d) if d != "[DONE]" else d for d in data_lines(await again.text())] == \
            [json.loads(d) if d != "[DONE]" else d for d in sent]
        assert service.generations.tokens_generated == tokens and len(await task_ids(service)) == before + 1
    # The same key without `stream` is another request: 422, as for any other change.
    resp = await api.post("/v1/chat/completions", json={**chat, "stream": False},
                          headers=key("stream /v1/chat/completions None"))
    await expect_error(resp, 422, "idempotency_key_reused")


async def test_a_retry_the_moment_a_stream_ends_is_a_replay_not_a_conflict(api, service):
    """The openai SDK stops reading at a stream's end event and may retry at once, before the
    first connection closes: the answer must already be stored (409 `idempotency_key_in_use` was
    seen there when it was stored only after the stream)."""
    chat = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "temperature": 0, "stream": True}
    ends = (b"event: response.completed", b"event: response.incomplete")
    for path, body, end in (("/v1/responses", {**SAY_HI, "stream": True}, ends),
                            ("/v1/chat/completions", chat, (b"data: [DONE]",))):
        for n in range(3):
            first = await api.post(path, json=body, headers=key(f"at once {path} {n}"))
            assert first.status == 200, await first.text()
            while not (line := await first.content.readline()).startswith(end):
                assert line, "the stream ended without its end event"
            again = await api.post(path, json=body, headers=key(f"at once {path} {n}"))
            assert again.status == 200 and again.headers.get("Idempotent-Replayed") == "true", await again.text()
            await again.text()
            await first.text()


async def test_a_key_without_a_client_is_ignored_and_never_replays_a_pairing(api, service):
    """Pairing requests have no client identity: a key there would be shared by every local
    program, and a replay would hand one app's pairing id (and so its token) to another."""
    body = {"client_name": "Real app", "scopes": ["models:read"]}
    first, first_text = await raw(api, "POST", "/v1/pairings", headers=key("pair-1"), json=body)
    thief, thief_text = await raw(api, "POST", "/v1/pairings", headers=key("pair-1"), json=body)
    assert first.status == 202 and "Idempotent-Replayed" not in thief.headers
    assert json.loads(first_text)["id"] not in thief_text  # a new request (here 429: one per name), not a replay
    assert await service.store.read(lambda c: c.execute("SELECT count(*) FROM idempotency_keys").fetchone()[0]) == 0


async def test_a_key_on_an_unknown_route_costs_no_write(api, service):
    """The route and the client are resolved before the key store is touched: a stranger's POST
    with a key, to a route that does not exist, commits nothing (each commit is an fsync)."""
    watcher = sqlite3.connect(service.data_dir / "lmsp.sqlite3")
    try:
        version = watcher.execute("PRAGMA data_version").fetchone()[0]
        for path in ("/v1/nothing-here", "/v1/pairings/x/y/z", "/v1/tasks/task_x/cancel"):
            resp, _ = await raw(api, "POST", path, headers=key("k-1"), json={})
            assert resp.status in (401, 404, 405), (path, resp.status)
        assert watcher.execute("PRAGMA data_version").fetchone()[0] == version  # no commit by anyone
    finally:
        watcher.close()


async def test_after_deleting_a_response_its_key_no_longer_replays_it(api, service):
    first = await (await api.post("/v1/responses", json=BACKGROUND, headers=key("del-1"))).json()
    await wait_status(api, first["task"]["id"])
    assert (await api.delete(f"/v1/responses/{first['id']}")).status == 200
    again = await api.post("/v1/responses", json=BACKGROUND, headers=key("del-1"))
    assert again.status == 202 and "Idempotent-Replayed" not in again.headers, await again.text()
    created = await again.json()
    assert created["id"] != first["id"]
    assert (await api.get(f"/v1/tasks/{created['task']['id']}")).status == 200  # it points at a real task
