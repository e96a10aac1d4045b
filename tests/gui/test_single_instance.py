"""One app per data directory: a second launch makes the first show its dashboard."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from PySide6.QtCore import QDir
from PySide6.QtNetwork import QLocalSocket

from app.gui.single_instance import SingleInstance, server_name
from tests.conftest import ROOT, Processes, kill_group

pytestmark = pytest.mark.gui


def test_second_launch_asks_the_first_to_show(qtbot, tmp_path: Path) -> None:
    first = SingleInstance(tmp_path / "data")
    assert first.claim()
    try:
        with qtbot.waitSignal(first.show_requested, timeout=10000):
            assert not SingleInstance(tmp_path / "data").claim()  # told the first; this one exits
        with qtbot.waitSignal(first.show_requested, timeout=10000):  # any client saying "show"
            client = QLocalSocket()
            client.connectToServer(first.name)
            assert client.waitForConnected(5000)
            client.write(b"show\n")
            client.flush()
        assert SingleInstance(tmp_path / "other").claim()  # another data dir is another app
    finally:
        first.release()
    assert SingleInstance(tmp_path / "data").claim()  # free again once the first is gone


def test_a_socket_left_by_a_crash_does_not_block_the_next_start(qtbot, tmp_path: Path) -> None:
    name = server_name(tmp_path / "data")
    probe = SingleInstance(tmp_path / "data")
    assert probe.claim()
    path = probe._server.fullServerName()
    probe.release()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)  # a socket file nobody listens on, as a killed app leaves it
    stale.close()
    assert Path(path).exists()
    again = SingleInstance(tmp_path / "data")
    assert again.name == name and again.claim()
    again.release()


CLAIMER = """
import sys
from PySide6.QtCore import QCoreApplication
from app.gui.single_instance import SingleInstance
app = QCoreApplication([])
instance = SingleInstance(sys.argv[1])
print("claimed" if instance.claim() else "refused", flush=True)
app.exec()
"""


def test_after_the_first_app_is_killed_the_next_start_claims_at_once(qtbot, tmp_path: Path, procs: Processes) -> None:
    """A real SIGKILL of the instance leaves its socket file behind; the next start takes over."""
    first = procs.popen([sys.executable, "-c", CLAIMER, str(tmp_path / "data")], cwd=ROOT,
                        stdout=subprocess.PIPE, text=True)
    assert first.stdout is not None and first.stdout.readline().strip() == "claimed"
    assert not SingleInstance(tmp_path / "data").claim()  # it is alive: it was told to show
    probe = SingleInstance(tmp_path / "data")
    kill_group(first)
    socket_file = Path(QDir.tempPath()) / server_name(tmp_path / "data")
    assert socket_file.exists(), "SIGKILL should leave the socket file behind"
    assert probe.claim()
    probe.release()
