"""The store on real SQLite files: migrations, corruption, locks, a full disk, the writer thread."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from app.core.service import AppService
from app.engine.registry import models
from app.errors import StoreError
from app.server.app import make_app
from app.store import config, db
from app.store.store import Store

TABLES = {"service_config", "clients", "models", "responses", "tasks", "task_events", "idempotency_keys"}
STAMP = r"\d{8}T\d{6}Z"
PARTS = ("", "-wal", "-shm")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextmanager
def plain(path: Path) -> Iterator[sqlite3.Connection]:
    """A connection that is not the app's: what another program (or a person) would see."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        yield conn
    finally:
        conn.close()


def tables(conn: sqlite3.Connection) -> set[str]:
    return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def schema(conn: sqlite3.Connection) -> list[tuple[Any, ...]]:
    return sorted(tuple(r) for r in conn.execute("SELECT type, name, sql FROM sqlite_master"))


def settings_rows(conn: sqlite3.Connection) -> dict[str, str]:
    return {r[0]: r[1] for r in conn.execute("SELECT key, value FROM service_config")}


def make_database(path: Path, rows: int = 3, size: int = 10) -> dict[str, str]:
    """A database made by the app, with `rows` settings in it, closed cleanly."""
    opened = db.open_database(path)
    data = {f"key{i}": f'"{i:0{size}d}"' for i in range(rows)}
    with opened.conn:
        opened.conn.execute("BEGIN")
        opened.conn.executemany("INSERT INTO service_config(key, value) VALUES (?, ?)", data.items())
    opened.conn.close()
    return data


def siblings(path: Path, marker: str) -> list[Path]:
    return sorted(p for p in path.parent.iterdir() if p.name.startswith(f"{path.name}.{marker}-"))


# -- migrations ----------------------------------------------------------------------------

def test_fresh_database_is_created_at_the_latest_schema_with_every_table(tmp_path: Path) -> None:
    path = tmp_path / "not-yet" / "lmsp.sqlite3"
    opened = db.open_database(path)
    assert opened.recovered_from_corruption is None
    assert opened.conn.execute("PRAGMA user_version").fetchone()[0] == db.latest_version() >= 1
    assert TABLES <= tables(opened.conn)
    opened.conn.close()
    with plain(path) as other:  # what is on disk, not only what the connection saw
        assert other.execute("PRAGMA user_version").fetchone()[0] == db.latest_version()
        assert TABLES <= tables(other)


def test_opening_again_changes_nothing_and_keeps_the_data(tmp_path: Path) -> None:
    path = tmp_path / "lmsp.sqlite3"
    data = make_database(path)
    with plain(path) as other:
        before = schema(other)
    again = db.open_database(path)
    assert again.recovered_from_corruption is None
    assert again.conn.execute("PRAGMA user_version").fetchone()[0] == db.latest_version()
    assert schema(again.conn) == before
    assert settings_rows(again.conn) == data
    again.conn.close()
    assert siblings(path, "backup") == [] and siblings(path, "corrupt") == []


@pytest.mark.parametrize("journal_mode", ["delete", "wal"])
def test_database_from_a_newer_version_is_refused_and_left_byte_for_byte(tmp_path: Path, journal_mode: str) -> None:
    path = tmp_path / "lmsp.sqlite3"
    with plain(path) as newer:
        newer.execute(f"PRAGMA journal_mode = {journal_mode}")
        newer.execute("CREATE TABLE future_things(x)")
        newer.execute("INSERT INTO future_things VALUES ('precious')")
        newer.execute("PRAGMA user_version = 99")
    before = sha256(path)

    with pytest.raises(StoreError) as refused:
        db.open_database(path)

    assert refused.value.code == "database_too_new"
    assert "99" in refused.value.message
    assert sha256(path) == before
    assert siblings(path, "backup") == [] and siblings(path, "corrupt") == []


def _with_extra_migration(monkeypatch: pytest.MonkeyPatch, sql: str) -> None:
    real = db.migrations()
    monkeypatch.setattr(db, "migrations", lambda: [*real, (len(real) + 1, sql)])


def test_a_file_made_before_incremental_vacuum_is_switched_once_and_keeps_its_data(tmp_path: Path) -> None:
    """Files from schema 5 and older were made with auto_vacuum off: purges could never give space
    back. Opening one switches it (one VACUUM); what it held is all there."""
    path = tmp_path / "lmsp.sqlite3"
    with plain(path) as old:  # as the app made it before: schema 5, no auto_vacuum
        old.execute("PRAGMA journal_mode = WAL")
        for version, sql in db.migrations()[:5]:
            for statement in db._statements(sql):
                old.execute(statement)
            old.execute(f"PRAGMA user_version = {version}")
        old.execute("INSERT INTO service_config(key, value) VALUES ('kept', '1')")
        old.execute("INSERT INTO responses(id, client_id, model_id, request, background, created_at) "
                    "VALUES ('resp_1', 'client_owner', 'm', '{\"input\": \"h\u00e9\"}', 1, 0)")
        assert old.execute("PRAGMA auto_vacuum").fetchone()[0] == 0
    opened = db.open_database(path)
    conn = opened.conn
    assert conn.execute("PRAGMA auto_vacuum").fetchone()[0] == db.AUTO_VACUUM_INCREMENTAL
    assert settings_rows(conn)["kept"] == "1"
    assert conn.execute("SELECT request_bytes FROM responses").fetchone()[0] == len('{"input": "hé"}'.encode())
    conn.close()


def test_migrating_an_existing_database_first_writes_a_backup_of_the_old_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "lmsp.sqlite3"
    data = make_database(path)
    old = db.latest_version()
    _with_extra_migration(monkeypatch, "CREATE TABLE extra(x);")

    opened = db.open_database(path)

    assert opened.conn.execute("PRAGMA user_version").fetchone()[0] == old + 1
    assert "extra" in tables(opened.conn)
    assert settings_rows(opened.conn) == data
    opened.conn.close()
    [backup] = siblings(path, "backup")
    assert re.fullmatch(rf"lmsp\.sqlite3\.backup-v{old}-{STAMP}", backup.name)
    with plain(backup) as saved:
        assert saved.execute("PRAGMA user_version").fetchone()[0] == old
        assert "extra" not in tables(saved)
        assert settings_rows(saved) == data
        assert saved.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_a_failing_migration_leaves_version_and_schema_as_they_were(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "lmsp.sqlite3"
    data = make_database(path)
    with plain(path) as other:
        before = schema(other)
    _with_extra_migration(monkeypatch, "CREATE TABLE half_done(x);\nCREATE TABLE broken(;\n")

    with pytest.raises(StoreError) as refused:
        db.open_database(path)
    assert refused.value.code == "migration_failed" and "unchanged" in refused.value.message

    with plain(path) as other:
        assert other.execute("PRAGMA user_version").fetchone()[0] == db.latest_version() - 1
        assert schema(other) == before
        assert "half_done" not in tables(other)
        assert settings_rows(other) == data
    monkeypatch.undo()  # the version that has no broken migration still opens it, data intact
    opened = db.open_database(path)
    assert opened.recovered_from_corruption is None and settings_rows(opened.conn) == data
    opened.conn.close()


# -- corruption and locks ------------------------------------------------------------------

def test_random_bytes_are_moved_aside_with_wal_and_shm_and_a_fresh_database_made(tmp_path: Path) -> None:
    path = tmp_path / "lmsp.sqlite3"
    garbage = {part: os.urandom(16384) for part in PARTS}
    for part, blob in garbage.items():
        Path(f"{path}{part}").write_bytes(blob)

    opened = db.open_database(path)

    aside = opened.recovered_from_corruption
    assert aside is not None and re.fullmatch(rf"lmsp\.sqlite3\.corrupt-{STAMP}", aside)
    assert (tmp_path / aside).read_bytes() == garbage[""]
    assert (tmp_path / f"{aside}-wal").read_bytes() == garbage["-wal"]
    # Moved, not deleted. SQLite rebuilds a -shm (its index of the -wal) whenever it opens
    # one, so that file's bytes are SQLite's, not the user's: only its presence is checked.
    assert (tmp_path / f"{aside}-shm").exists()
    assert opened.conn.execute("PRAGMA user_version").fetchone()[0] == db.latest_version()
    assert TABLES <= tables(opened.conn)
    opened.conn.execute("INSERT INTO service_config(key, value) VALUES ('works', '1')")
    opened.conn.close()
    assert garbage[""] not in path.read_bytes()


def _garble_middle(path: Path) -> None:
    """Overwrite every page but the first and the last: the header stays valid.

    Sizes come from the header bytes, not from SQLite, which would merge a -wal on closing."""
    header = path.read_bytes()[:100]
    assert header.startswith(b"SQLite format 3\x00")
    page = int.from_bytes(header[16:18], "big")
    count = path.stat().st_size // page
    assert count > 4
    with path.open("r+b") as fh:
        fh.seek(page)
        fh.write(os.urandom(page * (count - 2)))


def test_database_with_garbage_pages_is_detected_and_moved_aside(tmp_path: Path) -> None:
    path = tmp_path / "lmsp.sqlite3"
    make_database(path, rows=200, size=500)
    _garble_middle(path)
    with plain(path) as other:  # the header is intact: it opens, it is only wrong inside
        assert other.execute("PRAGMA user_version").fetchone()[0] == db.latest_version()
    before = path.read_bytes()

    opened = db.open_database(path)

    aside = opened.recovered_from_corruption
    assert aside is not None and re.fullmatch(rf"lmsp\.sqlite3\.corrupt-{STAMP}", aside)
    assert (tmp_path / aside).read_bytes() == before
    assert settings_rows(opened.conn) == {}
    assert opened.conn.execute("PRAGMA quick_check").fetchone()[0] == "ok"
    opened.conn.close()


def test_corrupt_database_keeps_its_unmerged_wal_when_moved_aside(tmp_path: Path) -> None:
    """After a power cut the last commits may live only in the -wal: it is evidence too."""
    live = tmp_path / "live.sqlite3"
    make_database(live, rows=200, size=500)
    opened = db.open_database(live)
    opened.conn.execute("PRAGMA wal_autocheckpoint = 0")
    opened.conn.executemany("INSERT INTO service_config(key, value) VALUES (?, '\"late\"')",
                            [(f"late{i}",) for i in range(20)])
    path = tmp_path / "lmsp.sqlite3"
    for part in PARTS:  # the files as a crash would leave them, with the connection still open
        shutil.copyfile(f"{live}{part}", f"{path}{part}")
    opened.conn.close()
    _garble_middle(path)
    before = {part: Path(f"{path}{part}").read_bytes() for part in ("", "-wal")}
    assert len(before["-wal"]) > 0

    aside = db.open_database(path).recovered_from_corruption

    assert aside is not None
    assert (tmp_path / aside).read_bytes() == before[""]
    assert (tmp_path / f"{aside}-wal").read_bytes() == before["-wal"]
    assert (tmp_path / f"{aside}-shm").exists()


def test_database_locked_by_another_program_is_not_moved_aside(tmp_path: Path) -> None:
    """Waits out the real busy timeout (10 s): a lock is not corruption, however long it lasts."""
    path = tmp_path / "lmsp.sqlite3"
    data = make_database(path)
    before = sha256(path)
    locker = sqlite3.connect(path, isolation_level=None)
    locker.execute("PRAGMA locking_mode = EXCLUSIVE")
    locker.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StoreError) as refused:
            db.open_database(path)
        assert refused.value.code == "database_unavailable"
        assert sha256(path) == before
        assert siblings(path, "corrupt") == []
    finally:
        locker.close()
    opened = db.open_database(path)
    assert opened.recovered_from_corruption is None and settings_rows(opened.conn) == data
    opened.conn.close()


async def test_write_while_another_program_holds_the_lock_fails_busy_and_moves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "lmsp.sqlite3"
    store = Store(path)
    await store.open()
    try:
        await store.write(config.save, {"before": 1})
        # Shorten the wait on the real writer connection (through a write, as the app would).
        await store.write(lambda conn: conn.execute("PRAGMA busy_timeout = 300"))
        before = {part: sha256(Path(f"{path}{part}")) for part in ("", "-wal")}
        locker = sqlite3.connect(path, isolation_level=None)
        locker.execute("BEGIN EXCLUSIVE")
        try:
            started = time.monotonic()
            with pytest.raises(StoreError) as refused:
                await store.write(config.save, {"during": 1})
            assert refused.value.code == "database_busy"
            assert time.monotonic() - started < 5
            assert {part: sha256(Path(f"{path}{part}")) for part in ("", "-wal")} == before
            assert siblings(path, "corrupt") == []
            assert await store.read(config.get_value, "before") == 1  # readers are not blocked
        finally:
            locker.close()
        await store.write(config.save, {"after": 1})  # the lock gone, writes work again
        assert await store.read(config.get_value, "during") is None
        assert await store.read(config.get_value, "after") == 1
    finally:
        await store.close()


async def test_service_on_a_corrupt_file_starts_fresh_and_says_so(tmp_path: Path, aiohttp_client: Any) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    garbage = os.urandom(32768)
    (data_dir / "lmsp.sqlite3").write_bytes(garbage)

    svc = AppService(data_dir)
    await svc.start()
    try:
        aside = svc.describe()["recovered_from_corruption"]
        assert aside is not None and re.fullmatch(rf"lmsp\.sqlite3\.corrupt-{STAMP}", aside)
        assert (data_dir / aside).read_bytes() == garbage
        assert svc.ready
        registered = await svc.store.read(
            lambda c: c.execute("SELECT id FROM models WHERE id = ?", (models.DEFAULT_MODEL_ID,)).fetchone())
        assert registered is not None
        client = await aiohttp_client(make_app(svc))
        discovery = await (await client.get("/lmsp")).json()
        assert discovery["recovered_from_corruption"] == aside
        token = await svc.access.owner_token()
        missing = await client.get("/v1/tasks/task_nope", headers={"Authorization": f"Bearer {token}"})
        assert missing.status == 404
    finally:
        await svc.stop()

    again = AppService(data_dir)  # the next clean start no longer reports it
    await again.start()
    try:
        assert again.describe()["recovered_from_corruption"] is None
        assert (data_dir / aside).read_bytes() == garbage
    finally:
        await again.stop()


# -- full disk -----------------------------------------------------------------------------

async def test_full_disk_refuses_the_write_and_keeps_everything_before_it(tmp_path: Path) -> None:
    path = tmp_path / "lmsp.sqlite3"
    store = Store(path)
    await store.open()
    try:
        earlier = {f"row{i}": "x" * 200 for i in range(50)}
        await store.write(config.save, earlier)

        def fill_disk(conn: sqlite3.Connection) -> None:  # no page may be added from now on
            pages = conn.execute("PRAGMA page_count").fetchone()[0]
            conn.execute(f"PRAGMA max_page_count = {pages}")

        await store.write(fill_disk)
        with pytest.raises(StoreError) as full:
            await store.write(config.save, {"big": "y" * (1 << 20), "small": "z"})

        assert full.value.code == "disk_full"
        rows = await store.read(lambda c: {r["key"]: r["value"] for r in c.execute("SELECT * FROM service_config")})
        assert {k: rows[k] for k in earlier} == {k: f'"{v}"' for k, v in earlier.items()}
        assert "big" not in rows and "small" not in rows  # all of the failed write, or none
        assert await store.read(lambda c: c.execute("PRAGMA integrity_check").fetchone()[0]) == "ok"
        await store.write(config.save, {"row0": "fits"})  # what fits is still written
    finally:
        await store.close()
    with plain(path) as other:
        assert other.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert settings_rows(other).keys() - {db.CLOSED_CLEANLY} == earlier.keys()


# -- the writer (the `store` fixture is in conftest.py) ---------------------------------------

async def test_writes_run_on_one_writer_thread_not_the_event_loop(store: Store) -> None:
    loop_thread = threading.get_ident()
    seen = [await store.write(lambda conn: threading.get_ident()) for _ in range(3)]
    assert loop_thread not in seen
    assert len(set(seen)) == 1
    assert await store.write(lambda conn: threading.current_thread().name.startswith("lmsp-writer"))


async def test_an_exception_in_a_write_rolls_back_all_of_it(store: Store) -> None:
    await store.write(config.save, {"kept": 1})

    def half_then_fail(conn: sqlite3.Connection) -> None:
        config.save(conn, {"first": 1})
        config.save(conn, {"kept": 2})
        raise ValueError("changed my mind")

    with pytest.raises(ValueError, match="changed my mind"):
        await store.write(half_then_fail)

    assert await store.read(config.get_value, "first") is None
    assert await store.read(config.get_value, "kept") == 1
    await store.write(config.save, {"next": 1})  # the connection was not left in a transaction
    assert await store.read(config.get_value, "next") == 1


async def test_writer_commits_in_wal_mode_with_synchronous_full(store: Store) -> None:
    pragmas = await store.write(lambda conn: {name: conn.execute(f"PRAGMA {name}").fetchone()[0]
                                              for name in ("journal_mode", "synchronous", "foreign_keys")})
    assert pragmas == {"journal_mode": "wal", "synchronous": 2, "foreign_keys": 1}
    with plain(store.path) as other:  # WAL is a property of the file: every program sees it
        assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


async def test_readers_cannot_write(store: Store) -> None:
    with pytest.raises(sqlite3.OperationalError):
        await store.read(config.save, {"sneaky": 1})
    assert await store.read(config.get_value, "sneaky") is None
