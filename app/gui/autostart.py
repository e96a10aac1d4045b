"""Start at login: on Linux an XDG autostart entry; other platforms are not supported yet."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from app import durable, paths

SUPPORTED = sys.platform.startswith("linux")
UNSUPPORTED_REASON = "Not available on this platform yet"
TEMPLATE = "lmsp-tray-autostart.desktop"  # in app/resources/


def entry_path() -> Path:
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "autostart" / "lmsp-tray.desktop"


def enabled() -> bool:
    return SUPPORTED and entry_path().exists()


def command(data_dir: Path | None) -> str:
    """How to start this very installation: the installed script, or this Python on the source tree."""
    script = _script()
    args = [str(script)] if script else [sys.executable, "-m", "app"]
    if paths.FROZEN:  # a built app: the executable is the app
        args = [sys.executable]
    if data_dir is not None and data_dir != paths.default_data_dir():
        args += ["--data-dir", str(data_dir)]
    return " ".join(_quote(a) for a in args)


def _script() -> Path | None:
    """The installed launcher of the Python running now (a venv's bin/ is rarely on PATH at login)."""
    beside = Path(sys.executable).with_name("lmsp-tray")
    if beside.exists():
        return beside
    found = shutil.which("lmsp-tray")
    return Path(found) if found else None


def _quote(arg: str) -> str:
    """Quoting as the Desktop Entry spec wants it for Exec (not shell quoting)."""
    arg = arg.replace("%", "%%")
    if arg and all(c.isalnum() or c in "/-._=+:,%" for c in arg):
        return arg
    quoted = '"' + "".join("\\" + c if c in '"`$\\' else c for c in arg) + '"'
    return quoted.replace("\\", "\\\\")  # Exec is also a string value: its backslashes escape again


def enable(data_dir: Path | None = None) -> Path:
    text = paths.resource(TEMPLATE).read_text(encoding="utf-8")
    lines = [f"Exec={command(data_dir)}" if line.startswith("Exec=") else line for line in text.splitlines()]
    if _script() is None and not paths.FROZEN:
        # `python -m app` must start in the folder that holds the app package (the source tree)
        lines.append(f"Path={Path(__file__).resolve().parents[2]}")
    target = entry_path()
    durable.write(target, "\n".join(lines) + "\n")
    return target


def disable() -> None:
    entry_path().unlink(missing_ok=True)
