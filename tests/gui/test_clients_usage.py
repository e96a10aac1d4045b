"""The Clients tab's usage (issue 40): each app's requests and tokens today and over 30 days, a
bar a day, its most used model; checked against the tasks that ran; read again while the tab is
seen, never while it is hidden; 50 apps fit, nothing cut off."""

from __future__ import annotations

import datetime
import json
import secrets
import time
from pathlib import Path
from typing import Any

import pytest
from gui_helpers import Until, make_task, settle
from PySide6.QtWidgets import QTableWidget

from app.core.auth import Client
from app.core.service import AppService
from app.engine.registry.models import DEFAULT_MODEL_ID
from app.gui.clients_tab import CHART, COLUMNS, DAYS, ClientsTab, amount, utc_today
from app.gui.session import Session
from app.gui.sparkline import Sparkline

pytestmark = [pytest.mark.gui, pytest.mark.scripted(pace=400.0)]
ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "test-output" / "screenshots"
TODAY, MONTH, MODEL = COLUMNS.index("Today"), COLUMNS.index("Last 30 days"), COLUMNS.index("Most used model")


async def paired(service: AppService, name: str) -> Client:
    pairing = await service.access.request_pairing({"client_name": name, "scopes": ["responses:write"]})
    await service.access.approve_pairing(pairing["id"])
    client = await service.access.authenticate((await service.access.pairing_status(pairing["id"]))["token"])
    assert client is not None
    return client


async def ran(service: AppService, client: Client, tokens: int) -> dict[str, Any]:
    """A task of `client`, to its end: its response."""
    created = await make_task(service, client, tokens=tokens)
    assert (await service.tasks.wait(created["task"]["id"]))["status"] == "completed"
    return await service.responses.response(client, created["id"])


def row_of(table: QTableWidget, name: str) -> int:
    return next(r for r in range(table.rowCount()) if table.item(r, 0).text() == name)


def text(tab: ClientsTab, name: str, column: int) -> str:
    return tab.table.item(row_of(tab.table, name), column).text()


def chart(tab: ClientsTab, name: str) -> list[int]:
    widget = tab.table.cellWidget(row_of(tab.table, name), CHART)
    assert isinstance(widget, Sparkline)
    return [int(v) for v in widget.values]


def tokens(responses: list[dict[str, Any]]) -> int:
    return sum(r["usage"]["input_tokens"] + r["usage"]["output_tokens"] for r in responses)


async def test_each_apps_usage_is_the_tasks_it_ran(session: Session, owner: Client, until: Until) -> None:
    service = session.service
    notes = await paired(service, "Notes")
    mine = [await ran(service, owner, 6), await ran(service, owner, 4)]
    theirs = [await ran(service, notes, 5)]
    tab = ClientsTab(session)
    tab.show()
    await until(lambda: tab.table.rowCount() == 2 and text(tab, "Notes", TODAY) != amount((0, 0)), 10, "usage shown")
    for name, responses in (("You (the owner)", mine), ("Notes", theirs)):
        assert text(tab, name, TODAY) == text(tab, name, MONTH) == amount((len(responses), tokens(responses)))
        assert chart(tab, name) == [0] * (DAYS - 1) + [tokens(responses)]
        assert text(tab, name, MODEL) == DEFAULT_MODEL_ID

    # Seen, the tab follows: a task asked for and ended shows within a second or so of its end.
    mine.append(await ran(service, owner, 3))
    shown = amount((3, tokens(mine)))
    await until(lambda: text(tab, "You (the owner)", TODAY) == shown, 10, "the new task counted")

    # Hidden, it reads nothing; shown again, it is up to date.
    tab.hide()
    await settle()
    mine.append(await ran(service, owner, 3))
    await settle()
    assert not tab._refresh.isActive() and text(tab, "You (the owner)", TODAY) == shown
    tab.show()
    await until(lambda: text(tab, "You (the owner)", TODAY) == amount((4, tokens(mine))), 10, "read when shown")
    tab.close()


async def _fifty_apps(service: AppService) -> None:
    """50 paired apps with 40 days of usage each, over 3 models (one used most)."""
    today = (utc_today() - datetime.date(1970, 1, 1)).days

    def write(conn: Any) -> None:
        for n in range(50):
            client_id = f"client_{secrets.token_hex(8)}"
            conn.execute("INSERT INTO clients(id, name, token_hash, scopes, created_at) VALUES (?, ?, ?, ?, ?)",
                         (client_id, f"App number {n} with a longer name", secrets.token_hex(32),
                          json.dumps(["responses:write", "tasks:read"]), time.time()))
            for day in range(today - 39, today + 1):
                for k, model in enumerate(("qwen2.5-7b-instruct-q4_k_m", "llama-3.2-3b-instruct-q8_0", "phi-4")):
                    conn.execute("INSERT INTO usage_days(day, client_id, model_id, requests, tasks_completed, "
                                 "input_tokens, output_tokens) VALUES (?, ?, ?, ?, ?, ?, ?)",
                                 (day, client_id, model, 30 * (k + 1) * n, 30 * (k + 1) * n, 120_000 * n, 45_000))
    await service.store.write(write)


async def test_fifty_apps_fit_and_nothing_is_cut_off(session: Session, until: Until) -> None:
    await _fifty_apps(session.service)
    tab = ClientsTab(session)
    tab.resize(980, 600)  # the dashboard's size
    tab.show()
    await until(lambda: tab.table.rowCount() == 51, 10, "51 clients")
    last = "App number 49 with a longer name"
    await until(lambda: text(tab, last, MODEL) != "-", 10, "usage shown")
    assert text(tab, last, MODEL) == "phi-4"  # the most requests
    assert text(tab, last, TODAY) == amount((30 * 6 * 49, 3 * (120_000 * 49 + 45_000)))
    assert text(tab, last, MONTH) == amount((DAYS * 30 * 6 * 49, DAYS * 3 * (120_000 * 49 + 45_000)))
    assert chart(tab, last) == [3 * (120_000 * 49 + 45_000)] * DAYS
    metrics = tab.table.fontMetrics()
    for row in range(tab.table.rowCount()):
        for col in (TODAY, MONTH, MODEL):
            assert metrics.horizontalAdvance(tab.table.item(row, col).text()) < tab.table.columnWidth(col)
    SHOTS.mkdir(parents=True, exist_ok=True)
    assert tab.grab().save(str(SHOTS / "clients-tab-50-apps.png"))
    tab.close()
