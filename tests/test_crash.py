"""The service is SIGKILLed again and again with work queued and running; nothing acknowledged
is lost, every event log stays gap-free, and each leftover task moves as table 11.3 says. Its
engines are scripted (tests/scripted.py), at about the pace of llama.cpp with the default model."""

from __future__ import annotations

import json
import random
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from app.tasks import output
from tests.conftest import Headless, wait_until

pytestmark = pytest.mark.scripted(pace=50.0)
POLICIES = ("fail", "retry", "resume")
TERMINAL = ("completed", "failed", "cancelled")


def _tasks(db_file: Path) -> dict[str, sqlite3.Row]:
    conn = sqlite3.connect(db_file)
    conn.row_factory = sqlite3.Row
    try:
        return {r["id"]: r for r in conn.execute("SELECT id, status, on_restart, last_sequence_number FROM tasks")}
    finally:
        conn.close()


def _events(db_file: Path, task_id: str) -> list[dict]:
    conn = sqlite3.connect(db_file)
    try:
        return [json.loads(d) for (d,) in conn.execute(
            "SELECT data FROM task_events WHERE task_id = ? ORDER BY sequence_number", (task_id,))]
    finally:
        conn.close()


def _expected_next(status: str, policy: str) -> set[str] | None:
    """The first event a leftover task gets after a restart; None: it may get none yet."""
    if status == "cancelling":
        return {"response.cancelled"}
    if policy == "fail":
        return {"response.failed"}
    if status in ("loading", "running") and policy == "retry":
        return {"response.queued"}
    if status == "loading":  # resume of a task that never started: queued again
        return {"response.queued"}
    return None  # queued stays queued, running (resume) continues: the next event is the scheduler's


def test_repeated_sigkill_loses_nothing(headless: Headless) -> None:
    rng = random.Random(7)
    db_file = headless.data_dir / "lmsp.sqlite3"
    acknowledged: set[str] = set()
    checked = 0
    headless.start()

    for round_no in range(10):
        def submit(n: int) -> None:
            for _ in range(n):
                try:
                    status, body = headless.post("/v1/responses", {
                        "input": f"Tell me fact number {rng.randrange(1000)} about the moon.", "background": True,
                        "on_restart": rng.choice(POLICIES), "temperature": 0,
                        "max_output_tokens": rng.randrange(10, 60)})
                except OSError:
                    return  # the service died under us: this request was never acknowledged
                if status == 202:
                    acknowledged.add(body["task"]["id"])
        submit(3)
        if round_no % 3 == 0:  # now and then, cancel something so `cancelling` is left over too
            running = [t for t, r in _tasks(db_file).items() if r["status"] == "running"]
            if running:
                headless.post(f"/v1/tasks/{running[0]}/cancel", {})
        sender = threading.Thread(target=submit, args=(3,))
        sender.start()  # requests in flight while the process dies
        time.sleep(rng.uniform(0.05, 1.2))
        headless.kill()
        sender.join()

        before = _tasks(db_file)
        assert acknowledged <= set(before), "a task acknowledged with 202 was lost"
        headless.start()
        for task_id, row in before.items():
            if row["status"] in TERMINAL:
                continue
            after = _events(db_file, task_id)[row["last_sequence_number"] + 1:]
            expected = _expected_next(row["status"], row["on_restart"])
            if expected is not None:
                assert after, f"{task_id} ({row['status']}, {row['on_restart']}) got no recovery event"
                assert after[0]["type"] in expected, (row["status"], row["on_restart"], after[0]["type"])
                if after[0]["type"] == "response.failed":
                    assert after[0]["error"]["code"] == "server_restarted"
                checked += 1
            elif row["status"] == "running":  # resumed: continues from its snapshot, no reset
                assert not any(e["type"] in ("response.queued", "response.failed") for e in after)
                attempt = _events(db_file, task_id)[row["last_sequence_number"]]["attempt"]
                assert {e["attempt"] for e in after} <= {attempt}
                checked += 1

    assert checked >= 10, "the kills should have caught work in flight"
    # No more kills: everything runs to its end.
    wait_until(lambda: all(r["status"] in TERMINAL for r in _tasks(db_file).values()), timeout=240, interval=0.5)
    headless.terminate()

    conn = sqlite3.connect(db_file)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    final = _tasks(db_file)
    assert acknowledged <= set(final)
    for task_id in final:
        events = _events(db_file, task_id)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed",
                                      "response.cancelled")
        status, attempt = conn.execute("SELECT status, attempt FROM tasks WHERE id = ?", (task_id,)).fetchone()
        text = output.read(conn, task_id)[1]
        if status == "completed":
            deltas = "".join(e["delta"] for e in events
                             if e["type"] == "response.output_text.delta" and e["attempt"] == attempt)
            assert deltas == text
