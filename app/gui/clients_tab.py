"""Clients: the apps holding a token, what they may do, when they last came; Revoke."""

from __future__ import annotations

import time
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QHBoxLayout, QPushButton, QTableWidgetItem, QWidget

from app.core.auth import OLLAMA_ID
from app.gui.async_ui import confirm, spawn
from app.gui.session import Session
from app.gui.widgets import list_page, list_table

COLUMNS = ("Name", "Scopes", "Last used", "Paired")


def when(stamp: float | None) -> str:
    if not stamp:
        return "never"
    ago = time.time() - stamp
    if ago < 60:
        return "just now"
    if ago < 3600:
        return f"{int(ago // 60)} min ago"
    if ago < 86400:
        return f"{int(ago // 3600)} h ago"
    return time.strftime("%Y-%m-%d", time.localtime(stamp))


class ClientsTab(QWidget):
    def __init__(self, session: Session, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.session = session
        self.clients: list[dict[str, Any]] = []
        self.table = list_table(COLUMNS, stretch=1, widths={0: 220, 2: 120, 3: 120})
        self.table.itemSelectionChanged.connect(self._update_buttons)
        self.revoke_button = QPushButton("Revoke access")
        self.revoke_button.clicked.connect(self.revoke_selected)
        row = QHBoxLayout()
        row.addWidget(self.revoke_button)
        row.addStretch(1)
        list_page(self, row, self.table, "Apps get access by pairing: they ask, you allow. Revoking takes effect "
                  "on the app's next request; it can pair again later.")
        session.bridge.clients_changed.connect(self.load)
        session.bridge.pairing_resolved.connect(lambda *_: self.load())
        self._update_buttons()

    def load(self) -> None:
        spawn(self.session.service.access.list_clients(), self, self.show_clients)

    def show_clients(self, clients: list[dict[str, Any]]) -> None:
        self.clients = clients
        self.table.setRowCount(len(clients))
        for row, client in enumerate(clients):
            name = "You (the owner)" if client.get("owner") else client["name"]
            cells = (name, ", ".join(client["scopes"]), when(client.get("last_used_at")), when(client["created_at"]))
            for col, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setData(Qt.ItemDataRole.UserRole, client["id"])
                item.setToolTip(client["id"])
                self.table.setItem(row, col, item)
        self._update_buttons()

    def selected(self) -> dict[str, Any] | None:
        items = self.table.selectedItems()
        if not items:
            return None
        ident = items[0].data(Qt.ItemDataRole.UserRole)
        return next((c for c in self.clients if c["id"] == ident), None)

    def _update_buttons(self) -> None:
        client = self.selected()
        self.revoke_button.setEnabled(client is not None and not client.get("owner"))
        built_in = client is not None and client["id"] == OLLAMA_ID
        self.revoke_button.setText("Turn off" if built_in else "Revoke access")

    def revoke_selected(self) -> None:
        client = self.selected()
        if client and client["id"] == OLLAMA_ID:
            question = ("Turn off Ollama's port? Apps using it without a token can no longer use your models "
                        "(apps with a token keep Ollama's API on LMSP's port).", "Turn off")
        else:
            question = (f"Stop {client['name'] if client else ''} from using your models? "
                        "It will have to pair again.", "Revoke")
        if client and confirm(self, "Revoke access", *question):
            spawn(self.session.service.access.revoke_client(client["id"]), self, lambda _: self.load())
