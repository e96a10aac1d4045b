"""Tasks: the table (live from bus events), a filter, Cancel, and the selected task's detail.

An event for a task marks it stale; stale tasks are re-read through the facade in small
batches (deltas arrive many times a second, one read per batch is plenty).
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

from PySide6.QtCore import QItemSelection, Qt, QTimer
from PySide6.QtGui import QHideEvent, QShowEvent
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QSplitter,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from app.errors import NotFound
from app.gui.async_ui import spawn
from app.gui.session import Session
from app.gui.task_detail import TaskDetail
from app.gui.task_table import (
    ACTIVE,
    CLIENT,
    ELAPSED,
    FILTERS,
    ID_ROLE,
    MODEL,
    PROGRESS,
    SPEED,
    STATUS,
    ProgressDelegate,
    TaskFilter,
    TaskTableModel,
)

LOAD_LIMIT = 200
BATCH_SECONDS = 0.1
# Events of a task leaving the queue (to load, or cancelled) or joining it (a retry, or giving its
# slot to another app's task): the others move.
QUEUE_MOVES = {"response.loading", "response.cancelled", "response.queued"}


class TasksTab(QWidget):
    def __init__(self, session: Session, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.session = session
        self.model = TaskTableModel(self)
        self.proxy = TaskFilter(self)
        self.proxy.setSourceModel(self.model)
        self._stale: set[str] = set()
        self._fetching = False
        self._more = False  # list_tasks had more than LOAD_LIMIT
        self._queue_moved = False  # a task left or joined the queue since the queued rows were read

        self.filter = QComboBox()
        self.filter.addItems(list(FILTERS))
        self.filter.currentTextChanged.connect(self.proxy.set_filter)
        self.summary = QLabel()
        self.cancel_button = QPushButton("Cancel task")
        self.cancel_button.setEnabled(False)
        self.cancel_button.clicked.connect(self.cancel_selected)
        bar = QHBoxLayout()
        bar.addWidget(QLabel("Show:"))
        bar.addWidget(self.filter)
        bar.addSpacing(12)
        bar.addWidget(self.summary, 1)
        bar.addWidget(self.cancel_button)

        self.table = QTableView()
        self.table.setModel(self.proxy)
        self.table.setItemDelegateForColumn(PROGRESS, ProgressDelegate(self.table))
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setAlternatingRowColors(True)
        self.table.verticalHeader().hide()
        self.table.setTabKeyNavigation(False)  # Tab leaves the table, as in a form
        self.table.setWordWrap(False)
        header = self.table.horizontalHeader()
        # Status: wide enough for "queued #12 · waits for its model to load" (what a queued task waits for).
        for col, width in ((STATUS, 240), (CLIENT, 130), (PROGRESS, 150), (SPEED, 80), (ELAPSED, 100)):
            header.resizeSection(col, width)
        header.setSectionResizeMode(MODEL, QHeaderView.ResizeMode.Stretch)
        self.table.selectionModel().selectionChanged.connect(self._selection_changed)

        self.detail = TaskDetail(session)
        self.detail.open_task.connect(self.select_task)
        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(self.table)
        split.addWidget(self.detail)
        split.setSizes([260, 240])
        layout = QVBoxLayout(self)
        layout.addLayout(bar)
        layout.addWidget(split, 1)

        # Elapsed time moves between events; ticking only while on screen: hidden, it would cost
        # the idle app a look at every row a second (10 000 finished tasks: 2 ms each time).
        self._clock = QTimer(self, interval=1000)
        self._clock.timeout.connect(self.model.tick)
        session.bridge.task_event.connect(self.on_event)
        session.bridge.clients_changed.connect(self.load_client_names)
        session.bridge.pairing_resolved.connect(lambda *_: self.load_client_names())
        self.model.rowsInserted.connect(self._update_summary)
        self.model.modelReset.connect(self._update_summary)

    def showEvent(self, event: QShowEvent) -> None:  # noqa: N802 (Qt's name)
        super().showEvent(event)
        self.model.tick()
        self._clock.start()

    def hideEvent(self, event: QHideEvent) -> None:  # noqa: N802 (Qt's name)
        super().hideEvent(event)
        self._clock.stop()

    # -- loading ----------------------------------------------------------------------------

    def load(self) -> None:
        assert self.session.owner is not None
        spawn(self.session.service.tasks.list_tasks(self.session.owner, limit=LOAD_LIMIT), self, self._loaded)
        self.load_client_names()

    def _loaded(self, result: tuple[list[dict[str, Any]], bool]) -> None:
        tasks, self._more = result
        self.model.reset(tasks)

    def load_client_names(self) -> None:
        spawn(self.session.service.access.list_clients(), self,
              lambda clients: self.model.set_client_names({c["id"]: c["name"] for c in clients}))

    def _update_summary(self) -> None:
        count = len(self.model.tasks)
        more = f" (the {LOAD_LIMIT} most recent, and new ones)" if self._more else ""
        self.summary.setText(f"{count} task{'s' if count != 1 else ''}{more}")

    # -- live updates -----------------------------------------------------------------------

    def on_event(self, event: dict[str, Any]) -> None:
        self._stale.add(event["task_id"])
        if event["type"] in QUEUE_MOVES:  # the other queued tasks' places changed
            self._queue_moved = True
        if not self._fetching and self.session.owner is not None:
            self._fetching = True
            spawn(self._refresh_stale(), self)

    async def _refresh_stale(self) -> None:
        owner = self.session.owner
        assert owner is not None  # on_event starts this only once there is one
        try:
            while self._stale:
                await asyncio.sleep(BATCH_SECONDS)  # let a burst of deltas collapse into one read
                batch, self._stale = self._stale, set()
                if self._queue_moved:
                    self._queue_moved = False
                    queued, _ = await self.session.service.tasks.list_tasks(owner, "queued", LOAD_LIMIT)
                    for task in queued:
                        self.model.upsert(task)
                for task_id in batch:
                    try:
                        task = await self.session.service.tasks.task(owner, task_id)
                    except NotFound:
                        continue  # removed by retention meanwhile
                    self.model.upsert(task)
                    if task_id == self.selected_id():
                        self.detail.set_header(task)
                        self._update_buttons()
        finally:
            self._fetching = False

    # -- selection and actions --------------------------------------------------------------

    def selected_id(self) -> str | None:
        rows = self.table.selectionModel().selectedRows()
        return rows[0].data(ID_ROLE) if rows else None

    def _selection_changed(self, _selected: QItemSelection, _deselected: QItemSelection) -> None:
        task_id = self.selected_id()
        self.detail.show_task(self.model.task(task_id) if task_id else None)
        self._update_buttons()

    def _update_buttons(self) -> None:
        task = self.model.task(self.selected_id() or "")
        self.cancel_button.setEnabled(task is not None and task["status"] in ACTIVE
                                      and task["status"] != "cancelling")

    def cancel_selected(self) -> None:
        task_id = self.selected_id()
        if task_id is None or self.session.owner is None:
            return
        self.cancel_button.setEnabled(False)
        spawn(self.session.service.tasks.cancel(self.session.owner, "task", task_id), self, self._cancelled)

    def _cancelled(self, task: dict[str, Any]) -> None:
        self.model.upsert(task)
        self._update_buttons()

    def _reveal(self, task_id: str, task: dict[str, Any]) -> None:
        self.model.upsert(task)
        self.select_task(task_id)

    def select_task(self, task_id: str) -> None:
        """Show one task (from a notification): reveal it whatever the filter, select it."""
        if self.model.row_of(task_id) < 0:
            assert self.session.owner is not None
            spawn(self.session.service.tasks.task(self.session.owner, task_id), self, partial(self._reveal, task_id))
            return
        self.filter.setCurrentText("All")
        source = self.model.index(self.model.row_of(task_id), 0)
        index = self.proxy.mapFromSource(source)
        self.table.selectRow(index.row())
        self.table.scrollTo(index)

