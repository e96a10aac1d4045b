"""How tasks, responses and events look to clients (OpenAI Responses shape + LMSP `task`)."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from app.tasks.states import CANCELLED, COMPLETED, FAILED, QUEUED

# A task with the response it belongs to: the unit every reader works with.
# A download's own columns come along (NULL for a generation).
JOINED = ("SELECT t.*, r.model_id, r.client_id, r.request, r.background, r.metadata, "
          "r.created_at AS response_created_at, d.repo, d.file, d.revision, d.sha256, d.total_bytes, d.bytes, "
          "d.bytes_per_second, d.partial_path, d.model_id AS download_model_id "
          "FROM tasks t JOIN responses r ON r.id = t.response_id LEFT JOIN downloads d ON d.task_id = t.id")


def joined(conn: sqlite3.Connection, where: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
    return conn.execute(f"{JOINED} WHERE {where}", params).fetchall()


def one_task(conn: sqlite3.Connection, task_id: str) -> sqlite3.Row | None:
    rows = joined(conn, "t.id = ?", (task_id,))
    return rows[0] if rows else None


def one_response(conn: sqlite3.Connection, response_id: str) -> sqlite3.Row | None:
    rows = joined(conn, "t.response_id = ?", (response_id,))
    return rows[0] if rows else None


def message_id(response_id: str) -> str:
    """The id of a response's one output message: `msg_` + the random part of `resp_...`."""
    return "msg_" + response_id[5:]


def response_status(row: sqlite3.Row) -> str:
    status = row["status"]
    if status == COMPLETED:
        return "incomplete" if row["finish_reason"] == "length" else "completed"
    if status in (FAILED, CANCELLED, QUEUED):
        return status
    return "in_progress"


def _error(row: sqlite3.Row) -> dict[str, Any] | None:
    if row["error_code"] is None:
        return None
    return {"code": row["error_code"], "message": row["error_message"] or ""}


def task_object(row: sqlite3.Row) -> dict[str, Any]:
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


def response_object(row: sqlite3.Row) -> dict[str, Any]:
    request = json.loads(row["request"])
    status = response_status(row)
    text = row["output_text"]
    done = status in ("completed", "incomplete")
    output = [] if not text and not done else [{
        "type": "message", "id": message_id(row["response_id"]), "role": "assistant",
        "status": "completed" if status == "completed" else ("in_progress" if status == "in_progress" else "incomplete"),
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }]
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
        "instructions": request.get("instructions"), "max_output_tokens": row["max_output_tokens"],
        "temperature": request.get("temperature"), "top_p": request.get("top_p"),
        "tools": [], "tool_choice": "auto", "parallel_tool_calls": False,
        "text": {"format": {"type": "text"}},
        "task": {"id": row["id"], "status": row["status"], "on_restart": row["on_restart"]},
    }


def events_after(conn: sqlite3.Connection, task_id: str, after: int, limit: int = 1000) -> list[dict[str, Any]]:
    rows = conn.execute("SELECT data FROM task_events WHERE task_id = ? AND sequence_number > ? "
                        "ORDER BY sequence_number LIMIT ?", (task_id, after, limit)).fetchall()
    return [json.loads(r["data"]) for r in rows]
