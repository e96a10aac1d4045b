"""The branches of the code that run on Windows and macOS, exercised here on Linux (make test also
type-checks app/ for each platform: mypy --platform win32 and darwin)."""

from __future__ import annotations

import asyncio
import fcntl
import os
import resource
import signal
from pathlib import Path

import platformdirs.macos
import pytest

from app import durable, main, paths
from app.engine.parent.server import crash, ended
from app.server import gate
from app.store import db
from tests.conftest import Headless


def test_a_crash_is_told_from_a_kill_by_its_signal_or_by_its_windows_exception_code() -> None:
    assert crash(-signal.SIGSEGV) == "SIGSEGV" and crash(-signal.SIGABRT) == "SIGABRT"
    assert crash(-signal.SIGKILL) is None and crash(-signal.SIGTERM) is None and crash(1) is None
    # Windows: the NTSTATUS of the exception is the exit code, however it was read (unsigned or not).
    assert crash(0xC0000005, "win32") == "access violation (0xC0000005)"
    assert crash(0xC0000005 - (1 << 32), "win32") == "access violation (0xC0000005)"
    assert crash(0xC0000409, "win32") == "fail fast (0xC0000409)"  # abort(), a GGML_ASSERT
    assert crash(1, "win32") is None and crash(0, "win32") is None
    assert ended(-signal.SIGKILL) == "killed by SIGKILL" and ended(3) == "ended with exit code 3"


def test_the_connection_cap_has_no_descriptor_limit_to_keep_to_on_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    read = gate._descriptors.__wrapped__  # the limit as read at start, not the cached one
    assert read() < 1 << 30  # Linux: the soft limit
    monkeypatch.setattr("sys.platform", "win32")
    assert read() == 1 << 30


def test_on_windows_a_stop_signal_reaches_the_loop_through_python_s_own_handler(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows' Proactor loop has no add_signal_handler: Ctrl+C and SIGTERM still stop the app."""
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    monkeypatch.setattr("sys.platform", "win32")
    loop = asyncio.new_event_loop()
    monkeypatch.setattr(loop, "add_signal_handler", None)  # as on Windows: none to call
    try:
        stop = asyncio.Event()
        main.stop_on_signals(loop, stop)
        signal.raise_signal(signal.SIGTERM)
        loop.run_until_complete(asyncio.wait_for(stop.wait(), 5))
        assert stop.is_set()
    finally:
        for sig, handler in kept.items():
            signal.signal(sig, handler)
        loop.close()


def test_a_low_open_file_limit_is_raised_at_start_as_far_as_the_hard_one_lets_it(headless: Headless) -> None:
    """macOS starts an app with 256 open files: the server's connection cap would be 64."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    headless.start(preexec=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
    assert headless.proc is not None
    limits = Path(f"/proc/{headless.proc.pid}/limits").read_text()
    soft = int(next(line for line in limits.splitlines() if line.startswith("Max open files")).split()[3])
    assert soft == (main.FILES if hard == resource.RLIM_INFINITY else min(main.FILES, hard)), limits


def test_the_per_user_folders_are_the_platform_s_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """platformdirs' folders: Linux's as they always were (XDG), macOS' and Windows' own."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert paths.default_data_dir() == tmp_path / "data" / "lmsp-tray"
    assert paths.default_log_dir() == tmp_path / "state" / "lmsp-tray" / "log"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert paths.default_data_dir() == Path.home() / ".local" / "share" / "lmsp-tray"
    mac = platformdirs.macos.MacOS(paths.APP_NAME, appauthor=False)
    assert mac.user_data_path == Path.home() / "Library" / "Application Support" / "lmsp-tray"
    assert mac.user_log_path == Path.home() / "Library" / "Logs" / "lmsp-tray"


def test_on_macos_a_sync_reaches_the_medium(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """macOS' fsync stops at the drive's cache: files and folders ask for F_FULLFSYNC (plain fsync
    where the file system refuses it), and SQLite for its `fullfsync`."""
    asked: list[str] = []
    monkeypatch.setattr("sys.platform", "darwin")
    monkeypatch.setattr(fcntl, "F_FULLFSYNC", 51, raising=False)  # macOS' number; Linux has none

    def full(fd: int, command: int) -> int:
        asked.append("F_FULLFSYNC" if command == 51 else str(command))
        if len(asked) > 2:
            raise OSError(45, "Operation not supported")  # a file system without it
        return 0

    monkeypatch.setattr(fcntl, "fcntl", full)
    monkeypatch.setattr(os, "fsync", lambda fd: asked.append("fsync"))
    durable.write(tmp_path / "a.json", "{}")  # the file, then its folder
    assert asked == ["F_FULLFSYNC", "F_FULLFSYNC"] and (tmp_path / "a.json").read_text() == "{}"
    durable.sync_dir(tmp_path)
    assert asked[2:] == ["F_FULLFSYNC", "fsync"]
    conn = db.connect(tmp_path / "lmsp.sqlite3")
    assert [conn.execute(f"PRAGMA {name}").fetchone()[0] for name in ("fullfsync", "checkpoint_fullfsync")] == [1, 1]


def test_on_windows_a_rename_writes_through_and_waits_for_a_file_held_open(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    monkeypatch.setattr("sys.platform", "win32")
    tries: list[tuple[str, str]] = []

    def held_twice(source: str, target: str) -> None:  # an indexer has the file open, then lets go
        tries.append((source, target))
        if len(tries) < 3:
            raise PermissionError(13, "The process cannot access the file")
        os.replace(source, target)

    monkeypatch.setattr(durable, "_move_file", held_twice)
    durable.write(tmp_path / "service.json", "new")
    assert (tmp_path / "service.json").read_text() == "new" and len(tries) == 3

    def always_held(source: str, target: str) -> None:
        tries.append((source, target))
        raise PermissionError(13, "The process cannot access the file")

    tries.clear()
    monkeypatch.setattr(durable, "_move_file", always_held)
    with pytest.raises(PermissionError):
        durable.write(tmp_path / "service.json", "newer")
    assert len(tries) == durable.RENAME_TRIES
    assert [p.name for p in tmp_path.iterdir()] == ["service.json"] and (tmp_path / "service.json").read_text() == "new"
