"""Pairing (LMSP §3): a local app asks, the person approves, the app gets a scoped token once."""

from __future__ import annotations

import json
import math
import secrets
import sqlite3
import time
import unicodedata
from typing import Any

from app.core.auth import SCOPES, new_token, token_hash
from app.errors import Conflict, InvalidRequest, NotFound, TooManyRequests

LIFETIME_SECONDS = 300
# Waiting requests: in all (the owner looks at each), and per requester (app/server/peer.py), so
# one requester filling its share leaves room for everyone else; one per requester and name.
# Where the system does not tell the local user, every local app is one requester: its share
# is then the old global cap.
MAX_PENDING, MAX_PENDING_PER_REQUESTER = 100, 20
NOTIFY_EVERY_SECONDS = 60.0  # at most one desktop notification per requester in this time
# Control and format characters (ESC, BEL, NUL, bidi overrides, zero-width marks) and line or
# paragraph separators: in a terminal or a notification they redraw or reorder what is shown.
UNSAFE = ("Cc", "Cf", "Cs", "Zl", "Zp")


# Blanks that are not U+0020 (U+3000 is two columns wide), and letters that show as blanks: a
# name padded with them pushes the real code and scopes off a terminal's row, after fake ones.
BLANK_LETTERS = {"\u115f", "\u1160", "\u2800", "\u3164", "\uffa0"}  # Hangul fillers, Braille blank
MAX_MARKS = 3  # combining marks on one letter: Vietnamese needs two; a stack of dozens overdraws rows


def unsafe(char: str) -> bool:
    return unicodedata.category(char) in UNSAFE


def blank(char: str) -> bool:
    return (unicodedata.category(char) == "Zs" and char != " ") or char in BLANK_LETTERS


def stacked(text: str) -> bool:
    """Whether more than MAX_MARKS combining marks follow one another anywhere in `text`."""
    run = 0
    for char in text:
        run = run + 1 if unicodedata.category(char) in ("Mn", "Me") else 0
        if run > MAX_MARKS:
            return True
    return False


def shown(text: str) -> str:
    """`text` with every unsafe character written as a visible escape (`\\u202e`)."""
    return "".join(f"\\u{ord(c):04x}" if unsafe(c) else c for c in text)


def parse(body: Any) -> tuple[str, list[str]]:
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    for key in body:
        if key not in ("client_name", "scopes"):
            raise InvalidRequest(f"Unknown parameter {key!r}.", param=key)
    name = body.get("client_name")
    if not isinstance(name, str) or not name.strip() or len(name) > 100:
        raise InvalidRequest("`client_name` must be a name of 1 to 100 characters.", param="client_name")
    if any(unsafe(c) for c in name):
        raise InvalidRequest("`client_name` must not contain control or formatting characters (newlines, "
                             "escapes, direction overrides).", param="client_name")
    if any(blank(c) for c in name) or stacked(name):
        raise InvalidRequest("`client_name` may have no blanks but the ordinary space (no wide or no-break "
                             f"spaces), and at most {MAX_MARKS} accents on a letter.", param="client_name")
    scopes = body.get("scopes")
    if not isinstance(scopes, list) or not scopes or not all(isinstance(s, str) and s in SCOPES for s in scopes):
        raise InvalidRequest(f"`scopes` must be a non-empty list drawn from {list(SCOPES)}.", param="scopes")
    return name.strip(), sorted(set(scopes))


def status_of(row: sqlite3.Row, now: float | None = None) -> str:
    if row["status"] == "pending" and (now or time.time()) >= row["expires_at"]:
        return "expired"
    return str(row["status"])


def pairing_object(row: sqlite3.Row) -> dict[str, Any]:
    return {"id": row["id"], "object": "pairing", "status": status_of(row), "client_name": row["client_name"],
            "scopes": json.loads(row["scopes"]), "code": row["code"], "created_at": row["created_at"],
            "expires_at": row["expires_at"], "client_id": row["client_id"], "origin": row["origin"]}


def create(conn: sqlite3.Connection, name: str, scopes: list[str], theirs: set[str],
           origin: str | None = None) -> sqlite3.Row:
    """A new pending request; `theirs`: the ids of the requests this requester made before;
    `origin`: the web page's, for a request made from one."""
    now = time.time()
    waiting = conn.execute("SELECT id, client_name, expires_at FROM pairings WHERE status = 'pending' "
                           "AND expires_at > ?", (now,)).fetchall()
    own = [r for r in waiting if r["id"] in theirs]

    def retry_after(rows: list[sqlite3.Row]) -> int:  # until the first of them expires
        return max(1, math.ceil(min(float(r["expires_at"]) for r in rows) - now))

    same = [r for r in own if r["client_name"] == name]
    if same:
        raise TooManyRequests("too_many_pairings", f"A pairing request from {name!r} is already waiting; poll it, "
                              "or try again when it has expired.", retry_after(same))
    if len(own) >= MAX_PENDING_PER_REQUESTER or len(waiting) >= MAX_PENDING:
        raise TooManyRequests("too_many_pairings", "Too many pairing requests are waiting; try again later.",
                              retry_after(own if len(own) >= MAX_PENDING_PER_REQUESTER else waiting))
    pairing_id = "pair_" + secrets.token_urlsafe(24)
    code = f"{secrets.randbelow(1000):03d}-{secrets.randbelow(1000):03d}"
    conn.execute("INSERT INTO pairings(id, client_name, scopes, code, status, created_at, expires_at, origin) "
                 "VALUES (?, ?, ?, ?, 'pending', ?, ?, ?)",
                 (pairing_id, name, json.dumps(scopes), code, now, now + LIFETIME_SECONDS, origin))
    return get(conn, pairing_id)


def get(conn: sqlite3.Connection, pairing_id: str) -> sqlite3.Row:
    row: sqlite3.Row | None = conn.execute("SELECT * FROM pairings WHERE id = ?", (pairing_id,)).fetchone()
    if row is None:
        raise NotFound("pairing", pairing_id)
    return row


def pending(conn: sqlite3.Connection) -> list[sqlite3.Row]:
    return conn.execute("SELECT * FROM pairings WHERE status = 'pending' AND expires_at > ? ORDER BY created_at",
                        (time.time(),)).fetchall()


def decide(conn: sqlite3.Connection, pairing_id: str, approve: bool) -> tuple[sqlite3.Row, str | None]:
    """Approve (creating the client; returns its token) or deny a pending, unexpired request."""
    row = get(conn, pairing_id)
    if status_of(row) != "pending":
        raise Conflict("pairing_not_pending", f"This pairing request is already {status_of(row)}.")
    token = None
    client_id = None
    if approve:
        token = new_token()
        client_id = "client_" + secrets.token_hex(8)
        conn.execute("INSERT INTO clients(id, name, token_hash, scopes, created_at) VALUES (?, ?, ?, ?, ?)",
                     (client_id, row["client_name"], token_hash(token), row["scopes"], time.time()))
        if row["origin"] is not None:  # asked from a web page: that page may use the token
            conn.execute("INSERT INTO client_origins(client_id, origin) VALUES (?, ?)", (client_id, row["origin"]))
    conn.execute("UPDATE pairings SET status = ?, client_id = ? WHERE id = ? AND status = 'pending'",
                 ("approved" if approve else "denied", client_id, pairing_id))
    return get(conn, pairing_id), token


def hand_over(conn: sqlite3.Connection, pairing_id: str) -> bool:
    """Mark the token as given; True only the first time (a token is returned exactly once)."""
    return conn.execute("UPDATE pairings SET token_given = 1 WHERE id = ? AND status = 'approved' "
                        "AND token_given = 0", (pairing_id,)).rowcount == 1


def client_origins(conn: sqlite3.Connection) -> dict[str, frozenset[str]]:
    """The web origins of each client that has any (revoking a client removes its own)."""
    found: dict[str, set[str]] = {}
    for row in conn.execute("SELECT client_id, origin FROM client_origins"):
        found.setdefault(row["client_id"], set()).add(row["origin"])
    return {client_id: frozenset(origins) for client_id, origins in found.items()}


def revoke(conn: sqlite3.Connection, client_id: str) -> bool:
    """Revoke a live client and forget its web origins; False if there is no such client."""
    done = conn.execute("UPDATE clients SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
                        (time.time(), client_id)).rowcount
    conn.execute("DELETE FROM client_origins WHERE client_id = ?", (client_id,))
    return bool(done)
