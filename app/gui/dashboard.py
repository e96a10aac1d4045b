"""The dashboard window: tabs for tasks, models, activity, a chat, clients and settings."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QCloseEvent, QKeySequence, QShortcut
from PySide6.QtWidgets import QLabel, QMainWindow, QTabWidget, QWidget

from app.gui.activity import Recorder
from app.gui.activity_tab import ActivityTab
from app.gui.chat_tab import ChatTab
from app.gui.clients_tab import ClientsTab
from app.gui.icons import app_icon
from app.gui.models_tab import ModelsTab
from app.gui.session import Session
from app.gui.settings_tab import SettingsTab
from app.gui.tasks_tab import TasksTab

TABS = ("Tasks", "Models", "Activity", "Chat", "Clients", "Settings")


class Dashboard(QMainWindow):
    closed = Signal()

    def __init__(self, session: Session, parent: QWidget | None = None, recorder: Recorder | None = None) -> None:
        """`recorder`: the app's, sampling since it started; else one of the window's own."""
        super().__init__(parent)
        self.session = session
        self.setObjectName("dashboard")
        self.setWindowTitle("LMSP Tray")
        self.setWindowIcon(app_icon())
        self.resize(980, 640)
        self.tasks = TasksTab(session)
        self.models = ModelsTab(session)
        self.activity = ActivityTab(recorder or Recorder(session, self))
        self.chat = ChatTab(session)
        self.clients = ClientsTab(session)
        self.settings = SettingsTab(session)
        self.tabs = QTabWidget()
        self.tabs.setDocumentMode(True)
        for widget, title in zip((self.tasks, self.models, self.activity, self.chat, self.clients,
                                       self.settings), TABS):
            self.tabs.addTab(widget, title)
        self.setCentralWidget(self.tabs)
        self.address = QLabel()
        self.address.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.statusBar().addWidget(self.address, 1)
        # Tabs by keyboard from anywhere in the window (a focused table would otherwise take
        # Ctrl+Tab for itself); Ctrl+W hides the window, as elsewhere.
        for keys, step in (("Ctrl+Tab", 1), ("Ctrl+PgDown", 1), ("Ctrl+Shift+Tab", -1),
                           ("Ctrl+PgUp", -1)):
            QShortcut(QKeySequence(keys), self, lambda step=step: self.next_tab(step))
        QShortcut(QKeySequence.StandardKey.Close, self, self.close)
        session.changed.connect(self._update_status)
        self._update_status()
        self.tasks.load()
        self.clients.load()

    def _update_status(self) -> None:
        line = self.session.status_line()
        if self.session.exposed:
            line += "   ⚠ reachable from other computers"
        self.address.setText(line)

    def next_tab(self, step: int) -> None:
        self.tabs.setCurrentIndex((self.tabs.currentIndex() + step) % self.tabs.count())

    def bring_forward(self, tab: str | None = None) -> None:
        if tab is not None:
            self.tabs.setCurrentIndex(TABS.index(tab))
        self.show()
        self.setWindowState(self.windowState() & ~Qt.WindowState.WindowMinimized)
        self.raise_()
        self.activateWindow()

    def show_task(self, task_id: str) -> None:
        self.bring_forward("Tasks")
        self.tasks.select_task(task_id)

    def add_model(self) -> None:
        self.bring_forward("Models")
        self.models.add_model_file()

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 (Qt's name)
        """Closing the window only hides it: the service lives in the tray."""
        event.accept()
        self.hide()
        self.closed.emit()
