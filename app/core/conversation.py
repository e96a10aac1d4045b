"""Conversation state (LMSP §12): a response that continues an earlier one (`previous_response_id`).

The chain is resolved when a request is accepted, in its write transaction, and the request
stored with the new response holds every message the model will see: the previous response's
history and input (never its `instructions`) and its output, then the new input. Recovery,
`resume` and a later deletion of an ancestor therefore never change a task already accepted,
and the continuation reads one stored request instead of the whole chain.

Only a whole, live chain can be continued: every ancestor must still be stored, belong to the
same client and have completed (`completed` or `incomplete`: an answer cut by
`max_output_tokens` is still an answer). A response still running, failed or cancelled, or one
deleted or purged by retention, anywhere in the chain, is 404 `previous_response_not_found`,
whose message says which and why. A `store: false` response is 400: it is never kept for that.
"""

from __future__ import annotations

import sqlite3
from dataclasses import replace
from typing import Any

from app.engine.request import ChatMessage, Request
from app.errors import InvalidRequest, LmspError
from app.tasks import calls, output, records
from app.tasks.states import COMPLETED

PARAM = "previous_response_id"
MAX_LINKS = 10_000                    # responses in one chain: the walk is bounded whatever is stored
MAX_HISTORY_CHARS = 16 * 1024 * 1024  # what a continuation carries over; the engine's context check refuses far less


def _not_found(message: str) -> LmspError:
    return LmspError("previous_response_not_found", message, param=PARAM, status=404)


def _link(conn: sqlite3.Connection, client_id: str, response_id: str, asked: str) -> sqlite3.Row:
    """One response of the chain, checked: stored, this client's, completed."""
    row: sqlite3.Row | None = conn.execute(
        "SELECT r.client_id, r.store, r.previous_response_id, t.id AS task_id, t.status, t.kind "
        "FROM responses r JOIN tasks t ON t.response_id = r.id WHERE r.id = ?",
        (response_id,)).fetchone()
    where = "" if response_id == asked else f" (an earlier turn of the conversation that {asked!r} continues)"
    if row is None or row["kind"] != "response" or row["client_id"] != client_id:
        # Another client's response looks exactly like one that does not exist.
        raise _not_found(f"No response with id {response_id!r}{where}: it may have been deleted or expired.")
    if row["status"] != COMPLETED:
        raise _not_found(f"The response {response_id!r}{where} is {row['status']}: only a completed response "
                         "can be continued.")
    return row


def history(conn: sqlite3.Connection, client_id: str, previous_id: str) -> list[ChatMessage]:
    """The messages that come before the new input when continuing `previous_id`."""
    row = _link(conn, client_id, previous_id, previous_id)
    if not row["store"]:
        raise InvalidRequest(f"The response {previous_id!r} was created with `store: false`, so it cannot be "
                             "continued.", param=PARAM, code="previous_response_not_stored")
    ancestor, links = row["previous_response_id"], 1
    while ancestor is not None:  # every ancestor must still be there, as when the chain was built
        links += 1
        if links > MAX_LINKS:
            raise InvalidRequest(f"The conversation is longer than {MAX_LINKS} responses.", param=PARAM,
                                 code="conversation_too_long")
        ancestor = _link(conn, client_id, ancestor, previous_id)["previous_response_id"]
    stored = Request.from_json(conn.execute("SELECT request FROM responses WHERE id = ?", (previous_id,)).fetchone()[0])
    # Its answer without the reasoning before it, as thinking models' templates leave that out.
    answer: ChatMessage = {"role": "assistant", "content": calls.answer_of(stored, output.text(conn, row["task_id"]))}
    messages = [*stored.seen(), answer]
    if sum(len(m["content"]) + sum(map(len, m.get("images", []))) for m in messages) > MAX_HISTORY_CHARS:
        raise InvalidRequest(f"The conversation is longer than {MAX_HISTORY_CHARS} characters.", param=PARAM,
                             code="conversation_too_long")
    return messages


def continued(request: Request, earlier: list[ChatMessage]) -> Request:
    """The request with the earlier messages after its instructions, before its input."""
    cut = 0 if request.instructions is None else 1
    messages = request.messages
    return replace(request, messages=[*messages[:cut], *earlier, *messages[cut:]], history=len(earlier))


def input_items(response_id: str, request: Request) -> list[dict[str, Any]]:
    """The input of a response in OpenAI's item shape, oldest first: earlier turns included."""
    base = records.message_id(response_id)
    return [{"id": f"{base}_{i}", "type": "message", "role": m["role"], "status": "completed",
             "content": [*({"type": "input_image", "image_url": url, "detail": "auto"} for url in m.get("images", [])),
                         {"type": "output_text", "text": m["content"], "annotations": []} if m["role"] == "assistant"
                         else {"type": "input_text", "text": m["content"]}]}
            for i, m in enumerate(request.seen())]


def page(items: list[dict[str, Any]], order: str, after: str | None, limit: int) -> dict[str, Any]:
    """OpenAI's list shape for input items: `order` asc|desc, `after` an item id, `limit`."""
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        at = next((i for i, item in enumerate(ordered) if item["id"] == after), None)
        if at is None:
            raise InvalidRequest(f"No input item {after!r} to page after.", param="after")
        ordered = ordered[at + 1:]
    data = ordered[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(ordered) > limit}
