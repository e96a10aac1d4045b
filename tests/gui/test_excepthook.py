"""Unexpected errors are shown with copyable details; the app keeps running."""

from __future__ import annotations

import sys

import pytest
from gui_helpers import Until, visible
from PySide6.QtGui import QGuiApplication

from app.errors import Conflict
from app.gui import excepthook
from app.gui.async_ui import spawn

pytestmark = pytest.mark.gui


def fail(message: str) -> None:
    raise ValueError(message)


def test_errors_collect_in_one_dialog_with_copyable_details(qtbot) -> None:
    for message in ("first problem", "second problem"):
        try:
            fail(message)
        except ValueError:
            dialog = excepthook.report(*sys.exc_info())
    assert dialog.isVisible() and visible(excepthook.ErrorDialog) == [dialog]
    details = dialog.details.toPlainText()
    assert "ValueError: first problem" in details and "ValueError: second problem" in details
    assert "in fail" in details  # the traceback, not just the message
    assert "2 errors" in dialog.summary.text()
    dialog.copy_details()
    assert QGuiApplication.clipboard().text() == details
    dialog.close()


async def test_spawned_work_reports_bugs_and_shows_lmsp_errors(until: Until, monkeypatch: pytest.MonkeyPatch) -> None:
    caught: list[type] = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, exc, tb: caught.append(kind))

    async def buggy() -> None:
        fail("bug")

    async def refused() -> None:
        raise Conflict("task_not_cancellable", "Task t has already ended.")

    spawn(buggy())
    spawn(refused())
    await until(lambda: caught, 10, "bug reported")
    assert caught == [ValueError]
    from PySide6.QtWidgets import QMessageBox
    boxes = await until(lambda: [b for b in visible(QMessageBox) if b.objectName() == "lmsp-error"], 10, "box")
    assert boxes[0].text() == "Task t has already ended."
