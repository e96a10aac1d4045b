"""The tray icon: a state icon, a tooltip saying what runs, a menu built when it opens, and
notifications that lead to the right place when clicked."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, Qt, QUrl, Signal
from PySide6.QtGui import QAction, QDesktopServices, QGuiApplication
from PySide6.QtWidgets import QMenu, QSystemTrayIcon

from app.display import is_remote
from app.errors import LmspError
from app.gui import autostart
from app.gui.async_ui import show_error, spawn
from app.gui.icons import tray_icon
from app.gui.models_tab import endpoints_summary
from app.gui.session import Session
from app.gui.widgets import markup, tip


class Tray(QObject):
    open_dashboard = Signal()
    open_settings = Signal()
    add_model = Signal()
    add_remote_model = Signal()
    open_models = Signal()
    find_models = Signal()
    download_model = Signal()
    review_pairing = Signal(str)   # pairing id
    quit_requested = Signal()

    def __init__(self, session: Session, data_dir: Path | None = None, parent: QObject | None = None,
                 log_dir: Path | None = None) -> None:
        super().__init__(parent)
        self.session = session
        self.data_dir = data_dir
        self.log_dir = log_dir  # where app.logs writes; None: not known (no "Open logs")
        self.state = ""
        self.menu = QMenu()
        self.menu.setToolTipsVisible(True)
        self.menu.aboutToShow.connect(self.build_menu)  # lazily: always current, nothing to keep in sync
        self.icon = QSystemTrayIcon(tray_icon("starting"))
        self.icon.setContextMenu(self.menu)
        self.icon.activated.connect(self._activated)
        self.icon.messageClicked.connect(self._message_clicked)
        self._on_message: Callable[[], object] | None = None
        session.changed.connect(self.refresh)
        self.refresh()

    def show(self) -> None:
        self.icon.show()

    def hide(self) -> None:
        self.icon.hide()

    def refresh(self) -> None:
        state = self.session.icon_state()
        if state != self.state:
            self.state = state
            self.icon.setIcon(tray_icon(state))
        text = "\n".join([self.session.status_line(), *self.session.download_lines()])
        if self.session.exposed:
            text += "\nWarning: reachable from other computers"
        self.icon.setToolTip(tip(text))

    def notify(self, title: str, text: str, on_click: Callable[[], object] | None = None,
               icon: QSystemTrayIcon.MessageIcon = QSystemTrayIcon.MessageIcon.Information) -> None:
        """A message from the tray; clicking it runs `on_click` (the latest message wins). `text` is
        escaped: notification servers read markup (<b>, <a href>, <img>) in the body, and it holds
        names and error messages the app did not write."""
        self._on_message = on_click
        self.icon.showMessage(title, markup(text), icon, 10000)

    def _message_clicked(self) -> None:
        if self._on_message is not None:
            self._on_message()

    def _activated(self, reason: QSystemTrayIcon.ActivationReason) -> None:
        if reason in (QSystemTrayIcon.ActivationReason.Trigger, QSystemTrayIcon.ActivationReason.DoubleClick):
            if self.session.phase == "ready":
                self.open_dashboard.emit()

    # -- the menu ---------------------------------------------------------------------------

    def _action(self, menu: QMenu, name: str, text: str, slot: Callable[..., Any] | None = None,
                enabled: bool = True) -> QAction:
        action = menu.addAction(text)
        action.setObjectName(name)  # tests (and accessibility tools) find actions by name
        action.setEnabled(enabled)
        if slot is not None:
            action.triggered.connect(slot)
        return action

    def build_menu(self) -> None:
        menu, session = self.menu, self.session
        # clear() deletes the entries but not the submenus (children of the menu): drop them too.
        for sub in menu.findChildren(QMenu, options=Qt.FindChildOption.FindDirectChildrenOnly):
            sub.setParent(None)
            sub.deleteLater()
        menu.clear()
        ready = session.phase == "ready"
        self._action(menu, "status", session.status_line(), enabled=False)
        if session.exposed:
            self._action(menu, "exposed", "⚠ Reachable from other computers", enabled=False)
        menu.addSeparator()
        self._action(menu, "dashboard", "Open dashboard", self.open_dashboard.emit, ready)
        models = menu.addMenu("Models")
        models.setObjectName("models")
        models.setEnabled(ready)
        self._build_models(models)
        if session.paused:
            self._action(menu, "pause", "Resume tasks", lambda: self._set_paused(False), ready)
        else:
            self._action(menu, "pause", "Pause new tasks", lambda: self._set_paused(True), ready)
        if session.pairings:
            pairings = menu.addMenu(f"Pairing requests ({len(session.pairings)})")
            pairings.setObjectName("pairings")
            self._build_pairings(pairings)
        menu.addSeparator()
        self._action(menu, "copy", "Copy API address", self.copy_address, ready).setToolTip(session.api_base)
        self._ollama_entry(menu, ready)
        login = self._action(menu, "autostart", "Start at login", self._toggle_autostart, autostart.SUPPORTED)
        login.setCheckable(True)
        login.setChecked(autostart.enabled())
        if not autostart.SUPPORTED:
            login.setToolTip(autostart.UNSUPPORTED_REASON)
        self._action(menu, "settings", "Settings…", self.open_settings.emit, ready)
        # Also while starting or after a failed start: that is when the logs matter most.
        logs = self._action(menu, "logs", "Open logs", self.open_logs, self.log_dir is not None)
        logs.setToolTip(str(self.log_dir) if self.log_dir else "The log folder is not known")
        menu.addSeparator()
        self._action(menu, "quit", "Quit LMSP Tray", self.quit_requested.emit, session.phase != "stopping")

    def _build_models(self, menu: QMenu) -> None:
        service = self.session.service
        for model in self.session.models:
            if is_remote(model):
                self._remote_entry(menu, model)
                continue
            usable = model["status"] in ("available", "loaded")
            label = model["id"] if usable else f"{model['id']} (file {model['status']})"
            action = self._action(menu, f"model:{model['id']}", label, enabled=usable)
            action.setCheckable(True)
            action.setChecked(model["status"] == "loaded")
            action.setToolTip("Loaded: click to unload" if model["status"] == "loaded" else "Click to load")
            model_id = model["id"]
            action.triggered.connect(lambda checked, m=model_id: spawn(
                service.models.load_model(m) if checked else service.models.unload_model(m)))
        if not self.session.models:
            self._action(menu, "no-models", "No models yet", enabled=False)
        menu.addSeparator()
        self._action(menu, "add-model", "Add model file…", self.add_model.emit)
        self._action(menu, "add-remote-model", "Add remote model…", self.add_remote_model.emit)
        self._action(menu, "find-models", "Find models on this computer…", self.find_models.emit)
        self._action(menu, "download-model", "Download a model…", self.download_model.emit)

    def _remote_entry(self, menu: QMenu, model: dict[str, Any]) -> None:
        """Nothing to load: the entry says whether its servers answer and leads to the Models tab."""
        reachable = model["status"] == "available"
        label = f"{model['id']} — remote" + ("" if reachable else ", unreachable")
        action = self._action(menu, f"model:{model['id']}", label, self.open_models.emit, enabled=reachable)
        action.setToolTip(tip(endpoints_summary(model)))

    def _build_pairings(self, menu: QMenu) -> None:
        service = self.session.service
        for pairing in self.session.pairings.values():
            pid, name = pairing["id"], pairing["client_name"]
            menu.addSection(f"{name} — code {pairing['code']}")
            # Allowing happens only in the review window, where the code to compare and the
            # scopes asked for are in front of the person: never one click from a menu.
            self._action(menu, f"review:{pid}", f"Review and allow {name}…",
                         lambda _=False, p=pid: self.review_pairing.emit(p))
            self._action(menu, f"deny:{pid}", f"Deny {name}",
                         lambda _=False, p=pid: spawn(service.access.deny_pairing(p)))

    def _ollama_entry(self, menu: QMenu, ready: bool) -> None:
        """Apps built for Ollama (Open WebUI, Continue…) in or out with one click: checked is the
        `open` setting (Ollama's port, no pairing); Settings has the other choices."""
        settings = self.session.service.settings
        action = self._action(menu, "ollama", "Let Ollama apps in", self._toggle_ollama, ready)
        action.setCheckable(True)
        action.setChecked(ready and settings["ollama_api"] == "open")
        action.setToolTip(f"Apps built for Ollama reach LMSP Tray on 127.0.0.1:{settings['ollama_port']} without "
                          f"pairing, allowed to: {', '.join(settings['ollama_scopes'])}. They show under Clients.")

    def _toggle_ollama(self, checked: bool) -> None:
        async def switch() -> None:
            try:
                await self.session.service.settings.update({"ollama_api": "open" if checked else "off"})
            except LmspError as exc:  # Ollama's port taken (Ollama itself running), say
                show_error(None, "Ollama apps", exc.message)

        spawn(switch())

    # -- actions ----------------------------------------------------------------------------

    def _set_paused(self, paused: bool) -> None:
        self.session.service.tasks.set_paused(paused)
        self.refresh()

    def copy_address(self) -> None:
        QGuiApplication.clipboard().setText(self.session.api_base)

    def open_logs(self) -> None:
        """The log folder in the system's file manager."""
        if self.log_dir is None:
            return
        if not QDesktopServices.openUrl(QUrl.fromLocalFile(str(self.log_dir))):
            show_error(None, "Open logs", f"No file manager could open the log folder. The logs are in "
                                          f"{self.log_dir}")

    def _toggle_autostart(self, checked: bool) -> None:
        try:
            autostart.enable(self.data_dir) if checked else autostart.disable()
        except OSError as exc:
            show_error(None, "Start at login", f"The login entry could not be changed: {exc}")
