"""Recovery of generations at startup (LMSP §11.3): the scheduler runs it with the other kinds'
rules (app/tasks/kinds/), before the service accepts or runs anything.

Each leftover task is moved by its `on_restart` policy, its new state and event in one
transaction:

    found \\ policy   fail        retry       resume
    queued           failed      queued      queued
    loading          failed      queued      queued
    running          failed      queued      running (continues from the snapshot)
    cancelling       cancelled   cancelled   cancelled

The same rules move a running task whose engine died beneath it (`after_engine_death`).
A queued task that had run (it gave its slot to another app's task, output kept: its
`started_at` says so) is moved as a running one: `retry` starts it again from nothing, `resume`
leaves it queued to continue from its output.

At start they move every leftover at once, in a few statements (`_move_all`): a heavy user's
100 000 unfinished tasks moved one by one took 7 s before the port opened. The events are built
by SQLite's JSON functions as `machine.transition` builds them (tests/test_recovery_bulk.py
compares the two); a forced function call, whose output item only Python parses, moves one by one.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections import Counter, defaultdict

from app.tasks import machine, output
from app.tasks.machine import RESPONSE
from app.tasks.states import CANCELLED, CANCELLING, FAILED, QUEUED, RUNNING, UNFINISHED

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
    elif to == QUEUED and (status != QUEUED or task["on_restart"] == "retry" and task["started_at"] is not None):
        _requeue(conn, task, status)  # from loading or running, or queued after it ran: `retry` starts again
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
    """A running task whose engine died, by its `on_restart`: `resume` stays running (its
    next run continues from what it wrote), `retry` is queued again from nothing. None: it is to
    fail (`fail`), or it is no longer running (a cancel came)."""
    task = conn.execute("SELECT id, status, on_restart, attempt FROM tasks WHERE id = ?", (task_id,)).fetchone()
    if task is None or task["status"] != RUNNING or task["on_restart"] == "fail":
        return None
    return [] if task["on_restart"] == "resume" else _requeue(conn, task, RUNNING)


def recover(conn: sqlite3.Connection, kind: str) -> dict[str, int]:
    """Apply table 11.3 to every unfinished task of `kind` (the generations': downloads have
    rules of their own, app/tasks/kinds/download.py). Returns counts like {"running->failed": 2}.

    The moves are statements inside the caller's transaction; the caller runs this on the
    writer, so all moves commit together."""
    marks = ",".join("?" * len(UNFINISHED))
    counts: Counter[str] = Counter()
    for status, policy, n in conn.execute(f"SELECT status, on_restart, count(*) FROM tasks WHERE status IN ({marks}) "
                                          "AND kind = ? GROUP BY status, on_restart", (*UNFINISHED, kind)):
        counts[f"{status}->{target(status, policy)}"] += n
    _plan(conn, kind)
    # A function call's output item and a model's reasoning are parsed by Python (calls.output):
    # a task whose output is or may hold one (forced, offered, a thinking model's) is moved one by one.
    # The moves first: see _move_all.
    for task in conn.execute("SELECT t.id, t.status, t.on_restart, t.attempt, t.started_at FROM recovery_moves m "
                             "CROSS JOIN tasks t ON t.id = m.task_id CROSS JOIN responses r ON r.id = t.response_id "
                             "WHERE r.request ->> '$.call' OR r.request -> '$.offer' IS NOT NULL "
                             "OR r.request ->> '$.reasoning' <> ''").fetchall():
        conn.execute("DELETE FROM recovery_moves WHERE task_id = ?", (task["id"],))
        _move(conn, task)
    _move_all(conn)
    if counts:
        log.info("recovered %d unfinished tasks: %s", sum(counts.values()), dict(counts))
    return dict(counts)


def _plan(conn: sqlite3.Connection, kind: str) -> None:
    """recovery_moves: each leftover task `target` moves (not those it leaves as they are), to
    what state, with what event, in what attempt."""
    conn.execute("CREATE TEMP TABLE IF NOT EXISTS recovery_moves (task_id TEXT PRIMARY KEY, status TEXT, type TEXT, "
                 "attempt INTEGER, output_text TEXT NOT NULL DEFAULT '', output_tokens INTEGER NOT NULL DEFAULT 0)")
    conn.execute("DELETE FROM recovery_moves")
    conn.execute("""INSERT INTO recovery_moves (task_id, status, type, attempt)
        SELECT id, CASE WHEN status = 'cancelling' THEN 'cancelled' WHEN on_restart = 'fail' THEN 'failed'
                        ELSE 'queued' END AS moved,
               CASE WHEN status = 'cancelling' THEN 'response.cancelled' WHEN on_restart = 'fail' THEN 'response.failed'
                    ELSE 'response.queued' END,
               attempt + (status <> 'cancelling' AND on_restart = 'retry')
        FROM tasks WHERE kind = ? AND (status = 'cancelling' OR on_restart = 'fail' AND status IN ('queued', 'loading',
            'running') OR on_restart = 'retry' AND (status IN ('loading', 'running') OR status = 'queued'
            AND started_at IS NOT NULL) OR on_restart = 'resume' AND status = 'loading')""", (kind,))
# The event of a move, as machine.transition writes it (records.in_event(records.response_object)):
# the same keys in the same order, the output as it stands after the move (none, once requeued).
_EVENT = """json_object(
    'type', m.type, 'sequence_number', t.last_sequence_number + 1, 'task_id', t.id, 'response_id', t.response_id,
    'created_at', json(:now), 'attempt', m.attempt, 'response', json_object(
        'id', t.response_id, 'object', 'response', 'created_at', CAST(r.created_at AS INTEGER), 'status', m.status,
        'model', r.model_id,
        'output', CASE WHEN m.output_text = '' THEN json('[]') ELSE json_array(json_object(
            'type', 'message', 'id', 'msg_' || substr(t.response_id, 6), 'role', 'assistant', 'status', 'incomplete',
            'content', json_array(json_object('type', 'output_text', 'text', m.output_text,
                                              'annotations', json('[]'))))) END,
        'output_text', m.output_text,
        'usage', json_object('input_tokens', t.input_tokens, 'output_tokens', m.output_tokens,
                             'total_tokens', t.input_tokens + m.output_tokens,
                             'input_tokens_details', json_object('cached_tokens', t.cached_tokens),
                             'output_tokens_details', json_object('reasoning_tokens', 0)),
        'error', CASE WHEN m.status = 'failed' THEN json(:error)
                      WHEN t.error_code IS NULL THEN NULL
                      ELSE json_object('code', t.error_code, 'message', coalesce(t.error_message, '')) END,
        'incomplete_details', NULL, 'background', json(iif(r.background, 'true', 'false')),
        'metadata', json(r.metadata), 'previous_response_id', r.previous_response_id,
        'store', json(iif(r.store, 'true', 'false')), 'max_output_tokens', t.max_output_tokens,
        'temperature', json(coalesce(r.request -> '$.temperature', '1.0')),
        'top_p', json(coalesce(r.request -> '$.top_p', '1.0')),
        'tool_choice', json(coalesce(r.request -> '$.tool_choice', '"auto"')), 'parallel_tool_calls', json('false'),
        'task', json_object('id', t.id, 'status', m.status, 'on_restart', t.on_restart)))"""
# ...and the fields after the response: the error of a failed one, the reset of a requeued one.
EVENT_JSON = (f"CASE m.status WHEN 'failed' THEN json_insert({_EVENT}, '$.error', json(:error)) "
              f"WHEN 'queued' THEN json_insert({_EVENT}, '$.output_reset', json('true')) ELSE {_EVENT} END")


def _move_all(conn: sqlite3.Connection) -> None:
    """Each task of recovery_moves: its event appended, its row moved, the output of a requeued one
    deleted. Python only gathers the output texts the events carry."""
    texts: defaultdict[str, list[str]] = defaultdict(list)
    # The moves first (CROSS JOIN keeps SQLite's order): the planner, knowing nothing of the temp
    # table, read the whole task_output table instead, 0.64 s of a 1 GB history at every start.
    for task_id, text in conn.execute("SELECT o.task_id, o.text FROM recovery_moves m CROSS JOIN task_output o "
                                      "ON o.task_id = m.task_id WHERE m.status <> 'queued' "
                                      "ORDER BY o.task_id, o.chunk"):
        texts[task_id].append(text)
    conn.executemany("UPDATE recovery_moves SET output_text = ? WHERE task_id = ?",
                     [("".join(parts), task_id) for task_id, parts in texts.items()])
    conn.execute("UPDATE recovery_moves SET output_tokens = t.output_tokens FROM tasks t "
                 "WHERE t.id = recovery_moves.task_id AND recovery_moves.status <> 'queued'")
    now = time.time()
    error = json.dumps(RESTARTED)
    conn.execute(f"INSERT INTO task_events (task_id, sequence_number, type, data, created_at) "
                 f"SELECT t.id, t.last_sequence_number + 1, m.type, {EVENT_JSON}, :now_real FROM recovery_moves m "
                 "JOIN tasks t ON t.id = m.task_id JOIN responses r ON r.id = t.response_id ORDER BY m.task_id",
                 {"now": json.dumps(now), "now_real": now, "error": error})
    conn.execute("""UPDATE tasks SET status = m.status, attempt = m.attempt,
        last_sequence_number = tasks.last_sequence_number + 1,
        finished_at = iif(m.status = 'queued', tasks.finished_at, :now),
        error_code = iif(m.status = 'failed', :code, tasks.error_code),
        error_message = iif(m.status = 'failed', :message, tasks.error_message),
        output_tokens = iif(m.status = 'queued', 0, tasks.output_tokens),
        tokens_per_second = iif(m.status = 'queued', NULL, tasks.tokens_per_second),
        started_at = iif(m.status = 'queued', NULL, tasks.started_at)
        FROM recovery_moves m WHERE tasks.id = m.task_id""",
                 {"now": now, "code": RESTARTED["code"], "message": RESTARTED["message"]})
    conn.execute("DELETE FROM task_output WHERE task_id IN "
                 "(SELECT task_id FROM recovery_moves WHERE status = 'queued')")
    conn.execute("DELETE FROM recovery_moves")
