"""Structured output and function tools in a request (LMSP §12): `text.format`, `tools`,
`tool_choice`, and the `function_call` / `function_call_output` input items.

What comes out is stored with the request: the fields echoed in the response object and, when
the output is constrained, the `constraint` the engine sends llama.cpp as a grammar. A forced
call (`tool_choice` `required` or a named function) is generated as one JSON object
`{"name": ..., "arguments": {...}}` (see app/tasks/calls.py), so a single grammar covers the
choice of function and its arguments. Functions offered (`tool_choice` auto) are the model's to
call or not: the same object, in the form the model's template writes calls
(app/engine/call_forms.py), binds the answer only once it opens as a call (the `offer`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.engine.call_forms import HERMES
from app.engine.constraints.grammar import Converted, too_large
from app.engine.request import TEXT, ChatMessage, Constraint, Format, Schema, Tool, ToolChoice
from app.errors import InvalidRequest, LmspError

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
NO_PARAMETERS: Schema = {"type": "object", "properties": {}, "additionalProperties": False}
# Schemas to grammars: app/engine/constraints/grammar_worker.py, or `grammar.convert_all` where no loop waits.
Convert = Callable[[list[Any]], list[Converted]]


@dataclass(frozen=True)
class Structured:
    """The request's structured-output and tool fields (app/engine/request.py `Request` has them)."""
    format: Format
    tools: list[Tool]
    tool_choice: ToolChoice
    constraint: Constraint | None = None
    call: bool = False
    offer: Constraint | None = None  # the grammar of a call the model may make (`tool_choice` auto)


def _format(text: Any) -> Format:
    if text is None:
        return TEXT
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise InvalidRequest("`text` must be an object with a `format`.", param="text")
    fmt = text.get("format") or TEXT
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {"type": "text"}
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise InvalidRequest("`text.format.type` must be text, json_schema or json_object.", param="text.format.type")
    if not isinstance(fmt.get("name"), str) or not NAME.match(fmt["name"]):
        raise InvalidRequest("`text.format.name` must be 1-64 letters, digits, _ or -.", param="text.format.name")
    if not isinstance(fmt.get("schema"), dict):
        raise InvalidRequest("`text.format.schema` must be a JSON schema object.", param="text.format.schema")
    if not isinstance(fmt.get("strict", False), (bool, type(None))):
        raise InvalidRequest("`text.format.strict` must be true or false.", param="text.format.strict")
    out: Format = {"type": "json_schema", "name": fmt["name"], "schema": fmt["schema"],
                   "strict": bool(fmt.get("strict"))}
    if isinstance(fmt.get("description"), str):
        out["description"] = fmt["description"]
    return out


def chat_tool(value: Any, param: str) -> dict[str, Any]:
    """A tool (or a named tool choice) in the chat shape OpenAI's chat completions and Ollama's API
    share, `{"type": "function", "function": {...}}`, as the Responses API writes it: flat."""
    if not isinstance(value, dict) or not isinstance(value.get("function"), dict):
        raise InvalidRequest("Expected {\"type\": \"function\", \"function\": {...}}.", param=param)
    return {"type": value.get("type"), **value["function"]}


def _tool(tool: Any, param: str) -> Tool:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidRequest("Only function tools (`type: function`) are supported.", param=f"{param}.type")
    if not isinstance(tool.get("name"), str) or not NAME.match(tool["name"]):
        raise InvalidRequest("A function's `name` must be 1-64 letters, digits, _ or -.", param=f"{param}.name")
    parameters = tool.get("parameters")
    if parameters is None:
        parameters = NO_PARAMETERS
    if not isinstance(parameters, dict):
        raise InvalidRequest("`parameters` must be a JSON schema object.", param=f"{param}.parameters")
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequest("`description` must be a string.", param=f"{param}.description")
    return {"type": "function", "name": tool["name"], "description": description, "parameters": parameters,
            "strict": bool(tool.get("strict", True))}


def _tools(value: Any) -> list[Tool]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequest("`tools` must be a list.", param="tools")
    tools = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(value)]
    names = [t["name"] for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("Each function needs its own name.", param="tools")
    return tools


def _choice(value: Any, tools: list[Tool]) -> ToolChoice:
    if value is None or value == "auto":
        return "auto"
    if value == "none":
        return "none"
    if value == "required":
        if not tools:
            raise InvalidRequest("`tool_choice: required` needs at least one tool.", param="tool_choice")
        return "required"
    if isinstance(value, dict) and value.get("type") == "function":
        if not any(t["name"] == value.get("name") for t in tools):
            raise InvalidRequest(f"No function named {value.get('name')!r} in `tools`.", param="tool_choice.name")
        return {"type": "function", "name": value["name"]}
    raise InvalidRequest("`tool_choice` must be auto, none, required or {\"type\": \"function\", \"name\"}.",
                         param="tool_choice")


def call_schema(tools: list[Tool]) -> Schema:
    """One schema for `{"name", "arguments"}` over the given functions. Each function's
    parameters move under `$defs/fn<i>`, their local `$ref`s rewritten to follow them."""
    defs, choices = {}, []
    for i, tool in enumerate(tools):
        defs[f"fn{i}"] = _moved(tool["parameters"], f"#/$defs/fn{i}/")
        choices.append({"type": "object", "properties": {"name": {"const": tool["name"]},
                                                          "arguments": {"$ref": f"#/$defs/fn{i}"}},
                        "required": ["name", "arguments"], "additionalProperties": False})
    return {"$defs": defs, **(choices[0] if len(choices) == 1 else {"anyOf": choices})}


def _moved(node: Any, prefix: str) -> Any:
    if isinstance(node, list):
        return [_moved(x, prefix) for x in node]
    if not isinstance(node, dict):
        return node
    return {k: (prefix + v[2:] if k == "$ref" and isinstance(v, str) and v.startswith("#/") else _moved(v, prefix))
            for k, v in node.items()}


def parse(body: dict[str, Any], convert: Convert) -> Structured:
    """The request's structured-output and tool fields, checked, as stored with it: the grammar
    of its constraint too, converted once here."""
    fmt = _format(body.get("text"))
    tools = _tools(body.get("tools"))
    choice = _choice(body.get("tool_choice"), tools)
    forced = tools if choice == "required" else [t for t in tools if isinstance(choice, dict)
                                                 and t["name"] == choice["name"]]
    schemas = [("text.format.schema", fmt["schema"])] if fmt["type"] == "json_schema" else []
    schemas += [(f"tools[{i}].parameters", tool["parameters"]) for i, tool in enumerate(tools)]
    # Functions offered (`auto`, and no JSON format asked of the answer): a call the model makes
    # is bound by their one schema too.
    offered = tools if choice == "auto" and fmt["type"] == "text" else []
    if forced or offered:  # each function's schema passed alone; together only a clash of `$defs` names could fail
        schemas.append(("tools", call_schema(forced or offered)))
    refusals = [(param, reason) for param, schema in schemas if (reason := too_large(schema))]
    if not refusals:  # a schema past the limits is not sent to the worker (pickling it holds the loop too)
        converted = convert([schema for _, schema in schemas]) if schemas else []
        refusals = [(param, reason) for (param, _), (reason, _) in zip(schemas, converted) if reason]
    if refusals:
        raise LmspError("unsupported_schema", f"This schema cannot be enforced while decoding: {refusals[0][1]}.",
                        param=refusals[0][0], status=400)
    if forced or offered:
        constraint: Constraint = {"type": "json_schema", "schema": schemas[-1][1], "gbnf": converted[-1][1]}
        return Structured(fmt, tools, choice, constraint, call=True) if forced else \
            Structured(fmt, tools, choice, offer=constraint)
    if fmt["type"] == "json_object":
        return Structured(fmt, tools, choice, {"type": "json_object"})
    if fmt["type"] == "json_schema":
        return Structured(fmt, tools, choice, {"type": "json_schema", "schema": fmt["schema"], "gbnf": converted[0][1]})
    return Structured(fmt, tools, choice)


def item_message(item: dict[str, Any], calls: dict[str, str], param: str) -> ChatMessage:
    """A `function_call` or `function_call_output` input item as a chat message. A call reads
    as a model writes one in Hermes' form (app/engine/call_forms.py: a template of another form is
    shown it in its own, `ChatTemplate.prompt`); its result as a user turn naming the function
    (every chat template knows user turns; not all know a `tool` role). `calls`: the calls
    before this item (call_id -> name); a call is added to it."""
    if item["type"] == "function_call":
        name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
        if not isinstance(name, str) or not isinstance(arguments, str) or not isinstance(call_id, str):
            raise InvalidRequest("A function_call item needs `call_id`, `name` and `arguments` (a JSON string).",
                                 param=param)
        calls.setdefault(call_id, name)
        return {"role": "assistant", "content": HERMES.said(name, arguments)[1]}
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str) or not isinstance(output, str):
        raise InvalidRequest("A function_call_output item needs `call_id` and `output` (a string).", param=param)
    name = calls.get(call_id)
    source = f"The function {name}" if name is not None else f"The function call {call_id}"
    return {"role": "user", "content": f"{source} returned: {output}"}


def reasoning(output: list[dict[str, Any]]) -> str | None:
    """The text of a response's `reasoning` item (app/tasks/calls.py), if it has one."""
    found = [item for item in output if item["type"] == "reasoning"]
    return "".join(part["text"] for item in found for part in item["content"]) if found else None
