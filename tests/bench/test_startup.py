"""Startup with a heavy user's queue after a crash: 100 000 unfinished tasks (queued, every
on_restart policy, and a `parallel`'s worth running with output) in the database; the app serves its first
request in under a second, with recovery (LMSP §11.3) complete before that answer. And a clean start
of a database of 1 GB (a long history), which answers within a second too: the whole-file check runs
only after an unclean end. A bench (`make bench`), not CI: building each database takes a minute.

    pytest tests/bench/test_startup.py -s   (LMSP_STARTUP_TASKS, LMSP_STARTUP_BYTES to change the sizes)
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
HISTORY_BYTES = int(float(os.environ.get("LMSP_STARTUP_BYTES", "1e9")))
OUTPUT_BYTES = 100_000  # each finished task's output in the history
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


def clone(conn: sqlite3.Connection, count: int, task: Any) -> None:
    """`count` copies of the one task, each with its response, events and output: the n-th copy's
    rows as `task(n, table, record)` changes them (None leaves the row out)."""
    (task_id, response_id), = conn.execute("SELECT id, response_id FROM tasks").fetchall()
    tables = {"responses": copies(conn, "responses", "id", response_id), "tasks": copies(conn, "tasks", "id", task_id),
              "task_events": copies(conn, "task_events", "task_id", task_id),
              "task_output": copies(conn, "task_output", "task_id", task_id)}
    keys = {"responses": "id", "tasks": "id", "task_events": "task_id", "task_output": "task_id"}
    with conn:
        for table, (columns, rows) in tables.items():
            marks = ",".join("?" * len(columns))
            batch = []
            for n in range(count):
                for row in rows:
                    record = dict(zip(columns, row))
                    record[keys[table]] = f"{record[keys[table]]}_{n}"
                    if table == "tasks":
                        record["response_id"] = f"{response_id}_{n}"
                    if (kept := task(n, table, record)) is not None:
                        batch.append(tuple(kept[c] for c in columns))
            conn.executemany(f"INSERT INTO {table} ({','.join(columns)}) VALUES ({marks})", batch)


def fill(db_file: Path, count: int, rng: random.Random, running: int) -> None:
    """`count` copies of the one task with a random policy each: `running` of them running, with
    their events and output so far, the others queued, with only their first two events."""
    cells = [("running" if n < running else "queued", rng.choice(("fail", "retry", "resume"))) for n in range(count)]

    def unfinished(n: int, table: str, record: dict[str, Any]) -> dict[str, Any] | None:
        status, policy = cells[n]
        if status == "queued" and (table == "task_output" or record.get("sequence_number", 0) > 1):
            return None
        if table == "tasks":
            record.update(status=status, on_restart=policy)
            if status == "queued":
                record.update(last_sequence_number=1, output_tokens=0, started_at=None)
        return record

    conn = sqlite3.connect(db_file)
    clone(conn, count, unfinished)
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


def uncached(db_file: Path) -> None:
    """Drop the database's pages from the page cache (this file's only), as after a reboot."""
    fd = os.open(db_file, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fill_history(db_file: Path, size: int) -> None:
    """Copies of the one finished task, with OUTPUT_BYTES of output each, until `size` bytes."""
    conn = sqlite3.connect(db_file)
    conn.execute("PRAGMA journal_mode = OFF")  # written once, straight into the file
    conn.execute("PRAGMA synchronous = OFF")
    chunks = conn.execute("SELECT count(*) FROM task_output").fetchone()[0]
    text = "".join(random.Random(7).choices("abcdefghij klmnopqrstuvwxyz.", k=OUTPUT_BYTES // chunks))

    def finished(n: int, table: str, record: dict[str, Any]) -> dict[str, Any]:
        if table == "task_output":
            record["text"] = text
        return record

    clone(conn, size // OUTPUT_BYTES, finished)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.close()


def clean_starts(app: Headless, procs: Processes, count: int = 3) -> list[float]:
    """Seconds to the first answer of `count` starts, each after a clean quit, the file out of the cache."""
    timings = []
    for _ in range(count):
        uncached(app.data_dir / "lmsp.sqlite3")
        timings.append(first_answer(app, procs))
        assert app.terminate() == 0
    return timings


def test_a_clean_start_of_a_large_history_answers_within_a_second(tmp_path: Path, procs: Processes) -> None:
    """The whole-file check is what grew with the file; a clean quit lets the next start skip it.
    An empty database's start, on the same machine, is the baseline (Python's imports, the app's
    objects): under load it alone may take longer than the bound."""
    app = Headless(tmp_path / "data", procs, scripted_app(pace=1000.0))
    app.start()
    app.complete({"input": "Count.", "max_output_tokens": 20})
    assert app.terminate() == 0  # a clean quit: its record stays through the copies below
    db_file = app.data_dir / "lmsp.sqlite3"
    try:
        small = clean_starts(app, procs)
        began = time.monotonic()
        fill_history(db_file, HISTORY_BYTES)
        print(f"\n{db_file.stat().st_size / 1e9:.2f} GB written in {time.monotonic() - began:.1f} s")
        clean = clean_starts(app, procs)
        app.start()
        app.kill()  # no clean close: the next start reads the whole file
        uncached(db_file)
        unclean = first_answer(app, procs)
        assert app.terminate() == 0
        opened = [line.split("app.store.db: ")[1] for line in app.log.read_text().splitlines()
                  if "app.store.db: database" in line]
        print(f"/health answered after a clean quit in {', '.join(f'{t:.2f}' for t in clean)} s (median "
              f"{statistics.median(clean):.2f} s; {statistics.median(small):.2f} s with an almost empty database); "
              f"after a SIGKILL, with the check, in {unclean:.2f} s. The database's opening: {'; '.join(opened[-5:])}")
        assert statistics.median(clean) < 1.0
    finally:
        for part in app.data_dir.glob("lmsp.sqlite3*"):
            part.unlink()
