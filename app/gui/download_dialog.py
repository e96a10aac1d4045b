"""Download a model: a Hugging Face repository, its GGUF files with their sizes, and "Download".

The download itself is a durable task of the service: its progress is in the Tasks tab and the
tray's tooltip, a notification says when the model is ready, and Cancel in the Tasks tab stops
it. Closing this window changes nothing. One window per session, from the Models tab and the tray.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QDialog,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
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
from app.gui.widgets import act_or_close, list_table, named, plain

COLUMNS = ("File", "Size")
_dialog: DownloadDialog | None = None


class DownloadDialog(QDialog):
    def __init__(self, session: Session, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.session = session
        self.setObjectName("download-model")
        self.setWindowTitle("Download a model")
        self.setWindowIcon(app_icon())
        self.resize(640, 420)

        intro = QLabel("A model repository on Hugging Face, such as <i>bartowski/SmolLM2-135M-Instruct-GGUF</i>. "
                       "Files go to the Hugging Face cache, where other tools find them too.", wordWrap=True)
        self.repo = named(QLineEdit(placeholderText="owner/name"), "download-repo")
        self.repo.returnPressed.connect(self.show_files)
        self.look_button = QPushButton("Show files")
        self.look_button.clicked.connect(self.show_files)
        row = QHBoxLayout()
        row.addWidget(self.repo, 1)
        row.addWidget(self.look_button)

        self.table = list_table(list(COLUMNS), stretch=0, widths={1: 100})
        self.table.setObjectName("download-files")
        self.table.itemSelectionChanged.connect(self._update_buttons)
        self.table.itemDoubleClicked.connect(lambda _item: self.download())
        self.summary = plain(named(QLabel(wordWrap=True), "download-summary"))  # the hub's file names and errors
        self.summary.setStyleSheet(style.HINT)
        self.summary.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        buttons, self.download_button = act_or_close("Download", self.download, "Close", self.close)

        layout = QVBoxLayout(self)
        layout.setSpacing(10)
        layout.addWidget(intro)
        layout.addLayout(row)
        layout.addWidget(self.table, 1)
        layout.addWidget(self.summary)
        layout.addWidget(buttons)
        self.busy = False
        self._update_buttons()

    def _say(self, text: str, error: bool = False) -> None:
        self.summary.setStyleSheet(style.ERROR if error else style.HINT)
        self.summary.setText(text)

    def _update_buttons(self) -> None:
        self.look_button.setEnabled(not self.busy)
        self.download_button.setEnabled(not self.busy and self.selected() is not None)

    def selected(self) -> str | None:
        items = self.table.selectedItems()
        return items[0].data(Qt.ItemDataRole.UserRole) if items else None

    def show_files(self) -> None:
        repo = self.repo.text().strip()
        if self.busy or not repo:
            return
        self.busy = True
        self.table.setRowCount(0)
        self._say(f"Asking Hugging Face for the files of {repo}…")
        self._update_buttons()

        async def look() -> list[dict[str, Any]] | None:
            try:
                return await self.session.service.downloads.hub_files(repo)
            except LmspError as exc:  # said here, beside the field: no message box on top
                self._say(exc.message, error=True)
                return None
            finally:
                self.busy = False
                self._update_buttons()

        spawn(look(), self, done=self._show)

    def _show(self, files: list[dict[str, Any]] | None) -> None:
        if files is None:
            return
        self.table.setRowCount(len(files))
        for row, found in enumerate(files):
            for col, text in enumerate((found["file"], human_size(found["size_bytes"]))):
                item = QTableWidgetItem(text)
                item.setData(Qt.ItemDataRole.UserRole, found["file"])
                if col == 1:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                self.table.setItem(row, col, item)
        self._say(f"{len(files)} GGUF files. Pick one: smaller files (Q4) are quicker, larger ones (Q8) more "
                  "faithful." if files else "This repository has no GGUF files.")
        if files:
            self.table.selectRow(0)
        self._update_buttons()

    def download(self) -> None:
        file, repo = self.selected(), self.repo.text().strip()
        if self.busy or file is None:
            return
        owner = self.session.owner
        assert owner is not None  # the dialog opens once the service is ready
        self.busy = True
        self._update_buttons()

        async def start() -> None:
            try:
                await self.session.service.downloads.create_download(owner, {"repo": repo, "file": file})
                self._say(f"Downloading {file}: its progress is in the Tasks tab and the tray, and you will be "
                          "told when it is ready. You can close this window.")
            except LmspError as exc:
                self._say(exc.message, error=True)
            finally:
                self.busy = False
                self._update_buttons()

        spawn(start(), self)


def show_download_dialog(session: Session) -> DownloadDialog:
    """Bring the one window forward."""
    global _dialog
    if _dialog is None or not isValid(_dialog) or _dialog.session is not session:
        _dialog = DownloadDialog(session)
    _dialog.show()
    _dialog.raise_()
    _dialog.activateWindow()
    return _dialog
