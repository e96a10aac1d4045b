"""Retention (LMSP §8): finished work older than the retention period goes; unfinished never.

A `store: false` response (LMSP §12) goes much sooner: UNSTORED_GRACE_SECONDS after it ended,
long enough for its caller (always in the foreground) to have its answer, and at the latest when
the service stops (or, after a crash, starts again); while it runs it is kept like any task, so
recovery still applies to it."""

from __future__ import annotations

import sqlite3
import time

from app.tasks.states import TERMINAL

UNSTORED_GRACE_SECONDS = 60
UNSTORED_EVERY_SECONDS = 30  # how often they are purged (app/core/housekeeping.py)


def purge(conn: sqlite3.Connection, retention_seconds: int, idempotency_ttl_seconds: int,
          now: float | None = None) -> dict[str, int]:
    now = time.time() if now is None else now
    marks = ",".join("?" * len(TERMINAL))
    gone = _drop(conn, f"SELECT response_id FROM tasks WHERE status IN ({marks}) AND finished_at IS NOT NULL "
                 "AND finished_at < ?", (*TERMINAL, now - retention_seconds))
    keys = conn.execute("DELETE FROM idempotency_keys WHERE created_at < ?", (now - idempotency_ttl_seconds,)).rowcount
    # Pairing requests long over, and clients revoked long ago (the requests that created them first).
    old = now - retention_seconds
    pairings = conn.execute("DELETE FROM pairings WHERE expires_at < ? OR client_id IN "
                            "(SELECT id FROM clients WHERE revoked_at < ?)", (old, old)).rowcount
    clients = conn.execute("DELETE FROM clients WHERE revoked_at < ?", (old,)).rowcount
    unstored = purge_unstored(conn, now)
    return {"responses": gone, "unstored": unstored, "idempotency_keys": keys, "pairings": pairings,
            "clients": clients, "pages_reclaimed": reclaim(conn)}


def purge_unstored(conn: sqlite3.Connection, now: float | None = None, grace: float = UNSTORED_GRACE_SECONDS) -> int:
    """Delete the `store: false` responses that ended more than `grace` seconds ago: request,
    output, events and task (cascade), and the idempotency keys that kept a copy of the answer."""
    now = time.time() if now is None else now
    marks = ",".join("?" * len(TERMINAL))
    ended = (f"SELECT r.id FROM responses r JOIN tasks t ON t.response_id = r.id WHERE r.store = 0 "
             f"AND t.status IN ({marks}) AND t.finished_at <= ?")
    return _drop(conn, ended, (*TERMINAL, now - grace))


def _drop(conn: sqlite3.Connection, ids: str, params: tuple[object, ...]) -> int:
    """Delete the responses the query `ids` selects (cascading to task, output and events) and
    the idempotency keys about them: a retry then creates anew instead of replaying a response
    that is gone (as when one is deleted)."""
    conn.execute(f"DELETE FROM idempotency_keys WHERE response_id IN ({ids})", params)
    return conn.execute(f"DELETE FROM responses WHERE id IN ({ids})", params).rowcount


def reclaim(conn: sqlite3.Connection) -> int:
    """Give the pages that deletes freed back to the disk (the file has auto_vacuum = INCREMENTAL;
    the file shrinks at the next checkpoint). One step of the pragma frees one page and Python's
    sqlite3 steps a statement without result columns once: one execute per page, microseconds each."""
    pages = int(conn.execute("PRAGMA freelist_count").fetchone()[0])
    for _ in range(pages):
        conn.execute("PRAGMA incremental_vacuum")
    return pages
