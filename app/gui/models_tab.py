"""Models: the registered model files and remote models, and Add / Edit / Remove / Load / Unload."""

from __future__ import annotations

from collections.abc import Awaitable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFileDialog, QHBoxLayout, QLabel, QProgressDialog, QPushButton, QTableWidgetItem, QWidget
from shiboken6 import isValid

from app.display import facts, human_size, is_remote, processor_facts, processor_text, short_digest
from app.errors import LmspError
from app.gui.async_ui import confirm, show_error, spawn
from app.gui.download_dialog import show_download_dialog
from app.gui.found_models import show_found_models
from app.gui.remote_dialog import RemoteModelDialog
from app.gui.session import Session
from app.gui.widgets import hashing_progress, list_page, list_table, markup, named, plain, tip

COLUMNS = ("Model", "Size", "Digest", "State", "Engine", "Memory")
ENGINE, MEMORY = 4, 5
ENGINE_MODES = {"fast": "Fast", "safe": "Safe mode"}
ENGINE_HINT = "llama.cpp's fastest CPU paths for this processor."
STATES = {"available": "Ready", "loaded": "Loaded", "missing": "File missing", "changed": "File changed on disk",
          "unreachable": "Unreachable"}
REMOTE_HINT = "Served by other OpenAI-compatible servers: nothing to load here."
FAST_AGAIN_HINT = ("This model crashed llama.cpp's fast paths on this computer and runs in safe mode. Try them "
                   "again (after an update of LMSP Tray, say): if they still crash, it goes back to safe mode "
                   "by itself and your tasks carry on.")


def endpoint_line(endpoint: dict[str, Any]) -> str:
    """"gpu-box:8080 ✓ 1 running" or "office:8080 ✗ refused the connection …" (the error
    without the URL it starts with: the host already says which)."""
    host = urlsplit(endpoint["base_url"]).netloc or endpoint["base_url"]
    if endpoint["status"] != "available":
        why = (endpoint.get("error") or "not answering").removeprefix(endpoint["base_url"]).lstrip(": ")
        return f"{host} ✗ {why}"
    return f"{host} ✓" + (f" {endpoint['running']} running" if endpoint.get("running") else "")


def state_text(model: dict[str, Any]) -> str:
    """The State cell: a remote model that answers says so, and how many of its endpoints do not."""
    down = sum(1 for e in model.get("endpoints") or [] if e["status"] != "available")
    state = STATES.get(model["status"], model["status"])
    if not down or model["status"] != "available":
        return state
    return f"{state}, {down} of {len(model['endpoints'])} unreachable"


def engine_text(model: dict[str, Any]) -> str:
    """The Engine cell of a local model: its mode, and where it runs once loaded (Fast · 100% GPU)."""
    mode = ENGINE_MODES.get((model.get("engine") or {}).get("mode", ""), "—")
    return f"{mode} · {processor_text(model['processor'])}" if model.get("processor") else mode


def memory_text(model: dict[str, Any]) -> tuple[str, str]:
    """The Memory cell and its longer form, from the model's `memory`: "0.5 GB" and "Memory: 0.5 GB
    (KV cache 0.4 GB for 4 tasks at once)"; a KV cache that cannot be known before the load says so."""
    memory = model.get("memory")
    if not memory:
        return "—", ""
    tasks = f"for {memory['parallel']} task{'s' if memory['parallel'] != 1 else ''} at once"
    if memory["total_bytes"] is None:
        return (f"{human_size(memory['weights_bytes'])} + ?",
                f"Memory: {human_size(memory['weights_bytes'])} and a KV cache {tasks} whose size is not known "
                "before the model loads")
    total = human_size(memory["total_bytes"])
    return total, f"Memory: {total} (KV cache {human_size(memory['kv_cache_bytes'])} {tasks})"


def endpoints_summary(model: dict[str, Any]) -> str:
    endpoints = model.get("endpoints") or []
    count = f"{len(endpoints)} endpoint{'s' if len(endpoints) != 1 else ''}"
    return f"{count}: " + ", ".join(endpoint_line(e) for e in endpoints)


def facts_html(model: dict[str, Any]) -> str:
    """The details pane: app/display.py `facts` as a table of two label: value columns."""
    cells = [f"<td><b>{markup(label)}:</b></td><td>{markup(value)}</td>" for label, value in facts(model)]
    half = (len(cells) + 1) // 2
    rows = (cells[i] + ('<td width="24"></td>' + cells[i + half] if i + half < len(cells) else "")
            for i in range(half))
    return '<table cellspacing="2">' + "".join(f"<tr>{row}</tr>" for row in rows) + "</table>"


class ModelsTab(QWidget):
    def __init__(self, session: Session, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.session = session
        self.progress: QProgressDialog | None = None
        self.table = list_table(COLUMNS, stretch=0, widths={1: 90, 2: 120, 3: 150, ENGINE: 190, MEMORY: 90})
        self.table.itemSelectionChanged.connect(self._update_buttons)
        self.table.itemDoubleClicked.connect(lambda _item: self.edit_remote())
        self.remote_dialog: RemoteModelDialog | None = None  # the one add/edit window open, if any

        self.buttons: dict[str, QPushButton] = {}
        row = QHBoxLayout()
        for name, text, slot in (("add", "Add model file…", self.add_model_file),
                                 ("add-remote", "Add remote model…", self.add_remote),
                                 ("edit", "Edit…", self.edit_remote), ("remove", "Remove", self.remove),
                                 ("load", "Load", self.load_selected), ("unload", "Unload", self.unload_selected),
                                 ("fast-mode", "Try fast mode again", self.try_fast_mode)):
            button = self.buttons[name] = QPushButton(text)
            button.clicked.connect(slot)
            row.addWidget(button)
        row.addStretch(1)
        find = self.buttons["find"] = QPushButton("Find models on this computer…")
        find.setToolTip("Models that LM Studio, Ollama or Hugging Face already downloaded (nothing is copied)")
        find.clicked.connect(self.find_models)
        row.addWidget(find)
        download = self.buttons["download"] = QPushButton("Download a model…")
        download.setToolTip("A GGUF file from Hugging Face, checked against its sha256 before it is added")
        download.clicked.connect(self.download_model)
        row.addWidget(download)
        self.buttons["add-remote"].setToolTip("A model served by other OpenAI-compatible servers (llama.cpp, vLLM, "
                                              "Ollama, another LMSP Tray); its tasks are kept here")
        self.buttons["edit"].setToolTip("Change a remote model's endpoints")
        self.buttons["fast-mode"].setToolTip(FAST_AGAIN_HINT)
        page = list_page(self, row, self.table, "Removing a model only forgets it here: the file itself is never "
                         "deleted. A loaded model stays in memory until it is unloaded or idle too long.")
        self.details = plain(named(QLabel(wordWrap=True), "model-details"))  # the selected model, in full
        self.details.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        page.insertWidget(2, self.details)
        # What the selected local model is (family, size, quantization, context…), two columns of
        # label: value, so that it takes four lines under the table.
        self.facts = named(QLabel(), "model-facts")
        self.facts.setTextFormat(Qt.TextFormat.RichText)
        self.facts.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        page.insertWidget(3, self.facts)
        session.models_updated.connect(self.show_models)
        self.show_models()

    def show_models(self) -> None:
        selected = self.selected()
        models = self.session.models
        self.table.setRowCount(len(models))
        for row, model in enumerate(models):
            engine = model.get("engine") or {}
            remote = is_remote(model)
            memory, memory_hint = memory_text(model)
            cells = (model["id"], human_size(model.get("size_bytes")), short_digest(model.get("digest")),
                     state_text(model), "Remote" if remote else engine_text(model), memory)
            runs = [f"Processor: {processor_facts(model)}"] if model.get("processor") or engine.get("gpu_reason") \
                else []
            hints = {ENGINE: REMOTE_HINT if remote else "\n".join([engine.get("reason") or ENGINE_HINT, *runs]),
                     MEMORY: memory_hint}
            where = ("\n".join(endpoint_line(e) for e in model["endpoints"]) if remote
                     else f"{model.get('path', '')}\n{model.get('digest', '')}")
            for col, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setData(Qt.ItemDataRole.UserRole, model)
                item.setToolTip(tip(hints.get(col, where)))
                if col in (1, MEMORY):
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                self.table.setItem(row, col, item)
            if selected and model["id"] == selected["id"]:
                self.table.selectRow(row)
        self._update_buttons()

    def selected(self) -> dict[str, Any] | None:
        items = self.table.selectedItems()
        return items[0].data(Qt.ItemDataRole.UserRole) if items else None

    def _update_buttons(self) -> None:
        model = self.selected()
        remote = is_remote(model)
        local = None if remote else model  # a remote model is never loaded here
        status = local["status"] if local else None
        self.buttons["remove"].setEnabled(model is not None)
        self.buttons["edit"].setEnabled(remote)
        self.buttons["load"].setEnabled(status == "available")
        self.buttons["unload"].setEnabled(status == "loaded")
        # Only a fallback the engine remembers can be forgotten: the setting `safe` is the user's own.
        gpu_failed = local is not None and bool(local["engine"].get("gpu_reason"))
        self.buttons["fast-mode"].setText("Try the GPU again" if gpu_failed else "Try fast mode again")
        self.buttons["fast-mode"].setEnabled(gpu_failed or (local is not None and local["engine"]["mode"] == "safe"
                                             and self.session.service.settings["engine_mode"] == "auto"))
        for name in ("load", "unload"):
            self.buttons[name].setToolTip(REMOTE_HINT if remote else "")
        self.facts.setText(facts_html(model) if model is not None and not remote else "")
        if model is None:
            self.details.setText("")
            return
        where = endpoints_summary(model) if remote else model.get("path", "")
        memory = memory_text(model)[1]
        self.details.setText(f"{model['id']} — {where}" + (f"\n{memory}" if memory else ""))

    # -- actions ----------------------------------------------------------------------------

    def add_model_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Add a model file", str(Path.home()),
                                              "GGUF models (*.gguf);;All files (*)")
        if path:
            self.register(path)

    def find_models(self) -> None:
        show_found_models(self.session)

    def download_model(self) -> None:
        show_download_dialog(self.session)

    def add_remote(self) -> None:
        self._open_remote_dialog(None)

    def edit_remote(self) -> None:
        if is_remote(model := self.selected()):
            self._open_remote_dialog(model)

    def _open_remote_dialog(self, model: dict[str, Any] | None) -> None:
        """One add/edit window at a time: asking again brings it forward."""
        if self.remote_dialog is None or not isValid(self.remote_dialog) or not self.remote_dialog.isVisible():
            self.remote_dialog = RemoteModelDialog(self.session, model, self)
        self.remote_dialog.show()
        self.remote_dialog.raise_()
        self.remote_dialog.activateWindow()

    def register(self, path: str) -> None:
        """Validate and hash the file (long for big models), showing progress meanwhile."""
        dialog = self.progress = hashing_progress(self, "Adding a model",
                                                  f"Checking and hashing {Path(path).name}…", 420)
        self.buttons["add"].setEnabled(False)  # one file at a time

        def report(done: int, total: int) -> None:  # called on the loop thread
            dialog.setValue(int(done * 100 / total) if total else 100)

        async def work() -> dict[str, Any] | None:
            try:
                return await self.session.service.models.register_model({"path": path}, progress=report)
            except LmspError as exc:
                show_error(self, "Model not added", exc.message)
                return None
            finally:
                dialog.close()
                self.progress = None
                self.buttons["add"].setEnabled(True)

        spawn(work(), self)

    def remove(self) -> None:
        model = self.selected()
        if model is None:
            return
        question = (f"Forget the remote model {model['id']} and its API keys? Its servers are not affected."
                    if is_remote(model) else f"Forget the model {model['id']}? The file stays on disk.")
        if confirm(self, "Remove model", question, "Remove"):
            spawn(self._then_refresh(self.session.service.models.remove_model(model["id"])), self)

    def load_selected(self) -> None:
        if model := self.selected():
            self.buttons["load"].setEnabled(False)
            spawn(self._then_refresh(self.session.service.models.load_model(model["id"])), self)

    def unload_selected(self) -> None:
        if model := self.selected():
            self.buttons["unload"].setEnabled(False)
            spawn(self._then_refresh(self.session.service.models.unload_model(model["id"])), self)

    def try_fast_mode(self) -> None:
        if model := self.selected():
            self.buttons["fast-mode"].setEnabled(False)
            spawn(self._then_refresh(self.session.service.models.forget_engine_mode(model["id"])), self)

    async def _then_refresh(self, work: Awaitable[Any]) -> None:
        """Buttons were disabled while the work ran; whatever happened, show the truth again."""
        try:
            await work
        finally:
            self._update_buttons()
