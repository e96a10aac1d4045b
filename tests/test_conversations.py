"""Conversation state (LMSP §12): `previous_response_id` chains, `input_items`, `store: false`.

Real service, real SQLite file; scripted engines (tests/scripted.py) but where the model must
have seen the earlier turns (marked `llama`: real inference with the default model)."""

from __future__ import annotations

import json
import sqlite3
import time
from typing import Any

import openai
import pytest

from app.core.service import AppService
from app.engine.registry.models import DEFAULT_MODEL_ID
from app.tasks.retention import UNSTORED_GRACE_SECONDS
from tests.conftest import Headless
from tests.helpers import bearer, expect_error, pair, pair_sync, raw

pytestmark = pytest.mark.scripted
TURN = {"max_output_tokens": 6, "temperature": 0}


async def create(api: Any, headers: dict[str, str] | None = None, **body: Any) -> dict[str, Any]:
    resp = await api.post("/v1/responses", json={**TURN, **body}, headers=headers or {})
    assert resp.status in (200, 202), await resp.text()
    return await resp.json()


async def items(api: Any, response_id: str, query: str = "order=asc") -> dict[str, Any]:
    resp = await api.get(f"/v1/responses/{response_id}/input_items?{query}")
    assert resp.status == 200, await resp.text()
    return await resp.json()


def texts(listed: dict[str, Any]) -> list[tuple[str, str]]:
    return [(item["role"], item["content"][0]["text"]) for item in listed["data"]]


@pytest.mark.llama
def test_a_chain_through_the_sdk_sees_earlier_turns_and_survives_sigkill(headless: Headless) -> None:
    headless.start()
    _, token = pair_sync(headless.url, headless.token, ["responses:read", "responses:write"], "chat-app")
    sdk = openai.OpenAI(base_url=f"{headless.url}/v1", api_key=token, max_retries=0, timeout=120)
    first = sdk.responses.create(model=DEFAULT_MODEL_ID, input="My cat is called Tom.", **TURN)
    second = sdk.responses.create(model=DEFAULT_MODEL_ID, previous_response_id=first.id,
                                  input="What is my cat called?", **TURN)
    assert second.previous_response_id == first.id and first.previous_response_id is None
    # The model saw the first turn: its input and output come before the new input.
    listed = sdk.responses.input_items.list(second.id, order="asc")
    assert [(i.role, i.content[0].text) for i in listed.data] == [
        ("user", "My cat is called Tom."), ("assistant", first.output_text), ("user", "What is my cat called?")]
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # The engine reused the first turn's prompt from its cache.
    assert second.usage.input_tokens_details.cached_tokens > 0
    headless.kill()  # SIGKILL: the chain is all in SQLite
    headless.start()
    sdk.close()
    sdk = openai.OpenAI(base_url=f"{headless.url}/v1", api_key=token, max_retries=0, timeout=120)  # a new port
    third = sdk.responses.create(model=DEFAULT_MODEL_ID, previous_response_id=second.id, input="And his age?", **TURN)
    assert third.status in ("completed", "incomplete")
    listed = sdk.responses.input_items.list(third.id, order="asc")
    assert [i.content[0].text for i in listed.data] == [
        "My cat is called Tom.", first.output_text, "What is my cat called?", second.output_text, "And his age?"]
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    sdk.close()


async def test_input_items_page_like_openai(api: Any) -> None:
    first = await create(api, input="One.", instructions="Answer in French.")
    second = await create(api, previous_response_id=first["id"], input="Two.")
    everything = await items(api, second["id"])
    # Instructions are not carried over: neither listed nor given to the model again.
    assert texts(everything) == [("user", "One."), ("assistant", first["output_text"]), ("user", "Two.")]
    assert second["instructions"] is None and texts(await items(api, first["id"])) == [("user", "One.")]
    assert everything["object"] == "list" and not everything["has_more"]
    assert everything["first_id"] == everything["data"][0]["id"]
    assert everything["last_id"] == everything["data"][-1]["id"]
    newest = await items(api, second["id"], "limit=2")  # default order: newest first, as OpenAI
    assert texts(newest) == [("user", "Two."), ("assistant", first["output_text"])] and newest["has_more"]
    rest = await items(api, second["id"], f"limit=2&after={newest['last_id']}")
    assert texts(rest) == [("user", "One.")] and not rest["has_more"]
    resp = await api.get(f"/v1/responses/{second['id']}/input_items?order=sideways")
    await expect_error(resp, 400, "invalid_request", "order")
    resp = await api.get(f"/v1/responses/{second['id']}/input_items?after=msg_nope")
    await expect_error(resp, 400, "invalid_request", "after")


async def test_only_a_completed_stored_response_of_the_same_client_continues(api: Any, service: AppService) -> None:
    _, token = await pair(api, ["responses:read", "responses:write"], "Other App")
    mine = await create(api, input="Hello.")
    resp = await api.post("/v1/responses", json={**TURN, "input": "Hi.", "previous_response_id": mine["id"]},
                          headers=bearer(token))
    await expect_error(resp, 404, "previous_response_not_found", "previous_response_id")  # as if unknown
    resp = await api.post("/v1/responses", json={**TURN, "input": "Hi.", "previous_response_id": "resp_nothing"})
    await expect_error(resp, 404, "previous_response_not_found", "previous_response_id")
    # Still queued (the service is paused), then cancelled: neither can be continued.
    service.tasks.set_paused(True)
    waiting = await create(api, input="Later.", background=True)
    resp = await api.post("/v1/responses", json={**TURN, "input": "Hi.", "previous_response_id": waiting["id"]})
    assert "queued" in (await expect_error(resp, 404, "previous_response_not_found", "previous_response_id"))["message"]
    await api.post(f"/v1/responses/{waiting['id']}/cancel")
    resp = await api.post("/v1/responses", json={**TURN, "input": "Hi.", "previous_response_id": waiting["id"]})
    assert "cancelled" in (await expect_error(resp, 404, "previous_response_not_found"))["message"]
    resp = await api.post("/v1/responses", json={**TURN, "input": "Hi.", "previous_response_id": ""})
    await expect_error(resp, 400, "invalid_request", "previous_response_id")
    # input_items: responses:read, and only one's own.
    resp, text = await raw(api, "GET", f"/v1/responses/{mine['id']}/input_items", headers=bearer(token))
    assert resp.status == 404, text
    _, writer = await pair(api, ["responses:write"], "Writer")
    resp, text = await raw(api, "GET", f"/v1/responses/{mine['id']}/input_items", headers=bearer(writer))
    assert resp.status == 403 and json.loads(text)["error"]["code"] == "insufficient_scope", text


async def test_a_deleted_or_expired_ancestor_ends_the_chain_but_not_what_was_accepted(
        api: Any, service: AppService) -> None:
    a = await create(api, input="Turn A.")
    b = await create(api, previous_response_id=a["id"], input="Turn B.")
    c = await create(api, previous_response_id=b["id"], input="Turn C.")
    # Retention removes A (finished 8 days ago): B and C stay, as they were accepted...
    with sqlite3.connect(service.store.path) as conn:
        conn.execute("UPDATE tasks SET finished_at = finished_at - 8 * 86400 WHERE response_id = ?", (a["id"],))
    assert (await service.housekeeping.purge())["responses"] == 1
    assert [t for _, t in texts(await items(api, c["id"]))][:2] == ["Turn A.", a["output_text"]]
    # ...but the chain can no longer be continued, from its end or its middle.
    for tip in (c, b):
        resp = await api.post("/v1/responses", json={**TURN, "input": "D.", "previous_response_id": tip["id"]})
        err = await expect_error(resp, 404, "previous_response_not_found", "previous_response_id")
        assert a["id"] in err["message"]
    # A deleted response likewise.
    x = await create(api, input="Turn X.")
    y = await create(api, previous_response_id=x["id"], input="Turn Y.")
    assert (await api.delete(f"/v1/responses/{x['id']}")).status == 200
    resp = await api.post("/v1/responses", json={**TURN, "input": "Z.", "previous_response_id": y["id"]})
    await expect_error(resp, 404, "previous_response_not_found", "previous_response_id")


async def test_store_false_cannot_be_continued_and_leaves_nothing_in_the_file(api: Any, service: AppService) -> None:
    secret = "The vault code is 7351-PELICAN."
    resp = await api.post("/v1/responses", json={**TURN, "input": secret, "background": True, "store": False})
    await expect_error(resp, 400, "invalid_request", "store")
    gone = await create(api, input=secret, store=False, metadata={"tag": "ephemeral"})
    assert gone["store"] is False and gone["status"] in ("completed", "incomplete")
    resp = await api.post("/v1/responses", json={**TURN, "input": "Again?", "previous_response_id": gone["id"]})
    await expect_error(resp, 400, "previous_response_not_stored", "previous_response_id")
    kept = await create(api, input="Nothing secret.")
    # Within the grace period it is still there (the caller may fetch it once more)...
    assert (await api.get(f"/v1/responses/{gone['id']}")).status == 200
    counts = await service.housekeeping.purge(time.time() + UNSTORED_GRACE_SECONDS + 1)
    assert counts["unstored"] == 1 and counts["responses"] == 0
    # ...then request, output, events and task are gone, the stored response stays.
    assert (await api.get(f"/v1/responses/{gone['id']}")).status == 404
    assert (await api.get(f"/v1/responses/{kept['id']}")).status == 200
    with sqlite3.connect(service.store.path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # as the service does when it closes
        dump = "\n".join(conn.iterdump())
    assert "7351-PELICAN" not in dump and gone["id"] not in dump and "Nothing secret." in dump
    files = b"".join(p.read_bytes() for p in service.store.path.parent.glob(f"{service.store.path.name}*"))
    assert b"7351-PELICAN" not in files  # not even in a free page: deleted content is overwritten
