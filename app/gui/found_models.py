"""Models you already have: GGUF files that LM Studio, Ollama and the Hugging Face cache keep,
each with a checkbox. "Add selected" registers the picked ones where they are: nothing is copied.

One dialog per session, reached from the welcome window, the Models tab and the tray's Models menu.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtGui import QBrush, QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDialog,
    QDialogButtonBox,
    QHeaderView,
    QLabel,
    QProgressDialog,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)
from shiboken6 import isValid

from app.display import human_size
from app.errors import LmspError
from app.gui import style
from app.gui.async_ui import spawn
from app.gui.icons import app_icon
from app.gui.session import Session
from app.gui.widgets import hashing_progress, markup, named, tip

SOURCES = {"lmstudio": "LM Studio", "ollama": "Ollama", "huggingface": "Hugging Face"}
COLUMNS = ("Model", "From", "Size", "")
NAME, SOURCE, SIZE, STATE = range(4)
ERROR_COLOUR = QColor("#b91c1c")


def _found_table() -> QTableWidget:
    """The files found, a row each: a box to tick by the name, then where it is from, its size and state."""
    table = QTableWidget(0, len(COLUMNS))
    table.setObjectName("found-table")
    table.setHorizontalHeaderLabels(COLUMNS)
    table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    table.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
    table.setFocusPolicy(Qt.FocusPolicy.StrongFocus)
    table.verticalHeader().hide()
    table.setWordWrap(False)
    table.setTextElideMode(Qt.TextElideMode.ElideMiddle)  # the file name is at the end
    table.setShowGrid(False)
    table.setAlternatingRowColors(True)
    header = table.horizontalHeader()
    right = Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter
    size_header = table.horizontalHeaderItem(SIZE)
    assert size_header is not None  # setHorizontalHeaderLabels made it
    size_header.setTextAlignment(right)
    header.setDefaultAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter)
    header.setSectionResizeMode(NAME, QHeaderView.ResizeMode.Stretch)
    for col, width in ((SOURCE, 110), (SIZE, 80), (STATE, 110)):
        header.setSectionResizeMode(col, QHeaderView.ResizeMode.Fixed)
        header.resizeSection(col, width)
    return table


class FoundModelsDialog(QDialog):
    def __init__(self, session: Session, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.session = session
        self.found: list[dict[str, Any]] = []
        self.added: set[str] = set()          # paths registered (before or by this dialog)
        self.errors: dict[str, str] = {}      # path -> why it was not added, from the last "Add selected"
        self.busy = False                     # looking or adding: one at a time
        self.adding: str | None = None        # the path being added now
        self.progress: QProgressDialog | None = None
        self.setObjectName("found-models")
        self.setWindowTitle("Models you already have")
        self.setWindowIcon(app_icon())
        self.resize(820, 440)

        intro = QLabel("Model files that LM Studio, Ollama or Hugging Face already downloaded to this computer. "
                       "Adding one uses the file where it is: nothing is copied or moved.", wordWrap=True)
        self.table = _found_table()
        self.table.itemChanged.connect(lambda _item: self._update_buttons())
        self.summary = named(QLabel(wordWrap=True), "found-summary")
        self.summary.setStyleSheet(style.HINT)
        self.summary.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        buttons = QDialogButtonBox()
        self.rescan_button = QPushButton("Look again")
        self.add_button = QPushButton("Add selected")
        self.close_button = QPushButton("Close")
        buttons.addButton(self.rescan_button, QDialogButtonBox.ButtonRole.ResetRole)
        buttons.addButton(self.add_button, QDialogButtonBox.ButtonRole.AcceptRole)
        buttons.addButton(self.close_button, QDialogButtonBox.ButtonRole.RejectRole)
        self.add_button.setDefault(True)
        self.rescan_button.clicked.connect(self.scan)
        self.add_button.clicked.connect(self.add_selected)
        self.close_button.clicked.connect(self.close)

        layout = QVBoxLayout(self)
        layout.setSpacing(10)
        layout.addWidget(intro)
        layout.addWidget(self.table, 1)
        layout.addWidget(self.summary)
        layout.addWidget(buttons)
        self.table.setFocus()
        self.scan()

    # -- the list ---------------------------------------------------------------------------

    def scan(self) -> None:
        if self.busy:
            return
        self.busy = True
        self.errors = {}
        self.summary.setStyleSheet(style.HINT)
        self.summary.setText("Looking in the folders of LM Studio, Ollama and Hugging Face…")
        self._update_buttons()

        async def look() -> list[dict[str, Any]] | None:
            try:
                return await self.session.service.models.discover_models()
            except OSError as exc:  # an unreadable folder, a vanished disk
                self.summary.setStyleSheet(style.ERROR)
                self.summary.setText(f"Could not look for models: {markup(exc)}")
                return None
            finally:
                self.busy = False
                self._update_buttons()

        spawn(look(), self, done=self.show_found)

    def show_found(self, found: list[dict[str, Any]] | None) -> None:
        if found is None:
            return
        picked = {m["path"] for m in self.picked()}  # a second look keeps what was ticked
        self.found = found
        self.added = {m["path"] for m in found if m["registered"]}
        self.table.blockSignals(True)
        self.table.setRowCount(len(found))
        for row, model in enumerate(found):
            path_tip = f"{model['path']}\nAdded as: {model['suggested_id']}"
            cells = (model["name"], SOURCES.get(model["source"], model["source"]), human_size(model["size_bytes"]), "")
            for col, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setToolTip(tip(path_tip))
                item.setData(Qt.ItemDataRole.UserRole, model)
                if col == SIZE:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                self.table.setItem(row, col, item)
            self._show_row(row, checked=model["path"] in picked)
        self.table.blockSignals(False)
        self._summarise()
        self._update_buttons()

    def _show_row(self, row: int, checked: bool = False) -> None:
        """A row as it stands: added (ticked, greyed), failed (the reason), or free to pick."""
        model = self.found[row]
        path = model["path"]
        name, state = self._cell(row, NAME), self._cell(row, STATE)
        state.setToolTip(name.toolTip())
        added = path in self.added
        flags = Qt.ItemFlag.ItemIsEnabled | Qt.ItemFlag.ItemIsUserCheckable
        name.setFlags(Qt.ItemFlag.NoItemFlags if added else flags)
        name.setCheckState(Qt.CheckState.Checked if added or checked else Qt.CheckState.Unchecked)
        for col in (SOURCE, SIZE, STATE):
            self._cell(row, col).setFlags(Qt.ItemFlag.NoItemFlags if added else Qt.ItemFlag.ItemIsEnabled)
        if added:
            state.setText("added")
            state.setForeground(QBrush())
            state.setToolTip(tip(f"{path}\nAlready in your models."))
        elif path == self.adding:
            state.setText("adding…")
            state.setForeground(QBrush())
        elif path in self.errors:
            state.setText("not added")
            state.setForeground(QBrush(ERROR_COLOUR))
            state.setToolTip(tip(self.errors[path]))
        else:
            state.setText("")
            state.setForeground(QBrush())

    def _cell(self, row: int, col: int) -> QTableWidgetItem:
        """A cell that every row has from the moment it is shown."""
        item = self.table.item(row, col)
        assert item is not None
        return item

    def item(self, name: str) -> QTableWidgetItem:
        """The checkbox cell of the model called `name` (as its app calls it)."""
        for row, model in enumerate(self.found):
            if model["name"] == name:
                return self._cell(row, NAME)
        raise KeyError(name)

    def picked(self) -> list[dict[str, Any]]:
        """Ticked and not yet added, in the order shown."""
        out = []
        for row, model in enumerate(self.found):
            item = self.table.item(row, NAME)
            if (item is not None and item.checkState() == Qt.CheckState.Checked
                    and model["path"] not in self.added):
                out.append(model)
        return out

    def _summarise(self, just_added: int = 0) -> None:
        if not self.found:
            self.summary.setStyleSheet(style.HINT)
            self.summary.setText("No models found. LMSP Tray looks where LM Studio, Ollama and Hugging Face "
                                 "keep theirs; you can still add any .gguf file from the Models tab.")
            return
        if self.errors:
            names = {m["path"]: m["name"] for m in self.found}
            lines = "".join(f"<br><b>{markup(names.get(path, path))}</b>: {markup(why)}"
                            for path, why in self.errors.items())
            count = len(self.errors)
            failed = f"{count} could not be added:" if count > 1 else "1 could not be added:"
            done = f"{just_added} added. " if just_added else ""
            self.summary.setStyleSheet(style.HINT)
            self.summary.setText(f"{done}<span style='{style.ERROR}'>{failed}{lines}</span>")
            return
        self.summary.setStyleSheet(style.HINT)
        found = f"{len(self.found)} found" + (f", {len(self.added)} already added" if self.added else "")
        if just_added:
            self.summary.setText(f"{just_added} added: they are in the Models tab. {found}.")
        elif len(self.added) == len(self.found):
            self.summary.setText(f"{found}: nothing left to add.")
        else:
            self.summary.setText(f"{found}. Tick the ones you want, then Add selected.")

    def _update_buttons(self) -> None:
        self.add_button.setEnabled(not self.busy and bool(self.picked()))
        self.rescan_button.setEnabled(not self.busy)

    # -- adding ------------------------------------------------------------------------------

    def add_selected(self) -> None:
        picked = self.picked()
        if self.busy or not picked:
            return
        self.busy = True
        self.errors = {}
        self._update_buttons()
        dialog = self.progress = hashing_progress(self, "Adding models", "", 440)
        dialog.setObjectName("found-progress")
        spawn(self._add(picked, dialog), self)

    async def _add(self, picked: list[dict[str, Any]], dialog: QProgressDialog) -> None:
        count, added = len(picked), 0
        try:
            for index, model in enumerate(picked):
                dialog.setLabelText(f"Adding {index + 1} of {count}: {model['name'].rsplit('/', 1)[-1]}\n"
                                    "Checking and hashing the file (a large model takes a while)…")
                dialog.setValue(int(index * 100 / count))
                self.adding = model["path"]
                self._refresh_row(model["path"])

                def report(done: int, total: int, index: int = index) -> None:  # on the loop thread
                    if isValid(dialog):
                        dialog.setValue(int((index + (done / total if total else 1)) * 100 / count))

                try:
                    await self.session.service.models.register_model(
                        {"path": model["path"], "id": model["suggested_id"], "projector": model.get("projector")},
                                                              progress=report)
                except LmspError as exc:  # this file only: the next one is still tried
                    self.errors[model["path"]] = exc.message
                else:
                    self.added.add(model["path"])
                    added += 1
                self.adding = None
                self._refresh_row(model["path"])
        finally:
            self.busy = False
            self.adding = None
            if isValid(dialog):
                dialog.close()
            self.progress = None
        self._summarise(just_added=added)
        self._update_buttons()

    def _refresh_row(self, path: str) -> None:
        self.table.blockSignals(True)
        for row, model in enumerate(self.found):
            if model["path"] == path:
                self._show_row(row, checked=True)
        self.table.blockSignals(False)


_dialog: FoundModelsDialog | None = None


def show_found_models(session: Session) -> FoundModelsDialog:
    """Bring the one dialog forward (a fresh look at the disk each time it is opened anew)."""
    global _dialog
    if _dialog is None or not isValid(_dialog) or _dialog.session is not session:
        if _dialog is not None and isValid(_dialog):
            _dialog.deleteLater()
        _dialog = FoundModelsDialog(session)
    elif not _dialog.isVisible():
        _dialog.scan()
    _dialog.show()
    _dialog.raise_()
    _dialog.activateWindow()
    return _dialog


def close_found_models() -> None:
    if _dialog is not None and isValid(_dialog):
        _dialog.close()
