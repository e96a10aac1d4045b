"""The task detail shows a function call as its name and pretty-printed arguments, and a JSON
result pretty-printed: real widgets, a real service, real inference."""

from __future__ import annotations

import json

import pytest
from gui_helpers import Until

from app.core.auth import Client
from app.gui.session import Session
from app.gui.task_detail import TaskDetail

pytestmark = pytest.mark.gui

ADD = {"type": "function", "name": "add", "description": "Add two integers.",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"], "additionalProperties": False}}


async def _shown(session: Session, owner: Client, until: Until, body: dict) -> tuple[TaskDetail, dict]:
    detail = TaskDetail(session)
    detail.show()
    created = await session.service.responses.create_response(owner, {"background": True, "temperature": 0,
                                                             "max_output_tokens": 200, **body})
    response = created.body
    detail.show_task(await session.service.tasks.task(owner, response["task"]["id"]))
    await until(lambda: any("completed" in detail.log.item(i).text() for i in range(detail.log.count())), 90,
                "task completed")
    return detail, await session.service.responses.response(owner, response["id"])


async def test_a_function_call_shows_its_name_and_pretty_arguments(session: Session, owner: Client,
                                                                   until: Until) -> None:
    detail, final = await _shown(session, owner, until, {"input": "Add 2 and 3.", "tools": [ADD],
                                                             "tool_choice": "required"})
    call = final["output"][0]
    assert call["type"] == "function_call"
    pretty = json.dumps(json.loads(call["arguments"]), indent=2)
    await until(lambda: detail.text.toPlainText() == f"Function call: add\n{pretty}", 10, "the call shown")
    log = [detail.log.item(i).text() for i in range(detail.log.count())]
    assert any("function_call_arguments.delta ×" in line for line in log), log
    assert any("function_call_arguments.done" in line for line in log)


async def test_a_structured_result_is_pretty_printed(session: Session, owner: Client, until: Until) -> None:
    fmt = {"type": "json_schema", "name": "colours", "strict": True,
           "schema": {"type": "object", "properties": {"colours": {"type": "array", "items": {"type": "string"},
                                                                   "minItems": 3, "maxItems": 3}},
                      "required": ["colours"], "additionalProperties": False}}
    detail, final = await _shown(session, owner, until, {"input": "Name three colours.", "text": {"format": fmt}})
    value = json.loads(final["output_text"])
    assert len(value["colours"]) == 3
    await until(lambda: detail.text.toPlainText() == json.dumps(value, indent=2), 10, "pretty result")
    assert detail.text.toPlainText() != final["output_text"]  # not the raw stream: indented
