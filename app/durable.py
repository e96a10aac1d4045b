"""Files that outlast a power cut: the one way the app writes a file outside SQLite.

A write is only on the disk once it is fsynced, and a new name (a file created, a rename) only
once its folder is: without both, a power cut or a kernel panic may leave the old file, an empty
one, or none, even though the program saw every call succeed (tests/powercut/ shows it). So a
file is written to a temporary name beside it, fsynced, renamed over the old one and its folder
fsynced: after a cut it is the old file or the new one, whole, never a mix or nothing.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path


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


def sync_dir(folder: Path) -> None:
    """Make the names in `folder` (files created, renamed or removed in it) last. Windows has no
    such call (and no need: NTFS logs its names), so there it does nothing."""
    if sys.platform == "win32":
        return
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
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
        view = memoryview(raw)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    os.chmod(tmp, mode)  # the umask may have taken bits `mode` asks for, or it was left by a killed run
    replace(tmp, path)


def replace(source: Path, target: Path) -> None:
    """Rename `source` (already fsynced) over `target`, and make the new name last."""
    os.replace(source, target)
    sync_dir(target.parent)
    if source.parent != target.parent:
        sync_dir(source.parent)


def remove(path: Path) -> None:
    """Delete `path` (if there) for good: a power cut does not bring it back."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
        sync_dir(path.parent)
