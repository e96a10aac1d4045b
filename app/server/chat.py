"""`POST /v1/chat/completions` (LMSP §9): the OpenAI chat shape over the same task machinery,
so existing local apps work unchanged. Foreground only: durable work goes through /v1/responses."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from aiohttp import web

from app.core.service import TERMINAL_EVENTS
from app.errors import InvalidRequest
from app.server.handlers import cancel_quietly, unless_client_leaves
from app.server.keys import CLIENT, SERVICE
from app.server.middleware import read_json
from app.server.sse import follow
from app.tasks import records

ALLOWED = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
           "stream", "stream_options", "n", "user", "metadata", "store", "frequency_penalty", "presence_penalty"}


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
    out = {"input": body["messages"], "stream": False, "background": False}
    for src, dst in (("model", "model"), ("temperature", "temperature"), ("top_p", "top_p"), ("seed", "seed"),
                     ("stop", "stop"), ("max_tokens", "max_output_tokens"),
                     ("max_completion_tokens", "max_output_tokens")):
        if body.get(src) is not None:
            out[dst] = body[src]
    return out


def _finish_reason(row_or_response: dict[str, Any]) -> str:
    return "length" if row_or_response["status"] == "incomplete" else "stop"


def _chunk(ident: str, model: str, created: int, delta: dict[str, Any], finish: str | None) -> bytes:
    body = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    client = request[CLIENT]
    body = await read_json(request)
    created = await service.create_response(client, as_response_request(body), path="/v1/chat/completions")
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
            return web.json_response({
                "id": ident, "object": "chat.completion", "created": response["created_at"], "model": final["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": final["output_text"]},
                             "finish_reason": _finish_reason(final), "logprobs": None}],
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
    async with contextlib.aclosing(follow(service, task_id, -1)) as events:
        async for event in events:
            if event is None:  # silence: chat streams send no heartbeat
                continue
            if event["type"] == "response.output_text.delta":
                await out.write(_chunk(ident, model, created, {"content": event["delta"]}, None))
            elif event["type"] in TERMINAL_EVENTS:
                finish = "length" if event["type"] == "response.incomplete" else "stop"
                await out.write(_chunk(ident, model, created, {}, finish))
                await out.write(b"data: [DONE]\n\n")
    return out
