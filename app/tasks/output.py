"""A task's output, stored append-only (table `task_output`): one chunk per write, so a write
costs the same whatever the length of what came before it."""

from __future__ import annotations

import json
import sqlite3


def append(conn: sqlite3.Connection, task_id: str, ids: list[int], text: str) -> None:
    conn.execute("INSERT INTO task_output(task_id, chunk, ids, text) "
                 "SELECT ?, COALESCE(MAX(chunk) + 1, 0), ?, ? FROM task_output WHERE task_id = ?",
                 (task_id, json.dumps(ids), text, task_id))


def read(conn: sqlite3.Connection, task_id: str) -> tuple[list[int], str]:
    """The token ids and the text of everything written so far, in order."""
    ids: list[int] = []
    parts: list[str] = []
    for row in conn.execute("SELECT ids, text FROM task_output WHERE task_id = ? ORDER BY chunk", (task_id,)):
        ids += json.loads(row[0])
        parts.append(row[1])
    return ids, "".join(parts)


def text(conn: sqlite3.Connection, task_id: str) -> str:
    rows = conn.execute("SELECT text FROM task_output WHERE task_id = ? ORDER BY chunk", (task_id,))
    return "".join(row[0] for row in rows)


def clear(conn: sqlite3.Connection, task_id: str) -> None:
    """A new attempt starts from nothing (`retry`)."""
    conn.execute("DELETE FROM task_output WHERE task_id = ?", (task_id,))
