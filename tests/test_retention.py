"""Retention (LMSP §8, rule 11.2): finished work older than the period goes, unfinished never."""

from __future__ import annotations

import itertools
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.core.service import AppService
from app.store import config, db
from app.store.store import Store
from app.tasks import machine
from app.tasks.retention import purge
from app.tasks.states import CANCELLED, CANCELLING, COMPLETED, FAILED, LOADING, QUEUED, RUNNING, TERMINAL, UNFINISHED
from tests.helpers import poll

pytestmark = pytest.mark.scripted  # the machine around inference, not inference: tests/scripted.py's engines

DAY = 86400.0
WEEK = 7 * DAY
NOW = time.time()
_ids = itertools.count()

# The transitions that lead from a new (queued) task to each state.
PATHS = {
    QUEUED: [], LOADING: [LOADING], RUNNING: [LOADING, RUNNING], CANCELLING: [LOADING, RUNNING, CANCELLING],
    COMPLETED: [LOADING, RUNNING, COMPLETED], FAILED: [LOADING, FAILED], CANCELLED: [CANCELLED],
}


def add_task(conn: sqlite3.Connection, status: str, finished_at: float | None = None,
             created_at: float | None = None) -> str:
    """A response and its task, moved to `status` through the state machine, with its events."""
    n = next(_ids)
    response_id, task_id = f"resp_{n:04d}", f"task_{n:04d}"
    conn.execute("INSERT INTO responses(id, client_id, model_id, request, background, metadata, created_at) "
                 "VALUES (?, 'client_owner', 'some-model', '{}', 1, '{}', ?)", (response_id, created_at or NOW))
    machine.create(conn, task_id, response_id, "fail", None)
    for step in PATHS[status]:
        done = {"finished_at": finished_at} if step in TERMINAL else {}
        assert machine.transition(conn, task_id, step, [(f"test.{step}", {})], **done) is not None
    if status not in TERMINAL and finished_at is not None:  # nonsense a bug or a hand edit could leave
        conn.execute("UPDATE tasks SET finished_at = ? WHERE id = ?", (finished_at, task_id))
    if created_at is not None:
        conn.execute("UPDATE tasks SET created_at = ? WHERE id = ?", (created_at, task_id))
    assert machine.status_of(conn, task_id) == status
    return task_id


def add_key(conn: sqlite3.Connection, key: str, created_at: float, response_id: str | None = None) -> None:
    conn.execute("INSERT INTO idempotency_keys(client_id, key, request_digest, status_code, response_body, "
                 "response_id, created_at) VALUES ('client_owner', ?, 'digest', 200, '{}', ?, ?)",
                 (key, response_id, created_at))


def left(conn: sqlite3.Connection, task_id: str) -> dict[str, int]:
    """What remains of a task: its row, its response, its events."""
    response_id = "resp_" + task_id[5:]
    return {
        "task": conn.execute("SELECT COUNT(*) FROM tasks WHERE id = ?", (task_id,)).fetchone()[0],
        "response": conn.execute("SELECT COUNT(*) FROM responses WHERE id = ?", (response_id,)).fetchone()[0],
        "events": conn.execute("SELECT COUNT(*) FROM task_events WHERE task_id = ?", (task_id,)).fetchone()[0],
    }


def keys(conn: sqlite3.Connection) -> set[str]:
    return {r[0] for r in conn.execute("SELECT key FROM idempotency_keys")}


@pytest.fixture
def conn(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    """The app's own writer connection (foreign keys on) to a real database file."""
    opened = db.open_database(tmp_path / "lmsp.sqlite3")
    yield opened.conn
    opened.conn.close()


def run_purge(conn: sqlite3.Connection, **kw: Any) -> dict[str, int]:
    conn.execute("BEGIN IMMEDIATE")
    counts = purge(conn, int(kw.get("retention", WEEK)), int(kw.get("ttl", DAY)), now=NOW)
    conn.execute("COMMIT")
    return counts


@pytest.mark.parametrize("status", TERMINAL)
def test_finished_task_older_than_retention_goes_with_its_response_and_events(
        conn: sqlite3.Connection, status: str) -> None:
    old = add_task(conn, status, finished_at=NOW - WEEK - 60, created_at=NOW - WEEK - 120)
    assert left(conn, old)["events"] >= 3

    counts = run_purge(conn)

    assert counts["responses"] == 1
    assert left(conn, old) == {"task": 0, "response": 0, "events": 0}


@pytest.mark.parametrize("status", TERMINAL)
def test_finished_task_younger_than_retention_is_kept_whole(conn: sqlite3.Connection, status: str) -> None:
    recent = add_task(conn, status, finished_at=NOW - WEEK + 60, created_at=NOW - WEEK - 3600)
    before = left(conn, recent)

    assert run_purge(conn)["responses"] == 0
    assert left(conn, recent) == before == {"task": 1, "response": 1, "events": before["events"]}


@pytest.mark.parametrize("status", UNFINISHED)
def test_unfinished_task_is_never_deleted_however_old(conn: sqlite3.Connection, status: str) -> None:
    ancient = NOW - 10 * 365 * DAY
    stuck = add_task(conn, status, finished_at=ancient, created_at=ancient)  # finished_at set, wrongly
    before = left(conn, stuck)

    assert run_purge(conn, retention=60)["responses"] == 0
    assert left(conn, stuck) == before
    assert machine.status_of(conn, stuck) == status


def test_purge_removes_exactly_the_expired_finished_tasks_among_many(conn: sqlite3.Connection) -> None:
    gone = [add_task(conn, s, finished_at=NOW - 2 * WEEK) for s in TERMINAL]
    kept = ([add_task(conn, s, finished_at=NOW - DAY) for s in TERMINAL]
            + [add_task(conn, s, finished_at=NOW - 2 * WEEK, created_at=NOW - 2 * WEEK) for s in UNFINISHED])

    assert run_purge(conn)["responses"] == len(gone)

    assert all(left(conn, t) == {"task": 0, "response": 0, "events": 0} for t in gone)
    assert all(left(conn, t)["task"] == left(conn, t)["response"] == 1 for t in kept)
    assert all(left(conn, t)["events"] > 0 for t in kept)
    orphans = conn.execute("SELECT COUNT(*) FROM task_events WHERE task_id NOT IN (SELECT id FROM tasks)")
    assert orphans.fetchone()[0] == 0


def test_expired_idempotency_keys_go_and_fresh_ones_stay(conn: sqlite3.Connection) -> None:
    add_key(conn, "expired", NOW - DAY - 60)
    add_key(conn, "fresh", NOW - DAY + 60)
    add_key(conn, "new", NOW)

    assert run_purge(conn)["idempotency_keys"] == 1
    assert keys(conn) == {"fresh", "new"}


def test_a_key_about_a_purged_response_goes_with_it_though_young(conn: sqlite3.Connection) -> None:
    # A retry must create anew, not replay a response whose events are gone (a stream with nothing in it).
    old = add_task(conn, COMPLETED, finished_at=NOW - 2 * WEEK)
    kept = add_task(conn, COMPLETED, finished_at=NOW - DAY)
    add_key(conn, "about-purged", NOW - 60, "resp_" + old[5:])
    add_key(conn, "about-kept", NOW - 60, "resp_" + kept[5:])

    assert run_purge(conn, retention=WEEK, ttl=4 * WEEK)["responses"] == 1
    assert keys(conn) == {"about-kept"}


# -- through the service -------------------------------------------------------------------

def seed(data_dir: Path, fn: Any) -> Any:
    """Write into the service's database before the service starts, as an earlier run would have."""
    opened = db.open_database(data_dir / "lmsp.sqlite3")
    try:
        opened.conn.execute("BEGIN IMMEDIATE")
        result = fn(opened.conn)
        opened.conn.execute("COMMIT")
        return result
    finally:
        opened.conn.close()


async def read(svc: AppService, fn: Any) -> Any:
    return await svc.store.read(fn)


async def test_service_start_purges_expired_finished_work(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"

    def earlier_run(conn: sqlite3.Connection) -> tuple[str, str]:
        add_key(conn, "expired", time.time() - 2 * DAY)
        add_key(conn, "fresh", time.time())
        return (add_task(conn, COMPLETED, finished_at=time.time() - 8 * DAY),
                add_task(conn, FAILED, finished_at=time.time() - DAY))

    old, recent = seed(data_dir, earlier_run)
    svc = AppService(data_dir)
    await svc.start()
    try:
        assert await read(svc, lambda c: left(c, old)) == {"task": 0, "response": 0, "events": 0}
        assert (await read(svc, lambda c: left(c, recent)))["task"] == 1
        assert await read(svc, keys) == {"fresh"}
    finally:
        await svc.stop()


async def test_service_start_uses_the_configured_retention_period(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"

    def earlier_run(conn: sqlite3.Connection) -> tuple[str, str]:
        config.save(conn, {"retention_seconds": 3600})
        return (add_task(conn, COMPLETED, finished_at=time.time() - 7200),
                add_task(conn, CANCELLED, finished_at=time.time() - 600))

    old, recent = seed(data_dir, earlier_run)
    svc = AppService(data_dir)
    await svc.start()
    try:
        assert (await read(svc, lambda c: left(c, old)))["task"] == 0
        assert (await read(svc, lambda c: left(c, recent)))["task"] == 1
    finally:
        await svc.stop()


async def test_service_purge_removes_work_that_expired_while_it_ran(tmp_path: Path) -> None:
    svc = AppService(tmp_path / "data")
    await svc.start()
    try:
        old = await svc.store.write(lambda c: add_task(c, COMPLETED, finished_at=time.time() - 2 * WEEK))
        unfinished = await svc.store.write(
            lambda c: add_task(c, CANCELLING, finished_at=time.time() - 2 * WEEK, created_at=time.time() - 2 * WEEK))

        counts = await svc.housekeeping.purge()

        assert counts["responses"] == 1
        assert await read(svc, lambda c: left(c, old)) == {"task": 0, "response": 0, "events": 0}
        assert (await read(svc, lambda c: left(c, unfinished)))["task"] == 1
    finally:
        await svc.stop()


def database_bytes(svc: AppService) -> bytes:
    """Every file of the database as it lies on the disk (the -wal and -shm too): what any program
    of the user, or a backup, reads."""
    return b"".join(p.read_bytes() for p in svc.store.path.parent.glob(f"{svc.store.path.name}*"))


async def test_a_purge_leaves_no_copy_of_what_it_deleted_in_the_wal_once_readers_let_it(tmp_path: Path) -> None:
    """The red team's P10: the WAL kept the deleted rows' old pages (readable in the file) until a
    restart. A reader on an older snapshot delays its emptying to the next tick, no more."""
    svc = AppService(tmp_path / "data")
    await svc.start()
    try:
        secret = b"The vault code is 7351-PELICAN."
        request = json.dumps({"input": secret.decode()})

        def old_task_with_a_secret(conn: sqlite3.Connection) -> None:
            task_id = add_task(conn, COMPLETED, finished_at=time.time() - 2 * WEEK)
            conn.execute("UPDATE responses SET request = ? WHERE id = ?", (request, "resp_" + task_id[5:]))

        await svc.store.write(old_task_with_a_secret)
        assert secret in database_bytes(svc)
        reader = sqlite3.connect(svc.store.path, isolation_level=None)  # another program, mid-read
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM responses").fetchone()
        try:
            assert (await svc.housekeeping.purge())["responses"] == 1
            assert secret in database_bytes(svc)  # its snapshot still needs them
        finally:
            reader.close()
        await poll(lambda: secret not in database_bytes(svc), timeout=15, interval=0.2,
                   what="the deleted rows to leave the WAL")
        assert Path(f"{svc.store.path}-wal").stat().st_size == 0
        # With no reader in the way, a purge empties it at once.
        await svc.store.write(old_task_with_a_secret)
        assert (await svc.housekeeping.purge())["responses"] == 1
        assert secret not in database_bytes(svc)
    finally:
        await svc.stop()


async def test_the_wal_does_not_keep_the_size_of_a_large_delete(store: Store) -> None:
    """A transaction writes as many pages as it changes into the WAL; once they are copied back, the
    WAL shrinks to `db.WAL_SIZE_LIMIT` at the next write instead of keeping that size until a restart."""
    wal = Path(f"{store.path}-wal")
    blob = '"' + "x" * 100_000 + '"'
    await store.write(lambda c: c.executemany("INSERT INTO service_config(key, value) VALUES (?, ?)",
                                              [(f"big{i}", blob) for i in range(400)]))
    await store.write(lambda c: c.execute("DELETE FROM service_config WHERE key LIKE 'big%'"))
    assert wal.stat().st_size > 30_000_000
    await store.write(config.save, {"after": 1})
    assert wal.stat().st_size <= db.WAL_SIZE_LIMIT
    assert await store.read(config.get_value, "after") == 1


async def test_old_pairings_revoked_clients_and_uncollected_tokens_do_not_stay_forever(api: Any,
                                                                                      service: AppService) -> None:
    """Pairing requests and revoked clients older than the retention period go; an approved token
    its app never collected leaves memory once its pairing's lifetime is over. Live clients stay."""
    body = {"client_name": "Kept", "scopes": ["models:read"]}
    kept = (await (await api.post("/v1/pairings", json=body)).json())["id"]
    await api.post(f"/v1/pairings/{kept}/approve")
    kept_token = (await (await api.get(f"/v1/pairings/{kept}")).json())["token"]
    revoked = (await (await api.post("/v1/pairings", json={**body, "client_name": "Revoked"})).json())["id"]
    await api.post(f"/v1/pairings/{revoked}/approve")
    revoked_client = (await (await api.get(f"/v1/pairings/{revoked}")).json())["client_id"]
    assert (await api.delete(f"/v1/clients/{revoked_client}")).status == 200
    uncollected = (await (await api.post("/v1/pairings", json={**body, "client_name": "Never came"})).json())["id"]
    await api.post(f"/v1/pairings/{uncollected}/approve")
    denied = (await (await api.post("/v1/pairings", json={**body, "client_name": "Denied"})).json())["id"]
    await api.post(f"/v1/pairings/{denied}/deny")

    soon = await service.housekeeping.purge(now=time.time() + 600)  # past the lifetime, well within the retention
    assert soon["uncollected_tokens"] == 1 and soon["pairings"] == soon["clients"] == 0
    late = (await (await api.get(f"/v1/pairings/{uncollected}")).json())
    assert late["status"] == "approved" and "token" not in late

    later = await service.housekeeping.purge(now=time.time() + service.settings["retention_seconds"] + 600)
    assert later["pairings"] == 4 and later["clients"] == 1
    names = await read(service, lambda c: [r[0] for r in c.execute("SELECT name FROM clients ORDER BY name")])
    assert names == ["Kept", "Never came", "Owner"]  # the revoked one is gone, live clients stay
    assert (await api.get("/v1/models", headers={"Authorization": f"Bearer {kept_token}"})).status == 200
