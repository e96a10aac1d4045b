"""Chat: try a model without writing a script (issue 40). Each message is a task of the owner like
any other (it shows in Tasks), answered through the core's `respond` as an HTTP stream would be;
the conversation goes on through `previous_response_id`. Stop cancels the task; the next message
continues from the last answer that completed."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from PySide6.QtGui import QTextCursor
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from app.core.answers import Answer, Ask, respond
from app.core.tasks import TERMINAL_EVENTS
from app.display import is_remote
from app.errors import LmspError
from app.gui.async_ui import spawn
from app.gui.session import Session
from app.gui.task_table import status_text
from app.gui.widgets import named, plain

MAX_TOKENS = 1024  # an answer's length at most: a try, not a book
# Sampling for a conversation, not the API's defaults (temperature 1.0, top_p 1.0), at which small
# models drift off topic and into other scripts: the default model's card asks for 0.2 and 0.9 (a
# 135M model wanders still, less often).
TEMPERATURE, TOP_P = 0.2, 0.9


class ChatTab(QWidget):
    def __init__(self, session: Session, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.session = session
        self.previous: str | None = None  # the last completed response: the next message continues it
        self.task_id: str | None = None   # the answer being written, if any
        self._asking: asyncio.Task[Any] | None = None
        self.model = named(QComboBox(), "chat-model")
        self.model.setMinimumContentsLength(24)
        self.new_chat = named(QPushButton("New chat"), "chat-new")
        self.new_chat.clicked.connect(self.start_over)
        top = QHBoxLayout()
        top.addWidget(QLabel("Model:"))
        top.addWidget(self.model, 1)
        top.addWidget(self.new_chat)
        self.transcript = named(QTextBrowser(), "chat-transcript")
        self.stats = plain(named(QLabel(), "chat-stats"))  # an error message among the figures
        self.input = named(QLineEdit(placeholderText="Type a message and press Enter"), "chat-input")
        self.input.returnPressed.connect(self.send)
        self.send_button = named(QPushButton("Send"), "chat-send")
        self.send_button.clicked.connect(self.send)
        self.stop_button = named(QPushButton("Stop"), "chat-stop")
        self.stop_button.clicked.connect(self.stop)
        bottom = QHBoxLayout()
        bottom.addWidget(self.input, 1)
        bottom.addWidget(self.send_button)
        bottom.addWidget(self.stop_button)
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addWidget(self.transcript, 1)
        layout.addWidget(self.stats)
        layout.addLayout(bottom)
        session.models_updated.connect(self.show_models)
        self.show_models()
        self._update_buttons()

    def show_models(self) -> None:
        """The models that can answer now, the one picked kept."""
        picked = self.model.currentText()
        usable = [m["id"] for m in self.session.models if m["status"] in ("available", "loaded")
                  or (is_remote(m) and m["status"] == "available")]
        self.model.blockSignals(True)
        self.model.clear()
        self.model.addItems(usable)
        if picked in usable:
            self.model.setCurrentText(picked)
        self.model.blockSignals(False)
        self._update_buttons()

    @property
    def busy(self) -> bool:
        return self._asking is not None and not self._asking.done()

    def _update_buttons(self) -> None:
        self.send_button.setEnabled(not self.busy and self.model.count() > 0)
        self.stop_button.setEnabled(self.busy)
        self.model.setEnabled(not self.busy)

    def start_over(self) -> None:
        self.stop()
        self.previous = None
        self.transcript.clear()
        self.stats.setText("")

    def send(self) -> None:
        text = self.input.text().strip()
        if not text or self.busy or not self.model.currentText():
            return
        self.input.clear()
        self._append(f"\n\nYou: {text}" if self.transcript.toPlainText() else f"You: {text}")
        self._append(f"\n\n{self.model.currentText()}: ")
        self._asking = spawn(self._ask(self.model.currentText(), text), self)
        self._asking.add_done_callback(lambda _: self._update_buttons())
        self._update_buttons()

    def stop(self) -> None:
        if self.busy and self.task_id is not None and self.session.owner is not None:
            spawn(self.session.service.tasks.cancel(self.session.owner, "task", self.task_id), self)

    async def _ask(self, model: str, text: str) -> None:
        owner = self.session.owner
        assert owner is not None, "the chat is shown once the service is ready"
        body: dict[str, Any] = {"model": model, "input": text, "max_output_tokens": MAX_TOKENS,
                                "temperature": TEMPERATURE, "top_p": TOP_P}
        if self.previous is not None:
            body["previous_response_id"] = self.previous
        started, first, final = time.monotonic(), None, None
        self.stats.setText("Waiting for the model…")
        try:
            async with respond(self.session.service, Ask(owner, body, stream=True), lambda: False) as answer:
                final, first = await self._stream(answer, started)
        except LmspError as exc:  # refused, or failed before any output: said here, not in a dialog
            final = {"status": "failed", "error": {"message": exc.message}}
        self.task_id = None
        self._finish(final, started, first, time.monotonic())

    async def _stream(self, answer: Answer, started: float) -> tuple[dict[str, Any] | None, float | None]:
        """Show the answer as it comes: (the final response, when its first token came)."""
        first, final = None, None
        self.task_id = answer.task_id
        assert answer.events is not None and answer.task_id is not None and self.session.owner is not None
        task = await self.session.service.tasks.task(self.session.owner, answer.task_id)
        if task["status"] == "queued":  # behind other tasks: say where it stands
            self.stats.setText(f"Waiting: {status_text(task)}")
        async with contextlib.aclosing(answer.events) as events:
            async for event in events:
                if event is None:
                    continue
                if event["type"] == "response.output_text.delta":
                    first = first or time.monotonic()
                    self._append(event["delta"])
                    self.stats.setText(f"Time to first token {first - started:.2f} s · writing…")
                elif event["type"] == "response.reasoning_text.delta":  # a thinking model, before it answers
                    first = first or time.monotonic()
                    self.stats.setText(f"Time to first token {first - started:.2f} s · thinking…")
                elif event["type"] in TERMINAL_EVENTS:
                    final = event["response"]
        return final, first

    def _finish(self, final: dict[str, Any] | None, started: float, first: float | None, ended: float) -> None:
        status = final["status"] if final else "stopped"
        if final is not None and status in ("completed", "incomplete"):
            self.previous = final["id"]  # only a completed answer can be continued
        tokens = ((final or {}).get("usage") or {}).get("output_tokens") or 0
        parts = [f"Time to first token {first - started:.2f} s" if first else "No output", f"{tokens} tokens"]
        if first and tokens > 1 and ended > first:
            parts.append(f"{(tokens - 1) / (ended - first):.1f} tokens/s")  # the first token's time is the TTFT
        if status != "completed":
            why = (final or {}).get("error") or {}
            parts.append({"cancelled": "stopped", "incomplete": "cut at the length limit"}.get(
                status, f"{status}: {why.get('message', '')}" if why else status))
        self.stats.setText(" · ".join(parts))

    def _append(self, text: str) -> None:
        cursor = self.transcript.textCursor()
        cursor.movePosition(QTextCursor.MoveOperation.End)
        cursor.insertText(text)
        self.transcript.setTextCursor(cursor)
        self.transcript.ensureCursorVisible()
