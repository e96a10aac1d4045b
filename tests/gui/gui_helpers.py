"""Helpers shared by the GUI tests (a module of its own: two conftest.py files cannot be told apart by import)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from PySide6.QtGui import QAction
from PySide6.QtWidgets import QApplication, QMenu

from app.core.auth import Client
from app.core.service import AppService
from app.gui import async_ui
from app.gui.bridge import Bridge
from app.gui.session import Session
from tests.helpers import poll

URL = "http://127.0.0.1:11535"  # what the session shows; these tests need no HTTP server
Until = Callable[..., Awaitable[Any]]


async def wait_until(predicate: Callable[[], Any], timeout: float = 60.0, what: str = "condition") -> Any:
    """The tests' one polling loop (tests/helpers.py), at the GUI's pace."""
    return await poll(predicate, timeout, 0.02, what)


async def settle(timeout: float = 10.0) -> None:
    """Wait until the GUI has no coroutine of its own in flight for a few turns in a row
    (a queued bus event can still start one)."""
    deadline = time.monotonic() + timeout
    quiet = 0
    while quiet < 3 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        quiet = 0 if async_ui._running else quiet + 1


def visible(kind: type) -> list[Any]:
    return [w for w in QApplication.topLevelWidgets() if isinstance(w, kind) and w.isVisible()]


@contextlib.asynccontextmanager
async def attached(service: AppService) -> AsyncIterator[Session]:
    """The GUI's view of a real, started service, for one block."""
    bridge = Bridge(service.bus)
    live = Session(service, bridge)
    await live.attach(URL)
    try:
        yield live
    finally:
        # Leave nothing for Qt to run after the loop is gone: queued bridge events first, then
        # the GUI's own coroutines (a detail pane still loading, a fetch of a stale row).
        bridge.close()
        await asyncio.sleep(0.05)
        pending = list(async_ui._running)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def make_task(service: AppService, owner: Client, tokens: int = 30, text: str = "Name three colours.",
                    **extra: Any) -> dict[str, Any]:
    body = {"input": text, "background": True, "max_output_tokens": tokens, "temperature": 0, **extra}
    created = await service.responses.create_response(owner, body)
    return getattr(created, "body", created)  # the facade returns a Created(status, body, replayed)


@contextlib.asynccontextmanager
async def desktop_menu(service: AppService, until: Until) -> AsyncIterator[tuple[Any, dict[str, QAction]]]:
    """The whole desktop app on `service`, ready: (the desktop, its tray's Models menu entries by
    object name). It quits when the block ends."""
    from app.gui.desktop import Desktop

    shell = Desktop(Life(service))
    run = asyncio.ensure_future(shell.run())
    try:
        await until(lambda: shell.session.phase == "ready", 20, "desktop ready")
        shell.tray.build_menu()
        models = shell.tray.menu.findChild(QMenu, "models")
        yield shell, {a.objectName(): a for a in models.actions() if isinstance(a, QAction)}
    finally:
        shell.request_quit()
        await run


class Life:
    """Lifecycle's shape around the already started test service (no HTTP server needed)."""

    def __init__(self, service: AppService, log_file: Path | None = None) -> None:
        self.service = service
        self.data_dir = service.data_dir
        self.log_file = log_file
        self.calls: list[str] = []

    async def start(self) -> str:
        self.calls.append("start")
        return URL

    async def stop(self) -> None:
        self.calls.append("stop")
