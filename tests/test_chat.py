"""Chat completions (LMSP §9) in the terms an OpenAI chat client knows: errors name the chat
fields it sent, usage at the end of a stream when asked, a too-long input refused with 400
(streamed too: the task fails before any output), and the same answers from /v1/responses.
The engines are scripted (tests/scripted.py: a word a token, the default model's context)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.helpers import SAY_HI, expect_error

pytestmark = pytest.mark.scripted
HI = [{"role": "user", "content": "Say hi"}]
CHAT = {"messages": HI, "max_tokens": 8, "temperature": 0}
LONG = "word " * 5000  # longer than the 4096-token context the model runs with


def chunks(text: str) -> list[Any]:
    """The `data:` payloads of a chat stream, `[DONE]` as the string it is."""
    lines = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


@pytest.mark.parametrize("body, param, said", [
    ({"messages": "hi"}, "messages", "`messages`"),
    ({"messages": []}, "messages", "`messages`"),
    ({**CHAT, "max_tokens": 0}, "max_tokens", "`max_tokens`"),
    ({**CHAT, "max_completion_tokens": "8"}, "max_completion_tokens", "`max_completion_tokens`"),
    ({"messages": [*HI, {"role": "tool", "content": "22 C"}]}, "messages[1].tool_call_id", "`tool_call_id`"),
    ({"messages": [*HI, {"role": "tool", "tool_call_id": "call_1", "content": 22}]}, "messages[1].content",
     "`content`"),
    ({"messages": [*HI, {"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": "{}"}}]}]}, "messages[1].tool_calls[0].id", "`id`"),
    ({"messages": [*HI, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_weather"}}]}]}, "messages[1].tool_calls[0].function.arguments", "`arguments`"),
    # Messages after an assistant turn of two tool calls (two items on the Responses side).
    ({"messages": [*HI, {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "b", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "robot", "content": "?"}]}, "messages[2].role", "role"),
    ({"messages": [*HI, {"role": "user", "content": [{"type": "input_audio"}]}]}, "messages[1].content[0]", "text"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options", "`stream: true`"),
    ({**CHAT, "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options", "include_usage"),
])
async def test_errors_name_the_chat_fields_sent(api, body, param, said):
    err = await expect_error(await api.post("/v1/chat/completions", json=body), 400, "invalid_request", param)
    assert said in err["message"]
    assert not any(f"`{name}`" in err["message"] for name in ("max_output_tokens", "call_id", "input", "output")), err


async def test_a_streamed_chat_ends_with_its_usage_when_asked(api):
    plain = chunks(await (await api.post("/v1/chat/completions", json={**CHAT, "stream": True})).text())
    assert plain[-1] == "[DONE]" and all("usage" not in c for c in plain[:-1])

    resp = await api.post("/v1/chat/completions",
                          json={**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert resp.status == 200, await resp.text()
    assert resp.headers.get("X-Accel-Buffering") == "no"  # a proxy in front must not hold chunks back
    got = chunks(await resp.text())
    assert got[-1] == "[DONE]"
    last, body = got[-2], got[:-2]
    assert last["choices"] == [] and last["object"] == "chat.completion.chunk", last
    usage = last["usage"]
    assert usage["prompt_tokens"] > 5 and 0 < usage["completion_tokens"] <= 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert all(c["usage"] is None for c in body)  # as OpenAI: null on every chunk but the last
    assert body[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    # The same figures as the response it ran as, and as the same request unstreamed.
    unstreamed = await (await api.post("/v1/chat/completions", json=CHAT)).json()
    assert unstreamed["usage"] == usage


async def test_a_too_long_input_is_400_on_both_routes(api):
    resp = await api.post("/v1/responses", json={"input": LONG, "max_output_tokens": 4})
    err = await expect_error(resp, 400, "context_length_exceeded", "input")
    assert "4096" in err["message"]
    resp = await api.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": LONG}]})
    err = await expect_error(resp, 400, "context_length_exceeded", "messages")
    assert "4096" in err["message"]
    # The error is the answer a retry with the same key gets, without running again.
    for _ in range(2):
        resp = await api.post("/v1/responses", json={"input": LONG}, headers={"Idempotency-Key": "long-1"})
        await expect_error(resp, 400, "context_length_exceeded", "input")
    assert resp.headers.get("Idempotent-Replayed") == "true"
    # Deleting the failed response frees its key: the retry runs anew (and fails anew).
    failed = (await (await api.get("/v1/tasks?status=failed")).json())["data"]
    assert len(failed) == 3, failed
    for task in failed:
        assert (await api.request("DELETE", f"/v1/responses/{task['response_id']}")).status == 200
    resp = await api.post("/v1/responses", json={"input": LONG}, headers={"Idempotency-Key": "long-1"})
    await expect_error(resp, 400, "context_length_exceeded", "input")
    assert "Idempotent-Replayed" not in resp.headers
    # And the service is fine for the next request.
    assert (await api.post("/v1/responses", json=SAY_HI)).status == 200


async def test_a_stream_whose_task_fails_before_any_output_is_an_http_error(api):
    """As OpenAI's: the openai SDK raises BadRequestError at the call, before any event."""
    too_long = [{"role": "user", "content": LONG}]
    resp = await api.post("/v1/chat/completions", json={"messages": too_long, "stream": True})
    err = await expect_error(resp, 400, "context_length_exceeded", "messages")
    assert "4096" in err["message"] and resp.content_type == "application/json"
    resp = await api.post("/v1/responses", json={"input": LONG, "stream": True})
    await expect_error(resp, 400, "context_length_exceeded", "input")
    # A retry with the key is answered the same, without running again.
    for _ in range(2):
        resp = await api.post("/v1/responses", json={"input": LONG, "stream": True},
                              headers={"Idempotency-Key": "long-stream"})
        await expect_error(resp, 400, "context_length_exceeded", "input")
    assert resp.headers.get("Idempotent-Replayed") == "true"
    failed = (await (await api.get("/v1/tasks?status=failed")).json())["data"]
    assert len(failed) == 3
    # A stream that gets output streams as before, its events from the start.
    resp = await api.post("/v1/responses", json={**SAY_HI, "stream": True})
    assert resp.status == 200 and resp.content_type == "text/event-stream"
    kinds = [line[len("event: "):] for line in (await resp.text()).splitlines() if line.startswith("event: ")]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds


def test_chat_keys_stored_by_the_previous_version_are_dropped_on_upgrade(tmp_path):
    """Before schema 11 a non-streamed chat stored its key with the chat body, which the chat
    route now cannot replay (it replays the response): the upgrade drops those keys, so a retry
    within their lifetime runs anew instead of failing with 500. Other keys stay."""
    from app.store import db
    from tests.test_store import plain

    old = tmp_path / "old.sqlite3"
    with plain(old) as conn:
        for version, sql in db.migrations()[:10]:
            for statement in db._statements(sql):
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {version}")
        for key, ident in (("chat", "chatcmpl-1"), ("resp", "resp_1")):
            conn.execute("INSERT INTO idempotency_keys VALUES ('c', ?, 'd', 200, ?, ?, 0)",
                         (key, json.dumps({"id": ident}), ident))
    conn = db.open_database(old).conn
    assert [r[0] for r in conn.execute("SELECT key FROM idempotency_keys")] == ["resp"]
