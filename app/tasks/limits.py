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
from app.tasks.retention import UNSTORED_EVERY_SECONDS, UNSTORED_GRACE_SECONDS
from app.tasks.states import UNFINISHED

QUEUE_RETRY_SECONDS = 30    # a place in the queue frees when a task ends: soon, usually
PURGE_INTERVAL_SECONDS = 600  # how often retention runs (app/core/housekeeping.py)
# The apps that share one client (the Ollama listener's apps without a token, app/core/auth.py
# `Client.party`) may each use this part of its per-client limits: one cannot spend them all.
PARTY_SHARE = 4
# One app: a client, or one party of a client that several apps share. Apps take turns in the
# queue, share an engine's slots and use models (app/tasks/kinds/generation_writes.py, the engine
# pool) under this key: `Client.app` in Python, APP over a `responses r` row in SQL.
APP = "r.client_id || COALESCE(char(31) || r.party, '')"


def app_key(client_id: str, party: str | None) -> str:
    return client_id if party is None else f"{client_id}\x1f{party}"


def party_share(limit: int, least: int = 1) -> int:
    """One party's part of a per-client `limit`, never below `least`."""
    return max(least, limit // PARTY_SHARE)


_UNFINISHED = ", ".join(f"'{status}'" for status in UNFINISHED)


def store_request(conn: sqlite3.Connection, settings: dict[str, Any], request_id: str, client_id: str,
                  model_id: str, request: str, background: bool, metadata: str, now: float, *,
                  party: str | None = None, **more: Any) -> None:
    """Insert a request row for one new task (`more`: other columns of it), or raise
    TooManyRequests naming the limit it would pass. `party`: which of the apps sharing the client
    sent it (app/core/auth.py `Client.party`); it may use 1/PARTY_SHARE of the client's limits."""
    size = len(request.encode())
    _check_queue(conn, settings, client_id, party)
    _check_bytes(conn, settings, client_id, party, size, now)
    columns = {"id": request_id, "client_id": client_id, "model_id": model_id, "request": request,
               "background": int(background), "metadata": metadata, "created_at": now, "request_bytes": size,
               "party": party, **more}
    conn.execute(f"INSERT INTO responses({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
                 tuple(columns.values()))


def _usage(conn: sqlite3.Connection, column: str, client_id: str) -> tuple[int, int]:
    """(this client's, everyone's) count from `client_usage`, which triggers keep exact in every
    transaction that changes it (migration 0010): one row per client, whatever is stored."""
    mine, everyone = conn.execute(f"SELECT COALESCE(SUM({column} * (client_id = ?)), 0), COALESCE(SUM({column}), 0) "
                                  "FROM client_usage", (client_id,)).fetchone()
    return int(mine), int(everyone)


def _party_usage(conn: sqlite3.Connection, client_id: str, party: str) -> tuple[int, int]:
    """(unfinished tasks, stored request bytes) of one party of a client, counted from its rows:
    its requests are `store: false` (app/server/ollama.py), gone a minute and a half after they
    end (app/tasks/retention.py), so it has few."""
    unfinished, stored = conn.execute(
        f"SELECT COALESCE(SUM(t.status IN ({_UNFINISHED})), 0), COALESCE(SUM(r.request_bytes), 0) FROM responses r "
        "LEFT JOIN tasks t ON t.response_id = r.id WHERE r.client_id = ? AND r.party = ?",
        (client_id, party)).fetchone()
    return int(unfinished), int(stored)


def _check_queue(conn: sqlite3.Connection, settings: dict[str, Any], client_id: str, party: str | None) -> None:
    mine, everyone = _usage(conn, "unfinished", client_id)
    per_client = settings["max_queued_tasks_per_client"]
    if party is not None:
        theirs = _party_usage(conn, client_id, party)[0]
        if theirs >= party_share(per_client):
            raise TooManyRequests("too_many_queued_tasks", f"This app already has {theirs} unfinished tasks, its "
                                  f"limit (setting max_queued_tasks_per_client / {PARTY_SHARE}, each app's part of "
                                  "the client the apps without a token share). Try again when some have finished.",
                                  QUEUE_RETRY_SECONDS)
    if mine >= per_client:
        raise TooManyRequests("too_many_queued_tasks", f"This client already has {mine} unfinished tasks, its limit "
                              f"(setting max_queued_tasks_per_client = {per_client}). "
                              "Try again when some have finished, or cancel some.", QUEUE_RETRY_SECONDS)
    if everyone >= settings["max_queued_tasks"]:
        raise TooManyRequests("too_many_queued_tasks", f"The service already has {everyone} unfinished tasks from "
                              f"all clients, its limit (setting max_queued_tasks = {settings['max_queued_tasks']}). "
                              "Try again when some have finished.", QUEUE_RETRY_SECONDS)


Check = tuple[int, int, tuple[str, str | None] | None, str, str]  # used, limit, whose, who, which limit


def _check_bytes(conn: sqlite3.Connection, settings: dict[str, Any], client_id: str, party: str | None, size: int,
                 now: float) -> None:
    mine, everyone = _usage(conn, "request_bytes", client_id)
    per_client = settings["max_request_bytes_per_client"]
    checks: list[Check] = [
        (mine, per_client, (client_id, None), "This client's", "setting max_request_bytes_per_client"),
        (everyone, settings["max_request_bytes"], None, "All clients'", "setting max_request_bytes")]
    later = "Delete finished responses (DELETE /v1/responses/{id}) or wait until retention removes them."
    if party is not None:
        checks.insert(0, (_party_usage(conn, client_id, party)[1], party_share(per_client, MIB),
                          (client_id, party), "This app's", f"setting max_request_bytes_per_client / {PARTY_SHARE}, "
                          "each app's part of the client the apps without a token share"))
        later = "They are not kept: each leaves a minute after its answer."
    for used, limit, whose, who, setting in checks:
        if used + size > limit:
            raise TooManyRequests(
                "storage_limit_reached", f"{who} stored requests take {used / MIB:.1f} MiB; this one "
                f"({size / MIB:.1f} MiB) would pass the limit ({setting} = {limit / MIB:.0f} MiB). {later}",
                _until_purged(conn, settings, whose, now))


def _until_purged(conn: sqlite3.Connection, settings: dict[str, Any], whose: tuple[str, str | None] | None,
                  now: float) -> int:
    """Seconds until retention removes the oldest finished request (of `whose`: a client, or one
    of its parties; or anyone's). A `store: false` one goes UNSTORED_GRACE_SECONDS after it ended,
    at the next of the purges every UNSTORED_EVERY_SECONDS; a stored one after `retention_seconds`,
    at the next of the purges every PURGE_INTERVAL_SECONDS."""
    mine = "" if whose is None else " AND r.client_id = ?" + (" AND r.party = ?" if whose[1] else "")
    params = (settings["retention_seconds"] + PURGE_INTERVAL_SECONDS, UNSTORED_GRACE_SECONDS + UNSTORED_EVERY_SECONDS,
              *(() if whose is None else [w for w in whose if w]))
    gone = conn.execute("SELECT MIN(t.finished_at + CASE WHEN r.store THEN ? ELSE ? END) FROM tasks t "
                        f"JOIN responses r ON r.id = t.response_id WHERE t.finished_at IS NOT NULL{mine}",
                        params).fetchone()[0]
    if gone is None:  # nothing finished yet: space comes back only as tasks finish and age
        return QUEUE_RETRY_SECONDS
    return max(QUEUE_RETRY_SECONDS, int(gone - now))
