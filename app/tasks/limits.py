"""Limits on queued work and stored bytes: one client can neither fill the queue nor the disk
for everyone (settings `max_queued_tasks_per_client`, `max_queued_tasks`,
`max_request_bytes_per_client`, `max_request_bytes`).

Every request, a generation's or a download's, is stored here, in the transaction that checks
the limits: two requests at once cannot both take the last place.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from app.errors import TooManyRequests
from app.store.config import MIB

QUEUE_RETRY_SECONDS = 30    # a place in the queue frees when a task ends: soon, usually
PURGE_INTERVAL_SECONDS = 600  # how often retention runs (app/core/housekeeping.py)


def store_request(conn: sqlite3.Connection, settings: dict[str, Any], request_id: str, client_id: str,
                  model_id: str, request: str, background: bool, metadata: str, now: float, **more: Any) -> None:
    """Insert a request row for one new task (`more`: other columns of it), or raise
    TooManyRequests naming the limit it would pass."""
    size = len(request.encode())
    _check_queue(conn, settings, client_id)
    _check_bytes(conn, settings, client_id, size, now)
    columns = {"id": request_id, "client_id": client_id, "model_id": model_id, "request": request,
               "background": int(background), "metadata": metadata, "created_at": now, "request_bytes": size, **more}
    conn.execute(f"INSERT INTO responses({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
                 tuple(columns.values()))


def _usage(conn: sqlite3.Connection, column: str, client_id: str) -> tuple[int, int]:
    """(this client's, everyone's) count from `client_usage`, which triggers keep exact in every
    transaction that changes it (migration 0010): one row per client, whatever is stored."""
    mine, everyone = conn.execute(f"SELECT COALESCE(SUM({column} * (client_id = ?)), 0), COALESCE(SUM({column}), 0) "
                                  "FROM client_usage", (client_id,)).fetchone()
    return int(mine), int(everyone)


def _check_queue(conn: sqlite3.Connection, settings: dict[str, Any], client_id: str) -> None:
    mine, everyone = _usage(conn, "unfinished", client_id)
    if mine >= settings["max_queued_tasks_per_client"]:
        raise TooManyRequests("too_many_queued_tasks", f"This client already has {mine} unfinished tasks, its limit "
                              f"(setting max_queued_tasks_per_client = {settings['max_queued_tasks_per_client']}). "
                              "Try again when some have finished, or cancel some.", QUEUE_RETRY_SECONDS)
    if everyone >= settings["max_queued_tasks"]:
        raise TooManyRequests("too_many_queued_tasks", f"The service already has {everyone} unfinished tasks from "
                              f"all clients, its limit (setting max_queued_tasks = {settings['max_queued_tasks']}). "
                              "Try again when some have finished.", QUEUE_RETRY_SECONDS)


def _check_bytes(conn: sqlite3.Connection, settings: dict[str, Any], client_id: str, size: int, now: float) -> None:
    mine, everyone = _usage(conn, "request_bytes", client_id)
    for used, limit, whose, setting in ((mine, settings["max_request_bytes_per_client"], client_id,
                                         "max_request_bytes_per_client"),
                                        (everyone, settings["max_request_bytes"], None, "max_request_bytes")):
        if used + size > limit:
            owner = "This client's" if whose else "All clients'"
            raise TooManyRequests(
                "storage_limit_reached", f"{owner} stored requests take {used / MIB:.1f} MiB; this one "
                f"({size / MIB:.1f} MiB) would pass the limit (setting {setting} = {limit / MIB:.0f} MiB). Delete "
                "finished responses (DELETE /v1/responses/{id}) or wait until retention removes them.",
                _until_purged(conn, settings, whose, now))


def _until_purged(conn: sqlite3.Connection, settings: dict[str, Any], client_id: str | None, now: float) -> int:
    """Seconds until retention removes the oldest finished request (of `client_id`, or anyone's)."""
    mine = " AND r.client_id = ?" if client_id else ""
    oldest = conn.execute("SELECT MIN(t.finished_at) FROM tasks t JOIN responses r ON r.id = t.response_id "
                          f"WHERE t.finished_at IS NOT NULL{mine}", (client_id,) if client_id else ()).fetchone()[0]
    if oldest is None:  # nothing finished yet: space comes back only as tasks finish and age
        return QUEUE_RETRY_SECONDS
    return max(QUEUE_RETRY_SECONDS, int(oldest + settings["retention_seconds"] - now) + PURGE_INTERVAL_SECONDS)

