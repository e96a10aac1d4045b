"""Settings in `service_config`: defaults, validation, reads and writes (LMSP §2b)."""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import socket
import sqlite3
from typing import Any

from app.errors import InvalidRequest

log = logging.getLogger(__name__)

ON_RESTART = ("fail", "retry", "resume")
MIB = 1024 * 1024
# The longest a model may be kept loaded unused: the idle setting's maximum, and Ollama's `keep_alive`'s.
MAX_IDLE_SECONDS = 365 * 86400

DEFAULTS: dict[str, Any] = {
    "host": "127.0.0.1",
    "port": 11535,
    "retention_seconds": 604800,
    "default_on_restart": "fail",
    "max_concurrent_tasks": 1,  # engines (copies of a model) at once
    # Tasks one loaded model serves at once, decoded together (continuous batching); 1: one at a time.
    "parallel": 4,
    "allowed_origins": [],
    "idempotency_ttl_seconds": 86400,
    "model_idle_ttl_seconds": 0,  # 0: never unload for idleness
    "allowed_hosts": [],
    "engine_mode": "auto",  # §11: auto falls back to safe per model when fast mode crashes
    "gpu": "auto",  # §18: a model's layers on the GPU the build sees, as many as fit; off: the CPU alone
    "max_connections": 256,  # open HTTP connections at once; capped at a quarter of the fd limit
    # Unfinished tasks (generations and downloads) one client, and all clients, may have at once.
    "max_queued_tasks_per_client": 100,
    "max_queued_tasks": 1000,
    # Bytes of stored requests (prompts), finished ones kept for `retention_seconds` included.
    "max_request_bytes_per_client": 256 * MIB,
    "max_request_bytes": 1024 * MIB,
    # §11 remote endpoints: how long a task waits for one to answer; tasks on them at once.
    "remote_wait_seconds": 300,
    "max_concurrent_remote_tasks": 8,
    # §15 Ollama's API: off; `token` (/api/* on this port, a paired token); `open` (also a listener
    # on 127.0.0.1:ollama_port where a request without a token acts as one built-in client).
    "ollama_api": "off",
    "ollama_port": 11434,
    "ollama_scopes": ["models:read", "responses:write"],
}


def _int_in(lo: int, hi: int) -> Any:
    def check(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi
    return check


def _str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(s, str) and s for s in v)


# What a browser sends as Origin: scheme://host[:port], nothing after it, in ASCII: the host is
# letters, digits and hyphens between dots (an international name in its punycode form, `xn--`),
# or a bracketed IPv6 address. No wildcard: each web page that may call the service is named. No
# other character: the origin is what the owner judges a pairing by, and bidi controls or
# look-alike letters (a Cyrillic `і`) would show another site's name.
ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://(?:[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?\Z")


def _origins(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(s, str) and ORIGIN.match(s) for s in v)


def _host(v: Any) -> bool:
    """An address this computer can listen on, tried now: a bad one saved would only show at the
    next start, as a service that does not start. (One bind to port 0 on a local address: no
    lookup, no wait, fine on the event loop.)"""
    if v == "localhost":
        return True
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(v).version == 6 else socket.AF_INET
    except ValueError:
        return False
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((v, 0))
        except OSError:
            return False
    return True


def _ollama_scopes(v: Any) -> bool:
    """Scopes for apps that come without a token: any but `admin`, which no unknown app gets."""
    return isinstance(v, list) and all(s in OLLAMA_SCOPES for s in v) and len(set(v)) == len(v)


OLLAMA_SCOPES = ("models:read", "models:write", "responses:read", "responses:write", "tasks:read", "tasks:cancel",
                 "metrics:read")


# Said with the error, for values whose rule the key's name does not tell.
HINTS = {"host": " Use 'localhost' or an IP address of this computer, such as 127.0.0.1 or 0.0.0.0.",
         "allowed_origins": " Each one is a web origin as browsers send it, scheme://host[:port] in ASCII (an "
                            "international domain name in its punycode form, xn--...).",
         "ollama_scopes": f" Choose among {', '.join(OLLAMA_SCOPES)} (never admin)."}

VALIDATORS: dict[str, Any] = {
    "host": lambda v: isinstance(v, str) and _host(v),
    "port": _int_in(0, 65535),
    "retention_seconds": _int_in(60, 10 * 365 * 86400),
    "default_on_restart": lambda v: v in ON_RESTART,
    "max_concurrent_tasks": _int_in(1, 16),
    "parallel": _int_in(1, 64),
    "allowed_origins": _origins,
    "idempotency_ttl_seconds": _int_in(60, 365 * 86400),
    "model_idle_ttl_seconds": _int_in(0, MAX_IDLE_SECONDS),
    "allowed_hosts": _str_list,
    "engine_mode": lambda v: v in ("auto", "fast", "safe"),
    "gpu": lambda v: v in ("auto", "off"),
    "max_connections": _int_in(8, 65536),
    "max_queued_tasks_per_client": _int_in(1, 100_000),
    "max_queued_tasks": _int_in(1, 1_000_000),
    "max_request_bytes_per_client": _int_in(MIB, 1 << 40),
    "max_request_bytes": _int_in(MIB, 1 << 40),
    "remote_wait_seconds": _int_in(0, 7 * 86400),
    "max_concurrent_remote_tasks": _int_in(1, 256),
    "ollama_api": lambda v: v in ("off", "token", "open"),
    "ollama_port": _int_in(1, 65535),
    "ollama_scopes": _ollama_scopes,
}


def validate(changes: Any) -> dict[str, Any]:
    if not isinstance(changes, dict):
        raise InvalidRequest("Settings must be a JSON object.")
    for key, value in changes.items():
        if key not in VALIDATORS:
            raise InvalidRequest(f"Unknown setting {key!r}.", param=key)
        if not VALIDATORS[key](value):
            raise InvalidRequest(f"Invalid value for {key!r}: {value!r}.{HINTS.get(key, '')}", param=key)
    return changes


def load(conn: sqlite3.Connection) -> dict[str, Any]:
    stored = {row["key"]: json.loads(row["value"]) for row in conn.execute("SELECT key, value FROM service_config")}
    # A value saved before its rule was tightened, or a host this computer cannot listen on now
    # (an interface not up yet), gives way to the default, so the service still starts.
    settings = dict(DEFAULTS)
    for key, value in stored.items():
        if key in DEFAULTS and VALIDATORS[key](value):
            settings[key] = value
        elif key in DEFAULTS:
            log.warning("setting %s: the stored value %r is not usable now; using %r", key, value, DEFAULTS[key])
    return settings


def save(conn: sqlite3.Connection, changes: dict[str, Any]) -> None:
    conn.executemany(
        "INSERT INTO service_config(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
        [(k, json.dumps(v)) for k, v in changes.items()])


def get_value(conn: sqlite3.Connection, key: str) -> Any:
    row = conn.execute("SELECT value FROM service_config WHERE key = ?", (key,)).fetchone()
    return json.loads(row["value"]) if row else None
