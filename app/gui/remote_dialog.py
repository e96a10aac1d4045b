"""Add or edit a remote model (LMSP §11): its id and the OpenAI-compatible servers that serve it.

Saving probes every endpoint that is new or changed (the facade refuses one that does not
answer as it should); "Test connection" probes one beforehand. A refusal is shown beside the endpoint it names and
the window stays open. Saved API keys are never shown again: editing keeps a key unless a new
one is typed or "Clear key" is ticked.
"""

from __future__ import annotations

import re
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QCheckBox,
    QDialog,
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QScrollArea,
    QVBoxLayout,
    QWidget,
)

from app.errors import LmspError
from app.gui import style
from app.gui.async_ui import spawn
from app.gui.icons import app_icon
from app.gui.session import Session
from app.gui.widgets import act_or_close, named, plain

MAX_ENDPOINTS = 16
KEPT = "•••••• (unchanged)"
# The endpoint a refusal names: "remote.endpoints[1]", "remote.endpoints[0].base_url".
ENDPOINT_PARAM = re.compile(r"^remote\.endpoints\[(\d+)\]")


class EndpointBox(QGroupBox):
    """One endpoint's fields, its Test connection and Remove buttons, and what was found."""

    def __init__(self, saved: dict[str, Any] | None) -> None:
        super().__init__()
        self.saved = saved  # the endpoint as the facade listed it, when editing
        self.base_url = QLineEdit(placeholderText="http://gpu-box:8080/v1")
        self.model = QLineEdit(placeholderText="its name on that server")
        self.key = QLineEdit(echoMode=QLineEdit.EchoMode.Password)
        self.clear_key = QCheckBox("Clear key")
        self.clear_key.setToolTip("Send no key to this server from now on")
        keep_place = self.clear_key.sizePolicy()
        keep_place.setRetainSizeWhenHidden(True)  # the key fields line up whether it shows or not
        self.clear_key.setSizePolicy(keep_place)
        self.clear_key.setVisible(bool(saved and saved["has_api_key"]))
        self.test_button = QPushButton("Test connection")
        self.remove_button = QPushButton("Remove")
        self.status = news_line()
        if saved:
            self.base_url.setText(saved["base_url"])
            self.model.setText(saved["model"])
            self.say(f"✗ {saved['error']}" if saved["status"] != "available" else
                     "✓ Answering" + (f", {saved['running']} running" if saved["running"] else ""),
                     error=saved["status"] != "available")
        for changed in (self.base_url.textChanged, self.model.textChanged, self.clear_key.toggled):
            changed.connect(self._show_key_state)
        self._show_key_state()

        grid = QGridLayout(self)
        grid.addWidget(QLabel("Base URL"), 0, 0)
        grid.addWidget(self.base_url, 0, 1, 1, 4)
        grid.addWidget(QLabel("Model"), 1, 0)
        grid.addWidget(self.model, 1, 1)
        grid.addWidget(QLabel("API key"), 1, 2)
        grid.addWidget(self.key, 1, 3)
        grid.addWidget(self.clear_key, 1, 4)
        grid.addWidget(self.status, 2, 0, 1, 3)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        buttons.addWidget(self.test_button)
        buttons.addWidget(self.remove_button)
        grid.addLayout(buttons, 2, 3, 1, 2)
        grid.setColumnStretch(1, 3)
        grid.setColumnStretch(3, 2)

    def _saved_key_applies(self) -> bool:
        """The saved key goes on with this endpoint unless another is typed: the facade finds it
        by the same URL and model."""
        return bool(self.saved and self.saved["has_api_key"] and not self.clear_key.isChecked()
                    and self.base_url.text().strip().rstrip("/") == self.saved["base_url"]
                    and self.model.text().strip() == self.saved["model"])

    def keeps_key(self) -> bool:
        return self._saved_key_applies() and not self.key.text()

    def _show_key_state(self) -> None:
        if self.clear_key.isChecked():
            self.key.clear()
        self.key.setEnabled(not self.clear_key.isChecked())
        self.key.setPlaceholderText(KEPT if self._saved_key_applies() else "none")

    def body(self) -> dict[str, Any]:
        """The endpoint as the facade takes it: without "api_key" keeps the saved key, None clears it."""
        body: dict[str, Any] = {"base_url": self.base_url.text().strip(), "model": self.model.text().strip()}
        if self.key.text():
            body["api_key"] = self.key.text()
        elif self.clear_key.isChecked():
            body["api_key"] = None
        return body

    def say(self, text: str, error: bool = False) -> None:
        say(self.status, text, error)


class RemoteModelDialog(QDialog):
    def __init__(self, session: Session, model: dict[str, Any] | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.session = session
        self.editing = model
        self.setObjectName("remote-model")
        self.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)  # one per add or edit: nothing kept
        self.setWindowTitle(f"Edit remote model {model['id']}" if model else "Add a remote model")
        self.setWindowIcon(app_icon())
        self.resize(680, 520)

        intro = QLabel("A model served by other OpenAI-compatible servers (llama.cpp, vLLM, Ollama, another "
                       "LMSP Tray). Its tasks are kept here; each goes to the least busy endpoint that answers.",
                       wordWrap=True)
        self.model_id = named(QLineEdit(placeholderText="the name apps will ask for, e.g. big"), "remote-id")
        if model:  # an id is for good: it shows as text, not as a field
            self.model_id.setText(model["id"])
            self.model_id.setReadOnly(True)
            self.model_id.setFrame(False)
            self.model_id.setStyleSheet("background: transparent")
            self.model_id.setFocusPolicy(Qt.FocusPolicy.NoFocus)
        self.id_error = news_line()
        id_row = QHBoxLayout()
        id_row.addWidget(QLabel("Model id"))
        id_row.addWidget(self.model_id, 1)

        self.boxes: list[EndpointBox] = []
        self.list = QVBoxLayout()
        holder = QWidget()
        column = QVBoxLayout(holder)
        column.addLayout(self.list)
        column.addStretch(1)
        scroll = QScrollArea(widgetResizable=True)
        scroll.setWidget(holder)
        self.add_button = QPushButton("Add endpoint")
        self.add_button.clicked.connect(lambda: self.add_endpoint(None))

        self.message = news_line()
        buttons, self.save_button = act_or_close("Save", self.save, "Cancel", self.close)

        layout = QVBoxLayout(self)
        layout.addWidget(intro)
        layout.addLayout(id_row)
        layout.addWidget(self.id_error)
        layout.addWidget(scroll, 1)
        layout.addWidget(self.add_button)
        layout.addWidget(self.message)
        layout.addWidget(buttons)
        for saved in (model["endpoints"] if model else [None]):
            self.add_endpoint(saved)
        self.busy = False
        self.saved = False  # True once the facade took it

    # -- the endpoint list ------------------------------------------------------------------

    def add_endpoint(self, saved: dict[str, Any] | None) -> EndpointBox:
        box = EndpointBox(saved)
        box.test_button.clicked.connect(lambda: self.test(box))
        box.remove_button.clicked.connect(lambda: self.remove_endpoint(box))
        self.boxes.append(box)
        self.list.addWidget(box)
        self._renumber()
        return box

    def remove_endpoint(self, box: EndpointBox) -> None:
        self.boxes.remove(box)
        box.deleteLater()
        self._renumber()

    def _renumber(self) -> None:
        for i, box in enumerate(self.boxes):
            box.setTitle(f"Endpoint {i + 1}")
            box.remove_button.setEnabled(len(self.boxes) > 1)  # a remote model has at least one
        self.add_button.setEnabled(len(self.boxes) < MAX_ENDPOINTS)

    # -- actions ----------------------------------------------------------------------------

    def test(self, box: EndpointBox) -> None:
        box.say("Testing…")
        box.test_button.setEnabled(False)

        async def work() -> None:
            try:
                if self.editing and box.keeps_key():  # the key is only in the service: check the saved endpoint
                    box.say(await self._test_saved(box))
                else:
                    endpoint = {**box.body(), "api_key": box.key.text() or None}
                    found = await self.session.service.remotes.test_endpoint(endpoint)
                    box.say(f"✓ Answered in {found['latency_ms']:.0f} ms. It serves: "
                            f"{', '.join(found['models']) or 'no models listed'}.")
            except LmspError as exc:
                box.say(f"✗ {exc.message}", error=True)
            finally:
                box.test_button.setEnabled(True)

        spawn(work(), self)

    async def _test_saved(self, box: EndpointBox) -> str:
        """Loading a remote model probes its endpoints, with their keys; read this one's health."""
        assert self.editing is not None and box.saved is not None
        model = await self.session.service.models.load_model(self.editing["id"])
        same = next(e for e in model["endpoints"] if (e["base_url"], e["model"]) == (box.saved["base_url"],
                                                                                     box.saved["model"]))
        if same["status"] != "available":
            raise LmspError("upstream_unreachable", same["error"] or "It does not answer.")
        return "✓ Answers, with the saved key."

    def save(self) -> None:
        if self.busy:
            return
        self.busy = True
        self.save_button.setEnabled(False)
        say(self.id_error, "")
        for box in self.boxes:
            box.say("")
        self._say("Checking every endpoint…")
        remote = {"endpoints": [box.body() for box in self.boxes]}
        service = self.session.service

        async def work() -> None:
            try:
                if self.editing:
                    await service.remotes.update_remote_model(self.editing["id"], {"remote": remote})
                else:
                    await service.models.register_model({"id": self.model_id.text().strip(), "remote": remote})
            except LmspError as exc:
                self._show_refusal(exc)  # the window stays open, with what was typed
                return
            finally:
                self.busy = False
                self.save_button.setEnabled(True)
            self.saved = True
            self.close()

        spawn(work(), self)

    def _show_refusal(self, exc: LmspError) -> None:
        """Beside what it names: an endpoint, the id, or else under the list."""
        self._say("")
        named = ENDPOINT_PARAM.match(exc.param or "")
        if named and int(named.group(1)) < len(self.boxes):
            box = self.boxes[int(named.group(1))]
            box.say(f"✗ {exc.message}", error=True)
            field = (exc.param or "").rpartition(".")[2]  # base_url, model, api_key, or the endpoint as a whole
            {"model": box.model, "api_key": box.key}.get(field, box.base_url).setFocus()
        elif exc.param == "id" or exc.code == "model_exists":
            say(self.id_error, exc.message, error=True)
            self.model_id.setFocus()
        else:
            self._say(exc.message, error=True)

    def _say(self, text: str, error: bool = False) -> None:
        say(self.message, text, error)


def news_line() -> QLabel:
    """Where `say` writes: hidden until there is something to say."""
    label = plain(QLabel(wordWrap=True))  # an upstream's own words among them
    label.hide()
    return label


def say(label: QLabel, text: str, error: bool = False) -> None:
    """A line of news under a field: red when something was refused; hidden when there is none."""
    label.setStyleSheet(style.ERROR if error else style.HINT)
    label.setText(text)
    label.setVisible(bool(text))
