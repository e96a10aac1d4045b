"""A local app asks for access: who it is, what it could do (in words), the code it shows,
how long the request stays open. The person allows or denies."""

from __future__ import annotations

import time
from typing import Any

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QFont, QFontDatabase
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QLabel, QPushButton, QVBoxLayout, QWidget
from shiboken6 import isValid

from app.gui import style
from app.gui.async_ui import spawn
from app.gui.icons import app_icon
from app.gui.session import Session
from app.gui.widgets import markup, named

SCOPE_WORDS = {
    "models:read": "See which models are installed",
    "models:write": "Add, remove, load and unload models",
    "responses:read": "Read the answers it asked for",
    "responses:write": "Generate text and embeddings with your models",
    "tasks:read": "Follow the progress of its tasks",
    "tasks:cancel": "Cancel its tasks",
    "metrics:read": "See usage figures (tokens, speed)",
    "admin": "Full control: every app's work, the settings, and letting other apps in",
}


def scope_sentence(scope: str) -> str:
    return SCOPE_WORDS.get(scope, scope)


def countdown(seconds_left: float) -> str:
    if seconds_left <= 0:
        return "This request has expired. Ask the app to try again."
    minutes, seconds = divmod(int(seconds_left), 60)
    return f"This request expires in {minutes}:{seconds:02d}."


class PairingDialog(QDialog):
    def __init__(self, session: Session, pairing: dict[str, Any], parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.session = session
        self.pairing = pairing
        self.pairing_id: str = pairing["id"]
        self.setObjectName("pairing-dialog")
        self.setWindowTitle("Allow an app to use your models?")
        self.setWindowIcon(app_icon())
        self.setMinimumWidth(460)
        self.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)

        name = QLabel(f"<span style='font-size: 13pt'><b>{markup(pairing['client_name'])}</b></span> "
                      "wants to use the language models on this computer.", wordWrap=True)
        scopes = "".join(f"<li>{markup(scope_sentence(s))}</li>" for s in pairing["scopes"])
        abilities = QLabel(f"If you allow it, it can:<ul style='margin-left: -20px'>{scopes}</ul>", wordWrap=True)
        if "admin" in pairing["scopes"]:
            abilities.setText(abilities.text() + "<b>Only allow full control for an app you trust completely.</b>")
        self.code = named(QLabel(pairing["code"]), "pairing-code")
        font = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)
        font.setPointSize(22)
        font.setWeight(QFont.Weight.Bold)
        self.code.setFont(font)
        self.code.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.code.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        # A web page asks: the person judges the address it comes from, not only the name it gives itself.
        self.origin = named(QLabel(f"Asked by the web page at <b>{markup(pairing['origin'])}</b>. If you allow "
                                   "it, pages from this address (and only from it) can use this access.",
                                   wordWrap=True), "pairing-origin") if pairing.get("origin") else None
        self.expiry = named(QLabel(), "pairing-expiry")
        self.expiry.setStyleSheet(style.HINT)
        self.expiry.setAlignment(Qt.AlignmentFlag.AlignCenter)

        buttons = QDialogButtonBox()
        self.deny_button = QPushButton("Deny")
        self.allow_button = QPushButton("Allow")
        buttons.addButton(self.deny_button, QDialogButtonBox.ButtonRole.RejectRole)
        buttons.addButton(self.allow_button, QDialogButtonBox.ButtonRole.AcceptRole)
        self.allow_button.setAutoDefault(False)  # Enter must never grant access by accident
        self.deny_button.setDefault(True)
        self.allow_button.clicked.connect(self.allow)
        self.deny_button.clicked.connect(self.deny)

        layout = QVBoxLayout(self)
        layout.setSpacing(10)
        layout.addWidget(name)
        if self.origin is not None:
            layout.addWidget(self.origin)
        layout.addWidget(abilities)
        layout.addWidget(QLabel("Check that the app shows the same code:"))
        layout.addWidget(self.code)
        layout.addWidget(self.expiry)
        layout.addWidget(buttons)

        self._timer = QTimer(self, interval=1000)
        self._timer.timeout.connect(self.tick)
        self._timer.start()
        session.bridge.pairing_resolved.connect(self._resolved_elsewhere)
        self.tick()

    def seconds_left(self) -> float:
        return float(self.pairing["expires_at"]) - time.time()

    def tick(self) -> None:
        left = self.seconds_left()
        self.expiry.setText(countdown(left))
        if left <= 0:
            self._timer.stop()
            self.allow_button.setEnabled(False)
            self.deny_button.setText("Close")

    def allow(self) -> None:
        self._decide(self.session.service.access.approve_pairing(self.pairing_id))

    def deny(self) -> None:
        if self.seconds_left() <= 0:
            self.close()
            return
        self._decide(self.session.service.access.deny_pairing(self.pairing_id))

    def _decide(self, work: Any) -> None:
        self.allow_button.setEnabled(False)
        self.deny_button.setEnabled(False)

        async def decide() -> None:
            try:
                await work
            finally:
                if isValid(self):
                    self.close()  # decided, or refused (expired, decided elsewhere): nothing left to do here

        spawn(decide(), self.parentWidget())

    def _resolved_elsewhere(self, pairing_id: str, _status: str) -> None:
        if pairing_id == self.pairing_id and self.isVisible():
            self.close()
