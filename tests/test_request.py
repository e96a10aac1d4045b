"""A request keeps one form from the parser to the engine: stored as JSON and read back as the
same value; rows stored by earlier versions read too."""

from __future__ import annotations

import json

import pytest

from app.core import conversation, requests
from app.engine.constraints import grammar
from app.engine.request import Request

HI = {"role": "user", "content": "hi"}
# What each earlier version stored for a request: the first one, the one that added structured
# output (grammars not yet converted on arrival), and a continuation.
OLD_ROWS = [
    {"messages": [HI], "instructions": None, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop": []},
    {"messages": [HI], "instructions": None, "temperature": 1.0, "top_p": 1.0, "seed": 7, "stop": ["x"],
     "format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": True},
     "tools": [], "tool_choice": "auto", "constraint": {"type": "json_schema", "schema": {"type": "object"}}},
    {"messages": [{"role": "system", "content": "be"}, HI, {"role": "assistant", "content": "hello"}, HI],
     "instructions": "be", "temperature": 1.0, "top_p": 1.0, "seed": None, "stop": [], "format": {"type": "text"},
     "tools": [], "tool_choice": "auto", "previous_response_id": "resp_1", "history": 2},
]


@pytest.mark.parametrize("row", OLD_ROWS)
def test_rows_stored_by_earlier_versions_read_back(row: dict) -> None:
    request = Request.from_json(json.dumps(row))
    assert request.messages == row["messages"] and request.seed == row["seed"] and request.stop == row["stop"]
    assert request.format == row.get("format", {"type": "text"}) and request.constraint == row.get("constraint")
    assert request.seen() == row["messages"][1 if row["instructions"] else 0:]
    if "format" in row:  # stored again, it is the same text
        assert json.loads(request.to_json()) == row


def test_a_request_is_stored_and_read_back_as_the_same_value() -> None:
    body = {"input": "hi", "instructions": "be", "temperature": 0, "stop": "x", "tool_choice": "required",
            "tools": [{"type": "function", "name": "f", "description": "d"}]}
    request = requests.parse(body, grammar.convert_all).request
    continued = conversation.continued(request, [HI, {"role": "assistant", "content": "hello"}])
    for value in (request, continued):
        assert Request.from_json(value.to_json()) == value
    # Unset, the fields earlier versions left out stay out: every row has one shape.
    plain = json.loads(requests.parse({"input": "hi"}, grammar.convert_all).request.to_json())
    assert list(plain) == ["messages", "instructions", "temperature", "top_p", "seed", "stop", "format", "tools",
                           "tool_choice"]
    assert continued.messages[0]["content"] == "be" and continued.history == 2
    assert continued.prompt()[0]["content"].startswith("be\n\nYou can call these functions: ")


@pytest.mark.parametrize("text", ["[]", '{"messages": [], "colour": "red"}', '{"temperature": "hot"}',
                                  '{"messages": [{"role": "user"}]}'])
def test_a_row_that_is_no_request_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        Request.from_json(text)
