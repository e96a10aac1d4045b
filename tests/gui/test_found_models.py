"""Models you already have: the files of LM Studio, Ollama and Hugging Face in a home of our own,
listed, picked and registered where they are; and the three ways to the dialog."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from gui_helpers import Life, Until, visible
from PySide6.QtCore import Qt
from PySide6.QtGui import QAction
from PySide6.QtWidgets import QMenu

from app.core.service import AppService
from app.display import human_size
from app.engine.registry.discovery import GGUF_MAGIC
from app.gui.dashboard import Dashboard
from app.gui.desktop import Desktop
from app.gui.found_models import FoundModelsDialog, show_found_models
from app.gui.session import Session
from app.gui.tray import Tray
from tests.test_discovery import _machine

pytestmark = pytest.mark.gui

LMS = "bartowski/Tiny-GGUF/tiny-Q4_K_M.gguf"
OLLAMA = "tiny:latest"
OLLAMA_OTHER = "someone/tiny-chat:q4"
HF = "TheOrg/Tiny-GGUF/tiny.Q8_0.gguf"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A home folder where LM Studio, Ollama and Hugging Face each left small GGUF files."""
    home = tmp_path / "home"
    files = _machine(home)
    monkeypatch.setattr("app.engine.registry.discovery.Path.home", lambda: home)
    for var in ("OLLAMA_MODELS", "HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    return {"home": home, **files}


def on_disk(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


def checked(dialog: FoundModelsDialog, name: str) -> bool:
    return dialog.item(name).checkState() == Qt.CheckState.Checked


def enabled(dialog: FoundModelsDialog, name: str) -> bool:
    return bool(dialog.item(name).flags() & Qt.ItemFlag.ItemIsEnabled)


def state(dialog: FoundModelsDialog, name: str) -> str:
    return dialog.table.item(dialog.item(name).row(), 3).text()


async def opened(session: Session, until: Until) -> FoundModelsDialog:
    dialog = show_found_models(session)
    await until(lambda: dialog.found and not dialog.busy, 20, "models found")
    return dialog


async def added(dialog: FoundModelsDialog, until: Until) -> None:
    dialog.add_button.click()
    # The progress dialog is up at once, before the first file is even opened.
    assert dialog.progress is not None and dialog.progress.isVisible()
    await until(lambda: not dialog.busy and dialog.progress is None, 60, "adding finished")


async def test_lists_the_models_and_adds_the_picked_ones_in_place(session: Session, home: dict[str, Path],
                                                                  until: Until) -> None:
    service = session.service
    await service.models.register_model({"path": str(home["lmstudio"].resolve())})  # one the person added before
    before_home, before_data = on_disk(home["home"]), on_disk(service.data_dir)

    dialog = await opened(session, until)
    shown = {m["name"]: m for m in dialog.found}
    assert set(shown) == {LMS, OLLAMA, OLLAMA_OTHER, HF}
    table = dialog.table
    sources = {table.item(row, 0).text(): table.item(row, 1).text() for row in range(table.rowCount())}
    assert sources == {LMS: "LM Studio", OLLAMA: "Ollama", OLLAMA_OTHER: "Ollama", HF: "Hugging Face"}
    size = table.item(dialog.item(OLLAMA).row(), 2).text()
    assert size == human_size(home["ollama"].stat().st_size)
    assert str(home["ollama"].resolve()) in dialog.item(OLLAMA).toolTip()  # the path, on hover
    # Already registered: ticked, greyed, "added". Nothing is ticked for the person.
    assert checked(dialog, LMS) and not enabled(dialog, LMS) and state(dialog, LMS) == "added"
    assert all(enabled(dialog, n) and not checked(dialog, n) for n in (OLLAMA, OLLAMA_OTHER, HF))
    assert not dialog.add_button.isEnabled()

    dialog.item(OLLAMA).setCheckState(Qt.CheckState.Checked)
    dialog.item(HF).setCheckState(Qt.CheckState.Checked)
    assert dialog.add_button.isEnabled()
    await added(dialog, until)

    models = {m["id"]: m for m in await service.models.list_models()}
    for name in (OLLAMA, HF):
        model = models[shown[name]["suggested_id"]]
        assert model["path"] == shown[name]["path"]  # registered where it is
        assert checked(dialog, name) and not enabled(dialog, name) and state(dialog, name) == "added"
    assert models[OLLAMA]["path"] == str(home["ollama"].resolve())
    assert shown[OLLAMA_OTHER]["path"] not in {m["path"] for m in models.values()}
    assert enabled(dialog, OLLAMA_OTHER) and not checked(dialog, OLLAMA_OTHER)
    assert "2 added" in dialog.summary.text()
    # Nothing copied, moved or touched: the home is as it was, the data folder holds no model.
    assert on_disk(home["home"]) == before_home
    new_files = set(on_disk(service.data_dir)) - set(before_data)
    assert not [f for f in new_files if Path(f).read_bytes()[:4] == GGUF_MAGIC]
    await until(lambda: {OLLAMA, shown[HF]["suggested_id"]} <= {m["id"] for m in session.models}, 10,
                "the Models tab's list updated")


async def test_a_bad_file_is_reported_and_the_others_still_added(session: Session, home: dict[str, Path],
                                                                 until: Until) -> None:
    dialog = await opened(session, until)
    shown = {m["name"]: m for m in dialog.found}
    for name in (OLLAMA, HF):  # Ollama's comes first, and fails
        dialog.item(name).setCheckState(Qt.CheckState.Checked)
    home["ollama"].unlink()  # gone between the listing and "Add selected"
    await added(dialog, until)

    assert state(dialog, OLLAMA) == "not added" and enabled(dialog, OLLAMA) and checked(dialog, OLLAMA)
    assert "No file at" in dialog.table.item(dialog.item(OLLAMA).row(), 3).toolTip()
    summary = dialog.summary.text()
    assert "1 added" in summary and "1 could not be added" in summary and OLLAMA in summary
    assert "No file at" in summary
    assert state(dialog, HF) == "added"
    ids = {m["id"] for m in await session.service.models.list_models()}
    assert shown[HF]["suggested_id"] in ids and OLLAMA not in ids


async def test_reached_from_the_tray_and_the_models_tab(service: AppService, home: dict[str, Path],
                                                         until: Until) -> None:
    shell = Desktop(Life(service))
    run = asyncio.ensure_future(shell.run())
    try:
        await until(lambda: shell.session.phase == "ready", 20, "desktop ready")
        tray: Tray = shell.tray
        tray.menu.aboutToShow.emit()
        models = tray.menu.findChild(QMenu, "models")
        entry = models.findChild(QAction, "find-models")
        assert entry.text() == "Find models on this computer…" and entry.isEnabled()
        entry.trigger()
        dialogs = await until(lambda: visible(FoundModelsDialog), 10, "dialog from the tray")
        await until(lambda: len(dialogs[0].found) == 4, 20, "models found")
        dialogs[0].close()

        shell.show_dashboard("Models")
        dashboard = shell.dashboard
        assert isinstance(dashboard, Dashboard)
        button = dashboard.models.buttons["find"]
        assert button.text() == "Find models on this computer…"
        button.click()
        again = await until(lambda: visible(FoundModelsDialog), 10, "dialog from the Models tab")
        assert again == dialogs  # the one dialog, looking afresh
        await until(lambda: not again[0].busy, 20, "looked again")
    finally:
        shell.request_quit()
        assert await asyncio.wait_for(run, 20) == 0
    assert not visible(FoundModelsDialog)
