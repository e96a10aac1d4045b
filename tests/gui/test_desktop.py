"""The desktop shell: start order, notifications that lead somewhere, pairing, quit."""

from __future__ import annotations

import asyncio
import errno
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gui_helpers import Life, Until, make_task, visible
from PySide6.QtWidgets import QMessageBox, QSystemTrayIcon

from app import paths
from app.core.auth import Client
from app.core.service import AppService
from app.engine.parent import gpu
from app.engine.registry.models import DEFAULT_MODEL_ID
from app.gui.dashboard import Dashboard
from app.gui.desktop import Desktop
from app.gui.pairing_dialog import PairingDialog
from app.gui.single_instance import SingleInstance, notify_running

pytestmark = pytest.mark.gui


@pytest.fixture
async def desktop(service: AppService, until: Until) -> Any:
    life = Life(service)
    shell = Desktop(life)
    run = asyncio.ensure_future(shell.run())
    await until(lambda: shell.session.phase == "ready", 20, "desktop ready")
    yield shell
    shell.request_quit()
    assert await asyncio.wait_for(run, 20) == 0
    assert life.calls == ["start", "stop"]


async def test_a_failed_task_notifies_and_the_click_shows_it(desktop: Desktop, owner: Client, until: Until,
                                                          tmp_path: Path) -> None:
    messages: list[tuple[str, str, Callable[[], None] | None]] = []
    desktop.tray.notify = lambda title, text, on_click=None, icon=None: messages.append((title, text, on_click))
    service = desktop.session.service
    link = tmp_path / "vanishing.gguf"
    link.symlink_to(paths.default_model_file())
    await service.models.register_model({"path": str(link), "id": "vanishing"})
    service.tasks.set_paused(True)
    # A foreground request's caller is answered the error itself: only the background task notifies.
    foreground = await make_task(service, owner, model="vanishing", background=False)
    response = await make_task(service, owner, model="vanishing")
    link.unlink()  # the file goes away while the tasks wait: running them fails
    service.tasks.set_paused(False)
    await until(lambda: messages, 30, "notification")
    assert (await service.tasks.task(owner, foreground["task"]["id"]))["status"] == "failed"
    assert len(messages) == 1
    title, text, on_click = messages[0]
    assert title == "A task failed" and "vanishing" in text
    assert on_click is not None
    on_click()
    dashboard = desktop.dashboard
    assert isinstance(dashboard, Dashboard) and dashboard.isVisible()
    await until(lambda: dashboard.tasks.selected_id() == response["task"]["id"], 10, "task selected")


async def test_a_pairing_request_opens_the_dialog_without_a_tray(desktop: Desktop, until: Until) -> None:
    # Offscreen there is no tray to notify from: the request is shown at once.
    service = desktop.session.service
    pairing = await service.access.request_pairing({"client_name": "Sketch", "scopes": ["responses:write"]})
    dialogs = await until(lambda: visible(PairingDialog), 10, "pairing dialog")
    assert dialogs[0].pairing_id == pairing["id"]
    desktop.open_pairing(pairing["id"])  # asking again raises the same dialog
    assert visible(PairingDialog) == dialogs
    dialogs[0].allow_button.click()
    await until(lambda: not desktop.pairing_dialogs, 10, "dialog gone")
    assert any(c["name"] == "Sketch" for c in await service.access.list_clients())


async def test_quit_from_the_tray_stops_the_service(service: AppService, until: Until) -> None:
    life = Life(service)
    shell = Desktop(life)
    run = asyncio.ensure_future(shell.run())
    await until(lambda: shell.session.phase == "ready", 20, "desktop ready")
    shell.tray.menu.aboutToShow.emit()
    quit_action = next(a for a in shell.tray.menu.actions() if a.objectName() == "quit")
    quit_action.trigger()
    assert await asyncio.wait_for(run, 20) == 0
    assert life.calls == ["start", "stop"] and shell.session.phase == "stopping"


async def test_a_failed_start_shows_why_and_keeps_the_tray_until_quit(service: AppService, until: Until) -> None:
    life = Life(service)

    async def port_taken() -> str:
        raise OSError(errno.EADDRINUSE, "address already in use")

    life.start = port_taken  # type: ignore[method-assign]
    shell = Desktop(life)
    run = asyncio.ensure_future(shell.run())
    await until(lambda: shell.session.phase == "error", 10, "error state")
    assert shell.tray.state == "error" and "port is already in use" in shell.tray.icon.toolTip()
    boxes = await until(lambda: [b for b in visible(QMessageBox) if b.objectName() == "lmsp-error"], 10, "box")
    assert "--port" in boxes[0].text()
    shell.tray.menu.aboutToShow.emit()
    enabled = {a.objectName() for a in shell.tray.menu.actions() if a.isEnabled()}
    assert "quit" in enabled and "dashboard" not in enabled
    shell.request_quit()
    assert await asyncio.wait_for(run, 20) == 1


async def test_a_second_launch_while_starting_shows_the_dashboard_once_ready(service: AppService,
                                                                             until: Until) -> None:
    life = Life(service)
    go = asyncio.Event()
    real_start = life.start

    async def slow_start() -> str:
        await go.wait()  # recovery and the port take their time
        return await real_start()

    life.start = slow_start  # type: ignore[method-assign]
    instance = SingleInstance(service.data_dir)
    assert instance.claim()
    shell = Desktop(life, instance)
    run = asyncio.ensure_future(shell.run())
    try:
        await asyncio.sleep(0.1)
        assert notify_running(instance.name)  # what a second `lmsp-tray` does
        await until(lambda: shell._show_when_ready is not None, 10, "show request noted")
        assert shell.dashboard is None  # nothing to show before the service is ready
        go.set()
        await until(lambda: shell.dashboard is not None and shell.dashboard.isVisible(), 20, "dashboard shown")
    finally:
        shell.request_quit()
        assert await asyncio.wait_for(run, 20) == 0
        instance.release()


async def test_safe_mode_is_said_once_and_shown_in_the_models_tab(desktop: Desktop, owner: Client, until: Until,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    messages: list[tuple[str, str, Callable[[], None] | None]] = []
    desktop.tray.notify = lambda title, text, on_click=None, icon=None: messages.append((title, text, on_click))
    service = desktop.session.service
    monkeypatch.setenv("LMSP_ENGINE_FAULT", "fast:warmup")  # the engine child crashes as on an AMX CPU
    first = await make_task(service, owner, tokens=5)
    second = await make_task(service, owner, tokens=5)
    for response in (first, second):
        row = await service.tasks.wait(response["task"]["id"])
        assert row["status"] == "completed", dict(row)
    await until(lambda: messages, 20, "notification")
    await asyncio.sleep(0.3)  # a second notice would have arrived by now
    assert [m[0] for m in messages] == ["Running in safe mode"]
    title, text, on_click = messages[0]
    assert "smollm2-135m-instruct" in text and "carry on" in text
    assert on_click is not None
    on_click()
    dashboard = desktop.dashboard
    assert isinstance(dashboard, Dashboard) and dashboard.isVisible()
    table = dashboard.models.table
    await until(lambda: table.rowCount() and table.item(0, 4).text() == "Safe mode · 100% CPU", 10,
                "engine column")
    assert "SIGSEGV" in table.item(0, 4).toolTip()


@pytest.mark.gpu
async def test_a_gpu_failure_is_said_once_and_the_models_tab_tries_the_gpu_again(
        desktop: Desktop, owner: Client, until: Until, monkeypatch: pytest.MonkeyPatch) -> None:
    """On Mesa's lavapipe (tests/test_gpu.py says why it is named): the GPU fails as the model loads,
    the model runs on the CPU, the tray says so once, and the Models tab tries the GPU again."""
    messages: list[tuple[str, str, Callable[[], None] | None]] = []
    desktop.tray.notify = lambda title, text, on_click=None, icon=None: messages.append((title, text, on_click))
    monkeypatch.setenv("GGML_VK_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(gpu, "devices", functools.cache(gpu.devices.__wrapped__))  # asked again, with lavapipe
    monkeypatch.setenv("LMSP_ENGINE_FAULT", "gpu:warmup:SIGABRT")
    service = desktop.session.service
    for _ in range(2):
        row = await service.tasks.wait((await make_task(service, owner, tokens=2))["task"]["id"])
        assert row["status"] == "completed", dict(row)
    await until(lambda: messages, 20, "notification")
    await asyncio.sleep(0.3)  # a second notice would have arrived by now
    [(title, text, on_click)] = messages
    assert title == "Running on the CPU" and "SIGABRT" in text and "smollm2-135m-instruct" in text, text
    assert on_click is not None
    on_click()
    dashboard = desktop.dashboard
    assert isinstance(dashboard, Dashboard) and dashboard.isVisible()
    tab = dashboard.models
    await until(lambda: tab.table.rowCount() and tab.table.item(0, 4).text() == "Fast · 100% CPU", 10, "engine column")
    assert "failed on the GPU" in tab.table.item(0, 4).toolTip()
    tab.table.selectRow(0)
    button = tab.buttons["fast-mode"]
    assert button.isEnabled() and button.text() == "Try the GPU again"
    assert "Processor:</b></td><td>100% CPU. It failed on the GPU while loading" in tab.facts.text()

    monkeypatch.delenv("LMSP_ENGINE_FAULT")  # its driver got fixed, say
    button.click()
    await until(lambda: tab.table.item(0, 4).text() == "Fast", 20, "the model let go, the GPU allowed again")
    await service.models.load_model(DEFAULT_MODEL_ID)
    await until(lambda: tab.table.item(0, 4).text() == "Fast · 100% GPU", 20, "on the GPU")
    tab.table.selectRow(0)
    assert "Processor:</b></td><td>100% GPU (Vulkan0: 31 of 31 layers, " in tab.facts.text()
    assert not button.isEnabled() and button.text() == "Try fast mode again"


async def test_pairing_notifications_are_plain_text_throttled_and_a_click_opens_what_was_announced(
        desktop: Desktop, until: Until, monkeypatch: pytest.MonkeyPatch) -> None:
    shown: list[tuple[str, str]] = []
    monkeypatch.setattr(desktop.tray.icon, "showMessage", lambda title, text, *rest: shown.append((title, text)))
    monkeypatch.setattr(Desktop, "has_tray", property(lambda self: True))
    monkeypatch.setattr(QSystemTrayIcon, "supportsMessages", staticmethod(lambda: True))
    service = desktop.session.service
    ask = service.access.request_pairing
    first = await ask({"client_name": "<b>Editor</b> & <a href='x'>", "scopes": ["models:read"]}, requester="uid:1000")
    flood = [await ask({"client_name": f"Flood {i}", "scopes": ["admin"]}, requester="uid:2000") for i in range(4)]
    await until(lambda: len(desktop.session.pairings) == 5, 10, "the session knows all five requests")
    assert len(shown) == 2  # one per requester: the other three of the flood were not announced
    assert shown[0][1].startswith("&lt;b&gt;Editor&lt;/b&gt; &amp; &lt;a href=&#x27;x&#x27;&gt; (code ")
    desktop.tray.icon.messageClicked.emit()  # the person clicks the first notification, after the second came
    dialogs = await until(lambda: visible(PairingDialog), 10, "pairing dialogs")
    assert first["id"] in {d.pairing_id for d in dialogs}
    assert {d.pairing_id for d in dialogs} <= {first["id"], flood[0]["id"]}  # only what was announced
    for dialog in dialogs:
        dialog.close()
