"""The tray: state icons, the tooltip, the lazily built menu and what its entries do."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.request
from pathlib import Path

import pytest
from gui_helpers import URL, Until, make_task, visible
from PySide6.QtGui import QAction, QGuiApplication
from PySide6.QtWidgets import QMenu, QMessageBox

from app.gui import autostart
from app.gui.icons import tray_icon
from app.gui.session import Session
from app.gui.tray import Tray
from app.server.app import Server

pytestmark = pytest.mark.gui


def action(tray: Tray, name: str) -> QAction:
    tray.menu.aboutToShow.emit()  # what opening the menu does: build it afresh
    found = tray.menu.findChild(QAction, name)
    assert found is not None, f"no menu entry {name!r}"
    return found


def shows(tray: Tray, state: str) -> bool:
    return tray.state == state and tray.icon.icon().cacheKey() == tray_icon(state).cacheKey()


async def test_pause_and_resume_change_state_icon_and_menu(session: Session, until: Until) -> None:
    tray = Tray(session)
    assert shows(tray, "idle")
    assert tray.icon.toolTip() == "Serving on 127.0.0.1:11535 — idle"
    pause = action(tray, "pause")
    assert pause.text() == "Pause new tasks"
    pause.trigger()
    assert session.service.scheduler.paused
    await until(lambda: shows(tray, "paused"), 10, "paused icon")
    assert "paused" in tray.icon.toolTip()
    resume = action(tray, "pause")
    assert resume.text() == "Resume tasks"
    resume.trigger()
    assert not session.service.scheduler.paused
    await until(lambda: shows(tray, "idle"), 10, "idle icon")


async def test_copy_address_puts_the_api_url_on_the_clipboard(session: Session) -> None:
    tray = Tray(session)
    QGuiApplication.clipboard().clear()
    action(tray, "copy").trigger()
    assert QGuiApplication.clipboard().text() == f"{URL}/v1"


async def test_models_submenu_shows_the_models(session: Session) -> None:
    tray = Tray(session)
    tray.menu.aboutToShow.emit()
    models = tray.menu.findChild(QMenu, "models")
    assert models is not None
    names = [a.objectName() for a in models.actions()]
    assert "model:smollm2-135m-instruct" in names and "add-model" in names
    entry = models.findChild(QAction, "model:smollm2-135m-instruct")
    assert entry.isCheckable() and not entry.isChecked()


async def test_pairing_submenu_reviews_and_denies_but_never_allows_in_one_click(session: Session,
                                                                               until: Until) -> None:
    tray = Tray(session)
    tray.menu.aboutToShow.emit()
    assert tray.menu.findChild(QMenu, "pairings") is None
    pairing = await session.service.access.request_pairing({"client_name": "Notes", "scopes": ["responses:write"]})
    await until(lambda: pairing["id"] in session.pairings, 10, "pairing seen")
    tray.menu.aboutToShow.emit()
    entries = [a.objectName() for a in tray.menu.findChild(QMenu, "pairings").actions() if a.objectName()]
    assert entries == [f"review:{pairing['id']}", f"deny:{pairing['id']}"]
    reviewed: list[str] = []
    tray.review_pairing.connect(reviewed.append)
    action(tray, f"review:{pairing['id']}").trigger()
    assert reviewed == [pairing["id"]]
    await asyncio.sleep(0.2)
    assert pairing["id"] in session.pairings  # reviewing opens the window; it approves nothing
    action(tray, f"deny:{pairing['id']}").trigger()
    await until(lambda: not session.pairings, 10, "pairing resolved")
    assert not any(c["name"] == "Notes" for c in await session.service.access.list_clients())
    tray.menu.aboutToShow.emit()
    assert tray.menu.findChild(QMenu, "pairings") is None


@pytest.mark.skipif(not autostart.SUPPORTED, reason="start at login is Linux-only for now")
async def test_start_at_login_writes_and_removes_the_autostart_entry(
        session: Session, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    tray = Tray(session, data_dir=tmp_path / "data")
    entry = action(tray, "autostart")
    assert entry.isCheckable() and not entry.isChecked()
    entry.trigger()
    written = tmp_path / "config" / "autostart" / "lmsp-tray.desktop"
    text = written.read_text()
    assert "[Desktop Entry]" in text and f"--data-dir {tmp_path / 'data'}" in text
    assert action(tray, "autostart").isChecked()
    action(tray, "autostart").trigger()
    assert not written.exists()


async def test_ollama_apps_are_let_in_and_out_with_one_click(session: Session, until: Until) -> None:
    """The entry opens and closes the real listener on Ollama's port; with the port taken (Ollama
    itself running) the click changes nothing and says why."""
    settings = session.service.settings
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    await settings.update({"ollama_port": port})
    server = Server(session.service)
    await server.start("127.0.0.1", 0)
    try:
        tray = Tray(session)
        entry = action(tray, "ollama")
        assert entry.isCheckable() and not entry.isChecked() and f"127.0.0.1:{port}" in entry.toolTip()
        entry.trigger()
        await until(lambda: settings["ollama_api"] == "open", 10, "Ollama apps let in")
        assert action(tray, "ollama").isChecked()
        version = await asyncio.to_thread(ollama_version, port)  # no token: an Ollama app
        assert "version" in version
        action(tray, "ollama").trigger()
        await until(lambda: settings["ollama_api"] == "off", 10, "Ollama apps shut out")
        with pytest.raises(OSError):
            await asyncio.to_thread(ollama_version, port)
        with socket.socket() as ollama:  # as Ollama holds it (Go's listeners set SO_REUSEADDR: past TIME_WAIT)
            ollama.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ollama.bind(("127.0.0.1", port))
            ollama.listen()
            action(tray, "ollama").trigger()
            boxes = await until(lambda: [b for b in visible(QMessageBox) if b.objectName() == "lmsp-error"], 10,
                                "box")
        assert f"Port {port}" in boxes[0].text() and settings["ollama_api"] == "off"
        assert not action(tray, "ollama").isChecked()
    finally:
        await server.stop_accepting()
        await server.stop()


def ollama_version(port: int) -> dict[str, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/version", timeout=5) as answer:
        return json.loads(answer.read())  # type: ignore[no-any-return]


async def test_notification_click_runs_its_target(session: Session) -> None:
    tray = Tray(session)
    clicked: list[str] = []
    tray.notify("Title", "Text", lambda: clicked.append("first"))
    tray.notify("Title", "Text", lambda: clicked.append("second"))
    tray.icon.messageClicked.emit()
    assert clicked == ["second"]  # the message on screen is the latest one


@pytest.mark.scripted(pace=20.0)
async def test_the_tooltip_says_how_many_run_and_wait(session: Session, until: Until) -> None:
    """Two slots, five tasks: "2 running, 3 queued" (issue 40), then idle again once they end."""
    assert session.owner is not None
    await session.service.settings.update({"parallel": 2})
    tray = Tray(session)
    ids = [(await make_task(session.service, session.owner, tokens=2000, text=f"Story {n}."))["task"]["id"]
           for n in range(5)]
    await until(lambda: tray.icon.toolTip() == "Serving on 127.0.0.1:11535 — 2 running, 3 queued", 30,
                "two running, three queued")
    for task_id in ids:
        await session.service.tasks.cancel(session.owner, "task", task_id)
    await until(lambda: tray.icon.toolTip() == "Serving on 127.0.0.1:11535 — idle", 30, "idle again")
