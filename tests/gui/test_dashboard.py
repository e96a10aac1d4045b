"""The dashboard follows real tasks through bus events, and acts through the facade."""

from __future__ import annotations

from pathlib import Path

import pytest
from gui_helpers import Until, make_task, visible
from PySide6.QtGui import QAction
from PySide6.QtWidgets import QProgressDialog

from app import paths
from app.core.auth import OLLAMA_NAME, Client
from app.gui import clients_tab, models_tab
from app.gui.dashboard import Dashboard
from app.gui.session import Session
from app.gui.task_table import ELAPSED, ID_ROLE, PROGRESS, PROGRESS_ROLE, STATUS
from app.gui.tray import Tray
from tests.test_api import add_client

# Scripted engines (tests/scripted.py) at about llama.cpp's pace with the default model: the
# dashboard follows tasks and models, whatever text they hold.
pytestmark = [pytest.mark.gui, pytest.mark.scripted(pace=50.0)]


def cell(dash: Dashboard, task_id: str, column: int) -> str:
    model = dash.tasks.model
    row = model.row_of(task_id)
    return model.data(model.index(row, column)) if row >= 0 else ""


def select(dash: Dashboard, task_id: str) -> None:
    dash.tasks.select_task(task_id)
    assert dash.tasks.selected_id() == task_id


async def test_task_row_follows_a_real_task_to_completed(session: Session, owner: Client, until: Until) -> None:
    dash = Dashboard(session)
    dash.show()
    tray = Tray(session)
    seen_states: set[str] = set()
    session.changed.connect(lambda: seen_states.add(tray.state))
    response = await make_task(session.service, owner, tokens=30)
    task_id = response["task"]["id"]
    await until(lambda: dash.tasks.model.row_of(task_id) >= 0, 20, "row appears")
    select(dash, task_id)
    assert session.service.bus.watched(task_id), "the task shown is not followed live: its output would lag"
    dash.hide()  # closed to the tray: nobody sees the output, it need not be written token by token
    assert not session.service.bus.watched(task_id)
    dash.show()
    assert session.service.bus.watched(task_id)
    await until(lambda: cell(dash, task_id, STATUS) == "completed", 90, "task completed")
    await until(lambda: cell(dash, task_id, PROGRESS) == "30 / 30", 10, "progress 30/30")
    model = dash.tasks.model
    assert model.index(model.row_of(task_id), PROGRESS).data(PROGRESS_ROLE) == (30, 30)  # what the bar draws
    task = await session.service.tasks.task(owner, task_id)
    assert cell(dash, task_id, ELAPSED) == f"{task['finished_at'] - task['started_at']:.1f} s"  # not "0 s"
    assert "busy" in seen_states and tray.state == "idle"
    # The detail pane streamed the same text the response holds, and logged the events.
    final = await session.service.responses.response(owner, response["id"])
    await until(lambda: dash.tasks.detail.text.toPlainText() == final["output_text"], 10, "streamed text")
    log = [dash.tasks.detail.log.item(i).text() for i in range(dash.tasks.detail.log.count())]
    assert any("created" in line for line in log) and any("output_text.delta" in line for line in log)
    # Filters: a completed task is Finished, not Active nor Failed.
    for name, count in (("Active", 0), ("Failed", 0), ("Finished", 1), ("All", 1)):
        dash.tasks.filter.setCurrentText(name)
        assert dash.tasks.proxy.rowCount() == count, name
    # The engine kept the model loaded: the Models tab and the tray say so; Unload frees it.
    models = dash.models
    await until(lambda: models.table.item(0, 3).text() == "Loaded", 10, "model shown loaded")
    tray.menu.aboutToShow.emit()
    assert tray.menu.findChild(QAction, "model:smollm2-135m-instruct").isChecked()
    models.table.selectRow(0)
    assert models.buttons["unload"].isEnabled() and not models.buttons["load"].isEnabled()
    models.buttons["unload"].click()
    await until(lambda: models.table.item(0, 3).text() == "Ready", 20, "model unloaded")
    assert models.buttons["load"].isEnabled()


async def test_cancel_a_running_task_from_the_table(session: Session, owner: Client, until: Until) -> None:
    dash = Dashboard(session)
    dash.show()
    response = await make_task(session.service, owner, tokens=2000, text="Tell a very long story.")
    task_id = response["task"]["id"]
    await until(lambda: cell(dash, task_id, STATUS) == "running · slot 1 of 4", 60, "task running")
    select(dash, task_id)
    assert dash.tasks.cancel_button.isEnabled()
    dash.tasks.cancel_button.click()
    await until(lambda: cell(dash, task_id, STATUS) == "cancelled", 30, "task cancelled")
    assert not dash.tasks.cancel_button.isEnabled()
    task = await session.service.tasks.task(owner, task_id)
    assert task["status"] == "cancelled" and task["progress"]["output_tokens"] < 2000


async def test_models_tab_adds_and_removes_a_model(session: Session, until: Until, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    source = paths.default_model_file()
    assert source is not None
    link = tmp_path / "Copy-Of-SmolLM2.gguf"
    link.symlink_to(source)
    dash = Dashboard(session)
    tab = dash.models
    assert tab.table.rowCount() == 1
    tab.register(str(link))
    assert visible(QProgressDialog)
    await until(lambda: tab.table.rowCount() == 2, 60, "model registered")
    assert tab.table.item(1, 0).text() == "copy-of-smollm2"
    assert tab.table.item(1, 2).text() == tab.table.item(0, 2).text()  # same file, same digest
    await until(lambda: not visible(QProgressDialog), 10, "progress dialog closed")
    monkeypatch.setattr(models_tab, "confirm", lambda *args: True)
    tab.table.selectRow(1)
    tab.buttons["remove"].click()
    await until(lambda: tab.table.rowCount() == 1, 20, "model removed")
    assert link.exists()  # forgetting a model never deletes its file


async def test_clients_tab_revokes_a_paired_app(session: Session, until: Until,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    pairing = await session.service.access.request_pairing({"client_name": "Editor", "scopes": ["responses:write"]})
    await session.service.access.approve_pairing(pairing["id"])
    dash = Dashboard(session)
    tab = dash.clients
    await until(lambda: tab.table.rowCount() == 2, 10, "clients listed")
    tab.table.selectRow(0)
    assert not tab.revoke_button.isEnabled()  # the owner cannot be revoked
    row = next(i for i in range(2) if tab.table.item(i, 0).text() == "Editor")
    tab.table.selectRow(row)
    monkeypatch.setattr(clients_tab, "confirm", lambda *args: True)
    tab.revoke_button.click()
    await until(lambda: tab.table.rowCount() == 1, 10, "client revoked")
    assert [c["name"] for c in await session.service.access.list_clients()] == ["Owner"]


async def test_the_ollama_apps_client_is_listed_and_turned_off_in_one_click(session: Session, until: Until,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    await session.service.settings.update({"ollama_api": "open"})  # no server here: nothing listens
    dash = Dashboard(session)
    tab = dash.clients
    await until(lambda: tab.table.rowCount() == 2, 10, "the built-in client listed")
    row = next(i for i in range(2) if tab.table.item(i, 0).text() == OLLAMA_NAME)
    tab.table.selectRow(row)
    assert tab.revoke_button.text() == "Turn off" and tab.revoke_button.isEnabled()
    monkeypatch.setattr(clients_tab, "confirm", lambda *args: True)
    tab.revoke_button.click()
    await until(lambda: tab.table.rowCount() == 1, 10, "turned off")
    assert session.service.settings["ollama_api"] == "token" and session.service.access.tokenless() is None


async def test_show_task_reveals_it_whatever_the_filter(session: Session, owner: Client, until: Until) -> None:
    session.service.tasks.set_paused(True)  # the task stays queued: no inference needed
    response = await make_task(session.service, owner)
    dash = Dashboard(session)
    dash.tasks.filter.setCurrentText("Failed")
    await until(lambda: dash.tasks.model.row_of(response["task"]["id"]) >= 0, 10, "row loaded")
    dash.show_task(response["task"]["id"])
    assert dash.tabs.currentWidget() is dash.tasks and dash.tasks.filter.currentText() == "All"
    assert dash.tasks.selected_id() == response["task"]["id"]
    assert dash.tasks.table.currentIndex().data(ID_ROLE) == response["task"]["id"]
    assert cell(dash, response["task"]["id"], STATUS) == "queued #1 · waits: tasks paused"


async def test_the_table_shows_each_task_s_slot_or_place_in_the_queue(session: Session, owner: Client,
                                                                      until: Until) -> None:
    await session.service.settings.update({"parallel": 2})
    dash = Dashboard(session)
    dash.show()
    ids = [(await make_task(session.service, owner, tokens=2000, text=f"Story {n}."))["task"]["id"] for n in range(4)]
    shown = {"running · slot 1 of 2", "running · slot 2 of 2", "queued #1 · waits for a slot",
             "queued #2 · waits for a slot"}
    await until(lambda: {cell(dash, i, STATUS) for i in ids} == shown, 30, "slots and places shown")
    first = next(i for i in ids if cell(dash, i, STATUS).startswith("running"))
    await session.service.tasks.cancel(owner, "task", first)
    # The first queued task takes the freed slot; the one behind it moves up.
    shown = {"cancelled", "running · slot 1 of 2", "running · slot 2 of 2", "queued #1 · waits for a slot"}
    await until(lambda: {cell(dash, i, STATUS) for i in ids} == shown, 30, "the queue moved up")
    # The rest end here, not while the service stops under the test's feet.
    for task_id in (i for i in ids if i != first):
        await session.service.tasks.cancel(owner, "task", task_id)
    await until(lambda: {cell(dash, i, STATUS) for i in ids} == {"cancelled"}, 30, "all cancelled")


async def test_a_task_that_gives_its_slot_to_another_app_says_so(session: Session, owner: Client,
                                                                  until: Until) -> None:
    """The red team's P7 in the Tasks tab: the owner's two tasks fill both slots, another app's
    task takes one of them at once; the owner's task that gave way shows first in the queue, and
    its log says why."""
    service = session.service
    await service.settings.update({"parallel": 2})
    other = await service.access.authenticate(await add_client(service, "client_other", ["responses:write"]))
    assert other is not None
    dash = Dashboard(session)
    dash.show()
    mine = [(await make_task(service, owner, tokens=2000, text=f"Story {n}."))["task"]["id"] for n in range(2)]
    both = {"running · slot 1 of 2", "running · slot 2 of 2"}
    await until(lambda: {cell(dash, i, STATUS) for i in mine} == both, 30, "the owner's tasks in both slots")
    theirs = (await make_task(service, other, tokens=2000))["task"]["id"]

    def shown() -> list[str]:
        return sorted(cell(dash, i, STATUS) for i in [*mine, theirs])

    await until(lambda: shown() == ["queued #1 · waits for a slot", *sorted(both)], 10, "one of them gave way")
    assert cell(dash, theirs, STATUS).startswith("running")
    gave_way = next(i for i in mine if cell(dash, i, STATUS).startswith("queued"))
    select(dash, gave_way)
    log = dash.tasks.detail.log
    await until(lambda: any("gave its slot to another app's task" in log.item(i).text() for i in range(log.count())),
                10, "the log says why it waits")
    for task_id in [*mine, theirs]:  # they end here, not while the service stops under the test's feet
        await service.tasks.cancel(owner, "task", task_id)
    await until(lambda: {cell(dash, i, STATUS) for i in [*mine, theirs]} == {"cancelled"}, 30, "all cancelled")
