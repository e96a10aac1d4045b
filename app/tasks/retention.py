"""Retention (LMSP §8): finished work older than the retention period goes; unfinished never."""

from __future__ import annotations

import sqlite3
import time

from app.tasks.states import TERMINAL


def purge(conn: sqlite3.Connection, retention_seconds: int, idempotency_ttl_seconds: int,
          now: float | None = None) -> dict[str, int]:
    now = time.time() if now is None else now
    marks = ",".join("?" * len(TERMINAL))
    # Deleting the response cascades to its task and the task's events.
    gone = conn.execute(
        f"DELETE FROM responses WHERE id IN (SELECT response_id FROM tasks WHERE status IN ({marks}) "
        "AND finished_at IS NOT NULL AND finished_at < ?)", (*TERMINAL, now - retention_seconds)).rowcount
    keys = conn.execute("DELETE FROM idempotency_keys WHERE created_at < ?", (now - idempotency_ttl_seconds,)).rowcount
    # Pairing requests long over, and clients revoked long ago (the requests that created them first).
    old = now - retention_seconds
    pairings = conn.execute("DELETE FROM pairings WHERE expires_at < ? OR client_id IN "
                            "(SELECT id FROM clients WHERE revoked_at < ?)", (old, old)).rowcount
    clients = conn.execute("DELETE FROM clients WHERE revoked_at < ?", (old,)).rowcount
    return {"responses": gone, "idempotency_keys": keys, "pairings": pairings, "clients": clients,
            "pages_reclaimed": reclaim(conn)}


def reclaim(conn: sqlite3.Connection) -> int:
    """Give the pages that deletes freed back to the disk (the file has auto_vacuum = INCREMENTAL;
    the file shrinks at the next checkpoint). One step of the pragma frees one page and Python's
    sqlite3 steps a statement without result columns once: one execute per page, microseconds each."""
    pages = int(conn.execute("PRAGMA freelist_count").fetchone()[0])
    for _ in range(pages):
        conn.execute("PRAGMA incremental_vacuum")
    return pages
