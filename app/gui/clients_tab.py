"""Clients: the apps holding a token, what each used today and over the last 30 days (a bar a
day), the model it uses most, what it may do, when it last came; Revoke.

Days are UTC days, as GET /v1/usage counts them. The numbers are read again when the tab is
shown and, while it is visible, a second after tasks are asked for or end; hidden, it reads nothing.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QHideEvent, QShowEvent
from PySide6.QtWidgets import QHBoxLayout, QPushButton, QTableWidgetItem, QWidget

from app.core.auth import OLLAMA_ID, OWNER
from app.core.service import AppService
from app.core.tasks import TERMINAL_EVENTS
from app.gui.async_ui import confirm, spawn
from app.gui.session import Session
from app.gui.sparkline import Sparkline
from app.gui.widgets import list_page, list_table, tip

# When it paired and its id are the name's tooltip; the scopes, last, take the room left (in full
# in their tooltip).
COLUMNS = ("Name", "Today", "Last 30 days", "Tokens a day", "Most used model", "Last used", "Scopes")
CHART, SCOPES = COLUMNS.index("Tokens a day"), COLUMNS.index("Scopes")
DAYS = 30
REFRESH_MS = 1000
ASKED = ("response.created",)  # a request counted: the tab shows it without waiting for its end


@dataclass
class Used:
    """One client's usage over the last DAYS days, as the tab shows it."""
    today: tuple[int, int] = (0, 0)        # requests, tokens
    month: tuple[int, int] = (0, 0)
    daily: list[int] = field(default_factory=lambda: [0] * DAYS)  # tokens a day, the oldest first
    models: dict[str, tuple[int, int]] = field(default_factory=dict)  # requests and tokens by model

    def model(self) -> str:
        """The model asked for most (by requests, then tokens); "-" for none."""
        return max(self.models, key=lambda m: self.models[m], default="-")


def utc_today() -> datetime.date:
    return datetime.datetime.now(datetime.UTC).date()


def summarize(by_day: Iterable[dict[str, Any]], by_model: Iterable[dict[str, Any]],
              today: datetime.date) -> dict[str, Used]:
    """GET /v1/usage's rows by client and day, and by client and model, of the last DAYS days."""
    used: dict[str, Used] = {}
    for row in by_day:
        mine = used.setdefault(row["client_id"], Used())
        tokens = row["input_tokens"] + row["output_tokens"]
        ago = (today - datetime.date.fromisoformat(row["day"])).days
        if 0 <= ago < DAYS:
            mine.daily[DAYS - 1 - ago] += tokens
            mine.month = (mine.month[0] + row["requests"], mine.month[1] + tokens)
        if ago == 0:
            mine.today = (row["requests"], tokens)
    for row in by_model:
        mine = used.setdefault(row["client_id"], Used())
        mine.models[row["model"]] = (row["requests"], row["input_tokens"] + row["output_tokens"])
    return used


async def read_usage(service: AppService) -> tuple[list[dict[str, Any]], dict[str, Used]]:
    """The clients with their usage over the last DAYS days."""
    today = utc_today()
    since = (today - datetime.timedelta(days=DAYS - 1)).isoformat()
    # Started together, awaited once: one wait for all three, not three in a row.
    clients, by_day, by_model = await asyncio.gather(service.access.list_clients(),
                                                     service.tasks.usage(OWNER, since, None, "client,day"),
                                                     service.tasks.usage(OWNER, since, None, "client,model"))
    return clients, summarize(by_day, by_model, today)


def amount(counts: tuple[int, int]) -> str:
    """"3 requests · 1.2k tokens"."""
    requests, tokens = counts
    return f"{requests:,} request{'' if requests == 1 else 's'} · {compact(tokens)} tokens"


def compact(n: int) -> str:
    """1234 -> "1.2k", 495000 -> "495k": three figures at most."""
    for size, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= size:
            return f"{n / size:.{0 if n >= 100 * size else 1}f}{unit}"
    return str(n)


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
        self.used: dict[str, Used] = {}
        self.table = list_table(COLUMNS, stretch=SCOPES, widths={0: 180, CHART: 100})
        self.table.itemSelectionChanged.connect(self._update_buttons)
        self.revoke_button = QPushButton("Revoke access")
        self.revoke_button.clicked.connect(self.revoke_selected)
        row = QHBoxLayout()
        row.addWidget(self.revoke_button)
        row.addStretch(1)
        list_page(self, row, self.table, "Apps get access by pairing: they ask, you allow. Revoking takes effect "
                  "on the app's next request; it can pair again later. Days are UTC days.")
        # Tasks asked for or ended change the numbers: read again once they settle, only if seen.
        self._refresh = QTimer(self, singleShot=True, interval=REFRESH_MS)
        self._refresh.timeout.connect(self.load)
        session.bridge.task_event.connect(self._task_event)
        session.bridge.clients_changed.connect(self.load)
        session.bridge.pairing_resolved.connect(lambda *_: self.load())
        self._update_buttons()

    def load(self) -> None:
        spawn(read_usage(self.session.service), self, lambda got: self.show_clients(*got))

    def showEvent(self, event: QShowEvent) -> None:  # noqa: N802 (Qt's name)
        super().showEvent(event)
        self.load()

    def hideEvent(self, event: QHideEvent) -> None:  # noqa: N802 (Qt's name)
        super().hideEvent(event)
        self._refresh.stop()

    def _task_event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if (kind in TERMINAL_EVENTS or kind in ASKED) and self.isVisible() and not self._refresh.isActive():
            self._refresh.start()

    def show_clients(self, clients: list[dict[str, Any]], used: dict[str, Used] | None = None) -> None:
        self.clients, self.used = clients, used or {}
        self.table.setRowCount(len(clients))
        for row, client in enumerate(clients):
            mine = self.used.get(client["id"], Used())
            name = "You (the owner)" if client.get("owner") else client["name"]
            scopes = ", ".join(client["scopes"])
            cells = (name, amount(mine.today), amount(mine.month), "", mine.model(), when(client.get("last_used_at")),
                     scopes)
            for col, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setData(Qt.ItemDataRole.UserRole, client["id"])
                paired = f"{client['id']}, paired {when(client['created_at'])}"
                item.setToolTip(tip(scopes if col == SCOPES else paired))
                self.table.setItem(row, col, item)
            peak = max(mine.daily)
            self.table.setCellWidget(row, CHART, Sparkline(mine.daily, f"Tokens a day, the last {DAYS} UTC days; "
                                                           f"the most in a day: {peak:,}"))
        for col in (1, 2, COLUMNS.index("Most used model"), COLUMNS.index("Last used")):
            self.table.resizeColumnToContents(col)  # numbers and names are never cut off
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
