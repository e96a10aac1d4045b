"""Ids of the things the service creates: a prefix saying what it is, 96 random bits."""

from __future__ import annotations

import secrets


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"
