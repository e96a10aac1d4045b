"""How tasks, responses and events look to clients (OpenAI Responses shape + LMSP `task`)."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Mapping
from typing import Any

from app.engine.request import Request
from app.tasks import calls, output
from app.tasks.states import CANCELLED, COMPLETED, FAILED, QUEUED

# A download's own columns (NULL for a generation), and where every task's columns come from.
_DOWNLOAD = ("d.repo, d.file, d.revision, d.sha256, d.total_bytes, d.bytes, d.bytes_per_second, d.partial_path, "
             "d.model_id AS download_model_id")
_FROM = "FROM tasks t JOIN responses r ON r.id = t.response_id LEFT JOIN downloads d ON d.task_id = t.id"

# A task with the response it belongs to: the unit every reader works with.
JOINED = ("SELECT t.*, r.model_id, r.client_id, r.request, r.background, r.metadata, r.previous_response_id, "
          f"r.store, r.created_at AS response_created_at, {_DOWNLOAD} {_FROM}")


# The same, with only what a task object shows: a listing never loads the request or the output
# text of each task (megabytes each, and never shown in a list).
LISTED = ("SELECT t.id, t.kind, t.status, t.on_restart, t.attempt, t.response_id, t.created_at, t.started_at, "
          "t.finished_at, t.output_tokens, t.max_output_tokens, t.tokens_per_second, t.error_code, "
          f"t.error_message, t.last_sequence_number, r.model_id, r.client_id, {_DOWNLOAD} {_FROM}")


def joined(conn: sqlite3.Connection, where: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
    return conn.execute(f"{JOINED} WHERE {where}", params).fetchall()


def _with_output(conn: sqlite3.Connection, rows: list[sqlite3.Row]) -> dict[str, Any] | None:
    """The one joined row, with the output text its chunks add up to (`response_object` needs it)."""
    return {**dict(rows[0]), "output_text": output.text(conn, rows[0]["id"])} if rows else None


def one_task(conn: sqlite3.Connection, task_id: str) -> dict[str, Any] | None:
    return _with_output(conn, joined(conn, "t.id = ?", (task_id,)))


def one_response(conn: sqlite3.Connection, response_id: str) -> dict[str, Any] | None:
    return _with_output(conn, joined(conn, "t.response_id = ?", (response_id,)))


def one_listed(conn: sqlite3.Connection, column: str, ident: str) -> dict[str, Any] | None:
    """What a task object shows of the task whose `column` (t.id or t.response_id) is `ident`."""
    row = conn.execute(f"{LISTED} WHERE {column} = ?", (ident,)).fetchone()
    return dict(row) if row else None


message_id = calls.message_id


def response_status(row: Mapping[str, Any]) -> str:
    status: str = row["status"]
    if status == COMPLETED:
        return "incomplete" if row["finish_reason"] == "length" else "completed"
    if status in (FAILED, CANCELLED, QUEUED):
        return status
    return "in_progress"


def _error(row: Mapping[str, Any] | sqlite3.Row) -> dict[str, Any] | None:
    if row["error_code"] is None:
        return None
    return {"code": row["error_code"], "message": row["error_message"] or ""}


def task_object(row: Mapping[str, Any] | sqlite3.Row) -> dict[str, Any]:
    download = row["kind"] == "download"
    task = {
        "id": row["id"], "object": "task", "kind": row["kind"], "status": row["status"],
        "on_restart": row["on_restart"], "attempt": row["attempt"],
        "response_id": None if download else row["response_id"], "model": row["model_id"],
        "client_id": row["client_id"],
        "created_at": row["created_at"], "started_at": row["started_at"], "finished_at": row["finished_at"],
        "progress": {"output_tokens": row["output_tokens"], "max_output_tokens": row["max_output_tokens"],
                     "tokens_per_second": row["tokens_per_second"]},
        "error": _error(row), "last_sequence_number": row["last_sequence_number"],
    }
    if download:
        task["progress"] = {"bytes": row["bytes"], "total_bytes": row["total_bytes"],
                            "bytes_per_second": row["bytes_per_second"]}
        task["download"] = {"repo": row["repo"], "file": row["file"], "revision": row["revision"],
                            "sha256": row["sha256"], "model_id": row["download_model_id"]}
    return task


def response_object(row: Mapping[str, Any]) -> dict[str, Any]:
    request = Request.from_json(row["request"])
    status = response_status(row)
    text = row["output_text"]
    done = status in ("completed", "incomplete")
    item_status = "completed" if status == "completed" else ("in_progress" if status == "in_progress" else "incomplete")
    output, text = calls.output(request, row["response_id"], text, item_status, done)
    return {
        "id": row["response_id"], "object": "response", "created_at": int(row["response_created_at"]),
        "status": status, "model": row["model_id"], "output": output, "output_text": text,
        "usage": {"input_tokens": row["input_tokens"], "output_tokens": row["output_tokens"],
                  "total_tokens": row["input_tokens"] + row["output_tokens"],
                  "input_tokens_details": {"cached_tokens": row["cached_tokens"]},
                  "output_tokens_details": {"reasoning_tokens": 0}},
        "error": _error(row),
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "background": bool(row["background"]), "metadata": json.loads(row["metadata"]),
        "previous_response_id": row["previous_response_id"], "store": bool(row["store"]),
        "max_output_tokens": row["max_output_tokens"],
        "temperature": request.temperature, "top_p": request.top_p,
        "tool_choice": request.tool_choice, "parallel_tool_calls": False,
        "task": {"id": row["id"], "status": row["status"], "on_restart": row["on_restart"]},
        **echoed(request),
    }


# What a response echoes of its request, as long as the client made it: megabytes of
# `instructions`, `tools` and `text.format` schema.
ECHOED = ("instructions", "tools", "text")


def echoed(request: Request) -> dict[str, Any]:
    return {"instructions": request.instructions, "tools": request.tools, "text": {"format": request.format}}


def in_event(response: Mapping[str, Any]) -> dict[str, Any]:
    """A response as its lifecycle events carry it: without what it echoes of the request. A task
    has several such events, each stored and replayed to every reader; with the echo, 8 MiB of
    instructions were stored 4 times more per task than the limits counted, and a stream that did
    not read held them all (74 MiB). The response itself (GET /v1/responses/{id}) has them."""
    return {key: value for key, value in response.items() if key not in ECHOED}


class Stored(dict[str, Any]):
    """An event as written in the log, with the JSON text it was written as: a stream sends that
    text as it is, instead of encoding the event again for each reader and each token."""
    text: str

    @classmethod
    def parse(cls, text: str) -> Stored:
        event = cls(json.loads(text))
        event.text = text
        return event


def events_after(conn: sqlite3.Connection, task_id: str, after: int, limit: int = 1000,
                 max_bytes: int | None = None) -> list[Stored]:
    """Up to `limit` events after `after`, and no more after the one that reaches `max_bytes` of
    text (at least one, whatever its size)."""
    page: list[Stored] = []
    size = 0
    with contextlib.closing(conn.execute("SELECT data FROM task_events WHERE task_id = ? AND sequence_number > ? "
                                         "ORDER BY sequence_number LIMIT ?", (task_id, after, limit))) as rows:
        for row in rows:  # read one by one: the rows past the budget are never loaded
            page.append(Stored.parse(row["data"]))
            size += len(row["data"])
            if max_bytes is not None and size >= max_bytes:
                break
    return page
