"""Idempotency keys (LMSP §7, after the IETF draft and Stripe): a retried request is answered
from what the first one stored, and never executed twice."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from dataclasses import dataclass
from typing import Any

from app.errors import Conflict, InvalidRequest, LmspError


@dataclass(frozen=True)
class Stored:
    status: int
    body: dict[str, Any]


def digest(method: str, path: str, client_id: str, body: Any) -> str:
    canonical = json.dumps([method, path, client_id, body], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def check_key(key: str) -> str:
    if not key or len(key) > 255 or not key.isprintable():
        raise InvalidRequest("An Idempotency-Key is 1 to 255 printable characters.", param="Idempotency-Key")
    return key


def claim(conn: sqlite3.Connection, client_id: str, key: str, request_digest: str, ttl: int) -> Stored | None:
    """None: the key is now ours and in flight. Otherwise the stored answer to replay."""
    now = time.time()
    conn.execute("DELETE FROM idempotency_keys WHERE client_id = ? AND key = ? AND created_at < ?",
                 (client_id, key, now - ttl))
    row = conn.execute("SELECT * FROM idempotency_keys WHERE client_id = ? AND key = ?", (client_id, key)).fetchone()
    if row is None:
        conn.execute("INSERT INTO idempotency_keys(client_id, key, request_digest, created_at) VALUES (?, ?, ?, ?)",
                     (client_id, key, request_digest, now))
        return None
    if row["request_digest"] != request_digest:
        raise LmspError("idempotency_key_reused", "This Idempotency-Key was used with a different request.",
                        status=422)
    if row["status_code"] is None:
        raise Conflict("idempotency_key_in_use", "A request with this Idempotency-Key is still being processed.")
    return Stored(row["status_code"], json.loads(row["response_body"]))


def finish(conn: sqlite3.Connection, client_id: str, key: str, status: int, body: dict[str, Any],
           response_id: str | None = None) -> None:
    """Store the answer; `response_id`: the response it is about (a failure's body does not name
    it), so that deleting the response frees the key."""
    conn.execute("UPDATE idempotency_keys SET status_code = ?, response_body = ?, response_id = ? "
                 "WHERE client_id = ? AND key = ?", (status, json.dumps(body), response_id, client_id, key))


def release(conn: sqlite3.Connection, client_id: str, key: str) -> None:
    """Forget an in-flight key whose request did nothing, so a retry can run."""
    conn.execute("DELETE FROM idempotency_keys WHERE client_id = ? AND key = ? AND status_code IS NULL",
                 (client_id, key))


def forget_response(conn: sqlite3.Connection, response_id: str) -> None:
    """A deleted response's keys go with it: a retry creates anew, never replays a dead task."""
    conn.execute("DELETE FROM idempotency_keys WHERE response_id = ?", (response_id,))


def forget_in_flight(conn: sqlite3.Connection) -> int:
    """At startup: keys whose request died with the previous process can be used again."""
    return conn.execute("DELETE FROM idempotency_keys WHERE status_code IS NULL").rowcount
