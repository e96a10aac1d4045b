"""The branches of the code that run on Windows and macOS, exercised here on Linux (make test also
type-checks app/ for each platform: mypy --platform win32 and darwin)."""

from __future__ import annotations

import asyncio
import resource
import signal
from pathlib import Path

import pytest

from app import main
from app.engine.parent.server import crash, ended
from app.server import gate
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
