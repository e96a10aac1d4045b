"""Recovery of generations at startup (LMSP §11.3): the scheduler runs it with the other kinds'
rules (app/tasks/kinds/), before the service accepts or runs anything.

Each leftover task is moved by its `on_restart` policy, its new state and event in one
transaction:

    found \\ policy   fail        retry       resume
    queued           failed      queued      queued
    loading          failed      queued      queued
    running          failed      queued      running (continues from the snapshot)
    cancelling       cancelled   cancelled   cancelled

The same rules move a running task whose engine child died beneath it (`after_engine_death`).
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections import Counter

from app.tasks import machine, output
from app.tasks.machine import RESPONSE
from app.tasks.states import CANCELLED, CANCELLING, FAILED, LOADING, QUEUED, RUNNING, UNFINISHED

log = logging.getLogger(__name__)

RESTARTED = {"code": "server_restarted", "message": "The service restarted while this task was unfinished."}


def target(status: str, policy: str) -> str:
    """The state table 11.3 moves a leftover task to."""
    if status == CANCELLING:
        return CANCELLED
    if policy == "fail":
        return FAILED
    if policy == "resume" and status == RUNNING:
        return RUNNING
    return QUEUED


def _move(conn: sqlite3.Connection, task: sqlite3.Row) -> str:
    status, to = task["status"], target(task["status"], task["on_restart"])
    now = time.time()
    if to == CANCELLED:
        machine.transition(conn, task["id"], CANCELLED, [("response.cancelled", {"response": RESPONSE})],
                           only_from=(CANCELLING,), finished_at=now)
    elif to == FAILED:
        machine.transition(conn, task["id"], FAILED,
                           [("response.failed", {"response": RESPONSE, "error": RESTARTED})],
                           error_code=RESTARTED["code"], error_message=RESTARTED["message"], finished_at=now)
    elif to == QUEUED and status in (LOADING, RUNNING):
        _requeue(conn, task, status)
    # queued stays queued and a resumed running task stays running: no transition to write.
    return f"{status}->{to}"


def _requeue(conn: sqlite3.Connection, task: sqlite3.Row, status: str) -> list[machine.Event] | None:
    """Back to the queue, its output gone; `retry` starts again from nothing: a new attempt, whose
    opening event says so."""
    attempt = task["attempt"] + 1 if task["on_restart"] == "retry" else task["attempt"]
    output.clear(conn, task["id"])
    return machine.transition(conn, task["id"], QUEUED,
                              [("response.queued", {"response": RESPONSE, "output_reset": True})],
                              only_from=(status,), attempt=attempt, output_tokens=0, tokens_per_second=None,
                              started_at=None)


def after_engine_death(conn: sqlite3.Connection, task_id: str) -> list[machine.Event] | None:
    """A running task whose engine child died, by its `on_restart`: `resume` stays running (its
    next run continues from what it wrote), `retry` is queued again from nothing. None: it is to
    fail (`fail`), or it is no longer running (a cancel came)."""
    task = conn.execute("SELECT id, status, on_restart, attempt FROM tasks WHERE id = ?", (task_id,)).fetchone()
    if task is None or task["status"] != RUNNING or task["on_restart"] == "fail":
        return None
    return [] if task["on_restart"] == "resume" else _requeue(conn, task, RUNNING)


def recover(conn: sqlite3.Connection, kind: str) -> dict[str, int]:
    """Apply table 11.3 to every unfinished task of `kind` (the generations': downloads have
    rules of their own, app/tasks/kinds/download.py). Returns counts like {"running->failed": 2}.

    Each task's move is its own savepoint-free statement group inside the caller's
    transaction; the caller runs this on the writer, so all moves commit together."""
    marks = ",".join("?" * len(UNFINISHED))
    leftovers = conn.execute(f"SELECT id, status, on_restart, attempt FROM tasks WHERE status IN ({marks}) "
                             "AND kind = ?", (*UNFINISHED, kind)).fetchall()
    counts = Counter(_move(conn, task) for task in leftovers)
    if leftovers:
        log.info("recovered %d unfinished tasks: %s", len(leftovers), dict(counts))
    return dict(counts)
