"""A generation's transactions: each runs on the writer thread and returns the events it wrote
(None when the task was no longer where the write expected it: a cancel came first)."""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import replace
from typing import Any, NamedTuple

from app.engine.parent.engine import Engine
from app.engine.registry import models
from app.engine.request import Request
from app.errors import LmspError
from app.tasks import calls, machine, output, records
from app.tasks.kinds.generation_job import Chunk, EngineRoom, Prepared
from app.tasks.limits import APP
from app.tasks.machine import RESPONSE
from app.tasks.states import CANCELLED, CANCELLING, COMPLETED, FAILED, LOADING, QUEUED, RUNNING


class Taken(NamedTuple):
    """A task `take` claimed: its client, its model's format (the room's name it runs under), the
    events taking it wrote, what it needs to start, and the local engine it runs on (worked out
    once, here: `Generations.start` uses it)."""
    task_id: str
    app: str  # whose task it is: its client, or the party of a client several apps share (APP)
    name: str
    events: list[machine.Event]
    task: Prepared
    engine: Engine | None


def _prepare(conn: sqlite3.Connection, task_id: str) -> Prepared:
    """Read in the claim's transaction: a trip to a reader thread would add a wake-up to the start.
    The output is read once, with its ids (`one_task` would read its text a second time)."""
    row = dict(records.joined(conn, "t.id = ?", (task_id,))[0])
    ids, text = output.read(conn, task_id)
    request, running = Request.from_json(row["request"]), row["status"] == RUNNING
    try:
        return Prepared(row, request, ids, text, models.usable(conn, row["model_id"]), None, running)
    except LmspError as exc:
        return Prepared(row, request, ids, text, None, exc, running)


def take(conn: sqlite3.Connection, kind: str, room: EngineRoom) -> Taken | None:
    """The next task of `kind` to run in `room` (its names: a local engine `gguf`, `remote`): a
    resumed `running` task first, else a queued one, round-robin by client: the oldest of the
    first client after the last one served (in id order, wrapping around) that has one. A client
    with 50 queued tasks delays another's single task by one task, not 50. A client that holds all
    but one of the shared engine's slots (`room.crowded`) comes after every other: it takes the
    last slot only when no other client's task is there to take it. When the engine offered
    holds the task's model, the task is `running` in the same commit. With no engine free, only
    a task of the model an engine with a slot free runs is taken for it. None when nothing waits."""
    busy, formats = room.busy, room.names
    # A task whose model was deleted is taken as a local one, and fails as such.
    tasks = (f"SELECT t.id, {APP} AS app, COALESCE(m.format, 'gguf') AS format FROM tasks t "
             "JOIN responses r ON r.id = t.response_id LEFT JOIN models m ON m.id = r.model_id "
             f"WHERE t.kind = ? AND COALESCE(m.format, 'gguf') IN ({','.join('?' * len(formats))})")
    args: tuple[Any, ...] = (kind, *formats)
    if room.engine is None and room.holds is not None:
        tasks += " AND (m.format = 'remote' OR (m.path = ? AND m.digest = ?))"
        args += (room.holds.path, room.holds.digest)
    exclude = f" AND t.id NOT IN ({','.join('?' * len(busy))})" if busy else ""
    row = conn.execute(f"{tasks} AND t.status = 'running'{exclude} ORDER BY t.created_at LIMIT 1",
                       (*args, *busy)).fetchone()
    if row is not None:
        task = _prepare(conn, row["id"])
        return Taken(row["id"], row["app"], row["format"], [], task, room.engine_for(_file(task))[0])
    row = conn.execute(f"{tasks} AND t.status = 'queued' ORDER BY {_TURNS} LIMIT 1",
                       (*args, *_turns(room.crowded, room.last_app))).fetchone()
    if row is None:
        return None
    events = machine.transition(conn, row["id"], LOADING, [("response.loading", {"progress": 0.0})])
    assert events is not None
    task = _prepare(conn, row["id"])
    file = _file(task)
    engine, ready = room.engine_for(file)
    if file is not None and file == ready:
        # Nothing to load: the task starts running in this commit, not in one of its own.
        started = start_running(conn, task)
        assert started is not None
        events, task = events + started, replace(task, running=True)
    return Taken(row["id"], row["app"], row["format"], events, task, engine)


def _file(task: Prepared) -> models.Registered | None:
    return models.registered(task.model) if task.model is not None else None


# The order of clients' turns, then each client's tasks oldest first (`_turns` gives its values):
# the crowded clients last, then the others from the first after the last served, wrapping around.
_TURNS = f"{APP} IN (SELECT value FROM json_each(?)), {APP} <= ?, {APP}, t.created_at"


def _turns(crowded: tuple[str, ...], last_app: str) -> tuple[str, str]:
    return json.dumps(crowded), last_app


def queue_order(conn: sqlite3.Connection, kind: str, crowded: tuple[str, ...], last_app: str) -> list[str]:
    """The queued tasks of `kind` in the order `take` would take them: clients in turn (the crowded
    last, the others in id order from the first after `last_app`, wrapping around), each its
    oldest task."""
    queues: dict[str, list[str]] = {}
    for row in conn.execute(f"SELECT t.id, {APP} AS app FROM tasks t JOIN responses r ON r.id = t.response_id "
                            f"WHERE t.kind = ? AND t.status = 'queued' ORDER BY {_TURNS}",
                            (kind, *_turns(crowded, last_app))):
        queues.setdefault(row["app"], []).append(row["id"])
    turns = list(queues.values())
    return [queue[k] for k in range(max(map(len, turns), default=0)) for queue in turns if k < len(queue)]


def waiting(conn: sqlite3.Connection, task_id: str, message: str) -> list[machine.Event] | None:
    return machine.record(conn, task_id, (LOADING,), [("response.loading", {"progress": 0.0, "message": message})])


def reset_output(conn: sqlite3.Connection, task_id: str, resume_mode: str) -> list[machine.Event] | None:
    """A new attempt from nothing, in place: the output goes, and the event says so."""
    task = conn.execute("SELECT status, attempt FROM tasks WHERE id = ?", (task_id,)).fetchone()
    if task["status"] != RUNNING:
        return None
    output.clear(conn, task_id)  # first: the response in the event shows the output as it now is
    return machine.record(conn, task_id, (RUNNING,), [("response.in_progress", {
        "response": RESPONSE, "output_reset": True, "resume_mode": resume_mode})],
        attempt=task["attempt"] + 1, output_tokens=0, tokens_per_second=None)


def start_running(conn: sqlite3.Connection, task: Prepared) -> list[machine.Event] | None:
    # The output message opens before the first delta (calls.message_opened); a function call's
    # item once its name is decoded (calls.CallStream); where functions are offered, either once
    # the answer shows which it is (calls.Offered); after the model's reasoning (calls.Reasoned).
    # A task that gave its slot away (`requeue`) and starts again has it open already, and keeps
    # its first start (a new attempt has neither: recovery's requeue clears its `started_at`).
    row, request = task.row, task.request
    opened = [] if request.call or request.offer is not None or request.reasoning or row["started_at"] is not None \
        else calls.message_opened(calls.message_id(row["response_id"]))
    return machine.transition(conn, row["id"], RUNNING, [
        ("response.loading", {"progress": 1.0}),
        ("response.in_progress", {"response": RESPONSE}),
        *opened,
    ], only_from=(LOADING,), started_at=row["started_at"] or time.time())


def requeue(conn: sqlite3.Connection, task_id: str, held: Chunk) -> list[machine.Event] | None:
    """Back to the queue with its output so far, `held` included, word for word: the task gave its
    slot to another app's (`Generations.make_way`) and, taken again, continues from there."""
    saved = save_output(conn, task_id, held)
    if saved is None:
        return None
    queued = machine.transition(conn, task_id, QUEUED, [("response.queued", {"response": RESPONSE, "preempted": True})],
                                only_from=(RUNNING,), tokens_per_second=None)
    assert queued is not None
    return saved + queued


def waits_for(conn: sqlite3.Connection, kind: str, file: models.Registered, app: str) -> bool:
    """Whether a queued task of `kind` of another app than `app` is for this model file."""
    return conn.execute("SELECT 1 FROM tasks t JOIN responses r ON r.id = t.response_id JOIN models m "
                        f"ON m.id = r.model_id WHERE t.kind = ? AND t.status = 'queued' AND {APP} <> ? "
                        "AND m.path = ? AND m.digest = ? LIMIT 1",
                        (kind, app, file.path, file.digest)).fetchone() is not None


def save_output(conn: sqlite3.Connection, task_id: str, chunk: Chunk) -> list[machine.Event] | None:
    events = machine.record(conn, task_id, (RUNNING,), chunk.events, output_tokens=chunk.output_tokens,
                            tokens_per_second=chunk.tokens_per_second)
    if events is not None and (chunk.ids or chunk.text):
        output.append(conn, task_id, chunk.ids, chunk.text)
    return events


def complete(conn: sqlite3.Connection, task_id: str, last: Chunk, ending: list[calls.Event], reason: str,
              usage: dict[str, Any]) -> list[machine.Event] | None:
    saved = save_output(conn, task_id, last)
    if saved is None:
        return None
    done = machine.transition(
        conn, task_id, COMPLETED,
        [*ending, ("response.incomplete" if reason == "length" else "response.completed", {"response": RESPONSE})],
        finish_reason=reason, input_tokens=usage.get("input_tokens", 0), cached_tokens=usage.get("cached_tokens", 0),
        finished_at=time.time())
    assert done is not None
    return saved + done



def fail(conn: sqlite3.Connection, task_id: str, code: str, message: str) -> list[machine.Event] | None:
    error = {"code": code, "message": message}
    return machine.transition(conn, task_id, FAILED, [("response.failed", {"response": RESPONSE, "error": error})],
                              error_code=code, error_message=message, finished_at=time.time())


def cancelled(conn: sqlite3.Connection, task_id: str) -> list[machine.Event] | None:
    return machine.transition(conn, task_id, CANCELLED, [("response.cancelled", {"response": RESPONSE})],
                              only_from=(CANCELLING,), finished_at=time.time())


def request_cancel(conn: sqlite3.Connection, task_id: str, held: Chunk | None = None) -> list[machine.Event] | None:
    """Accept a cancel atomically: queued ends at once, loading/running go to `cancelling`, after
    the output the task `held` back. None when the task is already finished."""
    saved = (save_output(conn, task_id, held) or []) if held is not None else []
    events = machine.transition(conn, task_id, CANCELLED, [("response.cancelled", {"response": RESPONSE})],
                                only_from=(QUEUED,), finished_at=time.time())
    if events is None:
        events = machine.transition(conn, task_id, CANCELLING, [("response.cancelling", {})])
    return None if events is None else saved + events
