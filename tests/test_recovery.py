"""Recovery at startup: every cell of LMSP table 11.3, then `resume` for real across a SIGKILL
(llama.cpp's: its text must be the uninterrupted one), `retry` and SIGTERM with scripted engines."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest

from app.store import db
from app.tasks import machine, output, records, recovery
from app.tasks.states import CANCELLED, CANCELLING, FAILED, LOADING, QUEUED, RUNNING
from tests.conftest import Headless, Processes, wait_until

pytestmark = pytest.mark.scripted

TABLE = {  # (found, policy) -> expected state
    (QUEUED, "fail"): FAILED, (QUEUED, "retry"): QUEUED, (QUEUED, "resume"): QUEUED,
    (LOADING, "fail"): FAILED, (LOADING, "retry"): QUEUED, (LOADING, "resume"): QUEUED,
    (RUNNING, "fail"): FAILED, (RUNNING, "retry"): QUEUED, (RUNNING, "resume"): RUNNING,
    (CANCELLING, "fail"): CANCELLED, (CANCELLING, "retry"): CANCELLED, (CANCELLING, "resume"): CANCELLED,
}


def _tx(conn: sqlite3.Connection, fn, *args):  # type: ignore[no-untyped-def]
    conn.execute("BEGIN IMMEDIATE")
    result = fn(conn, *args)
    conn.execute("COMMIT")
    return result


def _leftover(conn: sqlite3.Connection, state: str, policy: str) -> str:
    """A task left in `state`, as a crash would leave it, with some output if it ran."""
    task_id = f"task_{state}_{policy}"
    response_id = f"resp_{state}_{policy}"
    conn.execute("INSERT INTO responses(id, client_id, model_id, request, background, created_at) "
                 "VALUES (?, 'client_owner', 'm', '{\"messages\": []}', 1, ?)", (response_id, time.time()))
    machine.create(conn, task_id, response_id, policy, 50)
    if state in (LOADING, RUNNING, CANCELLING):
        machine.transition(conn, task_id, LOADING, [("response.loading", {"progress": 0.0})])
    if state in (RUNNING, CANCELLING):
        machine.transition(conn, task_id, RUNNING, [("response.in_progress", {})], started_at=time.time())
        machine.record(conn, task_id, (RUNNING,), [("response.output_text.delta", {"delta": "Hello"})],
                       output_tokens=2)
        output.append(conn, task_id, [1, 2], "Hello")
    if state == CANCELLING:
        machine.transition(conn, task_id, CANCELLING, [("response.cancelling", {})])
    return task_id


@pytest.mark.parametrize(("found", "policy"), list(TABLE))
def test_table_11_3(tmp_path: Path, found: str, policy: str) -> None:
    conn = db.open_database(tmp_path / "lmsp.sqlite3").conn
    task_id = _tx(conn, _leftover, found, policy)
    before = conn.execute("SELECT last_sequence_number, attempt FROM tasks WHERE id = ?", (task_id,)).fetchone()

    _tx(conn, recovery.recover, "response")

    row = records.one_task(conn, task_id)
    expected = TABLE[(found, policy)]
    assert row["status"] == expected
    events = records.events_after(conn, task_id, -1)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))  # no gap, no duplicate
    assert row["last_sequence_number"] == events[-1]["sequence_number"]
    new = events[before["last_sequence_number"] + 1:]
    if expected == FAILED:
        assert [e["type"] for e in new] == ["response.failed"]
        assert row["error_code"] == "server_restarted" and new[0]["error"]["code"] == "server_restarted"
        assert new[0]["response"]["status"] == "failed"
    elif expected == CANCELLED:
        assert [e["type"] for e in new] == ["response.cancelled"]
        assert row["finished_at"] is not None
    elif expected == QUEUED and found != QUEUED:
        assert [e["type"] for e in new] == ["response.queued"] and new[0]["output_reset"] is True
        assert row["output_text"] == "" and row["output_tokens"] == 0  # retry starts from nothing
        assert row["attempt"] == before["attempt"] + (1 if policy == "retry" else 0)
        assert new[0]["attempt"] == row["attempt"]
    else:  # unchanged: queued stays queued, a resumed task keeps its snapshot
        assert new == []
        if found == RUNNING:
            assert row["output_text"] == "Hello" and output.read(conn, task_id) == ([1, 2], "Hello")


@pytest.mark.parametrize("policy", ["fail", "retry", "resume"])
def test_a_task_that_gave_its_slot_away_is_recovered_as_a_running_one(tmp_path: Path, policy: str) -> None:
    """Queued again with its output, for another app's task (app/tasks/kinds/generation.py): a
    restart moves it as the running task it was, not as one that never started."""
    conn = db.open_database(tmp_path / "lmsp.sqlite3").conn

    def gave_way(conn: sqlite3.Connection) -> str:
        task_id = _leftover(conn, RUNNING, policy)
        machine.transition(conn, task_id, QUEUED, [("response.queued", {"preempted": True})])
        return task_id

    task_id = _tx(conn, gave_way)
    _tx(conn, recovery.recover, "response")
    row = records.one_task(conn, task_id)
    last = records.events_after(conn, task_id, -1)[-1]
    if policy == "fail":
        assert row["status"] == FAILED and last["type"] == "response.failed"
    elif policy == "retry":  # a new attempt, from nothing
        assert row["status"] == QUEUED and last["type"] == "response.queued" and last["output_reset"] is True
        assert row["attempt"] == 2 and row["output_text"] == "" and row["started_at"] is None
    else:  # it continues from its output, word for word, when it is taken again
        assert row["status"] == QUEUED and last.get("preempted") is True
        assert row["attempt"] == 1 and output.read(conn, task_id) == ([1, 2], "Hello")


def test_recovery_is_idempotent(tmp_path: Path) -> None:
    conn = db.open_database(tmp_path / "lmsp.sqlite3").conn
    ids = [_tx(conn, _leftover, state, policy) for state, policy in TABLE]
    _tx(conn, recovery.recover, "response")
    first = {i: records.one_task(conn, i)["last_sequence_number"] for i in ids}
    _tx(conn, recovery.recover, "response")  # a second crash right after recovery changes nothing more
    assert {i: records.one_task(conn, i)["last_sequence_number"] for i in ids} == first


PROMPT = {"input": "Write a long story about a lighthouse keeper and a storm.", "temperature": 0,
          "max_output_tokens": 160}


def _final_text(svc: Headless, task_id: str) -> dict:
    wait_until(lambda: svc.get(f"/v1/tasks/{task_id}")[1]["status"] in ("completed", "failed", "cancelled"),
               timeout=120)
    return svc.get(f"/v1/responses/{svc.get(f'/v1/tasks/{task_id}')[1]['response_id']}")[1]


@pytest.mark.llama
def test_resume_after_sigkill_carries_on_from_the_committed_text(headless: Headless) -> None:
    """What a resumed greedy run promises (README, Recovery): the text committed before the kill,
    word for word, then llama.cpp's continuation of it, to the same token budget, in the same
    attempt and one gap-free event log."""
    headless.start()
    assert headless.request("PATCH", "/v1/settings", {"parallel": 1})[0] == 200
    status, created = headless.post("/v1/responses", {**PROMPT, "background": True, "on_restart": "resume"})
    assert status == 202
    task_id = created["task"]["id"]
    wait_until(lambda: headless.get(f"/v1/tasks/{task_id}")[1]["progress"]["output_tokens"] >= 40, timeout=60)
    headless.kill()
    conn = db.open_database(headless.data_dir / "lmsp.sqlite3").conn
    committed = output.read(conn, task_id)[1]  # what the kill left written
    conn.close()

    headless.start()  # recovery leaves it running; the scheduler continues from the snapshot
    final = _final_text(headless, task_id)
    assert final["status"] == "incomplete" and final["usage"]["output_tokens"] == 160
    assert len(committed) > 40 and final["output_text"].startswith(committed)
    assert len(final["output_text"]) > len(committed) + 100  # and went on, no second start
    status, events = headless.get(f"/v1/tasks/{task_id}/events")
    seqs = [e["sequence_number"] for e in events["data"]]
    assert seqs == list(range(len(seqs)))
    deltas = "".join(e["delta"] for e in events["data"] if e["type"] == "response.output_text.delta")
    assert deltas == final["output_text"]
    assert {e["attempt"] for e in events["data"]} == {1}


@pytest.mark.llama
def test_resume_with_several_at_once_keeps_the_committed_text_word_for_word(headless: Headless) -> None:
    """With several tasks at once (`parallel` 4, the default) a resumed task keeps the text it had
    written, word for word, and continues from exactly there; that the rest is what an
    uninterrupted run would have said is not promised (batch composition changes llama.cpp's sums)."""
    headless.start()
    ids = []
    for topic in ("a storm", "a ship"):
        body = {**PROMPT, "input": f"Write a long story about a lighthouse keeper and {topic}.", "background": True,
                "on_restart": "resume"}
        status, created = headless.post("/v1/responses", body)
        assert status == 202
        ids.append(created["task"]["id"])
    wait_until(lambda: all(headless.get(f"/v1/tasks/{i}")[1]["progress"]["output_tokens"] >= 40 for i in ids),
               timeout=60)
    headless.kill()
    conn = db.open_database(headless.data_dir / "lmsp.sqlite3").conn
    committed = {task_id: output.read(conn, task_id)[1] for task_id in ids}  # what the crash left written
    conn.close()

    headless.start()
    for task_id in ids:
        final = _final_text(headless, task_id)
        assert final["status"] == "incomplete" and final["usage"]["output_tokens"] == 160
        assert len(committed[task_id]) > 20 and final["output_text"].startswith(committed[task_id])
        status, events = headless.get(f"/v1/tasks/{task_id}/events")
        assert [e["sequence_number"] for e in events["data"]] == list(range(len(events["data"])))
        assert "".join(e["delta"] for e in events["data"] if e["type"] == "response.output_text.delta") == \
            final["output_text"]
        assert {e["attempt"] for e in events["data"]} == {1}


def test_retry_after_sigkill_starts_a_new_attempt(headless: Headless) -> None:
    headless.start()
    status, created = headless.post("/v1/responses", {**PROMPT, "background": True, "on_restart": "retry"})
    task_id = created["task"]["id"]
    wait_until(lambda: headless.get(f"/v1/tasks/{task_id}")[1]["progress"]["output_tokens"] >= 20, timeout=60)
    headless.kill()
    headless.start()
    final = _final_text(headless, task_id)
    events = headless.get(f"/v1/tasks/{task_id}/events")[1]["data"]
    reset = [e for e in events if e.get("output_reset")]
    assert len(reset) == 1 and reset[0]["attempt"] == 2
    last_attempt = "".join(e["delta"] for e in events
                           if e["type"] == "response.output_text.delta" and e["attempt"] == 2)
    assert final["output_text"] == last_attempt and final["usage"]["output_tokens"] == 160


def test_sigterm_commits_a_snapshot_and_exits_zero(headless: Headless) -> None:
    headless.start()
    _, created = headless.post("/v1/responses", {**PROMPT, "background": True, "on_restart": "resume",
                                                 "max_output_tokens": 2000, "temperature": 0.7})
    task_id = created["task"]["id"]
    wait_until(lambda: headless.get(f"/v1/tasks/{task_id}")[1]["progress"]["output_tokens"] >= 10, timeout=60)
    assert headless.terminate() == 0
    assert not (headless.data_dir / "service.json").exists()
    conn = sqlite3.connect(headless.data_dir / "lmsp.sqlite3")
    status, tokens = conn.execute("SELECT status, output_tokens FROM tasks WHERE id = ?", (task_id,)).fetchone()
    ids, text = output.read(conn, task_id)
    assert status == "running" and tokens >= 10 and len(ids) == tokens and text  # left for recovery to resume
    last = conn.execute("SELECT max(sequence_number) FROM task_events WHERE task_id = ?", (task_id,)).fetchone()[0]
    deltas = "".join(json.loads(d)["delta"] for (d,) in conn.execute(
        "SELECT data FROM task_events WHERE task_id = ? AND type = 'response.output_text.delta'", (task_id,)))
    assert deltas == text and last is not None


def test_a_second_service_on_the_same_data_refuses_and_a_busy_port_is_reported(headless: Headless) -> None:
    import subprocess
    import sys

    from tests.conftest import ROOT

    headless.start()
    second = subprocess.run([sys.executable, "-m", "app", "--headless", "--data-dir", str(headless.data_dir),
                             "--port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert second.returncode == 2 and f"already running for {headless.data_dir} at {headless.url}" in second.stderr
    port = headless.url.rsplit(":", 1)[1]
    other = subprocess.run([sys.executable, "-m", "app", "--headless", "--data-dir",
                            str(headless.data_dir.parent / "other"), "--port", port],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert other.returncode == 2 and f"Cannot serve on 127.0.0.1:{port}" in other.stderr
    assert "Traceback" not in other.stderr
    assert headless.get("/health")[0] == 200  # the first one is untouched
    assert json.loads((headless.data_dir / "service.json").read_text())["pid"] == headless.proc.pid


@pytest.mark.parametrize("holder", ["this test process", "an unrelated sleep"])
def test_a_service_json_left_by_a_kill_never_stops_the_next_start(headless: Headless, procs: Processes,
                                                                  holder: str) -> None:
    """After a crash or power cut the pid in the leftover service.json may be a live process's
    (pids are reused): the next start must not mistake it for a running LMSP Tray."""
    import os

    headless.start()
    status, _ = headless.post("/v1/responses", {**PROMPT, "max_output_tokens": 4})  # an engine child too
    assert status == 200
    headless.kill()
    leftover = headless.data_dir / "service.json"
    info = json.loads(leftover.read_text())
    info["pid"] = os.getpid() if holder == "this test process" else procs.popen(["sleep", "300"]).pid
    leftover.write_text(json.dumps(info))
    started = time.monotonic()
    headless.start()  # fails if the service exits ("already running")
    assert time.monotonic() - started < 30
    assert headless.get("/health")[0] == 200


def test_without_a_screen_the_app_serves_headless(tmp_path: Path, procs: Processes) -> None:
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    proc = procs.popen([sys.executable, "-m", "app", "--data-dir", str(tmp_path / "data"), "--port", "0"],
                       cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: (tmp_path / "data" / "service.json").exists(), timeout=60)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "no screen to show a tray icon on" in err
