"""The pieces of structured output that need no model: which schemas the grammar can enforce,
and how a call's text becomes stream events (also after a resume)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from app import paths
from app.core import structured
from app.engine.constraints import grammar
from app.errors import LmspError
from app.tasks.calls import CallStream, item

TEXT = '{"name": "add", "arguments": {"a": 1, "b": {"c": "}{"}} } '
ARGS = '{"a": 1, "b": {"c": "}{"}}'


class Pet(BaseModel):
    kind: str
    legs: int | None = None


class Owner(BaseModel):
    name: str
    pets: list[Pet]


@pytest.mark.parametrize("schema", [Owner.model_json_schema(), Pet.model_json_schema(),
                                    {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}},
                                    {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3},
                                    {"type": ["string", "null"]}, {"enum": ["a", "b"]}, {"type": "object"}])
def test_schemas_the_grammar_enforces_are_accepted(schema: dict[str, Any]) -> None:
    assert grammar.convert(schema)[0] is None
    assert "root ::=" in grammar.gbnf({"type": "json_schema", "schema": schema})


@pytest.mark.parametrize("schema, why", [
    ({"type": "integer", "maximum": 9}, "`maximum`"),
    ({"type": "string", "format": "uri"}, "format 'uri'"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}, "'b'"),
    ({"type": "string", "enum": ["long"], "maxLength": 2}, "`maxLength`"),
    ({"type": "array", "items": {"type": "string"}, "minItems": 10**8}, "from 0 to 1000"),
    ({"type": "string", "pattern": "^x{99999}$"}, "above 1000"),
    ({"type": "string", "pattern": "x"}, "Pattern must start"),
    ({"allOf": [{"type": "string"}]}, "no type"),
    ({"properties": []}, "properties"),
    ({"$defs": [1]}, "well-formed"),
])
def test_what_the_grammar_would_ignore_is_refused_with_the_reason(schema: dict[str, Any], why: str) -> None:
    reason = grammar.convert(schema)[0]
    assert reason is not None and why in reason, reason


def test_json_strings_in_the_grammar_exclude_control_characters() -> None:
    text = grammar.gbnf({"type": "json_schema", "schema": {"type": "string"}})
    assert any(line.startswith('char ::= [^"\\\\\\x7F\\x00-\\x1F] | ') for line in text.splitlines()), text


def test_call_events_stream_the_arguments_whatever_the_chunks() -> None:
    for size in (1, 2, 3, 7, len(TEXT)):
        stream = CallStream("resp_abc")
        events = [e for i in range(0, len(TEXT), size) for e in stream.feed(TEXT[i:i + size])]
        events += stream.done("completed")
        kinds = [kind for kind, _ in events]
        assert kinds[0] == "response.output_item.added" and kinds.count("response.output_item.added") == 1
        assert kinds[-2:] == ["response.function_call_arguments.done", "response.output_item.done"]
        assert "".join(e["delta"] for k, e in events if k.endswith(".delta")) == ARGS
        assert events[0][1]["item"] == {"type": "function_call", "id": "fc_abc", "call_id": "call_abc",
                                        "name": "add", "arguments": "", "status": "in_progress"}
        assert events[-1][1]["item"] == item("resp_abc", TEXT, "completed")
        assert json.loads(events[-1][1]["item"]["arguments"]) == {"a": 1, "b": {"c": "}{"}}


def test_a_resumed_call_stream_carries_on_from_what_was_sent() -> None:
    for cut in range(len(TEXT)):
        before = CallStream("resp_abc")
        sent = before.feed(TEXT[:cut])
        after = CallStream("resp_abc", TEXT[:cut])  # rebuilt from the stored text, as the runner does
        events = sent + after.feed(TEXT[cut:])
        assert [k for k, _ in events].count("response.output_item.added") == 1
        assert "".join(e["delta"] for k, e in events if k.endswith(".delta")) == ARGS


def test_forced_calls_are_one_schema_over_name_and_arguments() -> None:
    tools = [{"type": "function", "name": "owner", "parameters": Owner.model_json_schema()},
             {"type": "function", "name": "ping"}]
    parsed = structured.parse({"tools": tools, "tool_choice": "required"}, grammar.convert_all)
    assert parsed.call and parsed.constraint and grammar.convert(parsed.constraint["schema"])[0] is None
    assert parsed.tools[1]["parameters"] == structured.NO_PARAMETERS
    named = structured.parse({"tools": tools, "tool_choice": {"type": "function", "name": "ping"}}, grammar.convert_all)
    assert named.constraint and named.constraint["schema"]["properties"]["name"] == {"const": "ping"}
    assert structured.parse({"tools": tools, "tool_choice": "auto"}, grammar.convert_all).constraint is None
    with pytest.raises(LmspError) as refused:
        structured.parse({"tools": tools, "tool_choice": {"type": "function", "name": "nope"}}, grammar.convert_all)
    assert refused.value.param == "tool_choice.name"


def test_the_converter_is_found_beside_a_linked_llama_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The venv's `llama-server` (what `make run` and a wheel's install find first) is a link to the
    build: the converter beside the build is found through it."""
    built = paths.llama_server()
    assert built is not None
    link = tmp_path / "bin" / "llama-server"
    link.parent.mkdir()
    link.symlink_to(built.resolve())
    monkeypatch.setenv("LMSP_LLAMA_SERVER", str(link))
    assert grammar._converter.__wrapped__().json_schema_to_gbnf  # type: ignore[attr-defined]
