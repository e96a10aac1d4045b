"""Opening the database: connection setup, corruption handling, numbered migrations.

`synchronous=FULL` in WAL mode: every commit is fsynced before it returns, so a task
acknowledged with 202 survives a power cut, not only a crash of the process. NORMAL would
lose the last commits on power loss, which would break LMSP rule 11.2 in the one case that
matters most. The cost is one fsync per commit; the writer (store.py) commits the writes that
arrive together as one, so they share it.
"""

from __future__ import annotations

import logging
import sqlite3
import sys
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from app import durable
from app.errors import StoreError

log = logging.getLogger(__name__)

# Result codes (sqlite3.h): a corrupt file is moved aside, a busy one never is.
SQLITE_READONLY = 8
SQLITE_CORRUPT = 11
SQLITE_NOTADB = 26
AUTO_VACUUM_INCREMENTAL = 2
# What the WAL may keep of its size once a checkpoint has copied it all back (it keeps its largest
# size otherwise, with old copies of deleted rows in it). Twice what `wal_autocheckpoint` lets it
# grow to, so that a WAL of ordinary size is reused, not shrunk and grown again.
WAL_SIZE_LIMIT = 8 * 1024 * 1024
# The row (in `service_config`) that says the last run closed the database cleanly: the store's
# close writes it, every start deletes it before the service answers anything.
CLOSED_CLEANLY = "closed_cleanly"


def connect(path: Path, *, readonly: bool = False) -> sqlite3.Connection:
    """The one connection-setup function: every connection of the app is made here."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10.0)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA busy_timeout = 10000")
    conn.execute("PRAGMA foreign_keys = ON")
    if readonly:
        conn.execute("PRAGMA query_only = ON")
    else:
        # Retention's deletes give their pages back to the disk (retention.reclaim). A new file
        # is made so; an older one is switched by one VACUUM (see `_reclaimable`).
        conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = FULL")
        if sys.platform == "darwin":  # fsync there leaves the bytes in the drive's cache: F_FULLFSYNC
            conn.execute("PRAGMA fullfsync = ON")
            conn.execute("PRAGMA checkpoint_fullfsync = ON")
        conn.execute("PRAGMA wal_autocheckpoint = 1000")
        conn.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT}")
        # What is deleted is overwritten, not left in free pages: a `store: false` prompt or a
        # deleted response is gone from the file once the WAL is checkpointed.
        conn.execute("PRAGMA secure_delete = ON")
    return conn


def migrations() -> list[tuple[int, str]]:
    """(version, sql) for every numbered file in migrations/, in order."""
    found = []
    for entry in resources.files("app.store.migrations").iterdir():
        if entry.name.endswith(".sql"):
            found.append((int(entry.name.split("_", 1)[0]), entry.read_text(encoding="utf-8")))
    found.sort()
    assert [v for v, _ in found] == list(range(1, len(found) + 1)), "migrations must be numbered 1..N"
    return found


def latest_version() -> int:
    return len(migrations())


@dataclass
class Opened:
    conn: sqlite3.Connection
    recovered_from_corruption: str | None  # name of the file moved aside, if any
    checked: bool  # whether `PRAGMA quick_check` ran: the last run did not close it cleanly


def _utc_stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def _is_corruption(exc: sqlite3.DatabaseError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (SQLITE_CORRUPT, SQLITE_NOTADB)
    text = str(exc).lower()
    return "malformed" in text or "not a database" in text


def move_aside(path: Path) -> str:
    """Rename the database and its -wal/-shm to `<name>.corrupt-<UTC>`. Nothing is deleted."""
    stamp = _utc_stamp()
    aside = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while aside.exists():
        aside = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
        n += 1
    for suffix in ("", "-wal", "-shm"):
        part = Path(str(path) + suffix)
        if part.exists():
            part.rename(str(aside) + suffix)
    durable.sync_dir(path.parent)  # the fresh database starts beside the old one, never over it
    log.error("database %s was corrupt; moved aside to %s and started fresh", path, aside.name)
    return aside.name


def _check(conn: sqlite3.Connection) -> None:
    """Raise sqlite3.DatabaseError if the file is not a healthy database."""
    rows = conn.execute("PRAGMA quick_check").fetchall()
    if [tuple(r) for r in rows] != [("ok",)]:
        raise sqlite3.DatabaseError("database disk image is malformed: " + "; ".join(str(r[0]) for r in rows[:5]))


def _closed_cleanly(conn: sqlite3.Connection, version: int) -> bool:
    """Whether the last run recorded its clean close (`service_config` is there from schema 1)."""
    return version >= 1 and conn.execute("SELECT 1 FROM service_config WHERE key = ?", (CLOSED_CLEANLY,)
                                         ).fetchone() is not None


def _probe(path: Path) -> tuple[int | None, bool]:
    """Check an existing file through a read-only connection, before a writable one touches it,
    unless the last run closed it cleanly: `quick_check` reads the whole file (0.35 s at 280 MB),
    and only a crash, a kill or a power cut in the middle of a write can have left it damaged.

    Closing a writable connection to a corrupt WAL database checkpoints its -wal into it and
    deletes the -wal and -shm, and opening one switches a rollback-journal file to WAL: a file
    that is to be moved aside, or refused as too new, must stay as it was found. Returns the
    schema version, or None if there is no file or only a writer can read it (a hot journal),
    and whether it was checked.
    """
    if not path.exists():
        return None, False
    probe = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True, timeout=10.0)
    try:
        version = int(probe.execute("PRAGMA user_version").fetchone()[0])
        if version > latest_version() or _closed_cleanly(probe, version):  # too new: refused untouched
            return version, False
        _check(probe)
        return version, True
    except sqlite3.OperationalError as exc:
        if (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF == SQLITE_READONLY:
            return None, False
        raise
    finally:
        probe.close()


def _too_new(path: Path, current: int, known: int) -> StoreError:
    return StoreError(
        "database_too_new",
        f"The database {path} was written by a newer LMSP Tray (schema {current}, this version "
        f"knows up to {known}). It was left untouched; please install the newer version.")


def open_database(path: Path) -> Opened:
    """Open (creating if needed), check, and migrate the database at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    aside = None
    existed, started = path.exists(), time.monotonic()
    try:
        version, checked = _probe(path)
        if version is not None and version > latest_version():
            raise _too_new(path, version, latest_version())
        conn = connect(path)
        if version is None:
            _check(conn)
            checked = True
    except sqlite3.DatabaseError as exc:
        if not _is_corruption(exc):
            raise StoreError("database_unavailable", f"The database {path} cannot be opened: {exc}") from exc
        try:
            conn.close()
        except Exception:  # noqa: BLE001 - the handle may never have opened
            pass
        aside = move_aside(path)
        conn = connect(path)
        checked = True
    if existed:
        log.info("database %s (%.2f s)", "checked after an unclean end" if checked
                 else "closed cleanly by the last run: not checked", time.monotonic() - started)
    migrate(conn, path)
    _reclaimable(conn, path)
    # Committed (and fsynced) before anything else runs: a crash or a power cut from here on
    # leaves no record of a clean close, and the next start checks the file.
    try:
        conn.execute("DELETE FROM service_config WHERE key = ?", (CLOSED_CLEANLY,))
    except sqlite3.Error as exc:
        conn.close()
        raise StoreError("database_unavailable", f"The database {path} cannot be written to: {exc}") from exc
    return Opened(conn, aside, checked)


def close(conn: sqlite3.Connection) -> None:
    """Close the writer at a quit, after its last write: record the clean close (the next start
    skips `quick_check`), then empty the WAL into the file. A record that cannot be written (a full
    disk) only means that the next start checks."""
    try:
        conn.execute("INSERT INTO service_config(key, value) VALUES (?, 'true') ON CONFLICT(key) DO NOTHING",
                     (CLOSED_CLEANLY,))
    except sqlite3.Error as exc:
        log.warning("could not record the database's clean close (%s): the next start checks it", exc)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


def _reclaimable(conn: sqlite3.Connection, path: Path) -> None:
    """Switch a file made before auto_vacuum = INCREMENTAL (schema 6 and older) by the one VACUUM
    that takes: it rewrites the whole file, so it runs outside any transaction, hence not in a
    migration. Without room on the disk for the copy, the file works on as it is and the next
    start tries again."""
    if conn.execute("PRAGMA auto_vacuum").fetchone()[0] == AUTO_VACUUM_INCREMENTAL:
        return
    started = time.monotonic()
    try:
        conn.execute("VACUUM")
    except sqlite3.OperationalError as exc:
        log.warning("could not switch the database %s to give freed space back (%s); trying at the next start",
                    path, exc)
        return
    log.info("database switched to give freed space back to the disk (VACUUM, %.1f s)", time.monotonic() - started)


def migrate(conn: sqlite3.Connection, path: Path) -> None:
    steps = migrations()
    current = conn.execute("PRAGMA user_version").fetchone()[0]
    if current > len(steps):
        conn.close()
        raise _too_new(path, current, len(steps))
    if current == len(steps):
        return
    if current > 0:
        backup = path.with_name(f"{path.name}.backup-v{current}-{_utc_stamp()}")
        dest = sqlite3.connect(backup)
        with dest:
            conn.backup(dest)
        dest.close()
        log.info("backed up the database to %s before migrating", backup.name)
    for version, sql in steps[current:]:
        # DDL and the version bump commit together: a crash leaves the old or the new schema.
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in _statements(sql):
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {version}")
            conn.execute("COMMIT")
        except BaseException as exc:
            conn.execute("ROLLBACK")
            conn.close()
            if isinstance(exc, sqlite3.Error):
                raise StoreError("migration_failed", f"Updating the database {path} to schema {version} failed "
                                 f"({exc}); it was left at schema {current}, unchanged.") from exc
            raise
        log.info("database migrated to schema %d", version)


def _statements(sql: str) -> list[str]:
    """Split a migration file into statements (executescript would commit on its own)."""
    out, buf = [], ""
    for line in sql.splitlines(keepends=True):
        if line.lstrip().startswith("--"):
            continue
        buf += line
        if sqlite3.complete_statement(buf):
            out.append(buf.strip())
            buf = ""
    if buf.strip():
        out.append(buf.strip())
    return out
