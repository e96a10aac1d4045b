"""The tasks table: a model over task objects (as the facade returns them), a filter, and a
progress-bar delegate."""

from __future__ import annotations

import time
from typing import Any

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QPersistentModelIndex, QSortFilterProxyModel, Qt
from PySide6.QtGui import QColor, QPainter
from PySide6.QtWidgets import QApplication, QStyle, QStyledItemDelegate, QStyleOptionProgressBar, QStyleOptionViewItem

from app.gui.session import ACTIVE
from app.gui.widgets import tip

Index = QModelIndex | QPersistentModelIndex
COLUMNS = ("Status", "Model", "Client", "Progress", "Speed", "Elapsed")  # speed: tokens/s, or MB/s
STATUS, MODEL, CLIENT, PROGRESS, SPEED, ELAPSED = range(len(COLUMNS))
# "Finished" means ended without failing; failures have their own filter.
FILTERS = {"All": None, "Active": ACTIVE, "Finished": ("completed", "cancelled"), "Failed": ("failed",)}
COLORS = {"queued": "#6b7280", "loading": "#b45309", "running": "#1d4ed8", "cancelling": "#b45309",
          "completed": "#15803d", "cancelled": "#6b7280", "failed": "#b91c1c"}
ID_ROLE = Qt.ItemDataRole.UserRole
PROGRESS_ROLE = Qt.ItemDataRole.UserRole + 1


def done_and_limit(task: dict[str, Any]) -> tuple[int, int | None]:
    """How far a task is: tokens against the limit, or a download's bytes against the file size."""
    progress = task["progress"]
    if task["kind"] == "download":
        return progress["bytes"], progress["total_bytes"]
    return progress["output_tokens"], progress["max_output_tokens"]


# What a task that has not started waits for (GET /v1/tasks `waiting_for`), as the Status cell says it.
WAITS = {"slot": "waits for a slot", "model_load": "waits for its model to load", "download": "waits for a download",
         "paused": "waits: tasks paused"}


def status_text(task: dict[str, Any]) -> str:
    """The status, with where the task stands: its place in the queue and what it waits for, its
    slot among the tasks its model decodes together."""
    slot = task.get("slot")
    waits = WAITS.get(task.get("waiting_for") or "")
    if task.get("queue_position"):
        return f"queued #{task['queue_position']}" + (f" · {waits}" if waits else "")
    if waits and task["status"] == "queued":  # a download: downloads have no queue positions
        return f"queued · {waits}"
    if slot and slot["of"] > 1:
        return f"{task['status']} · slot {slot['index'] + 1} of {slot['of']}"
    return str(task["status"])


def elapsed(task: dict[str, Any], now: float) -> float | None:
    start = task.get("started_at")
    if start is None:
        return None
    return max(0.0, (task.get("finished_at") or now) - start)


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds < 10:  # most tasks of a small model take well under a second: "0 s" would say nothing
        return f"{seconds:.1f} s"
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class TaskTableModel(QAbstractTableModel):
    def __init__(self, parent: Any = None) -> None:
        super().__init__(parent)
        self.tasks: list[dict[str, Any]] = []   # newest first, as list_tasks returns them
        self.client_names: dict[str, str] = {}

    def rowCount(self, parent: Index = QModelIndex()) -> int:  # noqa: N802 (Qt's name)
        return 0 if parent.isValid() else len(self.tasks)

    def columnCount(self, parent: Index = QModelIndex()) -> int:  # noqa: N802
        return 0 if parent.isValid() else len(COLUMNS)

    def headerData(self, section: int, orientation: Qt.Orientation,  # noqa: N802
                   role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            return COLUMNS[section]
        return None

    def data(self, index: Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        task = self.tasks[index.row()]
        col = index.column()
        if role == ID_ROLE:
            return task["id"]
        if role == PROGRESS_ROLE:
            return done_and_limit(task)
        if role == Qt.ItemDataRole.ToolTipRole:
            error = task.get("error")
            return tip(f"{task['id']}\n{error['code']}: {error['message']}" if error else task["id"])
        if role == Qt.ItemDataRole.ForegroundRole and col == STATUS:
            return QColor(COLORS.get(task["status"], "#000000"))
        if role == Qt.ItemDataRole.TextAlignmentRole and col in (SPEED, ELAPSED):
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        if role != Qt.ItemDataRole.DisplayRole:
            return None
        if col == STATUS:
            return status_text(task)
        if col == MODEL:
            return task.get("model") or "—"
        if col == CLIENT:
            client = task.get("client_id")
            return self.client_names.get(client, client) if client else "—"
        if col == PROGRESS:
            if task["kind"] == "download":
                progress = task["progress"]
                return f"{progress['bytes'] / 1e6:,.1f} / {progress['total_bytes'] / 1e6:,.1f} MB"
            done, limit = done_and_limit(task)
            return f"{done} / {limit}" if limit else f"{done}"
        if col == SPEED:
            if task["kind"] == "download":
                rate = task["progress"].get("bytes_per_second") if task["status"] in ACTIVE else None
                return f"{rate / 1e6:.1f} MB/s" if rate else "—"
            speed = task["progress"].get("tokens_per_second")
            return f"{speed:.1f} tok/s" if speed else "—"
        return format_seconds(elapsed(task, time.time()))

    def row_of(self, task_id: str) -> int:
        return next((i for i, t in enumerate(self.tasks) if t["id"] == task_id), -1)

    def task(self, task_id: str) -> dict[str, Any] | None:
        row = self.row_of(task_id)
        return self.tasks[row] if row >= 0 else None

    def reset(self, tasks: list[dict[str, Any]]) -> None:
        """Show a freshly read list; rows that events brought in meanwhile are kept if newer."""
        merged = {t["id"]: t for t in tasks}
        for task in self.tasks:
            known = merged.get(task["id"])
            if known is None or task["last_sequence_number"] > known["last_sequence_number"]:
                merged[task["id"]] = task
        self.beginResetModel()
        self.tasks = sorted(merged.values(), key=lambda t: (t["created_at"], t["id"]), reverse=True)
        self.endResetModel()

    def upsert(self, task: dict[str, Any]) -> None:
        row = self.row_of(task["id"])
        if row >= 0:
            self.tasks[row] = task
            self.dataChanged.emit(self.index(row, 0), self.index(row, len(COLUMNS) - 1))
            return
        # New tasks are the newest: they go on top, where list_tasks would put them.
        at = next((i for i, t in enumerate(self.tasks) if t["created_at"] < task["created_at"]), len(self.tasks))
        self.beginInsertRows(QModelIndex(), at, at)
        self.tasks.insert(at, task)
        self.endInsertRows()

    def set_client_names(self, names: dict[str, str]) -> None:
        self.client_names = names
        if self.tasks:
            self.dataChanged.emit(self.index(0, CLIENT), self.index(len(self.tasks) - 1, CLIENT))

    def tick(self) -> None:
        """Elapsed time of running tasks moves without any event: repaint that column."""
        for row, task in enumerate(self.tasks):
            if task["status"] in ACTIVE and task.get("started_at"):
                self.dataChanged.emit(self.index(row, ELAPSED), self.index(row, ELAPSED))


class TaskFilter(QSortFilterProxyModel):
    def __init__(self, parent: Any = None) -> None:
        super().__init__(parent)
        self.statuses: tuple[str, ...] | None = None

    def set_filter(self, name: str) -> None:
        if not hasattr(self, "beginFilterChange"):  # Qt < 6.10
            self.statuses = FILTERS[name]
            self.invalidateRowsFilter()
            return
        self.beginFilterChange()
        self.statuses = FILTERS[name]
        self.endFilterChange(QSortFilterProxyModel.Direction.Rows)

    def filterAcceptsRow(self, source_row: int, source_parent: Index) -> bool:  # noqa: N802
        if self.statuses is None:
            return True
        model = self.sourceModel()
        assert isinstance(model, TaskTableModel)
        return model.tasks[source_row]["status"] in self.statuses


class ProgressDelegate(QStyledItemDelegate):
    """Tokens so far against the limit, drawn as a progress bar."""

    def paint(self, painter: QPainter, option: QStyleOptionViewItem, index: Index) -> None:
        done, limit = index.data(PROGRESS_ROLE)
        bar = QStyleOptionProgressBar()
        bar.rect = option.rect.adjusted(3, 3, -3, -3)
        bar.minimum = 0
        # No limit: a busy (indeterminate) bar would mislead; show the count on an empty bar.
        bar.maximum = limit or 1
        bar.progress = min(done, limit) if limit else 0
        bar.text = index.data(Qt.ItemDataRole.DisplayRole)
        bar.textVisible = True
        bar.textAlignment = Qt.AlignmentFlag.AlignCenter
        bar.state = option.state | QStyle.StateFlag.State_Horizontal
        if option.state & QStyle.StateFlag.State_Selected:
            painter.fillRect(option.rect, option.palette.highlight())
        style = option.widget.style() if option.widget else QApplication.style()
        style.drawControl(QStyle.ControlElement.CE_ProgressBar, bar, painter, option.widget)
