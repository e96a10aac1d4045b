"""The selected task: its event log and its text as it streams, and the response it continues.

A function call shows as its name and its arguments; once a call or a JSON result is complete
it is shown pretty-printed.

History comes from the core (`tasks.events`), live events from the bridge; events that arrive
while the history is loading wait in a buffer, and sequence numbers drop duplicates, so the
log has no gap and no repeat. While the pane is on screen, the task it shows is watched (the
core's `tasks.watch`), so that its output streams token by token, as it does to an SSE reader.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QFontDatabase, QHideEvent, QShowEvent, QTextCursor
from PySide6.QtWidgets import QLabel, QListWidget, QPlainTextEdit, QSplitter, QVBoxLayout, QWidget

from app.errors import NotFound
from app.gui.async_ui import spawn
from app.gui.session import Session
from app.gui.widgets import markup

PAGE = 1000  # the facade returns at most this many events per call
DELTAS = ("response.output_text.delta", "response.function_call_arguments.delta")


class TaskDetail(QWidget):
    open_task = Signal(str)  # the task of the response this one continues, when its link is clicked

    def __init__(self, session: Session, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.session = session
        self.task_id: str | None = None
        self.last_seq = -1
        self._buffer: list[dict[str, Any]] | None = None
        self._delta_run = 0
        self._unwatch: Callable[[], None] | None = None
        self.header = QLabel("Select a task to see its events and output.")
        self.header.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.chain = QLabel()  # "Continues resp_...": a conversation's previous turn (previous_response_id)
        self.chain.setObjectName("chain")
        self.chain.setTextFormat(Qt.TextFormat.RichText)
        self.chain.linkActivated.connect(lambda response_id: spawn(self._open_previous(response_id), self))
        self.chain.hide()
        self.log = QListWidget()
        self.log.setObjectName("event-log")
        self.log.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.text = QPlainTextEdit(readOnly=True)
        self.text.setObjectName("output-text")
        self.text.setPlaceholderText("The output appears here as it is generated.")
        split = QSplitter(Qt.Orientation.Horizontal)
        split.addWidget(_titled("Events", self.log))
        split.addWidget(_titled("Output", self.text))
        split.setSizes([380, 520])
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 4, 0, 0)
        layout.addWidget(self.header)
        layout.addWidget(self.chain)
        layout.addWidget(split, 1)
        session.bridge.task_event.connect(self.on_event)

    def show_task(self, task: dict[str, Any] | None) -> None:
        if task is None or task["id"] != self.task_id:
            self._release()
        if task is None:
            self.task_id = None
            self.chain.hide()
            self.header.setText("Select a task to see its events and output.")
            self.log.clear()
            self.text.clear()
            return
        self.set_header(task)
        if task["id"] == self.task_id:
            return
        self.task_id, self.last_seq, self._delta_run = task["id"], -1, 0
        self._follow()
        self.chain.hide()
        self.log.clear()
        self.text.clear()
        self._buffer = []
        spawn(self._load(task["id"]), self)

    def _follow(self) -> None:
        if self._unwatch is None and self.task_id is not None and self.isVisible():
            self._unwatch = self.session.service.tasks.watch(self.task_id)

    def _release(self) -> None:
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None

    def showEvent(self, event: QShowEvent) -> None:
        super().showEvent(event)
        self._follow()

    def hideEvent(self, event: QHideEvent) -> None:  # the dashboard closed to the tray, another tab
        super().hideEvent(event)
        self._release()

    def set_header(self, task: dict[str, Any]) -> None:
        error = task.get("error")
        extra = f" — {error['message']}" if error else ""
        self.header.setText(f"<b>{markup(task['id'])}</b> · {markup(task.get('model') or '—')} · "
                            f"{markup(task['status'])}{markup(extra)}")

    async def _load(self, task_id: str) -> None:
        owner = self.session.owner
        assert owner is not None
        after = -1
        while True:
            page = await self.session.service.tasks.events(owner, task_id, after)
            if self.task_id != task_id:
                return  # another task was selected meanwhile
            for event in page:
                self._apply(event)
            if len(page) < PAGE:
                break
            after = page[-1]["sequence_number"]
        buffered, self._buffer = self._buffer or [], None
        for late in buffered:
            self._apply(late)

    def on_event(self, event: dict[str, Any]) -> None:
        if event.get("task_id") != self.task_id:
            return
        if self._buffer is not None:
            self._buffer.append(event)
        else:
            self._apply(event)

    def _apply(self, event: dict[str, Any]) -> None:
        seq = event["sequence_number"]
        if seq <= self.last_seq:
            return
        self.last_seq = seq
        kind = event["type"]
        stamp = time.strftime("%H:%M:%S", time.localtime(event.get("created_at") or time.time()))
        if kind in DELTAS:
            self._append_text(event.get("delta", ""))
            self._delta_run += 1
            line = f"{seq:>4}  {stamp}  {kind.removeprefix('response.')} ×{self._delta_run}"
            if self._delta_run > 1:
                self.log.item(self.log.count() - 1).setText(line)
            else:
                self.log.addItem(line)
        else:
            self._delta_run = 0
            previous = (event.get("response") or {}).get("previous_response_id")
            if kind == "response.created" and previous:
                self.chain.setText(f'Continues <a href="{markup(previous)}">{markup(previous)}</a>')
                self.chain.show()
            if kind == "response.queued" and event.get("output_reset"):
                self.text.clear()  # a retry starts again: the earlier attempt's text is void
            shown = _finished_output(event)
            if shown is not None:
                self.text.setPlainText(shown)
            self.log.addItem(f"{seq:>4}  {stamp}  {kind.removeprefix('response.')}{_suffix(event)}")
        self.log.scrollToBottom()

    async def _open_previous(self, response_id: str) -> None:
        owner = self.session.owner
        assert owner is not None
        try:
            response = await self.session.service.responses.response(owner, response_id)
        except NotFound:
            self.chain.setText(f"Continues {markup(response_id)} (deleted or expired)")
            return
        self.open_task.emit(response["task"]["id"])

    def _append_text(self, delta: str) -> None:
        # A cursor of our own: the reader's selection stays put; follow the end only if they were there.
        bar = self.text.verticalScrollBar()
        following = bar.value() >= bar.maximum() - 4
        cursor = QTextCursor(self.text.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        cursor.insertText(delta)
        if following:
            bar.setValue(bar.maximum())


def _finished_output(event: dict[str, Any]) -> str | None:
    """What the output pane shows instead of the raw stream: a call's name (its arguments
    stream below it), then the whole call, or a complete JSON result, pretty-printed."""
    item = event.get("item") or {}
    if item.get("type") == "function_call":
        if event["type"] == "response.output_item.added":
            return f"Function call: {item['name']}\n"
        return f"Function call: {item['name']}\n{_pretty(item['arguments']) or item['arguments']}"
    if event["type"] == "response.output_text.done":
        return _pretty(event.get("text", ""))
    return None


def _pretty(text: str) -> str | None:
    """JSON objects and arrays indented; None for anything else (plain text stays as it is)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return json.dumps(value, indent=2, ensure_ascii=False) if isinstance(value, (dict, list)) else None


def _suffix(event: dict[str, Any]) -> str:
    if event["type"] == "response.failed" and event.get("error"):
        return f" — {event['error'].get('code')}: {event['error'].get('message')}"
    if event["type"] == "response.loading" and event.get("progress") is not None:
        return f" ({int(event['progress'] * 100)} %)"
    if event.get("output_reset"):
        return f" (attempt {event.get('attempt')}, output reset)"
    if event.get("preempted"):
        return " (gave its slot to another app's task; its output is kept)"
    return ""


def _titled(title: str, widget: QWidget) -> QWidget:
    box = QWidget()
    layout = QVBoxLayout(box)
    layout.setContentsMargins(0, 0, 0, 0)
    layout.setSpacing(2)
    label = QLabel(title)
    label.setStyleSheet("font-weight: bold")
    layout.addWidget(label)
    layout.addWidget(widget, 1)
    return box
