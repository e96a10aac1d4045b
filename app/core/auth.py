"""Clients, tokens and scopes (LMSP §3). Only sha256 hashes of tokens are ever stored."""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import sqlite3
import time
from dataclasses import dataclass

from app.tasks.limits import app_key, party_share

SCOPES = ("models:read", "models:write", "responses:read", "responses:write",
          "tasks:read", "tasks:cancel", "metrics:read", "admin")
OWNER_ID = "client_owner"
# LMSP §15: the built-in client of the Ollama listener, for the apps that come without a token.
OLLAMA_ID, OLLAMA_NAME = "client_ollama", "Apps using the Ollama API"


@dataclass(frozen=True)
class Client:
    id: str
    name: str
    scopes: frozenset[str]
    origins: frozenset[str] = frozenset()  # web pages that may use its token (LMSP §16)
    # Which of the apps that share this client sent the request (app/server/peer.py `party`): the
    # Ollama listener's apps without a token are one client, but each has its own share of its limits.
    party: str | None = None

    @property
    def is_admin(self) -> bool:
        return "admin" in self.scopes

    def allows(self, scope: str) -> bool:
        return self.is_admin or scope in self.scopes

    @property
    def app(self) -> str:
        """Which app this is, where several share the client: its turns, slots and models go by it."""
        return app_key(self.id, self.party)

    def share(self, limit: int) -> int:
        """This request's sender's part of a per-client `limit`: all of it, or a party's part."""
        return limit if self.party is None else party_share(limit)


OWNER = Client(OWNER_ID, "Owner", frozenset({"admin"}))  # the desktop app acts as the owner


def new_token() -> str:
    return "lmsp_" + secrets.token_urlsafe(32)  # 256 random bits


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def install_owner(conn: sqlite3.Connection, token: str) -> None:
    """Make `token` the owner's (admin) token, replacing any earlier one."""
    conn.execute(
        "INSERT INTO clients(id, name, token_hash, scopes, is_owner, created_at) VALUES (?, 'Owner', ?, ?, 1, ?) "
        "ON CONFLICT(id) DO UPDATE SET token_hash = excluded.token_hash, revoked_at = NULL",
        (OWNER_ID, token_hash(token), json.dumps(["admin"]), time.time()))


def install_ollama(conn: sqlite3.Connection, scopes: list[str] | None) -> None:
    """The built-in Ollama client with `scopes`, or revoked (None). Its token hash is of a token
    nobody is given: it is never authenticated by a token, only by arriving on the Ollama listener."""
    if scopes is None:
        conn.execute("UPDATE clients SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", (time.time(), OLLAMA_ID))
        return
    conn.execute(
        "INSERT INTO clients(id, name, token_hash, scopes, created_at) VALUES (?, ?, ?, ?, ?) "
        "ON CONFLICT(id) DO UPDATE SET scopes = excluded.scopes, revoked_at = NULL",
        (OLLAMA_ID, OLLAMA_NAME, token_hash(new_token()), json.dumps(scopes), time.time()))


def owner_matches(conn: sqlite3.Connection, token: str) -> bool:
    row = conn.execute("SELECT token_hash FROM clients WHERE id = ?", (OWNER_ID,)).fetchone()
    return row is not None and hmac.compare_digest(row["token_hash"], token_hash(token))


def authenticate(conn: sqlite3.Connection, token: str) -> Client | None:
    """The client a bearer token belongs to, or None. The lookup is by hash (an index probe
    on a value an attacker cannot steer), then compared in constant time."""
    digest = token_hash(token)
    row = conn.execute("SELECT id, name, scopes, token_hash FROM clients WHERE token_hash = ? AND revoked_at IS NULL",
                       (digest,)).fetchone()
    if row is None or not hmac.compare_digest(row["token_hash"], digest):
        return None
    origins = conn.execute("SELECT origin FROM client_origins WHERE client_id = ?", (row["id"],)).fetchall()
    return Client(row["id"], row["name"], frozenset(json.loads(row["scopes"])), frozenset(o[0] for o in origins))


def touch(conn: sqlite3.Connection, client_id: str) -> None:
    conn.execute("UPDATE clients SET last_used_at = ? WHERE id = ?", (time.time(), client_id))
