"""What is sent to an upstream and read back (app/engine/net/remote.py sends it): a chat
completion request (OpenAI's API, which every upstream speaks) or a continuation on llama.cpp's
llama-server (`/completion`), and the text, finish reason and usage of each chunk of either
stream."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.engine.request import Request
from app.engine.runs import Generation


def sampling(request: Request) -> dict[str, Any]:
    """The sampling fields of `request`, and `stream`, as both OpenAI's and llama-server's APIs name them."""
    fields: dict[str, Any] = {"temperature": request.temperature, "top_p": request.top_p, "stream": True}
    if request.seed is not None:
        fields["seed"] = request.seed
    if request.stop:
        fields["stop"] = request.stop
    return fields


def chat_request(model: str, gen: Generation) -> dict[str, Any]:
    """The chat completion request for `gen` to the upstream's `model`, from its start, streamed,
    with the usage at the end."""
    body: dict[str, Any] = {"model": model, "messages": gen.request.prompt(),
                            "stream_options": {"include_usage": True}, **sampling(gen.request)}
    if gen.max_tokens is not None:
        body["max_tokens"] = gen.max_tokens
    if gen.request.constraint is not None:
        schema = gen.request.constraint.get("schema")
        body["response_format"] = ({"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
                                   if schema is not None else {"type": "json_object"})
    return body


def read_chat(event: dict[str, Any]) -> tuple[str, str | None, dict[str, Any]]:
    """Text, finish reason and usage of one chunk of an OpenAI chat completion stream."""
    choices = event.get("choices") or [{}]
    text = (choices[0].get("delta") or {}).get("content") or ""
    reason = choices[0].get("finish_reason")
    usage = event.get("usage") or {}
    return text, reason and ("length" if reason == "length" else "stop"), {
        "input_tokens": usage.get("prompt_tokens", 0)} if usage else {}


def read_completion(event: dict[str, Any]) -> tuple[str, str | None, dict[str, Any]]:
    """The same of one chunk of llama-server's own `/completion` stream."""
    if not event.get("stop"):
        return event.get("content") or "", None, {}
    return event.get("content") or "", "length" if event.get("stop_type") == "limit" else "stop", {
        "input_tokens": event.get("tokens_evaluated", 0)}


Reader = Callable[[dict[str, Any]], tuple[str, str | None, dict[str, Any]]]
