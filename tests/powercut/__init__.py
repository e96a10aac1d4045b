"""The power-cut file system (fs.py over disk.py), as a test starts, cuts and remounts it.

`PowerCutMount(root, procs).mount()` serves root/disk at root/mnt from a process of its own
(started through the `procs` fixture, so it ends with the test); `cut(mode, seed)` cuts the power
and unmounts; `mount()` again serves what the disk kept. Nothing here can hang a test: every
wait has a timeout, and an unmount that does not finish is made lazy (`fusermount3 -uz`).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
FUSERMOUNT = shutil.which("fusermount3")


def available() -> str | None:
    """Why the power-cut file system cannot run here, or None if it can."""
    if FUSERMOUNT is None:
        return "no fusermount3 (Debian's fuse3)"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "no usable /dev/fuse"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as exc:  # OSError: no libfuse3 for its ctypes to load
        return f"mfusepy unusable: {exc}"
    return None


class PowerCutMount:
    def __init__(self, root: Path, procs: Any) -> None:
        self.backing, self.mnt, self.state = root / "disk", root / "mnt", root / "state"
        for folder in (self.backing, self.mnt, self.state):
            folder.mkdir(parents=True, exist_ok=True)
        self.procs = procs
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root / "powercut.log"
        self.cuts: list[dict[str, int]] = []

    def mount(self, timeout: float = 10.0) -> PowerCutMount:
        assert self.proc is None, "already mounted"
        with self.log.open("ab") as log:
            self.proc = self.procs.popen([sys.executable, "-m", "tests.powercut.fs", str(self.backing), str(self.mnt),
                                          str(self.state)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not os.path.ismount(self.mnt):
            assert self.proc.poll() is None, f"the power-cut file system exited: {self.log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"not mounted in {timeout}s: {self.log.read_text()[-2000:]}"
            time.sleep(0.02)
        return self

    def ask(self, request: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(timeout)
            sock.connect(str(self.state / "control.sock"))
            sock.sendall(json.dumps(request).encode() + b"\n")
            with sock.makefile("r") as answer:
                found: dict[str, Any] = json.loads(answer.readline())
                return found

    def cut_power(self, mode: str = "drop", seed: int = 0) -> dict[str, int]:
        """Cut the power: what was not synced is lost ("drop") or partly kept ("torn"); from now
        on every operation on the mount fails. What was lost, counted."""
        lost = self.ask({"cut": mode, "seed": seed})
        self.cuts.append(lost)
        return lost

    def cut(self, mode: str = "drop", seed: int = 0) -> dict[str, int]:
        """Cut the power and unmount; `mount()` then serves what the disk kept."""
        lost = self.cut_power(mode, seed)
        self.unmount()
        return lost

    def unmount(self) -> None:
        if self.proc is None:
            return
        assert FUSERMOUNT is not None
        done = subprocess.run([FUSERMOUNT, "-u", str(self.mnt)], capture_output=True, timeout=10)
        if done.returncode != 0:  # busy (a process still in it): detach now, gone when it lets go
            subprocess.run([FUSERMOUNT, "-uz", str(self.mnt)], capture_output=True, timeout=10)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        try:
            os.stat(self.mnt)
        except OSError:  # a dead mount ("Transport endpoint is not connected"): take it away
            subprocess.run([FUSERMOUNT, "-uz", str(self.mnt)], capture_output=True, timeout=10)
