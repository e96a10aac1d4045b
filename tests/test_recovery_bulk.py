"""Recovery at startup moves every leftover task in a few statements (app/tasks/recovery.py); its
events are the ones machine.transition writes when tasks are moved one by one: every cell of
table 11.3, with and without output, metadata, sampling, a named tool, non-ASCII text, an error
already set, a forced function call (moved one by one), a store: false response."""

from __future__ import annotations

import itertools
import json
import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any

from app.store import db
from app.tasks import machine, output, recovery
from app.tasks.states import CANCELLING, LOADING, QUEUED, RUNNING, UNFINISHED

REQUESTS = [
    {"messages": []},
    {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0.7, "top_p": 0.25,
     "tool_choice": {"type": "function", "name": "f"}},
    {"messages": [{"role": "user", "content": "Call"}], "temperature": 0, "call": True,
     "tools": [{"type": "function", "name": "f", "description": None, "parameters": {"type": "object"},
                "strict": True}],
     "constraint": {"type": "json_schema", "schema": {"type": "object"}}},
]


def leftover(conn: sqlite3.Connection, n: int, state: str, policy: str, request: dict[str, Any], text: str) -> None:
    task_id, response_id = f"task_{n}", f"resp_{n:024d}"
    conn.execute("INSERT INTO responses(id, client_id, model_id, request, background, metadata, created_at, store, "
                 "previous_response_id) VALUES (?, 'client_owner', 'm', ?, ?, ?, ?, ?, ?)",
                 (response_id, json.dumps(request), n % 2, json.dumps({"n": str(n), "ü": "é"}), time.time() + n,
                  n % 3 != 0, None if n % 4 else "resp_before"))
    machine.create(conn, task_id, response_id, policy, 50 if n % 2 else None)
    if state in (LOADING, RUNNING, CANCELLING):
        machine.transition(conn, task_id, LOADING, [("response.loading", {"progress": 0.0})])
    if state in (RUNNING, CANCELLING):
        machine.transition(conn, task_id, RUNNING, [("response.in_progress", {})], started_at=time.time(),
                           tokens_per_second=12.5, error_code="earlier" if n % 5 == 0 else None)
        for chunk in (text[:3], text[3:]) if text else ():
            machine.record(conn, task_id, (RUNNING,), [("response.output_text.delta", {"delta": chunk})],
                           output_tokens=len(chunk))
            output.append(conn, task_id, [1], chunk)
    if state == CANCELLING:
        machine.transition(conn, task_id, CANCELLING, [("response.cancelling", {})])
    if state == QUEUED and text:  # it ran, then gave its slot to another app's task, its output kept
        machine.transition(conn, task_id, LOADING, [("response.loading", {"progress": 0.0})])
        machine.transition(conn, task_id, RUNNING, [("response.in_progress", {})], started_at=time.time())
        machine.record(conn, task_id, (RUNNING,), [("response.output_text.delta", {"delta": text})],
                       output_tokens=len(text))
        output.append(conn, task_id, [1], text)
        machine.transition(conn, task_id, QUEUED, [("response.queued", {"preempted": True})])


def snapshot(path: Path) -> tuple[list[Any], list[Any], list[Any]]:
    conn = sqlite3.connect(path)
    try:
        tasks = conn.execute("SELECT * FROM tasks ORDER BY id").fetchall()
        events = [(task_id, seq, etype, json.loads(data)) for task_id, seq, etype, data in conn.execute(
            "SELECT task_id, sequence_number, type, data FROM task_events ORDER BY task_id, sequence_number")]
        chunks = conn.execute("SELECT * FROM task_output ORDER BY task_id, chunk").fetchall()
        return tasks, events, chunks
    finally:
        conn.close()


def without_times(rows: list[Any], at: tuple[int, ...]) -> list[Any]:
    return [tuple(None if i in at else v for i, v in enumerate(row)) for row in rows]


def test_the_moves_at_once_write_what_the_moves_one_by_one_write(tmp_path: Path) -> None:
    made = db.open_database(tmp_path / "made.sqlite3").conn
    made.execute("BEGIN IMMEDIATE")
    cells = itertools.product(UNFINISHED, ("fail", "retry", "resume"), REQUESTS, ("", "Hello, wörld ✓ \"q\"\n"))
    for n, (state, policy, request, text) in enumerate(cells):
        leftover(made, n, state, policy, request, text if state in (RUNNING, CANCELLING, QUEUED) else "")
    made.execute("COMMIT")
    made.close()
    shutil.copy(tmp_path / "made.sqlite3", tmp_path / "one.sqlite3")
    shutil.copy(tmp_path / "made.sqlite3", tmp_path / "all.sqlite3")

    one = db.open_database(tmp_path / "one.sqlite3").conn
    one.execute("BEGIN IMMEDIATE")
    marks = ",".join("?" * len(UNFINISHED))
    expected = {}
    for task in one.execute(f"SELECT id, status, on_restart, attempt, started_at FROM tasks WHERE status IN ({marks})",
                            UNFINISHED).fetchall():
        move = recovery._move(one, task)
        expected[move] = expected.get(move, 0) + 1
    one.execute("COMMIT")
    one.close()
    every = db.open_database(tmp_path / "all.sqlite3").conn
    every.execute("BEGIN IMMEDIATE")
    counts = recovery.recover(every, "response")
    every.execute("COMMIT")
    every.close()

    assert counts == expected and sum(counts.values()) == len(UNFINISHED) * 3 * len(REQUESTS) * 2
    (tasks_one, events_one, out_one), (tasks_all, events_all, out_all) = (
        snapshot(tmp_path / "one.sqlite3"), snapshot(tmp_path / "all.sqlite3"))
    columns = [c[1] for c in sqlite3.connect(tmp_path / "made.sqlite3").execute("PRAGMA table_info(tasks)")]
    finished = (columns.index("finished_at"),)
    assert without_times(tasks_all, finished) == without_times(tasks_one, finished)
    assert out_all == out_one
    assert len(events_all) == len(events_one)
    for (task_a, seq_a, type_a, data_a), (task_b, seq_b, type_b, data_b) in zip(events_all, events_one):
        assert (task_a, seq_a, type_a) == (task_b, seq_b, type_b)
        assert list(data_a) == list(data_b), "the same keys, in the same order"
        data_a.pop("created_at"), data_b.pop("created_at")
        assert data_a == data_b, (task_a, seq_a)
        if "response" in data_a:
            assert list(data_a["response"]) == list(data_b["response"])
