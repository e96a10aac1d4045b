"""One app per data directory: a second launch makes the first show its dashboard."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from PySide6.QtNetwork import QLocalSocket

from app.gui.single_instance import SingleInstance, server_name

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
