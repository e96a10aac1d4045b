"""A conversation the model's chat template refuses is refused when its request is accepted
(400 `template_error`, the template's own words), before a task exists and whatever engine would
run it: Mistral-Instruct's, Gemma's and Llama 2's templates refuse roles that do not alternate,
Gemma 1/2's any system message. The template is rendered as the engine renders it
(app/engine/template.py), over every message it would see: earlier turns of a conversation
(`previous_response_id`), the functions offered and a forced call's note included. What gets past (a template over
gguf.MAX_TEMPLATE_BYTES, a request stored before this check) fails in the engine alone."""

from __future__ import annotations

import sqlite3
from dataclasses import replace

from app.core import conversation
from app.engine import template
from app.engine.registry import models
from app.engine.registry.gguf import GgufInfo
from app.engine.request import Request
from app.errors import InvalidRequest, LmspError


def subject(conn: sqlite3.Connection, client_id: str, model_id: str,
            request: Request) -> tuple[sqlite3.Row, Request] | None:
    """The local model's row and the request as its engine would get it; None when there is
    nothing to check here (a remote model), or something else is wrong that accepting the
    request says in its own words (no such model, a conversation that cannot be continued).
    InvalidRequest for a prompt without a template (`raw`, `suffix`) to a remote model: its
    endpoint takes chats only."""
    row: sqlite3.Row | None = conn.execute("SELECT * FROM models WHERE id = ?", (model_id,)).fetchone()
    _sees(row, request)
    if row is not None and row["format"] == "remote" and (request.raw or request.suffix is not None):
        name = "raw" if request.raw else "suffix"
        raise InvalidRequest(f"`{name}` needs a local model: a remote endpoint is sent chats.", param=name)
    if row is None or row["format"] == "remote":
        return None
    previous = request.previous_response_id
    if previous is not None:
        try:
            request = conversation.continued(request, conversation.history(conn, client_id, previous))
        except LmspError:
            return None
        _sees(row, request)  # the earlier turns' images too
    return row, request


def _sees(row: sqlite3.Row | None, request: Request) -> None:
    """InvalidRequest when the request shows images to a model that cannot see them: one loaded
    without a vision projector (`models.projector`), or a remote endpoint (it is sent text)."""
    if not request.images or row is None:
        return
    if row["format"] == "remote":
        raise InvalidRequest("Images go only to a local model with a vision projector: a remote endpoint is "
                             "sent text.", param="input", code="unsupported_image")
    if models.registered(row).projector is None:
        raise InvalidRequest(f"The model {row['id']!r} has no vision projector, so it cannot be shown images "
                             "(register it with one: `projector`, or an mmproj-*.gguf beside its file).",
                             param="input", code="unsupported_image")


def check(info: GgufInfo, request: Request) -> Request:
    """InvalidRequest `template_error` if the model's template refuses the request's prompt, and
    for a `suffix` where the model has no fill-in-the-middle tokens; else the request as its
    template reads it: the form the model calls an offered function in (`Request.tool_form`,
    where the template writes functions), how the answer holds its reasoning
    (`Request.reasoning`: not apart where its output is bound to JSON). Costs time linear in
    the conversation: run it off the event loop."""
    if request.suffix is not None and info.fim is None:
        raise InvalidRequest("This model has no fill-in-the-middle tokens, so it cannot fill in text before "
                             "a `suffix`: use a model trained for it (a code model such as Qwen2.5-Coder).",
                             param="suffix", code="unsupported_suffix")
    if request.raw or request.suffix is not None or info.chat_template is None:
        return request
    chat = template.compiled(info.chat_template)
    if request.offer is not None and chat.form is not None:
        request = replace(request, tool_form=chat.form.name)
    try:
        prompt, _ = chat.prompt(request)
    except template.Refused as exc:
        raise InvalidRequest(str(exc), param="input", code="template_error") from exc
    return request if request.constraint is not None else replace(request, reasoning=chat.reasoning(prompt))
