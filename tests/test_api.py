"""The HTTP API as a client sees it: status codes, error bodies, headers, event streams, and
what ends up in the database, against a real service. Its engines are scripted (tests/scripted.py:
they count, "1, 2, 3, ..."), but in the tests about what llama.cpp makes of a request (marked
`llama`: SmolLM2-135M).

Every generation is small (a few tokens) except where a task must still be running when the test
acts on it; those are cancelled or killed, never waited out.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Any

import aiohttp
import pytest

from app.core import auth
from app.server.app import Server
from tests.helpers import poll, wait_status

SAY_HI = {"input": "Say hi", "max_output_tokens": 8, "temperature": 0}
# SmolLM2 answers this at length at temperature 0 ("1, 2, 3, ..." for well over 2000 tokens): the
# prompt for tasks that must still be running when the test acts on them.
COUNT = "Write the numbers from 1 to 1000 separated by commas."
LONG = {"input": COUNT, "max_output_tokens": 2000, "temperature": 0, "background": True}
TERMINAL_EVENTS = {"response.completed", "response.incomplete", "response.failed", "response.cancelled"}
TABLES = ("responses", "tasks", "task_events")
pytestmark = pytest.mark.scripted


# -- helpers -------------------------------------------------------------------------------

async def counts(service: Any) -> dict[str, int]:
    out = {}
    for table in TABLES:
        out[table] = await service.store.read(
            lambda c, t=table: c.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0])
    return out


async def expect_error(resp: aiohttp.ClientResponse, status: int, code: str,
                       param: Any = ...) -> dict[str, Any]:
    """The LMSP error body, exactly: {"error": {"type", "code", "message", "param"}}, as JSON."""
    text = await resp.text()
    assert resp.status == status, (resp.status, text)
    assert resp.content_type == "application/json", (resp.content_type, text)
    body = json.loads(text)
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"type", "code", "message", "param"}, err
    assert err["code"] == code, err
    assert isinstance(err["type"], str) and err["type"], err
    assert isinstance(err["message"], str) and err["message"], err
    assert "Traceback" not in err["message"]
    if param is not ...:
        assert err["param"] == param, err
    return err


async def task(api: Any, task_id: str) -> dict[str, Any]:
    resp = await api.get(f"/v1/tasks/{task_id}")
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def wait_generating(api: Any, task_id: str) -> dict[str, Any]:
    """Until the task is `running` and has produced output (past prompt evaluation)."""
    async def check() -> dict[str, Any] | None:
        body = await task(api, task_id)
        assert body["status"] in ("queued", "loading", "running"), body
        return body if body["status"] == "running" and body["progress"]["output_tokens"] > 0 else None
    return await poll(check, what=f"task {task_id} to produce output")


async def events(api: Any, task_id: str, after: int | None = None) -> list[dict[str, Any]]:
    url = f"/v1/tasks/{task_id}/events" + (f"?after={after}" if after is not None else "")
    resp = await api.get(url)
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    return body["data"]


async def start_background(api: Any, body: dict[str, Any]) -> dict[str, Any]:
    resp = await api.post("/v1/responses", json={**body, "background": True})
    assert resp.status == 202, await resp.text()
    return await resp.json()


async def read_sse(resp: aiohttp.ClientResponse, timeout: float = 60.0) -> list[dict[str, Any]]:
    """Parse an SSE body until the server closes it. Each frame's `id:` and `event:` must agree
    with its JSON `data:`; returns the decoded events."""
    assert resp.status in (200, 202), await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream"), resp.headers["Content-Type"]
    frames: list[dict[str, str]] = []

    async def run() -> None:
        fields: dict[str, str] = {}
        async for raw in resp.content:
            line = raw.decode("utf-8").rstrip("\r\n")
            if not line:
                if fields:
                    frames.append(fields)
                fields = {}
                continue
            if line.startswith(":"):
                continue  # comment (heartbeat)
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            fields[name] = fields[name] + "\n" + value if name == "data" and name in fields else value
        assert not fields, f"unterminated frame at end of stream: {fields}"

    await asyncio.wait_for(run(), timeout)  # the stream must end by itself
    out = []
    for f in frames:
        assert set(f) == {"id", "event", "data"}, f
        event = json.loads(f["data"])
        assert int(f["id"]) == event["sequence_number"], f
        assert f["event"] == event["type"], f
        out.append(event)
    return out


def check_sequence(evs: list[dict[str, Any]], first: int = 0) -> None:
    """Contiguous sequence numbers from `first`, one task, exactly one terminal event, at the end."""
    assert [e["sequence_number"] for e in evs] == list(range(first, first + len(evs))), \
        [(e["sequence_number"], e["type"]) for e in evs]
    assert len({e["task_id"] for e in evs}) == 1
    assert evs[-1]["type"] in TERMINAL_EVENTS, evs[-1]["type"]
    assert not any(e["type"] in TERMINAL_EVENTS for e in evs[:-1])


def deltas(evs: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")


async def add_client(service: Any, client_id: str, scopes: list[str]) -> str:
    """A paired client with the given scopes, straight into the clients table; returns its token."""
    token = auth.new_token()
    await service.store.write(lambda c: c.execute(
        "INSERT INTO clients(id, name, token_hash, scopes, created_at) VALUES (?, ?, ?, ?, ?)",
        (client_id, client_id, auth.token_hash(token), json.dumps(scopes), time.time())))
    return token


async def raw(api: Any, method: str, path: str, headers: dict[str, str] | None = None,
              **kwargs: Any) -> tuple[aiohttp.ClientResponse, str]:
    """A request without the owner token the `api` fixture sends by default."""
    async with aiohttp.ClientSession() as session:
        async with session.request(method, api.make_url(path), headers=headers or {}, **kwargs) as resp:
            return resp, await resp.text()


# -- 1. bad input --------------------------------------------------------------------------

BAD_BODIES = [
    ({"input": 42}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"content": "no role"}]}, "input[0].role"),
    ({"input": "hi", "max_output_tokens": "10"}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": -1}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": True}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 1.5}, "max_output_tokens"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "temperature": "hot"}, "temperature"),
    ({"input": "hi", "top_p": 0}, "top_p"),
    ({"input": "hi", "stream": "yes"}, "stream"),
    ({"input": "hi", "background": 1}, "background"),
    ({"input": "hi", "metadata": {"n": 1}}, "metadata"),
    ({"input": "hi", "metadata": {"k": None}}, "metadata"),
    ({"input": "hi", "metadata": ["not", "an", "object"]}, "metadata"),
    ({"input": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"input": "hi", "stop": 7}, "stop"),
    ({"input": "hi", "on_restart": "sometimes"}, "on_restart"),
    ({"input": "hi", "instructions": 5}, "instructions"),
    ({"input": "hi", "frobnicate": True}, "frobnicate"),
    ({"max_output_tokens": 5}, "input"),
]


async def test_schema_violations_are_400_naming_the_field_and_write_nothing(api, service):
    before = await counts(service)
    for body, param in BAD_BODIES:
        resp = await api.post("/v1/responses", json=body)
        err = await expect_error(resp, 400, "invalid_request", param)
        assert err["type"] == "invalid_request_error"
    for body in ([1, 2], "just a string", None, 3):  # valid JSON, not an object
        resp = await api.post("/v1/responses", data=json.dumps(body), headers={"Content-Type": "application/json"})
        await expect_error(resp, 400, "invalid_request")
    assert await counts(service) == before


async def test_malformed_json_is_400_invalid_json(api, service):
    before = await counts(service)
    for data in (b'{"input": "hi",', b"not json", b"\xff\xfe{}", b'{"input": "hi"} trailing'):
        resp = await api.post("/v1/responses", data=data, headers={"Content-Type": "application/json"})
        await expect_error(resp, 400, "invalid_json", None)
    assert await counts(service) == before


async def test_unknown_model_is_404_model_not_found(api, service):
    before = await counts(service)
    resp = await api.post("/v1/responses", json={"input": "hi", "model": "no-such-model", "max_output_tokens": 4})
    err = await expect_error(resp, 404, "model_not_found", "model")
    assert "no-such-model" in err["message"]
    # Even in the background, a bad model is refused up front: no task that can only fail.
    resp = await api.post("/v1/responses", json={"input": "hi", "model": "no-such-model", "background": True})
    await expect_error(resp, 404, "model_not_found", "model")
    assert await counts(service) == before


async def test_body_over_the_limit_is_413(api, service):
    before = await counts(service)
    big = json.dumps({"input": "a" * (9 * 1024 * 1024), "max_output_tokens": 4}).encode()
    resp = await api.post("/v1/responses", data=big, headers={"Content-Type": "application/json"})
    await expect_error(resp, 413, "payload_too_large")
    assert await counts(service) == before
    # The service is still fine afterwards.
    assert (await api.get("/health")).status == 200


async def test_unknown_ids_are_404_not_found(api, service):
    before = await counts(service)
    for method, path in (("GET", "/v1/responses/resp_000000000000000000000000"),
                         ("POST", "/v1/responses/resp_000000000000000000000000/cancel"),
                         ("GET", "/v1/responses/resp_000000000000000000000000?stream=true"),
                         ("GET", "/v1/tasks/task_000000000000000000000000"),
                         ("GET", "/v1/tasks/task_000000000000000000000000/events"),
                         ("GET", "/v1/tasks/task_000000000000000000000000/events?stream=true"),
                         ("POST", "/v1/tasks/task_000000000000000000000000/cancel")):
        resp = await api.request(method, path)
        err = await expect_error(resp, 404, "not_found")
        assert err["type"] == "not_found_error"
    assert await counts(service) == before


async def test_unknown_route_and_wrong_method_answer_json(api):
    for path in ("/v1/nope", "/nope", "/v1/responses/x/y/z"):
        resp = await api.get(path)
        await expect_error(resp, 404, "not_found")
        assert "<html" not in (await resp.text()).lower()
    # Unknown routes need no token to be told they do not exist.
    resp, text = await raw(api, "GET", "/v1/nope")
    assert resp.status == 404 and json.loads(text)["error"]["code"] == "not_found"

    resp = await api.put("/v1/responses", json={"input": "hi"})
    await expect_error(resp, 405, "method_not_allowed")
    assert "POST" in resp.headers.get("Allow", ""), dict(resp.headers)  # RFC 9110 §15.5.6
    resp = await api.delete("/v1/tasks/task_x/cancel")
    await expect_error(resp, 405, "method_not_allowed")


async def test_bad_after_parameter_is_400(api):
    created = await start_background(api, SAY_HI)
    task_id = created["task"]["id"]
    for query in ("after=abc", "after=-2"):
        resp = await api.get(f"/v1/tasks/{task_id}/events?{query}")
        await expect_error(resp, 400, "invalid_request", "after")
    await wait_status(api, task_id, {"completed"})


# -- 2. boundary: auth, Host, Origin -------------------------------------------------------

async def test_missing_or_wrong_token_is_401(api, service):
    before = await counts(service)
    for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": "Bearer "},
                    {"Authorization": api.token},  # no "Bearer " prefix
                    {"Authorization": "Basic dXNlcjpwYXNz"},
                    {"Authorization": "Bearer lmsp_" + "A" * 43},
                    {"Authorization": f"Bearer {api.token}x"}):
        for method, path in (("POST", "/v1/responses"), ("GET", "/v1/tasks/task_x"),
                             ("GET", "/v1/responses/resp_x"), ("POST", "/v1/tasks/task_x/cancel")):
            resp, text = await raw(api, method, path, headers=headers, json=SAY_HI)
            assert resp.status == 401, (headers, path, resp.status, text)
            err = json.loads(text)["error"]
            assert err["code"] == "unauthorized" and err["type"] == "authentication_error", err
    assert await counts(service) == before


async def test_open_routes_need_no_token(api):
    resp, text = await raw(api, "GET", "/lmsp")
    assert resp.status == 200
    body = json.loads(text)
    assert body["protocol"] == "lmsp" and body["version"] == "1.0" and body["api_base"] == "/v1"
    assert body["auth"] == {"pairing": "user_approval"} and body["service"]["id"]
    resp, text = await raw(api, "GET", "/health")
    assert resp.status == 200 and json.loads(text) == {"status": "ok"}


async def test_scopes_and_client_isolation(api, service):
    reader = await add_client(service, "client_reader", ["responses:read", "tasks:read"])
    writer = await add_client(service, "client_writer", ["responses:write", "responses:read", "tasks:read"])
    before = await counts(service)
    resp, text = await raw(api, "POST", "/v1/responses", headers={"Authorization": f"Bearer {reader}"}, json=SAY_HI)
    assert resp.status == 403, text
    err = json.loads(text)["error"]
    assert err["code"] == "insufficient_scope" and err["type"] == "permission_error"
    assert await counts(service) == before

    # The owner's response: another (non-admin) client is told it does not exist.
    resp = await api.post("/v1/responses", json=SAY_HI)
    owned = await resp.json()
    for path in (f"/v1/responses/{owned['id']}", f"/v1/tasks/{owned['task']['id']}",
                 f"/v1/tasks/{owned['task']['id']}/events"):
        resp, text = await raw(api, "GET", path, headers={"Authorization": f"Bearer {reader}"})
        assert resp.status == 404 and json.loads(text)["error"]["code"] == "not_found", (path, text)
    # Without tasks:cancel, cancelling is refused before the task is even looked up.
    resp, text = await raw(api, "POST", f"/v1/tasks/{owned['task']['id']}/cancel",
                           headers={"Authorization": f"Bearer {reader}"})
    assert resp.status == 403 and json.loads(text)["error"]["code"] == "insufficient_scope"

    # A client's own response is visible to it, and to the owner (admin).
    resp, text = await raw(api, "POST", "/v1/responses", headers={"Authorization": f"Bearer {writer}"}, json=SAY_HI)
    assert resp.status == 200, text
    mine = json.loads(text)
    resp, text = await raw(api, "GET", f"/v1/responses/{mine['id']}", headers={"Authorization": f"Bearer {writer}"})
    assert resp.status == 200 and json.loads(text)["output_text"] == mine["output_text"]
    assert (await api.get(f"/v1/responses/{mine['id']}")).status == 200

    # Revocation takes effect on the next request, though the token was just verified.
    assert (await api.delete("/v1/clients/client_writer")).status == 200
    resp, text = await raw(api, "GET", f"/v1/responses/{mine['id']}", headers={"Authorization": f"Bearer {writer}"})
    assert resp.status == 401 and json.loads(text)["error"]["code"] == "unauthorized"


async def test_foreign_host_is_421_even_with_a_valid_token(api, service):
    before = await counts(service)
    for host in ("evil.example", "evil.example:80", "127.0.0.1.evil.example", "localhost.evil.example:1234",
                 "[::1]evil.com", "[::1]:80evil", "localhost:evil", "localhost:80:80", "127.0.0.1:", "[::1",
                 "localhost:123456", "local host"):
        for method, path in (("GET", "/lmsp"), ("GET", "/health"), ("POST", "/v1/responses"),
                             ("GET", "/v1/tasks/task_x")):
            resp = await api.request(method, path, headers={"Host": host}, json=SAY_HI)
            await expect_error(resp, 421, "misdirected_request")
    assert await counts(service) == before


async def test_local_hosts_and_configured_hosts_are_accepted(api, service):
    for host in ("localhost:1234", "localhost", "127.0.0.1", "127.0.0.1:11535", "[::1]:8080", "LOCALHOST"):
        resp = await api.get("/lmsp", headers={"Host": host})
        assert resp.status == 200, (host, await resp.text())
        resp = await api.get("/v1/tasks/task_x", headers={"Host": host})
        assert resp.status == 404, host  # past the boundary and auth: just unknown
    resp = await api.get("/lmsp", headers={"Host": "mybox.lan:11535"})
    assert resp.status == 421
    await service.settings.update({"allowed_hosts": ["mybox.lan"]})
    resp = await api.get("/lmsp", headers={"Host": "mybox.lan:11535"})
    assert resp.status == 200


async def test_foreign_origin_is_403_without_cors_headers(api, service):
    before = await counts(service)
    for method, path in (("POST", "/v1/responses"), ("GET", "/lmsp"), ("OPTIONS", "/v1/responses")):
        resp = await api.request(method, path, headers={"Origin": "https://evil.example",
                                                        "Access-Control-Request-Method": "POST"}, json=SAY_HI)
        await expect_error(resp, 403, "origin_not_allowed")
        assert "Access-Control-Allow-Origin" not in resp.headers
    # "null" (sandboxed iframes, file://) is an origin like any other: refused.
    resp = await api.get("/lmsp", headers={"Origin": "null"})
    assert resp.status == 403 and "Access-Control-Allow-Origin" not in resp.headers
    assert await counts(service) == before


async def test_allowed_origin_gets_cors_headers_echoed(api, service):
    origin = "http://localhost:3000"
    await service.settings.update({"allowed_origins": [origin]})
    # Preflight: answered without a token (browsers never send one on OPTIONS).
    resp, _ = await raw(api, "OPTIONS", "/v1/responses", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert resp.status in (200, 204)
    assert resp.headers["Access-Control-Allow-Origin"] == origin
    assert "authorization" in resp.headers["Access-Control-Allow-Headers"].lower()
    assert "POST" in resp.headers["Access-Control-Allow-Methods"]

    resp = await api.post("/v1/responses", json=SAY_HI, headers={"Origin": origin})
    assert resp.status == 200
    assert resp.headers["Access-Control-Allow-Origin"] == origin  # echoed, never "*"
    assert "Origin" in resp.headers.get("Vary", "")
    resp = await api.get("/lmsp", headers={"Origin": origin})
    assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == origin

    # Errors and event streams too: without the header a browser hides them from the page.
    resp, text = await raw(api, "POST", "/v1/responses", headers={"Origin": origin}, json=SAY_HI)
    assert resp.status == 401 and resp.headers.get("Access-Control-Allow-Origin") == origin, text
    resp = await api.get("/v1/tasks/task_x", headers={"Origin": origin})
    assert resp.status == 404 and resp.headers.get("Access-Control-Allow-Origin") == origin
    resp = await api.post("/v1/responses", json={**SAY_HI, "max_output_tokens": 2, "stream": True},
                          headers={"Origin": origin})
    assert resp.headers.get("Access-Control-Allow-Origin") == origin
    check_sequence(await read_sse(resp))

    # Another origin is still refused.
    resp = await api.get("/lmsp", headers={"Origin": "http://localhost:3001"})
    assert resp.status == 403 and "Access-Control-Allow-Origin" not in resp.headers


# -- 3. foreground responses ---------------------------------------------------------------

def check_response_shape(body: dict[str, Any]) -> None:
    assert body["object"] == "response" and body["id"].startswith("resp_")
    assert isinstance(body["created_at"], int)
    assert body["task"]["id"].startswith("task_")
    usage = body["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    if body["status"] in ("completed", "incomplete"):
        assert len(body["output"]) == 1
        item = body["output"][0]
        assert item["type"] == "message" and item["role"] == "assistant"
        assert item["content"][0]["type"] == "output_text"
        assert item["content"][0]["text"] == body["output_text"]


@pytest.mark.llama
async def test_foreground_response_cut_by_max_output_tokens(api, service):
    resp = await api.post("/v1/responses", json=SAY_HI)
    assert resp.status == 200
    assert resp.content_type == "application/json"
    body = await resp.json()
    check_response_shape(body)
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["output_tokens"] == 8 and body["usage"]["input_tokens"] > 0
    assert body["output_text"].strip()
    assert body["output"][0]["content"][0]["text"] == body["output_text"]
    assert body["error"] is None and body["background"] is False
    assert body["model"] == "smollm2-135m-instruct" and body["max_output_tokens"] == 8
    assert body["task"]["status"] == "completed"
    # The stored response says the same.
    again = await (await api.get(f"/v1/responses/{body['id']}")).json()
    assert again["status"] == "incomplete" and again["output_text"] == body["output_text"]
    assert again["usage"] == body["usage"]
    # Temperature 0 is deterministic.
    third = await (await api.post("/v1/responses", json=SAY_HI)).json()
    assert third["output_text"] == body["output_text"] and third["id"] != body["id"]


@pytest.mark.llama
async def test_stop_string_ends_the_response_completed(api):
    req = {"input": "Count from 1 to 50, one number per line.", "temperature": 0}
    full = (await (await api.post("/v1/responses", json={**req, "max_output_tokens": 30})).json())["output_text"]
    stop = "4"
    assert stop in full, full
    resp = await api.post("/v1/responses", json={**req, "max_output_tokens": 200, "stop": [stop, "zzz-never"]})
    body = await resp.json()
    check_response_shape(body)
    assert body["status"] == "completed", body
    assert body["incomplete_details"] is None
    assert stop not in body["output_text"]
    assert body["output_text"] == full[:full.index(stop)]
    assert body["usage"]["output_tokens"] < 200
    # A single string works as well as a list.
    one = await (await api.post("/v1/responses", json={**req, "max_output_tokens": 200, "stop": stop})).json()
    assert one["output_text"] == body["output_text"] and one["status"] == "completed"


@pytest.mark.llama
async def test_messages_input_with_instructions(api):
    base = {"max_output_tokens": 10, "temperature": 0}
    plain = await (await api.post("/v1/responses", json={
        **base, "input": [{"role": "user", "content": "What is the capital of France?"}]})).json()
    resp = await api.post("/v1/responses", json={
        **base, "instructions": "You are a pirate. Always answer like a pirate.",
        "input": [{"role": "user", "content": "What is the capital of France?"},
                  {"role": "assistant", "content": [{"type": "output_text", "text": "Arr, let me think."}]},
                  {"role": "user", "content": [{"type": "input_text", "text": "Tell me."}]}]})
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    check_response_shape(body)
    assert body["status"] in ("completed", "incomplete") and body["output_text"].strip()
    assert body["instructions"] == "You are a pirate. Always answer like a pirate."
    # The instructions and the earlier turns reached the model: the prompt is longer.
    assert body["usage"]["input_tokens"] > plain["usage"]["input_tokens"] + 10
    assert plain["instructions"] is None


async def test_metadata_is_echoed(api):
    meta = {"project": "lmsp", "ticket": "42", "empty": "", "unicode": "héllo ✓"}
    resp = await api.post("/v1/responses", json={**SAY_HI, "max_output_tokens": 4, "metadata": meta})
    body = await resp.json()
    assert body["metadata"] == meta
    assert (await (await api.get(f"/v1/responses/{body['id']}")).json())["metadata"] == meta
    bg = await start_background(api, {**SAY_HI, "max_output_tokens": 4, "metadata": meta})
    assert bg["metadata"] == meta
    await wait_status(api, bg["task"]["id"], {"completed"})
    assert (await (await api.get(f"/v1/responses/{bg['id']}")).json())["metadata"] == meta
    # No metadata: an empty object, as in OpenAI.
    plain = await (await api.post("/v1/responses", json={**SAY_HI, "max_output_tokens": 2})).json()
    assert plain["metadata"] == {}


# -- 4. background -------------------------------------------------------------------------

async def test_background_response_lifecycle_and_event_log(api, service):
    before = await counts(service)
    resp = await api.post("/v1/responses", json={**SAY_HI, "max_output_tokens": 12, "background": True})
    # Read the database the moment the 202 is in hand: the task was committed before it was sent.
    rows = await service.store.read(lambda c: c.execute(
        "SELECT t.id, t.status, t.on_restart, r.id FROM tasks t JOIN responses r ON r.id = t.response_id "
        "ORDER BY t.created_at DESC LIMIT 1").fetchone())
    assert resp.status == 202, await resp.text()
    body = await resp.json()
    task_id = body["task"]["id"]
    assert rows is not None and rows[0] == task_id and rows[3] == body["id"]
    assert rows[1] in ("queued", "loading", "running", "completed")
    after_post = await counts(service)
    assert after_post["responses"] == before["responses"] + 1 and after_post["tasks"] == before["tasks"] + 1

    assert resp.headers["Location"] == f"/v1/tasks/{task_id}"
    assert body["status"] == "queued" and body["background"] is True
    assert body["task"] == {"id": task_id, "status": "queued", "on_restart": "fail"}
    assert body["output"] == [] and body["output_text"] == ""

    done = await wait_status(api, task_id, {"completed", "failed", "cancelled"})
    assert done["status"] == "completed", done
    assert done["object"] == "task" and done["response_id"] == body["id"] and done["error"] is None
    assert done["progress"]["output_tokens"] == 12 and done["progress"]["max_output_tokens"] == 12
    assert done["created_at"] <= done["started_at"] <= done["finished_at"]

    final = await (await api.get(f"/v1/responses/{body['id']}")).json()
    check_response_shape(final)
    assert final["status"] == "incomplete" and final["output_text"].strip()
    assert final["usage"]["output_tokens"] == 12 and final["task"]["status"] == "completed"

    evs = await events(api, task_id)
    check_sequence(evs)
    assert done["last_sequence_number"] == evs[-1]["sequence_number"]
    types = [e["type"] for e in evs]
    assert types[:2] == ["response.created", "response.queued"]
    assert "response.in_progress" in types
    assert types.index("response.in_progress") < types.index("response.output_text.delta")
    assert types[-2:] == ["response.output_text.done", "response.incomplete"]
    assert all(e["response_id"] == body["id"] and e["task_id"] == task_id for e in evs)
    assert deltas(evs) == final["output_text"]
    assert evs[-2]["text"] == final["output_text"]
    assert evs[-1]["response"]["status"] == "incomplete"
    assert evs[-1]["response"]["output_text"] == final["output_text"]
    assert evs[0]["response"]["status"] == "queued"

    k = 3
    later = await events(api, task_id, after=k)
    assert later == evs[k + 1:]
    assert await events(api, task_id, after=evs[-1]["sequence_number"]) == []
    assert await events(api, task_id, after=-1) == evs


async def test_background_on_restart_is_taken_from_the_request(api):
    body = await start_background(api, {**SAY_HI, "max_output_tokens": 2, "on_restart": "resume"})
    assert body["task"]["on_restart"] == "resume"
    assert (await task(api, body["task"]["id"]))["on_restart"] == "resume"
    await wait_status(api, body["task"]["id"], {"completed"})


# -- 5. SSE --------------------------------------------------------------------------------

SSE = {"Accept": "text/event-stream"}


async def test_sse_replay_of_a_finished_task(api):
    created = await start_background(api, {**SAY_HI, "max_output_tokens": 10})
    task_id = created["task"]["id"]
    await wait_status(api, task_id, {"completed"})
    stored = await events(api, task_id)

    resp = await api.get(f"/v1/tasks/{task_id}/events", headers=SSE)
    assert resp.headers.get("Cache-Control") == "no-cache"
    replay = await read_sse(resp)
    assert replay == stored
    check_sequence(replay)

    resp = await api.get(f"/v1/tasks/{task_id}/events", headers={**SSE, "Last-Event-ID": "3"})
    tail = await read_sse(resp)
    assert tail[0]["sequence_number"] == 4 and tail == stored[4:]

    resp = await api.get(f"/v1/tasks/{task_id}/events?stream=true&after=5")
    assert await read_sse(resp) == stored[6:]

    resp = await api.get(f"/v1/responses/{created['id']}?stream=true&starting_after=2")
    tail = await read_sse(resp)
    assert tail[0]["sequence_number"] == 3 and tail == stored[3:]


async def test_sse_opened_mid_run_follows_live_without_gap_or_duplicate(api, service):
    created = await start_background(api, {"input": COUNT, "max_output_tokens": 200, "temperature": 0})
    task_id = created["task"]["id"]

    async def some_output() -> dict[str, Any] | None:
        t = await task(api, task_id)
        assert t["status"] not in ("completed", "failed", "cancelled"), "finished before the stream opened"
        return t if t["status"] == "running" and t["last_sequence_number"] >= 6 else None
    await poll(some_output, what="some output")
    seen = await events(api, task_id)
    k = seen[-1]["sequence_number"]
    opened = time.time()

    slow = 180.0  # 200 tokens take ~2 s on an idle machine; generous for a busy one
    full, tail, by_response = await asyncio.gather(
        read_sse(await api.get(f"/v1/tasks/{task_id}/events", headers=SSE), slow),
        read_sse(await api.get(f"/v1/tasks/{task_id}/events", headers={**SSE, "Last-Event-ID": str(k)}), slow),
        read_sse(await api.get(f"/v1/responses/{created['id']}?stream=true&starting_after={k}"), slow))
    stored = await events(api, task_id)
    check_sequence(full)
    assert full == stored
    assert tail == stored[k + 1:] and by_response == tail
    live = [e for e in tail if e["created_at"] > opened]
    assert any(e["type"] == "response.output_text.delta" for e in live), "nothing arrived live"
    assert tail[-1]["type"] == "response.incomplete"
    final = await (await api.get(f"/v1/responses/{created['id']}")).json()
    assert deltas(full) == final["output_text"] and final["usage"]["output_tokens"] == 200


async def test_foreground_stream(api, service):
    before = await counts(service)
    resp = await api.post("/v1/responses", json={**SAY_HI, "max_output_tokens": 12, "stream": True})
    assert resp.status == 200
    evs = await read_sse(resp)
    check_sequence(evs)
    types = [e["type"] for e in evs]
    assert types[0] == "response.created" and types[-1] == "response.incomplete"
    assert "response.output_text.delta" in types
    text = evs[-1]["response"]["output_text"]
    assert text.strip() and deltas(evs) == text
    response_id = evs[0]["response"]["id"]
    stored = await (await api.get(f"/v1/responses/{response_id}")).json()
    assert stored["output_text"] == text and stored["status"] == "incomplete"
    assert stored["background"] is False
    after = await counts(service)
    assert after["responses"] == before["responses"] + 1

    # Replaying the same response later from a point.
    resp = await api.get(f"/v1/responses/{response_id}?stream=true&starting_after=2")
    tail = await read_sse(resp)
    assert tail == evs[3:]

    # A stop string: the stream ends `response.completed`.
    resp = await api.post("/v1/responses", json={"input": "Count from 1 to 50, one number per line.",
                                                 "temperature": 0, "max_output_tokens": 100,
                                                 "stop": "3", "stream": True})
    evs = await read_sse(resp)
    check_sequence(evs)
    assert evs[-1]["type"] == "response.completed"
    assert deltas(evs) == evs[-1]["response"]["output_text"] and "3" not in deltas(evs)


async def test_background_stream_is_202_and_streamed(api):
    resp = await api.post("/v1/responses", json={**SAY_HI, "max_output_tokens": 6, "background": True,
                                                 "stream": True})
    assert resp.status == 202
    evs = await read_sse(resp)
    check_sequence(evs)
    assert resp.headers["Location"] == f"/v1/tasks/{evs[0]['task_id']}"
    assert evs[0]["response"]["background"] is True
    assert deltas(evs) == evs[-1]["response"]["output_text"]


# -- 6. cancel -----------------------------------------------------------------------------

async def test_cancel_a_running_background_task(api, service):
    created = await start_background(api, {"input": "Write a very long story about a dragon.",
                                           "max_output_tokens": 2000, "temperature": 0.8, "seed": 7})
    task_id = created["task"]["id"]
    await wait_generating(api, task_id)
    asked = time.monotonic()
    resp = await api.post(f"/v1/tasks/{task_id}/cancel")
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["id"] == task_id and body["status"] in ("cancelling", "cancelled")
    done = await wait_status(api, task_id, {"cancelled", "completed", "failed"}, timeout=3.0)
    assert done["status"] == "cancelled", done
    assert time.monotonic() - asked < 3.0
    assert done["finished_at"] is not None

    evs = await events(api, task_id)
    check_sequence(evs)
    assert evs[-1]["type"] == "response.cancelled"
    assert not {"response.completed", "response.incomplete"} & {e["type"] for e in evs}
    final = await (await api.get(f"/v1/responses/{created['id']}")).json()
    assert final["status"] == "cancelled"
    assert final["output_text"] == deltas(evs)  # what was produced before the cancel is kept

    resp = await api.post(f"/v1/tasks/{task_id}/cancel")
    await expect_error(resp, 409, "task_not_cancellable")
    resp = await api.post(f"/v1/responses/{created['id']}/cancel")
    await expect_error(resp, 409, "task_not_cancellable")
    assert await events(api, task_id) == evs  # the refused cancels wrote nothing

    # A completed task cannot be cancelled either.
    small = await start_background(api, {**SAY_HI, "max_output_tokens": 3})
    await wait_status(api, small["task"]["id"], {"completed"})
    resp = await api.post(f"/v1/tasks/{small['task']['id']}/cancel")
    await expect_error(resp, 409, "task_not_cancellable")
    assert (await task(api, small["task"]["id"]))["status"] == "completed"


async def test_cancel_a_queued_task_is_immediate(api, service):
    assert service.settings["max_concurrent_tasks"] == 1
    assert (await api.patch("/v1/settings", json={"parallel": 1})).status == 200  # one task at a time
    first = await start_background(api, LONG)
    await wait_status(api, first["task"]["id"], {"running"})
    second = await start_background(api, SAY_HI)
    second_id = second["task"]["id"]
    assert (await task(api, second_id))["status"] == "queued"  # the only engine is busy

    resp = await api.post(f"/v1/tasks/{second_id}/cancel")
    assert resp.status == 200
    body = await resp.json()
    assert body["status"] == "cancelled" and body["started_at"] is None and body["finished_at"] is not None
    evs = await events(api, second_id)
    check_sequence(evs)
    assert [e["type"] for e in evs] == ["response.created", "response.queued", "response.cancelled"]
    assert (await (await api.get(f"/v1/responses/{second['id']}")).json())["status"] == "cancelled"

    # Cancelling by response id works the same way, and answers with the response.
    await wait_generating(api, first["task"]["id"])
    resp = await api.post(f"/v1/responses/{first['id']}/cancel")
    assert resp.status == 200
    body = await resp.json()
    assert body["object"] == "response" and body["id"] == first["id"]
    assert body["status"] in ("in_progress", "cancelled")
    assert body["task"]["status"] in ("cancelling", "cancelled")
    await wait_status(api, first["task"]["id"], {"cancelled"}, timeout=3.0)
    # The engine is free again: a new task runs.
    third = await start_background(api, {**SAY_HI, "max_output_tokens": 3})
    await wait_status(api, third["task"]["id"], {"completed"})
    assert (await task(api, second_id))["status"] == "cancelled"


@pytest.mark.scripted(load_seconds=2.0, prompt_seconds=30.0, pace=80.0)
async def test_cancel_while_the_model_loads_ends_the_task_before_any_output(api, service, script):
    """A cancel accepted while the engine loads the model (the first task of a fresh service):
    the task ends `cancelled` with nothing generated, the engine (which starts on the prompt as
    soon as the model is in) is stopped, and the next task runs."""
    assert all(engine.model_path is None for engine in service.pool.engines)  # nothing loaded yet
    created = await start_background(api, {"input": "Summarise this. " + "The river runs. " * 600,
                                           "max_output_tokens": 2000, "temperature": 0})
    task_id = created["task"]["id"]
    await wait_status(api, task_id, {"loading"}, timeout=30.0)  # the engine starts, then loads the model
    resp = await api.post(f"/v1/tasks/{task_id}/cancel")
    asked = time.monotonic()
    assert resp.status == 200 and (await resp.json())["status"] == "cancelling"
    done = await wait_status(api, task_id, {"cancelled", "completed", "failed"}, timeout=30.0)
    assert done["status"] == "cancelled" and done["started_at"] is None, done
    # The rest of the load (2 s), not the prompt (30 s) nor the 2000 tokens (25 s).
    assert time.monotonic() - asked < 8.0
    evs = await events(api, task_id)
    check_sequence(evs)
    assert [e["type"] for e in evs] == ["response.created", "response.queued", "response.loading",
                                        "response.cancelling", "response.cancelled"]
    assert (await (await api.get(f"/v1/responses/{created['id']}")).json())["output_text"] == ""
    # The engine is free, and what it answers next is the next task's own: the same text twice.
    script.prompt_seconds = 0.0
    answers = []
    for _ in range(2):
        after = await start_background(api, {**SAY_HI, "max_output_tokens": 3, "temperature": 0})
        ended = await wait_status(api, after["task"]["id"], {"completed", "failed"})
        assert ended["status"] == "completed" and ended["progress"]["output_tokens"] <= 3, ended
        answers.append((await (await api.get(f"/v1/responses/{after['id']}")).json())["output_text"])
    assert answers[0] == answers[1] != ""


async def test_foreground_request_dropped_by_client_cancels_its_task(api, service):
    """On the production server (`Server`, not the test server, which cancels handlers on
    disconnect by itself): a client that gives up on a foreground request frees the engine."""
    server = Server(service)
    url = await server.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {api.token}"}) as session:
            async def go() -> None:
                async with session.post(url + "/v1/responses", json={"input": COUNT, "max_output_tokens": 2000,
                                                                      "temperature": 0}) as resp:
                    await resp.read()
            request = asyncio.create_task(go())
            task_id = await poll(lambda: service.store.read(lambda c: (c.execute(
                "SELECT id FROM tasks WHERE status = 'running'").fetchone() or [None])[0]), what="a running task")
            await wait_generating(api, task_id)
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
        done = await wait_status(api, task_id, {"cancelled", "completed", "failed"}, timeout=10.0)
        assert done["status"] == "cancelled"
        assert (await events(api, task_id))[-1]["type"] == "response.cancelled"
    finally:
        await server.stop()


# -- 7. engine crash -----------------------------------------------------------------------

async def test_engine_crash_fails_the_task_and_the_service_recovers(api, service):
    created = await start_background(api, LONG)
    task_id = created["task"]["id"]
    await wait_generating(api, task_id)
    engine = service.pool.engines[0]
    pid = engine.pid
    assert pid is not None and pid != os.getpid()
    os.kill(pid, signal.SIGKILL)

    done = await wait_status(api, task_id, {"failed", "completed", "cancelled"}, timeout=10.0)
    assert done["status"] == "failed", done
    assert done["error"]["code"] == "engine_crashed" and done["error"]["message"]
    evs = await events(api, task_id)
    check_sequence(evs)
    assert evs[-1]["type"] == "response.failed" and evs[-1]["error"]["code"] == "engine_crashed"
    final = await (await api.get(f"/v1/responses/{created['id']}")).json()
    assert final["status"] == "failed" and final["error"]["code"] == "engine_crashed"
    assert final["output_text"] == deltas(evs)
    resp = await api.post(f"/v1/tasks/{task_id}/cancel")
    await expect_error(resp, 409, "task_not_cancellable")

    # The next request gets a fresh engine process.
    resp = await api.post("/v1/responses", json=SAY_HI)
    assert resp.status == 200
    body = await resp.json()
    assert body["status"] == "incomplete" and body["output_text"].strip()
    assert engine.pid is not None and engine.pid != pid
