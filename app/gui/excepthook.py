"""Unexpected exceptions end up in a dialog with copyable details; the app keeps running.

Covers plain Qt slots (PySide6 hands their exceptions to sys.excepthook), qasync's
`asyncSlot`s (same), and asyncio tasks nobody awaited (the loop's exception handler).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import traceback
from types import TracebackType
from typing import Any

from PySide6.QtGui import QFontDatabase, QGuiApplication
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QLabel, QPlainTextEdit, QPushButton, QVBoxLayout, QWidget

from app.gui.widgets import markup

log = logging.getLogger(__name__)


class ErrorDialog(QDialog):
    """One dialog for a burst of errors: later ones are appended instead of piling up windows."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("lmsp-exception")
        self.setWindowTitle("LMSP Tray: unexpected error")
        self.resize(640, 380)
        self.summary = QLabel(wordWrap=True)
        self.details = QPlainTextEdit(readOnly=True)
        self.details.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.details.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        copy = QPushButton("Copy details")
        buttons.addButton(copy, QDialogButtonBox.ButtonRole.ActionRole)
        copy.clicked.connect(self.copy_details)
        buttons.rejected.connect(self.close)
        layout = QVBoxLayout(self)
        layout.addWidget(self.summary)
        layout.addWidget(QLabel("The app is still running. If this keeps happening, please report it "
                                "with the details below."))
        layout.addWidget(self.details, 1)
        layout.addWidget(buttons)
        self.count = 0

    def add(self, summary: str, details: str) -> None:
        self.count += 1
        shown = summary if self.count == 1 else f"{summary}  ({self.count} errors so far)"
        self.summary.setText(f"<b>Something went wrong.</b><br>{markup(shown)}")
        separator = "\n" + "-" * 60 + "\n" if self.details.toPlainText() else ""
        self.details.setPlainText(self.details.toPlainText() + separator + details)

    def copy_details(self) -> None:
        QGuiApplication.clipboard().setText(self.details.toPlainText())


_dialog: ErrorDialog | None = None


def report(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> ErrorDialog:
    global _dialog
    details = "".join(traceback.format_exception(exc_type, exc, tb))
    log.error("unexpected error\n%s", details)
    if _dialog is None or not _dialog.isVisible():
        _dialog = ErrorDialog()
    _dialog.add(f"{exc_type.__name__}: {exc}", details)
    _dialog.show()
    _dialog.raise_()
    return _dialog


def _hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    if issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc, tb)
        return
    try:
        report(exc_type, exc, tb)
    except Exception:  # never let the hook itself take the app down
        sys.__excepthook__(exc_type, exc, tb)


def _loop_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    exc = context.get("exception")
    if isinstance(exc, Exception):
        _hook(type(exc), exc, exc.__traceback__)
    else:
        loop.default_exception_handler(context)


def install(loop: asyncio.AbstractEventLoop) -> None:
    sys.excepthook = _hook
    loop.set_exception_handler(_loop_handler)
