"""The first-run welcome: shown at each start of the desktop app until "Don't show this again",
with the address the running server really answers on."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from gui_helpers import Life, Until, visible

from app import paths
from app.core.service import AppService
from app.gui.desktop import Desktop
from app.gui.found_models import FoundModelsDialog
from app.gui.welcome import WELCOME_DISMISSED, WelcomeWindow
from app.main import Lifecycle

pytestmark = pytest.mark.gui


@pytest.fixture(autouse=True)
def empty_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """"Models you already have" looks in a home of our own, not the machine's."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setattr("app.engine.registry.discovery.Path.home", lambda: home)
    for var in ("OLLAMA_MODELS", "HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    return home


class Running:
    """The desktop app over a real Lifecycle (service + HTTP server on a free port), started and
    stopped as run_desktop does it, minus the QApplication and single-instance parts."""

    def __init__(self, data_dir: Path) -> None:
        self.life = Lifecycle(data_dir, "127.0.0.1", 0)
        self.shell = Desktop(self.life, welcome=True)
        self.run: asyncio.Future[int] = asyncio.ensure_future(self.shell.run())

    async def ready(self, until: Until) -> Running:
        await until(lambda: self.shell.session.phase == "ready" or self.run.done(), 60, "desktop ready")
        assert not self.run.done(), self.run.result()
        return self

    async def stop(self) -> None:
        self.shell.request_quit()
        assert await asyncio.wait_for(self.run, 60) == 0


async def welcome_shown(until: Until) -> WelcomeWindow:
    windows = await until(lambda: visible(WelcomeWindow), 20, "welcome window")
    assert len(windows) == 1
    return windows[0]


async def test_welcome_until_dont_show_again(tmp_path: Path, until: Until) -> None:
    data_dir = tmp_path / "data"

    # First start: the welcome, with the address the server really answers on.
    app = await Running(data_dir).ready(until)
    try:
        welcome = await welcome_shown(until)
        url = json.loads((data_dir / paths.SERVICE_FILE).read_text())["url"]
        assert not url.endswith(":11535")  # port 0: a port of the system's choosing, so not a default
        assert welcome.address.text() == f"{url}/v1" == app.shell.session.api_base
        token = await app.life.service.access.owner_token()
        async with aiohttp.ClientSession() as http:
            async with http.get(welcome.address.text() + "/models",
                                headers={"Authorization": f"Bearer {token}"}) as response:
                assert response.status == 200
                assert any(m["id"] == "smollm2-135m-instruct" for m in (await response.json())["data"])
        welcome.close_button.click()  # closed without "Don't show this again"
        await until(lambda: not visible(WelcomeWindow) and app.shell.welcome is None, 10, "welcome closed")
        assert await app.life.service.settings.preference(WELCOME_DISMISSED) is None
    finally:
        await app.stop()

    # Second start: shown again; this time "Don't show this again".
    app = await Running(data_dir).ready(until)
    try:
        welcome = await welcome_shown(until)
        welcome.dont_show.setChecked(True)
        welcome.close_button.click()
        await until(lambda: not visible(WelcomeWindow), 10, "welcome closed")
    finally:
        await app.stop()  # the choice is written before the store closes, even on a quick Quit

    # Third start: not shown.
    app = await Running(data_dir).ready(until)
    try:
        assert await app.life.service.settings.preference(WELCOME_DISMISSED) is True
        await asyncio.sleep(0.5)
        assert not visible(WelcomeWindow) and app.shell.welcome is None
        assert await app.shell.show_welcome_unless_dismissed() is None
    finally:
        await app.stop()


async def test_welcome_leads_to_the_models_already_here(tmp_path: Path, until: Until) -> None:
    app = await Running(tmp_path / "data").ready(until)
    try:
        welcome = await welcome_shown(until)
        welcome.find_button.click()
        dialogs = await until(lambda: visible(FoundModelsDialog), 10, "found-models dialog")
        await until(lambda: not dialogs[0].busy, 20, "looked")
        assert dialogs[0].found == [] and "No models found" in dialogs[0].summary.text()
        assert welcome.isVisible()  # still there to read on
    finally:
        await app.stop()
    assert not visible(WelcomeWindow) and not visible(FoundModelsDialog)


async def test_the_tests_own_desktops_show_no_welcome(service: AppService, until: Until) -> None:
    shell = Desktop(Life(service))  # welcome=False: only run_desktop asks for it
    run = asyncio.ensure_future(shell.run())
    await until(lambda: shell.session.phase == "ready", 20, "desktop ready")
    await asyncio.sleep(0.3)
    assert not visible(WelcomeWindow)
    shell.request_quit()
    assert await asyncio.wait_for(run, 20) == 0
