"""The task state machine. Every status change in the app goes through `transition`.

A transition is one conditional UPDATE (`WHERE status IN (...)`) plus its events, each with
the next sequence number, inside the caller's transaction: status and event log can never
disagree (LMSP rule 11.2), and a cancel and a completion cannot both win.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable
from typing import Any

from app.tasks import records
from app.tasks.states import ALLOWED, QUEUED

# Put this value under "response" in an event's fields to embed the response as it stands
# after the update, in the same transaction (as `records.in_event` shows it).
RESPONSE = object()

Event = dict[str, Any]


def _append(conn: sqlite3.Connection, task: sqlite3.Row, seq: int, etype: str,
             fields: dict[str, Any], now: float, attempt: int) -> Event:
    response_id = task["response_id"] if task["kind"] == "response" else None  # a download's request is no response
    event = records.Stored({"type": etype, "sequence_number": seq, "task_id": task["id"],
                            "response_id": response_id, "created_at": now, "attempt": attempt, **fields})
    event.text = json.dumps(event, ensure_ascii=False)
    conn.execute("INSERT INTO task_events(task_id, sequence_number, type, data, created_at) VALUES (?, ?, ?, ?, ?)",
                 (task["id"], seq, etype, event.text, now))
    return event


def transition(conn: sqlite3.Connection, task_id: str, to: str,
               events: Iterable[tuple[str, dict[str, Any]]] = (), *,
               only_from: tuple[str, ...] | None = None, **columns: Any) -> list[Event] | None:
    """Move a task to `to` and append `events`, or return None if its status does not allow it.

    `columns` are other task columns to set in the same UPDATE (snapshot, error, times...).
    """
    sources = only_from or ALLOWED[to]
    assert set(sources) <= set(ALLOWED[to]), f"illegal transition to {to} from {sources}"
    return _update(conn, task_id, sources, list(events), {"status": to, **columns})


def record(conn: sqlite3.Connection, task_id: str, in_states: tuple[str, ...],
           events: Iterable[tuple[str, dict[str, Any]]], **columns: Any) -> list[Event] | None:
    """Append events (and update columns, e.g. the snapshot) without changing the status,
    only while the task is in one of `in_states`."""
    return _update(conn, task_id, in_states, list(events), columns)


def _update(conn: sqlite3.Connection, task_id: str, sources: tuple[str, ...],
            events: list[tuple[str, dict[str, Any]]], columns: dict[str, Any]) -> list[Event] | None:
    now = time.time()
    marks = ",".join("?" * len(sources))
    sets = ", ".join(f"{name} = ?" for name in columns)
    sets = (sets + ", " if sets else "") + "last_sequence_number = last_sequence_number + ?"
    cur = conn.execute(f"UPDATE tasks SET {sets} WHERE id = ? AND status IN ({marks}) "
                       "RETURNING id, kind, response_id, attempt, last_sequence_number",
                       (*columns.values(), len(events), task_id, *sources))
    task = cur.fetchone()
    cur.close()
    if task is None:
        return None
    first = task["last_sequence_number"] - len(events) + 1
    if any(fields.get("response") is RESPONSE for _, fields in events):
        joined = records.one_task(conn, task_id)
        assert joined is not None
        snapshot = records.in_event(records.response_object(joined))
        events = [(etype, {**fields, "response": snapshot} if fields.get("response") is RESPONSE else fields)
                  for etype, fields in events]
    return [_append(conn, task, first + i, etype, fields, now, task["attempt"])
            for i, (etype, fields) in enumerate(events)]


def create(conn: sqlite3.Connection, task_id: str, response_id: str, on_restart: str,
           max_output_tokens: int | None) -> list[Event]:
    """Insert a new queued task with its opening events."""
    conn.execute("INSERT INTO tasks(id, response_id, status, on_restart, created_at, max_output_tokens) "
                 "VALUES (?, ?, 'queued', ?, ?, ?)", (task_id, response_id, on_restart, time.time(), max_output_tokens))
    events = record(conn, task_id, (QUEUED,), [("response.created", {"response": RESPONSE}),
                                               ("response.queued", {"response": RESPONSE})])
    assert events is not None
    return events


def status_of(conn: sqlite3.Connection, task_id: str) -> str | None:
    row = conn.execute("SELECT status FROM tasks WHERE id = ?", (task_id,)).fetchone()
    return row["status"] if row else None
