"""One app per data directory: a second launch asks the first to show its dashboard, then exits.

A QLocalServer named after the data directory (hashed: names have length limits) is the
lock. A stale socket left by a crash is detected by failing to connect, and removed.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from PySide6.QtCore import QObject, Signal
from PySide6.QtNetwork import QLocalServer, QLocalSocket

log = logging.getLogger(__name__)
SHOW = b"show\n"


def server_name(data_dir: Path) -> str:
    digest = hashlib.sha256(str(Path(data_dir).resolve()).encode()).hexdigest()[:16]
    return f"lmsp-tray-{digest}"


def notify_running(name: str, timeout_ms: int = 1000) -> bool:
    """Tell an instance listening on `name` to show itself. False if nobody listens."""
    socket = QLocalSocket()
    socket.connectToServer(name)
    if not socket.waitForConnected(timeout_ms):
        return False
    socket.write(SHOW)
    socket.flush()
    socket.waitForBytesWritten(timeout_ms)
    socket.disconnectFromServer()
    return True


class SingleInstance(QObject):
    show_requested = Signal()

    def __init__(self, data_dir: Path, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.name = server_name(data_dir)
        self._server = QLocalServer(self)
        self._server.setSocketOptions(QLocalServer.SocketOption.UserAccessOption)
        self._server.newConnection.connect(self._accept)
        self._clients: list[QLocalSocket] = []

    def claim(self) -> bool:
        """True if this process is now the instance; False if another one was told to show."""
        if notify_running(self.name):
            return False
        QLocalServer.removeServer(self.name)  # a socket file left behind by a crash
        if not self._server.listen(self.name):
            log.warning("single-instance lock unavailable: %s", self._server.errorString())
        return True

    def release(self) -> None:
        for socket in self._clients:
            socket.readyRead.disconnect(self._read)
            socket.abort()
        self._clients.clear()
        self._server.close()

    def _accept(self) -> None:
        while (socket := self._server.nextPendingConnection()) is not None:
            # Kept here until it disconnects; one slot reads whichever client has data.
            self._clients.append(socket)
            socket.readyRead.connect(self._read)
            socket.disconnected.connect(self._forget)
        self._read()

    def _read(self) -> None:
        for socket in self._clients:
            if socket.bytesAvailable() and SHOW.strip() in bytes(socket.readAll().data()):
                self.show_requested.emit()

    def _forget(self) -> None:
        for socket in [s for s in self._clients if s.state() == QLocalSocket.LocalSocketState.UnconnectedState]:
            self._read()  # what it said before hanging up still counts
            self._clients.remove(socket)
            socket.deleteLater()
