"""Open logs: the tray shows the log folder that app.main chose, in the system's file manager."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from gui_helpers import Life, Until
from PySide6.QtCore import QUrl
from PySide6.QtGui import QAction, QDesktopServices

from app import main as app_main
from app.core.service import AppService
from app.gui.desktop import Desktop

pytestmark = pytest.mark.gui


@pytest.fixture
def file_manager(monkeypatch: pytest.MonkeyPatch) -> list[QUrl]:
    """The system's file manager, faked: what it was asked to open."""
    opened: list[QUrl] = []

    def open_url(url: QUrl) -> bool:
        opened.append(url)
        return True

    monkeypatch.setattr(QDesktopServices, "openUrl", open_url)
    return opened


def logs_action(shell: Desktop) -> QAction:
    shell.tray.menu.aboutToShow.emit()
    found = shell.tray.menu.findChild(QAction, "logs")
    assert found is not None
    return found


async def test_open_logs_opens_the_log_folder(service: AppService, tmp_path: Path, until: Until,
                                              file_manager: list[QUrl]) -> None:
    folder = tmp_path / "logs"
    folder.mkdir()
    shell = Desktop(Life(service, log_file=folder / "lmsp-tray.log"))
    run = asyncio.ensure_future(shell.run())
    try:
        await until(lambda: shell.session.phase == "ready", 20, "desktop ready")
        entry = logs_action(shell)
        assert entry.text() == "Open logs" and entry.isEnabled() and entry.toolTip() == str(folder)
        entry.trigger()
        assert file_manager == [QUrl.fromLocalFile(str(folder))]
        assert Path(file_manager[0].toLocalFile()) == folder
    finally:
        shell.request_quit()
        assert await asyncio.wait_for(run, 20) == 0


async def test_without_a_known_log_folder_the_entry_is_greyed(service: AppService, until: Until,
                                                              file_manager: list[QUrl]) -> None:
    shell = Desktop(Life(service))
    run = asyncio.ensure_future(shell.run())
    try:
        await until(lambda: shell.session.phase == "ready", 20, "desktop ready")
        assert not logs_action(shell).isEnabled()
        shell.tray.open_logs()
        assert file_manager == []
    finally:
        shell.request_quit()
        assert await asyncio.wait_for(run, 20) == 0


def test_main_hands_the_log_file_to_the_desktop_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []

    def run_desktop(life: Any) -> int:
        seen.append(life.log_file)
        return 0

    monkeypatch.setattr("app.gui.desktop.run_desktop", run_desktop)
    try:
        assert app_main.main(["--data-dir", str(tmp_path / "data"), "--port", "0"]) == 0
    finally:
        logging.basicConfig(force=True)  # let go of the log file logs.setup opened
    # An explicit data folder keeps its logs beside it (logs.log_dir).
    assert seen == [tmp_path / "data" / "logs" / "lmsp-tray.log"]


def test_qt_s_own_warnings_go_to_the_log(qapp: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Not straight to stderr from the GUI thread (a full pipe nobody reads would stop the app),
    and so they are in the log file a user sends along."""
    from PySide6.QtCore import qInstallMessageHandler
    from PySide6.QtGui import QPixmap

    from app.gui.desktop import route_qt_messages

    route_qt_messages()
    try:
        QPixmap().scaled(10, 10)  # Qt warns: a null pixmap
    finally:
        qInstallMessageHandler(None)
    assert [(r.name, r.levelno) for r in caplog.records if "null pixmap" in r.getMessage()] == [("qt", logging.WARNING)]
