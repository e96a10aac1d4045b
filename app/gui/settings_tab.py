"""Settings: one form over the service settings. Save sends only what changed, through the
facade's validation; a refused value is explained next to its field and nothing is saved."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.errors import LmspError
from app.gui import style
from app.gui.async_ui import spawn
from app.gui.session import Session
from app.gui.widgets import named, plain

DAY, MINUTE = 86400, 60
ON_RESTART = {"fail": "Mark it failed (the app may resubmit)", "retry": "Run it again from the start",
              "resume": "Continue where it stopped"}
ENGINE_MODES = {"auto": "Automatic (fast; safe if it crashes)", "fast": "Fast only",
                "safe": "Safe (slower, avoids CPU-specific crashes)"}
GPU_MODES = {"auto": "Automatic (the GPU where there is one; the CPU if it fails)", "off": "Off (the CPU only)"}
OLLAMA_MODES = {"off": "Off", "token": "On LMSP's port, for apps with a token",
                "open": "Also on Ollama's port, for apps without a token"}
# What apps on Ollama's port may do without a token (never admin), in the person's words.
OLLAMA_SCOPES = {"responses:write": "Generate", "models:read": "See the models",
                 "models:write": "Add and remove models", "responses:read": "Read their answers",
                 "tasks:read": "See their tasks", "tasks:cancel": "Cancel their tasks"}
RESTART_NEEDED = ("host", "port")
GROUPS = (("Network", ("host", "port", "allowed_origins")),
          ("Tasks", ("max_concurrent_tasks", "parallel", "default_on_restart", "retention_seconds")),
          ("Models", ("model_idle_ttl_seconds", "engine_mode", "gpu")),
          ("Apps that speak Ollama's API", ("ollama_api", "ollama_port", "ollama_scopes")))
LONGEST_LABEL = "Unfinished task after a restart:"  # the groups' label columns line up at this width


def choices(options: dict[str, str]) -> QComboBox:
    """A drop-down of a setting's values (its items' data), in the person's words."""
    box = QComboBox()
    for value, text in options.items():
        box.addItem(text, value)
    return box


class SettingsTab(QWidget):
    def __init__(self, session: Session, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.session = session
        self.host = QLineEdit()
        self.port = QLineEdit()
        self.host.setMinimumWidth(self.fontMetrics().horizontalAdvance("M" * 22))
        self.port.setFixedWidth(self.fontMetrics().horizontalAdvance("0" * 9))
        self.retention = QSpinBox(minimum=1, maximum=3650, suffix=" days")
        self.on_restart = choices(ON_RESTART)
        self.concurrency = QSpinBox(minimum=1, maximum=16)
        self.parallel = QSpinBox(minimum=1, maximum=64)
        self.origins = QPlainTextEdit()
        self.origins.setPlaceholderText("https://example.app  (one per line; none: only apps without an Origin)")
        self.origins.setFixedHeight(64)
        self.idle = QSpinBox(minimum=0, maximum=525600, suffix=" min")
        self.idle.setSpecialValueText("never")  # for 0; PySide6's stubs do not take it as a keyword
        self.engine_mode = choices(ENGINE_MODES)
        self.gpu = choices(GPU_MODES)
        # param name (as the facade reports it) -> (field, label text, hint)
        self.fields: dict[str, tuple[QWidget, str, str]] = {
            "host": (self.host, "Address", "127.0.0.1 keeps the service on this computer. Takes effect after restart."),
            "port": (self.port, "Port", "0 picks any free port. Takes effect after restart."),
            "retention_seconds": (self.retention, "Keep finished tasks for", ""),
            "default_on_restart": (self.on_restart, "Unfinished task after a restart", ""),
            "max_concurrent_tasks": (self.concurrency, "Models loaded at once", "Copies of models in memory, each "
                                     "serving its parallel tasks; each copy needs memory of its own."),
            "parallel": (self.parallel, "Parallel tasks per model", "Tasks one loaded model serves together; each "
                         "needs memory for its own KV cache (the Models tab shows what a model takes)."),
            "allowed_origins": (self.origins, "Allowed web origins", "Web pages from these origins may call the API."),
            "model_idle_ttl_seconds": (self.idle, "Unload idle model after", ""),
            "engine_mode": (self.engine_mode, "Inference engine", "Safe mode turns off llama.cpp's weight "
                            "repacking and AMX kernels, which crash on some CPUs. Applies from the next task."),
            "gpu": (self.gpu, "GPU", "A model's layers go to the graphics card, as many as its free memory holds. "
                    "Applies from the next task."),
            **self._ollama_fields(),
        }
        self.errors: dict[str, QLabel] = {}
        groups = self._groups()
        self.status = plain(QLabel(wordWrap=True))
        self.save_button = QPushButton("Save")
        self.save_button.clicked.connect(self.save)
        revert = QPushButton("Revert")
        revert.clicked.connect(self.load)
        buttons = QHBoxLayout()
        buttons.addWidget(self.status, 1)
        buttons.addWidget(revert)
        buttons.addWidget(self.save_button)
        self.running_note = QLabel(wordWrap=True)  # when --host/--port overrode the settings for this run
        self.running_note.setStyleSheet(style.HINT)
        layout = QVBoxLayout(self)
        layout.addWidget(self.running_note)
        layout.addLayout(groups)
        layout.addStretch(1)
        layout.addLayout(buttons)
        self.shown: dict[str, Any] = {}
        session.bridge.settings_changed.connect(self._changed_elsewhere)
        self.load()

    def _ollama_fields(self) -> dict[str, tuple[QWidget, str, str]]:
        """LMSP §15: whether and where Ollama's API answers, and what apps without a token may do."""
        self.ollama_api = choices(OLLAMA_MODES)
        self.ollama_port = QSpinBox(minimum=1, maximum=65535)
        self.ollama_port.setGroupSeparatorShown(False)
        self.ollama_scopes = QWidget()
        scope_boxes = QHBoxLayout(self.ollama_scopes)
        scope_boxes.setContentsMargins(0, 0, 0, 0)
        self.scope_boxes = {scope: QCheckBox(text) for scope, text in OLLAMA_SCOPES.items()}
        for box in self.scope_boxes.values():
            scope_boxes.addWidget(box)
        return {"ollama_api": (self.ollama_api, "Ollama's API", "For Open WebUI, Continue and other apps built for "
                               "Ollama. On Ollama's port, requests without a token are one client in the Clients "
                               "tab."),
                "ollama_port": (self.ollama_port, "Ollama's port", "11434 is Ollama's own: quit Ollama to use it."),
                "ollama_scopes": (self.ollama_scopes, "Apps without a token may", "")}

    def _groups(self) -> QVBoxLayout:
        """The fields, labelled, in their groups."""
        groups = QVBoxLayout()
        for title, params in GROUPS:
            form = QFormLayout()
            for param in params:
                field, label, hint = self.fields[param]
                name = QLabel(label + ":")
                name.setMinimumWidth(self.fontMetrics().horizontalAdvance(LONGEST_LABEL) + 8)
                name.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignTop)
                name.setContentsMargins(0, 4, 0, 0)  # level with the text inside the field
                form.addRow(name, self._row(param, field, hint))
            box = QGroupBox(title)
            box.setLayout(form)
            groups.addWidget(box)
        return groups

    def _row(self, param: str, field: QWidget, hint: str) -> QWidget:
        """The field (narrow ones keep their size), its hint, and room for its error."""
        row = QWidget()
        column = QVBoxLayout(row)
        column.setContentsMargins(0, 0, 0, 0)
        column.setSpacing(2)
        if field in (self.origins, self.ollama_scopes):
            column.addWidget(field)
        else:
            line = QHBoxLayout()
            line.addWidget(field)
            line.addStretch(1)
            column.addLayout(line)
        if hint:
            note = QLabel(hint, wordWrap=True)
            note.setStyleSheet(style.HINT)
            column.addWidget(note)
        error = self.errors[param] = plain(named(QLabel(wordWrap=True), f"error:{param}"))  # it quotes the value
        error.setStyleSheet(style.ERROR)
        error.hide()
        column.addWidget(error)
        return row

    def load(self) -> None:
        s = self.session.service.settings
        self.host.setText(str(s["host"]))
        self.port.setText(str(s["port"]))
        self.retention.setValue(max(1, round(s["retention_seconds"] / DAY)))
        self.on_restart.setCurrentIndex(max(0, self.on_restart.findData(s["default_on_restart"])))
        self.concurrency.setValue(s["max_concurrent_tasks"])
        self.parallel.setValue(s["parallel"])
        self.origins.setPlainText("\n".join(s["allowed_origins"]))
        self.idle.setValue(round(s["model_idle_ttl_seconds"] / MINUTE))
        self.engine_mode.setCurrentIndex(max(0, self.engine_mode.findData(s["engine_mode"])))
        self.gpu.setCurrentIndex(max(0, self.gpu.findData(s["gpu"])))
        self.ollama_api.setCurrentIndex(max(0, self.ollama_api.findData(s["ollama_api"])))
        self.ollama_port.setValue(s["ollama_port"])
        for scope, box in self.scope_boxes.items():
            box.setChecked(scope in s["ollama_scopes"])
        self.shown = self.values()  # what the form said before any edit (days/minutes are rounded)
        now = urlsplit(self.session.url)
        differs = self.session.url and (now.hostname, now.port) != (s["host"].strip("[]"), s["port"])
        self.running_note.setVisible(bool(differs))
        self.running_note.setText(f"This run serves on {self.session.address}, as chosen when it started; "
                                  "the settings below apply from the next start without --host/--port.")
        self.clear_errors()
        self.status.clear()

    def values(self) -> dict[str, Any]:
        """The form as settings; a port that is not a number stays text (and is refused)."""
        port = self.port.text().strip()
        return {"host": self.host.text().strip(), "port": int(port) if port.isdigit() else port,
                "retention_seconds": self.retention.value() * DAY,
                "default_on_restart": self.on_restart.currentData(),
                "max_concurrent_tasks": self.concurrency.value(),
                "parallel": self.parallel.value(),
                "allowed_origins": [o.strip() for o in self.origins.toPlainText().splitlines() if o.strip()],
                "model_idle_ttl_seconds": self.idle.value() * MINUTE,
                "engine_mode": self.engine_mode.currentData(), "gpu": self.gpu.currentData(),
                "ollama_api": self.ollama_api.currentData(), "ollama_port": self.ollama_port.value(),
                "ollama_scopes": [scope for scope, box in self.scope_boxes.items() if box.isChecked()]}

    def changes(self) -> dict[str, Any]:
        return {k: v for k, v in self.values().items() if v != self.shown.get(k)}

    def clear_errors(self) -> None:
        for label in self.errors.values():
            label.hide()
            label.clear()

    def show_error(self, param: str | None, message: str) -> None:
        label = self.errors.get(param or "")
        if label is None:
            self.status.setStyleSheet(style.ERROR)
            self.status.setText(message)
            return
        label.setText(message)
        label.show()
        self.fields[param or ""][0].setFocus()
        self.status.setStyleSheet(style.ERROR)
        self.status.setText("Not saved: please correct the field marked in red.")

    def save(self) -> None:
        self.clear_errors()
        changes = self.changes()
        if not changes:
            self.status.setStyleSheet("")
            self.status.setText("Nothing to save.")
            return
        if not isinstance(changes.get("port", 0), int):
            self.show_error("port", "The port must be a whole number from 0 to 65535.")
            return
        self.save_button.setEnabled(False)
        spawn(self._save(changes), self)

    async def _save(self, changes: dict[str, Any]) -> None:
        try:
            await self.session.service.settings.update(changes)
        except LmspError as exc:
            self.show_error(exc.param, exc.message)
            return
        finally:
            self.save_button.setEnabled(True)
        self.load()
        later = [k for k in RESTART_NEEDED if k in changes]
        self.status.setStyleSheet("")
        self.status.setText("Saved." + (" The new address and port take effect after a restart." if later else ""))

    def _changed_elsewhere(self, _keys: list[str]) -> None:
        if not self.changes():  # never overwrite edits in progress
            status = self.status.text()
            self.load()
            self.status.setText(status)
