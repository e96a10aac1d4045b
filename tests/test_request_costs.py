"""What reading a request may cost (red team 2026-12-05, N2 N3 N5 N14; 2026-12-07, P2): long
inputs are read in linear time and schemas converted in the grammar worker within its budget,
both off the event loop, so /health answers meanwhile; schemas too large, too costly, or that llama.cpp could not
finish are a 400 `unsupported_schema`, not a frozen service or a crashed engine. Real service,
real llama.cpp inference with the default model where the output follows a grammar; scripted
engines (tests/scripted.py) where nothing is decoded under one."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable
from typing import Any

import pytest

from app.core.requests import MAX_ITEMS
from app.core.service import AppService
from app.engine.constraints import grammar
from app.engine.constraints.grammar_worker import BUDGET
from app.errors import InvalidRequest
from app.server import ollama_shapes
from tests.helpers import SAY_HI, bearer, expect_error, pair

pytestmark = pytest.mark.alone  # its bounds are seconds and lag: no other test beside it

LAG = 0.1  # the slowest /health round trip allowed while a costly request is read, in seconds


async def probing(api: Any, request: Awaitable[Any]) -> tuple[Any, float, float]:
    """`request`'s answer, how long it took, and the slowest /health round trip meanwhile (a
    stalled event loop shows there: the probe runs on it, as the server does)."""
    started = time.monotonic()
    pending = asyncio.ensure_future(request)
    worst = 0.0
    while not pending.done():
        t0 = time.monotonic()
        await asyncio.sleep(0.01)
        assert (await api.get("/health")).status == 200
        worst = max(worst, time.monotonic() - t0 - 0.01)
    return await pending, time.monotonic() - started, worst


def posting(api: Any, path: str, body: dict[str, Any]) -> Awaitable[Any]:
    """The request, its body encoded here: the test client runs on the loop measured."""
    return api.post(path, data=json.dumps(body), headers={"Content-Type": "application/json"})


def json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"format": {"type": "json_schema", "name": "x", "schema": schema}}


def string_with(pattern: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"v": {"type": "string", "pattern": pattern}}, "required": ["v"]}


async def nothing_stored(api: Any) -> None:
    assert (await (await api.get("/v1/tasks")).json())["data"] == []


@pytest.mark.scripted  # what is timed is reading or waiting, not decoding: tests/scripted.py
async def test_tool_results_are_read_in_linear_time_off_the_loop(api: Any) -> None:
    # The red team's shape: results whose call is not in the input, so each one looked through
    # every item before it (10,000: 2.3 s on the event loop; 60,000: 115 s).
    results = [{"type": "function_call_output", "call_id": "c", "output": ""}] * MAX_ITEMS
    # `max_output_tokens` is checked after `input`: what is timed is reading the input.
    resp, seconds, lag = await probing(api, posting(api, "/v1/responses", {"input": results,
                                                                                    "max_output_tokens": 0}))
    await expect_error(resp, 400, "invalid_request", "max_output_tokens")
    assert lag <= LAG and seconds < 2, (lag, seconds)
    tool = [{"role": "tool", "tool_call_id": "c", "content": ""}] * MAX_ITEMS
    resp, seconds, lag = await probing(api, posting(api, "/v1/chat/completions", {"messages": tool,
                                                                                           "max_tokens": 0}))
    await expect_error(resp, 400, "invalid_request", "max_tokens")
    assert lag <= LAG and seconds < 2, (lag, seconds)
    # One more is refused by the cap, naming the field the client sent.
    resp = await api.post("/v1/responses", json={"input": results + results[:1], "max_output_tokens": 1})
    assert str(MAX_ITEMS) in (await expect_error(resp, 400, "invalid_request", "input"))["message"]
    resp = await api.post("/v1/chat/completions", json={"messages": tool + tool[:1], "max_tokens": 1})
    await expect_error(resp, 400, "invalid_request", "messages")
    await nothing_stored(api)


def _ollama_chat(calls: list[str], answers: list[str | None]) -> dict[str, Any]:
    """An Ollama chat: one assistant message calling `calls`, then a tool message naming each of
    `answers` (None: one that names no function)."""
    return {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": n}} for n in calls]}]
            + [{"role": "tool", **({"tool_name": n} if n else {}), "content": "ok"} for n in answers]}


def test_ollama_tool_messages_are_matched_in_linear_time_and_capped_before() -> None:
    """Red team 2026-12-07 P2: each tool message looked through every call before its own (8,000
    calls each way took 7.7 s; 14,000, 61 s on both request-reader threads), before the item cap."""
    def translated(body: dict[str, Any]) -> list[dict[str, Any]]:
        return ollama_shapes.chat_request(body, "m")["input"]

    # Earliest unanswered call of the function named, or of any when none is named.
    items = translated(_ollama_chat(["a", "b", "a"], ["a", None, "a"]))
    assert [i["call_id"] for i in items if i["type"] == "function_call_output"] == ["call_0_0", "call_0_1", "call_0_2"]
    for unanswerable in (["c"], ["a", "a", "a"], [None, None, None, None]):
        with pytest.raises(InvalidRequest, match="must answer a tool call"):
            translated(_ollama_chat(["a", "b", "a"], unanswerable))
    # The most the cap lets in, in the red team's shape: half the calls of a function, answered
    # after the other half (quadratic, this took seconds).
    half = MAX_ITEMS // 2
    body = _ollama_chat(["a"] * half + ["b"] * half, ["b"] * half)
    started = time.perf_counter()
    items = translated(body)
    assert time.perf_counter() - started < 0.5
    assert len(items) == MAX_ITEMS + half and items[-1]["call_id"] == f"call_0_{MAX_ITEMS - 1}"
    # Past the cap, refused before any message is read: the messages, their tool calls, the tools.
    for body, what in ((_ollama_chat([], ["a"] * MAX_ITEMS), f"`messages` has {MAX_ITEMS + 1} items"),
                       (_ollama_chat(["a"] * (MAX_ITEMS + 1), []), f"`messages` has {MAX_ITEMS + 1} tool calls"),
                       ({**_ollama_chat([], []), "tools": [{}] * (MAX_ITEMS + 1)}, f"`tools` has {MAX_ITEMS + 1}")):
        started = time.perf_counter()
        with pytest.raises(InvalidRequest, match=what):
            translated(body)
        assert time.perf_counter() - started < 0.1


async def test_a_schema_too_costly_to_convert_is_refused_within_the_budget_off_the_loop(api: Any) -> None:
    # Property names the converter maps to the same rule name: 900 of them took 37 s (cubic).
    colliding = {"type": "object", "properties": {"a" + chr(0x100 + i): {} for i in range(900)}}
    for attempt in range(2):  # the first starts the worker (not counted in the budget); the second finds it killed
        resp, seconds, lag = await probing(api, posting(api, "/v1/responses", {
            "input": "hi", "text": json_schema(colliding)}))
        error = await expect_error(resp, 400, "unsupported_schema", "text.format.schema")
        assert f"longer than {BUDGET:.0f} s" in error["message"]
        assert lag <= LAG and seconds < BUDGET + (30 if attempt == 0 else 5), (lag, seconds)
    # Past the limits it is refused before any conversion: 8,000 required properties took 8 s.
    many = {**colliding, "properties": {f"p{i}": {} for i in range(8000)}}
    many["required"] = list(many["properties"])
    resp, seconds, lag = await probing(api, posting(api, "/v1/responses", {"input": "hi",
                                                                                    "text": json_schema(many)}))
    assert "8000 properties" in (await expect_error(resp, 400, "unsupported_schema"))["message"]
    assert lag <= LAG and seconds < BUDGET, (lag, seconds)
    await nothing_stored(api)
    # The worker is back for the next schema, and the output follows it.
    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
               "additionalProperties": False}
    resp = await api.post("/v1/responses", json={"input": "The weather in Paris, as JSON.", "temperature": 0,
                                                 "max_output_tokens": 40, "text": json_schema(weather)})
    body = await resp.json()
    assert resp.status == 200 and body["status"] == "completed", body
    assert set(json.loads(body["output_text"])) == {"city"}


async def test_enums_past_the_cap_are_refused_and_at_the_cap_a_token_stays_cheap(api: Any) -> None:
    def picking(count: int) -> dict[str, Any]:
        schema = {"type": "object", "properties": {"v": {"enum": [f"v{i:07d}" for i in range(count)]}},
                  "required": ["v"], "additionalProperties": False}
        return {"input": "Pick one value.", "temperature": 0, "max_output_tokens": 40, "text": json_schema(schema)}

    resp = await api.post("/v1/responses", json=picking(grammar.MAX_CHOICES + 1))
    assert f"more than {grammar.MAX_CHOICES}" in (await expect_error(resp, 400, "unsupported_schema"))["message"]
    await api.post("/v1/responses", json=SAY_HI)  # the model loaded, so what is timed next is decoding
    started = time.monotonic()
    resp = await api.post("/v1/responses", json=picking(grammar.MAX_CHOICES))
    seconds = time.monotonic() - started
    body = await resp.json()
    assert resp.status == 200 and body["status"] == "completed", body
    assert json.loads(body["output_text"])["v"] in [f"v{i:07d}" for i in range(grammar.MAX_CHOICES)]
    tokens = body["usage"]["output_tokens"]
    # 25,000 values cost 4 s a token; the cap's, 0.17 s on two cores with a load average of 13.
    print(f"{grammar.MAX_CHOICES} enum values: {tokens} tokens in {seconds:.2f} s")
    assert seconds / tokens < 0.5, (seconds, tokens)


@pytest.mark.scripted  # refused before any engine: tests/scripted.py's, were one asked
@pytest.mark.parametrize("pattern", ["^[^\\s\\S]$", "^\\u0000$", "^[\\x00]$", "^[^\\x00-\\U0010FFFF]$", "^[]$",
                                     "^(a|[^\\x01-\\U0010FFFF])$"])
async def test_a_pattern_no_text_can_match_is_refused(api: Any, pattern: str) -> None:
    # Before: llama.cpp could not parse the first (the engine exited: 500 engine_crashed), aborted
    # on the next three (SIGABRT, the model moved to safe mode), and `[]` gave `{"v": ""}`.
    for schema in (string_with(pattern), {"type": "object", "properties": {"w": string_with(pattern)}}):
        resp = await api.post("/v1/responses", json={"input": "Write v.", "max_output_tokens": 8,
                                                     "text": json_schema(schema)})
        await expect_error(resp, 400, "unsupported_schema", "text.format.schema")
    await nothing_stored(api)


async def test_a_grammar_with_no_way_on_fails_its_task_without_killing_the_engine(
        api: Any, service: AppService, monkeypatch: pytest.MonkeyPatch) -> None:
    # A request stored before these checks existed carries a schema they now refuse: converted
    # here without them, as it was then.
    monkeypatch.setattr(service.grammars, "convert", lambda schemas, app="": [
        (None, grammar.gbnf({"type": "json_schema", "schema": s})) for s in schemas])
    assert (await api.post("/v1/responses", json=SAY_HI)).status == 200
    engine = service.pool.engines[0]
    pid, mode = engine.pid, (await (await api.get("/v1/models/smollm2-135m-instruct")).json())["engine"]
    # Unparsable (the engine exited: 500 engine_crashed), then no token left (llama.cpp aborted).
    for pattern, why in (("^[^\\s\\S]$", "could not parse"), ("^\\u0000$", "no further text")):
        resp = await api.post("/v1/responses", json={"input": "Write v.", "max_output_tokens": 8, "temperature": 0,
                                                     "text": json_schema(string_with(pattern))})
        assert why in (await expect_error(resp, 400, "unsupported_schema"))["message"]
        assert engine.pid == pid and engine.alive  # no abort, no reload
    assert (await (await api.get("/v1/models/smollm2-135m-instruct")).json())["engine"] == mode
    again = await api.post("/v1/responses", json=SAY_HI)
    assert again.status == 200 and (await again.json())["output_text"]


@pytest.mark.scripted  # what is timed is reading or waiting, not decoding: tests/scripted.py
async def test_one_app_s_costly_schemas_hold_up_neither_other_apps_nor_itself_twice(api: Any) -> None:
    """Schemas take their turn in one grammar worker. Eight costly ones sent at once by one app
    (red team, second look: 3.3 s each, budget and restart) made another app's plain 2-token
    request wait 28.6 s. Now an app has one conversion at a time (the next: 429), and the others'
    requests do not queue behind it."""
    greedy, plain = await pair(api, ["responses:write"], "Greedy"), await pair(api, ["responses:write"], "Plain")
    colliding = {"type": "object", "properties": {"a" + chr(0x100 + i): {} for i in range(900)}}
    await api.post("/v1/responses", json=SAY_HI)  # the model is loaded: what is timed below is waiting
    costly = [api.post("/v1/responses", json={"input": "hi", "text": json_schema({**colliding, "title": str(i)})},
                       headers=bearer(greedy[1])) for i in range(8)]
    pending = [asyncio.ensure_future(request) for request in costly]
    await asyncio.sleep(0.5)  # they are in
    started = time.monotonic()
    resp = await api.post("/v1/responses", json={**SAY_HI, "max_output_tokens": 2}, headers=bearer(plain[1]))
    waited = time.monotonic() - started
    assert resp.status == 200, await resp.text()
    answers = await asyncio.gather(*pending)
    assert sorted(answer.status for answer in answers) == [400] + [429] * 7, [answer.status for answer in answers]
    assert all(answer.headers.get("Retry-After") for answer in answers if answer.status == 429)
    # One conversion ahead of it at most (the budget and a worker's restart), not eight.
    assert waited < 2 * BUDGET + 5, waited
