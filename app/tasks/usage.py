"""What each client used (LMSP §17): the rows of `usage_days`, summed as a report asks.

The counting itself is in the database (migration 0015): triggers add a task's request in the
transaction that creates it and its end in the one that ends it. Days are UTC days: a report
means the same whichever time zone the service or the app is in.
"""

from __future__ import annotations

import datetime
import sqlite3
import time
from dataclasses import dataclass
from typing import Any

from app.errors import InvalidRequest

GROUPS = ("day", "client", "model")  # the order of a report's keys, and of its sort
COUNTS = ("requests", "tasks_completed", "tasks_failed", "tasks_cancelled", "input_tokens", "output_tokens",
          "generation_seconds", "downloaded_bytes")
_COLUMNS = {"day": ("u.day",), "client": ("u.client_id", "COALESCE(c.name, u.client_id)"), "model": ("u.model_id",)}
_KEYS = {"day": ("day",), "client": ("client_id", "client_name"), "model": ("model",)}
EPOCH = datetime.date(1970, 1, 1)


@dataclass(frozen=True)
class Query:
    first: int | None        # the first day counted (UTC days since 1970-01-01); None: from the start
    last: int | None         # the last day counted, included; None: up to today
    group_by: tuple[str, ...]


def today(now: float | None = None) -> int:
    return int((time.time() if now is None else now) // 86400)


def day_text(day: int) -> str:
    return (EPOCH + datetime.timedelta(days=day)).isoformat()


def _day(text: str | None, param: str) -> int | None:
    if text is None:
        return None
    try:
        return (datetime.date.fromisoformat(text) - EPOCH).days
    except ValueError:
        raise InvalidRequest(f"`{param}` must be a date, YYYY-MM-DD (a UTC day).", param=param) from None


def parse(start: str | None, end: str | None, group_by: str | None) -> Query:
    """The query string's `from`, `to` (dates, both included) and `group_by` (one of day, client,
    model, or several joined by commas; default client)."""
    first, last = _day(start, "from"), _day(end, "to")
    if first is not None and last is not None and first > last:
        raise InvalidRequest("`from` must not be after `to`.", param="from")
    groups = ("client" if group_by is None else group_by).split(",")
    if not groups or any(g not in GROUPS for g in groups) or len(set(groups)) < len(groups):
        raise InvalidRequest("`group_by` must be day, client or model, or several of them joined by commas.",
                             param="group_by")
    return Query(first, last, tuple(g for g in GROUPS if g in groups))


def report(conn: sqlite3.Connection, query: Query, client_id: str | None) -> list[dict[str, Any]]:
    """The sums per group of `query`, of every client, or of `client_id` alone; in the order of
    the groups' keys (days, then clients' ids, then models)."""
    where, params = ["1"], []
    for clause, value in (("u.day >= ?", query.first), ("u.day <= ?", query.last), ("u.client_id = ?", client_id)):
        if value is not None:
            where.append(clause)
            params.append(value)
    columns = [column for group in query.group_by for column in _COLUMNS[group]]
    keys = [key for group in query.group_by for key in _KEYS[group]]
    sums = ", ".join(f"SUM(u.{count})" for count in COUNTS)
    grouping = ", ".join(columns)
    rows = conn.execute(f"SELECT {grouping}, {sums} FROM usage_days u LEFT JOIN clients c ON c.id = u.client_id "
                        f"WHERE {' AND '.join(where)} GROUP BY {grouping} ORDER BY {grouping}", params).fetchall()
    out = []
    for row in rows:
        entry: dict[str, Any] = dict(zip(keys, row[:len(keys)]))
        entry.update(zip(COUNTS, row[len(keys):]))
        if "day" in entry:
            entry["day"] = day_text(entry["day"])
        entry["generation_seconds"] = round(entry["generation_seconds"], 3)
        out.append(entry)
    return out
