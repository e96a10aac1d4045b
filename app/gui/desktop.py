"""The desktop app: one instance per data directory, the tray at once, then the service.

    run_desktop(life)
      1. single instance: a second launch asks the first to show its dashboard and exits 0
      2. QApplication on qasync's loop; unexpected errors go to a dialog, the app keeps running
      3. the tray icon appears at once, "starting"
      4. life.start(): recovery finishes before the server accepts anything
      5. the welcome window, until the person says "Don't show this again"
      6. idle in the tray until Quit (or SIGTERM); then life.stop(), in its fixed order
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

import qasync
from PySide6.QtCore import QMessageLogContext, QObject, QTimer, QtMsgType, qInstallMessageHandler
from PySide6.QtWidgets import QApplication, QSystemTrayIcon

from app.errors import LmspError
from app.gui import excepthook
from app.gui.activity import Recorder
from app.gui.async_ui import show_error, spawn
from app.gui.bridge import Bridge
from app.gui.dashboard import Dashboard
from app.gui.download_dialog import show_download_dialog
from app.gui.found_models import close_found_models, show_found_models
from app.gui.icons import app_icon
from app.gui.pairing_dialog import PairingDialog
from app.gui.session import Session
from app.gui.single_instance import SingleInstance
from app.gui.tray import Tray
from app.gui.welcome import WELCOME_DISMISSED, WelcomeWindow

log = logging.getLogger(__name__)


class Desktop(QObject):
    """Owns the windows and decides what a notification or a menu entry leads to."""

    def __init__(self, life: Any, instance: SingleInstance | None = None, welcome: bool = False) -> None:
        """`welcome`: offer the welcome window once ready (the real app does; tests ask for it)."""
        super().__init__()
        self.life = life
        self.bridge = Bridge(life.service.bus, self)
        self.session = Session(life.service, self.bridge, self)
        log_file = getattr(life, "log_file", None)  # set by app.main; None: "Open logs" stays greyed
        self.tray = Tray(self.session, life.data_dir, self, log_dir=Path(log_file).parent if log_file else None)
        self.dashboard: Dashboard | None = None
        self.activity = Recorder(self.session, self)  # from the start: the charts show the last 24 h
        self.pairing_dialogs: dict[str, PairingDialog] = {}
        self.announced: list[str] = []  # pairing ids a notification announced, oldest first
        self.offer_welcome = welcome
        self.welcome: WelcomeWindow | None = None
        self._saving: set[asyncio.Task[Any]] = set()  # preferences being written
        self.quitting = asyncio.Event()
        self._show_when_ready: str | None = None  # a tab asked for before the service was ready
        self.tray.open_dashboard.connect(lambda: self.show_dashboard())
        self.tray.open_settings.connect(lambda: self.show_dashboard("Settings"))
        self.tray.add_model.connect(self.add_model)
        self.tray.add_remote_model.connect(self.add_remote_model)
        self.tray.open_models.connect(lambda: self.show_dashboard("Models"))
        self.tray.find_models.connect(self.find_models)
        self.tray.download_model.connect(lambda: self.session.phase == "ready" and show_download_dialog(self.session))
        self.tray.review_pairing.connect(self.open_pairing)
        self.tray.quit_requested.connect(self.request_quit)
        if instance is not None:
            instance.show_requested.connect(lambda: self.show_dashboard())
        self.bridge.pairing_requested.connect(self._pairing_requested)
        self.bridge.task_event.connect(self._task_event)
        self.bridge.safe_mode.connect(self._safe_mode)
        self.bridge.gpu_fallback.connect(self._gpu_fallback)
        self._clock = QTimer(self, interval=5000)  # pairing requests expire without an event
        self._clock.timeout.connect(lambda: self.session.forget_expired(time.time()))
        self._clock.start()

    @property
    def has_tray(self) -> bool:
        return QSystemTrayIcon.isSystemTrayAvailable()

    async def run(self) -> int:
        self.tray.show()
        try:
            url = await self.life.start()
        except Exception as exc:  # stay in the tray, in the error state, until the person quits
            message = _start_problem(exc)
            log.error("could not start: %s", message)
            self.session.set_phase("error", message)
            if isinstance(exc, (LmspError, OSError)):  # expected kinds: a port in use, a newer database
                show_error(None, "LMSP Tray could not start", message)
            else:
                excepthook.report(type(exc), exc, exc.__traceback__)
            await self.quitting.wait()
            await self._stop()
            return 1
        await self.session.attach(url)
        self._announce_start()
        if not self.has_tray:  # no tray host: the window is the only way in (and out)
            log.warning("no system tray: showing the dashboard instead")
            self.ensure_dashboard().closed.connect(self.request_quit)
            self._show_when_ready = self._show_when_ready or "Tasks"
        if self._show_when_ready is not None:
            self.show_dashboard(self._show_when_ready)
        if self.offer_welcome:
            await self.show_welcome_unless_dismissed()
        await self.quitting.wait()
        await self._stop()
        return 0

    def request_quit(self) -> None:
        self.quitting.set()

    async def _stop(self) -> None:
        self.session.set_phase("stopping")
        for dialog in list(self.pairing_dialogs.values()):
            dialog.close()
        if self.welcome is not None:
            self.welcome.close()
        close_found_models()
        if self._saving:  # "Don't show this again", ticked just before Quit, still reaches the store
            await asyncio.wait(list(self._saving), timeout=10)
        if self.dashboard is not None:
            self.dashboard.hide()
        try:
            await self.life.stop()
        except Exception:  # a half-started service may not stop cleanly; exit anyway
            log.exception("stopping failed")
        self.bridge.close()
        self.tray.hide()

    def _announce_start(self) -> None:
        aside = self.session.service.describe().get("recovered_from_corruption")
        if aside:
            self.tray.notify("The database was damaged", f"It was set aside as {aside} (nothing was deleted) "
                             "and a fresh one was started.", icon=QSystemTrayIcon.MessageIcon.Warning)
        counts = self.session.service.recovery_counts
        failed = sum(n for move, n in counts.items() if move.endswith("->failed"))
        resumed = sum(n for move, n in counts.items() if move in ("running->running", "running->queued",
                                                                  "loading->queued"))
        if failed or resumed:
            parts = ([f"{resumed} resumed"] if resumed else []) + ([f"{failed} failed"] if failed else [])
            self.tray.notify("Unfinished tasks after the restart", ", ".join(parts) + ".",
                             lambda: self.show_dashboard("Tasks"))

    # -- windows ----------------------------------------------------------------------------

    def ensure_dashboard(self) -> Dashboard:
        if self.dashboard is None:
            self.dashboard = Dashboard(self.session, recorder=self.activity)
        return self.dashboard

    def show_dashboard(self, tab: str | None = None) -> Dashboard | None:
        """Bring the dashboard forward; asked for while starting (a second launch), it opens once ready."""
        if self.session.phase != "ready":
            if self.session.phase == "starting":
                self._show_when_ready = tab or "Tasks"
            return None
        dashboard = self.ensure_dashboard()
        dashboard.bring_forward(tab)
        return dashboard

    async def show_welcome_unless_dismissed(self) -> WelcomeWindow | None:
        try:
            if await self.session.service.settings.preference(WELCOME_DISMISSED):
                return None
        except LmspError as exc:
            log.warning("could not read the welcome preference: %s", exc.message)
            return None
        if self.quitting.is_set():
            return None
        welcome = self.welcome = WelcomeWindow(self.session)
        welcome.find_models.connect(self.find_models)
        welcome.dismissed.connect(self._welcome_dismissed)
        welcome.show()
        welcome.raise_()
        welcome.activateWindow()
        return welcome

    def _welcome_dismissed(self, forever: bool) -> None:
        self.welcome = None
        if forever:
            task = spawn(self.session.service.settings.set_preference(WELCOME_DISMISSED, True))
            self._saving.add(task)
            task.add_done_callback(self._saving.discard)

    def find_models(self) -> None:
        if self.session.phase == "ready":
            show_found_models(self.session)

    def add_model(self) -> None:
        if (dashboard := self.show_dashboard("Models")) is not None:
            dashboard.add_model()

    def add_remote_model(self) -> None:
        if (dashboard := self.show_dashboard("Models")) is not None:
            dashboard.models.add_remote()

    def show_task(self, task_id: str) -> None:
        if (dashboard := self.show_dashboard()) is not None:
            dashboard.show_task(task_id)

    def open_pairing(self, pairing_id: str) -> None:
        dialog = self.pairing_dialogs.get(pairing_id)
        pairing = self.session.pairings.get(pairing_id)
        if dialog is None:
            if pairing is None:
                return  # already decided or expired
            dialog = self.pairing_dialogs[pairing_id] = PairingDialog(self.session, pairing)
            dialog.destroyed.connect(lambda *_: self.pairing_dialogs.pop(pairing_id, None))
        dialog.show()
        dialog.raise_()
        dialog.activateWindow()

    def _pairing_requested(self, pairing: dict[str, Any]) -> None:
        if not pairing["notify"]:
            return  # the same requester was announced a moment ago; the tray menu lists this one too
        self.announced.append(pairing["id"])
        if self.has_tray and QSystemTrayIcon.supportsMessages():
            self.tray.notify("An app asks to use your models",
                             f"{pairing['client_name']} (code {pairing['code']}). Click to review.",
                             self.open_announced_pairings)
        else:
            self.open_pairing(pairing["id"])

    def open_announced_pairings(self) -> None:
        """A click on a notification does not say which one it was (Qt's messageClicked carries
        nothing, and older notifications stay on screen): every announced request still waiting
        is opened, so the one that was clicked is always among them."""
        self.announced = [pid for pid in self.announced if pid in self.session.pairings]
        for pairing_id in self.announced:
            self.open_pairing(pairing_id)

    def _task_event(self, event: dict[str, Any]) -> None:
        task_id = event["task_id"]
        if event["type"] == "download.completed":
            self.tray.notify("A model is ready", f"{event['model_id']} was downloaded and checked. Click to see it.",
                             lambda: self.show_dashboard("Models"))
        if event["type"] not in ("response.failed", "download.failed"):
            return
        if event["type"] == "response.failed" and not event["response"]["background"]:
            return  # a foreground request's caller is answered the error itself
        error = event.get("error") or {}
        title = "A download failed" if event["type"] == "download.failed" else "A task failed"
        self.tray.notify(title, error.get("message") or "The task failed.",
                         lambda: self.show_task(task_id), QSystemTrayIcon.MessageIcon.Warning)


    def _safe_mode(self, event: dict[str, Any]) -> None:
        """Said once per model, CPU and llama.cpp release: the engine remembers the choice, so this
        repeats only after fast mode was tried again (an update, or Try fast mode again) and crashed."""
        names = ", ".join(event.get("models") or []) or "a model"
        self.tray.notify("Running in safe mode",
                         f"{names} crashed the fast inference engine on this CPU. It now runs in safe mode, "
                         "a little slower; your tasks carry on. Nothing to do; the Models tab says more.",
                         lambda: self.show_dashboard("Models"), QSystemTrayIcon.MessageIcon.Information)

    def _gpu_fallback(self, event: dict[str, Any]) -> None:
        """Said once per model and llama.cpp release, as safe mode is: the engine remembers it."""
        names = ", ".join(event.get("models") or []) or "a model"
        self.tray.notify("Running on the CPU", f"{event.get('reason', '')} ({names}) "
                         "The Models tab can try the GPU again.",
                         lambda: self.show_dashboard("Models"), QSystemTrayIcon.MessageIcon.Warning)


def _start_problem(exc: Exception) -> str:
    if isinstance(exc, LmspError):
        return exc.message
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return ("The port is already in use by another program. Quit that program, or start LMSP Tray "
                "on another port (lmsp-tray --port 11536).")
    return str(exc)


def _on_signals(loop: asyncio.AbstractEventLoop, handler: Any) -> None:
    """SIGTERM/SIGINT quit cleanly, as the tray's Quit does."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, handler)
        except (NotImplementedError, RuntimeError, ValueError):  # Windows
            signal.signal(sig, lambda *_: loop.call_soon_threadsafe(handler))


QT_LEVELS = {QtMsgType.QtDebugMsg: logging.DEBUG, QtMsgType.QtInfoMsg: logging.INFO,
             QtMsgType.QtWarningMsg: logging.WARNING, QtMsgType.QtCriticalMsg: logging.ERROR,
             QtMsgType.QtFatalMsg: logging.CRITICAL}


def _qt_message(kind: QtMsgType, context: QMessageLogContext, message: str) -> None:
    logging.getLogger("qt").log(QT_LEVELS.get(kind, logging.WARNING), "%s", message)


def route_qt_messages() -> None:
    """Qt's own messages go into the log (its file too), instead of straight to stderr from the
    GUI thread: on a stderr nobody reads, that write would stop the app once the pipe is full."""
    qInstallMessageHandler(_qt_message)


def run_desktop(life: Any) -> int:
    route_qt_messages()
    # argv[0] names the X11 window class: "lmsp-tray", not "__main__.py".
    app = QApplication.instance() or QApplication(["lmsp-tray", *sys.argv[1:]])
    assert isinstance(app, QApplication)
    app.setApplicationName("LMSP Tray")
    app.setDesktopFileName("lmsp-tray")
    app.setWindowIcon(app_icon())
    app.setQuitOnLastWindowClosed(False)  # closing the dashboard leaves the service in the tray
    instance = SingleInstance(life.data_dir)
    if not instance.claim():
        log.info("LMSP Tray is already running for %s: asked it to show its dashboard", life.data_dir)
        return 0
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    excepthook.install(loop)
    desktop = Desktop(life, instance, welcome=True)
    _on_signals(loop, desktop.request_quit)
    main = loop.create_task(desktop.run())
    try:
        while True:
            try:
                return int(loop.run_until_complete(main))
            except RuntimeError:
                if main.done():
                    raise
                # Qt's loop ended under us (the session is ending): stop the service properly.
                desktop.request_quit()
    finally:
        instance.release()
        loop.close()
