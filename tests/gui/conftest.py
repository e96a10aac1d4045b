"""GUI tests run on qasync's QEventLoop: the loop the desktop app runs on, so Qt events and the
service's coroutines interleave as they do for a person using the app.

Wait with `until` (asyncio.sleep on that loop), never with qtbot.waitUntil/waitSignal inside an
async test: those spin a nested Qt loop, which would re-enter asyncio tasks.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import qasync
from gui_helpers import Until, attached, settle, wait_until
from PySide6.QtWidgets import QApplication

from app.core.auth import Client
from app.core.service import AppService
from app.gui.session import Session


def _qt_loop() -> asyncio.AbstractEventLoop:
    app = QApplication.instance() or QApplication([])
    # A closed dialog must not end the loop under a running test (as in the tray app).
    app.setQuitOnLastWindowClosed(False)
    return qasync.QEventLoop(app)


def pytest_asyncio_loop_factories(config: Any, item: Any) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    return {"qt": _qt_loop}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    """End every async test at rest: pytest-qt processes Qt events once the test returns, with
    the asyncio loop no longer running, and a GUI coroutine resumed there could not continue."""
    original = getattr(item, "obj", None)
    if not inspect.iscoroutinefunction(original):
        return (yield)

    @functools.wraps(original)
    async def settled(*args: Any, **kwargs: Any) -> Any:
        try:
            return await original(*args, **kwargs)
        finally:
            await settle()

    item.obj = settled
    try:
        return (yield)
    finally:
        item.obj = original


@pytest.fixture
def until() -> Until:
    return wait_until


@pytest.fixture
async def owner(service: AppService) -> Client:
    client = await service.access.authenticate(await service.access.owner_token())
    assert client is not None
    return client


@pytest.fixture
async def session(service: AppService, qapp: QApplication) -> AsyncIterator[Session]:
    """The GUI's view of a real, started service (real store, real inference)."""
    async with attached(service) as live:
        yield live


@pytest.fixture(autouse=True)
def close_windows(qapp: QApplication) -> Any:
    yield
    for widget in QApplication.topLevelWidgets():
        if widget.isVisible():
            widget.close()
