"""Output as it is decoded (tests/bench/test_streaming.py times how soon a live reader gets each
token, LMSP §6 "coalescing must not be felt"): a task nobody follows is written in fewer commits and a reader
that arrives gets what was held back at once, writing a token costs the same at the end of a
long answer as at its start, and output written by an older version survives the migration."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from app.events import EventBus
from app.store import db
from app.tasks import output
from app.tasks.kinds import generation
from app.tasks.states import TERMINAL
from tests.helpers import COUNT, poll
from tests.test_api import deltas, events, start_background, task, wait_status

pytestmark = pytest.mark.scripted  # the machine around inference, not inference: tests/scripted.py's engines

SSE = {"Accept": "text/event-stream"}


async def test_a_plain_request_nobody_follows_is_written_in_few_commits(api: Any, service: Any) -> None:
    """A request that only waits for its answer has no live reader: its output is committed at
    most every QUIET_SPACING, not once per token (each commit takes CPU from decoding)."""
    await api.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4})  # the model loaded
    before, started = service.store.commits, time.monotonic()
    resp = await api.post("/v1/responses", json={"input": COUNT, "temperature": 0, "max_output_tokens": 200})
    body = await resp.json()
    assert resp.status == 200 and body["usage"]["output_tokens"] == 200, body
    commits, took = service.store.commits - before, time.monotonic() - started
    # However fast the machine decodes: the task's own commits (create, end) and a few more.
    assert commits <= took / generation.QUIET_SPACING + 5, \
        f"{commits} commits in {took:.1f} s for 200 tokens nobody watched"


def test_a_watch_ends_once_however_often_it_is_released() -> None:
    bus = EventBus()
    first, second = bus.watch("task_a"), bus.watch("task_a")
    first()
    first()  # a second call must not end the other reader's watch
    assert bus.watched("task_a")
    second()
    assert not bus.watched("task_a")
    with bus.feed("task_a", watch=False):  # one that only waits for the end
        assert not bus.watched("task_a")
    with bus.feed("task_a", watch=True):
        assert bus.watched("task_a")
    assert not bus.watched("task_a")


async def held_back(api: Any, service: Any, monkeypatch: Any) -> tuple[str, list[dict[str, Any]]]:
    """An unwatched task held back 3 s at a time (long, so that it shows plainly), at least 0.5 s
    after its first delta and with 20 tokens or more held back (on a busy machine decoding can
    be slow): its id and its events so far."""
    monkeypatch.setattr(generation, "QUIET_SPACING", 3.0)
    task_id = (await start_background(api, {"input": COUNT, "temperature": 0, "max_output_tokens": 600}))["task"]["id"]

    async def first_delta() -> list[dict[str, Any]] | None:
        evs = await events(api, task_id)
        return evs if any(e["type"] == "response.output_text.delta" for e in evs) else None

    async def twenty_held() -> bool:
        return len(service.generations.jobs[task_id].ids) >= 20

    replayed = await poll(first_delta, what="the first delta")
    await asyncio.sleep(0.5)  # tokens keep coming meanwhile, held back
    await poll(twenty_held, what="twenty tokens held back")
    return task_id, replayed


async def test_a_reader_that_arrives_gets_the_held_back_output_at_once_then_each_token(
        api: Any, service: Any, monkeypatch: Any) -> None:
    task_id, replayed = await held_back(api, service, monkeypatch)
    held = await events(api, task_id, replayed[-1]["sequence_number"])
    assert not held, f"{len(held)} more events within 0.5 s of the first delta of an unwatched task"

    assert (await task(api, task_id))["status"] == "running", "ended too soon to tell"
    attached = time.monotonic()
    resp = await api.get(f"/v1/tasks/{task_id}/events?stream=true&after={replayed[-1]['sequence_number']}")
    assert resp.status == 200
    frames: list[tuple[float, dict[str, Any]]] = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            frames.append((time.monotonic(), json.loads(line[6:])))
    live = [e for _, e in frames]
    waited = frames[0][0] - attached
    assert waited < 1.0, f"the output held back reached the reader {waited:.2f} s after it came (hold: 3 s)"
    final = await (await api.get(f"/v1/responses/{replayed[0]['response_id']}")).json()
    assert deltas(replayed + live) == final["output_text"]
    live_deltas = [e for e in live[1:] if e["type"] == "response.output_text.delta"]
    # Held back 3 s at a time, the rest of the task would come in one or two deltas.
    assert len(live_deltas) >= 20, f"{len(live_deltas)} deltas after the reader arrived: output is still held back"


async def test_a_cancel_keeps_the_output_held_back(api: Any, service: Any, monkeypatch: Any) -> None:
    task_id, replayed = await held_back(api, service, monkeypatch)
    first = deltas(replayed)
    assert (await api.post(f"/v1/tasks/{task_id}/cancel")).status == 200
    assert (await wait_status(api, task_id, set(TERMINAL)))["status"] == "cancelled"
    evs = await events(api, task_id)
    final = await (await api.get(f"/v1/responses/{evs[0]['response_id']}")).json()
    assert final["output_text"] == deltas(evs)
    assert len(final["output_text"]) > len(first) + 10, \
        f"the cancel dropped what was held back: {final['output_text']!r}"
    types = [e["type"] for e in evs]
    assert types.index("response.cancelling") > max(i for i, t in enumerate(types) if t.endswith(".delta"))


@pytest.mark.alone  # costs compared over time
async def test_writing_a_token_costs_the_same_late_in_a_long_answer_as_early(api: Any, service: Any) -> None:
    wal = Path(str(service.store.path) + "-wal")
    # No checkpoints during the task: the -wal file then only grows, by what each commit wrote.
    await service.store.write(lambda conn: conn.execute("PRAGMA wal_autocheckpoint = 0"))
    resp = await api.post("/v1/responses", json={"input": COUNT, "temperature": 0, "max_output_tokens": 2000,
                                                 "background": True})
    task_id = (await resp.json())["task"]["id"]
    samples: list[tuple[int, int, int]] = []  # (output tokens committed, commits so far, -wal bytes)

    async def finished() -> bool:
        task = await (await api.get(f"/v1/tasks/{task_id}")).json()
        samples.append((task["progress"]["output_tokens"], service.store.commits, os.path.getsize(wal)))
        return task["status"] == "completed"

    await poll(finished, timeout=300, interval=0.2, what="the 2000-token task")

    def cost(lo: int, hi: int) -> tuple[float, float]:
        """-wal bytes per token and per commit between the samples nearest `lo` and `hi` tokens."""
        a = min(samples, key=lambda s: abs(s[0] - lo))
        b = min(samples, key=lambda s: abs(s[0] - hi))
        return (b[2] - a[2]) / (b[0] - a[0]), (b[2] - a[2]) / (b[1] - a[1])

    assert samples[-1][0] == 2000
    early, late = cost(100, 500), cost(1500, 1900)
    # Rewriting all the output on each write made a late write cost twice an early one and more.
    assert late[1] < 1.3 * early[1], f"a commit late in the task wrote {late[1]:.0f} bytes, early {early[1]:.0f}"
    assert late[0] < 32_000, f"{late[0]:.0f} bytes of WAL per token"


def test_output_written_before_the_migration_is_kept(tmp_path: Path, monkeypatch: Any) -> None:
    path = tmp_path / "lmsp.sqlite3"
    real = db.migrations()
    monkeypatch.setattr(db, "migrations", lambda: real[:3])  # the schema before output had its own table
    conn = db.open_database(path).conn
    conn.execute("INSERT INTO responses(id, client_id, model_id, request, background, created_at) "
                 "VALUES ('resp_1', 'c', 'm', '{}', 1, 0), ('resp_2', 'c', 'm', '{}', 1, 0)")
    conn.execute("INSERT INTO tasks(id, response_id, status, on_restart, created_at, output_ids, output_text, "
                 "output_tokens) VALUES ('task_1', 'resp_1', 'running', 'resume', 0, '[5, 6, 7]', 'Hi there', 3), "
                 "('task_2', 'resp_2', 'queued', 'resume', 0, '[]', '', 0)")
    conn.close()
    monkeypatch.undo()

    migrated = db.open_database(path).conn
    try:
        assert output.read(migrated, "task_1") == ([5, 6, 7], "Hi there")  # `resume` continues from here
        assert output.read(migrated, "task_2") == ([], "")
        columns = {r[1] for r in migrated.execute("PRAGMA table_info(tasks)")}
        assert "output_ids" not in columns and "output_text" not in columns
    finally:
        migrated.close()
