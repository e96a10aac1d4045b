"""The first-run welcome: what LMSP Tray is, the address apps use, how an app gets in, and a
way to the models already on this computer. Shown at each start until dismissed for good
(the desktop app remembers that in the preference WELCOME_DISMISSED)."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QCloseEvent, QFont, QFontDatabase, QGuiApplication
from PySide6.QtWidgets import QCheckBox, QDialog, QFrame, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from app.gui import style
from app.gui.icons import app_icon
from app.gui.session import Session
from app.gui.widgets import named

WELCOME_DISMISSED = "gui.welcome_dismissed"


def _heading() -> QHBoxLayout:
    """The app's icon beside its name and what it does."""
    icon = QLabel()
    icon.setPixmap(app_icon().pixmap(48, 48))
    icon.setAlignment(Qt.AlignmentFlag.AlignTop)
    title = QLabel("<span style='font-size: 15pt'><b>Welcome to LMSP Tray</b></span>")
    what = QLabel("LMSP Tray runs language models right here on this computer, for the apps you allow "
                  "to use them.", wordWrap=True)
    heading = QVBoxLayout()
    heading.setSpacing(4)
    heading.addWidget(title)
    heading.addWidget(what)
    top = QHBoxLayout()
    top.setSpacing(14)
    top.addWidget(icon)
    top.addLayout(heading, 1)
    return top


class WelcomeWindow(QDialog):
    find_models = Signal()
    dismissed = Signal(bool)  # closed; True: "Don't show this again" was ticked

    def __init__(self, session: Session, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.session = session
        self.setObjectName("welcome")
        self.setWindowTitle("Welcome to LMSP Tray")
        self.setWindowIcon(app_icon())
        self.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        self.setMinimumWidth(560)
        self._told = False
        top, address_row, find_row = _heading(), self._address_row(), self._find_row()

        pairing = QLabel("<ol style='margin-left: -22px; margin-top: 2px'>"
                         "<li>The app asks to use your models.</li>"
                         "<li>A window opens here with a code: check that the app shows the same code.</li>"
                         "<li>Click <b>Allow</b>. You can take it back any time in the Clients tab.</li></ol>",
                         wordWrap=True)

        line = QFrame()
        line.setFrameShape(QFrame.Shape.HLine)
        line.setFrameShadow(QFrame.Shadow.Sunken)
        self.dont_show = named(QCheckBox("Don't show this again"), "welcome-dont-show")
        self.close_button = named(QPushButton("Close"), "welcome-close")
        self.close_button.setDefault(True)
        self.close_button.clicked.connect(self.close)
        bottom = QHBoxLayout()
        bottom.addWidget(self.dont_show)
        bottom.addStretch(1)
        bottom.addWidget(self.close_button)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(20, 18, 20, 14)
        layout.setSpacing(8)
        layout.addLayout(top)
        layout.addSpacing(6)
        layout.addWidget(_section("Your apps reach it at"))
        layout.addLayout(address_row)
        layout.addSpacing(4)
        layout.addWidget(_section("How an app connects"))
        layout.addWidget(pairing)
        layout.addLayout(find_row)
        layout.addSpacing(6)
        layout.addWidget(line)
        layout.addLayout(bottom)
        self.finished.connect(lambda _result: self._tell())

    def _address_row(self) -> QHBoxLayout:
        """The service's address, in large type, and a button that copies it."""
        self.address = named(QLabel(self.session.api_base), "welcome-address")
        font = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)
        font.setPointSize(max(font.pointSize(), 11))
        font.setWeight(QFont.Weight.Bold)
        self.address.setFont(font)
        self.address.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.copy_button = QPushButton("Copy")
        self.copy_button.setAutoDefault(False)
        self.copy_button.setToolTip("Copy the address to the clipboard")
        self.copy_button.clicked.connect(self.copy_address)
        address_row = QHBoxLayout()
        address_row.addWidget(self.address, 1)
        address_row.addWidget(self.copy_button)
        return address_row

    def _find_row(self) -> QHBoxLayout:
        """A way to the models other tools downloaded, and what it does."""
        self.find_button = named(QPushButton("Models you already have…"), "welcome-find-models")
        self.find_button.setAutoDefault(False)
        self.find_button.clicked.connect(self.find_models.emit)
        find_hint = QLabel("Use the models that LM Studio, Ollama or Hugging Face already downloaded, "
                           "without copying them.", wordWrap=True)
        find_hint.setStyleSheet(style.HINT)
        find_row = QHBoxLayout()
        find_row.setSpacing(12)
        find_row.addWidget(self.find_button)
        find_row.addWidget(find_hint, 1)
        return find_row

    def copy_address(self) -> None:
        QGuiApplication.clipboard().setText(self.session.api_base)

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 (Qt's name)
        super().closeEvent(event)
        if event.isAccepted():
            self._tell()

    def _tell(self) -> None:
        if not self._told:  # close() and finished both lead here; say it once
            self._told = True
            self.dismissed.emit(self.dont_show.isChecked())


def _section(text: str) -> QLabel:
    label = QLabel(f"<b>{text}</b>")
    return label
