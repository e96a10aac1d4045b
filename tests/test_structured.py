"""Structured output and function tools (LMSP §12) against a real headless service and the
default model (SmolLM2-135M), through the official `openai` SDK where a client would use it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from app.store import db
from app.tasks import output
from tests.conftest import Headless, wait_until
from tests.helpers import pair_sync

SCOPES = ["responses:read", "responses:write", "models:read", "tasks:read", "tasks:cancel"]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city now.",
          "parameters": WEATHER, "strict": True},
         {"type": "function", "name": "add", "description": "Add two integers.",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                         "required": ["a", "b"], "additionalProperties": False}}]
CAT = "Describe a cat in JSON with its name and age."  # SmolLM2 closes this object (at temperature 0)
ADD = {k: v for k, v in TOOLS[1].items() if k != "type"}  # the chat shape of a function
CALL_EVENTS = ["response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done"]


class Person(BaseModel):
    # No unbounded list or string: SmolLM2-135M repeats list items at temperature 0, and now and
    # then writes a string that never closes, until the token limit (the output stays valid JSON as
    # far as it goes, but never ends). Which prompt and seed do it changes with the CPU's kernels.
    name: str = Field(max_length=40)
    age: int
    city: str = Field(max_length=40)


class Weather(BaseModel):
    city: str
    unit: str


@pytest.fixture
def sdk(headless: Headless) -> Iterator[openai.OpenAI]:
    headless.start()
    _, token = pair_sync(headless.url, headless.token, SCOPES, "structured-test")
    client = openai.OpenAI(base_url=f"{headless.url}/v1", api_key=token, max_retries=0, timeout=180)
    yield client
    client.close()


def _events(svc: Headless, task_id: str) -> list[dict[str, Any]]:
    return svc.get(f"/v1/tasks/{task_id}/events")[1]["data"]


def _call_order(events: list[dict[str, Any]]) -> list[str]:
    """The event types, a run of argument deltas shown once."""
    kinds = [e["type"] for e in events]
    return [k for i, k in enumerate(kinds) if not (k.endswith("arguments.delta") and kinds[i - 1] == k)]


def test_sdk_parse_helpers_return_parsed_objects_every_time(sdk: openai.OpenAI) -> None:
    # Sampled runs are seeded, so that a failure can be run again as it was.
    prompts = ["Describe a person who likes the sea.", "Make up a character for a story.",
               "Tell me about an old teacher."]
    for i, prompt in enumerate(prompts):
        sampling: dict[str, Any] = {"temperature": 0.7, "extra_body": {"seed": i}} if i else {"temperature": 0}
        parsed = sdk.responses.parse(model="smollm2-135m-instruct", input=prompt, text_format=Person, **sampling)
        assert parsed.status == "completed", parsed
        assert isinstance(parsed.output_parsed, Person), parsed.output_text
        assert parsed.text.format.type == "json_schema" and parsed.text.format.name == "Person"
        chat = sdk.chat.completions.parse(model="smollm2-135m-instruct", response_format=Person,
                                          messages=[{"role": "user", "content": prompt}], **sampling)
        assert chat.choices[0].finish_reason == "stop"
        assert isinstance(chat.choices[0].message.parsed, Person), chat.choices[0].message.content


def test_json_object_always_parses(sdk: openai.OpenAI) -> None:
    for prompt in (CAT, "Say hello."):
        # Temperature 0: any JSON object is a wide grammar, and at 1 the small model can wander for
        # thousands of tokens of nested keys before it closes them (valid, but slow to wait for).
        made = sdk.responses.create(model="smollm2-135m-instruct", input=prompt, temperature=0,
                                    text={"format": {"type": "json_object"}})
        assert made.status == "completed"
        assert isinstance(json.loads(made.output_text), dict), made.output_text
        assert made.text.format.type == "json_object"
    chat = sdk.chat.completions.create(model="smollm2-135m-instruct", response_format={"type": "json_object"},
                                       temperature=0,
                                       messages=[{"role": "user", "content": CAT}])
    assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)


@pytest.mark.parametrize("schema", [{"type": "integer", "minimum": 0}, {"type": "string", "format": "email"},
                                    {"type": "string", "pattern": "abc"}, {"$ref": "https://example.com/s.json"},
                                    {"type": "array", "items": {"type": "string"}, "uniqueItems": True}])
def test_a_schema_the_grammar_cannot_express_is_refused_and_nothing_is_stored(headless: Headless,
                                                                              schema: dict[str, Any]) -> None:
    headless.start()
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {"v": schema},
                                                          "required": ["v"]}}
    status, body = headless.post("/v1/responses", {"input": "hi", "text": {"format": fmt}})
    assert status == 400 and body["error"]["code"] == "unsupported_schema", body
    assert body["error"]["param"] == "text.format.schema"
    status, body = headless.post("/v1/responses", {"input": "hi", "tools": [{**TOOLS[1], "parameters": fmt["schema"]}]})
    assert status == 400 and body["error"] == {**body["error"], "code": "unsupported_schema",
                                               "param": "tools[0].parameters"}
    chat = {"messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": fmt}}
    status, body = headless.post("/v1/chat/completions", chat)
    assert status == 400 and body["error"]["code"] == "unsupported_schema"
    assert body["error"]["param"] == "response_format.json_schema.schema"
    assert headless.get("/v1/tasks")[1]["data"] == []


@pytest.mark.parametrize("parallel", [1, 4])
def test_a_resumed_task_still_ends_with_the_same_valid_json(headless: Headless, parallel: int) -> None:
    """A resumed task's grammar picks up where its committed text left it: the JSON stays valid,
    the committed text is kept word for word and the rest may differ from an uninterrupted run's
    (README, Recovery)."""
    schema = {"type": "object", "properties": {"fruits": {"type": "array", "items": {"type": "string"},
                                                          "minItems": 12, "maxItems": 12}},
              "required": ["fruits"], "additionalProperties": False}
    body = {"input": "Name twelve fruits.", "temperature": 0,
            "text": {"format": {"type": "json_schema", "name": "fruits", "schema": schema, "strict": True}}}
    headless.start()
    assert headless.request("PATCH", "/v1/settings", {"parallel": parallel})[0] == 200
    status, reference = headless.post("/v1/responses", body)
    assert status == 200 and reference["status"] == "completed", reference
    jsonschema.validate(json.loads(reference["output_text"]), schema)
    assert reference["usage"]["output_tokens"] > 30

    status, created = headless.post("/v1/responses", {**body, "background": True, "on_restart": "resume"})
    task_id = created["task"]["id"]
    wait_until(lambda: headless.get(f"/v1/tasks/{task_id}")[1]["progress"]["output_tokens"] >= 15, timeout=60)
    headless.kill()  # SIGKILL mid-generation: the engine child goes with it
    conn = db.open_database(headless.data_dir / "lmsp.sqlite3").conn
    committed = output.read(conn, task_id)[1]  # what the kill left written
    conn.close()
    headless.start()
    final = wait_until(lambda: (r := headless.get(f"/v1/responses/{created['id']}")[1])["status"] == "completed"
                       and r, timeout=120)
    assert len(committed) > 20 and final["output_text"].startswith(committed)
    jsonschema.validate(json.loads(final["output_text"]), schema)
    events = _events(headless, task_id)
    assert {e["attempt"] for e in events} == {1}
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == final["output_text"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"},
                                    {"type": "function", "name": "add"}])
def test_a_forced_call_is_a_function_call_item_whose_arguments_validate(sdk: openai.OpenAI, headless: Headless,
                                                                        choice: Any) -> None:
    stream = sdk.responses.create(model="smollm2-135m-instruct", input="What is the weather in Paris? And 2 + 3?",
                                  tools=TOOLS, tool_choice=choice, stream=True, temperature=0)
    seen = list(stream)
    final = seen[-1].response
    assert seen[-1].type == "response.completed" and final.status == "completed"
    [call] = final.output
    assert call.type == "function_call" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    if isinstance(choice, dict):
        assert call.name == choice["name"]
    tool = next(t for t in TOOLS if t["name"] == call.name)
    jsonschema.validate(json.loads(call.arguments), tool["parameters"])
    # The OpenAI order, the deltas adding up to the arguments, the same item in every place.
    types = [e.type for e in seen]
    calls = [t for t in types if t in CALL_EVENTS]
    assert _call_order([{"type": t} for t in calls]) == CALL_EVENTS, types
    assert types.index("response.in_progress") < types.index("response.output_item.added")
    assert "".join(e.delta for e in seen if e.type == "response.function_call_arguments.delta") == call.arguments
    done = next(e for e in seen if e.type == "response.function_call_arguments.done")
    assert done.arguments == call.arguments and done.item_id == call.id
    assert next(e for e in seen if e.type == "response.output_item.done").item == call
    stored = sdk.responses.retrieve(final.id)
    assert stored.output == final.output and stored.output_text == "" and stored.tool_choice is not None
    # Replayed from the event log, the items are the same.
    task_id = headless.get(f"/v1/responses/{final.id}")[1]["task"]["id"]
    replay = _events(headless, task_id)
    added = next(e for e in replay if e["type"] == "response.output_item.added")["item"]
    assert added == {**call.model_dump(exclude_none=True), "arguments": "", "status": "in_progress"}
    assert next(e for e in replay if e["type"] == "response.output_item.done")["item"] == \
        call.model_dump(exclude_none=True)
    replayed = sdk.responses.retrieve(final.id, stream=True, starting_after=0)
    assert [e.type for e in replayed] == types[1:]


def test_function_call_output_round_trip(sdk: openai.OpenAI) -> None:
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = sdk.responses.create(model="smollm2-135m-instruct", input=[question], tools=TOOLS, temperature=0,
                                 tool_choice={"type": "function", "name": "get_weather"})
    [call] = first.output
    assert call.type == "function_call"
    answer = sdk.responses.create(
        model="smollm2-135m-instruct", tools=TOOLS, max_output_tokens=40, temperature=0,
        input=[question, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}])
    assert answer.status in ("completed", "incomplete")
    assert answer.output[0].type == "message" and answer.output_text.strip()
    # The same, continuing the stored response that made the call instead of repeating it.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}
    continued = sdk.responses.create(model="smollm2-135m-instruct", tools=TOOLS, max_output_tokens=40, temperature=0,
                                     previous_response_id=first.id, input=[result])
    assert continued.output[0].type == "message" and continued.output_text.strip()
    seen = [item.content[0].text for item in sdk.responses.input_items.list(continued.id, order="asc").data]
    assert seen[0] == question["content"] and '"get_weather"' in seen[1]
    assert seen[2].endswith('returned: {"temperature": 21}')
    # A result with no call before it, or a call without its arguments, is refused by name.
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.responses.create(model="smollm2-135m-instruct",
                             input=[question, {"type": "function_call", "call_id": "c1", "name": "get_weather"}])
    assert refused.value.body["param"] == "input[1]"


def test_chat_completions_tool_calls_through_the_sdk(sdk: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"}]
    made = sdk.chat.completions.parse(model="smollm2-135m-instruct", messages=messages, tool_choice="required",
                                      tools=[openai.pydantic_function_tool(Weather, name="get_weather")], temperature=0)
    choice = made.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(call.function.parsed_arguments, Weather)
    # Streamed: the call arrives as tool_calls deltas that add up to the same shape.
    chunks = list(sdk.chat.completions.create(model="smollm2-135m-instruct", messages=messages, stream=True,
                                              tools=[{"type": "function", "function": ADD}], temperature=0,
                                              tool_choice={"type": "function", "function": {"name": "add"}}))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]
    assert deltas[0][0].id.startswith("call_") and deltas[0][0].function.name == "add"
    arguments = "".join(d[0].function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), TOOLS[1]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The answer goes back as a `tool` message after the assistant's tool_calls.
    def answered(content: Any) -> Any:
        return sdk.chat.completions.create(model="smollm2-135m-instruct", max_tokens=30, temperature=0, messages=[
            *messages, {"role": "assistant", "tool_calls": [call.model_dump(include={"id", "type", "function"})]},
            {"role": "tool", "tool_call_id": call.id, "content": content}])

    back = answered("Sunny, 18 degrees.")
    assert back.choices[0].message.content and back.choices[0].finish_reason in ("stop", "length")
    # The result as text parts (as the SDK's types allow) is the same result.
    parts = answered([{"type": "text", "text": "Sunny, "}, {"type": "text", "text": "18 degrees."}])
    assert parts.choices[0].message.content == back.choices[0].message.content
