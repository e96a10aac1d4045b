"""Startup with a heavy user's queue after a crash: 100 000 unfinished tasks (queued, every
on_restart policy, and a `parallel`'s worth running with output) in the database; the app serves its first
request in under a second, with recovery (LMSP §11.3) complete before that answer. A bench
(`make bench`), not CI: building the database takes a minute.

    pytest tests/bench/test_startup.py -s   (LMSP_STARTUP_TASKS to change the count)
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Headless, Processes, scripted_app, wait_until

TASKS = int(os.environ.get("LMSP_STARTUP_TASKS", "100000"))
RUNNING = 4  # the default `parallel`: what one engine runs at once
pytestmark = [pytest.mark.timeout(1800)]


def one_task_left_running(app: Headless) -> None:
    """A real task, running with output when the app is SIGKILLed: the row every copy is made from."""
    app.start()
    status, created = app.post("/v1/responses", {"input": "Count.", "background": True, "max_output_tokens": 500})
    assert status == 202, created
    wait_until(lambda: app.get(f"/v1/tasks/{created['task']['id']}")[1]["progress"]["output_tokens"] > 10, timeout=30)
    app.kill()


def copies(conn: sqlite3.Connection, table: str, where: str, value: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    cursor = conn.execute(f"SELECT * FROM {table} WHERE {where} = ?", (value,))
    return [d[0] for d in cursor.description], cursor.fetchall()


def fill(db_file: Path, count: int, rng: random.Random, running: int) -> None:
    """`count` copies of the one task with a random policy each: `running` of them running, with
    their events and output so far, the others queued, with only their first two events."""
    conn = sqlite3.connect(db_file)
    (task_id, response_id), = conn.execute("SELECT id, response_id FROM tasks").fetchall()
    tables = {"responses": copies(conn, "responses", "id", response_id), "tasks": copies(conn, "tasks", "id", task_id),
              "task_events": copies(conn, "task_events", "task_id", task_id),
              "task_output": copies(conn, "task_output", "task_id", task_id)}
    keys = {"responses": "id", "tasks": "id", "task_events": "task_id", "task_output": "task_id"}
    cells = [("running" if n < running else "queued", rng.choice(("fail", "retry", "resume"))) for n in range(count)]
    with conn:
        for table, (columns, rows) in tables.items():
            marks = ",".join("?" * len(columns))
            batch = []
            for n, (status, policy) in enumerate(cells):
                for row in rows:
                    record = dict(zip(columns, row))
                    if status == "queued" and (table == "task_output" or record.get("sequence_number", 0) > 1):
                        continue
                    record[keys[table]] = f"{record[keys[table]]}_{n}"
                    if table == "tasks":
                        record.update(response_id=f"{response_id}_{n}", status=status, on_restart=policy)
                        if status == "queued":
                            record.update(last_sequence_number=1, output_tokens=0, started_at=None)
                    batch.append(tuple(record[c] for c in columns))
            conn.executemany(f"INSERT INTO {table} ({','.join(columns)}) VALUES ({marks})", batch)
    conn.close()


def first_answer(app: Headless, procs: Processes) -> float:
    """Seconds from the process's start to its first answered request (GET /health, 200)."""
    info = app.data_dir / "service.json"
    info.unlink(missing_ok=True)
    started = time.monotonic()
    proc = procs.popen([*app.command, "--headless", "--data-dir", str(app.data_dir), "--port", "0"],
                       stdout=app.log.open("ab"), stderr=-2)
    app.proc = proc
    while True:
        assert proc.poll() is None, app.log.read_text()[-2000:]
        assert time.monotonic() - started < 600, "no answer in ten minutes"
        try:
            url = json.loads(info.read_text())["url"]
            with urllib.request.urlopen(url + "/health", timeout=60) as resp:
                if resp.status == 200:
                    return time.monotonic() - started
        except (OSError, ValueError, KeyError):
            time.sleep(0.002)


def recovered(db_file: Path) -> None:
    """Table 11.3 applied to every task: nothing loading or cancelling, no `fail` task unfinished,
    no `retry` task still running."""
    conn = sqlite3.connect(db_file)
    try:
        left = conn.execute("SELECT count(*) FROM tasks WHERE status IN ('loading', 'cancelling') OR "
                            "(on_restart = 'fail' AND status IN ('queued', 'running')) OR "
                            "(on_restart = 'retry' AND status = 'running')").fetchone()[0]
        assert left == 0, f"{left} tasks not recovered when the first request was answered"
    finally:
        conn.close()


def test_startup_with_a_long_queue_answers_within_a_second(tmp_path: Path, procs: Processes) -> None:
    app = Headless(tmp_path / "data", procs, scripted_app(pace=20.0))
    one_task_left_running(app)
    db_file = app.data_dir / "lmsp.sqlite3"
    pristine = tmp_path / "pristine.sqlite3"
    began = time.monotonic()
    conn = sqlite3.connect(db_file)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    fill(db_file, TASKS, random.Random(11), RUNNING)
    os.replace(db_file, pristine)
    print(f"\n{TASKS} tasks written in {time.monotonic() - began:.1f} s")
    # The first start after the crash (recovery moves every task), a few times over the same file.
    timings = []
    for _ in range(3):
        for suffix in ("-wal", "-shm"):
            Path(f"{db_file}{suffix}").unlink(missing_ok=True)
        db_file.write_bytes(pristine.read_bytes())
        timings.append(first_answer(app, procs))
        recovered(db_file)
        app.kill()
    print(f"first request answered after {', '.join(f'{t:.2f}' for t in timings)} s "
          f"(median {statistics.median(timings):.2f} s) with {TASKS} unfinished tasks")
    assert statistics.median(timings) < 1.0
