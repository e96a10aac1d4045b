"""`POST /v1/chat/completions` (LMSP §9): the OpenAI chat shape over the same task machinery,
so existing local apps work unchanged. Foreground only: durable work goes through /v1/responses."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Awaitable
from typing import Any

from aiohttp import web

from app.core.answers import Ask
from app.core.follow import Events
from app.core.requests import text_of
from app.core.structured import chat_tool, reasoning
from app.core.tasks import TERMINAL_EVENTS
from app.errors import Failed, InvalidRequest, LmspError
from app.server import sse
from app.server.handlers import Shape, answer
from app.server.keys import CLIENT, SERVICE
from app.server.middleware import read_json

ALLOWED = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
           "stream", "stream_options", "n", "user", "metadata", "store", "frequency_penalty", "presence_penalty",
           "response_format", "tools", "tool_choice", "parallel_tool_calls", "reasoning_effort"}


def _text_format(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequest("`response_format.type` must be text, json_object or json_schema.",
                             param="response_format")
    if value["type"] != "json_schema":
        return {"format": {"type": value["type"]}}
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest("`response_format.json_schema` must be an object.", param="response_format.json_schema")
    return {"format": {"type": "json_schema", **spec}}


def _tool_choice(value: Any) -> Any:
    return chat_tool(value, "tool_choice") if isinstance(value, dict) else value


def _string(msg: dict[str, Any], field: str, param: str) -> str:
    if not isinstance(msg.get(field), str):
        raise InvalidRequest(f"`{field}` must be a string.", param=f"{param}.{field}")
    return str(msg[field])


def _call(call: Any, param: str) -> dict[str, Any]:
    fn = chat_tool(call, param)
    return {"type": "function_call", "call_id": _string(call, "id", param),
            "name": _string(fn, "name", f"{param}.function"),
            "arguments": _string(fn, "arguments", f"{param}.function")}


def _items(msg: Any, param: str) -> list[Any]:
    """The Responses input items one chat message stands for: an assistant turn with
    `tool_calls` is its text (if any) and a `function_call` per call, a `tool` message a
    `function_call_output` (checked here, so an error names their chat fields); any other
    message is the same item, which the Responses parser checks."""
    if not isinstance(msg, dict):
        return [msg]
    if msg.get("role") == "tool":
        return [{"type": "function_call_output", "call_id": _string(msg, "tool_call_id", param),
                 "output": text_of(msg.get("content"), f"{param}.content")}]
    if msg.get("role") == "assistant" and msg.get("tool_calls"):
        if not isinstance(msg["tool_calls"], list):
            raise InvalidRequest("`tool_calls` must be a list.", param=f"{param}.tool_calls")
        said = [{"role": "assistant", "content": msg["content"]}] if msg.get("content") else []
        return said + [_call(call, f"{param}.tool_calls[{j}]") for j, call in enumerate(msg["tool_calls"])]
    return [msg]


def _input(messages: Any) -> tuple[list[Any], list[int]]:
    """The messages as Responses input items, and for each item the index of its message."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("`messages` must be a non-empty list of messages.", param="messages")
    items: list[Any] = []
    origins: list[int] = []
    for i, msg in enumerate(messages):
        translated = _items(msg, f"messages[{i}]")
        items.extend(translated)
        origins.extend([i] * len(translated))
    return items, origins


class ChatNames:
    """Rewrites an error about the translated request in the terms of the chat request the client
    sent: its `param`, and the field names its message quotes."""

    def __init__(self, body: dict[str, Any], origins: list[int]) -> None:
        tokens = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        self.renames = (("max_output_tokens", tokens), ("text.format.", "response_format.json_schema."),
                        ("text.format", "response_format"), (".parameters", ".function.parameters"),
                        (".name", ".function.name"))
        self.origins = origins

    def name(self, field: str) -> str:
        item = re.match(r"input\[(\d+)\]", field)
        if item and int(item[1]) < len(self.origins):
            return f"messages[{self.origins[int(item[1])]}]{field[item.end():]}"
        if field == "input":
            return "messages"
        for old, new in self.renames:
            if old in field:
                return field.replace(old, new, 1)
        return field

    def __call__(self, exc: LmspError) -> None:
        exc.param = None if exc.param is None else self.name(exc.param)
        exc.message = re.sub(r"`([\w.\[\]]+)`", lambda m: f"`{self.name(m[1])}`", exc.message)


def as_response_request(body: Any) -> tuple[dict[str, Any], ChatNames]:
    """The chat request as a Responses request, and how to name its fields in errors."""
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    for key in body:
        if key not in ALLOWED:
            raise InvalidRequest(f"Unknown parameter {key!r}.", param=key)
    if body.get("n", 1) != 1 or isinstance(body.get("n"), bool):
        raise InvalidRequest("Only n = 1 is supported.", param="n")
    if not isinstance(body.get("stream", False), bool):
        raise InvalidRequest("`stream` must be true or false.", param="stream")
    if "messages" not in body:
        raise InvalidRequest("`messages` is required.", param="messages")
    items, origins = _input(body["messages"])
    out = {"input": items, "stream": False, "background": False}
    if body.get("response_format") is not None:
        out["text"] = _text_format(body["response_format"])
    if body.get("tools") is not None:
        tools = body["tools"]
        out["tools"] = [chat_tool(t, f"tools[{i}]") for i, t in enumerate(tools)] if isinstance(tools, list) else tools
    if body.get("tool_choice") is not None:
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("reasoning_effort") is not None:
        out["reasoning"] = {"effort": body["reasoning_effort"]}
    for src, dst in (("model", "model"), ("temperature", "temperature"), ("top_p", "top_p"), ("seed", "seed"),
                     ("stop", "stop"), ("max_tokens", "max_output_tokens"),
                     ("max_completion_tokens", "max_output_tokens")):
        if body.get(src) is not None:
            out[dst] = body[src]
    return out, ChatNames(body, origins)


def _message(final: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The assistant message of a finished response, and why it finished."""
    finish = "length" if final["status"] == "incomplete" else "stop"
    calls = [item for item in final["output"] if item["type"] == "function_call"]
    thought = reasoning(final["output"])
    said = {} if thought is None else {"reasoning_content": thought}  # as DeepSeek's and llama.cpp's APIs
    if not calls:
        return {"role": "assistant", "content": final["output_text"], **said}, finish
    return {"role": "assistant", "content": None, **said, "tool_calls": [
        {"id": c["call_id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls]}, "tool_calls" if finish == "stop" else finish


def _usage(response: dict[str, Any]) -> dict[str, int]:
    usage = response["usage"]
    return {"prompt_tokens": usage["input_tokens"], "completion_tokens": usage["output_tokens"],
            "total_tokens": usage["total_tokens"]}


def _ident(response: dict[str, Any]) -> str:
    return "chatcmpl-" + response["id"][len("resp_"):]


def _completion(final: dict[str, Any]) -> dict[str, Any]:
    message, finish = _message(final)
    return {"id": _ident(final), "object": "chat.completion", "created": final["created_at"], "model": final["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": _usage(final)}


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool) or any(
            name != "include_usage" for name in options):
        raise InvalidRequest("`stream_options` must be {\"include_usage\": true|false}.", param="stream_options")
    if not body.get("stream"):
        raise InvalidRequest("`stream_options` is only allowed with `stream: true`.", param="stream_options")
    return bool(options.get("include_usage"))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    translated, names = await request.app[SERVICE].off_loop(as_response_request, body)
    usage = _include_usage(body)
    ask = Ask(request[CLIENT], translated, request.headers.get("Idempotency-Key"), bool(body.get("stream")),
              path="/v1/chat/completions", sent=body, rename=names)

    def stream(request: web.Request, response: dict[str, Any], status: int, headers: dict[str, str],
               events: Events) -> Awaitable[web.StreamResponse]:
        return _stream(request, response, headers, events, usage, names)

    return await answer(request, ask, Shape(_completion, stream))


async def _stream(request: web.Request, response: dict[str, Any], headers: dict[str, str], events: Events,
                  include_usage: bool, names: ChatNames) -> web.StreamResponse:
    """The task's events from the start as chat chunks: a live generation, or a replay."""
    ident, model, created = _ident(response), response["model"], response["created_at"]
    extra = {"usage": None} if include_usage else {}  # as OpenAI: every chunk says it, null until the last

    def data(body: dict[str, Any]) -> bytes:
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

    def chunk(delta: dict[str, Any] | None, finish: str | None = None, **fields: Any) -> bytes:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
        return data({"id": ident, "object": "chat.completion.chunk", "created": created, "model": model,
                     "choices": choices, **extra, **fields})

    out = await sse.start(request, headers=headers)
    await out.write(chunk({"role": "assistant", "content": ""}))
    called = False
    async with contextlib.aclosing(events):
        async for event in events:
            if event is None:  # silence: chat streams send no heartbeat
                continue
            kind = event["type"]
            if kind == "response.output_text.delta":
                await out.write(chunk({"content": event["delta"]}))
            elif kind == "response.reasoning_text.delta":
                await out.write(chunk({"reasoning_content": event["delta"]}))
            elif kind == "response.output_item.added" and event["item"]["type"] == "function_call":
                called, item = True, event["item"]
                call = {"index": 0, "id": item["call_id"], "type": "function",
                        "function": {"name": item["name"], "arguments": ""}}
                await out.write(chunk({"tool_calls": [call]}))
            elif kind == "response.function_call_arguments.delta":
                await out.write(chunk({"tool_calls": [{"index": 0, "function": {"arguments": event["delta"]}}]}))
            elif kind == "response.failed":  # the openai SDK raises an APIError for a chunk like this
                error = Failed(**event["response"]["error"])
                names(error)
                await out.write(data(error.body()))
            elif kind in TERMINAL_EVENTS:
                finish = "length" if kind == "response.incomplete" else ("tool_calls" if called else "stop")
                await out.write(chunk({}, finish))
                if include_usage:
                    await out.write(chunk(None, usage=_usage(event["response"])))
            if kind in TERMINAL_EVENTS:
                await out.write(b"data: [DONE]\n\n")
    return out
