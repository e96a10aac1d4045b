"""Remote models from the desktop app (LMSP §11): the Add / Edit window against real
OpenAI-compatible upstreams (llama.cpp's llama-server on loopback), the Models tab's row with
its endpoints' health, the tray's entry, Remove."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from gui_helpers import Until, desktop_menu, make_task, visible
from PySide6.QtGui import QAction
from PySide6.QtWidgets import QMenu, QWidget
from shiboken6 import isValid

from app.core.auth import Client
from app.core.service import AppService
from app.gui import models_tab
from app.gui.dashboard import Dashboard
from app.gui.models_tab import ModelsTab
from app.gui.remote_dialog import KEPT, RemoteModelDialog
from app.gui.session import Session
from app.gui.tray import Tray

pytestmark = pytest.mark.gui
STATE, ENGINE = 3, 4
REFUSING = "http://127.0.0.1:9/v1"  # the discard port: nothing listens there


def closed(window: QWidget) -> bool:
    return not isValid(window) or not window.isVisible()  # closing deletes it


def row_of(tab: ModelsTab, model_id: str) -> int:
    return next((r for r in range(tab.table.rowCount()) if tab.table.item(r, 0).text() == model_id), -1)


def tray_entry(session: Session, model_id: str) -> QAction:
    tray = Tray(session)
    tray.build_menu()
    models = tray.menu.findChild(QMenu, "models")
    [entry] = [a for a in models.actions() if a.objectName() == f"model:{model_id}"]
    return entry


async def start_upstream(upstreams: Any, **kwargs: Any) -> Any:
    [upstream] = await asyncio.to_thread(upstreams, **kwargs)  # it waits for the server: not on the loop
    return upstream


async def test_add_a_remote_model_and_see_its_endpoints_health(session: Session, owner: Client, upstreams: Any,
                                                                until: Until, monkeypatch: pytest.MonkeyPatch) -> None:
    upstream = await start_upstream(upstreams)
    tab = Dashboard(session).models
    tab.buttons["add-remote"].click()
    dialog = tab.remote_dialog
    assert isinstance(dialog, RemoteModelDialog) and dialog.isVisible()
    dialog.model_id.setText("big")
    [box] = dialog.boxes
    box.base_url.setText(upstream.base_url)
    box.model.setText("smollm2")
    box.test_button.click()
    await until(lambda: box.status.text().startswith("✓"), 20, "the test's answer")
    assert "smollm2" in box.status.text() and " ms" in box.status.text()

    # A second endpoint that refuses: Save names it, beside it, and nothing is stored.
    refusing = dialog.add_endpoint(None)
    refusing.base_url.setText(REFUSING)
    refusing.model.setText("smollm2")
    dialog.save_button.click()
    await until(lambda: not dialog.busy, 20, "the save refused")
    assert dialog.isVisible() and refusing.status.text().startswith("✗")
    assert "refused the connection" in refusing.status.text() and box.status.text() == ""
    assert "big" not in [m["id"] for m in await session.service.models.list_models()]

    refusing.remove_button.click()
    assert len(dialog.boxes) == 1 and not box.remove_button.isEnabled()  # one endpoint at least
    dialog.save_button.click()
    await until(lambda: row_of(tab, "big") >= 0, 20, "the model in the table")
    assert closed(dialog)
    row = row_of(tab, "big")
    host = upstream.base_url.split("/")[2]
    assert tab.table.item(row, ENGINE).text() == "Remote" and tab.table.item(row, STATE).text() == "Ready"
    assert tab.table.item(row, STATE).toolTip() == f"{host} ✓"
    tab.table.selectRow(row)
    assert tab.details.text() == f"big — 1 endpoint: {host} ✓"
    assert tab.buttons["edit"].isEnabled() and not tab.buttons["load"].isEnabled()
    assert not tab.buttons["unload"].isEnabled()
    entry = tray_entry(session, "big")
    assert entry.text() == "big — remote" and entry.isEnabled()

    # A task on it counts as running on its endpoint, until it ends.
    task = (await make_task(session.service, owner, tokens=200, model="big"))["task"]
    await until(lambda: tab.details.text() == f"big — 1 endpoint: {host} ✓ 1 running", 30, "1 running")
    await until(lambda: tab.details.text() == f"big — 1 endpoint: {host} ✓", 60, "none running")
    assert (await session.service.tasks.task(owner, task["id"]))["status"] == "completed"

    # The server goes away: a re-check shows it unreachable, in the table and the tray.
    upstream.kill()
    await session.service.models.load_model("big")  # what the 30 s health check does
    await until(lambda: tab.table.item(row_of(tab, "big"), STATE).text() == "Unreachable", 20, "unreachable")
    assert "✗ refused the connection" in tab.table.item(row_of(tab, "big"), STATE).toolTip()
    assert "✗ refused the connection" in tab.details.text()
    entry = tray_entry(session, "big")
    assert entry.text() == "big — remote, unreachable" and not entry.isEnabled()

    monkeypatch.setattr(models_tab, "confirm", lambda *args: True)
    tab.table.selectRow(row_of(tab, "big"))
    tab.buttons["remove"].click()
    await until(lambda: row_of(tab, "big") < 0, 20, "the model removed")
    assert "big" not in [m["id"] for m in await session.service.models.list_models()]


async def test_a_bad_url_or_id_is_said_in_the_window_which_stays_open(session: Session, until: Until) -> None:
    tab = Dashboard(session).models
    tab.add_remote()
    dialog = tab.remote_dialog
    assert dialog is not None
    [box] = dialog.boxes
    box.base_url.setText("gpu-box:8080")  # no scheme
    box.model.setText("big")
    box.test_button.click()
    await until(lambda: box.status.text().startswith(("✓", "✗")), 10, "the test's answer")
    assert box.status.text().startswith("✗") and "http://" in box.status.text()

    box.say("")
    dialog.save_button.click()  # no id yet
    await until(lambda: not dialog.busy, 10, "the save refused")
    assert dialog.isVisible() and "id" in dialog.id_error.text() and box.status.text() == ""

    dialog.model_id.setText("big")
    dialog.save_button.click()
    await until(lambda: not dialog.busy and box.status.text(), 10, "the save refused")
    assert dialog.isVisible() and dialog.id_error.text() == ""
    assert box.status.text().startswith("✗") and "'gpu-box:8080' is not an http:// or https:// URL" in box.status.text()
    assert tab.table.rowCount() == 1  # only the default model


async def test_editing_keeps_the_key_unless_cleared(session: Session, upstreams: Any, until: Until) -> None:
    upstream = await start_upstream(upstreams, api_key="sekrit")
    await session.service.models.register_model({"id": "keyed", "remote": {"endpoints": [
        {"base_url": upstream.base_url, "model": "smollm2", "api_key": "sekrit"}]}})
    tab = Dashboard(session).models
    await until(lambda: row_of(tab, "keyed") >= 0, 10, "the model in the table")
    tab.table.selectRow(row_of(tab, "keyed"))
    tab.buttons["edit"].click()
    dialog = tab.remote_dialog
    assert dialog is not None and dialog.model_id.isReadOnly() and dialog.model_id.text() == "keyed"
    [box] = dialog.boxes
    assert box.base_url.text() == upstream.base_url and box.key.text() == ""  # the key is never shown
    assert box.key.placeholderText() == KEPT and box.clear_key.isVisible()
    assert box.status.text() == "✓ Answering"  # its health as last checked
    box.test_button.click()  # with the saved key, which only the service has
    await until(lambda: box.status.text().startswith("✓"), 20, "the test's answer")

    box.key.setText("wrong")
    box.test_button.click()
    await until(lambda: box.status.text().startswith("✗"), 20, "the wrong key refused")
    assert "refused the API key" in box.status.text()
    box.key.clear()

    # Clearing the key: the server then refuses, so the edit is refused and changes nothing.
    box.clear_key.setChecked(True)
    assert not box.key.isEnabled() and box.body() == {"base_url": upstream.base_url, "model": "smollm2",
                                                      "api_key": None}
    dialog.save_button.click()
    await until(lambda: not dialog.busy and box.status.text(), 20, "the edit refused")
    assert dialog.isVisible() and "refused the API key" in box.status.text()
    assert (await session.service.models.model("keyed"))["endpoints"][0]["has_api_key"]

    # Left empty, the field keeps the key: the server accepts it, and the window closes.
    box.clear_key.setChecked(False)
    assert box.body() == {"base_url": upstream.base_url, "model": "smollm2"}
    dialog.save_button.click()
    await until(lambda: closed(dialog), 20, "the edit saved")
    [endpoint] = (await session.service.models.model("keyed"))["endpoints"]
    assert endpoint["has_api_key"] and endpoint["status"] == "available"


async def test_the_tray_adds_a_remote_model_and_leads_to_it(service: AppService, upstreams: Any, until: Until) -> None:
    upstream = await start_upstream(upstreams)
    await service.models.register_model({"id": "big", "remote": {"endpoints": [
        {"base_url": upstream.base_url, "model": "smollm2"}]}})
    async with desktop_menu(service, until) as (shell, entries):
        assert entries["model:big"].text() == "big — remote"
        assert entries["model:big"].toolTip() == f"1 endpoint: {upstream.base_url.split('/')[2]} ✓"
        entries["model:big"].trigger()  # nothing to load: the Models tab, where it is shown
        dashboard = shell.dashboard
        assert dashboard is not None and dashboard.isVisible() and dashboard.tabs.currentWidget() is dashboard.models
        entries["add-remote-model"].trigger()
        [dialog] = visible(RemoteModelDialog)
        assert dialog.windowTitle() == "Add a remote model" and not dialog.model_id.isReadOnly()
