"""`POST /v1/chat/completions` (LMSP §9): the OpenAI chat shape over the same task machinery,
so existing local apps work unchanged. Foreground only: durable work goes through /v1/responses."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from aiohttp import web

from app.core.service import TERMINAL_EVENTS
from app.errors import InvalidRequest, LmspError
from app.server.handlers import cancel_quietly, unless_client_leaves
from app.server.keys import CLIENT, SERVICE
from app.server.middleware import read_json
from app.server.sse import follow
from app.tasks import records

ALLOWED = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
           "stream", "stream_options", "n", "user", "metadata", "store", "frequency_penalty", "presence_penalty",
           "response_format", "tools", "tool_choice", "parallel_tool_calls"}
# Where a Responses field came from in the chat shape, for error messages (`param`).
CHAT_PARAMS = (("text.format.", "response_format.json_schema."), ("text.format", "response_format"),
               (".parameters", ".function.parameters"), (".name", ".function.name"), ("input", "messages"))


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


def _function(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not isinstance(value.get("function"), dict):
        raise InvalidRequest("Expected {\"type\": \"function\", \"function\": {...}}.", param=param)
    return {"type": value.get("type"), **value["function"]}


def _tool_choice(value: Any) -> Any:
    return _function(value, "tool_choice") if isinstance(value, dict) else value


def _input(messages: Any) -> Any:
    """Assistant `tool_calls` and `tool` messages as the Responses input items they stand for."""
    if not isinstance(messages, list):
        return messages
    items: list[Any] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            items.append(msg)
        elif msg.get("role") == "tool":
            items.append({"type": "function_call_output", "call_id": msg.get("tool_call_id"),
                          "output": msg.get("content")})
        elif msg.get("role") == "assistant" and msg.get("tool_calls"):
            if msg.get("content"):
                items.append({"role": "assistant", "content": msg["content"]})
            calls = msg["tool_calls"] if isinstance(msg["tool_calls"], list) else [None]
            for call in calls:
                fn = _function(call, f"messages[{i}].tool_calls")
                items.append({"type": "function_call", "call_id": call.get("id"), "name": fn.get("name"),
                              "arguments": fn.get("arguments")})
        else:
            items.append(msg)
    return items


def chat_param(param: str | None) -> str | None:
    for old, new in CHAT_PARAMS:
        if param is not None and old in param:
            return param.replace(old, new, 1)
    return param


def as_response_request(body: Any) -> dict[str, Any]:
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
    out = {"input": _input(body["messages"]), "stream": False, "background": False}
    if body.get("response_format") is not None:
        out["text"] = _text_format(body["response_format"])
    if body.get("tools") is not None:
        tools = body["tools"]
        out["tools"] = [_function(t, f"tools[{i}]") for i, t in enumerate(tools)] if isinstance(tools, list) else tools
    if body.get("tool_choice") is not None:
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    for src, dst in (("model", "model"), ("temperature", "temperature"), ("top_p", "top_p"), ("seed", "seed"),
                     ("stop", "stop"), ("max_tokens", "max_output_tokens"),
                     ("max_completion_tokens", "max_output_tokens")):
        if body.get(src) is not None:
            out[dst] = body[src]
    return out


def _message(final: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The assistant message of a finished response, and why it finished."""
    finish = "length" if final["status"] == "incomplete" else "stop"
    calls = [item for item in final["output"] if item["type"] == "function_call"]
    if not calls:
        return {"role": "assistant", "content": final["output_text"]}, finish
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": c["call_id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls]}, "tool_calls" if finish == "stop" else finish


def _chunk(ident: str, model: str, created: int, delta: dict[str, Any], finish: str | None) -> bytes:
    body = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    client = request[CLIENT]
    body = await read_json(request)
    try:
        created = await service.create_response(client, as_response_request(body), path="/v1/chat/completions")
    except LmspError as exc:
        exc.param = chat_param(exc.param)
        raise
    response = created.body
    task_id = response["task"]["id"]
    ident = "chatcmpl-" + response["id"][5:]
    try:
        if not body.get("stream"):
            final = records.response_object(await unless_client_leaves(request, service.wait(task_id)))
            if final["status"] == "failed":
                error = final["error"] or {}
                raise InvalidRequest(error.get("message", "Generation failed."), code=error.get("code", "failed"))
            usage = final["usage"]
            message, finish = _message(final)
            return web.json_response({
                "id": ident, "object": "chat.completion", "created": response["created_at"], "model": final["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": {"prompt_tokens": usage["input_tokens"], "completion_tokens": usage["output_tokens"],
                          "total_tokens": usage["total_tokens"]}})
        return await _stream(request, service, task_id, ident, response)
    except (ConnectionResetError, asyncio.CancelledError):
        await cancel_quietly(service, client, task_id)
        raise


async def _stream(request: web.Request, service: Any, task_id: str, ident: str,
                  response: dict[str, Any]) -> web.StreamResponse:
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"})
    model, created = response["model"], response["created_at"]
    await out.prepare(request)
    await out.write(_chunk(ident, model, created, {"role": "assistant", "content": ""}, None))
    called = False
    async with contextlib.aclosing(follow(service, task_id, -1)) as events:
        async for event in events:
            if event is None:  # silence: chat streams send no heartbeat
                continue
            kind = event["type"]
            if kind == "response.output_text.delta":
                await out.write(_chunk(ident, model, created, {"content": event["delta"]}, None))
            elif kind == "response.output_item.added" and event["item"]["type"] == "function_call":
                called, item = True, event["item"]
                call = {"index": 0, "id": item["call_id"], "type": "function",
                        "function": {"name": item["name"], "arguments": ""}}
                await out.write(_chunk(ident, model, created, {"tool_calls": [call]}, None))
            elif kind == "response.function_call_arguments.delta":
                call = {"index": 0, "function": {"arguments": event["delta"]}}
                await out.write(_chunk(ident, model, created, {"tool_calls": [call]}, None))
            elif kind in TERMINAL_EVENTS:
                finish = "length" if kind == "response.incomplete" else ("tool_calls" if called else "stop")
                await out.write(_chunk(ident, model, created, {}, finish))
                await out.write(b"data: [DONE]\n\n")
    return out
