"""The settings form saves through the facade's validation: a refused value is explained next to
its field, and nothing changes."""

from __future__ import annotations

import pytest
from gui_helpers import Until

from app.display import human_size
from app.engine.registry import memory
from app.engine.registry.models import DEFAULT_MODEL_ID
from app.gui.session import Session
from app.gui.settings_tab import SettingsTab
from app.store import config
from tests.test_model_memory import needs

pytestmark = pytest.mark.gui


async def stored(session: Session) -> dict:
    return await session.service.store.read(config.load)


async def test_bad_port_shows_an_error_and_changes_nothing(session: Session, until: Until) -> None:
    tab = SettingsTab(session)
    tab.show()
    before, before_stored = dict(session.service.settings), await stored(session)
    tab.port.setText("70000")
    tab.concurrency.setValue(3)  # a good change in the same save must not be applied either
    tab.save_button.click()
    error = tab.errors["port"]
    await until(lambda: error.isVisible(), 10, "port error shown")
    assert "port" in error.text().lower()
    assert all(not label.isVisible() for name, label in tab.errors.items() if name != "port")
    assert "Not saved" in tab.status.text()
    assert session.service.settings == before
    assert await stored(session) == before_stored


async def test_port_that_is_not_a_number_is_refused_before_saving(session: Session) -> None:
    tab = SettingsTab(session)
    tab.show()
    tab.port.setText("eighty")
    tab.save_button.click()
    assert tab.errors["port"].isVisible() and "whole number" in tab.errors["port"].text()
    assert session.service.settings["port"] == 11535


async def test_saving_good_values_says_when_they_take_effect(session: Session, until: Until) -> None:
    tab = SettingsTab(session)
    tab.show()
    tab.port.setText("12000")
    tab.retention.setValue(3)
    tab.origins.setPlainText("https://notes.example\n\n")
    tab.save_button.click()
    await until(lambda: tab.status.text().startswith("Saved"), 10, "saved")
    assert "after a restart" in tab.status.text()
    saved = await stored(session)
    assert saved["port"] == 12000 and saved["retention_seconds"] == 3 * 86400
    assert saved["allowed_origins"] == ["https://notes.example"]
    assert saved["host"] == "127.0.0.1"  # untouched fields are not sent at all
    tab.save_button.click()
    assert tab.status.text() == "Nothing to save."


async def test_a_parallel_that_would_not_fit_is_explained_next_to_its_field(
        session: Session, until: Until, monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory this computer has is set by the test: the default model fits any parallel here."""
    monkeypatch.setattr(memory, "available_bytes", lambda: needs(2) + 1000)
    tab = SettingsTab(session)
    tab.show()
    assert tab.parallel.value() == 4
    before_stored = await stored(session)
    tab.parallel.setValue(16)
    tab.save_button.click()
    error = tab.errors["parallel"]
    await until(lambda: error.isVisible(), 10, "parallel error shown")
    assert error.text().startswith(f"Parallel 16 needs {human_size(needs(16))} for {DEFAULT_MODEL_ID}")
    assert error.text().endswith("At most 2 fit now.") and "Not saved" in tab.status.text()
    assert session.service.settings["parallel"] == 4 and await stored(session) == before_stored
    tab.parallel.setValue(2)
    tab.save_button.click()
    await until(lambda: tab.status.text().startswith("Saved"), 10, "saved")
    assert not error.isVisible() and (await stored(session))["parallel"] == 2


async def test_ollama_api_is_turned_on_with_its_scopes_and_a_taken_port_is_explained(session: Session,
                                                                                     until: Until) -> None:
    import socket

    from app.server.app import Server

    Server(session.service)  # as the desktop app has: it checks the Ollama port (not started here)
    tab = SettingsTab(session)
    tab.show()
    assert tab.ollama_api.currentData() == "off" and tab.ollama_port.value() == 11434
    assert {s for s, box in tab.scope_boxes.items() if box.isChecked()} == {"models:read", "responses:write"}
    with socket.socket() as taken:  # as Ollama itself would hold it
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        tab.ollama_api.setCurrentIndex(tab.ollama_api.findData("open"))
        tab.ollama_port.setValue(taken.getsockname()[1])
        tab.save_button.click()
        await until(lambda: tab.errors["ollama_port"].isVisible(), 10, "the port error shown")
    assert "taken" in tab.errors["ollama_port"].text() and session.service.settings["ollama_api"] == "off"
    tab.ollama_api.setCurrentIndex(tab.ollama_api.findData("token"))
    tab.scope_boxes["tasks:read"].setChecked(True)
    tab.save_button.click()
    await until(lambda: session.service.settings["ollama_api"] == "token", 10, "saved")
    assert session.service.settings["ollama_scopes"] == ["responses:write", "models:read", "tasks:read"]
