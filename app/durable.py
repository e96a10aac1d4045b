"""Files that outlast a power cut: the one way the app writes a file outside SQLite.

A write is only on the disk once it is fsynced, and a new name (a file created, a rename) only
once its folder is: without both, a power cut or a kernel panic may leave the old file, an empty
one, or none, even though the program saw every call succeed (tests/powercut/ shows it). So a
file is written to a temporary name beside it, fsynced, renamed over the old one and its folder
fsynced: after a cut it is the old file or the new one, whole, never a mix or nothing.

Per platform (README: What survives what): on macOS fsync leaves the bytes in the drive's own
cache, so `fsync` asks for F_FULLFSYNC (as SQLite's `fullfsync`, which app/store/db.py turns on
there); on Windows a folder cannot be fsynced (NTFS logs its names), a rename is asked to write
through, and one that another program holds open for a moment (an indexer, an antivirus) is tried
again, as pip does.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

RENAME_TRIES = 10  # Windows: a rename another program blocks, tried this often, RENAME_WAIT apart
RENAME_WAIT = 0.05


def booted_at() -> float | None:
    """When the machine booted (Linux); None where the system does not say. Bytes a killed process
    wrote without fsync are still there in the same boot (the page cache keeps them); from before
    it (a power cut), perhaps not. LMSP_BOOTED_AT stands for it where a test cuts the power
    without a reboot (tests/powercut/)."""
    forced = os.environ.get("LMSP_BOOTED_AT")
    if forced:
        return float(forced)
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            return next(float(line.split()[1]) for line in stat if line.startswith("btime "))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def fsync(fd: int) -> None:
    """Make what was written to `fd` last: on macOS F_FULLFSYNC (to the medium, past the drive's
    cache), or plain fsync where the file system has no such call."""
    if sys.platform == "darwin":
        import fcntl

        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
        except OSError:  # a file system without it (a network share): what fsync gives
            pass
    os.fsync(fd)


def sync_dir(folder: Path) -> None:
    """Make the names in `folder` (files created, renamed or removed in it) last. Windows has no
    such call (and no need: NTFS logs its names), so there it does nothing."""
    if sys.platform == "win32":
        return
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fsync(fd)
    finally:
        os.close(fd)


def write(path: Path, data: str | bytes, mode: int = 0o600) -> None:
    """Replace `path` with `data` (text as UTF-8), readable as `mode` says, as one step a power cut
    cannot split."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0), mode)
    try:
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view):]
            fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, mode)  # the umask may have taken bits `mode` asks for, or it was left by a killed run
        replace(tmp, path)
    except BaseException:  # the old file stays as it was, and no temporary one is left beside it
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def replace(source: Path, target: Path) -> None:
    """Rename `source` (already fsynced) over `target`, and make the new name last."""
    if sys.platform == "win32":
        _replace_on_windows(source, target)
    else:
        os.replace(source, target)
    sync_dir(target.parent)
    if source.parent != target.parent:
        sync_dir(source.parent)


def _replace_on_windows(source: Path, target: Path) -> None:
    """MoveFileEx with MOVEFILE_WRITE_THROUGH (it returns once the rename is on the disk), tried
    again while another program holds either file open without letting it be renamed."""
    for attempt in range(RENAME_TRIES):
        try:
            _move_file(str(source), str(target))
            return
        except PermissionError:
            if attempt == RENAME_TRIES - 1:
                raise
            time.sleep(RENAME_WAIT)


def _move_file(source: str, target: str) -> None:
    import ctypes

    replace_existing, write_through = 0x1, 0x8
    kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined,unused-ignore]
    if not kernel32.MoveFileExW(source, target, replace_existing | write_through):
        raise ctypes.WinError(ctypes.get_last_error())  # type: ignore[attr-defined,unused-ignore]


def remove(path: Path) -> None:
    """Delete `path` (if there) for good: a power cut does not bring it back."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
        sync_dir(path.parent)
