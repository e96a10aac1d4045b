"""Widgets set up the same way in several places: a list tab (buttons, table, note), a hashing
progress dialog, a window's act / close buttons, a widget the tests find by name; and text the
app did not write (a model's path, a file or app name, an error message) shown as it is, never as
rich text: a QLabel, a tooltip or a message box renders anything that looks like HTML as HTML, so
such text could pass itself off as the app's own word ("✔ Official release, signature verified")."""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from PySide6.QtCore import Qt
from PySide6.QtGui import Qt as QtText
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDialogButtonBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QMessageBox,
    QProgressDialog,
    QPushButton,
    QTableWidget,
    QVBoxLayout,
    QWidget,
)

from app.gui import style

W = TypeVar("W", bound=QWidget)
L = TypeVar("L", QLabel, QMessageBox)


def named(widget: W, name: str) -> W:
    """`widget` with its object name set. Qt takes `objectName=` as a keyword too, but PySide6's
    stubs list only a class's own properties, so mypy would refuse it."""
    widget.setObjectName(name)
    return widget


def plain(label: L) -> L:
    """`label` (a QLabel or QMessageBox) showing its text as plain text, whatever the text holds."""
    label.setTextFormat(Qt.TextFormat.PlainText)
    return label


def markup(text: object) -> str:
    """`text` for a rich-text label or a notification (whose servers read markup): every `<`, `>`,
    `&` and quote an entity, so that the text shows as it is."""
    return html.escape(str(text))


def tip(text: str) -> str:
    """A tooltip that shows `text` as it is. Qt renders a tooltip as rich text when it looks like
    some (a tag in its first line): such a text goes as HTML that says it literally."""
    return QtText.convertFromPlainText(text) if QtText.mightBeRichText(text) else text


def list_table(columns: Sequence[str], stretch: int, widths: dict[int, int]) -> QTableWidget:
    """A read-only table of whole-row, single selections; Tab leaves it, as in a form."""
    table = QTableWidget(0, len(columns))
    table.setHorizontalHeaderLabels(list(columns))
    table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
    table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
    table.verticalHeader().hide()
    table.setTabKeyNavigation(False)
    table.setWordWrap(False)
    header = table.horizontalHeader()
    header.setSectionResizeMode(stretch, QHeaderView.ResizeMode.Stretch)
    for col, width in widths.items():
        header.resizeSection(col, width)
    return table


def hashing_progress(parent: QWidget, title: str, label: str, width: int) -> QProgressDialog:
    dialog = QProgressDialog(label, "", 0, 100, parent)
    dialog.setLabel(plain(QLabel(label)))  # it names the file
    dialog.setWindowTitle(title)
    dialog.setCancelButton(None)  # hashing runs in a thread that cannot be interrupted
    # Not modal: a modal progress dialog runs a nested event loop on every setValue().
    dialog.setWindowModality(Qt.WindowModality.NonModal)
    dialog.setMinimumDuration(0)
    dialog.setMinimumWidth(width)
    dialog.setValue(0)
    dialog.show()
    return dialog


def act_or_close(act_text: str, act: Callable[[], Any], close_text: str, close: Callable[[], Any]
                 ) -> tuple[QDialogButtonBox, QPushButton]:
    """A window's buttons: the one that acts (the default, what Enter does) and the one that closes
    it; the acting button is returned too, to be enabled or disabled."""
    buttons = QDialogButtonBox()
    act_button, close_button = QPushButton(act_text), QPushButton(close_text)
    act_button.setDefault(True)
    buttons.addButton(act_button, QDialogButtonBox.ButtonRole.AcceptRole)
    buttons.addButton(close_button, QDialogButtonBox.ButtonRole.RejectRole)
    act_button.clicked.connect(act)
    close_button.clicked.connect(close)
    return buttons, act_button


def list_page(page: QWidget, buttons: QHBoxLayout, table: QTableWidget, note: str) -> QVBoxLayout:
    """Lay out a tab that lists things: its buttons, the table, and a hint underneath."""
    hint = QLabel(note, wordWrap=True)
    hint.setStyleSheet(style.HINT)
    layout = QVBoxLayout(page)
    layout.addLayout(buttons)
    layout.addWidget(table, 1)
    layout.addWidget(hint)
    return layout
